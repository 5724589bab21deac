"""Hugging Face ``generate`` under tensor parallelism: one random stream per TP group, and the full logits under
``loss_parallel=True``.

* Sampling (``do_sample=True``) draws each next token on every rank. The ranks of a tensor-parallel group must draw
  the same token, or their next forwards run on different sequences while the collectives mix them (no error, a
  wrong result). ``generate`` first gives the TP group its first rank's random state
  (``lightning_shard.tp.input_check.sync_rng_states``, one small all-reduce), as the strategy does before every
  training step: a seed set per rank inside a ``predict_step`` (``torch.manual_seed(seed + rank)``) had the ranks
  sample different tokens.
* Validation and test steps run inside ``loss_parallel()``, where the LM head returns vocabulary-sharded DTensor
  logits for the loss. ``generate`` consumes the logits as plain tensors (``argmax``, then arithmetic with its own
  plain tensors), so in a ``validation_step`` it failed with "got a plain torch.Tensor ... mixed with DTensor
  arguments". It runs inside ``lightning_shard.tp.full_logits()``, where the head gathers them, as without loss
  parallelism; ``generate`` keeps only the last position's logits by default, so the gather is small.

Example::

    wrapped = wrap_generate(lightning_module, tp_group, device, full_logits=True)   # ["model (LlamaForCausalLM)"]
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["wrap_generate"]


def wrap_generate(
    model: nn.Module, tp_group: dist.ProcessGroup, device: torch.device, *, full_logits: bool
) -> list[str]:
    """Wrap the ``generate`` method of every Hugging Face generation model in ``model`` (a module with ``generate``
    and ``prepare_inputs_for_generation``) as the module docstring says; returns their names."""
    wrapped = []
    for name, module in model.named_modules():
        generate = getattr(module, "generate", None)
        if not callable(generate) or not hasattr(module, "prepare_inputs_for_generation"):
            continue
        if getattr(generate, "_ls_wrapped", False):
            continue
        module.generate = _wrapped(generate, tp_group, device, full_logits)
        wrapped.append(f"{name or 'the model'} ({type(module).__name__})")
    return wrapped


def _wrapped(generate, tp_group: dist.ProcessGroup, device: torch.device, full: bool):
    from lightning_shard.tp import full_logits
    from lightning_shard.tp.input_check import sync_rng_states

    @functools.wraps(generate)
    def run(*args, **kwargs):
        sync_rng_states(tp_group, device)
        with full_logits() if full else contextlib.nullcontext():
            return generate(*args, **kwargs)

    run._ls_wrapped = True
    return run
