"""DTensorSpec: a DTensor's mesh, placements and global tensor metadata (everything but the data)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor._layout import local_shape_and_offset
from lightning_shard.tensor.placements import Placement


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

    def __hash__(self) -> int:
        return hash((self.mesh, self.placements, tuple(self.shape), self.stride, self.dtype))
