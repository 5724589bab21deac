"""Sharding rules of views/shape ops, reductions, factories, ``_foreach_*`` ops (optimizers) and misc ops on 2
and 4 gloo ranks: every result and gradient equals plain torch on full tensors (uneven shapes), output
placements equal torch's own DTensor where it has a rule (unless documented otherwise in
docs/dtensor_ops_shape.md), and none of these ops reach the Replicate fallback.
"""

from __future__ import annotations

import math

import torch
import torch.distributed.tensor as tdt

from lightning_shard import init_device_mesh
from lightning_shard.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    reset_fallback_counts,
)
from tests.harness import distributed

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


# ----------------------------------------------------------------------------------------------- helpers
def _kind(p) -> tuple:
    """A placement as comparable data, for ours and torch's alike."""
    if p.is_shard():
        return ("S", p.dim)
    if p.is_partial():
        return ("P", getattr(p, "reduce_op", None))
    return ("R",)


def _to_torch_placement(p):
    if p.is_shard():
        return tdt.Shard(p.dim)
    if p.is_partial():
        return tdt.Partial(p.reduce_op)
    return tdt.Replicate()


def _leaves(out) -> list:
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _leaves(o)]
    return [out]


def _make(t: torch.Tensor, mesh, placements, grad: bool) -> DTensor:
    """A DTensor leaf with ``placements``; a Partial is built from rank-dependent terms that sum to ``t``."""
    t = t.clone()
    base = [R if p.is_partial() else p for p in placements]
    x = distribute_tensor(t, mesh, base)
    if any(p.is_partial() for p in placements):
        local = x._local_tensor.clone()
        for i, p in enumerate(placements):
            if p.is_partial():
                n, c = mesh.shape[i], mesh.get_coordinate()[i]
                noise = torch.arange(local.numel(), dtype=local.dtype).reshape(local.shape) * 0.25
                local = local / n + (noise if c == 0 else -noise / (n - 1))
        x = DTensor.from_local(local, mesh, placements, shape=t.shape)
        x = DTensor(x._local_tensor, x._spec, requires_grad=False)
    if grad:
        x.requires_grad_()
    return x


def check(fn, tensors, mesh, placements, *, torch_mesh=None, expect=None, grad=True, exact=False):
    """Run ``fn`` on DTensors and on plain tensors; compare values, gradients and (optionally) placements.

    ``tensors``/``placements``: one entry per input. ``expect``: our expected output placements (a tuple
    per output leaf). ``torch_mesh``: also run torch's DTensor and compare output placements with ours.
    """
    grad = grad and all(t.is_floating_point() for t in tensors)
    xs = [_make(t, mesh, p, grad) for t, p in zip(tensors, placements)]
    refs = [t.clone().requires_grad_(grad) for t in tensors]
    out, ref = fn(*xs), fn(*refs)
    outs, ref_outs = _leaves(out), _leaves(ref)
    assert len(outs) == len(ref_outs)
    for o, r in zip(outs, ref_outs):
        assert isinstance(o, DTensor), type(o)
        assert o.shape == r.shape, (o.shape, r.shape)
        full = o.full_tensor()
        if exact or not r.is_floating_point():
            assert torch.equal(full, r), (full, r)
        else:
            torch.testing.assert_close(full, r, rtol=1e-5, atol=1e-5)
    if expect is not None:
        assert [tuple(o.placements) for o in outs] == [tuple(e) for e in expect], [o.placements for o in outs]
    if torch_mesh is not None:
        txs = [
            tdt.distribute_tensor(t.clone(), torch_mesh, [_to_torch_placement(p) for p in ps])
            for t, ps in zip(tensors, placements)
        ]
        touts = _leaves(fn(*txs))
        for o, to in zip(outs, touts):
            assert [_kind(p) for p in o.placements] == [_kind(p) for p in to.placements], (
                o.placements,
                to.placements,
            )
    if grad:
        float_outs = [(o, r) for o, r in zip(outs, ref_outs) if o.is_floating_point() and o.requires_grad]
        if float_outs:
            gen = torch.Generator().manual_seed(1)
            ws = [torch.randn(r.shape, generator=gen) for _, r in float_outs]
            loss = sum((o * distribute_tensor(w, mesh, [R] * mesh.ndim)).sum() for (o, _), w in zip(float_outs, ws))
            ref_loss = sum((r * w).sum() for (_, r), w in zip(float_outs, ws))
            loss.backward()
            ref_loss.backward()
            for x, r in zip(xs, refs):
                if r.grad is None:
                    continue
                torch.testing.assert_close(x.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-5)
    return out


