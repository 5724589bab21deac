"""Sharding rules of the math op families (matmul, embedding, softmax, norms, SDPA, NLL loss) on 2 and 4 gloo
ranks: every result and gradient equals plain torch on full tensors, output placements equal torch's own
DTensor where it has a rule (unless documented otherwise), and none of these ops hit the fallback.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
import torch.nn.functional as F

from lightning_shard import init_device_mesh
from lightning_shard.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    reset_fallback_counts,
)
from lightning_shard.tensor.dispatch import make_call
from lightning_shard.tensor.ops.norms import norm_forward_rule, rms_norm_backward_rule
from tests.harness import distributed

aten = torch.ops.aten
R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
PS = Partial("sum")

# Ops whose rules live in the modules under test: none of them may reach the fallback.
OWNED = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.mv.default",
    "aten.dot.default",
    "aten.embedding.default",
    "aten.embedding_dense_backward.default",
    "aten._softmax.default",
    "aten._log_softmax.default",
    "aten._safe_softmax.default",
    "aten._softmax_backward_data.default",
    "aten._log_softmax_backward_data.default",
    "aten.native_layer_norm.default",
    "aten.native_layer_norm_backward.default",
    "aten._fused_rms_norm.default",
    "aten._fused_rms_norm_backward.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "aten.nll_loss_forward.default",
    "aten.nll_loss_backward.default",
    "aten.nll_loss2d_forward.default",
    "aten.nll_loss2d_backward.default",
}


# ----------------------------------------------------------------------------------------------- helpers
def _leaf(t: torch.Tensor, mesh, placements) -> DTensor:
    """A DTensor leaf (requires grad when floating) holding ``t`` laid out as ``placements``."""
    t = t.clone()
    if t.is_floating_point():
        t.requires_grad_()
    return distribute_tensor(t, mesh, placements)


def _dt(t: torch.Tensor, mesh, placements) -> DTensor:
    """A DTensor (no grad) with ``placements``; ``Partial`` ones are built from a split of ``t`` into terms."""
    placements = list(placements)
    if not any(p.is_partial() for p in placements):
        return distribute_tensor(t.clone(), mesh, placements)
    base = [R if p.is_partial() else p for p in placements]
    x = distribute_tensor(t.clone(), mesh, base)
    # uneven terms: rank-dependent noise that cancels in the sum
    local = x._local_tensor.clone()
    coord = mesh.get_coordinate()
    for i, p in enumerate(placements):
        if p.is_partial():
            n = mesh.shape[i]
            # a private generator: local shapes differ across ranks, the global RNG must not diverge
            gen = torch.Generator().manual_seed(1000 + i)
            noise = torch.randn((n, *local.shape), dtype=local.dtype, generator=gen)
            noise = noise - noise.mean(0, keepdim=True)
            local = (local / n if p.reduce_op == "sum" else local) + noise[coord[i]]
    return DTensor.from_local(local, mesh, placements, shape=t.shape, stride=t.stride())


def _same(t):
    """``t`` as rank 0 has it: references must use the data ``distribute_tensor`` takes from rank 0."""
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
        return t
    t = t.clone().contiguous()
    dist.broadcast(t, 0)
    return t


def _kind(p) -> tuple:
    """Compare our placements with torch's by kind and dim."""
    if p.is_shard():
        return ("S", p.dim)
    if p.is_partial():
        return ("P", getattr(p, "reduce_op", "sum"))
    return ("R",)


def _kinds(placements) -> list[tuple]:
    return [_kind(p) for p in placements]


def _to_torch(x: DTensor):
    """The same value as a torch DTensor over the same process groups (for placement oracles)."""
    tp = []
    for p in x.placements:
        if p.is_shard():
            tp.append(tdt.Shard(p.dim))
        elif p.is_partial():
            tp.append(tdt.Partial(p.reduce_op))
        else:
            tp.append(tdt.Replicate())
    return tdt.DTensor.from_local(
        x._local_tensor, x.device_mesh.to_torch(), tp, shape=x.shape, stride=x.stride(), run_check=False
    )


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _close(got, want, what: str, atol: float = 1e-5) -> None:
    got = _full(got)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def _assert_no_owned_fallbacks() -> None:
    hit = {k: v for k, v in fallback_counts().items() if k in OWNED}
    assert hit == {}, f"ops with rules ran through the fallback: {hit}"


