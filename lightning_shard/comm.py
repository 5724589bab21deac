"""Thin wrappers over torch.distributed collectives, shared by DTensor and FSDP.

Why a wrapper: (1) one place to count collectives and bytes (``count_collectives()``, used by tests and
benchmarks), (2) one place for the fallbacks some backends or torch versions need (gloo on older torch lacks
``ReduceOp.AVG``; torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single``), (3) device
discipline: every tensor must be on a device type its group serves (``served_device_types``: an NCCL group
serves CUDA only, ``"cpu:gloo,cuda:nccl"`` both), checked before the collective is issued, so a CPU tensor
sent over NCCL raises a ``RuntimeError`` naming the calling line instead of failing inside NCCL (or, under
the simulator, never failing at all). No other module of the engine or the strategy calls
``torch.distributed`` collectives (``tests/test_comm_discipline.py``).

Example::

    with count_collectives() as counts:
        all_reduce(t, group)
    counts.calls["all_reduce"], counts.bytes["all_reduce"]
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_shard.device import accelerator_types, handle_for

__all__ = [
    "CollectiveCounts",
    "count_collectives",
    "all_gather_into",
    "reduce_scatter_into",
    "PairwiseWork",
    "all_reduce",
    "all_reduce_flags",
    "all_to_all_single",
    "broadcast",
    "broadcast_object",
    "all_gather_objects",
    "all_gather_list",
    "barrier",
    "served_device_types",
    "check_devices",
    "DeviceDisciplineError",
    "host_collectives",
    "host_collectives_for",
    "strict_host_collectives",
    "REDUCE_OPS",
]

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# On gloo, all-gathers and reduce-scatters of host tensors run as point-to-point sends between each pair of
# ranks (``_pairwise_all_gather``, ``_pairwise_reduce_scatter``). Tests turn it off to run gloo's own collectives,
# the path an NCCL group takes.
_PAIRWISE_ON_GLOO = True
# The p2p tag of each pairwise kind: in flight together on one group, an all-gather's messages and a
# reduce-scatter's never match each other; within a kind, messages match in the order ranks issue them, as the
# collectives they replace must be issued in the same order on every rank.
_PAIRWISE_TAGS = {"all_gather": 1, "reduce_scatter": 2}

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


class DeviceDisciplineError(RuntimeError):
    """A tensor on a device its collective's group does not serve, on another accelerator than this process's, or
    (strict host discipline) on the host by accident; the message names the call site.

    Example: ``check_devices("all_reduce", nccl_group, torch.zeros(2))`` raises it.
    """


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


# backend name -> the device types it serves, for backend strings without a "device:backend" map
_DEVICES_OF_BACKEND = {"nccl": ("cuda",), "gloo": ("cpu",)}
# id(group) -> (group, {device type: backend}), parsed once per group from its backend config
_SERVED: dict[int, tuple[dist.ProcessGroup, dict[str, str]]] = {}


def _backends_by_device(group: dist.ProcessGroup) -> dict[str, str]:
    """The backend ``group`` uses for each device type it serves, from its config (``"cpu:gloo,cuda:nccl"``)."""
    hit = _SERVED.get(id(group))
    if hit is None or hit[0] is not group:
        by_device = {}
        for entry in str(dist.get_backend_config(group)).split(","):
            device, _, backend = entry.strip().rpartition(":")
            for d in [device] if device else _DEVICES_OF_BACKEND.get(backend, ()):
                by_device[d] = backend
        hit = _SERVED[id(group)] = (group, by_device)
    return hit[1]


def served_device_types(group: dist.ProcessGroup | None = None) -> frozenset[str]:
    """The device types whose tensors ``group`` (default: the world) can carry, from its backend config.

    >>> sorted(served_device_types())  # a "gloo" world: gloo serves both
    ['cpu', 'cuda']
    >>> served_device_types(nccl_group), served_device_types(cpu_gloo_cuda_nccl_group)  # needs CUDA  # doctest: +SKIP
    (frozenset({'cuda'}), frozenset({'cpu', 'cuda'}))
    """
    return frozenset(_backends_by_device(group if group is not None else dist.group.WORLD))


def check_devices(what: str, group: dist.ProcessGroup | None, *tensors: torch.Tensor) -> None:
    """Raise ``RuntimeError`` naming the caller if a tensor is on a device type ``group`` does not serve.

    Example: ``check_devices("all_reduce", nccl_group, cpu_tensor)`` raises
    ``RuntimeError: all_reduce at lightning_shard/utils.py:96 (_total_norm): tensor on cpu, group serves cuda``.
    """
    served = served_device_types(group)
    for t in tensors:
        # meta tensors carry no data (distributing a meta-initialised model): there is nothing to send
        if t.device.type not in served and t.device.type != "meta":
            config = dist.get_backend_config(group or dist.group.WORLD)
            raise DeviceDisciplineError(
                f"lightning_shard.comm.{what} at {_call_site()}: a tensor on {t.device} (shape {tuple(t.shape)}) "
                f"entered a collective over a group whose backend ({config}) "
                f"serves {sorted(served)} only; move the tensor to {sorted(served)[0]!r} or use a group that serves "
                f"{t.device.type!r} (e.g. backend 'cpu:gloo,cuda:nccl')"
            )
        _check_accelerator_index(what, t)
        _check_host_round_trip(what, served, t)


# Strict host discipline (the simulator turns it on): a host tensor in a collective over a group that also serves
# an accelerator goes through the group's CPU backend (gloo), a device-to-host round trip that is only right
# where the engine means it (CPU-offloaded shards, a model built on the host being split). Those places say so
# with ``host_collectives()``; any other is an accelerator path that fell back to the host unnoticed.
_STRICT_HOST = [False]


class _HostCollectives(contextlib.AbstractContextManager):
    """The context of ``host_collectives()``: a nesting count, one shared object (it sits on DTensor's
    redistribution path, so entering it allocates nothing)."""

    depth = 0

    def __enter__(self) -> None:
        _HostCollectives.depth += 1

    def __exit__(self, *exc) -> None:
        _HostCollectives.depth -= 1


_HOST_COLLECTIVES = _HostCollectives()
_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def strict_host_collectives() -> Iterator[None]:
    """Inside the block, a host tensor in a collective over a group that serves an accelerator raises unless the
    caller runs it inside ``host_collectives()`` (``lightning_shard.simulate`` runs every simulation this way).

    Example::

        with strict_host_collectives():
            train_one_step()   # raises where a host tensor reached an accelerator group by accident
    """
    saved, _STRICT_HOST[0] = _STRICT_HOST[0], True
    try:
        yield
    finally:
        _STRICT_HOST[0] = saved


def host_collectives() -> contextlib.AbstractContextManager:
    """Mark the collectives of host tensors inside the block as intended (CPU offload, host-side setup).

    Example::

        with host_collectives():
            all_reduce(offloaded_norm, group)
    """
    return _HOST_COLLECTIVES


def host_collectives_for(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """``host_collectives()`` when ``tensor`` (a DTensor: its local part) lives on the host, else nothing: for
    code that handles CPU-offloaded and device state alike.

    Example::

        with host_collectives_for(grad):
            all_reduce(norm_term, group)
    """
    local = getattr(tensor, "_local_tensor", tensor)
    return _HOST_COLLECTIVES if local.device.type == "cpu" else _NOTHING


def _check_host_round_trip(what: str, served: frozenset[str], t: torch.Tensor) -> None:
    if not _STRICT_HOST[0] or _HostCollectives.depth or t.device.type != "cpu":
        return
    accelerators = sorted(served & set(accelerator_types()))
    if accelerators:
        raise DeviceDisciplineError(
            f"lightning_shard.comm.{what} at {_call_site()}: a host tensor (shape {tuple(t.shape)}) entered a "
            f"collective over a group that serves {accelerators[0]!r}: it goes through the group's CPU backend, a "
            f"device-to-host round trip. Keep the tensor on {accelerators[0]!r}, or, where a host collective is "
            "meant (CPU-offloaded state), run it inside lightning_shard.comm.host_collectives()"
        )


def _check_accelerator_index(what: str, t: torch.Tensor) -> None:
    """An accelerator tensor must be on this process's device: NCCL binds a process's communicator to one GPU,
    so a tensor on another (shards on cuda:0 while Lightning chose cuda:2 for ``Trainer(devices=[2, 3])``)
    fails inside NCCL or hangs the group."""
    if t.device.index is None or t.device.type not in accelerator_types():
        return
    expected = handle_for(t.device).current_device()
    if expected.index is not None and t.device.index != expected.index:
        raise DeviceDisciplineError(
            f"lightning_shard.comm.{what} at {_call_site()}: a tensor on {t.device} (shape {tuple(t.shape)}) "
            f"entered a collective, but this process's device is {expected}: a process's collectives run on its "
            f"own device. Move the tensor to {expected}, or set the device before building the mesh "
            f"(torch.{t.device.type}.set_device)"
        )


def _call_site() -> str:
    """``file:line (function)`` of the first frame outside this module (the code that asked for the collective)."""
    frame = sys._getframe(1)
    here = os.path.abspath(__file__)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) == here:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Gather equal-size ``input`` from every rank into ``output`` (concatenated on dim 0)."""
    check_devices("all_gather_into", group, output, input)
    _record("all_gather", input)
    if _runs_pairwise(input, group):
        return _finished_unless_async(_pairwise_all_gather(output, input, group), async_op)
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: str = "sum", async_op: bool = False
):
    """Reduce ``input`` (``group size`` equal chunks on dim 0) and keep this rank's chunk in ``output``.

    Example: ``work = reduce_scatter_into(chunk, staged.view(-1), group, async_op=True)``, then ``work.wait()``.
    """
    check_devices("reduce_scatter_into", group, output, input)
    _record("reduce_scatter", input)
    if _runs_pairwise(input, group):
        return _finished_unless_async(_pairwise_reduce_scatter(output, input, group, op), async_op)
    if op == "avg" and not _supports_avg(group):
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group)
        output.div_(dist.get_world_size(group))
        return work
    return _reduce_scatter_single(output, input, op=REDUCE_OPS[op], group=group, async_op=async_op)


