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
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_shard.device import accelerator_types, handle_for

__all__ = [
    "CollectiveCounts",
    "count_collectives",
    "all_gather_into",
    "reduce_scatter_into",
    "reduce_scatter_scratch",
    "reduces_in_place",
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
_SERVED: dict[int, tuple[dist.ProcessGroup, frozenset[str]]] = {}


def served_device_types(group: dist.ProcessGroup | None = None) -> frozenset[str]:
    """The device types whose tensors ``group`` (default: the world) can carry, from its backend config.

    >>> sorted(served_device_types())  # a "gloo" world: gloo serves both
    ['cpu', 'cuda']
    >>> served_device_types(nccl_group), served_device_types(cpu_gloo_cuda_nccl_group)  # needs CUDA  # doctest: +SKIP
    (frozenset({'cuda'}), frozenset({'cpu', 'cuda'}))
    """
    group = group if group is not None else dist.group.WORLD
    hit = _SERVED.get(id(group))
    if hit is not None and hit[0] is group:
        return hit[1]
    config = str(dist.get_backend_config(group))
    types: set[str] = set()
    for entry in config.split(","):
        device, _, backend = entry.strip().rpartition(":")
        types.update([device] if device else _DEVICES_OF_BACKEND.get(backend, ()))
    served = frozenset(types)
    _SERVED[id(group)] = (group, served)
    return served


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
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: str = "sum", async_op: bool = False
):
    """Reduce ``input`` (``group size`` equal chunks on dim 0) and keep this rank's chunk in ``output``."""
    check_devices("reduce_scatter_into", group, output, input)
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
    check_devices("reduce_scatter_scratch", group, input, *([] if output is None else [output]))
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

    >>> reduces_in_place(4 << 20, dist.group.WORLD), reduces_in_place(1 << 20, dist.group.WORLD)  # a gloo world
    (True, False)
    """
    return nbytes >= _GLOO_ALL_REDUCE_MIN_BYTES and "gloo" in str(dist.get_backend(group))


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
