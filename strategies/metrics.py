"""torchmetrics metrics under tensor parallelism: synchronise over the data-parallel ranks, not the world.

A torchmetrics ``Metric`` built without a ``process_group`` gathers its states from every rank when it
computes (``self.log(name, metric)`` at epoch end, ``metric.compute()``). The ranks of one tensor-parallel group
see the same batch, so over the world each data-parallel replica's states are counted ``tensor_parallel_size``
times: a ``SumMetric`` of the samples seen reads 32 instead of 16 under TP 2, a ``CatMetric`` holds every
value twice (ratios such as accuracy or a mean happen to survive). The strategy gives every metric of the
LightningModule that has neither a ``process_group`` nor a ``dist_sync_fn`` of its own
:func:`gather_over_data_parallel` as its ``dist_sync_fn``, so its states count each sample once.

Why a sync function and not ``metric.process_group = group``: a process group cannot be pickled or deep-copied,
and torchmetrics deep-copies metrics (``MetricTracker.increment()``, ``MetricCollection.clone()``), which then
raised ``TypeError: cannot pickle 'ProcessGroup' object``. A module-level function copies by reference and
reads the group the strategy set last (:func:`set_data_parallel_group`; ``None``, the world, without TP).

Example::

    set_data_parallel_group(mesh["data_parallel"].get_group())
    named = sync_metrics_over_data_parallel(lightning_module)
    # ["seen", "val_metrics.MeanMetric"]: the metrics now synchronised over the data-parallel ranks
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["gather_over_data_parallel", "set_data_parallel_group", "sync_metrics_over_data_parallel"]

# The group gather_over_data_parallel gathers over (None: the world). One strategy runs per process at a time;
# every setup and loop start sets it, so a metric kept from an earlier Trainer follows the current mesh.
_data_parallel_group: dist.ProcessGroup | None = None


def set_data_parallel_group(group: dist.ProcessGroup | None) -> None:
    """The group :func:`gather_over_data_parallel` gathers over (``None``: the world).

    Example: ``set_data_parallel_group(mesh["data_parallel"].get_group())``.
    """
    global _data_parallel_group
    _data_parallel_group = group


def gather_over_data_parallel(result: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """torchmetrics' ``gather_all_tensors`` over ``group`` if given, else over the data-parallel group.

    Example: ``torchmetrics.SumMetric(dist_sync_fn=gather_over_data_parallel)``.
    """
    from torchmetrics.utilities.distributed import gather_all_tensors

    return gather_all_tensors(result, group if group is not None else _data_parallel_group)


def sync_metrics_over_data_parallel(module: nn.Module) -> list[str]:
    """Give every torchmetrics ``Metric`` in ``module`` (submodules, including those of a ``MetricCollection``
    or ``nn.ModuleDict``) without a ``process_group`` or ``dist_sync_fn`` of its own
    :func:`gather_over_data_parallel` as its ``dist_sync_fn``; returns the names of the metrics that use it.

    Example: ``sync_metrics_over_data_parallel(lightning_module)``.
    """
    torchmetrics = sys.modules.get("torchmetrics")  # not imported: the module holds no metric
    if torchmetrics is None:
        return []
    named = []
    for name, metric in module.named_modules():
        if not isinstance(metric, torchmetrics.Metric) or metric.process_group is not None:
            continue  # the user's own group
        if metric.dist_sync_fn not in (None, gather_over_data_parallel):
            continue  # the user's own sync function
        metric.dist_sync_fn = gather_over_data_parallel
        named.append(name)
    return named