def _assert_no_fallback():
    assert fallback_counts() == {}, fallback_counts()


# ----------------------------------------------------------------------------------------------- 2 ranks
@distributed(world_size=2)
def test_views_and_shape_ops_2ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    tm = mesh.to_torch()
    g = torch.Generator().manual_seed(0)
    t75 = torch.randn(7, 5, generator=g)
    t86 = torch.randn(8, 6, generator=g)

    # view/reshape: a shard survives only where the local view is the local shard of the result
    check(lambda x: x.view(35), [t75], mesh, [[S0]], expect=[[R]])  # 4*5=20 rows-elements, chunk is 18
    check(lambda x: x.view(8, 2, 3), [t86], mesh, [[S0]], expect=[[S0]], torch_mesh=tm)
    check(lambda x: x.view(48), [t86], mesh, [[S0]], expect=[[S0]], torch_mesh=tm)
    check(lambda x: x.reshape(6, 8), [t86], mesh, [[S0]], expect=[[S0]])  # 4*6 == 3*8 elements per rank
    check(lambda x: x.reshape(6, 7), [torch.randn(7, 6, generator=g)], mesh, [[S0]], expect=[[R]])
    check(lambda x: x.view(-1, 5), [t75.repeat(2, 1)], mesh, [[S0]], expect=[[S0]])
    check(lambda x: x.flatten(), [t75], mesh, [[S1]], expect=[[R]])
    check(lambda x: x.unflatten(1, (5, 1)), [t75], mesh, [[S1]], expect=[[S1]], torch_mesh=tm)
    check(lambda x: x.t().reshape(35), [t75], mesh, [[S1]], expect=[[R]])
    # the tensor-parallel attention case: (B, S, H*D) -> (B, S, H, D) sharded on heads
    t_att = torch.randn(2, 3, 8, generator=g)
    check(lambda x: x.view(2, 3, 4, 2), [t_att], mesh, [[S2]], expect=[[S2]], torch_mesh=tm)
    check(lambda x: x.view(2, 3, 4, 2).transpose(1, 2), [t_att], mesh, [[S2]], expect=[[S1]], torch_mesh=tm)
    check(lambda x: x.view(2, 3, 3, 2), [torch.randn(2, 3, 6, generator=g)], mesh, [[S2]], expect=[[R]])
    check(lambda x: x.view(6, 8), [t_att], mesh, [[S2]], expect=[[S1]])
    check(lambda x: x.view(dtype=torch.int32), [t75], mesh, [[S1]], expect=[[S1]], grad=False)

    for pl in ([S0], [S1], [R], [Partial()]):
        check(lambda x: x.t(), [t75], mesh, [pl])
        check(lambda x: x.view(7, 5, 1).permute(2, 0, 1), [t75], mesh, [pl])
        check(lambda x: x.unsqueeze(1).expand(7, 3, 5), [t75], mesh, [pl])
        check(lambda x: x.unsqueeze(0).squeeze(), [t75], mesh, [pl])
        check(lambda x: x[:, :1].squeeze(1), [t75], mesh, [pl])
        check(lambda x: x.split(3), [t75], mesh, [pl])
        check(lambda x: x.split([1, 4], dim=1), [t75], mesh, [pl])
        check(lambda x: x.chunk(2, dim=1), [t75], mesh, [pl])
        check(lambda x: x[:, 1:3], [t75], mesh, [pl])
        check(lambda x: x[2:6:2], [t75], mesh, [pl])
        check(lambda x: x.narrow(1, 1, 3), [t75], mesh, [pl])
        check(lambda x: x[1], [t75], mesh, [pl])
        check(lambda x: x[:, -1], [t75], mesh, [pl])
        check(lambda x: x.unbind(1), [t75], mesh, [pl])
        check(lambda x: x.repeat(2, 1, 1), [t75], mesh, [pl])
        check(lambda x: x.t().contiguous(), [t75], mesh, [pl])
        check(lambda x: x.flip(0), [t75], mesh, [pl])
        check(lambda x, y: torch.cat([x, y], 0), [t75, t75 * 2], mesh, [pl, pl])
        check(lambda x, y: torch.cat([x, y], 1), [t75, t75 * 2], mesh, [pl, pl])
        check(lambda x, y: torch.stack([x, y], 1), [t75, t75 * 2], mesh, [pl, pl])
        check(lambda x, y: torch.cat([x, y], 1), [t75, t75 * 2], mesh, [pl, [R]])

    # torch's DTensor as the oracle for output placements on the plain layouts
    for pl in ([S0], [S1], [R]):
        for fn in (
            lambda x: x.t(),
            lambda x: x.transpose(0, 1),
            lambda x: x.unsqueeze(1),
            lambda x: x.unsqueeze(1).expand(7, 3, 5),
            lambda x: x.split(3, dim=1),
            lambda x: x[:, 1:3],
            lambda x: x[1:3],
            lambda x: x[1],
            lambda x: x.repeat(1, 2),
        ):
            check(fn, [t75], mesh, [pl], torch_mesh=tm, grad=False)
        check(lambda x, y: torch.cat([x, y], 1), [t75, t75], mesh, [pl, pl], torch_mesh=tm, grad=False)
        check(lambda x, y: torch.stack([x, y]), [t75, t75], mesh, [pl, pl], torch_mesh=tm, grad=False)
    _assert_no_fallback()


