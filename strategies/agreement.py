"""Check that the ranks agree on what must be the same everywhere: the strategy's arguments, the model's
structure, the optimizers and the fit's loop settings.

A multi-node job can start ranks that do not agree: a stale checkout on one node, a ``configure_model`` that
branches on the rank or an environment variable, a per-node config file. Nothing in FSDP or TP pairs tensors by
name: the broadcast of rank 0's values, the meshes' groups and every all-gather and reduce-scatter pair up by
call order and size. Ranks that disagree then hang, crash in the backend with a message naming no parameter,
or (same sizes, another layout or another learning rate) train a model no single configuration describes.

This module says what is compared and the fix for each section; ``lightning_shard.agreement`` compares (one
small all-gather of digests per check) and raises the same ``RanksDisagreeError`` on every rank, before any
collective that depends on the difference.

Example::

    check_ranks_agree({"parameters": parameter_entries(model)}, when="before the model is sharded")
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_shard import agreement
from lightning_shard.agreement import RanksDisagreeError

__all__ = [
    "RanksDisagreeError",
    "buffer_entries",
    "check_ranks_agree",
    "describe_choice",
    "module_entries",
    "optimizer_entries",
    "parameter_entries",
    "trainable_entries",
    "trainer_entries",
]

# Per section: what to do about a difference there.
FIXES = {
    "strategy arguments": "pass the same ShardFSDPTPStrategy arguments on every rank (per-node config files, command "
    "lines and environment variables feed them)",
    "Trainer settings": "pass the same Trainer arguments on every rank (per-node config files, command lines)",
    "parameters": "build the same model on every rank: __init__ and configure_model must not depend on the rank, the "
    "node, an environment variable or an unseeded random choice; freeze (requires_grad_) and cast (.half()) "
    "parameters on every rank alike; run the same code checkout on every node",
    "buffers": "register the same buffers (names, shapes, dtypes) on every rank",
    "modules": "build the model from the same classes on every rank (the same code checkout on every node)",
    "optimizers": "configure the same optimizers on every rank (type, param groups and hyper-parameters such as lr, "
    "betas, weight_decay, and the same learning-rate schedulers); under FSDP each rank updates its own shard, so "
    "ranks with different hyper-parameters train a model no single configuration describes",
    "trainable parameters": "freeze and unfreeze parameters on every rank alike (a callback that calls "
    "requires_grad_ under a rank condition, e.g. @rank_zero_only, freezes one rank's shards only)",
}


def check_ranks_agree(sections: dict[str, dict[str, str]], *, when: str, who: str = "shard_fsdp_tp") -> None:
    """``lightning_shard.agreement.check_ranks_agree`` over every rank, with the strategy's fixes per section.

    Example: ``check_ranks_agree({"Trainer settings": trainer_entries(trainer)}, when="at the first step")``.
    """
    agreement.check_ranks_agree(sections, when=when, fixes=FIXES, who=who)


def _tensor(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def parameter_entries(model: nn.Module) -> dict[str, str]:
    """Every parameter in registration order (tied ones under each name): shape, dtype and whether it trains."""
    params = model.named_parameters(remove_duplicate=False)
    return {name: f"{_tensor(p)} requires_grad={p.requires_grad}" for name, p in params}


def trainable_entries(model: nn.Module) -> dict[str, str]:
    """Whether each parameter trains, by name."""
    return {name: str(p.requires_grad) for name, p in model.named_parameters(remove_duplicate=False)}


def module_entries(model: nn.Module) -> dict[str, str]:
    """Every module's class by path: a class renamed or replaced on one node (a stale checkout) changes which
    modules ``fsdp_unit`` and the TP plan pick, and what the forward computes, with the same parameters."""
    return {name or "<root>": f"{type(m).__module__}.{type(m).__qualname__}" for name, m in model.named_modules()}


def buffer_entries(model: nn.Module) -> dict[str, str]:
    """Every buffer by name (not in registration order: the broadcast pairs buffers in name order, and a model may
    register them in an order that differs per process, such as Cohere Compass's rotary tables, one per entry of
    a ``set`` of layer types): shape and dtype."""
    return {name: _tensor(b) for name, b in sorted(model.named_buffers(remove_duplicate=False), key=lambda nb: nb[0])}


def optimizer_entries(
    model: nn.Module | None, optimizers: Iterable[Any], schedulers: Iterable[Any] = ()
) -> dict[str, str]:
    """Each optimizer's type and, per param group, its parameters (by name in ``model``, else by shape) and
    hyper-parameters; each learning-rate scheduler's type and settings."""
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    out: dict[str, str] = {}
    for i, optimizer in enumerate(optimizers):
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
        out[f"optimizer {i}"] = type(optimizer).__qualname__
        for j, group in enumerate(optimizer.param_groups):
            params = [names.get(id(p), _tensor(p)) for p in group["params"]]
            out[f"optimizer {i} group {j} params"] = repr(params)
            for key, value in sorted(group.items()):
                if key != "params":
                    out[f"optimizer {i} group {j} {key}"] = describe_choice(value)
    for i, scheduler in enumerate(schedulers):
        out[f"scheduler {i}"] = type(scheduler).__qualname__
        for key, value in sorted(_state(scheduler).items()):
            out[f"scheduler {i} {key}"] = describe_choice(value)
    return out


