"""DTensorSpec: a DTensor's mesh, placements and global tensor metadata (everything but the data)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor._layout import local_shape_and_offset
from lightning_shard.tensor.placements import Placement

_LAYOUT_TOKENS: dict[tuple, int] = {}  # grows by one entry per distinct (mesh, placements, shape)


@dataclass(frozen=True)
class DTensorSpec:
    """Mesh, one placement per mesh dim, and the global shape/stride/dtype.

    Example: ``DTensorSpec(mesh, (Shard(0),), torch.Size([7, 5]), (5, 1), torch.float32)``.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    @cached_property
    def _local(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        coord = self.mesh.get_coordinate()
        return local_shape_and_offset(self.shape, self.placements, self.mesh.shape, coord)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's shard."""
        return self._local[0]

    @property
    def local_offset(self) -> tuple[int, ...]:
        """Global index of the first element of this rank's shard, per tensor dim."""
        return self._local[1]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def with_placements(self, placements: tuple[Placement, ...]) -> DTensorSpec:
        return DTensorSpec(self.mesh, tuple(placements), self.shape, self.stride, self.dtype)

    def has_partial(self) -> bool:
        return self._has_partial

    @cached_property
    def _has_partial(self) -> bool:  # asked on every op (dispatch fast path): computed once per spec
        return any(p.is_partial() for p in self.placements)

    @cached_property
    def layout_token(self) -> int:
        """A small int equal for two specs exactly when their mesh, placements and shape are equal (their
        shards then line up element for element): computed once per spec, so the foreach fast path compares
        hundreds of specs per optimizer op at int speed."""
        key = (self.mesh, tuple(repr(p) for p in self.placements), tuple(self.shape))
        return _LAYOUT_TOKENS.setdefault(key, len(_LAYOUT_TOKENS))

    @cached_property
    def is_dense(self) -> bool:
        """Whether the strides lay the shape out densely (a permutation of contiguous strides)."""
        expected = 1
        for size, st in sorted(zip(self.shape, self.stride), key=lambda d: d[1]):
            if size != 1 and st != expected:
                return False
            expected *= size
        return True

    @cached_property
    def _hash(self) -> int:
        # The mesh is left out: equal specs have equal meshes, so the hash stays consistent with ==, and a
        # mesh's hash reads its whole rank grid (specs key the dispatch cache, hashed once per spec).
        return hash((self.placements, tuple(self.shape), self.stride, self.dtype))

    def __hash__(self) -> int:
        return self._hash
