"""Every rank must run the same number of training batches: a check, one batch ahead, that says when they do not.

A sharded model's forward runs collectives (FSDP all-gathers, TP all-reduces) on every rank, so a rank with
one batch more than another waits in its forward for a partner that has left the epoch: a hang under NCCL,
a collective mismatch or a hang under gloo. The ranks' batch counts differ when the data is split by the user
(an ``IterableDataset`` sharding itself, a sampler of the user's with ``use_distributed_sampler=False``) into
unequal parts; Lightning's own ``DistributedSampler`` pads them equal.

A length-less iterable cannot be counted ahead, but Lightning's data fetcher looks one batch ahead and knows
whether the current batch is a rank's last. Before each training batch the ranks compare "the epoch (or fit)
ends after this batch" (one max all-reduce of two integers, beside the sigterm broadcast Lightning makes at
every step); when they disagree, every rank raises at once, before the forward that would hang.

Evaluation and prediction compare the sized dataloaders' batch counts before the first batch (the strategy's
``_check_batch_counts_alike``); a length-less one is compared batch by batch: the ranks' positions (dataloader
index, batch index, and whether that dataloader ends after this batch) must agree before each step's forward.

Example::

    check_train_ends_alike(trainer, batch_idx, device)  # in Strategy.on_train_batch_start
    check_eval_positions_alike("validation", position, device)  # in Strategy.validation_step
"""

from __future__ import annotations

import torch

from lightning_shard import comm
from lightning_shard.device import has_data

__all__ = [
    "check_eval_positions_alike",
    "check_train_ends_alike",
    "eval_position",
    "has_lengthless_loader",
    "train_ends_after_this_batch",
]


def train_ends_after_this_batch(trainer) -> bool:
    """Whether this rank leaves the training epoch after the current batch: its last batch (the data ran out,
    or ``limit_train_batches`` is reached), or ``max_steps`` is reached by this batch's optimizer step."""
    loop = trainer.fit_loop.epoch_loop
    if loop._num_ready_batches_reached():
        return True
    module = trainer.lightning_module
    if module.automatic_optimization and loop.max_steps >= 0:
        return loop.global_step + (0 if loop._should_accumulate() else 1) >= loop.max_steps
    return False  # manual optimization steps inside training_step: max_steps is not known to stop here


def check_train_ends_alike(trainer, batch_idx: int, device: torch.device, same_batch=None, batch=None) -> None:
    """Raise a ``RuntimeError`` on every rank when some ranks end the training epoch after this batch and
    others do not. Every rank must call it before every training batch. With ``same_batch`` (an
    ``input_checks.EveryBatchCheck``), the same all-reduce also carries ``batch``'s checksum, so that the ranks
    of a TP group are checked for the same batch at every step at no extra collective.

    Example: ``check_train_ends_alike(trainer, batch_idx, strategy.root_device)``.
    """
    ends = train_ends_after_this_batch(trainer)
    flags = torch.tensor([int(ends), int(not ends)], dtype=torch.int64, device=device)
    if same_batch is not None:
        flags = torch.cat([flags, same_batch.slots(batch, device)])
    comm.all_reduce_flags(flags, None)
    if not has_data(flags):  # the simulator's fake tensors: the collective ran, there are no values to compare
        return
    if same_batch is not None:
        same_batch.verify(flags[2:], batch, batch_idx)
    if not bool(flags[:2].all()):
        return
    every = comm.all_gather_objects((batch_idx, ends))
    last = [rank for rank, (_, e) in enumerate(every) if e]
    more = [rank for rank, (_, e) in enumerate(every) if not e]
    raise RuntimeError(
        f"shard_fsdp_tp: the ranks ran out of training batches at different points: batch {batch_idx} of epoch "
        f"{trainer.current_epoch} is the last for ranks {last} but ranks {more} have more. A sharded model's "
        "forward runs collectives on every rank, so the ranks with more batches would wait for the others "
        "forever. Give every rank the same number of batches: split an IterableDataset or your own sampler "
        "into equal parts (by `trainer.strategy.distributed_sampler_kwargs`, dropping or padding the "
        "remainder), or let Lightning's DistributedSampler pad them (use_distributed_sampler=True)"
    )


def has_lengthless_loader(combined_loader) -> bool:
    """Whether a loop's ``CombinedLoader`` holds a dataloader without a length (e.g. over an ``IterableDataset``
    without ``__len__``), whose batch count cannot be compared before the loop."""
    from lightning.fabric.utilities.data import has_len

    loaders = getattr(combined_loader, "flattened", None) or []
    return any(not has_len(loader) for loader in loaders)


def eval_position(loop, args: tuple, kwargs: dict) -> tuple[int, int, bool] | None:
    """``(dataloader_idx, batch_idx, ends)`` of an evaluation or prediction step called with ``args``/``kwargs``
    (``ends``: that dataloader ends after this batch, the data ran out or its batch limit is reached); ``None``
    for a step taking ``dataloader_iter`` (no position known)."""
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
    if not isinstance(batch_idx, int):
        return None
    dataloader_idx = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
    # The fetcher holds the next batch of a length-less loader as (batch, batch_idx, dataloader_idx): in
    # Lightning's sequential mode a rank moving on to the next dataloader first reduces the last one's logged
    # values (sync_dist), a collective that must not meet another rank's next forward.
    ahead = getattr(loop._data_fetcher, "batches", None)
    next_elsewhere = bool(ahead) and isinstance(ahead[0], tuple) and ahead[0][-1] != dataloader_idx
    ends = loop.batch_progress.is_last_batch or next_elsewhere or batch_idx + 1 >= loop.max_batches[dataloader_idx]
    return dataloader_idx, batch_idx, bool(ends)


def check_eval_positions_alike(loop: str, position: tuple[int, int, bool], device: torch.device) -> None:
    """Raise a ``RuntimeError`` on every rank unless all ranks are at the same ``position`` of ``loop`` (one
    max all-reduce of six integers). Every rank must call it before every step of the loop.

    Example: ``check_eval_positions_alike("validation", (0, 3, False), strategy.root_device)``.
    """
    values = [int(v) for v in position]
    flags = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    comm.all_reduce_flags(flags, None)
    if not has_data(flags) or flags[:3].tolist() == (-flags[3:]).tolist():
        return
    every = comm.all_gather_objects(tuple(values))
    per_rank = ", ".join(
        f"rank {r}: dataloader {d} batch {b}{' (its last)' if e else ''}" for r, (d, b, e) in enumerate(every)
    )
    raise RuntimeError(
        f"shard_fsdp_tp: the {loop} dataloader(s) give the ranks different numbers of batches ({per_rank}); a "
        "sharded model's forward runs collectives on every rank, so the rank with more batches would wait for the "
        "others forever. Give every rank the same number of batches: split an IterableDataset into equal parts "
        "(by `trainer.strategy.distributed_sampler_kwargs`, padding or dropping the remainder)"
    )
