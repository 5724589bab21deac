"""The dispatch cache (``lightning_shard/tensor/_decisions.py``): a cached decision is reused only for an equal
key, and a reused decision gives exactly what a fresh one gives.

Each case runs an op on inputs A (deciding and caching), then on inputs B that differ from A in one thing the
decision depends on (shape, placements, dtype, stride, a size argument, a keyword, a scalar's type or sign,
the mesh, an in-place target's placement), and compares the result with B decided afresh (cache cleared):
placements, global shape, stride and dtype, mesh, and values. ``test_each_case_detects_a_key_without_it``
checks that every case fails when the key leaves out the thing it varies, so the cases can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_shard import DeviceMesh
from lightning_shard.tensor import DTensor, Partial, Replicate, Shard, _decisions, distribute_tensor
from lightning_shard.tensor._decisions import clear_dispatch_cache, dispatch_cache_info
from tests.harness import distributed

aten = torch.ops.aten


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(dist.get_world_size()))


def _dt(shape, placements, dtype=torch.float32, mesh=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(*shape, generator=g) * 10).to(dtype)
    return distribute_tensor(full, mesh or _mesh(), placements)


def _describe(x):
    if isinstance(x, DTensor):
        full = x.full_tensor()
        return {
            "placements": x.placements,
            "shape": tuple(x.shape),
            "stride": x.stride(),
            "spec": (tuple(x._spec.shape), x._spec.stride, x._spec.dtype),
            "dtype": x.dtype,
            "mesh": id(x.device_mesh),
            "values": full,
            "signbit": torch.signbit(full) if full.is_floating_point() else None,
        }
    if isinstance(x, (tuple, list)):
        return [_describe(y) for y in x]
    return x


def _same(a, b) -> list[str]:
    if isinstance(a, list):
        return [m for x, y in zip(a, b) for m in _same(x, y)] + ([] if len(a) == len(b) else ["lengths"])
    if isinstance(a, dict):
        out = []
        for k in a:
            x, y = a[k], b[k]
            equal = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            if not equal:
                out.append(f"{k}: {x} vs fresh {y}")
        return out
    return [] if a == b else [f"{a} vs fresh {b}"]


def _check(op, make_a, make_b) -> list[str]:
    """Mismatches between ``op(*make_b())`` after ``op(*make_a())`` was cached and ``op(*make_b())`` fresh.
    ``op`` returns what to compare (for in-place ops: the mutated argument)."""
    clear_dispatch_cache()
    op(*make_a())
    try:
        cached = _describe(op(*make_b()))
    except Exception as e:  # a decision reused where it does not fit may also fail outright
        return [f"raised {type(e).__name__}: {e}"]
    clear_dispatch_cache()
    fresh = _describe(op(*make_b()))
    return _same(cached, fresh)


# Each case: (what it varies, op, make_a, make_b). Built inside the ranks (they need the process group).
def _cases():
    mesh = _mesh()
    mesh2 = _mesh()  # equal to mesh, another object (as a mesh over other process groups would be)
    w = lambda: _dt((6,), [Replicate()], mesh=mesh, seed=5)  # noqa: E731
    return [
        ("shape", lambda x: aten.view.default(x, [-1]), lambda: (_dt((4, 6), [Shard(0)], mesh=mesh),),
         lambda: (_dt((6, 6), [Shard(0)], mesh=mesh),)),
        ("placements", lambda x, y: (x.add_(y), x)[1],
         lambda: (_dt((4, 6), [Shard(0)], mesh=mesh), w()), lambda: (_dt((4, 6), [Replicate()], mesh=mesh), w())),
        ("placements", lambda x: aten.sum.dim_IntList(x, [1]),
         lambda: (_dt((4, 6), [Shard(1)], mesh=mesh),), lambda: (_dt((4, 6), [Shard(0)], mesh=mesh),)),
        ("dtype", lambda x: aten.sum.dim_IntList(x, [0]), lambda: (_dt((4, 6), [Shard(1)], mesh=mesh),),
         lambda: (_dt((4, 6), [Shard(1)], torch.float64, mesh=mesh),)),
        ("stride", lambda x, y: aten.mul.Tensor(x, y),
         lambda: (_dt((4, 6), [Shard(0)], mesh=mesh), w()),
         lambda: (_dt((6, 4), [Shard(1)], mesh=mesh).t(), w())),
        ("args", lambda x, n: aten.view.default(x, [n, -1]),
         lambda: (_dt((4, 6), [Shard(1)], mesh=mesh), 2), lambda: (_dt((4, 6), [Shard(1)], mesh=mesh), 4)),
        ("args", lambda x, d: aten.sum.dim_IntList(x, [d], keepdim=True),
         lambda: (_dt((4, 6), [Shard(1)], mesh=mesh), 0), lambda: (_dt((4, 6), [Shard(1)], mesh=mesh), 1)),
        ("scalar type", lambda x, c: aten.mul.Tensor(x, c),
         lambda: (_dt((4, 6), [Shard(0)], torch.int64, mesh=mesh)[:, ::2], 3),
         lambda: (_dt((4, 6), [Shard(0)], torch.int64, mesh=mesh)[:, ::2], 3.0)),
        ("scalar type", lambda x, c: aten.add.Tensor(x, c),  # bool + 1 is int64, bool + True is bool
         lambda: (_dt((4, 6), [Shard(0)], torch.bool, mesh=mesh)[:, ::2], 1),
         lambda: (_dt((4, 6), [Shard(0)], torch.bool, mesh=mesh)[:, ::2], True)),
        ("float bits", lambda x, c: aten.mul.Tensor(x, c),
         lambda: (_dt((4, 6), [Shard(0)], mesh=mesh)[:, ::2], 0.0),
         lambda: (_dt((4, 6), [Shard(0)], mesh=mesh)[:, ::2], -0.0)),
        ("args", lambda x, c: aten.add.Tensor(x, c),  # a Partial's shift: the constant on one rank only
         lambda: (_partial(mesh), 2.0), lambda: (_partial(mesh), 5.0)),
        ("mesh", lambda x: aten.view.default(x, [-1]), lambda: (_dt((4, 6), [Shard(0)], mesh=mesh),),
         lambda: (_dt((4, 6), [Shard(0)], mesh=mesh2),)),
    ]  # fmt: skip


def _partial(mesh):
    local = torch.full((2, 3), float(dist.get_rank() + 1))
    return DTensor.from_local(local, mesh, [Partial()])


@distributed(world_size=2)
def test_a_reused_decision_matches_a_fresh_one():
    for what, op, make_a, make_b in _cases():
        clear_dispatch_cache()
        op(*make_b())
        op(*make_b())
        assert dispatch_cache_info().hits >= 1, (what, "the same op on equal inputs should hit the cache")
        assert _check(op, make_a, make_b) == [], what
        info = dispatch_cache_info()
        assert info.misses >= 1 and info.size >= 1, (what, info)


@distributed(world_size=2)
def test_repeated_calls_hit_and_uncacheable_calls_are_decided_each_time():
    mesh = _mesh()
    x = _dt((4, 6), [Shard(0)], mesh=mesh)
    clear_dispatch_cache()
    for _ in range(3):
        y = aten.view.default(x, [2, 12])
    assert dispatch_cache_info() == (2, 1, 1)
    assert torch.equal(y.full_tensor(), x.full_tensor().view(2, 12))
    # A plain one-element tensor operand: its value could matter, so no key; each call is right.
    z = x[:, ::2]
    clear_dispatch_cache()
    a, b = aten.mul.Tensor(z, torch.tensor(2.0)), aten.mul.Tensor(z, torch.tensor(3.0))
    assert dispatch_cache_info().size == 0
    assert torch.equal(a.full_tensor() * 1.5, b.full_tensor())


@distributed(world_size=2)
def test_one_dtensor_passed_twice_does_not_stand_for_two_equal_ones():
    # mul(x, x) and mul(x, y) have equal keys when x and y have equal specs: the decision must take each
    # argument from its own position, not the object the first call happened to pass twice.
    mesh = _mesh()
    x, y = _dt((4, 6), [Shard(0)], mesh=mesh, seed=1)[:, ::2], _dt((4, 6), [Shard(0)], mesh=mesh, seed=2)[:, ::2]
    clear_dispatch_cache()
    aten.mul.Tensor(x, x)
    out = aten.mul.Tensor(x, y)
    assert dispatch_cache_info().hits == 1
    assert torch.equal(out.full_tensor(), x.full_tensor() * y.full_tensor())
    p, q = _partial(mesh), _partial(mesh) * 2  # a rule's own local call (a Partial's shift) passed one DTensor twice
    clear_dispatch_cache()
    aten.add.Tensor(p, p)
    assert torch.equal(aten.add.Tensor(p, q).full_tensor(), p.full_tensor() + q.full_tensor())


def _key_without(what):
    """A broken ``_key_into`` that leaves ``what`` out of the key (to show the cases can fail)."""
    original = _decisions._key_into

    def broken(out, dtensors, a):
        if isinstance(a, DTensor):
            s = a._spec
            fields = {"shape": tuple(s.shape), "placements": s.placements, "dtype": s.dtype, "stride": s.stride}
            fields.pop(what, None)
            out.append(tuple(fields.values()))
            dtensors.append(a)
        elif what == "args" and type(a) in (int, bool, float):
            out.append(0)
        elif what == "scalar type" and type(a) in (int, bool, float):
            out.append(a)  # 1 == 1.0 == True
        elif what == "float bits" and type(a) is float:
            out.append(a)  # 0.0 == -0.0
        else:
            original(out, dtensors, a)

    return broken


@pytest.mark.parametrize("what", ["shape", "placements", "dtype", "stride", "args", "scalar type", "float bits",
                                  "mesh"])  # fmt: skip
@distributed(world_size=2)
def test_each_case_detects_a_key_without_it(what):
    import unittest.mock as mock

    cases = [c for c in _cases() if c[0] == what]
    assert cases
    patches = [mock.patch.object(_decisions, "_key_into", _key_without(what))]
    if what == "mesh":
        patches = [mock.patch.object(_decisions, "id", lambda mesh: 0, create=True)]
        # and equal meshes must be allowed to share a key: compare by ==, as a key without identity would
        patches.append(mock.patch.object(_decisions, "_same_mesh", lambda a, b: a == b))
    for p in patches:
        p.start()
    try:
        detected = [bool(_check(op, make_a, make_b)) for _, op, make_a, make_b in cases]
    finally:
        for p in patches:
            p.stop()
        clear_dispatch_cache()
    assert all(detected), (what, detected)


@distributed(world_size=2)
def test_the_cache_is_bounded():
    import unittest.mock as mock

    x = _dt((4, 6), [Shard(0)], mesh=_mesh())
    clear_dispatch_cache()
    with mock.patch.object(_decisions, "MAX_DECISIONS", 3):
        for n in (2, 4, 6, 8, 12, 24, 2):
            y = aten.view.default(x, [n, -1])
            assert torch.equal(y.full_tensor(), x.full_tensor().view(n, -1)), n
        assert dispatch_cache_info().size == 3
    clear_dispatch_cache()
