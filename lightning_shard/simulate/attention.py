"""``flash_attention_accounting``: inside a simulation, ``scaled_dot_product_attention`` keeps what a GPU's
flash attention keeps, not what the math path keeps.

On the simulator's stand-in device, torch's ``F.scaled_dot_product_attention`` takes the math path: it builds
the ``B x H x S x S`` scores and probabilities and keeps the probabilities for backward (8 GiB per layer for
Llama-3-8B at sequence 8192 in bf16), so the simulated peak would overstate a GPU's, where the fused kernels
(flash attention, memory-efficient attention) keep only ``q``, ``k``, ``v``, the output and a ``B x H x S``
fp32 log-sum-exp. While the context is open, ``F.scaled_dot_product_attention`` on fake tensors is replaced
by an autograd function that allocates exactly that:

* forward: the output (``... x S x Ev``) and the log-sum-exp (``... x S``, fp32); saves ``q, k, v``, the output,
  the log-sum-exp (and the mask, if any, as memory-efficient attention does);
* backward: the gradients of ``q``, ``k`` and ``v`` (their shapes and dtypes), plus the transient workspaces of
  flash attention 2's backward: an fp32 ``dq`` accumulator shaped like ``q`` and an fp32 ``B x H x S`` row sum
  (``softmax_d``); with grouped-query attention, ``dk``/``dv`` with the query's head count before they are
  summed over each group.

Tensors with data (a real run) go to torch's own function, so the context changes nothing outside the
simulation. Every engine simulated in one run gets the same accounting.

Example::

    with simulated_world(8) as world, flash_attention_accounting():
        loss = model(x).sum()      # each attention keeps q, k, v, out and a log-sum-exp, no S x S matrix
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

__all__ = ["flash_attention_accounting", "FlashAttentionAccounting"]


class FlashAttentionAccounting(torch.autograd.Function):
    """The allocations of a fused attention kernel on fake tensors (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale, enable_gqa):  # noqa: ARG004 (scale: no memory effect)
        _INSIDE[0] += 1  # a selective checkpointing policy saves these outputs (selective_ac.py)
        try:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        finally:
            _INSIDE[0] -= 1
        ctx.has_mask = attn_mask is not None
        ctx.save_for_backward(q, k, v, out, logsumexp, *([attn_mask] if ctx.has_mask else []))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, logsumexp, *_ = ctx.saved_tensors
        dq_accumulator = q.new_empty(q.shape, dtype=torch.float32)
        softmax_d = logsumexp.new_empty(logsumexp.shape)
        grouped = q.dim() >= 3 and k.shape[-3] != q.shape[-3]
        # flash attention 2 computes dk and dv per query head, then sums each group (grouped-query attention)
        expanded = [t.new_empty((*q.shape[:-1], t.shape[-1])) for t in (k, v)] if grouped else []
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del dq_accumulator, softmax_d, expanded
        return dq, dk, dv, None, None, None


_INSIDE = [0]  # > 0 while the accounting function's forward allocates its outputs


def inside_accounting() -> bool:
    """Whether the ops dispatched now are the fused attention's forward (its outputs)."""
    return _INSIDE[0] > 0


@contextlib.contextmanager
def flash_attention_accounting() -> Iterator[None]:
    """Replace ``F.scaled_dot_product_attention`` on fake tensors inside the block (see the module docstring)."""
    original = F.scaled_dot_product_attention

    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if not is_fake(query):
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return FlashAttentionAccounting.apply(query, key, value, attn_mask, scale, enable_gqa)

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
