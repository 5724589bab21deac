"""Tensor parallelism on our DTensor: parallel styles, ``parallelize_module``, ``loss_parallel``, ``auto_tp_plan``.

Example::

    tp_mesh = mesh["tensor_parallel"]
    plan, summary = auto_tp_plan(model, tp_mesh, return_summary=True)
    print("\\n".join(summary))
    parallelize_module(model, tp_mesh, plan)
"""

from lightning_shard.tp.api import parallelize_module
from lightning_shard.tp.auto_plan import auto_tp_plan
from lightning_shard.tp.coverage import TPCoverage, tp_coverage
from lightning_shard.tp.loss import full_logits, loss_parallel
from lightning_shard.tp.loss_head import LossParallelHead
from lightning_shard.tp.style import (
    ColwiseParallel,
    DivideAttributes,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "parallelize_module",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "DivideAttributes",
    "auto_tp_plan",
    "loss_parallel",
    "full_logits",
    "LossParallelHead",
    "tp_coverage",
    "TPCoverage",
]