def _runs_pairwise(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether a gather or reduce-scatter of ``tensor`` over ``group`` runs as pairwise sends: a host tensor on
    a group whose CPU backend is gloo. An accelerator tensor on a ``"cpu:gloo,cuda:nccl"`` group goes to NCCL's
    own collective.

    >>> _runs_pairwise(torch.ones(4), dist.group.WORLD)  # a gloo world
    True
    """
    return _PAIRWISE_ON_GLOO and tensor.device.type == "cpu" and _backends_by_device(group).get("cpu") == "gloo"


class PairwiseWork:
    """The sends and receives of one pairwise collective, waited for as one; then ``finish`` (a reduce-scatter's
    local reduction) runs once. Stands where torch's ``Work`` would (``wait()``, ``is_completed()``).

    Example: ``work = reduce_scatter_into(out, inp, gloo_group, async_op=True)``; ``work.wait()``.
    """

    def __init__(self, works: list, finish=None) -> None:
        self.works = works
        self.finish = finish

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for every send and receive, within ``timeout`` in all when given (else the group's own), as
        ``Work.wait(timeout)`` does; then the local reduction."""
        deadline = time.monotonic() + timeout.total_seconds() if timeout else None
        while self.works:  # one at a time: after a failed wait (a peer gone) a second wait raises again
            if deadline is None:
                self.works[0].wait()
            else:  # what is left of the whole wait's time (gloo raises on a timeout it is given)
                self.works[0].wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            self.works.pop(0)
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()
        return True

    def is_completed(self) -> bool:
        return not self.works and self.finish is None


def _finished_unless_async(work: PairwiseWork, async_op: bool) -> PairwiseWork | None:
    if async_op:
        return work
    work.wait()
    return None


def _peers(group: dist.ProcessGroup) -> tuple[int, int, list[tuple[int, int]]]:
    """``(size, group rank, [(send to, receive from) per round])``: in round k a rank sends to the rank k after
    it and receives from the rank k before it, so every pair exchanges once and no two sends meet one receive."""
    size, rank = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
    return size, rank, [((rank + k) % size, (rank - k) % size) for k in range(1, size)]


def _pairwise_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> PairwiseWork:
    """Gather as point-to-point sends: this rank's ``input`` to every other rank, theirs into ``output``'s chunks.

    Gloo's own all-gather moves the same bytes through its worker thread with copies: on 2 gloo ranks this took
    0.44x-0.90x its time for fp32 outputs of 1-32 MB (``benchmarks/gloo_collectives.py``, docs/benchmarks.md).
    """
    size, rank, rounds = _peers(group)
    chunks = output.view(size, *input.shape)
    if chunks[rank].data_ptr() != input.data_ptr():
        chunks[rank].copy_(input)
    tag, works = _PAIRWISE_TAGS["all_gather"], []
    if input.numel():
        for dst, src in rounds:
            works.append(dist.isend(input, group=group, group_dst=dst, tag=tag))
            works.append(dist.irecv(chunks[src], group=group, group_src=src, tag=tag))
    return PairwiseWork(works)


_PAIRWISE_REDUCE = {
    "sum": torch.Tensor.add_,
    "avg": torch.Tensor.add_,
    "max": torch.Tensor.maximum,
    "min": torch.Tensor.minimum,
}


def _pairwise_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: str
) -> PairwiseWork:
    """Reduce-scatter as point-to-point sends: each other rank's chunk of ``input`` to it, their chunks of this
    rank's part into ``output`` (the first) and a scratch buffer (the others), reduced locally once all arrived.

    Each rank sends and receives (size - 1) / size of the input, as a ring reduce-scatter does and half of what an
    all-reduce moves: on 2 gloo ranks this took 0.32x-0.51x the time of gloo's reduce-scatter and 0.44x-0.78x its
    all-reduce on fp32 inputs of 1-32 MB (``benchmarks/gloo_collectives.py``). On 2 ranks the sum is the one the
    collectives give, bit for bit (a + b = b + a).
    """
    size, rank, rounds = _peers(group)
    chunks, out = input.view(size, -1), output.view(-1)
    received = [out] + list(out.new_empty((size - 2, out.numel())) if size > 2 else [])
    tag, works = _PAIRWISE_TAGS["reduce_scatter"], []
    if input.numel():
        for (dst, src), into in zip(rounds, received):
            works.append(dist.isend(chunks[dst], group=group, group_dst=dst, tag=tag))
            works.append(dist.irecv(into, group=group, group_src=src, tag=tag))

    def reduce_locally() -> None:
        if size == 1:
            out.copy_(chunks[rank])
            return
        combine = _PAIRWISE_REDUCE[op]
        result = combine(out, chunks[rank])
        for other in received[1:]:
            result = combine(result, other)
        if result is not out:
            out.copy_(result)
        if op == "avg":
            out.div_(size)

    return PairwiseWork(works, reduce_locally)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``tensor`` with ``op`` in ``{"sum", "avg", "max", "min"}``."""
    check_devices("all_reduce", group, tensor)
    _record("all_reduce", tensor)
    if op == "avg" and not _supports_avg(group):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(dist.get_world_size(group))
        return work
    return dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group, async_op=async_op)


def all_reduce_flags(flags: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """In-place max all-reduce of a small integer flag vector (e.g. which parameters of an FSDP group got a
    gradient on any rank). Counted as its own kind, ``"all_reduce_flags"``, apart from the all-reduces of data.

    Example: ``work = all_reduce_flags(torch.tensor([1, 0], dtype=torch.int32), group, async_op=True)``.
    """
    check_devices("all_reduce_flags", group, flags)
    _record("all_reduce_flags", flags)
    return dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: dist.ProcessGroup,
) -> None:
    """Send ``input``'s dim-0 splits to each rank and receive theirs into ``output``."""
    check_devices("all_to_all_single", group, output, input)
    _record("all_to_all", input)
    dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``tensor`` in place from the rank with index ``src_group_rank`` inside ``group``."""
    check_devices("broadcast", group, tensor)
    _record("broadcast", tensor)
    dist.broadcast(tensor, group=group, group_src=src_group_rank)


def all_gather_list(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), as a list in group-rank order.

    Example: ``sums = all_gather_list(checksums, mesh.get_group(0))``.
    """
    check_devices("all_gather_list", group, tensor)
    _record("all_gather", tensor)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


