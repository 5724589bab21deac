"""The ranks of one tensor-parallel group must feed the model the same inputs: a check that says when they do not.

Tensor parallelism splits the *weights* over the ranks of a TP group; every rank of the group computes on the
same (replicated) input. If the ranks are given different batches -- a sampler or an iterable dataset split by
the global rank instead of the data-parallel rank, random augmentation seeded per rank -- each rank computes a
piece of a different sample, the collectives sum pieces that do not belong together, and training goes on
with wrong gradients and no error. :func:`check_same_inputs` compares a fingerprint of every tensor in a batch
(shape, dtype and a hash of its bytes) across the group and raises on every rank when they differ.

Only tensors take part (strings and other objects in a batch may legitimately differ, e.g. a worker id).
Tensors without data (meta, fake) and DTensors (already distributed) are compared by shape and dtype only.

The random number generators are inputs too: dropout on a replicated activation (GPT-2's residual and
embedding dropout) must draw the same mask on every rank of the group, or the replicated copies part ways.
:func:`sync_rng_states` makes the group's generator states equal (group rank 0's) where they differ, e.g.
after ``seed_everything(seed + rank)``.

Example::

    check_same_inputs(batch, mesh["tensor_parallel"].get_group(), what="training batch 0")
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_shard import comm
from lightning_shard.device import has_data
from lightning_shard.tensor import DTensor

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency
    xxhash = None

__all__ = ["TPInputMismatchError", "check_same_inputs", "input_fingerprint", "sync_rng_states"]

_MAX_DEPTH = 8  # nested containers deeper than this are not searched (batches are shallow)


class TPInputMismatchError(ValueError):
    """The ranks of one tensor-parallel group were given different inputs (raised on every rank of the group)."""


def input_fingerprint(obj: Any) -> list[tuple]:
    """``(path, shape, dtype, digest)`` for every tensor in ``obj`` (nested dicts, lists, tuples, dataclasses).

    Example::

        input_fingerprint({"ids": torch.zeros(2, 3, dtype=torch.long)})
        # [("['ids']", (2, 3), 'torch.int64', '...')]
    """
    leaves: list[tuple] = []
    _collect(obj, "batch", leaves, 0)
    return leaves


def check_same_inputs(obj: Any, group: dist.ProcessGroup, *, what: str = "inputs") -> None:
    """Raise :class:`TPInputMismatchError` on every rank of ``group`` unless all of them hold the same tensors in
    ``obj``. One small all-gather of fingerprints; every rank of ``group`` must call it.

    Example: ``check_same_inputs(batch, tp_mesh.get_group(), what="training batch 0")``.
    """
    mine = input_fingerprint(obj)
    everyone = comm.all_gather_objects(mine, group=group)
    first = everyone[0]
    for group_rank, theirs in enumerate(everyone):
        if theirs != first:
            raise TPInputMismatchError(_mismatch_message(what, group, first, theirs, group_rank))


def sync_rng_states(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Give every rank of ``group`` the random-number-generator states of its first rank (the CPU generator,
    and ``device``'s when it is a CUDA device); returns whether they differed. Every rank of ``group`` must
    call it: one all-reduce of two integers (a digest of the states) and, only when the states differ, a
    broadcast of the first rank's. Cheap enough to call before every training step (the strategies do, since
    code running on one rank only between steps, e.g. a rank-zero callback that samples, moves that rank's
    generator alone).

    Example: ``sync_rng_states(tp_mesh.get_group(), torch.device("cuda", local_rank))``.
    """
    if not comm.carries_data(group):  # the simulator's fake process group: no generators to agree on
        return False
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    if not _states_differ(states, group, device):
        return False
    first = dist.get_process_group_ranks(group)[0]
    states = comm.broadcast_object(states if dist.get_rank() == first else None, src=first, group=group)
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
    return True