def _check_fn(fn, tensors, placements, mesh, what, *, cot_seed=0, atol=1e-5, torch_oracle=False):
    """Run ``fn`` on DTensor leaves and on plain tensors; compare outputs and input gradients.

    Returns the DTensor output(s). With ``torch_oracle``, also runs ``fn`` on torch DTensors built from
    the same inputs and asserts equal output placements.
    """
    tensors = [_same(t) for t in tensors]
    leaves = [_leaf(t, mesh, p) for t, p in zip(tensors, placements)]
    refs = [t.clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    ref = fn(*refs)
    outs = out if isinstance(out, tuple) else (out,)
    refs_out = ref if isinstance(ref, tuple) else (ref,)
    torch.manual_seed(cot_seed)
    loss_d, loss_r = 0, 0
    for k, (o, r) in enumerate(zip(outs, refs_out)):
        _close(o, r.detach(), f"{what}: output {k}", atol)
        if r.is_floating_point() and r.requires_grad:
            cot = torch.randn(r.shape, dtype=r.dtype)
            loss_d = loss_d + (o.full_tensor() * cot).sum()
            loss_r = loss_r + (r * cot).sum()
    if isinstance(loss_r, torch.Tensor):
        loss_d.backward()
        loss_r.backward()
        for j, (leaf, r) in enumerate(zip(leaves, refs)):
            if r.grad is not None:
                assert leaf.grad is not None, f"{what}: no gradient for input {j}"
                _close(leaf.grad, r.grad, f"{what}: grad of input {j} (grad placements {leaf.grad.placements})", atol)
    if torch_oracle:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = fn(*[_to_torch(leaf.detach()) for leaf in leaves])
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        for k, (o, t) in enumerate(zip(outs, theirs)):
            assert _kinds(o.placements) == _kinds(t.placements), (
                f"{what}: output {k} placements {list(o.placements)} differ from torch's {list(t.placements)}"
            )
    return out


def _check_op(op, tensors, placements, mesh, what, *, extra=(), kwargs=None, torch_oracle=False, atol=1e-5):
    """Call aten ``op`` directly on DTensors with exactly ``placements`` (Partial allowed); compare values.

    Returns the output placements (a list per tensor output).
    """
    kwargs = kwargs or {}
    tensors = [_same(t) for t in tensors]
    dts = [_dt(t, mesh, p) if t is not None else None for t, p in zip(tensors, placements)]
    out = op(*dts, *extra, **kwargs)
    ref = op(*tensors, *[_full(e) for e in extra], **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    got = []
    for k, (o, r) in enumerate(zip(outs, refs)):
        if r is None:
            assert o is None, f"{what}: output {k} should be None"
            continue
        _close(o, r, f"{what}: output {k}", atol)
        got.append(list(o.placements))
    if torch_oracle:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mine = [*dts, *extra]
            theirs = op(*[_to_torch(d) if isinstance(d, DTensor) else d for d in mine], **kwargs)
        theirs = theirs if isinstance(theirs, (tuple, list)) else (theirs,)
        theirs = [t for t in theirs if t is not None]
        for k, (o, t) in enumerate(zip(got, theirs)):
            assert _kinds(o) == _kinds(t.placements), (
                f"{what}: output {k} placements {o} differ from torch's {list(t.placements)}"
            )
    return got


# ----------------------------------------------------------------------------------------------- matmul
@distributed(world_size=2)
def test_matmul_family_two_ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    a, b = torch.randn(7, 5), torch.randn(5, 3)
    # (a, b) placements -> expected output placement; the torch oracle agrees on each
    cases = [
        ((S0, R), [S0]),
        ((R, S1), [S1]),
        ((S1, S0), [PS]),
        ((R, R), [R]),
        ((PS, R), [PS]),
        ((R, PS), [PS]),
        ((Partial("avg"), R), [Partial("avg")]),
    ]
    for (pa, pb), want in cases:
        got = _check_op(aten.mm.default, [a, b], [[pa], [pb]], mesh, f"mm {pa} {pb}", torch_oracle=True)
        assert got == [want], f"mm {pa} x {pb}: {got}"
    # conflicting inputs: the cheaper redistribution (gather the smaller operand)
    big, small = torch.randn(9, 6), torch.randn(6, 2)
    assert _check_op(aten.mm.default, [big, small], [[S0], [S1]], mesh, "mm S0 S1") == [[S0]]
    assert _check_op(aten.mm.default, [small.t().contiguous(), big.t().contiguous()], [[S0], [S1]], mesh, "mm S0 S1 b")[
        0
    ] == [S1]
    assert _check_op(aten.mm.default, [a, b], [[PS], [PS]], mesh, "mm P P")[0][0].is_partial()
    _check_op(aten.mm.default, [a, b], [[S0], [S0]], mesh, "mm S0 S0")
    _check_op(aten.mm.default, [a, b], [[S1], [S1]], mesh, "mm S1 S1")

    # addmm: the bias follows the output; with a Partial product it becomes a Partial term (added once)
    bias1, bias2 = torch.randn(3), torch.randn(7, 3)
    for bias in (bias1, bias2):
        for pa, pb in ((S0, R), (R, S1), (S1, S0), (PS, R)):
            got = _check_op(
                aten.addmm.default,
                [bias, a, b],
                [[R], [pa], [pb]],
                mesh,
                f"addmm bias{bias.ndim} {pa} {pb}",
                torch_oracle=True,
            )
            assert _kinds(got[0]) == _kinds(_check_op(aten.mm.default, [a, b], [[pa], [pb]], mesh, "mm again")[0])
        _check_op(
            aten.addmm.default,
            [bias, a, b],
            [[R], [S1], [S0]],
            mesh,
            "addmm beta alpha",
            kwargs={"beta": 0.5, "alpha": 2.0},
        )
    _check_op(aten.addmm.default, [bias2, a, b], [[S0], [S1], [S0]], mesh, "addmm sharded bias, P product")
    _check_op(aten.addmm.default, [bias2, a, b], [[PS], [S1], [S0]], mesh, "addmm P bias, P product")
    _check_op(aten.addmm.default, [bias2, a, b], [[PS], [S0], [R]], mesh, "addmm P bias, S product")

    # bmm / baddbmm: batch shards, uneven batch 3 on 2 ranks
    x, y, z = torch.randn(3, 4, 5), torch.randn(3, 5, 6), torch.randn(3, 4, 6)
    for px, py, want in ((S0, S0, S0), (S1, R, S1), (R, S2, S2), (S2, S1, PS), (R, R, R), (PS, R, PS)):
        got = _check_op(aten.bmm.default, [x, y], [[px], [py]], mesh, f"bmm {px} {py}", torch_oracle=True)
        assert got == [[want]], f"bmm {px} x {py}: {got}"
        got = _check_op(
            aten.baddbmm.default, [z, x, y], [[R], [px], [py]], mesh, f"baddbmm {px} {py}", torch_oracle=True
        )
        assert got == [[want]], f"baddbmm {px} x {py}: {got}"
    _check_op(
        aten.baddbmm.default,
        [torch.randn(4, 6), x, y],
        [[R], [S2], [S1]],
        mesh,
        "baddbmm bcast bias",
        kwargs={"beta": 0.3, "alpha": -1.5},
    )
    _check_op(aten.bmm.default, [x, y], [[S0], [S1]], mesh, "bmm batch vs contraction conflict")
    _check_op(aten.mv.default, [a, torch.randn(5)], [[S1], [S0]], mesh, "mv")
    _check_op(aten.dot.default, [torch.randn(7), torch.randn(7)], [[S0], [S0]], mesh, "dot")

    # autograd through F.linear (2-D: t + addmm/mm; 3-D: views + mm) with TP layouts, 101x48 weights
    w, bias = torch.randn(101, 48) * 0.1, torch.randn(101)
    inp2, inp3 = torch.randn(7, 48), torch.randn(2, 5, 48)
    for inp in (inp2, inp3):
        # colwise (weight Shard(0)) and rowwise (weight Shard(1), input sharded on its last dim)
        _check_fn(F.linear, [inp, w, bias], [[R], [S0], [S0]], mesh, f"linear colwise {inp.ndim}-D")
        _check_fn(F.linear, [inp, w, bias], [[Shard(inp.ndim - 1)], [S1], [R]], mesh, f"linear rowwise {inp.ndim}-D")
        _check_fn(F.linear, [inp, w], [[S0], [R]], mesh, f"linear batch {inp.ndim}-D")
    _check_fn(torch.matmul, [torch.randn(3, 7, 4), torch.randn(3, 4, 5)], [[S0], [S0]], mesh, "matmul batch")
    _check_fn(torch.baddbmm, [z, x, y], [[R], [S1], [R]], mesh, "baddbmm autograd")
    _assert_no_owned_fallbacks()


# ----------------------------------------------------------------------------------------------- embedding
@distributed(world_size=2)
def test_embedding_two_ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    expect = {  # (table, ids) -> output placement; torch's DTensor agrees (its vocab split is a MaskPartial)
        (S0, R): PS,
        (S1, R): S2,
        (R, S0): S0,
        (R, S1): S1,
        (R, R): R,
    }
    torch.manual_seed(1)
    table, ids = torch.randn(101, 6), torch.randint(0, 101, (3, 5))
    ids[0, :3] = torch.tensor([0, 100, 50])
    for (tp, ip), want in expect.items():
        out = _check_fn(
            lambda i, w: F.embedding(i, w), [ids, table], [[ip], [tp]], mesh, f"embedding {tp} {ip}", torch_oracle=True
        )
        assert list(out.placements) == [want], f"embedding table {tp} ids {ip}: {out.placements}"
    # conflicting placements are resolved by moving the cheaper tensor (here: the indices)
    _check_fn(lambda i, w: F.embedding(i, w), [ids, table], [[S0], [S0]], mesh, "embedding vocab + batch ids")
    _check_fn(lambda i, w: F.embedding(i, w), [ids, table], [[S1], [S1]], mesh, "embedding cols + batch ids")
    # padding_idx (gradient of that row is zero) and scale_grad_by_freq, for each table layout
    for tp in (S0, S1, R):
        for ip in (R, S0):
            _check_fn(
                lambda i, w: F.embedding(i, w, padding_idx=50),
                [ids, table],
                [[ip], [tp]],
                mesh,
                f"embedding padding {tp} {ip}",
            )
            _check_fn(
                lambda i, w: F.embedding(i, w, scale_grad_by_freq=True),
                [ids, table],
                [[ip], [tp]],
                mesh,
                f"embedding freq {tp} {ip}",
            )
    # gradient placements: the table's gradient is laid out like the table for the TP layouts
    for tp, ip, want in ((S0, R, S0), (S1, R, S1), (R, S0, R)):
        w = _leaf(table, mesh, [tp])
        out = F.embedding(distribute_tensor(ids, mesh, [ip]), w)
        out.full_tensor().sum().backward()
        grad_p = w.grad.placements[0]
        # batch-split ids give partial sums of the table gradient; FSDP/TP reduce them later
        assert grad_p == want or (want == R and grad_p.is_partial()), f"grad of table {tp} ids {ip}: {grad_p}"
    # the backward op itself, on every layout of (grad_output, indices), against torch's placements
    g = torch.randn(3, 5, 6)
    for pg, pi, want in ((S0, S0, PS), (S2, R, S1), (PS, R, PS), (R, R, R), (S1, S1, PS)):
        got = _check_op(
            aten.embedding_dense_backward.default,
            [g, ids],
            [[pg], [pi]],
            mesh,
            f"embedding_dense_backward {pg} {pi}",
            extra=(101, -1, False),
            torch_oracle=True,
        )
        assert got == [[want]], f"embedding_dense_backward {pg} {pi}: {got}"
    _check_op(
        aten.embedding_dense_backward.default,
        [g, ids],
        [[S0], [S1]],
        mesh,
        "embedding bwd mismatch",
        extra=(101, 7, False),
    )
    _check_op(
        aten.embedding_dense_backward.default, [g, ids], [[S0], [S0]], mesh, "embedding bwd freq", extra=(101, -1, True)
    )
    # a 5-row table on 2 ranks and a 1-row table (one rank holds no rows)
    for vocab in (5, 1):
        small, sids = torch.randn(vocab, 4), torch.randint(0, vocab, (2, 3))
        out = _check_fn(lambda i, w: F.embedding(i, w), [sids, small], [[R], [S0]], mesh, f"embedding vocab {vocab}")
        assert out.placements == (PS,)
    _assert_no_owned_fallbacks()


# ----------------------------------------------------------------------------------------------- softmax, norms
@distributed(world_size=2)
def test_softmax_and_norms_two_ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(2)
    x = torch.randn(3, 7, 5)
    for fn, name in ((torch.softmax, "softmax"), (torch.log_softmax, "log_softmax")):
        for dim in (-1, 1):
            for p in (S0, S1, S2, R, PS):
                want = p if p.is_shard() and p.dim % 3 != dim % 3 else R
                got = _check_op(
                    getattr(aten, "_" + name).default,
                    [x],
                    [[p]],
                    mesh,
                    f"{name} dim {dim} {p}",
                    extra=(dim, False),
                    torch_oracle=True,
                )
                assert got == [[want]], f"{name} dim {dim} {p}: {got}"
            _check_fn(lambda t, fn=fn, dim=dim: fn(t, dim), [x], [[S0]], mesh, f"{name} autograd dim {dim}")
    _check_op(aten._safe_softmax.default, [x], [[S1]], mesh, "_safe_softmax", extra=(-1,), torch_oracle=True)
    y = torch.softmax(x, -1)
    for bwd in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
        for pg, po in ((S0, S0), (S1, R), (R, S0), (PS, S1), (S2, S2), (S0, S1)):
            _check_op(
                bwd,
                [torch.randn(3, 7, 5), y],
                [[pg], [po]],
                mesh,
                f"{bwd} {pg} {po}",
                extra=(-1, torch.float32),
                torch_oracle=True,
            )

    # layer norm over the last dim or the last two; weight/bias replicated (101x48-like uneven rows)
    x = torch.randn(7, 3, 6)
    w, b = torch.randn(6), torch.randn(6)
    for p in (S0, S1, S2, R, PS):
        out = aten.native_layer_norm.default(_dt(x, mesh, [p]), [6], _dt(w, mesh, [R]), _dt(b, mesh, [R]), 1e-5)
        ref = aten.native_layer_norm.default(x, [6], w, b, 1e-5)
        want = p if p in (S0, S1) else R
        for k in range(3):
            _close(out[k], ref[k], f"native_layer_norm {p} output {k}")
            assert out[k].placements == (want,), f"native_layer_norm {p} output {k}: {out[k].placements}"
        theirs = aten.native_layer_norm.default(
            _to_torch(_dt(x, mesh, [p])), [6], _to_torch(_dt(w, mesh, [R])), _to_torch(_dt(b, mesh, [R])), 1e-5
        )
        assert [_kinds(o.placements) for o in out] == [_kinds(t.placements) for t in theirs], f"layer_norm {p}"
    for p in (S0, S1, S2):
        _check_fn(lambda t, w, b: F.layer_norm(t, (6,), w, b), [x, w, b], [[p], [R], [R]], mesh, f"layer_norm fn {p}")
        _check_fn(lambda t: F.layer_norm(t, (3, 6)), [x], [[p]], mesh, f"layer_norm 2 dims no affine {p}")
    # backward: grad_weight / grad_bias come back Partial("sum") where rows are sharded (torch agrees)
    mean, rstd = aten.native_layer_norm.default(x, [6], w, b, 1e-5)[1:]
    g = torch.randn(7, 3, 6)
    for pg, px, want in (
        (S0, S0, [[S0], [PS], [PS]]),
        (S1, S1, [[S1], [PS], [PS]]),
        (R, R, [[R], [R], [R]]),
        (S2, S0, [[S0], [PS], [PS]]),
        (PS, S1, [[S1], [PS], [PS]]),
    ):
        got = _check_op(
            aten.native_layer_norm_backward.default,
            [g, x],
            [[pg], [px]],
            mesh,
            f"layer_norm_backward {pg} {px}",
            extra=(
                [6],
                _dt(mean, mesh, [px]),
                _dt(rstd, mesh, [px]),
                _dt(w, mesh, [R]),
                _dt(b, mesh, [R]),
                [True, True, True],
            ),
            torch_oracle=pg != PS,
        )
        assert got == want, f"layer_norm_backward {pg} {px}: {got}"
    got = _check_op(
        aten.native_layer_norm_backward.default,
        [g, x],
        [[S0], [S0]],
        mesh,
        "ln bwd mask",
        extra=([6], _dt(mean, mesh, [S0]), _dt(rstd, mesh, [S0]), None, _dt(b, mesh, [R]), [True, False, True]),
    )
    assert got == [[S0], [PS]]

    # RMS norm: on CPU both F.rms_norm and aten._fused_rms_norm decompose above the dispatcher (pow, mean,
    # rsqrt, mul: pointwise/reduction rules); the _fused_rms_norm rules serve CUDA, where they are kernels.
    for p in (S0, S1):  # Shard(2) (the normalized dim) hits a pointwise in-place limit: see docs
        _check_fn(lambda t, w: F.rms_norm(t, (6,), w, 1e-6), [x, w], [[p], [R]], mesh, f"rms_norm fn {p}")
    rrms = aten._fused_rms_norm.default(x, [6], w, 1e-6)[1]
    for p in (S0, S1, S2, PS):
        want = (p,) if p in (S0, S1) else (R,)
        args = (_dt(x, mesh, [p]), [6], _dt(w, mesh, [R]), 1e-6)
        plan = norm_forward_rule(make_call(aten._fused_rms_norm.default, args, {}))
        assert plan.inputs == [want, (R,)] and plan.outputs == [want, want], f"rms fwd {p}: {plan}"
        args = (_dt(g, mesh, [p]), _dt(x, mesh, [p]), [6], _dt(rrms, mesh, want), _dt(w, mesh, [R]), [True, True])
        plan = rms_norm_backward_rule(make_call(aten._fused_rms_norm_backward.default, args, {}))
        assert plan.outputs == [want, (PS,) if p in (S0, S1) else (R,)], f"rms bwd {p}: {plan}"
        assert plan.inputs == [want, want, want, (R,)], f"rms bwd {p}: {plan}"
    _assert_no_owned_fallbacks()


# ----------------------------------------------------------------------------------------------- attention
def _sdpa(**kw):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kw)

    return fn


@distributed(world_size=2)
def test_sdpa_two_ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 3, 5, 4), torch.randn(3, 3, 6, 4), torch.randn(3, 3, 6, 4)  # uneven B and H
    for p, want in ((S0, S0), (S1, S1), (R, R), (S2, R), (Shard(3), R), (PS, R)):
        for kw in ({}, {"is_causal": True}, {"scale": 0.3}):
            out = _check_fn(_sdpa(**kw), [q, k, v], [[p]] * 3, mesh, f"sdpa {p} {kw}")
            assert out.placements == (want,), f"sdpa {p} {kw}: {out.placements}"
    # mixed inputs: heads-sharded query with replicated key/value keeps the heads shard
    out = _check_fn(_sdpa(), [q, k, v], [[S1], [R], [R]], mesh, "sdpa S1 R R")
    assert out.placements == (S1,)
    # boolean and additive masks (not requiring grad: the fused CPU kernel), sharded with the batch
    bool_mask = torch.rand(3, 1, 5, 6) > 0.3
    bool_mask[..., 0] = True
    add_mask = torch.randn(5, 6)
    for p in (S0, S1):
        for m in (bool_mask, add_mask):
            dm = distribute_tensor(m, mesh, [p if m.ndim == 4 and p == S0 else R])

            def fn(q, k, v, dm=dm, m=m):  # the DTensor mask for DTensor inputs, the plain one for the reference
                return F.scaled_dot_product_attention(q, k, v, attn_mask=dm if isinstance(q, DTensor) else m)

            out = _check_fn(fn, [q, k, v], [[p]] * 3, mesh, f"sdpa mask {tuple(m.shape)} {p}", cot_seed=4)
            assert out.placements == (p,)
    # GQA: 4 query heads, 2 key/value heads: heads stay sharded when the kv heads split evenly
    qg, kg, vg = torch.randn(2, 4, 5, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    out = _check_fn(_sdpa(enable_gqa=True), [qg, kg, vg], [[S1]] * 3, mesh, "sdpa gqa heads")
    assert out.placements == (S1,)
    qg, kg, vg = torch.randn(2, 6, 5, 4), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)  # 3 kv heads on 2 ranks
    out = _check_fn(_sdpa(enable_gqa=True, is_causal=True), [qg, kg, vg], [[S1]] * 3, mesh, "sdpa gqa uneven")
    assert out.placements == (R,)
    # the backward op directly, with mixed layouts
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    g = torch.randn_like(out)
    got = _check_op(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        [g, q, k, v, out, lse],
        [[S1], [R], [S1], [R], [S1], [S1]],
        mesh,
        "sdpa backward op",
        extra=(0.0, True),
    )
    assert got == [[S1]] * 3
    _assert_no_owned_fallbacks()


