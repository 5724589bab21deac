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

Example::

    check_train_ends_alike(trainer, batch_idx, device)  # in Strategy.on_train_batch_start
"""

from __future__ import annotations

import torch

from lightning_shard import comm

__all__ = ["check_train_ends_alike", "train_ends_after_this_batch"]


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


def check_train_ends_alike(trainer, batch_idx: int, device: torch.device) -> None:
    """Raise a ``RuntimeError`` on every rank when some ranks end the training epoch after this batch and
    others do not. Every rank must call it before every training batch.

    Example: ``check_train_ends_alike(trainer, batch_idx, strategy.root_device)``.
    """
    ends = train_ends_after_this_batch(trainer)
    flags = torch.tensor([int(ends), int(not ends)], dtype=torch.int32, device=device)
    comm.all_reduce_flags(flags, None)
    if not bool(flags.all()):
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