@distributed(world_size=2)
def test_indexing_2ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    tm = mesh.to_torch()
    g = torch.Generator().manual_seed(1)
    t75 = torch.randn(7, 5, generator=g)
    idx = torch.tensor([0, 3, 3, 6])
    cols = torch.tensor([4, 0])
    mask = t75 > 0
    gidx = torch.randint(0, 5, (7, 3), generator=g)

    for pl in ([S0], [S1], [R], [Partial()]):
        check(lambda x, i: x[i], [t75, idx], mesh, [pl, [R]])
        check(lambda x, i: x[:, i], [t75, cols], mesh, [pl, [R]])
        check(lambda x, i: x[i, 1:], [t75, idx], mesh, [pl, [R]])
        check(lambda x, i: x.index_select(0, i), [t75, idx], mesh, [pl, [R]])
        check(lambda x, i: x.index_select(1, i), [t75, cols], mesh, [pl, [R]])
        check(lambda x, i: x.gather(1, i), [t75, gidx], mesh, [pl, [R]])
        check(lambda x, m: x.masked_fill(m, 0.5), [t75, mask], mesh, [pl, pl if pl[0] != Partial() else [R]])
        check(lambda x, m: torch.where(m, x, 0.0), [t75, mask], mesh, [pl, pl if pl[0] != Partial() else [R]])
        check(
            lambda x, v, i: x.clone().index_put((i,), v), [t75, t75[:4] * 3, idx[:4].flip(0) % 7], mesh, [pl, pl, [R]]
        )
    # a sharded index shards the output of index_select / gather (self replicated on the indexed dim)
    check(lambda x, i: x.index_select(0, i), [t75, idx], mesh, [[R], [S0]], expect=[[S0]], torch_mesh=tm)
    check(lambda x, i: x.gather(1, i), [t75, gidx], mesh, [[S0], [S0]], expect=[[S0]], torch_mesh=tm)
    check(
        lambda x, i: x.gather(0, i), [t75, torch.randint(0, 7, (3, 5), generator=g)], mesh, [[R], [S0]], expect=[[S0]]
    )
    check(lambda x, i: x[i], [t75, idx], mesh, [[S1], [R]], expect=[[S1]], torch_mesh=tm)
    # boolean mask indexing of a replicated tensor (data-dependent shape)
    check(lambda x, m: x[m], [t75, mask], mesh, [[R], [R]])
    # in-place index_put_ on a tensor sharded off the indexed dim keeps its shard
    x = distribute_tensor(t75.clone(), mesh, [S1])
    x[distribute_tensor(idx, mesh, [R])] = distribute_tensor(torch.ones(4, 5), mesh, [S1])
    ref = t75.clone()
    ref[idx] = 1.0
    assert x.placements == (S1,) and torch.equal(x.full_tensor(), ref)
    _assert_no_fallback()