def barrier(group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
    """Wait for every rank of ``group``; on an NCCL group pass this rank's ``device`` (as Lightning does)."""
    if device is not None and device.type == "cuda" and "cpu" not in served_device_types(group):
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def carries_data(group: dist.ProcessGroup | None = None) -> bool:
    """False on torch's fake backend (the simulator's process group), whose collectives move no data.

    Example: ``if carries_data(group): ...`` around a comparison of values across ranks.
    """
    return "fake" not in str(dist.get_backend_config(group or dist.group.WORLD))


_carries_data = carries_data


def _supports_avg(group: dist.ProcessGroup) -> bool:
    # Older gloo builds lack ReduceOp.AVG; NCCL always had it. Sum-then-divide is exact enough for gloo (CPU).
    return "nccl" in str(dist.get_backend(group))


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """``obj`` from global rank ``src`` on every rank of ``group`` (pickled; for small control values).

    torch's ``broadcast_object_list`` puts the pickled bytes on the device the group serves (the current CUDA
    device for NCCL, the CPU for gloo), so this is safe on any backend. On the simulator's fake backend, which
    carries no data, every rank keeps its own ``obj``.

    Example: ``ckpt_id = broadcast_object(os.urandom(7).hex() if rank == 0 else None)``.
    """
    _record("broadcast_object", torch.empty(0))
    if not _carries_data(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank of ``group`` (pickled; device chosen by torch; on
    the simulator's fake backend, this rank's ``obj`` in every slot).

    Also a barrier that is correct on any backend: no rank returns before every rank has called it.

    Example: ``all_ok = all(all_gather_objects(ok))``.
    """
    _record("all_gather_object", torch.empty(0))
    out: list[object] = [obj] * dist.get_world_size(group)
    if _carries_data(group):
        dist.all_gather_object(out, obj, group=group)
    return out
