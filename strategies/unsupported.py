"""What cannot work on a sharded model, refused with an error naming the fix (on every rank, before any
collective could hang): Lightning callbacks that deep-copy the unsharded model or rename its parameters, and
the LightningModule's export methods.

Example: ``refuse_callbacks(lightning_module)`` in ``setup_environment``; ``refuse_exports(lightning_module)``
once the strategy has sharded it.
"""

from __future__ import annotations

import types
from typing import Any, NoReturn

from torch import nn

EXPORTS = ("to_torchscript", "to_onnx")


def refuse_callbacks(module: nn.Module) -> None:
    """Callbacks that cannot work on a sharded model raise here, on every rank before the process group exists,
    naming the fix (Lightning's FSDPStrategy refuses ``StochasticWeightAveraging`` too).

    ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) keep a deep copy of the
    LightningModule made before the strategy shards it (the whole model on every rank) and average it with the
    sharded parameters, which mixes full tensors with shards (``WeightAveraging`` would stop at the first
    update with a DTensor mixing error naming neither the callback nor the fix).

    ``ModelPruning`` prunes at an epoch's end, after sharding: ``torch.nn.utils.prune`` moves each pruned
    parameter to ``<name>_orig`` and turns ``<name>`` into a plain attribute, so the FSDP unit's next forward no
    longer finds the parameter it shards (and the lottery-ticket reset assigns full tensors to the shards'
    ``.data``). Both stopped the run after a whole epoch of training, naming neither the callback nor the fix.
    """
    from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging

    trainer = getattr(module, "_trainer", None)
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, StochasticWeightAveraging):
            raise ValueError(
                "shard_fsdp_tp: the StochasticWeightAveraging callback does not support sharded models (it keeps "
                "an unsharded copy of the whole model on every rank); remove it. For a weight average, build a second "
                "copy of the model in configure_model (the strategy shards it like the first) and update it from "
                "the trained parameters under torch.no_grad(), e.g. avg.lerp_(param, 0.1), in on_train_batch_end"
            )
        if isinstance(callback, WeightAveraging):
            raise ValueError(
                f"shard_fsdp_tp: the {type(callback).__name__} callback (Lightning's WeightAveraging) does not "
                "support sharded models (it deep-copies the LightningModule before the strategy shards it, then "
                "averages that unsharded copy with the sharded parameters); remove it. For an EMA or SWA average, "
                "build torch.optim.swa_utils.AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.999)) in "
                "your LightningModule's __init__ (a submodule: the strategy shards it like the model), call its "
                "update_parameters(self.model) in on_train_batch_end, and optimize self.model.parameters() only"
            )
        if isinstance(callback, ModelPruning):
            raise ValueError(_PRUNING)


_PRUNING = (
    "shard_fsdp_tp: the ModelPruning callback does not support sharded models (it prunes after the strategy "
    "sharded the model, renaming each pruned parameter to '<name>_orig', which the FSDP units no longer find); "
    "remove it. Prune before sharding instead: torch.nn.utils.prune in your LightningModule's __init__ or "
    "configure_model, e.g. prune.l1_unstructured(module, 'weight', amount=0.5) (the strategy then shards "
    "'<name>_orig', and prune's hook applies '<name>_mask' in every forward); or prune an unsharded copy loaded "
    "with load_from_checkpoint in one process"
)


def refuse_exports(module: nn.Module) -> None:
    """Replace ``to_torchscript`` and ``to_onnx`` on this (sharded) LightningModule instance by a method raising
    ``RuntimeError`` with the fix.

    Scripting stopped at the FSDP state's annotation (``Unknown type annotation: 'FSDPState'``), tracing at the
    all-gather inside the trace (``Tried to trace ... ProcessGroup``), and an export that ran would hold shards,
    not the model's weights. The exports need the whole model in one process: load a checkpoint there.
    """
    for name in EXPORTS:
        setattr(module, name, types.MethodType(_refused_export(name), module))


def _refused_export(name: str):
    def refused(self: nn.Module, *args: Any, **kwargs: Any) -> NoReturn:
        from lightning_shard.fsdp import FSDPModule

        # the user's class, not the FSDP subclass fully_shard made of it
        cls = next(c for c in type(self).__mro__ if not issubclass(c, FSDPModule)).__name__
        raise RuntimeError(
            f"shard_fsdp_tp: {cls}.{name}() cannot export a sharded model (each rank holds only shards of its "
            "parameters, and its forward runs collectives); export from one plain process instead: save a "
            f"checkpoint (trainer.save_checkpoint(path) on every rank), then {cls}.load_from_checkpoint(path)."
            f"{name}(...) in a process without the strategy (after `import strategies`, a sharded checkpoint "
            "directory loads too)"
        )

    return refused


def warn_throughput_under_tp(module: nn.Module, tensor_parallel_size: int) -> None:
    """``ThroughputMonitor`` under tensor parallelism: a warning on rank 0 (its numbers are Lightning's to compute).

    Lightning's ``Throughput`` takes the world size as the number of model replicas: its global samples,
    batches and items per second are one rank's times the world size, and its global FLOPs the module's
    ``flops_per_batch`` times the world size. The ranks of one TP group train on the same batch, so under TP
    those global numbers count every sample ``tensor_parallel_size`` times, and a ``flops_per_batch`` measured
    on the whole model overstates each device's FLOPs (and MFU) by the same factor.
    """
    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    callbacks = getattr(getattr(module, "_trainer", None), "callbacks", None) or []
    if tensor_parallel_size == 1 or not any(isinstance(c, ThroughputMonitor) for c in callbacks):
        return
    rank_zero_warn(
        f"shard_fsdp_tp: ThroughputMonitor counts every rank as a model replica, but the {tensor_parallel_size} "
        f"ranks of a tensor-parallel group train on the same batch: its global samples/batches/items per second "
        f"are {tensor_parallel_size}x the samples trained. Divide them by {tensor_parallel_size} (the per-device "
        f"values are right); for FLOPs and MFU, set flops_per_batch to the whole model's FLOPs of one batch "
        f"divided by {tensor_parallel_size} (each rank computes its share), and read the global flops_per_sec "
        f"as is"
    )
