"""Gradients of torch's operator database through our DTensor on 2 ranks: no op may give a wrong gradient.

Uses the harness of ``benchmarks/dtensor_opdb_grad.py`` (float32 samples of ops with autograd, leaves
``Replicate`` and ``Shard(0)``, a fixed upstream gradient, every input's gradient gathered and compared with the
plain op's). The quick test covers the ops real models train through (linear/matmul, embedding, norms,
softmax, losses, views, cat/stack, gather/index_select, where) and the ones that need particular handling:

- backwards that build a plain tensor from a DTensor's global sizes (``at::zeros(self.sizes())``) and mix it
  with DTensors (``index_put``, ``prod``, ``select_scatter``, ``cummax`` ...), taken as Replicate once it is
  the same on every rank; ``cummax`` of a 0-dim input (the scatter rule hands it to the fallback);
- activation backwards torch does not tag as pointwise (``leaky_relu``, ``softplus``, ``hardswish``),
  ``glu``'s, the pooling backwards (``avg_pool2d``, ``adaptive_avg_pool2d``) and group norm's, which have rules
  (no fallback).

Two direct tests pin the safety of the first fix: a plain tensor that differs between ranks inside a backward
still raises on every rank, and one in forward code still raises. The full database runs under ``-m slow``.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_shard import init_device_mesh
from lightning_shard.tensor import Replicate, Shard, distribute_tensor, fallback_counts, reset_fallback_counts
from tests.harness import distributed
from tests.opdb import harness, run_ours

pytest.importorskip("expecttest")  # torch.testing._internal imports it

REAL_MODELS = [
    "nn.functional.linear", "nn.functional.embedding", "nn.functional.layer_norm", "log_softmax",
    "nn.functional.cross_entropy", "cat", "gather", "where",
]  # fmt: skip
FORMULA_PLAIN = ["index_put", "prod", "select_scatter", "cummax"]
RULE_BACKWARDS = [
    "nn.functional.leaky_relu", "nn.functional.softplus", "nn.functional.hardswish", "nn.functional.glu",
    "nn.functional.avg_pool2d", "nn.functional.adaptive_avg_pool2d",
]  # fmt: skip


def _run(names, samples: int = 3, few: tuple = ()):
    """(status, detail) per op key; the ops named in ``few`` run their first sample only."""
    grad = harness("dtensor_opdb_grad")

    def one(opinfo, lib):
        return {grad.fwd.op_key(opinfo): grad.run_op(opinfo, "ours", lib, 1 if opinfo.name in few else samples)}

    return run_ours(names, one)


@distributed(world_size=2, timeout=600)
def test_op_database_gradients_subset():
    results = _run(REAL_MODELS + FORMULA_PLAIN + RULE_BACKWARDS, samples=2, few=tuple(REAL_MODELS))
    assert len(results) >= len(REAL_MODELS + FORMULA_PLAIN + RULE_BACKWARDS), sorted(results)
    bad = {k: r for k, r in results.items() if r[0] in ("wrong", "error", "skipped")}
    assert not bad, bad
    for name in FORMULA_PLAIN:
        assert results[name][0] in ("clean", "fallback"), (name, results[name])
    for name in RULE_BACKWARDS:
        assert results[name][0] == "clean", (name, results[name])


class _MixesPlain(torch.autograd.Function):
    """Identity forward; the backward adds a plain tensor to the DTensor gradient: the same on every rank
    (``"same"``), with rank-dependent values (``"values"``) or a rank-dependent shape (``"shape"``)."""

    @staticmethod
    def forward(ctx, x, mode: str):
        ctx.mode = mode
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank()
        if ctx.mode == "shape":
            plain = torch.ones(4 if rank == 0 else 1, 3)  # broadcasts either way; an all-reduce of each would hang
        else:
            plain = torch.full(grad.shape, float(rank if ctx.mode == "values" else 3))
        return grad + plain, None


@distributed(world_size=2)
def test_plain_tensor_in_backward_is_replicated_only_when_the_same_on_every_rank():
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_()
    _MixesPlain.apply(x, "same").sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), torch.full((4, 3), 4.0))
    for mode in ("values", "shape"):
        y = distribute_tensor(torch.randn(4, 3), mesh, [Replicate()]).requires_grad_()
        with pytest.raises(RuntimeError, match="mixed with DTensor arguments.*differs"):
            _MixesPlain.apply(y, mode).sum().backward()
    with pytest.raises(RuntimeError, match="mixed with DTensor arguments"):
        _ = y + torch.zeros(4, 3)  # forward code: refused without a collective, as before


@distributed(world_size=2)
def test_cummax_of_a_0_dim_dtensor_backward():
    """cummax's backward scatters into ``at::zeros`` of the input's sizes: a plain 0-dim tensor, which the
    scatter rule took for a DTensor (ValueError: not enough values to unpack)."""
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.tensor(2.5), mesh, [Replicate()]).requires_grad_()
    values, _ = torch.cummax(x, 0)
    (values * 3).backward()
    ref = torch.tensor(2.5, requires_grad=True)
    (torch.cummax(ref, 0)[0] * 3).backward()
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad)


@distributed(world_size=2)
def test_group_norm_backward_keeps_the_batch_shard():
    """native_group_norm_backward went through the replicate fallback; uneven batch (3 over 2 ranks)."""
    torch.manual_seed(0)
    x, w, b, up = torch.randn(3, 4, 5), torch.randn(4), torch.randn(4), torch.randn(3, 4, 5)
    mesh = init_device_mesh("cpu", (2,))
    leaves = [
        distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in ((x, Shard(0)), (w, Replicate()), (b, Replicate()))
    ]
    reset_fallback_counts()
    out = torch.nn.functional.group_norm(leaves[0], 2, leaves[1], leaves[2])
    out.backward(distribute_tensor(up, mesh, [Shard(0)]))
    assert fallback_counts() == {}
    assert leaves[0].grad.placements == (Shard(0),)
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    torch.nn.functional.group_norm(refs[0], 2, refs[1], refs[2]).backward(up)
    for leaf, ref in zip(leaves, refs):
        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@distributed(world_size=2, timeout=7200)
def test_full_op_database_has_no_wrong_gradient():
    results = _run(None)
    wrong = {k: r for k, r in results.items() if r[0] == "wrong"}
    assert not wrong, wrong