@distributed(world_size=2)
def test_reductions_2ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    tm = mesh.to_torch()
    g = torch.Generator().manual_seed(2)
    t75 = torch.randn(7, 5, generator=g)
    t86 = torch.randn(8, 6, generator=g)
    PS, PM = Partial("sum"), Partial("max")

    check(lambda x: x.sum(0), [t75], mesh, [[S0]], expect=[[PS]], torch_mesh=tm)
    check(lambda x: x.sum(1), [t75], mesh, [[S0]], expect=[[S0]], torch_mesh=tm)
    check(lambda x: x.sum(), [t75], mesh, [[S1]], expect=[[PS]], torch_mesh=tm)
    check(lambda x: x.sum((0, 1), keepdim=True), [t75], mesh, [[S0]], expect=[[PS]], torch_mesh=tm)
    check(lambda x: x.sum(0, dtype=torch.float64), [t75], mesh, [[S0]], expect=[[PS]])
    check(lambda x: x.sum(1, keepdim=True), [t75], mesh, [[S1]], expect=[[PS]])
    check(lambda x: x.sum(0), [t75], mesh, [[PS]], expect=[[PS]])
    # mean: Partial("avg") on even shards (torch agrees), sum/count -> Partial("sum") on uneven ones
    check(lambda x: x.mean(0), [t86], mesh, [[S0]], expect=[[Partial("avg")]], torch_mesh=tm)
    check(lambda x: x.mean(), [t86], mesh, [[S1]], expect=[[Partial("avg")]], torch_mesh=tm)
    check(lambda x: x.mean(0), [t75], mesh, [[S0]], expect=[[PS]])
    check(lambda x: x.mean(), [t75], mesh, [[S1]], expect=[[PS]])
    check(lambda x: x.mean(1, keepdim=True), [t75], mesh, [[S0]], expect=[[S0]], torch_mesh=tm)
    # max/min family
    check(lambda x: x.amax(0), [t75], mesh, [[S0]], expect=[[PM]], torch_mesh=tm)
    check(lambda x: x.amin(1), [t75], mesh, [[S1]], expect=[[Partial("min")]], torch_mesh=tm)
    check(lambda x: x.max(), [t75], mesh, [[S0]], expect=[[PM]], torch_mesh=tm)
    check(lambda x: x.min(), [t75], mesh, [[S1]], expect=[[Partial("min")]])
    check(lambda x: x.amax(0), [torch.randn(1, 5, generator=g)], mesh, [[S0]], expect=[[R]])  # rank 1 empty
    check(lambda x: x.max(1), [t75], mesh, [[S1]], expect=[[R], [R]])
    check(lambda x: x.max(0), [t75], mesh, [[S1]], expect=[[S0], [S0]], torch_mesh=tm)
    check(lambda x: x.min(0, keepdim=True), [t75], mesh, [[S0]], expect=[[R], [R]])
    check(lambda x: x.argmax(0), [t75], mesh, [[S0]], expect=[[R]])
    check(lambda x: x.argmax(), [t75], mesh, [[S1]], expect=[[R]])
    # norms (any p): combined by one all-reduce, Replicate (torch: its private norm partial)
    for p in (2, 1, 3, 0.5, 0, math.inf, -math.inf):
        check(lambda x, p=p: torch.linalg.vector_norm(x, p), [t75], mesh, [[S0]], expect=[[R]])
        check(lambda x, p=p: torch.linalg.vector_norm(x, p, dim=1), [t75], mesh, [[S1]], expect=[[R]])
        check(lambda x, p=p: torch.linalg.vector_norm(x, p, dim=1), [t75], mesh, [[S0]], expect=[[S0]])
    check(lambda x: x.norm(), [t75], mesh, [[PS]], expect=[[R]])
    # the rest replicate the reduced dim
    for pl in ([S0], [S1], [Partial()]):
        check(lambda x: x.var(0), [t75], mesh, [pl])
        check(lambda x: x.std(), [t75], mesh, [pl])
        # prod's backward formula makes plain tensors (torch.ones) and cats them with DTensors: forward only
        check(lambda x: x.prod(1), [t75], mesh, [pl], grad=False)
        check(lambda x: x.cumsum(0), [t75], mesh, [pl])
        check(lambda x: x.logsumexp(1), [t75], mesh, [pl])
    for pl in ([S0], [S1]):
        check(lambda x: (x > 0).all(0), [t75], mesh, [pl])
        check(lambda x: (x > 0).any(), [t75], mesh, [pl])
        check(lambda x: (x > 0).sum(1), [t75], mesh, [pl])
    _assert_no_fallback()


