"""The post-forward shard of ``reshard_after_forward=<int>``: after forward, keep 1/size of the parameters.

With ``reshard_after_forward=size`` (``1 < size < shard-group size``, e.g. the GPUs of one node), a group
does not drop its unsharded parameters down to the full-group shard after forward. It keeps this rank's
``1/size`` slice of them, as if sharded over its ``size`` neighbours (``DeviceMesh.split_group``), so the
all-gather before backward runs over those ``size`` ranks only. Memory between forward and backward is
``size``-way instead of fully sharded; the backward all-gather stays inside the node.

The slice is taken from the unsharded flat buffer by one ``torch._foreach_copy_`` over views made once; its
storage is freed whenever the shard is not held (like the unsharded flat buffer itself).

Example::

    shard = PostForwardShard(shapes, 2, group, rank=1, dtype=torch.float32, device=torch.device("cpu"))
    shard.keep(unsharded_flat, full_layout)   # post-forward
    handle = shard.start_all_gather()         # pre-backward; then finish_all_gather(handle, unsharded_flat)
    shard.release()
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_shard.fsdp import buffers, collectives
from numba_kernels import GroupLayout


class PostForwardShard:
    """This rank's ``1/size`` of one group's unsharded parameters, held from forward to backward."""

    def __init__(
        self,
        shapes: list[torch.Size],
        size: int,
        group: dist.ProcessGroup,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layout = GroupLayout(shapes, size)
        self.group = group
        self.rank = rank
        self.flat = torch.empty(self.layout.shard_numel, dtype=dtype, device=device)
        self.held = False
        self._copies: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (into flat, from unsharded)
        if device.type != "meta":
            self.flat.untyped_storage().resize_(0)
            self.layout.warm(device, dtype, dtype)

    def keep(self, unsharded_flat: torch.Tensor, full_layout: GroupLayout) -> None:
        """Copy this rank's slice out of the (allocated) unsharded flat buffer."""
        storage = self.flat.untyped_storage()
        storage.resize_(self.layout.shard_numel * self.flat.element_size())
        buffers.populate_pages(storage)
        if self._copies is None:
            self._copies = self._views(unsharded_flat, full_layout)
        torch._foreach_copy_(*self._copies)
        self.held = True

    def _views(self, unsharded_flat: torch.Tensor, full_layout: GroupLayout):
        into, source = [], []
        for i in range(len(self.layout.shapes)):
            rows = self.layout.local_rows(i, self.rank)
            if rows == 0:
                continue
            inner = self.layout.inner_numels[i]
            start = int(full_layout.unsharded_offsets[i]) + self.rank * self.layout.rows_per_shard[i] * inner
            offset = int(self.layout.shard_offsets[i])
            source.append(unsharded_flat[start : start + rows * inner])
            into.append(self.flat[offset : offset + rows * inner])
        return into, source

    def start_all_gather(self) -> collectives.CollectiveHandle:
        """All-gather the held slices over the ``size`` ranks (async); finish with ``finish_all_gather``."""
        return collectives.start_all_gather(
            self.layout, self.flat, self.rank, self.group, self.flat.dtype, self.flat.device
        )

    def release(self) -> None:
        """Free the slice (after the backward all-gather, or when it went unused)."""
        if self.held:
            self.flat.untyped_storage().resize_(0)
            self.held = False
