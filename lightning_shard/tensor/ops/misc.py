"""Ops with non-tensor results or no family of their own: ``equal``, ``is_same_size``, ``.item()``, and
a few pointwise ops the pointwise registry misses (in-place ``masked_fill_``, tensor-valued ``masked_fill``).

- ``aten.equal(a, b)``: global equality; ``b`` is laid out like ``a`` (partials reduced), local shards are
  compared and the verdict is all-reduced over the mesh, so every rank returns the same bool.
- ``aten.is_same_size``: compares global shapes, no communication.
- ``aten._local_scalar_dense`` (``.item()``): the value is made whole first.

Example::

    torch.equal(x, y)      # x, y DTensors: True on every rank iff their global values are equal
    x.sum().item()         # a Python number, the same on every rank
"""

from __future__ import annotations

import torch

from lightning_shard import comm
from lightning_shard.tensor.dispatch import dispatch, register_custom
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops._registry import RULES, OpCall, Plan
from lightning_shard.tensor.ops.pointwise import pointwise_rule
from lightning_shard.tensor.redistribute import redistribute_local

aten = torch.ops.aten


def _local(t, placements) -> torch.Tensor:
    return redistribute_local(t._local_tensor, t._spec, placements) if isinstance(t, DTensor) else t


@register_custom(aten.equal.default)
def equal_handler(func, args: tuple, kwargs: dict) -> bool:
    a, b = args[0], args[1]
    ref = a if isinstance(a, DTensor) else b
    mesh = ref.device_mesh
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False  # global metadata: every rank decides alike without communicating
    placements = tuple(REPLICATE if p.is_partial() else p for p in ref.placements)
    same = torch.equal(_local(a, placements), _local(b, placements))
    verdict = torch.tensor([1 if same else 0], dtype=torch.int32, device=ref._local_tensor.device)
    with comm.host_collectives_for(verdict):  # the shards' device: the host for offloaded ones
        for i in range(mesh.ndim):
            comm.all_reduce(verdict, mesh.get_group(i), "min")
    return bool(verdict.item())


@register_custom(aten.is_same_size.default)
def is_same_size_handler(func, args: tuple, kwargs: dict) -> bool:
    return tuple(args[0].shape) == tuple(args[1].shape)


@register_custom(aten._local_scalar_dense.default)
def item_handler(func, args: tuple, kwargs: dict):
    x: DTensor = args[0]
    return _local(x, tuple([REPLICATE] * x.device_mesh.ndim)).item()


def masked_fill_rule(call: OpCall) -> Plan:
    """``x.masked_fill(mask, v)``: pointwise, and linear enough to keep a ``Partial("sum"/"avg")`` ``x``
    (autograd fills partial gradients in place, e.g. in the norm backward): masked positions get ``v`` as
    one rank's term (sum) or every rank's (avg); the mask is made whole on that mesh dim."""
    plan = pointwise_rule(call)
    x_spec = call.specs[0]
    value = call.args[2]
    if not isinstance(value, (int, float, bool)):
        return plan
    sum_dims = [i for i, p in enumerate(x_spec.placements) if p.is_partial() and p.reduce_op == "sum"]
    keep = [i for i, p in enumerate(x_spec.placements) if p.is_partial() and p.reduce_op in ("sum", "avg")]
    if not keep:
        return plan
    ins = [list(p) for p in plan.inputs]
    outs = [list(p) for p in plan.outputs]
    for i in keep:
        ins[0][i] = x_spec.placements[i]
        for k in range(1, len(ins)):
            ins[k][i] = REPLICATE
        for o in outs:
            o[i] = x_spec.placements[i]
    coord = call.mesh.get_coordinate()
    local_value = value if all(coord[i] == 0 for i in sum_dims) else 0
    local = ((call.args[0], call.args[1], local_value, *call.args[3:]), call.kwargs)
    return Plan([tuple(p) for p in ins], [tuple(o) for o in outs], local)


for _op in (aten.masked_fill.Scalar, aten.masked_fill_.Scalar):
    RULES[_op] = masked_fill_rule
for _op in (aten.masked_fill_.Tensor, aten.masked_fill.Tensor):
    RULES.setdefault(_op, pointwise_rule)


# ----------------------------------------------------------------------------------------------- out= variants
def _functional_twin(op):
    """The overload of ``op``'s packet that takes the same arguments minus the single ``out`` tensor."""
    schema = op._schema
    names = [a.name for a in schema.arguments if a.name != "out"]
    packet = getattr(aten, schema.name.split("::")[1])
    for name in packet.overloads():
        twin = getattr(packet, name)
        s = twin._schema
        if not s.is_mutable and [a.name for a in s.arguments] == names and len(s.returns) == 1:
            return twin
    return None


def out_variant_handler(func, args: tuple, kwargs: dict):
    """``op(..., out=t)`` (e.g. ``torch.maximum(a, b, out=a)`` in Adam's amsgrad): compute the functional op
    through its rule, then ``copy_`` into ``out`` (which keeps its placements)."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out")
    twin = _OUT_TWINS[func]
    result = dispatch(twin, args, kwargs)
    if tuple(result.shape) != tuple(out.shape):
        raise RuntimeError(
            f"{func}: out= has shape {tuple(out.shape)} but the result has shape {tuple(result.shape)}; "
            "DTensor out= arguments are not resized, pass one of the right shape"
        )
    dispatch(aten.copy_.default, (out, result), {})
    return out


_OUT_TWINS: dict = {}


def _register_out_variants() -> None:
    for s in torch._C._jit_get_all_schemas():
        if not s.name.startswith("aten::") or not s.overload_name.endswith("out"):
            continue
        mutable = [a for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
        if len(mutable) != 1 or mutable[0].name != "out" or not mutable[0].kwarg_only:
            continue
        packet = getattr(aten, s.name.split("::")[1], None)
        op = getattr(packet, s.overload_name, None) if packet is not None else None
        if op is None or op in RULES:
            continue
        twin = _functional_twin(op)
        if twin is not None and torch.Tag.nondeterministic_seeded not in twin.tags:
            _OUT_TWINS[op] = twin
            register_custom(op)(out_variant_handler)


_register_out_variants()
