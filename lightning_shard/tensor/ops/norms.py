"""Normalisation layers: ``native_layer_norm`` and ``_fused_rms_norm``, forward and backward, and
``native_group_norm``'s backward (its forward is a ``dimwise.py`` rule).

The normalised (trailing) dims must be whole on every rank, so shards on them are gathered and every
``Partial`` is reduced; a shard on a leading dim stays (rows are normalised independently). ``weight`` and
``bias`` are replicated. ``mean``/``rstd`` have the input's leading dims and keep its leading shards.

Backward: ``grad_input`` keeps the leading shard; ``grad_weight``/``grad_bias`` sum over the leading dims,
so on every mesh dim where a leading dim is sharded each rank holds a term of them: ``Partial("sum")``
(torch's DTensor gives the same placements; the FSDP/TP layer reduces them where it wants).

Note: on CPU, ``F.rms_norm`` is decomposed above the dispatcher into ``pow``/``mean``/``rsqrt``/``mul``
(pointwise and reduction rules cover it); ``_fused_rms_norm`` is what CUDA builds and direct callers reach.

Example: ``F.layer_norm(x, (D,), w, b)`` with ``x`` ``(Shard(0),)`` of shape ``(B, S, D)`` runs locally
and returns ``(Shard(0),)``; its backward gives ``w.grad`` as ``(Partial("sum"),)``.
"""

from __future__ import annotations

import torch

from lightning_shard.tensor._layout import local_shape_and_offset
from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops._registry import OpCall, Plan, register
from lightning_shard.tensor.placements import Partial, Placement
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten


def _leading(p: Placement, axis: int) -> bool:
    return p.is_shard() and p.dim < axis


def _choose(specs: list[DTensorSpec], mesh_ndim: int, axis: int) -> list[Placement]:
    """Per mesh dim: the first candidate spec's leading-dim shard, else Replicate."""
    out = []
    for i in range(mesh_ndim):
        pick = next((s.placements[i] for s in specs if _leading(s.placements[i], axis)), REPLICATE)
        out.append(pick)
    return out


def _others_replicated(call: OpCall, n_main: int) -> list[tuple[Placement, ...]]:
    return [tuple([REPLICATE] * call.mesh.ndim) for _ in call.specs[n_main:]]


@register(aten.native_layer_norm.default, aten._fused_rms_norm.default)
def norm_forward_rule(call: OpCall) -> Plan:
    """Inputs: ``input``, then weight/bias (replicated). Outputs: ``out``, stats (``mean``, ``rstd`` or ``rrms``)."""
    x = call.specs[0]
    axis = x.ndim - len(call.args[1])
    chosen = tuple(_choose([x], call.mesh.ndim, axis))
    n_stats = 2 if call.func == aten.native_layer_norm.default else 1
    return Plan([chosen, *_others_replicated(call, 1)], [chosen] * (1 + n_stats))


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(call: OpCall) -> Plan:
    """Args: ``grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask``."""
    grad, x = call.specs[0], call.specs[1]
    axis = x.ndim - len(call.args[2])
    chosen = tuple(_choose([x, grad], call.mesh.ndim, axis))
    mask = call.args[7]
    has = [mask[0], mask[1] and call.args[5] is not None, mask[2] and call.args[6] is not None]
    return _backward_plan(call, chosen, n_main=4, has_outputs=has)


@register(aten._fused_rms_norm_backward.default)
def rms_norm_backward_rule(call: OpCall) -> Plan:
    """Args: ``grad_out, input, normalized_shape, rstd, weight?, output_mask``."""
    grad, x = call.specs[0], call.specs[1]
    axis = x.ndim - len(call.args[2])
    chosen = tuple(_choose([x, grad], call.mesh.ndim, axis))
    mask = call.args[5]
    has = [mask[0], mask[1] and call.args[4] is not None]
    return _backward_plan(call, chosen, n_main=3, has_outputs=has)


@register(aten.native_group_norm_backward.default)
def group_norm_backward_rule(call: OpCall) -> Plan:
    """Args: ``grad_out, input, mean, rstd, weight?, N, C, HxW, group, output_mask``. Groups are normalised per
    sample, so a batch (dim 0) shard stays, as in the forward (``dimwise.py``), where every rank holds a piece
    (the kernel refuses an empty batch); ``mean``/``rstd`` are ``(N, group)`` and follow it. The local call
    gets the local batch size."""
    grad, x = call.specs[0], call.specs[1]
    chosen = list(_choose([x, grad], call.mesh.ndim, axis=1))
    ways = 1
    for i, p in enumerate(chosen):
        ways *= call.mesh.size(i) if p.is_shard() else 1
    if x.shape[0] < ways:
        chosen = [REPLICATE] * call.mesh.ndim
    chosen = tuple(chosen)
    plan = _backward_plan(call, chosen, n_main=4, has_outputs=list(call.args[9]))
    n_local = local_shape_and_offset(x.shape, chosen, call.mesh.shape, call.mesh.get_coordinate())[0][0]
    plan.local_args = ((*call.args[:5], n_local, *call.args[6:]), call.kwargs)
    return plan


def _backward_plan(call: OpCall, chosen: tuple[Placement, ...], n_main: int, has_outputs: list[bool]) -> Plan:
    # grad_weight / grad_bias: each rank summed over its own rows only
    param_grad = tuple(Partial("sum") if p.is_shard() else REPLICATE for p in chosen)
    outputs = [chosen] + [param_grad] * (len(has_outputs) - 1)
    outputs = [o for o, h in zip(outputs, has_outputs) if h]
    return Plan([chosen] * n_main + _others_replicated(call, n_main), outputs)