# ----------------------------------------------------------------------------------------------- losses
@distributed(world_size=2)
def test_nll_and_cross_entropy_two_ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(5)
    logits = torch.randn(7, 5)  # 4 + 3 rows
    target = torch.randint(0, 5, (7,))
    target[0] = 4
    skewed = target.clone()
    skewed[4:] = 2  # every row of rank 1 ignored with ignore_index=2: local means would be wrong
    cw = torch.rand(5) + 0.5
    red_want = {"mean": PS, "sum": PS, "none": S0}
    for red in ("mean", "sum", "none"):
        for tgt, ign in ((target, -100), (target, 1), (skewed, 2)):
            # every placement pair on the skewed targets (a rank with every row ignored), Shard(0) on the others
            pairs = ((S0, S0), (S0, R), (R, S0), (S1, S0)) if ign == 2 else ((S0, S0),)
            for lp, tp in pairs:

                def ce(x, t, red=red, ign=ign):
                    return F.cross_entropy(x, t, reduction=red, ignore_index=ign)

                out = _check_fn(ce, [logits, tgt], [[lp], [tp]], mesh, f"cross_entropy {red} ign {ign} {lp} {tp}")
                assert out.placements == (red_want[red],), f"cross_entropy {red} {lp} {tp}: {out.placements}"

            def nll_w(x, t, red=red, ign=ign):
                w = distribute_tensor(cw, mesh, [R]) if isinstance(x, DTensor) else cw
                return F.nll_loss(torch.log_softmax(x, 1), t, weight=w, reduction=red, ignore_index=ign)

            _check_fn(nll_w, [logits, tgt], [[S0], [S0]], mesh, f"nll class weights {red} ign {ign}")
    # torch's placements agree for sum and none; for mean torch gives Partial("avg") (wrong for uneven shards
    # or ignored targets, and refused by torch for uneven shards): ours is Partial("sum") of local_sum/global_count
    lp = torch.log_softmax(logits, 1)
    for red, code in (("sum", 2), ("none", 0)):
        _check_op(
            aten.nll_loss_forward.default,
            [lp, target],
            [[S0], [S0]],
            mesh,
            f"nll_loss_forward {red}",
            extra=(None, code, -100),
            torch_oracle=True,
        )
    even = torch.log_softmax(torch.randn(8, 5), 1), torch.randint(0, 5, (8,))
    got = _check_op(aten.nll_loss_forward.default, list(even), [[S0], [S0]], mesh, "nll mean", extra=(None, 1, -100))
    assert got == [[PS], [R]], got
    theirs = aten.nll_loss_forward.default(
        _to_torch(_dt(even[0], mesh, [S0])), _to_torch(_dt(even[1], mesh, [S0])), None, 1, -100
    )
    assert _kinds(theirs[0].placements) == [("P", "avg")]  # documented difference
    # every target ignored: nan, like torch
    all_ign = torch.full((7,), 3)
    out = F.cross_entropy(distribute_tensor(logits, mesh, [S0]), distribute_tensor(all_ign, mesh, [S0]), ignore_index=3)
    assert torch.isnan(out.full_tensor()) and torch.isnan(F.cross_entropy(logits, all_ign, ignore_index=3))
    # label smoothing decomposes into log_softmax + nll + pointwise/sum ops
    _check_fn(
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1, ignore_index=1),
        [logits, target],
        [[S0], [S0]],
        mesh,
        "cross_entropy label smoothing",
    )
    # the backward op directly: mean needs the global total weight, given replicated or as partial counts
    total = torch.tensor(float((target != 1).sum()))
    for red, code, pg in (("mean", 1, R), ("sum", 2, PS), ("none", 0, S0)):
        g = torch.randn(7) if code == 0 else torch.tensor(0.7)
        for ptot in (R, PS):
            got = _check_op(
                aten.nll_loss_backward.default,
                [g, lp, target],
                [[pg], [S0], [S0]],
                mesh,
                f"nll_loss_backward {red} total {ptot}",
                extra=(None, code, 1, _dt(total, mesh, [ptot])),
            )
            assert got == [[S0]], got
    # 3-D / 4-D logits reach nll_loss2d: batch and spatial dims may stay sharded, classes replicated
    l3, t3 = torch.randn(3, 5, 7), torch.randint(0, 5, (3, 7))
    l4, t4 = torch.randn(2, 5, 3, 3), torch.randint(0, 5, (2, 3, 3))
    for red in ("mean", "sum", "none"):
        for lp, tp, want in ((S0, S0, S0), (S2, S1, S1), (S1, R, R)):
            out = _check_fn(
                lambda x, t, red=red: F.cross_entropy(x, t, reduction=red, ignore_index=0),
                [l3, t3],
                [[lp], [tp]],
                mesh,
                f"cross_entropy 3-D {red} {lp} {tp}",
            )
            if red == "none":
                assert out.placements == (want,), f"3-D none {lp} {tp}: {out.placements}"
            else:
                assert out.placements == ((PS,) if want != R else (R,)), f"3-D {red} {lp}: {out.placements}"
        _check_fn(
            lambda x, t, red=red: F.cross_entropy(x, t, reduction=red),
            [l4, t4],
            [[Shard(3)], [S2]],
            mesh,
            f"cross_entropy 4-D {red}",
        )
    _assert_no_owned_fallbacks()


