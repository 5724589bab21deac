"""``_foreach_*`` ops (optimizers, ``clip_grad_norm_``): run the per-tensor op on each element through
``dispatch``, so every element uses its own sharding rule (and keeps its own placements for in-place ops).

The per-tensor op is found by name: ``_foreach_add_.List`` -> ``add_`` with the overload that accepts the
element arguments (``Tensor[]`` -> the i-th tensor, ``Scalar[]`` -> the i-th scalar, a ``scalars`` tensor
-> its i-th value, anything else -> passed to every element). A few names differ: ``norm`` ->
``linalg_vector_norm``, ``powsum`` -> ``sum(|x| ** p)``, ``maximum``/``minimum`` with a scalar ->
``clamp_min``/``clamp_max``; an in-place op without an in-place aten variant (``maximum_``) computes the
result and copies it into ``self``.

Example::

    torch._foreach_mul_([p1, p2], 0.9)     # p1, p2 DTensors: p1.mul_(0.9) and p2.mul_(0.9) through their rules
"""

from __future__ import annotations

import numbers

import torch

from lightning_shard.tensor.dispatch import dispatch, register_custom
from lightning_shard.tensor.dtensor import DTensor

aten = torch.ops.aten

_RENAMED = {"norm": "linalg_vector_norm"}
_SCALAR_RENAMED = {"maximum": "clamp_min", "minimum": "clamp_max"}


def _element_args(schema, args: tuple, kwargs: dict, i: int) -> list:
    """The foreach call's arguments (schema order, defaults filled) as seen by element ``i``."""
    out = []
    for k, a in enumerate(schema.arguments):
        if k < len(args) and not a.kwarg_only:
            v = args[k]
        elif a.name in kwargs:
            v = kwargs[a.name]
        elif a.has_default_value():
            v = a.default_value
        else:
            continue
        if a.type.kind() == "ListType" and isinstance(v, (list, tuple)):
            v = v[i]
        elif a.name == "scalars" and isinstance(v, torch.Tensor):
            v = v[i].item()
        out.append(v)
    return out


def _accepts(type_str: str, v) -> bool:
    optional = type_str.startswith("Optional[")
    if v is None:
        return optional
    base = type_str[len("Optional[") : -1] if optional else type_str
    if base == "Tensor":
        return isinstance(v, torch.Tensor)
    if base in ("number", "float", "int", "bool", "complex"):
        return isinstance(v, numbers.Number) and not isinstance(v, torch.Tensor)
    if base == "ScalarType":
        return isinstance(v, torch.dtype)
    if base.startswith("List[int]"):
        return isinstance(v, (list, tuple))
    return False  # generic lists (aten::add_.t) and anything else are never a foreach element's op


def _resolve(packet, values: list):
    """(overload, args, kwargs) of the first overload of ``packet`` that takes ``values`` in order."""
    for name in packet.overloads():
        if "out" in name:
            continue
        op = getattr(packet, name)
        params = op._schema.arguments
        if len(values) > len(params):
            continue
        if any(not p.has_default_value() for p in params[len(values) :]):
            continue
        if all(_accepts(str(p.type), v) for p, v in zip(params, values)):
            args = [v for p, v in zip(params, values) if not p.kwarg_only]
            kwargs = {p.name: v for p, v in zip(params, values) if p.kwarg_only}
            return op, tuple(args), kwargs
    raise NotImplementedError(f"no overload of aten.{packet.__name__} takes arguments {values!r}")


def _call(op, args: tuple, kwargs: dict):
    """Dispatch one element's op: through DTensor rules if any argument is a DTensor, else plainly."""
    if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
        return dispatch(op, args, kwargs)
    return op(*args, **kwargs)


def _element(base: str, values: list, inplace: bool):
    if base == "linalg_vector_norm" or base == "norm":
        x, ord_, dtype = (values + [2, None])[:3]
        return _call(aten.linalg_vector_norm.default, (x, ord_), {"dtype": dtype} if dtype else {})
    if base == "powsum":
        x, ord_, dtype = (values + [2, None])[:3]
        xa = _call(aten.abs.default, (x,), {})
        if dtype is not None:
            xa = _call(aten._to_copy.default, (xa,), {"dtype": dtype})
        return _call(aten.sum.default, (_call(aten.pow.Tensor_Scalar, (xa, ord_), {}),), {})
    name = _RENAMED.get(base, base)
    if len(values) > 1 and isinstance(values[1], numbers.Number) and name in _SCALAR_RENAMED:
        name = _SCALAR_RENAMED[name]
    if inplace and hasattr(aten, name + "_"):
        op, args, kwargs = _resolve(getattr(aten, name + "_"), values)
        _call(op, args, kwargs)
        return values[0]
    op, args, kwargs = _resolve(getattr(aten, name), values)
    out = _call(op, args, kwargs)
    if inplace:
        _call(aten.copy_.default, (values[0], out), {})
        return values[0]
    return out


def foreach_handler(func, args: tuple, kwargs: dict):
    """Run a ``_foreach_*`` op element by element through the per-tensor ops' rules."""
    schema = func._schema
    name = schema.name.split("::")[1][len("_foreach_") :]
    inplace = name.endswith("_")
    base = name.rstrip("_")
    lists = [
        v
        for a, v in zip(schema.arguments, args)
        if str(a.type).startswith("List[Tensor") and isinstance(v, (list, tuple))
    ]
    n = len(lists[0]) if lists else 0
    results = [_element(base, _element_args(schema, args, kwargs, i), inplace) for i in range(n)]
    if inplace:
        return None
    return results


def _register_all() -> None:
    for s in torch._C._jit_get_all_schemas():
        if not s.name.startswith("aten::_foreach_") or "out" in s.overload_name:
            continue
        packet = getattr(aten, s.name.split("::")[1])
        op = getattr(packet, s.overload_name or "default")
        register_custom(op)(foreach_handler)


_register_all()
