"""In-place view ops (``squeeze_``, ``unsqueeze_``, ``t_``, ``transpose_``, ``swapdims_``): they change a
DTensor's shape, strides and placements, not its values.

Each follows the rule of its out-of-place view (``squeeze_(0)`` -> ``squeeze(0)``). When that view runs on the
local shard without redistribution (the usual case: a squeezed or transposed dim moves a ``Shard`` index,
``Shard(1)`` -> ``Shard(0)``), the DTensor takes the view's local tensor, spec and, through a metadata-only
run of the op on the wrapper, its global sizes and strides, as torch's DTensor does. When the view would need
a redistribution (``self`` would change placements in place, breaking every alias of it), the op raises a
``RuntimeError`` naming it, as other in-place ops do. ``as_strided_``, ``set_`` and ``resize_as_`` address
storage or replace it and always raise.

Example::

    v = distribute_tensor(torch.randn(1, 6), mesh, [Shard(1)])
    v.squeeze_(0)            # v.shape == (6,), v.placements == (Shard(0),)
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.dispatch import dispatch, make_call, register_custom
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.fallback import not_exact
from lightning_shard.tensor.ops._registry import find_rule
from lightning_shard.tensor.ops.views import squeezable_dims

aten = torch.ops.aten

_OUT_OF_PLACE = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.t_.default: aten.t.default,
    aten.transpose_.default: aten.transpose.int,
    aten.swapdims_.default: aten.transpose.int,
    aten.swapaxes_.default: aten.transpose.int,
}


def _rule_view(func, args: tuple, kwargs: dict):
    """The out-of-place view op and arguments whose rule decides the layout (``squeeze`` -> ``squeeze.dims``
    with the globally squeezable dims, as the squeeze handler does)."""
    view = _OUT_OF_PLACE[func]
    if view in (aten.squeeze.default, aten.squeeze.dim):
        dims = None if view == aten.squeeze.default else [args[1] if len(args) > 1 else kwargs["dim"]]
        return aten.squeeze.dims, (args[0], squeezable_dims(args[0]._spec, dims)), {}
    return view, args, kwargs


@register_custom(*_OUT_OF_PLACE)
def inplace_view_handler(func, args: tuple, kwargs: dict):
    self_t: DTensor = args[0]
    view, vargs, vkwargs = _rule_view(func, args, kwargs)
    rule = find_rule(view)
    plan = rule(make_call(view, vargs, vkwargs)) if rule is not None else None
    if plan is None or tuple(plan.inputs[0]) != self_t.placements:
        raise RuntimeError(
            f"{func}: the in-place view would need its DTensor argument redistributed from "
            f"{list(self_t.placements)}; call the out-of-place {view.overloadpacket.__name__} (y = x."
            f"{view.overloadpacket.__name__}(...)) or redistribute first"
        )
    out: DTensor = dispatch(view, vargs, vkwargs)
    _set_wrapper_meta(func, args, kwargs)
    if tuple(self_t.shape) != tuple(out.shape):
        raise AssertionError(f"{func}: wrapper shape {tuple(self_t.shape)} != view shape {tuple(out.shape)}")
    self_t._local_tensor = out._local_tensor  # a view of the same storage: aliases of self stay aliases
    self_t._spec = out._spec
    return self_t


def _set_wrapper_meta(func, args: tuple, kwargs: dict) -> None:
    """Run ``func`` on the wrapper itself, below Python dispatch and on its meta kernel: only the wrapper's
    sizes and strides change (torch.utils._python_dispatch.return_and_correct_aliasing does the same)."""
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


@register_custom(
    aten.as_strided_.default,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor,
    aten.set_.default,
    aten.set_.source_Storage,
    aten.set_.source_Tensor_storage_offset,
)
def storage_handler(func, args: tuple, kwargs: dict):
    raise not_exact(func, "it replaces or re-addresses the tensor's storage, which a DTensor spreads over ranks")


@register_custom(aten.resize_.default, aten.resize_as_.default)
def resize_handler(func, args: tuple, kwargs: dict):
    """Resizing to the current shape (what ``out=`` arguments get) is a no-op; any other size raises."""
    self_t, size = args[0], args[1]
    if tuple(size.shape if isinstance(size, torch.Tensor) else size) == tuple(self_t.shape):
        return self_t
    raise not_exact(func, "it replaces or re-addresses the tensor's storage, which a DTensor spreads over ranks")
