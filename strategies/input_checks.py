"""When the strategy checks that the ranks of a tensor-parallel group see the same batch.

Different batches on the ranks of one TP group train wrong with no error (see
``lightning_shard.tp.input_check``). The full check (a hash of every byte and an all-gather of fingerprints)
runs on the first batch of every epoch of each loop (``batch_idx == 0``): that catches a sampler or dataset
split by the global rank, and augmentation seeded per rank, from the first step. Every training batch after
it is checked by ``EveryBatchCheck``: a checksum of up to 4096 sampled elements per tensor, carried in the
all-reduce the strategy makes before every training batch anyway (``batch_counts.check_train_ends_alike``),
so it adds no collective and no device-to-host copy; that catches data that agrees on batch 0 only (a
dataset whose first rows every rank shares, augmentation that diverges after the first step). Evaluation
batches after the first, a ``training_step(dataloader_iter)`` and Fabric are checked on their first batch
only (they have no such collective); Fabric has no batch index: its module checks its first forward in
training mode and its first in eval mode.

Example::

    check = FirstBatchCheck()
    check(mesh, "training", (batch, 0), {})     # checks; (batch, 1) would not
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.loops.fetchers import _DataFetcherWrapper
from torch import nn

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tp.input_check import TPInputMismatchError, check_same_inputs, sampled_checksum

__all__ = ["EveryBatchCheck", "FirstBatchCheck", "check_first_forwards", "check_initialised_at_first_forward"]


def _tp_group(mesh: DeviceMesh | None):
    """The TP process group, or ``None`` when there is no TP (nothing to check)."""
    if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()) or mesh.size("tensor_parallel") == 1:
        return None
    return mesh.get_group("tensor_parallel")


class FirstBatchCheck:
    """Checks the batch of a ``*_step(batch, batch_idx, ...)`` call when ``batch_idx == 0`` (or, for steps
    called without an index, the first call of each loop; for a ``*_step(dataloader_iter)``, the batch of index 0
    when the step fetches it). Every rank of a TP group makes the same calls, so they all reach the collective
    together.

    Example: ``FirstBatchCheck()(strategy.device_mesh, "validation", (batch, 0), {})``.
    """

    def __init__(self) -> None:
        self._loops_seen: set[str] = set()

    def __call__(self, mesh: DeviceMesh | None, loop: str, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """Check the step's batch if it is its loop's first; returns the step's ``(args, kwargs)``, where a
        ``dataloader_iter`` is replaced by one that checks the batch of index 0 when the step fetches it."""
        group = _tp_group(mesh)
        if group is None:
            return args, kwargs
        if args and isinstance(args[0], _DataFetcherWrapper):
            return (_CheckedDataloaderIter(args[0], group, loop), *args[1:]), kwargs
        self._check(group, loop, args, kwargs)
        return args, kwargs

    def _check(self, group, loop: str, args: tuple, kwargs: dict[str, Any]) -> None:
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        if isinstance(batch_idx, int):
            if batch_idx != 0:
                return
        elif loop in self._loops_seen:
            return
        self._loops_seen.add(loop)
        batch = args[0] if args else kwargs.get("batch")
        check_same_inputs(batch, group, what=f"{loop} batches (batch_idx {batch_idx})")


class EveryBatchCheck:
    """Every training batch, checked in the all-reduce the strategy makes anyway before each batch
    (``batch_counts.check_train_ends_alike``): each TP group gets two int64 slots, where its ranks put the
    batch's ``sampled_checksum`` ``c`` and ``-c``; under the max all-reduce the slots hold the group's largest
    checksum and minus its smallest, equal only when every rank of the group saw the same checksum. The other
    groups' slots start at a value below any checksum. When a group differs, its ranks run
    ``check_same_inputs`` (the full fingerprint, naming the tensor that differs) and the others raise too.

    Example: ``check = EveryBatchCheck(mesh)``; ``check.slots(batch, device)`` before, ``check.verify(...)`` after.
    """

    _EMPTY = -(1 << 62)

    def __init__(self, mesh: DeviceMesh) -> None:
        names = list(mesh.mesh_dim_names)
        tp_dim = names.index("tensor_parallel")
        coordinate = mesh.get_coordinate()
        others = [(coordinate[d], mesh.shape[d]) for d in range(mesh.ndim) if d != tp_dim]
        self.index, self.groups = 0, 1
        for position, size in others:  # this rank's TP group: its coordinates off the TP dim, row-major
            self.index, self.groups = self.index * size + position, self.groups * size
        self.group = mesh.get_group("tensor_parallel")

    def slots(self, batch: Any, device: torch.device) -> torch.Tensor:
        """This rank's slots: its group's pair holds the batch's checksum and its negative."""
        out = torch.full((2 * self.groups,), self._EMPTY, dtype=torch.int64, device=device)
        checksum = sampled_checksum(batch, device)
        out[2 * self.index] = checksum
        out[2 * self.index + 1] = -checksum
        return out

    def verify(self, reduced: torch.Tensor, batch: Any, batch_idx: int) -> None:
        """Raise ``TPInputMismatchError`` on every rank if any TP group's slots of the reduced vector differ."""
        pairs = reduced.view(-1, 2).tolist()
        differ = [g for g, (high, neg_low) in enumerate(pairs) if high != -neg_low]
        if not differ:
            return
        what = f"training batches (batch_idx {batch_idx}, the per-batch check)"
        if self.index in differ:
            check_same_inputs(batch, self.group, what=what)  # raises, naming the tensor that differs
        raise TPInputMismatchError(
            f"{what}: the ranks of tensor-parallel group(s) {differ} (of {self.groups}) were given different "
            "batches; every rank of a TP group must see the same batch (split the data by the data-parallel rank, "
            "trainer.strategy.distributed_sampler_kwargs, not by the global rank)"
        )


