"""Batch norm forward (``native_batch_norm``, ``_native_batch_norm_legit``, ``_batch_norm_with_update``): a
*replicate rule*.

Batch norm reduces over the batch and spatial dims and, when training, updates ``running_mean`` and
``running_var`` in place, which its schema does not declare as written (``Tensor?``, not ``Tensor(a!)``).
The rule computes it on replicated inputs and writes the running statistics back into each argument's own
shards (keeping their placements), exactly as the replicate fallback does, but as a decided rule: it is not
counted in ``fallback_counts()`` and runs under ``fallback_policy("error")``. torch's DTensor keeps
channel shards (``Shard(1)`` of the input with ``Shard(0)`` statistics) instead; that layout is rare outside
tests, so the whole-tensor rule is what we have.

Example::

    x = distribute_tensor(torch.randn(8, 3, 4, 4), mesh, [Shard(0)])
    F.batch_norm(x, rm, rv, training=True).placements      # (Replicate(),); rm, rv updated in place
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.dispatch import make_call, register_custom
from lightning_shard.tensor.fallback import run_replicated

aten = torch.ops.aten

REPLICATE_RULE_OPS = (
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default,
    aten._batch_norm_with_update.default,
)


@register_custom(*REPLICATE_RULE_OPS)
def batch_norm_handler(func, args: tuple, kwargs: dict):
    call = make_call(func, args, kwargs)  # the dispatcher's argument checks (one mesh, scalar-like plain tensors)
    return run_replicated(func, call.args, call.kwargs)
