"""``select_scatter`` and ``diagonal_scatter``: ``self`` with a slice of it replaced by ``src`` (the
functional forms of writing through ``select`` and ``diagonal``; ``slice_scatter`` is in ``dimwise.py``).

``src`` has the shape of the view: ``self`` without the selected dim, or without ``dim1``/``dim2`` and with
the diagonal last. A shard of ``self`` on a dim the view keeps stays, and ``src`` is sharded on the matching
dim of the view; a shard on a selected dim, and every ``Partial``, is replicated first.

Example::

    x = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)])
    src = distribute_tensor(torch.ones(6), mesh, [Shard(0)])
    torch.select_scatter(x, src, 0, 2).placements      # (Shard(dim=1),), no communication
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_shard.tensor.ops._common import REPLICATE, normalize_dim
from lightning_shard.tensor.ops._registry import OpCall, Plan, register
from lightning_shard.tensor.ops.dimwise import _arg
from lightning_shard.tensor.ops.views import same_kind

aten = torch.ops.aten


def _scatter_rule(view_dims: Callable[[OpCall, int], tuple[set[int], Callable[[int], int]]]):
    """A rule from ``view_dims(call, ndim) -> (dims the view removes, view dim of each kept dim)``."""

    def rule(call: OpCall) -> Plan:
        spec = call.specs[0]
        removed, to_view = view_dims(call, spec.ndim)
        ins, src = [], []
        for p in spec.placements:
            if p.is_shard() and p.dim not in removed:
                ins.append(p)
                src.append(same_kind(p, to_view(p.dim)))
            else:
                ins.append(REPLICATE)
                src.append(REPLICATE)
        inputs = [tuple(ins)] + [tuple(src)] * (len(call.specs) - 1)
        return Plan(inputs, [tuple(ins)])

    return rule


def _select(call: OpCall, ndim: int):
    dim = normalize_dim(_arg(call, "dim"), ndim)
    return {dim}, (lambda d: d - (d > dim))


def _diagonal(call: OpCall, ndim: int):
    d1 = normalize_dim(_arg(call, "dim1", 0), ndim)
    d2 = normalize_dim(_arg(call, "dim2", 1), ndim)
    return {d1, d2}, (lambda d: d - (d > d1) - (d > d2))


register(aten.select_scatter.default)(_scatter_rule(_select))
register(aten.diagonal_scatter.default)(_scatter_rule(_diagonal))
