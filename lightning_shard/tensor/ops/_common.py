"""Helpers shared by rule modules."""

from __future__ import annotations

from lightning_shard.tensor.placements import Placement, Replicate

REPLICATE = Replicate()


def normalize_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def unshard_dims(placements, dims) -> tuple[Placement, ...]:
    """Replace shards on any of ``dims`` and every Partial by Replicate (inputs of ops that mix those dims)."""
    dims = set(dims)
    return tuple(REPLICATE if (p.is_shard() and p.dim in dims) or p.is_partial() else p for p in placements)
