"""Matrix functions whose batch-dim rule (``dimwise.py``: the last two dims are whole, shards of the batch
dims stay) needs help from the dispatcher's usual path:

- ``geqrf`` has no meta kernel, so the output shapes and strides are written here (``a`` column-major
  per matrix, as LAPACK returns it, and ``tau`` of length ``min(m, n)``);
- ``linalg_pinv`` receives its tolerances as plain 0-dim CPU tensors made inside ``pinverse`` and
  ``linalg.pinv(rcond=...)``; they are taken as replicated DTensors, so that the meta run sees one device.

Example::

    a = distribute_tensor(torch.randn(4, 5, 3), mesh, [Shard(0)])
    torch.geqrf(a)[0].placements          # (Shard(dim=0),): four independent QR factorizations
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from lightning_shard.tensor.dispatch import _run_on_meta, make_call, register_custom, run_plan
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops._registry import find_rule
from lightning_shard.tensor.placements import Replicate
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten


@register_custom(aten.geqrf.default)
def geqrf_handler(func, args: tuple, kwargs: dict):
    call = make_call(func, args, kwargs)
    plan = find_rule(func)(call)
    shape = tuple(call.specs[0].shape)
    *batch, m, n = shape
    # column-major matrices, batches contiguous after each other
    a = torch.empty(*batch, n, m, dtype=call.specs[0].dtype, device="meta").transpose(-2, -1)
    tau = torch.empty(*batch, min(m, n), dtype=call.specs[0].dtype, device="meta")
    return run_plan(call, plan, (a, tau))


@register_custom(aten.linalg_pinv.atol_rtol_tensor)
def pinv_handler(func, args: tuple, kwargs: dict):
    mesh = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor))._spec.mesh
    rep = (Replicate(),) * mesh.ndim

    def promote(a):
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim == 0:
            return DTensor(a, DTensorSpec(mesh, rep, a.shape, a.stride(), a.dtype), requires_grad=False)
        return a

    args, kwargs = pytree.tree_map(promote, (args, kwargs))
    call = make_call(func, args, kwargs)
    plan = find_rule(func)(call)
    return run_plan(call, plan, _run_on_meta(func, call))
