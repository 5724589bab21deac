"""``log_sigmoid_forward(x) -> (output, buffer)`` (``F.logsigmoid``, ``multilabel_soft_margin_loss``): an
elementwise op with a second output for backward that has ``x``'s shape on CPU and is empty on CUDA.

On CPU both outputs keep ``x``'s shards (a ``Partial`` is reduced first: the op is not linear). Elsewhere the
meta kernel (which gives the buffer ``x``'s shape) does not describe the empty local buffer, so the rule
declines and the replicate fallback (whose outputs take their local shapes) computes it, counted.

Example::

    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    F.logsigmoid(x).placements      # (Shard(dim=0),)
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops._registry import OpCall, Plan, register

aten = torch.ops.aten


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_rule(call: OpCall) -> Plan | None:
    (spec,) = call.specs
    if call.args[0]._local_tensor.device.type != "cpu":
        return None
    ins = tuple(REPLICATE if p.is_partial() else p for p in spec.placements)
    return Plan([ins], [ins, ins])
