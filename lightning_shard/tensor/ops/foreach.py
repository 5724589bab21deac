"""``_foreach_*`` ops (optimizers, ``clip_grad_norm_``).

Fast path: a pointwise foreach op (``add``, ``mul``, ``lerp``, ``addcdiv``, ``sqrt`` ...) whose i-th tensors
share one layout (same mesh, shape and placements, no ``Partial``; dense for out-of-place ops), for every i,
is one foreach call over the local shards: each output has its element's layout, so no rule, redistribution
or meta run is needed. Other arguments pass through unchanged, a ``scalars`` tensor included (no ``.item()``
per element). This is the optimizer step of FSDP (every parameter, gradient and state ``Shard(0)``).

Otherwise, each element goes through ``dispatch`` with its own per-tensor op, so every element uses its own
sharding rule (and keeps its own placements for in-place ops).

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

import functools
import numbers

import torch

from lightning_shard.tensor.dispatch import dispatch, register_custom
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops._registry import is_inplace
from lightning_shard.tensor.spec import DTensorSpec

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


# Foreach ops that apply an elementwise op to each element (max, norm, powsum reduce; mm multiplies): on
# elements that share one layout, the local foreach computes each element's own shard exactly.
_ELEMENTWISE = frozenset(
    [
        "abs",
        "acos",
        "add",
        "addcdiv",
        "addcmul",
        "asin",
        "atan",
        "ceil",
        "clamp_max",
        "clamp_min",
        "clone",
        "copy",
        "cos",
        "cosh",
        "div",
        "erf",
        "erfc",
        "exp",
        "expm1",
        "floor",
        "frac",
        "lerp",
        "lgamma",
        "log",
        "log10",
        "log1p",
        "log2",
        "maximum",
        "minimum",
        "mul",
        "neg",
        "pow",
        "reciprocal",
        "round",
        "rsqrt",
        "sigmoid",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "sub",
        "tan",
        "tanh",
        "trunc",
        "zero",
    ]
)


@functools.cache
def _is_pointwise_foreach(func) -> bool:
    return func._schema.name.split("::")[1][len("_foreach_") :].rstrip("_") in _ELEMENTWISE


_NOT_APPLICABLE = object()


def _local_foreach(func, args: tuple, kwargs: dict):
    """The fast path of the module docstring (its result), or ``_NOT_APPLICABLE``. Runs once per optimizer op
    over every parameter, so the per-element checks read only cached spec facts."""
    if not _is_pointwise_foreach(func) or any(isinstance(v, (torch.Tensor, list, tuple)) for v in kwargs.values()):
        return _NOT_APPLICABLE
    inplace = is_inplace(func)
    first = args[0]
    if not isinstance(first, (list, tuple)) or not first or not all(isinstance(x, DTensor) for x in first):
        return _NOT_APPLICABLE
    specs = [x._spec for x in first]
    if any(s.has_partial() for s in specs) or (not inplace and not all(s.is_dense for s in specs)):
        return _NOT_APPLICABLE
    tokens = [s.layout_token for s in specs]
    local_args = [[x._local_tensor for x in first]]
    for i, a in enumerate(args[1:], start=1):
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            if len(a) != len(first) or not all(isinstance(y, DTensor) for y in a):
                return _NOT_APPLICABLE
            if [y._spec.layout_token for y in a] != tokens:
                return _NOT_APPLICABLE
            if not inplace and [y._spec.stride for y in a] != [s.stride for s in specs]:
                return _NOT_APPLICABLE
            local_args.append([y._local_tensor for y in a])
        elif isinstance(a, DTensor):
            if a.ndim > 0 or a._spec.has_partial():
                return _NOT_APPLICABLE
            local_args.append(a._local_tensor)  # a replicated 0-dim DTensor: the same value on every rank
        elif isinstance(a, torch.Tensor) and a.ndim > 0 and func._schema.arguments[i].name != "scalars":
            return _NOT_APPLICABLE
        else:
            local_args.append(a)
    out = func(*local_args, **kwargs)
    if inplace:
        return None
    return [_wrap_like(o, s) for o, s in zip(out, specs)]


def _wrap_like(out: torch.Tensor, spec) -> DTensor:
    if out.dtype != spec.dtype:
        spec = DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride, out.dtype)
    return DTensor(out, spec, requires_grad=False)


def foreach_handler(func, args: tuple, kwargs: dict):
    """Run a ``_foreach_*`` op as one local foreach call, or element by element through the per-tensor
    ops' rules."""
    fast = _local_foreach(func, args, kwargs)
    if fast is not _NOT_APPLICABLE:
        return fast
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
