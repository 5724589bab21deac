"""Thin wrappers over torch.distributed collectives, shared by DTensor and FSDP.

Why a wrapper: (1) one place to count collectives and bytes (``count_collectives()``, used by tests and
benchmarks), (2) one place for the fallbacks some backends or torch versions need (gloo on older torch lacks
``ReduceOp.AVG``; torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single``).

Example::

    with count_collectives() as counts:
        all_reduce(t, group)
    counts.calls["all_reduce"], counts.bytes["all_reduce"]
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveCounts",
    "count_collectives",
    "all_gather_into",
    "reduce_scatter_into",
    "reduce_scatter_scratch",
    "reduces_in_place",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "REDUCE_OPS",
]

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# From this input size on, gloo's all-reduce beats its reduce-scatter (see reduce_scatter_scratch).
_GLOO_ALL_REDUCE_MIN_BYTES = 4 << 20

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CollectiveCounts:
    """Number of calls and bytes sent per collective kind, recorded while ``count_collectives()`` is open."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()


_COUNTERS: list[CollectiveCounts] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the collectives this process issues through this module inside the block."""
    counts = CollectiveCounts()
    _COUNTERS.append(counts)
    try:
        yield counts
    finally:
        _COUNTERS.remove(counts)


def _record(kind: str, tensor: torch.Tensor) -> None:
    for c in _COUNTERS:
        c.record(kind, tensor)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Gather equal-size ``input`` from every rank into ``output`` (concatenated on dim 0)."""
    _record("all_gather", input)
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: str = "sum", async_op: bool = False
):
    """Reduce ``input`` (``group size`` equal chunks on dim 0) and keep this rank's chunk in ``output``."""
    _record("reduce_scatter", input)
    if op == "avg" and not _supports_avg(group):
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group)
        output.div_(dist.get_world_size(group))
        return work
    return _reduce_scatter_single(output, input, op=REDUCE_OPS[op], group=group, async_op=async_op)


def reduce_scatter_scratch(
    input: torch.Tensor, group: dist.ProcessGroup, output: torch.Tensor | None = None, async_op: bool = False
) -> tuple[object | None, torch.Tensor]:
    """Sum-reduce-scatter ``input`` (``group size`` equal chunks on dim 0), which the caller gives up: it may be
    overwritten. Returns ``(work, chunk)``; ``chunk`` holds this rank's reduced chunk once ``work`` is done.

    On gloo, from 4 MiB of input, ``input`` is all-reduced in place and ``chunk`` is this rank's view of it
    (``output`` is unused): there gloo's all-reduce took 0.43x-0.91x the time of its reduce-scatter on the
    same input, although it moves twice the bytes (``benchmarks/gloo_reduce_scatter.py``, docs/benchmarks.md;
    below 4 MB the two are level within noise). Otherwise it is a reduce-scatter into ``output`` (a new
    buffer if None). Counted as one reduce-scatter either way.

    Example::

        work, chunk = reduce_scatter_scratch(staged, group, async_op=True)
        work.wait()  # chunk now holds the sum over ranks of this rank's chunk of ``staged``
    """
    if reduces_in_place(input.numel() * input.element_size(), group):
        _record("reduce_scatter", input)
        work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return work, input.view(dist.get_world_size(group), -1)[dist.get_group_rank(group, dist.get_rank())]
    if output is None:
        output = input.new_empty(input.numel() // dist.get_world_size(group))
    return reduce_scatter_into(output, input, group, "sum", async_op=async_op), output


def reduces_in_place(nbytes: int, group: dist.ProcessGroup) -> bool:
    """Whether ``reduce_scatter_scratch`` of an ``nbytes`` input over ``group`` leaves the result in the input
    (an all-reduce in place; its ``output`` is then unused).

    >>> reduces_in_place(4 << 20, gloo_group), reduces_in_place(1 << 20, gloo_group)
    (True, False)
    """
    return nbytes >= _GLOO_ALL_REDUCE_MIN_BYTES and "gloo" in str(dist.get_backend(group))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``tensor`` with ``op`` in ``{"sum", "avg", "max", "min"}``."""
    _record("all_reduce", tensor)
    if op == "avg" and not _supports_avg(group):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(dist.get_world_size(group))
        return work
    return dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: dist.ProcessGroup,
) -> None:
    """Send ``input``'s dim-0 splits to each rank and receive theirs into ``output``."""
    _record("all_to_all", input)
    dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``tensor`` in place from the rank with index ``src_group_rank`` inside ``group``."""
    _record("broadcast", tensor)
    dist.broadcast(tensor, group=group, group_src=src_group_rank)


def _supports_avg(group: dist.ProcessGroup) -> bool:
    # Older gloo builds lack ReduceOp.AVG; NCCL always had it. Sum-then-divide is exact enough for gloo (CPU).
    return "nccl" in str(dist.get_backend(group))


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """``obj`` from global rank ``src`` on every rank of ``group`` (pickled; for small control values).

    torch's ``broadcast_object_list`` puts the pickled bytes on the device the group serves (the current CUDA
    device for NCCL, the CPU for gloo), so this is safe on any backend.

    Example: ``ckpt_id = broadcast_object(os.urandom(7).hex() if rank == 0 else None)``.
    """
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank of ``group`` (pickled; device chosen by torch).

    Also a barrier that is correct on any backend: no rank returns before every rank has called it.

    Example: ``all_ok = all(all_gather_objects(ok))``.
    """
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
