"""torchmetrics metrics under tensor parallelism: synchronise over the data-parallel ranks, not the world.

A torchmetrics ``Metric`` built without a ``process_group`` gathers its states from every rank when it
computes (``self.log(name, metric)`` at epoch end, ``metric.compute()``). The ranks of one tensor-parallel group
see the same batch, so over the world each data-parallel replica's states are counted ``tensor_parallel_size``
times: a ``SumMetric`` of the samples seen reads 32 instead of 16 under TP 2, a ``CatMetric`` holds every
value twice (ratios such as accuracy or a mean happen to survive). The strategy points every metric of the
LightningModule that has no ``process_group`` of its own at the data-parallel group, so its states count each
sample once; a ``process_group`` the user passed is kept.

Example::

    named = sync_metrics_over(lightning_module, mesh["data_parallel"].get_group())
    # ["train_acc", "val_metrics.MeanMetric"]: the metrics now synchronised over the data-parallel ranks
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch import nn

__all__ = ["sync_metrics_over"]

# Marks a group the strategy set, so that a later call (another loop, another Trainer) may replace it.
_SET_BY_STRATEGY = "_shard_fsdp_tp_process_group"


def sync_metrics_over(module: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Set ``process_group = group`` on every torchmetrics ``Metric`` in ``module`` (submodules, including those of
    a ``MetricCollection`` or ``nn.ModuleDict``) whose group is unset or was set by an earlier call; returns
    their names. Metrics with a group of the user's own are left alone.

    Example: ``sync_metrics_over(lightning_module, mesh["data_parallel"].get_group())``.
    """
    torchmetrics = sys.modules.get("torchmetrics")  # not imported: the module holds no metric
    if torchmetrics is None:
        return []
    named = []
    for name, metric in module.named_modules():
        if not isinstance(metric, torchmetrics.Metric):
            continue
        if metric.process_group is not None and getattr(metric, _SET_BY_STRATEGY, None) is not metric.process_group:
            continue  # the user's own group
        metric.process_group = group
        setattr(metric, _SET_BY_STRATEGY, group)
        named.append(name)
    return named
