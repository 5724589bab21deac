"""Hugging Face ``generate`` under ``loss_parallel=True``: it runs inside ``lightning_shard.tp.full_logits()``.

Validation and test steps run inside ``loss_parallel()``, where the LM head returns vocabulary-sharded DTensor
logits for the loss. ``generate`` consumes the logits as plain tensors (``argmax``, then arithmetic with its own
plain tensors), so in a ``validation_step`` it failed with "got a plain torch.Tensor ... mixed with DTensor
arguments". Inside ``full_logits()`` the head gathers them, as without loss parallelism; ``generate`` keeps only
the last position's logits by default, so the gather is small.

Example::

    wrapped = generate_with_full_logits(lightning_module)   # ["model (LlamaForCausalLM)"]
"""

from __future__ import annotations

import functools

from torch import nn

__all__ = ["generate_with_full_logits"]


def generate_with_full_logits(model: nn.Module) -> list[str]:
    """Make the ``generate`` method of every Hugging Face generation model in ``model`` (a module with
    ``generate`` and ``prepare_inputs_for_generation``) run inside ``full_logits()``; returns their names."""
    wrapped = []
    for name, module in model.named_modules():
        generate = getattr(module, "generate", None)
        if not callable(generate) or not hasattr(module, "prepare_inputs_for_generation"):
            continue
        if getattr(generate, "_ls_full_logits", False):
            continue
        module.generate = _with_full_logits(generate)
        wrapped.append(f"{name or 'the model'} ({type(module).__name__})")
    return wrapped


def _with_full_logits(generate):
    from lightning_shard.tp import full_logits

    @functools.wraps(generate)
    def run(*args, **kwargs):
        with full_logits():
            return generate(*args, **kwargs)

    run._ls_full_logits = True
    return run