class _CheckedDataloaderIter(_DataFetcherWrapper):
    """The ``dataloader_iter`` of ``def training_step(self, dataloader_iter)`` (or an evaluation step's), whose
    ``next()`` checks the batch of index 0 of each epoch: the step fetches its batches itself, so the strategy
    never sees them, and a split by the global rank trained wrong under TP with no error. A subclass, so that
    Lightning's and the user's ``isinstance`` checks still hold."""

    def __init__(self, wrapper: _DataFetcherWrapper, group, loop: str) -> None:
        super().__init__(wrapper.data_fetcher)
        self._group, self._loop = group, loop

    def __next__(self):
        batch, batch_idx, dataloader_idx = super().__next__()
        if batch_idx == 0:
            what = f"{self._loop} batches (batch_idx 0, fetched from dataloader_iter)"
            check_same_inputs(batch, self._group, what=what)
        return batch, batch_idx, dataloader_idx


def check_first_forwards(module: nn.Module, mesh: DeviceMesh | None) -> None:
    """Fabric: check the inputs of ``module``'s first forward in training mode and its first in eval mode.

    Example: ``check_first_forwards(model, strategy.device_mesh)`` after sharding ``model``.
    """
    group = _tp_group(mesh)
    if group is None:
        return
    modes_seen: set[bool] = set()

    def pre_forward(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if mod.training in modes_seen:
            return
        modes_seen.add(mod.training)
        mode = "training" if mod.training else "eval"
        check_same_inputs((args, kwargs), group, what=f"inputs to the first forward in {mode} mode")
        if len(modes_seen) == 2:
            handle.remove()

    handle = module.register_forward_pre_hook(pre_forward, with_kwargs=True)


def check_initialised_at_first_forward(module: nn.Module, unset: list[str]) -> None:
    """Fabric: before ``module``'s first forward (after the user had the chance to load a checkpoint), raise on
    every rank if a tensor built on meta still has no value (``strategies.parallelize.check_initialised``).

    Example: ``check_initialised_at_first_forward(model, parallelize.materialize(model, device))``.
    """
    from strategies.parallelize import check_initialised

    def pre_forward(mod: nn.Module, args: tuple) -> None:
        handle.remove()
        check_initialised(mod, unset, who="shard_fsdp_tp (Fabric)")

    handle = module.register_forward_pre_hook(pre_forward)