# ----------------------------------------------------------------------------------------------- end to end
V, D, H, HID, B, SEQ = 11, 8, 2, 12, 3, 5  # odd vocab and batch: uneven shards


def _tiny_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    p = {"emb": torch.randn(V, D)}
    for name in ("ln1", "ln2", "lnf"):
        p[f"{name}.w"], p[f"{name}.b"] = 1 + 0.1 * torch.randn(D), 0.1 * torch.randn(D)
    for name in ("q", "k", "v", "o"):
        p[f"{name}.w"], p[f"{name}.b"] = torch.randn(D, D) / D**0.5, 0.1 * torch.randn(D)
    p["up.w"], p["up.b"] = torch.randn(HID, D) / D**0.5, 0.1 * torch.randn(HID)
    p["down.w"], p["down.b"] = torch.randn(D, HID) / HID**0.5, 0.1 * torch.randn(D)
    return p


def _tiny_forward(p: dict, ids, targets, *, causal: bool = True):
    """Embedding, pre-LN attention block (SDPA), MLP block, final LN, tied LM head, cross-entropy."""
    x = F.embedding(ids, p["emb"])
    h = F.layer_norm(x, (D,), p["ln1.w"], p["ln1.b"])

    def heads(t):  # (B, S, D) -> (B, H, S, D/H)
        return t.view(B, SEQ, H, D // H).transpose(1, 2)

    q, k, v = (heads(F.linear(h, p[f"{n}.w"], p[f"{n}.b"])) for n in "qkv")
    a = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(B, SEQ, D)
    x = x + F.linear(a, p["o.w"], p["o.b"])
    h = F.layer_norm(x, (D,), p["ln2.w"], p["ln2.b"])
    x = x + F.linear(F.gelu(F.linear(h, p["up.w"], p["up.b"])), p["down.w"], p["down.b"])
    logits = F.linear(F.layer_norm(x, (D,), p["lnf.w"], p["lnf.b"]), p["emb"])  # tied head
    return F.cross_entropy(logits.reshape(B * SEQ, V), targets.reshape(B * SEQ), ignore_index=0)


def _tp_placements(vocab: Placement) -> dict[str, Placement]:
    """A Megatron-style TP plan: q/k/v/up colwise (weight and bias Shard(0)), o/down rowwise (weight Shard(1))."""
    out = {"emb": vocab}
    for n in ("q", "k", "v", "up"):
        out[f"{n}.w"], out[f"{n}.b"] = S0, S0
    for n in ("o", "down"):
        out[f"{n}.w"] = S1
    return out


def _run_tiny(mesh, placements: dict, ids_p, tgt_p) -> dict[str, tuple]:
    params = _tiny_params()
    torch.manual_seed(8)
    ids = torch.randint(0, V, (B, SEQ))
    targets = torch.randint(0, V, (B, SEQ))
    targets[0, :2] = 0  # ignored
    ref = {k: t.clone().requires_grad_() for k, t in params.items()}
    ref_loss = _tiny_forward(ref, ids, targets)
    ref_loss.backward()
    dps = {k: _leaf(t, mesh, [placements.get(k, R)] * mesh.ndim) for k, t in params.items()}
    loss = _tiny_forward(dps, distribute_tensor(ids, mesh, ids_p), distribute_tensor(targets, mesh, tgt_p))
    _close(loss, ref_loss.detach(), "tiny transformer loss")
    full = loss.full_tensor()
    full.backward()
    grads = {}
    for k, t in dps.items():
        assert t.grad is not None, f"no gradient for {k}"
        _close(t.grad, ref[k].grad, f"tiny transformer grad {k} ({t.grad.placements})", atol=2e-5)
        grads[k] = t.grad.placements
    return grads


@distributed(world_size=2)
def test_tiny_transformer_tensor_parallel_two_ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    # tensor parallel with a vocab-parallel (row-split) and with a column-split embedding table
    for vocab in (S0, S1):
        grads = _run_tiny(mesh, _tp_placements(vocab), [R], [R])
        for k, p in _tp_placements(vocab).items():
            # a column-split table tied to the head gets a replicated head gradient: the sum is replicated
            if not (k == "emb" and vocab == S1):
                assert grads[k] == (p,), f"TP: gradient of {k} has {grads[k]}, parameter {p}"
        print("fallbacks (not owned) after TP run:", fallback_counts())
    # data parallel: replicated parameters, batch-split ids and targets (gradients are partial sums)
    _run_tiny(mesh, {}, [S0], [S0])
    print("fallbacks (not owned):", fallback_counts())
    _assert_no_owned_fallbacks()


# ----------------------------------------------------------------------------------------------- 2x2 mesh
@distributed(world_size=4)
def test_math_ops_on_2x2_mesh():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(9)
    # matmul: each mesh dim decides on its own; nested shards of one dim (7 rows over 4 ranks)
    a, b, bias = torch.randn(7, 6), torch.randn(6, 5), torch.randn(5)
    for pa, pb, want in (
        ((S0, S1), (R, S0), [S0, PS]),
        ((S0, S0), (R, R), [S0, S0]),
        ((S1, R), (S0, S1), [PS, S1]),
        ((PS, S0), (R, R), [PS, S0]),
    ):
        got = _check_op(aten.mm.default, [a, b], [pa, pb], mesh, f"mm {pa} {pb}", torch_oracle=True)
        assert got == [want], f"mm {pa} {pb}: {got}"
        _check_op(aten.addmm.default, [bias, a, b], [(R, R), pa, pb], mesh, f"addmm {pa} {pb}", torch_oracle=True)
    _check_fn(
        F.linear,
        [torch.randn(3, 4, 6), torch.randn(101, 6), torch.randn(101)],
        [(S0, R), (R, S0), (R, S0)],
        mesh,
        "linear dp x colwise",
    )
    # embedding: 101-row table split over 4 ranks (26, 26, 26, 23) and over 2 with columns on the other dim
    table, ids = torch.randn(101, 6), torch.randint(0, 101, (5, 3))
    ids[0] = torch.tensor([0, 100, 77])
    for tp, ip, want, grad_want in (
        ((S0, S0), (R, R), [PS, PS], (S0, S0)),
        ((S0, S1), (R, R), [PS, S2], (S0, S1)),
        ((R, S0), (S0, R), [S0, PS], None),
    ):
        out = _check_fn(lambda i, w: F.embedding(i, w), [ids, table], [ip, tp], mesh, f"embedding {tp} {ip}")
        assert list(out.placements) == want, f"embedding {tp} {ip}: {out.placements}"
        if grad_want is not None:  # a vocab-split table gets its gradient split like itself
            w = _leaf(table, mesh, tp)
            F.embedding(distribute_tensor(ids, mesh, ip), w).full_tensor().sum().backward()
            assert w.grad.placements == grad_want, f"embedding grad {tp}: {w.grad.placements}"
    w = _leaf(table, mesh, (S0, S0))
    F.embedding(distribute_tensor(ids, mesh, (R, R)), w, padding_idx=77).full_tensor().sum().backward()
    assert w.grad.placements == (S0, S0)
    ref = table.clone().requires_grad_()
    F.embedding(ids, ref, padding_idx=77).sum().backward()
    _close(w.grad, ref.grad, "vocab-parallel grad on 4 ranks")
    # mean NLL over 7 rows on 4 ranks with targets ignored unevenly
    logits, target = torch.randn(7, 5), torch.randint(0, 5, (7,))
    target[5:] = 3
    for lp in ((S0, S0), (S0, R), (R, S0), (S0, S1)):
        out = _check_fn(
            lambda x, t: F.cross_entropy(x, t, ignore_index=3),
            [logits, target],
            [lp, (lp[0], lp[1]) if lp != (S0, S1) else (S0, R)],
            mesh,
            f"cross_entropy mean {lp}",
        )
    # layer norm: rows split over both mesh dims; weight/bias gradients partial over both
    x, lw, lb = torch.randn(3, 5, 6), torch.randn(6), torch.randn(6)
    mean, rstd = aten.native_layer_norm.default(x, [6], lw, lb, 1e-5)[1:]
    got = _check_op(
        aten.native_layer_norm_backward.default,
        [torch.randn(3, 5, 6), x],
        [(S0, S1), (S0, S1)],
        mesh,
        "layer_norm_backward 2-D mesh",
        extra=(
            [6],
            _dt(mean, mesh, (S0, S1)),
            _dt(rstd, mesh, (S0, S1)),
            _dt(lw, mesh, (R, R)),
            _dt(lb, mesh, (R, R)),
            [True, True, True],
        ),
        torch_oracle=True,
    )
    assert got == [[S0, S1], [PS, PS], [PS, PS]], got
    _check_fn(
        lambda t, w, b: F.layer_norm(t, (6,), w, b),
        [x, lw, lb],
        [(S0, S1), (R, R), (R, R)],
        mesh,
        "layer_norm 2-D mesh",
    )
    # SDPA: batch on one mesh dim, heads on the other; GQA needs the kv heads to split over both
    q, k, v = torch.randn(3, 4, 5, 4), torch.randn(3, 4, 5, 4), torch.randn(3, 4, 5, 4)
    out = _check_fn(_sdpa(is_causal=True), [q, k, v], [(S0, S1)] * 3, mesh, "sdpa batch x heads")
    assert out.placements == (S0, S1)
    qg = torch.randn(2, 8, 5, 4)
    for hkv, want in ((4, (S1, S1)), (2, (R, R))):
        kg, vg = torch.randn(2, hkv, 5, 4), torch.randn(2, hkv, 5, 4)
        out = _check_fn(_sdpa(enable_gqa=True), [qg, kg, vg], [(S1, S1)] * 3, mesh, f"sdpa gqa kv {hkv}")
        assert out.placements == want, f"gqa {hkv}: {out.placements}"
    # data parallel x tensor parallel on the tiny transformer
    tp = _tp_placements(S0)
    dps = {k: (R, p) for k, p in tp.items()}
    params = _tiny_params()
    torch.manual_seed(8)
    ids = torch.randint(0, V, (B, SEQ))
    targets = torch.randint(0, V, (B, SEQ))
    targets[0, :2] = 0
    ref = {k: t.clone().requires_grad_() for k, t in params.items()}
    ref_loss = _tiny_forward(ref, ids, targets)
    ref_loss.backward()
    leaves = {k: _leaf(t, mesh, dps.get(k, (R, R))) for k, t in params.items()}
    loss = _tiny_forward(leaves, distribute_tensor(ids, mesh, (S0, R)), distribute_tensor(targets, mesh, (S0, R)))
    _close(loss, ref_loss.detach(), "dp x tp loss")
    loss.full_tensor().backward()
    for key, t in leaves.items():
        _close(t.grad, ref[key].grad, f"dp x tp grad {key} ({t.grad.placements})", atol=2e-5)
    _assert_no_owned_fallbacks()
