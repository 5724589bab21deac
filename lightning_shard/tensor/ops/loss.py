"""Negative log-likelihood: ``nll_loss_forward``/``nll_loss2d_forward`` and their backward ops.

``F.cross_entropy`` decomposes into ``_log_softmax`` (softmax.py) and these ops; with ``label_smoothing``
it adds pointwise ops and sums covered by those rules.

The class (channel) dim — dim 1, or dim 0 of a 1-D input — is replicated; the other dims (batch, and
the spatial dims of ``nll_loss2d``) may stay sharded, input and target alike. ``weight`` is replicated.
Per ``reduction``:

* ``none``: the loss is sharded like the target.
* ``sum``: each rank sums its own rows: ``output`` and ``total_weight`` are ``Partial("sum")`` on every mesh
  dim where a batch/spatial dim is sharded.
* ``mean``: the mean over the whole batch is ``sum / total_weight`` with the *global* total weight (the
  number of non-ignored targets, or the sum of their class weights), which a mean of local means is not
  when shards are uneven or ``ignore_index`` hits ranks unequally. So the forward sums locally, all-reduces
  the (scalar) total weight, and returns ``output`` as ``Partial("sum")`` of ``local_sum / global_total``
  and ``total_weight`` replicated. Deliberately different from torch's DTensor, which returns
  ``Partial("avg")`` (only right for even shards without ignored targets) and refuses uneven shards.

Backward: ``grad_input`` is laid out like the input (channel dim replicated); ``grad_output`` is
replicated (sharded like the target for ``none``); for ``mean`` the replicated global ``total_weight`` makes
the local kernel's division exact.

Example: log-probabilities ``(Shard(0),)`` of shape ``(7, 5)`` with targets ``(Shard(0),)`` and the default
``reduction="mean"`` give a ``(Partial('sum'),)`` loss whose ``full_tensor()`` is the single-device loss.
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.dispatch import make_call, register_custom, wrap_outputs
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops._registry import OpCall, Plan, register
from lightning_shard.tensor.placements import Partial, Placement, Shard
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _channel(ndim: int) -> int:
    return 1 if ndim >= 2 else 0


def _target_dim(d: int, channel: int) -> int:
    return d if d < channel else d - 1


def _choose(inp: DTensorSpec, target: DTensorSpec) -> tuple[list[Placement], list[Placement]]:
    """Per mesh dim: a shard of a non-channel dim from the input (else from the target), for both."""
    c = _channel(inp.ndim)
    in_p, tg_p = [], []
    for i in range(inp.mesh.ndim):
        p, q = inp.placements[i], target.placements[i]
        if p.is_shard() and p.dim != c:
            d = p.dim
        elif q.is_shard():
            d = q.dim if q.dim < c else q.dim + 1
        else:
            in_p.append(REPLICATE)
            tg_p.append(REPLICATE)
            continue
        in_p.append(Shard(d))
        tg_p.append(Shard(_target_dim(d, c)))
    return in_p, tg_p


def _to_meta(a):
    if isinstance(a, DTensor):
        s = a._spec
        return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
    return a


@register_custom(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward_handler(func, args, kwargs):
    """``nll_loss_forward(self, target, weight, reduction, ignore_index) -> (output, total_weight)``."""
    call: OpCall = make_call(func, args, kwargs)
    args = call.args  # DTensors on a sub-mesh come back aligned onto the op's mesh (tensor/_submesh.py)
    inp, target, weight, reduction, ignore_index = args
    in_p, tg_p = _choose(inp._spec, target._spec)
    x = redistribute_local(inp._local_tensor, inp._spec, tuple(in_p))
    t = redistribute_local(target._local_tensor, target._spec, tuple(tg_p))
    w = None
    if weight is not None:
        w = redistribute_local(weight._local_tensor, weight._spec, tuple([REPLICATE] * call.mesh.ndim))
    split = tuple(Partial("sum") if p.is_shard() else REPLICATE for p in in_p)
    replicated = tuple([REPLICATE] * call.mesh.ndim)
    meta = func(_to_meta(inp), _to_meta(target), _to_meta(weight), reduction, ignore_index)
    if reduction == _NONE:
        out = func(x, t, w, reduction, ignore_index)
        return wrap_outputs(out, meta, [tuple(tg_p), replicated], call.mesh)
    if reduction == _SUM or split == replicated:
        out = func(x, t, w, reduction, ignore_index)
        return wrap_outputs(out, meta, [split, split], call.mesh)
    # mean over the whole batch: local sum / global total weight (see module docstring)
    local_sum, local_total = func(x, t, w, _SUM, ignore_index)
    total_spec = DTensorSpec(call.mesh, split, torch.Size([]), (), local_total.dtype)
    total = redistribute_local(local_total, total_spec, replicated)
    return wrap_outputs((local_sum / total, total), meta, [split, replicated], call.mesh)


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward_rule(call: OpCall) -> Plan:
    """``nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)``."""
    grad, inp, target = call.specs[:3]
    reduction = call.args[4]
    in_p, tg_p = _choose(inp, target)
    replicated = tuple([REPLICATE] * call.mesh.ndim)
    inputs = [tuple(tg_p) if reduction == _NONE else replicated, tuple(in_p), tuple(tg_p)]
    if call.args[3] is not None:
        inputs.append(replicated)  # class weights
    total = call.specs[-1]
    inputs.append(replicated if reduction == _MEAN else total.placements)
    return Plan(inputs, [tuple(in_p)])
