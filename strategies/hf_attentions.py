"""Hugging Face ``output_attentions`` under tensor parallelism: the attention weights gathered over the heads.

Each TP rank computes the attention of its own heads, so a sharded attention module returns weights
``(B, heads / tp, T, S)``; Hugging Face collected them as they were, and ``output_attentions=True`` returned each
rank's own heads with no error. A forward hook on the modules Hugging Face records attentions from (its
``_can_record_outputs``) all-gathers the weights on the head dim (heads are split in order, rank 0 first), only
while Hugging Face collects them, so other forwards pay nothing.

Example::

    hooked = gather_attention_weights(lightning_module, plan, mesh["tensor_parallel"])
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import DTensor, Shard
from lightning_shard.tp.style import ColwiseParallel

__all__ = ["gather_attention_weights"]


def gather_attention_weights(model: nn.Module, plan, tp_mesh: DeviceMesh) -> list[str]:
    """Hook every module of ``model`` from which Hugging Face records attention weights (its ``_can_record_outputs``
    target classes for ``*attentions``) and whose heads the TP ``plan`` splits; returns their names."""
    from lightning_shard.tp.api import _resolve

    # Heads are split where a projection inside keeps its column shard (q/k/v ColwiseParallel); a fused qkv whose
    # output is gathered (GPT-2's c_attn) leaves the attention math, and its weights, whole on every rank.
    split = {fqn for fqn, _, style in _resolve(model, plan) if _keeps_column_shard(style)}
    targets = _attention_recorders(model)
    hooked = []
    for fqn, module in model.named_modules():
        by_index: dict[int, set[str]] = {}
        for cls, key, index, layer in targets:
            if isinstance(module, cls) and (layer is None or f".{layer.strip('.')}." in f".{fqn}."):
                by_index.setdefault(index, set()).add(key)
        if not by_index or not any(p.startswith(f"{fqn}.") for p in split):
            continue
        for index, keys in by_index.items():  # one hook per output: GPT-2 records "attentions" and
            # "cross_attentions" from the same class, told apart by layer name
            hook = functools.partial(_gather_weights, keys=frozenset(keys), index=index, tp_mesh=tp_mesh)
            module.register_forward_hook(hook)
        hooked.append(fqn)
    return hooked


def _keeps_column_shard(style) -> bool:
    return isinstance(style, ColwiseParallel) and style.output_layouts[0].is_shard()


def _attention_recorders(model: nn.Module) -> list[tuple[type, str, int, str | None]]:
    """(module class, output key, output index, layer name) for each attention output Hugging Face records."""
    found = []
    for module in model.modules():
        recorded = getattr(type(module), "_can_record_outputs", None)
        if not isinstance(recorded, dict):  # none, or a property computed per instance (left alone)
            continue
        for key, specs in recorded.items():
            if "attentions" not in key:
                continue
            for spec in specs if isinstance(specs, list) else [specs]:
                cls = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
                entry = (cls, key, getattr(spec, "index", 1), getattr(spec, "layer_name", None))
                if isinstance(cls, type) and entry not in found:  # a model and its inner model list the same
                    found.append(entry)
    return found


def _gather_weights(module: nn.Module, args, output, *, keys: frozenset, index: int, tp_mesh: DeviceMesh):
    if not (isinstance(output, tuple) and len(output) > index and isinstance(output[index], torch.Tensor)):
        return output
    weights = output[index]
    if isinstance(weights, DTensor) or weights.ndim != 4 or not any(_collected(key) for key in keys):
        return output
    full = DTensor.from_local(weights, tp_mesh, [Shard(1)], run_check=False).full_tensor()
    return (*output[:index], full, *output[index + 1 :])


def _collected(key: str) -> bool:
    """True while a Hugging Face forward collects ``key`` (``output_attentions=True``)."""
    collector = _active_collector()
    if collector is None:  # a transformers without the collector: assume collected (correct, one gather more)
        return True
    collected = collector.get()
    return collected is not None and key in collected


@functools.cache
def _active_collector():
    """transformers' context variable of the outputs being collected (looked up once: the hook runs at every
    attention forward), or ``None`` where it has none."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector
