"""Redistribution: turn a local shard laid out by one placement list into the shard of another.

Where the collectives happen for DTensor. The plan, per mesh dimension, uses the fewest collectives:

==================  =========================================================
Shard -> Replicate   all-gather (padded when shards are uneven)
Partial -> Replicate all-reduce
Partial -> Shard     reduce-scatter (padded when uneven)
Shard(i) -> Shard(j) all-to-all
Replicate -> Shard   local chunk, no communication
Replicate -> Partial local (keep the value on one rank for sum, everywhere otherwise)
==================  =========================================================

When several mesh dims shard one tensor dim, a shard can only be gathered once the shards applied after it
are gathered; those are then chunked again locally (see ``_layout`` for the order).

Example::

    local = redistribute_local(x._local_tensor, x._spec, (Replicate(),))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_shard import comm
from lightning_shard.sac import outside_sac
from lightning_shard.tensor._layout import chunk_range, local_range, shard_order
from lightning_shard.tensor.placements import Partial, Placement, Replicate, StridedShard
from lightning_shard.tensor.spec import DTensorSpec


class _State:
    """The local tensor and its current placements while a redistribution plan runs."""

    def __init__(self, local: torch.Tensor, spec: DTensorSpec) -> None:
        self.local = local
        self.placements: list[Placement] = list(spec.placements)
        self.mesh = spec.mesh
        self.shape = spec.shape
        self.coord = spec.mesh.get_coordinate()
        self.mesh_shape = spec.mesh.shape
        self.fresh = False  # whether self.local is a buffer this plan made (may be reduced in place)

    def lengths_along(self, mesh_dim: int, tensor_dim: int) -> list[int]:
        """Length along ``tensor_dim`` held by each rank of ``mesh_dim`` (this rank's other coordinates)."""
        out = []
        for k in range(self.mesh_shape[mesh_dim]):
            coord = list(self.coord)
            coord[mesh_dim] = k
            out.append(local_range(self.shape[tensor_dim], self.placements, tensor_dim, self.mesh_shape, coord)[1])
        return out

    # -- single-mesh-dim steps -------------------------------------------------------------------------
    def all_gather(self, mesh_dim: int) -> None:
        """Shard -> Replicate on ``mesh_dim``; the shard must be the last applied on its tensor dim.

        Each rank sends its shard as it lies in memory (padded along ``d`` to the largest chunk when uneven) and
        the gathered pieces are put side by side along ``d`` in one copy. Moving ``d`` to the front first (so
        that the gathered buffer is the result) would copy the shard once more and hold that copy during the
        collective: 0.5x the result's size extra at the peak on 2 ranks (the logits of a column-parallel LM
        head: ``docs/benchmarks.md``, "TP 2"); torch's DTensor gathers along dim 0 the same way."""
        d = self.placements[mesh_dim].dim
        lengths = self.lengths_along(mesh_dim, d)
        chunk = max(lengths)
        x = self.local
        if x.shape[d] < chunk:
            pad = list(x.shape)
            pad[d] = chunk - x.shape[d]
            x = torch.cat([x, x.new_zeros(pad)], dim=d)
        x = x.contiguous()
        out = x.new_empty((len(lengths) * x.shape[0], *x.shape[1:]))
        comm.all_gather_into(out, x, self.mesh.get_group(mesh_dim))
        if d == 0 and all(n == chunk for n in lengths):
            self.local = out  # already in place: no copy
        else:
            # One copy that drops the padding and joins the pieces along dim d, leaving a contiguous tensor.
            pieces = out.view(len(lengths), *x.shape).unbind(0)
            self.local = torch.cat([p.narrow(d, 0, n) for p, n in zip(pieces, lengths)], dim=d)
        self.fresh = True
        self.placements[mesh_dim] = Replicate()

    def chunk(self, mesh_dim: int, placement: Placement) -> None:
        """Replicate -> Shard on ``mesh_dim``; it must become the last applied shard on its tensor dim."""
        d = placement.dim
        start, length = chunk_range(self.local.shape[d], self.mesh_shape[mesh_dim], self.coord[mesh_dim])
        view = self.local.narrow(d, start, length)
        self.local = view.contiguous()
        self.fresh = self.fresh or self.local is not view
        self.placements[mesh_dim] = placement

    def all_reduce(self, mesh_dim: int) -> None:
        """Partial -> Replicate on ``mesh_dim``."""
        op = self.placements[mesh_dim].reduce_op
        if not self.fresh:
            self.local = self.local.clone(memory_format=torch.contiguous_format)  # never mutate the source
            self.fresh = True
        comm.all_reduce(self.local, self.mesh.get_group(mesh_dim), op)
        self.placements[mesh_dim] = Replicate()

    def reduce_scatter(self, mesh_dim: int, placement: Placement) -> None:
        """Partial -> Shard on ``mesh_dim``; the new shard must be the last applied on its tensor dim."""
        op = self.placements[mesh_dim].reduce_op
        d, n = placement.dim, self.mesh_shape[mesh_dim]
        size = self.local.shape[d]
        step = -(-size // n)
        x = self.local.movedim(d, 0)
        if step * n != size:  # pad at the end of dim d: one copy, contiguous
            x = torch.cat([x, x.new_zeros((step * n - size, *x.shape[1:]))])
        x = x.contiguous()
        out = x.new_empty((step, *x.shape[1:]))
        comm.reduce_scatter_into(out, x, self.mesh.get_group(mesh_dim), op)
        _, length = chunk_range(size, n, self.coord[mesh_dim])
        self.local = out[:length].movedim(0, d).contiguous()
        self.fresh = True
        self.placements[mesh_dim] = placement

    def all_to_all(self, mesh_dim: int, placement: Placement) -> None:
        """Shard(a) -> Shard(b) on ``mesh_dim`` when it is the last shard applied on ``a`` and will be the last
        applied on ``b`` (see ``can_all_to_all``)."""
        a, b = self.placements[mesh_dim].dim, placement.dim
        n, me = self.mesh_shape[mesh_dim], self.coord[mesh_dim]
        group = self.mesh.get_group(mesh_dim)
        rows_a = self.lengths_along(mesh_dim, a)  # what each peer holds along a
        pieces = [self.local.narrow(b, *chunk_range(self.local.shape[b], n, k)) for k in range(n)]
        if b == 0 and self.local.is_contiguous():
            send = self.local.reshape(-1)  # the dim-0 pieces already sit one after the other: no copy
        else:
            send = torch.cat([p.reshape(-1) for p in pieces])
        my_b = chunk_range(self.local.shape[b], n, me)[1]
        recv_shapes = []
        for k in range(n):
            shape = list(self.local.shape)
            shape[a], shape[b] = rows_a[k], my_b
            recv_shapes.append(shape)
        recv_sizes = [int(torch.Size(s).numel()) for s in recv_shapes]
        recv = send.new_empty(sum(recv_sizes))
        comm.all_to_all_single(recv, send, recv_sizes, [p.numel() for p in pieces], group)
        if a == 0:  # the received pieces stack along dim 0 in rank order: the buffer is the result
            shape = list(self.local.shape)
            shape[0], shape[b] = sum(rows_a), my_b
            self.local = recv.view(shape)
        else:
            self.local = torch.cat([r.view(s) for r, s in zip(recv.split(recv_sizes), recv_shapes)], dim=a)
        self.fresh = True
        self.placements[mesh_dim] = placement

    def replicate_to_partial(self, mesh_dim: int, placement: Partial) -> None:
        if placement.reduce_op == "sum" and self.coord[mesh_dim] != 0:
            self.local = torch.zeros_like(self.local)
            self.fresh = True
        self.placements[mesh_dim] = placement

    # -- steps that respect nested shards -------------------------------------------------------------
    def later_shards(self, mesh_dim: int, tensor_dim: int) -> list[int]:
        order = shard_order(self.placements, tensor_dim)
        return order[order.index(mesh_dim) + 1 :]

    def unshard(self, mesh_dim: int) -> None:
        """Shard -> Replicate on ``mesh_dim``, gathering and re-chunking shards applied after it."""
        d = self.placements[mesh_dim].dim
        later = [(j, self.placements[j]) for j in self.later_shards(mesh_dim, d)]
        for j, _ in reversed(later):
            self.all_gather(j)
        self.all_gather(mesh_dim)
        for j, p in later:
            self.chunk(j, p)

    def shard(self, mesh_dim: int, placement: Placement) -> None:
        """Replicate -> Shard on ``mesh_dim``, in its place in the order of shards of that tensor dim."""
        d = placement.dim
        self.placements[mesh_dim] = placement
        later = [(j, self.placements[j]) for j in self.later_shards(mesh_dim, d)]
        self.placements[mesh_dim] = Replicate()
        for j, _ in reversed(later):
            self.all_gather(j)
        self.chunk(mesh_dim, placement)
        for j, p in later:
            self.chunk(j, p)

    def can_all_to_all(self, mesh_dim: int, target: Sequence[Placement]) -> bool:
        """Whether Shard(a) -> ``target[mesh_dim]`` (a plain Shard(b), b != a) is one all-to-all: the current shard
        must be the last applied on ``a`` (so gathering it needs nothing else gathered first), the new one must
        apply after every current shard of ``b`` (so splitting the local tensor is the right split), and those
        shards of ``b`` must be final (otherwise gathering them later would gather this one again)."""
        cur, want = self.placements[mesh_dim], target[mesh_dim]
        if not (cur.is_shard() and want.is_shard() and cur.dim != want.dim):
            return False
        if isinstance(cur, StridedShard) or isinstance(want, StridedShard):
            return False
        on_b = shard_order(self.placements, want.dim)
        return (
            shard_order(self.placements, cur.dim)[-1] == mesh_dim
            and _is_last_plain(self, mesh_dim, want.dim)
            and all(self.placements[j] == target[j] for j in on_b)
        )


_CARRIERS = {torch.int16: torch.int32, torch.uint16: torch.int32}


@outside_sac  # a buffer and the collective writing it in place: one unit, never saved or replayed by SAC
def redistribute_local(
    local: torch.Tensor, spec: DTensorSpec, target: Sequence[Placement], *, compact: bool = True
) -> torch.Tensor:
    """The local shard, under ``target`` placements, of the DTensor whose local shard is ``local``.

    ``compact=False`` lets the result be a view into a larger buffer the redistribution made, for a caller that
    copies it right away (a random op filling a parameter's shard): no copy beside that buffer. A DTensor whose
    shard lives on the host (CPU offload, a model split on the host) redistributes over its mesh's CPU backend,
    as meant (``comm.host_collectives``).

    Example: ``redistribute_local(x._local_tensor, x._spec, (Replicate(),))`` all-gathers a 1-D shard.
    """
    target = tuple(target)
    if tuple(spec.placements) == target:
        return local
    with comm.host_collectives_for(local):
        return _redistribute_local(local, spec, target, compact=compact)


def _redistribute_local(
    local: torch.Tensor, spec: DTensorSpec, target: Sequence[Placement], *, compact: bool = True
) -> torch.Tensor:
    """``redistribute_local``'s plan and collectives, for ``target`` (a tuple) other than ``spec``'s."""
    if local.is_conj() or local.is_neg():
        local = local.resolve_conj().resolve_neg()  # collectives move raw memory, not the lazy conj/neg bits
    carrier = _CARRIERS.get(local.dtype)
    if carrier is not None:
        # gloo and NCCL have no 16-bit integer collectives: move (and sum, modulo 2**16 after the cast back,
        # as 16-bit arithmetic does) the values as int32
        return redistribute_local(local.to(carrier), spec, target, compact=compact).to(local.dtype)
    st = _State(local, spec)
    ndim = len(spec.shape)

    # 1. Shard(a) -> Shard(b) on one mesh dim where no other shard is in the way: one all-to-all.
    for i, want in enumerate(target):
        if st.can_all_to_all(i, target):
            st.all_to_all(i, want)

    # 2. Shards that must go: gather, the last-applied first on each tensor dim.
    for d in range(ndim):
        for i in reversed(shard_order(st.placements, d)):
            if st.placements[i] != target[i]:
                st.unshard(i)

    # 3. Partials that must go: reduce-scatter straight into a shard when nothing is applied after it.
    for i, cur in enumerate(st.placements):
        if cur.is_partial() and cur != target[i]:
            want = target[i]
            if want.is_shard() and not isinstance(want, StridedShard) and _is_last_plain(st, i, want.dim):
                st.reduce_scatter(i, want)
            else:
                st.all_reduce(i)

    # 4. Replicate -> Shard / Partial, in mesh order so plain shards nest as they should.
    for i, want in enumerate(target):
        if st.placements[i] != want:
            if want.is_shard():
                st.shard(i, want)
            elif want.is_partial():
                st.replicate_to_partial(i, want)
    local = st.local
    if compact and st.fresh and local.untyped_storage().nbytes() > local.numel() * local.element_size():
        # A chunk of a buffer this plan made (a gather, then a chunk on another mesh dim): copied out once, at
        # the end, so that the shard does not keep the whole buffer alive (torch's DTensor copies every chunk).
        local = local.clone()
    return local


def _is_last_plain(st: _State, mesh_dim: int, tensor_dim: int) -> bool:
    """True if a plain shard of ``tensor_dim`` on ``mesh_dim`` would be applied after every current shard."""
    current = shard_order(st.placements, tensor_dim)
    return all(j < mesh_dim and not isinstance(st.placements[j], StridedShard) for j in current)