def rng_states_differ(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the random-number-generator states (CPU, and ``device``'s when it is a CUDA device) differ on some
    rank of ``group``, without changing them. Every rank of ``group`` must call it: one all-reduce of two
    integers. The strategies call it after each backward: the generators were synced before the step, so a
    difference means the model drew or seeded differently on the ranks inside the step.

    Example: ``rng_states_differ(tp_mesh.get_group(), torch.device("cpu"))``.
    """
    if not comm.carries_data(group):
        return False
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return _states_differ(states, group, device)


def replicated_gradients_apart(
    named_params, group: dist.ProcessGroup, device: torch.device, *, rtol: float = 1e-4
) -> list[tuple[str, float]]:
    """The parameters replicated over ``group`` (plain tensors, or DTensors whose placement on the
    ``"tensor_parallel"`` mesh dim is not a shard) whose local gradients differ across its ranks by more than
    ``rtol`` (relative to the gradient's absolute sum), or that have a gradient on some ranks only, as ``(name,
    relative difference)``, the largest first. Compares two sums per gradient (of the values and of their absolute
    values) and whether it exists: one max all-reduce of 6 numbers per parameter. Every rank of ``group`` must
    call it with the same parameters (the same model); which of them have a gradient may differ.

    Example: ``replicated_gradients_apart(model.named_parameters(), tp_mesh.get_group(), device)``.
    """
    names, stats = [], []
    for name, p in named_params:
        if not p.requires_grad or not _replicated_over_tp(p):
            continue
        names.append(name)
        g = p.grad
        if g is None or not _replicated_over_tp(g):  # none, or a pending sum (its local values differ by design)
            stats.append(torch.tensor([0.0, 0.0, float(g is not None)], dtype=torch.float64))
            continue
        g = (g.to_local() if isinstance(g, DTensor) else g).detach().double()
        stats.append(torch.stack([g.sum(), g.abs().sum(), torch.ones((), dtype=torch.float64)]).cpu())
    if not names or not comm.carries_data(group):
        return []
    on = "cpu" if "cpu" in comm.served_device_types(group) else device
    mine = torch.stack(stats)
    both = torch.cat([mine, -mine], dim=1).to(on)  # max over ranks of (x, -x): the max and minus the min
    comm.all_reduce(both, group, op="max")
    both = both.cpu()
    spread = both[:, :3] + both[:, 3:]  # max - min of each number
    scale = both[:, 1].clamp_min(torch.finfo(torch.float32).tiny)  # the largest absolute sum
    relative = torch.where(spread[:, 2] > 0, torch.inf, (spread[:, :2] / scale[:, None]).amax(dim=1))
    apart = [(names[i], relative[i].item()) for i in range(len(names)) if relative[i] > rtol]
    return sorted(apart, key=lambda item: -item[1])


def _replicated_over_tp(t: torch.Tensor) -> bool:
    """A plain tensor, or a DTensor whose placement on the ``"tensor_parallel"`` dim is ``Replicate`` (not a shard,
    nor a pending sum: a partial gradient's local values differ by design)."""
    if not isinstance(t, DTensor):
        return True
    names = t.device_mesh.mesh_dim_names or ()
    return all(pl.is_replicate() for n, pl in zip(names, t.placements) if n == "tensor_parallel")


def _states_differ(states: list[torch.Tensor], group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the generator states differ on some rank of ``group``: a max all-reduce of ``(d, -d)`` for a
    62-bit digest ``d`` of this rank's states, on the host when the group carries host tensors."""
    digest = int(_digest(torch.cat([s.reshape(-1).view(torch.uint8) for s in states])), 16) & ((1 << 62) - 1)
    on = "cpu" if "cpu" in comm.served_device_types(group) else device
    flags = torch.tensor([digest, -digest], dtype=torch.int64, device=on)
    comm.all_reduce_flags(flags, group)
    high, neg_low = flags.tolist()
    return high != -neg_low


def _collect(obj: Any, path: str, out: list, depth: int, leaf=None) -> None:
    """Append ``leaf(path, tensor)`` (default: the fingerprint entry) for every tensor in ``obj``."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        out.append(leaf(path, obj) if leaf else (path, tuple(obj.shape), str(obj.dtype), _digest(obj)))
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect(value, f"{path}[{key!r}]", out, depth + 1, leaf)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _collect(value, f"{path}[{i}]", out, depth + 1, leaf)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _collect(getattr(obj, field.name), f"{path}.{field.name}", out, depth + 1, leaf)


def _digest(tensor: torch.Tensor) -> str | None:
    """A hash of the tensor's bytes; ``None`` where there are no bytes to read (meta, fake, DTensor, sparse)."""
    if isinstance(tensor, DTensor) or not has_data(tensor) or tensor.layout != torch.strided:
        return None
    data = tensor.detach()
    if data.device.type != "cpu":  # a batch is small; one copy to the host for the check
        data = data.cpu()
    raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_hexdigest(raw) if xxhash is not None else f"{zlib.crc32(raw):08x}"


def _mismatch_message(what: str, group: dist.ProcessGroup, first: list, theirs: list, group_rank: int) -> str:
    ranks = dist.get_process_group_ranks(group)
    other = ranks[group_rank]
    detail = f"{len(first)} vs {len(theirs)} tensors"
    for a, b in zip(first, theirs):
        if a != b:
            same_layout = a[1:3] == b[1:3]
            detail = (
                f"{a[0]}: same shape {a[1]} and dtype, different values"
                if same_layout and a[0] == b[0]
                else f"{a[0]} {a[1]} {a[2]} on rank {ranks[0]} vs {b[0]} {b[1]} {b[2]} on rank {other}"
            )
            break
    return (
        f"tensor parallelism: the ranks {ranks} of one tensor-parallel group got different {what} (rank {ranks[0]} "
        f"vs rank {other}: {detail}). TP ranks compute pieces of the same samples, so they must see the same "
        "batch: split the data by the data-parallel rank (Lightning's distributed sampler does; with your own "
        "sampler or iterable dataset use the strategy's `distributed_sampler_kwargs`), not the global rank, and "
        "seed any random augmentation the same on the ranks of a TP group"
    )


_SAMPLE = 4096  # elements per tensor the sampled checksum reads: its cost does not grow with the batch
_MOD = (1 << 61) - 1  # a Mersenne prime: sums of (byte * weight) stay exact in int64 before the modulo


def sampled_checksum(obj: Any, device: torch.device) -> torch.Tensor:
    """A 0-dim int64 tensor on ``device`` in ``[0, 2**61 - 1)`` from up to 4096 evenly spaced elements of every
    tensor in ``obj`` (their bytes, weighted by position) and the tensors' shapes. Equal inputs give equal
    checksums; different batches (other samples, other augmentation) almost surely do not. Computed with torch
    ops on the tensors' own devices: no copy to the host, so it can ride in a collective the caller makes anyway.

    Example: ``sampled_checksum({"ids": ids}, ids.device)`` -> ``tensor(123456789)``.
    """
    host = 0  # CPU tensors: xxhash of the sampled bytes (a few torch ops per tensor cost more than hashing)
    on_device = None  # accelerator tensors: torch ops where they live, no copy to the host
    tensors: list[tuple[str, torch.Tensor]] = []
    _collect(obj, "batch", tensors, 0, leaf=lambda path, t: (path, t))
    for i, (path, tensor) in enumerate(tensors):
        # Names and shapes through crc32, not hash(): Python salts str hashes per process.
        host += zlib.crc32(repr((path, tuple(tensor.shape), str(tensor.dtype))).encode()) * (i + 1)
        if isinstance(tensor, DTensor) or not has_data(tensor) or tensor.layout != torch.strided:
            continue  # compared by name and shape only, as the fingerprint does
        flat = tensor.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE].contiguous().view(torch.uint8)
        if picked.device.type == "cpu":
            host += int(_digest(picked), 16) % _MOD * (2 * i + 3)
            continue
        weights = torch.arange(1, picked.numel() + 1, device=picked.device, dtype=torch.int64) * (2 * i + 3)
        part = (picked.to(torch.int64) * weights).sum().to(device)
        on_device = part if on_device is None else on_device + part
    total = torch.tensor(host % _MOD, dtype=torch.int64, device=device)
    return total if on_device is None else (total + on_device) % _MOD