@distributed(world_size=2)
def test_factories_and_misc_2ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    tm = mesh.to_torch()
    t75 = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    for pl in ([S0], [S1], [R]):
        check(lambda x: torch.zeros_like(x), [t75], mesh, [pl], expect=[pl], torch_mesh=tm, grad=False)
        check(lambda x: torch.ones_like(x), [t75], mesh, [pl], expect=[pl], torch_mesh=tm, grad=False)
        check(lambda x: torch.full_like(x, 2.5), [t75], mesh, [pl], expect=[pl], torch_mesh=tm, grad=False)
        check(lambda x: x.new_zeros(3, 2), [t75], mesh, [pl], expect=[[R]], torch_mesh=tm, grad=False)
        check(lambda x: x.new_ones(4), [t75], mesh, [pl], expect=[[R]], torch_mesh=tm, grad=False)
        check(lambda x: x.new_full((2, 2), 7.0), [t75], mesh, [pl], expect=[[R]], grad=False)
        e = torch.empty_like(_make(t75, mesh, pl, False))
        assert e.placements == tuple(pl) and e.shape == t75.shape
        assert _make(t75, mesh, pl, False).new_empty(3).placements == (R,)
        s = _make(t75, mesh, pl, False).new_empty_strided((7, 5), (5, 1))
        assert s.placements == tuple(pl) and s._local_tensor.shape == _make(t75, mesh, pl, False)._spec.local_shape
    # a Partial input: ones_like would sum to n, so it becomes Replicate
    check(lambda x: torch.ones_like(x), [t75], mesh, [[Partial()]], expect=[[R]], grad=False)
    # autograd's gradient-layout copy (new_empty_strided + copy_ of an expanded gradient) needs no fallback
    x = _make(t75, mesh, [S1], True)
    x.sum(1).sum().backward()
    assert x.grad.stride() == (5, 1) and torch.equal(x.grad.full_tensor(), torch.ones(7, 5))

    # misc: equal, is_same_size, item
    a = distribute_tensor(t75.clone(), mesh, [S0])
    b = distribute_tensor(t75.clone(), mesh, [S1])
    assert torch.equal(a, b)
    c = t75.clone()
    c[6, 4] += 1  # differs only in rank 1's shard
    assert not torch.equal(a, distribute_tensor(c, mesh, [S0]))
    assert not torch.equal(a, distribute_tensor(t75[:6].clone(), mesh, [S0]))
    assert a.is_same_size(b)
    assert a.sum().item() == t75.sum().item() or math.isclose(a.sum().item(), t75.sum().item(), rel_tol=1e-6)
    assert a[6, 4].item() == t75[6, 4].item()
    assert bool((a > -100).all())
    _assert_no_fallback()


def _opt_step(params_full, grads_full, make_opt, steps=3, mesh=None, placements=None):
    """Run ``steps`` optimizer steps on plain tensors, or on DTensors when ``mesh`` is given."""
    if mesh is None:
        params = [torch.nn.Parameter(p.clone()) for p in params_full]
    else:
        params = [torch.nn.Parameter(distribute_tensor(p.clone(), mesh, pl)) for p, pl in zip(params_full, placements)]
    opt = make_opt(params)
    for k in range(steps):
        for p, gfull, pl in zip(params, grads_full, placements or [None] * len(params)):
            gk = gfull * (k + 1) - p.detach().full_tensor() * 0.1 if mesh is not None else gfull * (k + 1) - p * 0.1
            p.grad = distribute_tensor(gk.detach(), mesh, pl) if mesh is not None else gk.detach()
        opt.step()
    return [p.detach().full_tensor() if mesh is not None else p.detach() for p in params]


