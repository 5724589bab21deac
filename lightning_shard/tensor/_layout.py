"""Where a rank's local shard sits in the global tensor (``torch.chunk`` semantics, nested shards).

Several mesh dims may shard the same tensor dim. They apply in order: plain ``Shard`` placements in mesh-dim
order, then ``StridedShard`` placements in mesh-dim order, each splitting what the previous ones left. Each
split uses ``torch.chunk`` semantics: chunks of ``ceil(n / parts)``, trailing parts shorter or empty.

Example::

    chunk_range(7, parts=2, index=1)   # (4, 3): rows 4..6
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_shard.tensor.placements import Placement, Shard, StridedShard


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk ``index`` when ``size`` elements are split in ``parts`` torch.chunk-style."""
    step = -(-size // parts) if parts else 0
    start = min(index * step, size)
    return start, max(0, min(step, size - start))


def shard_order(placements: Sequence[Placement], tensor_dim: int) -> list[int]:
    """Mesh dims sharding ``tensor_dim``, in the order their splits apply."""
    plain = [i for i, p in enumerate(placements) if p.is_shard(tensor_dim) and not isinstance(p, StridedShard)]
    strided = [i for i, p in enumerate(placements) if isinstance(p, StridedShard) and p.dim == tensor_dim]
    return plain + strided


def local_range(
    size: int, placements: Sequence[Placement], tensor_dim: int, mesh_shape: Sequence[int], coord: Sequence[int]
) -> tuple[int, int]:
    """(offset, length) along ``tensor_dim`` of the shard held at mesh coordinate ``coord``."""
    offset, length = 0, size
    for mesh_dim in shard_order(placements, tensor_dim):
        start, length = chunk_range(length, mesh_shape[mesh_dim], coord[mesh_dim])
        offset += start
    return offset, length


def local_shape_and_offset(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coord: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the shard at ``coord`` of a tensor of global ``shape``."""
    ranges = [local_range(s, placements, d, mesh_shape, coord) for d, s in enumerate(shape)]
    return tuple(r[1] for r in ranges), tuple(r[0] for r in ranges)


def check_placements(placements: Sequence[Placement], ndim: int, mesh_ndim: int, what: str) -> tuple[Placement, ...]:
    """Validate a placement list against a tensor's ndim and a mesh's ndim; normalise negative dims."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{what}: {len(placements)} placements {list(placements)} for a {mesh_ndim}-D mesh; "
            f"give exactly one placement per mesh dimension"
        )
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(f"{what}: {p!r} is not a Placement (use Shard(d), Replicate() or Partial())")
        if p.is_shard():
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{what}: {p} is out of range for a {ndim}-D tensor")
            if p.dim < 0:
                p = StridedShard(p.dim % ndim, p.split_factor) if isinstance(p, StridedShard) else Shard(p.dim % ndim)
        out.append(p)
    return tuple(out)
