"""``op_sac_context``: torchtitan's selective "op" activation checkpointing policy, for simulations of the
configuration published runs use (torchtitan's default for Llama: ``activation_checkpoint.mode = "selective"``,
``selective_ac_option = "op"``, in ``torchtitan/models/llama3/infra/parallelize.py``).

Inside each checkpointed block the policy keeps the outputs of matrix multiplies (``aten.mm``), except every
second one, of the fused attention kernels and of ``aten.max``, and recomputes everything else in backward. In
a simulation the fused attention is the accounting function of ``attention.py``, whose forward allocates its
output and log-sum-exp with ``new_empty``: ops run inside it are saved, as torchtitan saves the flash attention
op's outputs.

Example::

    checkpoint(block, x, use_reentrant=False, context_fn=op_sac_context)
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_shard.simulate import attention

__all__ = ["op_sac_context"]

_SAVE = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
})  # fmt: skip


def op_sac_context():
    """A fresh pair of SAC contexts with torchtitan's op policy (``checkpoint``'s ``context_fn``)."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if attention.inside_accounting():
            return CheckpointPolicy.MUST_SAVE
        if func is torch.ops.aten.mm.default:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            if counts[mode] % 2 == 0:  # every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
