"""Placements: how a DTensor's global value is laid out along one mesh dimension.

``Shard(d)``: tensor dim ``d`` is split over the mesh dimension with ``torch.chunk`` semantics
(chunks of ``ceil(size / n)`` rows; trailing ranks may hold fewer or none).
``Replicate()``: every rank holds the whole value.
``Partial(op)``: every rank holds a term; the value is their reduction (sum, avg, max or min).
``StridedShard(d, split_factor)``: a shard of tensor dim ``d`` that applies *after* the other mesh
dimensions sharding ``d`` (FSDP over TP: the data-parallel shard splits the TP-local tensor). torch calls it
``_StridedShard``; ``split_factor`` is the product of the later shards' mesh sizes, kept for interop.

Example::

    placements = (Shard(0), Replicate())     # rows split over mesh dim 0, copies along mesh dim 1
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "Shard", "StridedShard", "Replicate", "Partial"]

_REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class of all placements.

    >>> [(p.is_shard(), p.is_replicate(), p.is_partial()) for p in (Shard(0), Replicate(), Partial())]
    [(True, False, False), (False, True, False), (False, False, True)]
    """

    def is_shard(self, dim: int | None = None) -> bool:
        """True for ``Shard`` (on ``dim`` when given), strided or not."""
        return False

    def is_replicate(self) -> bool:
        """True for ``Replicate()``."""
        return False

    def is_partial(self) -> bool:
        """True for ``Partial(...)``."""
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Split tensor dim ``dim`` over the mesh dimension (``torch.chunk`` semantics).

    Example: ``distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])`` gives 4 and 3 rows on 2 ranks.
    """

    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class StridedShard(Shard):
    """A shard of ``dim`` applied after the other mesh dims' shards of ``dim`` (see module docstring).

    Example: FSDP over TP on a (dp, tp) mesh gives ``(StridedShard(0, split_factor=tp), Shard(0))``.
    """

    split_factor: int = 1

    def __repr__(self) -> str:
        return f"StridedShard(dim={self.dim}, split_factor={self.split_factor})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank of the mesh dimension holds the full value. Example: ``[Replicate()]``."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Each rank holds a term of the value; the value is their ``reduce_op`` reduction.

    Example: the local product of a column shard and a row shard is ``Partial("sum")``.
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial: reduce_op {self.reduce_op!r} is not one of {_REDUCE_OPS}")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})"