@distributed(world_size=2)
def test_foreach_and_optimizers_2ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(4)
    shapes = [(7, 5), (5, 7), (3,), (4, 4)]
    placements = [[S0], [S1], [R], [S1]]
    fulls = [torch.randn(s, generator=g) for s in shapes]
    others = [torch.randn(s, generator=g).abs() + 0.5 for s in shapes]

    def dts(ts, pls=placements):
        return [_make(t, mesh, pl, False) for t, pl in zip(ts, pls)]

    plain_pls = [[S0], [R], [R], [S0]]  # the other lists: some laid out differently from self

    def run(fn, *lists, out_of_place=False):
        xs = [dts(lst, placements if k == 0 else plain_pls) for k, lst in enumerate(lists)]
        refs = [[t.clone() for t in lst] for lst in lists]
        out, ref = fn(*xs), fn(*refs)
        if out_of_place:
            for o, r in zip(out, ref):
                torch.testing.assert_close(o.full_tensor(), r)
        else:
            for o, r, pl in zip(xs[0], refs[0], placements):
                assert o.placements == tuple(pl)
                torch.testing.assert_close(o.full_tensor(), r)

    run(lambda a: torch._foreach_mul_(a, 0.9), fulls)
    partial = [_make(fulls[0], mesh, [Partial()], False)]
    torch._foreach_mul_(partial, 0.5)  # linear: stays partial
    assert partial[0].placements == (Partial(),)
    torch.testing.assert_close(partial[0].full_tensor(), fulls[0] * 0.5, rtol=1e-5, atol=1e-5)
    run(lambda a, b: torch._foreach_add_(a, b, alpha=0.5), fulls, others)
    run(lambda a, b: torch._foreach_sub_(a, b), fulls, others)
    run(lambda a, b: torch._foreach_add(a, b), fulls, others, out_of_place=True)
    run(lambda a: torch._foreach_add_(a, [1.0, 2.0, 3.0, 4.0]), fulls)
    run(lambda a, b: torch._foreach_addcmul_(a, b, b, value=0.3), fulls, others)
    run(lambda a, b: torch._foreach_addcdiv_(a, b, b, [0.1, 0.2, 0.3, 0.4]), fulls, others)
    run(lambda a, b: torch._foreach_addcdiv_(a, b, b, torch.tensor([0.1, 0.2, 0.3, 0.4])), fulls, others)
    run(lambda a, b: torch._foreach_lerp_(a, b, 0.25), fulls, others)
    run(lambda a, b: torch._foreach_div_(a, b), fulls, others)
    run(lambda a: torch._foreach_div_(a, torch.tensor(4.0)), fulls)
    run(lambda a, b: torch._foreach_maximum_(a, b), [f for f in fulls[:3]], others[:3])
    run(lambda a, b: torch._foreach_copy_(a, b), fulls, others)
    run(lambda a: torch._foreach_zero_(a), fulls)
    run(lambda a: torch._foreach_sqrt(a), others, out_of_place=True)
    run(lambda a: torch._foreach_neg(a), fulls, out_of_place=True)
    run(lambda a: torch._foreach_pow(a, 2.0), fulls, out_of_place=True)
    run(lambda a: torch._foreach_norm(a), fulls, out_of_place=True)
    run(lambda a: torch._foreach_norm(a, math.inf), fulls, out_of_place=True)
    run(lambda a: [x.clamp_(-0.5, 0.5) for x in a] and torch._foreach_clamp_min_(a, -0.2), fulls)
    run(lambda a: torch._foreach_clamp_max_(a, 0.2), fulls)

    # optimizers, for-loop and foreach implementations, against plain torch on full tensors
    pls = [[S0], [S1], [R], [S0]]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    for foreach in (False, True):
        makers = [
            lambda ps, f=foreach: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=f),
            lambda ps, f=foreach: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=f),
            lambda ps, f=foreach: torch.optim.Adam(ps, lr=0.01, amsgrad=True, foreach=f),
        ]
        for make in makers:
            ref = _opt_step(params, grads, make)
            got = _opt_step(params, grads, make, mesh=mesh, placements=pls)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    # torch's clip_grad_norm_ (foreach) on DTensor gradients
    for foreach in (False, True):
        ps = [torch.nn.Parameter(distribute_tensor(p.clone(), mesh, pl)) for p, pl in zip(params, pls)]
        ref_ps = [torch.nn.Parameter(p.clone()) for p in params]
        for p, r, gr, pl in zip(ps, ref_ps, grads, pls):
            p.grad = distribute_tensor(gr.clone(), mesh, pl)
            r.grad = gr.clone()
        total = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=foreach)
        ref_total = torch.nn.utils.clip_grad_norm_(ref_ps, 1.0, foreach=foreach)
        torch.testing.assert_close(total.full_tensor(), ref_total)
        for p, r in zip(ps, ref_ps):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad)
    _assert_no_fallback()


