"""Pointwise ops with broadcasting, in-place variants, dtype casts and copies.

Per mesh dim: the output follows the first argument sharded on a non-broadcast dim (for in-place ops, the
``self`` argument); the other arguments are redistributed to match (a broadcast dim is replicated). A
``Partial`` survives only where the op is linear in it: ``add``/``sub`` of partials (a replicated operand
is turned into a partial term locally), ``mul``/``div`` of one partial by replicated values, ``neg``, and
copies/casts (except a sum's cast to an integer or bool dtype). Everywhere else partials are reduced first.

Example: ``x (Shard(0)) + bias (Replicate())`` runs locally and returns ``Shard(0)``.
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops._registry import RULES, OpCall, Plan
from lightning_shard.tensor.placements import Partial, Placement, Shard, StridedShard

aten = torch.ops.aten

_ADDITIVE = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor}
_MULTIPLICATIVE = {aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}
_SCALAR_LINEAR = {
    aten.mul.Scalar,
    aten.mul_.Scalar,
    aten.div.Scalar,
    aten.div_.Scalar,
    aten.neg.default,
    aten.neg_.default,
    aten.zero_.default,
}
# Adding a constant commutes with an average (avg(x_k + c) = avg(x_k) + c), not with a sum.
_AVG_SHIFTS = {
    aten.add.Scalar,
    aten.add_.Scalar,
    aten.sub.Scalar,
    aten.sub_.Scalar,
    aten.add.Tensor,
    aten.add_.Tensor,
    aten.sub.Tensor,
    aten.sub_.Tensor,
}
# Adding a constant to a sum of terms: one rank adds it, the others add 0.
_SCALAR_SHIFTS = {aten.add.Scalar, aten.add_.Scalar, aten.sub.Scalar, aten.sub_.Scalar}
_COPIES = {
    aten.clone.default,
    aten._to_copy.default,
    aten.detach.default,
    aten.alias.default,
    aten.alias_copy.default,
    aten.copy_.default,
    aten.positive.default,
    aten.lift_fresh.default,
}


def _tensor_args(call: OpCall) -> list:
    return [a for a in call.flat if isinstance(a, torch.Tensor)]


def _casts_to_integer(call: OpCall) -> bool:
    """Whether a copy op writes an integer or bool result (``_to_copy(dtype=...)``, ``copy_`` into one)."""
    if call.func == aten._to_copy.default:
        dtype = call.kwargs.get("dtype")
    elif call.func == aten.copy_.default:
        dtype = call.args[0].dtype
    else:
        return False
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


def _partial_ok(call: OpCall, partials: list[Partial], position_of_partial: list[int]) -> bool:
    """Whether the op may keep a Partial on this mesh dim, given which DTensor args are partial."""
    func = call.func
    ops = {p.reduce_op for p in partials}
    if len(ops) != 1:
        return False
    (op,) = ops
    if func in _COPIES:
        # a sum of truncated terms is not the truncated sum: a cast of a sum/avg partial to an integer or
        # bool dtype reduces first (max/min commute with the monotone cast)
        return op in ("max", "min") or not _casts_to_integer(call)
    if op not in ("sum", "avg"):
        return False
    if func in _SCALAR_LINEAR:
        return True
    if op == "avg" and func in _AVG_SHIFTS and len(call.specs) == 1:
        return True  # e.g. rms_norm's mean(x^2) + eps on a tensor sharded along the normalized dim
    if op == "sum" and func in _SCALAR_SHIFTS and len(call.specs) == 1:
        return True  # the constant is added on one rank only (pointwise_rule's local_args)
    if func in _ADDITIVE:
        # a plain scalar (number or 0-dim tensor) would be added once per rank: to a sum, it is added on one
        # rank only (pointwise_rule's local_args)
        return all(isinstance(a, DTensor) for a in call.args[:2]) or (
            op == "sum" and len(call.specs) == 1 and isinstance(call.args[0], DTensor)
        )
    if func in _MULTIPLICATIVE:
        if len(position_of_partial) != 1:
            return False
        is_div = func.overloadpacket in (aten.div, aten.div_)
        return not is_div or position_of_partial[0] == 0
    return False


def pointwise_rule(call: OpCall) -> Plan:
    specs = call.specs
    out_shape = torch.broadcast_shapes(*[tuple(a.shape) for a in _tensor_args(call)])
    inplace = call.is_inplace()
    inputs: list[list[Placement]] = [[] for _ in specs]
    outputs: list[Placement] = []
    for i in range(call.mesh.ndim):
        here = [s.placements[i] for s in specs]
        choice = _choose(call, here, out_shape, inplace)
        for j, s in enumerate(specs):
            inputs[j].append(_input_placement(choice, s, here[j], out_shape, call.func))
        outputs.append(choice)
    # frexp returns (mantissa, exponent), each laid out like the result
    n_out = 0 if inplace else len(call.func._schema.returns)
    plan = Plan([tuple(p) for p in inputs], [tuple(outputs)] * n_out)
    if call.func in _SCALAR_SHIFTS or (call.func in _ADDITIVE and not isinstance(call.args[1], DTensor)):
        plan.local_args = _shift_on_one_rank(call, inputs[0])
    return plan


def _shift_on_one_rank(call: OpCall, placements) -> tuple[tuple, dict] | None:
    """``x + c`` on a ``Partial("sum")`` x: ranks off index 0 of a sum-partial mesh dim add 0 instead of c."""
    coord = call.mesh.get_coordinate()
    if any(p.is_partial() and p.reduce_op == "sum" and coord[i] != 0 for i, p in enumerate(placements)):
        c = call.args[1]
        zero = torch.zeros_like(c) if isinstance(c, torch.Tensor) else 0
        return (call.args[0], zero, *call.args[2:]), call.kwargs
    return None


def _choose(call: OpCall, here: list[Placement], out_shape, inplace: bool) -> Placement:
    specs = call.specs
    out_ndim = len(out_shape)
    if inplace:
        first = here[0]
        if first.is_partial():
            partial_positions = [j for j, p in enumerate(here) if p.is_partial()]
            ok = _partial_ok(call, [p for p in here if p.is_partial()], partial_positions)
            return first if ok else REPLICATE  # REPLICATE makes run_plan raise a clear in-place error
        return first
    for j, p in enumerate(here):
        if p.is_shard():
            od = p.dim + out_ndim - specs[j].ndim
            if specs[j].shape[p.dim] == out_shape[od]:
                return _with_dim(p, od)
    partials = [p for p in here if p.is_partial()]
    if partials:
        positions = [j for j, p in enumerate(here) if p.is_partial()]
        if _partial_ok(call, partials, positions):
            return partials[0]
    return REPLICATE


def _input_placement(choice: Placement, spec, current: Placement, out_shape, func=None) -> Placement:
    if choice.is_shard():
        d = choice.dim - (len(out_shape) - spec.ndim)
        if d >= 0 and spec.shape[d] == out_shape[choice.dim]:
            return _with_dim(choice, d)
        return REPLICATE
    if choice.is_partial():
        if current.is_partial():
            return current
        # replicated operands become partial terms of a sum, but stay whole as factors/divisors of mul/div
        return choice if func in _ADDITIVE or func in _COPIES else REPLICATE
    return REPLICATE


def _with_dim(p: Placement, dim: int) -> Placement:
    """``p`` moved to tensor dim ``dim``, keeping its kind (a StridedShard stays strided)."""
    if p.dim == dim:
        return p
    return StridedShard(dim, p.split_factor) if isinstance(p, StridedShard) else Shard(dim)


def _register_all() -> None:
    # elementwise ops torch does not tag as pointwise
    untagged = {
        aten.rsub.Tensor,
        aten.rsub.Scalar,
        aten.floor_divide.default,
        aten.floor_divide.Scalar,
        aten.floor_divide_.Tensor,
        aten.floor_divide_.Scalar,
        aten.hardswish.default,
        aten.hardswish_.default,
        aten.complex.default,
        aten.polar.default,
        aten._conj.default,  # a view setting the conjugate bit (hfft, ihfft)
        aten.fill.Scalar,
        aten.fill.Tensor,
        # activation backwards (grad_output, self or result): elementwise, but not tagged pointwise by torch
        aten.elu_backward.default,
        aten.hardtanh_backward.default,
        aten.leaky_relu_backward.default,
        aten.softplus_backward.default,
        aten.hardswish_backward.default,
        aten.hardsigmoid_backward.default,
        aten.hardshrink_backward.default,
        aten.softshrink_backward.default,
        aten.mish_backward.default,
    }
    explicit = _ADDITIVE | _MULTIPLICATIVE | _SCALAR_LINEAR | _COPIES | _AVG_SHIFTS | {aten.fill_.Scalar} | untagged
    for op in explicit:
        RULES[op] = pointwise_rule
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            tags = op.tags
            if torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and op not in RULES:
                if "out" in overload:
                    continue
                RULES[op] = pointwise_rule


_register_all()
