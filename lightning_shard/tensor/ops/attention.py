"""Scaled dot-product attention kernels that ``F.scaled_dot_product_attention`` reaches on DTensors.

On CPU that is ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``); with a mask that
requires grad, or dropout, SDPA takes the math path instead (``bmm``/``_safe_softmax``/pointwise ops, each
covered by its own rule).

Inputs are ``(B, H, L, E)`` query and ``(B, Hkv, S, E)`` key/value. Per mesh dim the batch dim (0) or the
heads dim (1) may stay sharded — every (batch, head) pair is independent — and everything else is
replicated (``Partial`` reduced). A shard on the heads dim needs query and key/value heads split alike:
always so without GQA (same head count, same ``torch.chunk`` split), and with GQA (``Hkv < H``) only when
``Hkv`` divides evenly over the ranks sharding heads (otherwise heads are gathered). ``attn_mask`` is
sharded along with batch/heads where it has that dim un-broadcast, replicated elsewhere. ``is_causal``,
``scale`` and ``dropout_p`` pass through unchanged (they do not depend on the split).

Example: q, k, v with ``(Shard(1),)`` (heads) give an output and logsumexp with ``(Shard(1),)``.
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops._registry import OpCall, Plan, register
from lightning_shard.tensor.placements import Placement, Shard, StridedShard
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten


def _heads_ok(q: DTensorSpec, kv: list[DTensorSpec], mesh_dims: list[int], mesh_shape) -> bool:
    """Whether sharding dim 1 over ``mesh_dims`` splits query heads and key/value heads consistently."""
    if all(s.shape[1] == q.shape[1] for s in kv):
        return True
    parts = 1
    for i in mesh_dims:
        parts *= mesh_shape[i]
    return all(s.shape[1] % parts == 0 for s in kv)


def _choose(main: list[DTensorSpec], mesh_shape) -> list[Placement]:
    """Per mesh dim: ``Shard(0)`` or ``Shard(1)`` if some main input has it (query first), else Replicate."""
    chosen: list[Placement] = []
    for i in range(len(mesh_shape)):
        pick: Placement = REPLICATE
        for s in main:
            p = s.placements[i]
            if p.is_shard() and p.dim in (0, 1) and not isinstance(p, StridedShard):
                pick = Shard(p.dim)
                break
        chosen.append(pick)
    heads = [i for i, p in enumerate(chosen) if p.is_shard(1)]
    q, kv = main[0], main[1:3]
    if heads and not _heads_ok(q, kv, heads, mesh_shape):
        chosen = [REPLICATE if p.is_shard(1) else p for p in chosen]
    return chosen


def _mask_placements(mask: DTensorSpec, chosen: list[Placement], full_ndim: int) -> tuple[Placement, ...]:
    """The mask broadcasts to (B, H, L, S): shard it where it has the chosen dim un-broadcast."""
    out = []
    for p in chosen:
        if p.is_shard():
            d = p.dim - (full_ndim - mask.ndim)
            if d >= 0 and mask.shape[d] != 1:
                out.append(Shard(d))
                continue
        out.append(REPLICATE)
    return tuple(out)


def _plan(call: OpCall, n_main: int, n_out: int) -> Plan:
    main = call.specs[:n_main]
    chosen = _choose([main[k] for k in _qkv_order(n_main)], call.mesh.shape)
    placements = tuple(chosen)
    inputs: list[tuple[Placement, ...]] = [placements] * n_main
    mask = call.kwargs.get("attn_mask")
    if mask is not None and len(call.specs) > n_main:
        inputs.append(_mask_placements(call.specs[n_main], chosen, 4))
    return Plan(inputs, [placements] * n_out)


def _qkv_order(n_main: int) -> list[int]:
    # forward: (q, k, v); backward: (grad_out, q, k, v, out, logsumexp) -> look at q, k, v first
    return [0, 1, 2] if n_main == 3 else [1, 2, 3, 0, 4, 5]


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_cpu_rule(call: OpCall) -> Plan:
    """Outputs: ``(out (B, H, L, Ev), logsumexp (B, H, L))``, both with the chosen batch/heads shards."""
    return _plan(call, n_main=3, n_out=2)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_cpu_backward_rule(call: OpCall) -> Plan:
    """Inputs ``grad_out, q, k, v, out, logsumexp``; outputs ``grad_q, grad_k, grad_v``."""
    return _plan(call, n_main=6, n_out=3)