def _state(scheduler) -> dict:
    try:
        return scheduler.state_dict()
    except Exception:  # noqa: BLE001 - a scheduler of the user's without a state dict: its type is compared
        return {}


def describe_choice(choice: Any, depth: int = 0) -> str:
    """A strategy argument or a hyper-parameter as text that is the same on every rank for the same value:
    tensors (a capturable Adam's ``lr``) by their values (their ``repr`` names the rank's device), classes and
    functions by qualified name (a ``repr`` would hold their address), sets sorted, plans by module name and style."""
    if isinstance(choice, (str, int, float, bool, type(None))):
        return repr(choice)
    if isinstance(choice, torch.Tensor):
        return repr(choice.detach().cpu().tolist())
    if isinstance(choice, type) or (callable(choice) and hasattr(choice, "__qualname__")):
        return f"{getattr(choice, '__module__', '')}.{choice.__qualname__}"
    if depth > 6:  # deep enough to tell plans apart; a cycle stops here
        return type(choice).__qualname__
    if isinstance(choice, (set, frozenset)):
        return "{" + ", ".join(sorted(describe_choice(c, depth + 1) for c in choice)) + "}"
    if isinstance(choice, (list, tuple)):
        return "[" + ", ".join(describe_choice(c, depth + 1) for c in choice) + "]"
    if isinstance(choice, dict):
        items = sorted(choice.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{k!r}: {describe_choice(v, depth + 1)}" for k, v in items) + "}"
    fields = getattr(choice, "__dict__", None)
    if fields:  # a parallel style: its class and settings
        return f"{type(choice).__qualname__}({describe_choice(dict(fields), depth + 1)})"
    text = repr(choice)  # a placement (Shard(dim=0)); an object whose repr is its address by type only
    return type(choice).__qualname__ if " at 0x" in text else text


# The Trainer settings that change what the ranks compute together: an optimizer step taken on some ranks only,
# a gradient clipped on some ranks only (its norm is an all-reduce), a loop that runs more steps or validates at
# other times on some ranks.
TRAINER_SETTINGS = (
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "max_epochs",
    "max_steps",
    "min_epochs",
    "min_steps",
    "limit_train_batches",
    "limit_val_batches",
    "val_check_interval",
    "check_val_every_n_epoch",
)


def trainer_entries(trainer: Any) -> dict[str, str]:
    """The ``TRAINER_SETTINGS`` as the Trainer holds them now (a callback may have changed them since
    ``Trainer(...)``, e.g. ``GradientAccumulationScheduler``)."""
    return {name: repr(getattr(trainer, name, None)) for name in TRAINER_SETTINGS}
