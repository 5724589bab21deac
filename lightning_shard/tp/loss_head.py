"""``LossParallelHead``: the LM head style of ``auto_tp_plan(..., loss_parallel=True)``.

Vocabulary-sharded DTensor logits inside ``loss_parallel()`` (for a cross-entropy that never gathers them), full
plain logits outside it (and inside ``full_logits()``), as the head gives without loss parallelism.

Why not torch's ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` alone: its DTensor logits
escape every step that does not compute a loss inside the context. ``trainer.predict`` returned each rank's
vocabulary shard wrapped in a DTensor where the user expects the logits, a model scored in a plain loop after
``fit`` handed DTensors to plain-tensor code, and Hugging Face ``generate`` failed on them.

Example::

    parallelize_module(model, tp_mesh, {"lm_head": LossParallelHead()})
    with loss_parallel():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))   # sharded logits
    logits = model(x)                                                     # a plain tensor, (B, T, V)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import DTensor, Placement, Replicate, Shard
from lightning_shard.tp.loss import sharded_logits_wanted
from lightning_shard.tp.style import ColwiseParallel, _local, _redistribute

__all__ = ["LossParallelHead"]


class LossParallelHead(ColwiseParallel):
    """``ColwiseParallel`` with ``Shard(-1)`` DTensor output inside ``loss_parallel()``; outside it (or inside
    ``full_logits()``) the output is all-gathered on the vocabulary dim and returned as a plain tensor.

    Example: ``{"lm_head": LossParallelHead(input_layouts=Shard(1))}`` after a sequence-parallel final norm.
    """

    def __init__(self, *, input_layouts: Placement | None = None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=Shard(-1), use_local_output=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(_gather_outside_loss_parallel)  # after the style's own output hook
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(input_layouts={self.input_layouts})"


def _gather_outside_loss_parallel(module: nn.Module, inputs: Any, out: Any) -> Any:
    if not isinstance(out, DTensor) or sharded_logits_wanted():
        return out
    return _local(_redistribute(out, Replicate()))
