"""``compile_fsdp_units``: ``torch.compile`` each FSDP unit's forward after sharding, as torchtitan compiles
each transformer block.

Only the unit's ``forward`` is compiled; its FSDP hooks (all-gather before, free after, the backward hooks)
stay outside the graph and run eagerly, so every unit is one graph with no break (``fullgraph=True`` works
for a block whose own code compiles fully). Compiling the whole model instead (``torch.compile(model)``, or
``fabric.setup(torch.compile(model))``) also works: it breaks the graph at each unit's boundary, where the
hooks run (``lightning_shard.fsdp.state``).

Example::

    compile_fsdp_units(model)                      # after fully_shard
    compile_fsdp_units(model, {"mode": "max-autotune-no-cudagraphs"})
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_shard.fsdp import FSDPModule


def check_no_tensor_parallelism(tensor_parallel_size: int | str, tp_plan: Any) -> None:
    """Refuse ``compile_fsdp_units`` with tensor parallelism, before anything is sharded.

    Why: under TP a unit's forward computes on the engine's DTensors (its weights are TP shards), which
    ``torch.compile`` cannot trace: dynamo failed inside the first step with an ``InternalTorchDynamoError``
    ("'DTensor' object has no attribute '_spec'") that named neither the option nor a fix. Under FSDP alone the
    forward sees plain, gathered parameters and compiles.
    """
    if tp_plan is None or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 2:
        return
    raise ValueError(
        f"ShardFSDPTPStrategy: compile_fsdp_units with tensor_parallel_size={tensor_parallel_size}: torch.compile "
        "cannot trace the engine's DTensors, which a tensor-parallel unit's forward computes on; use "
        "compile_fsdp_units=False with tensor parallelism, or tensor_parallel_size=1 (FSDP only) to compile the units"
    )


def compile_fsdp_units(model: nn.Module, options: dict[str, Any] | None = None) -> list[str]:
    """Replace the ``forward`` of every FSDP unit below the root by its ``torch.compile``-d version (in place,
    idempotent); ``options`` are ``torch.compile`` keyword arguments. Returns the names of the units compiled.

    Example: ``compile_fsdp_units(model)`` -> ``["blocks.0", "blocks.1"]``.
    """
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"compile_fsdp_units: options={options!r} must be a dict of torch.compile arguments or None")
    compiled = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, FSDPModule) or getattr(module, "_ls_compiled", False):
            continue
        # An instance attribute: nn.Module.__call__ runs the hooks, then this compiled function.
        module.forward = torch.compile(module.forward, **(options or {}))
        module._ls_compiled = True
        compiled.append(name)
    return compiled
