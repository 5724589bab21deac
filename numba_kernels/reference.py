"""Plain-torch reference implementations of the four staging ops.

Readable, slow (a Python loop over parameters and ranks) and obviously right:
this is what the tests compare the CPU and CUDA kernels against, and it is
itself checked against ``torch.chunk`` / ``torch.cat`` / ``F.pad`` code in
``tests/test_kernels.py``. Arithmetic rule: compute in float32 (float64 for float64
data), round once to the output dtype with ``Tensor.copy_`` (round-to-nearest-even).

Inputs are assumed valid (``ops.py`` validates before dispatching here).

Example::

    >>> import torch
    >>> from numba_kernels.layout import GroupLayout
    >>> layout = GroupLayout([(3,)], world_size=2)
    >>> out = torch.empty(2, layout.shard_numel)
    >>> reduce_scatter_copy_in(layout, [torch.tensor([1.0, 2.0, 3.0])], out)
    >>> out.tolist()
    [[1.0, 2.0], [3.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import GroupLayout


def _f32_div(x: torch.Tensor, divisor: float | None) -> torch.Tensor:
    # float64 (no kernel takes it) is computed in float64: rounding its gradients to float32 would train a
    # float64 model at float32 accuracy.
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if divisor is None:
        return x
    # An explicit 0-dim tensor of x's dtype: division happens in float32 with the
    # divisor rounded to float32 first, exactly what the kernels do (float64: in float64).
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def all_gather_copy_in(
    layout: GroupLayout,
    sharded: torch.Tensor | Sequence[torch.Tensor],
    out: torch.Tensor,
    rank: int,
) -> None:
    """Write rank ``rank``'s flat shard (cast to ``out.dtype``) into row ``rank`` of ``out``."""
    row = out.view(layout.world_size, layout.shard_numel)[rank]
    if isinstance(sharded, torch.Tensor):
        row.copy_(sharded.reshape(-1))
        return
    for i, t in enumerate(sharded):
        off = int(layout.shard_offsets[i])
        dst = row[off : off + layout.padded_shard_numels[i]]
        valid = t.numel()
        dst[:valid].copy_(t.reshape(-1))
        dst[valid:].zero_()


def all_gather_copy_out(
    layout: GroupLayout,
    gathered: torch.Tensor,
    out: torch.Tensor | Sequence[torch.Tensor],
) -> None:
    """Unpad every rank's shard of every parameter from ``gathered`` into the unsharded output(s)."""
    g = gathered.view(layout.world_size, layout.shard_numel)
    for i in range(layout.num_params):
        if isinstance(out, torch.Tensor):
            off = int(layout.unsharded_offsets[i])
            full = out.view(-1)[off : off + layout.numels[i]]
        else:
            full = out[i].view(-1)
        chunk = layout.rows_per_shard[i] * layout.inner_numels[i]
        soff = int(layout.shard_offsets[i])
        for r in range(layout.world_size):
            valid = layout.local_rows(i, r) * layout.inner_numels[i]
            full[r * chunk : r * chunk + valid].copy_(g[r, soff : soff + valid])


def reduce_scatter_copy_in(
    layout: GroupLayout,
    grads: torch.Tensor | Sequence[torch.Tensor | None],
    out: torch.Tensor,
    *,
    predivide: float | None = None,
) -> None:
    """Chunk every gradient over ranks, pad, divide and cast into ``out`` (world_size, shard_numel)."""
    o = out.view(layout.world_size, layout.shard_numel)
    for i in range(layout.num_params):
        if isinstance(grads, torch.Tensor):
            off = int(layout.unsharded_offsets[i])
            g = grads.view(-1)[off : off + layout.numels[i]]
        else:
            g = None if grads[i] is None else grads[i].reshape(-1)
        chunk = layout.rows_per_shard[i] * layout.inner_numels[i]
        soff = int(layout.shard_offsets[i])
        for r in range(layout.world_size):
            dst = o[r, soff : soff + layout.padded_shard_numels[i]]
            valid = 0 if g is None else layout.local_rows(i, r) * layout.inner_numels[i]
            if valid:
                dst[:valid].copy_(_f32_div(g[r * chunk : r * chunk + valid], predivide))
            dst[valid:].zero_()


def post_reduce(
    layout: GroupLayout,
    reduced: torch.Tensor,
    out: torch.Tensor,
    *,
    postdivide: float | None = None,
    accumulate: bool = False,
) -> None:
    """``out = (out if accumulate else 0) + float32(reduced) / postdivide`` over the flat shard."""
    val = _f32_div(reduced.reshape(-1), postdivide)
    if accumulate:
        val = out.reshape(-1).to(torch.promote_types(out.dtype, torch.float32)) + val
    out.view(-1).copy_(val)
