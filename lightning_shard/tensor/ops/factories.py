"""Factory ops that take a DTensor argument: ``*_like`` and ``new_*``. None of them reads the input's values,
so no input is ever redistributed.

- ``zeros_like``/``ones_like``/``empty_like``/``full_like``: the result is laid out like the input (each rank
  makes its local shard); a ``Partial`` becomes ``Replicate`` (ones on every rank would sum to n).
- ``new_zeros``/``new_ones``/``new_empty``/``new_full(size)``: ``Replicate`` of the requested global size
  (every rank makes the whole tensor; it is usually small, e.g. the zero buffer of an index backward).
- ``new_empty_strided(size, stride)`` with ``size == self.shape`` (autograd's gradient-layout copy
  ``grad.new_empty_strided(param.shape, param.stride()).copy_(grad)``) is laid out like ``self``, so the copy
  needs no communication; other sizes are ``Replicate``.

Random ``*_like`` ops (``rand_like``...) live in ``random.py``.

Example::

    x = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    torch.zeros_like(x).placements      # (Shard(dim=0),)
    x.new_zeros(3).placements           # (Replicate(),)
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops._registry import OpCall, Plan, register
from lightning_shard.tensor.ops.views import local_shape

aten = torch.ops.aten


def _like_input(call: OpCall) -> tuple:
    spec = call.specs[0]
    return tuple(REPLICATE if p.is_partial() else p for p in spec.placements)


@register(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default)
def like_rule(call: OpCall) -> Plan:
    spec = call.specs[0]
    return Plan([spec.placements], [_like_input(call)])


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
def new_rule(call: OpCall) -> Plan:
    spec = call.specs[0]
    return Plan([spec.placements], [tuple([REPLICATE] * call.mesh.ndim)])


@register(aten.new_empty_strided.default)
def new_empty_strided_rule(call: OpCall) -> Plan:
    spec = call.specs[0]
    size, stride = list(call.args[1]), list(call.args[2])
    if tuple(size) != tuple(spec.shape):
        return Plan([spec.placements], [tuple([REPLICATE] * call.mesh.ndim)])
    outs = _like_input(call)
    local = local_shape(size, outs, call.mesh)
    args = (call.args[0], local, _strides_like(local, stride), *call.args[3:])
    return Plan([spec.placements], [outs], (args, call.kwargs))


def _strides_like(shape: list[int], stride: list[int]) -> list[int]:
    """Dense strides for ``shape`` with the dim order of ``stride`` (the local shard of a strided tensor)."""
    order = sorted(range(len(shape)), key=lambda d: stride[d], reverse=True)
    out, acc = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = acc
        acc *= max(shape[d], 1)
    return out