# ----------------------------------------------------------------------------------------------- 4 ranks
@distributed(world_size=4)
def test_views_and_reductions_2x2_mesh():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2, 2))
    tm = mesh.to_torch()
    g = torch.Generator().manual_seed(5)
    t75 = torch.randn(7, 5, generator=g)
    t86 = torch.randn(8, 6, generator=g)
    t_att = torch.randn(2, 4, 8, generator=g)
    PS = Partial("sum")

    # nested shards of one dim: (8,6)->(48,) is a shard of the result (even), (7,5)->(35,) is not
    check(lambda x: x.view(48), [t86], mesh, [[S0, S0]], expect=[[S0, S0]])
    check(lambda x: x.view(35), [t75], mesh, [[S0, S0]], expect=[[R, R]])
    check(lambda x: x.view(8, 3, 2), [t86], mesh, [[S0, S1]], expect=[[S0, R]])  # 3 rows of 2 vs 3 columns
    check(
        lambda x: x.view(8, 2, 2), [torch.randn(8, 4, generator=g)], mesh, [[S0, S1]], expect=[[S0, S1]], torch_mesh=tm
    )
    check(lambda x: x.view(2, 4, 4, 2), [t_att], mesh, [[S0, S2]], expect=[[S0, S2]], torch_mesh=tm)
    check(lambda x: x.view(2, 4, 4, 2), [t_att], mesh, [[S2, S2]], expect=[[S2, S2]])
    check(lambda x: x.view(2, 4, 2, 4), [t_att], mesh, [[S2, S2]], expect=[[R, R]])  # 2 heads, 4 ranks
    check(lambda x: x.view(8, 8), [t_att], mesh, [[S1, S0]], expect=[[R, S0]])
    for pls in ([S0, S1], [S1, S0], [S0, S0], [R, S1], [PS, S0]):
        check(lambda x: x.t(), [t75], mesh, [pls])
        check(lambda x: x.unsqueeze(0).expand(3, 7, 5), [t75], mesh, [pls])
        check(lambda x: x[1:5, 2:], [t75], mesh, [pls])
        check(lambda x: x[3], [t75], mesh, [pls])
        check(lambda x: x.split(2, dim=1), [t75], mesh, [pls])
        check(lambda x, y: torch.cat([x, y], 1), [t75, t75], mesh, [pls, pls])
        check(lambda x: x.sum(0), [t75], mesh, [pls])
        check(lambda x: x.mean(1), [t75], mesh, [pls])
        check(lambda x: x.mean(), [t86], mesh, [pls])
        check(lambda x: x.amax(0), [t75], mesh, [pls])
        check(lambda x: x.max(1), [t75], mesh, [pls])
        check(lambda x: torch.linalg.vector_norm(x, 3.0), [t75], mesh, [pls])
        check(lambda x: torch.linalg.vector_norm(x, math.inf, dim=0), [t75], mesh, [pls])
    check(lambda x: x.sum(), [t75], mesh, [[S0, S1]], expect=[[PS, PS]], torch_mesh=tm)
    check(lambda x: x.mean(), [t86], mesh, [[S0, S1]], expect=[[Partial("avg")] * 2], torch_mesh=tm)
    check(lambda x: x.mean(), [t75], mesh, [[S0, S1]], expect=[[PS, PS]])
    check(lambda x: x.sum(1), [t75], mesh, [[S0, S1]], expect=[[S0, PS]], torch_mesh=tm)
    _assert_no_fallback()
