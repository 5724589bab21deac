"""Softmax family: ``_softmax``, ``_log_softmax``, ``_safe_softmax`` and the two backward ops.

The softmax dim is normalised over, so it must be whole on every rank: a shard on it is gathered and every
``Partial`` is reduced (softmax is not linear). Shards on any other dim stay, and the output has the
input's placements. Backward follows whichever of ``grad_output`` / ``output`` has more shards (torch's
choice), with the softmax dim replicated, and both inputs redistributed to that layout.

Example: ``torch.softmax(x, -1)`` on ``x`` with ``(Shard(0),)`` runs locally and returns ``(Shard(0),)``;
with ``(Shard(1),)`` on a 2-D ``x`` it all-gathers first and returns ``(Replicate(),)``.
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.ops._common import normalize_dim, unshard_dims
from lightning_shard.tensor.ops._registry import OpCall, Plan, register

aten = torch.ops.aten


@register(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    dim = normalize_dim(call.args[1], spec.ndim)
    placements = unshard_dims(spec.placements, [dim])
    return Plan([placements], [placements])


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(call: OpCall) -> Plan:
    grad, out = call.specs
    dim = normalize_dim(call.args[2], grad.ndim)

    def n_shards(spec) -> int:
        return sum(p.is_shard() for p in spec.placements)

    src = grad if n_shards(grad) >= n_shards(out) else out
    placements = unshard_dims(src.placements, [dim])
    return Plan([placements, placements], [placements])
