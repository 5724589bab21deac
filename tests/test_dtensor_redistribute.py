"""Redistribution between every pair of placement lists, on 1-D, 2-D and 3-D meshes, uneven shapes included.

Oracles, independent of our layout code: ``torch.chunk`` applied step by step (plain shards in mesh-dim order,
then strided shards), cross-checked against torch's own ``distribute_tensor`` on ``mesh.to_torch()``.
Partial sources are built with ``DTensor.from_local`` from per-rank terms whose reduction is known.
"""

import itertools

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt

from lightning_shard import comm, init_device_mesh
from lightning_shard.tensor import DTensor, Partial, Replicate, Shard, StridedShard, distribute_tensor
from tests.harness import distributed

SHAPES = [(7, 5), (101, 48), (3, 2)]  # (3, 2) leaves empty shards on 4 ranks


def _chunk(t: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    chunks = torch.chunk(t, parts, dim=dim)
    return chunks[index] if index < len(chunks) else t.narrow(dim, t.shape[dim], 0)


def expected_local(full: torch.Tensor, placements, mesh_shape, coord) -> torch.Tensor:
    """This rank's slice: per tensor dim, plain shards in mesh-dim order, then strided ones, torch.chunk each."""
    out = full
    for d in range(full.ndim):
        plain = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == d]
        strided = [i for i, p in enumerate(placements) if isinstance(p, StridedShard) and p.dim == d]
        for i in plain + strided:
            out = _chunk(out, mesh_shape[i], coord[i], d)
    return out


def _torch_placement(p):
    if isinstance(p, StridedShard):
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(p.dim, split_factor=p.split_factor)
    if p.is_shard():
        return tdt.Shard(p.dim)
    return tdt.Replicate()


_REDUCE = {
    "sum": lambda ts: torch.stack(ts).sum(0),
    "avg": lambda ts: torch.stack(ts).sum(0) / len(ts),
    "max": lambda ts: torch.stack(ts).amax(0),
    "min": lambda ts: torch.stack(ts).amin(0),
}


def make_source(full_shape, mesh, placements, seed):
    """A DTensor with ``placements`` and its full value; Partial dims get integer-valued per-rank terms."""
    g = torch.Generator().manual_seed(seed)
    partial_dims = [i for i, p in enumerate(placements) if p.is_partial()]
    if not partial_dims:
        full = torch.randn(full_shape, generator=g)
        return distribute_tensor(full, mesh, placements, src_data_rank=None), full
    ops = {placements[i].reduce_op for i in partial_dims}
    assert len(ops) == 1, "tests use one reduce op per placement list"
    (op,) = ops
    n_terms = 1
    for i in partial_dims:
        n_terms *= mesh.size(i)
    terms = [torch.randint(-50, 50, full_shape, generator=g).float() for _ in range(n_terms)]
    full = _REDUCE[op](terms)
    coord = mesh.get_coordinate()
    index = 0
    for i in partial_dims:
        index = index * mesh.size(i) + coord[i]
    shard_only = [Replicate() if p.is_partial() else p for p in placements]
    local = expected_local(terms[index], shard_only, mesh.shape, coord).clone()
    return DTensor.from_local(local, mesh, placements, shape=full_shape), full


def check_pair(mesh, src, dst, shape, seed=0):
    x, full = make_source(shape, mesh, src, seed)
    before = x.to_local().clone()
    y = x.redistribute(mesh, dst)
    assert y.placements == tuple(dst) and y.shape == full.shape, (src, dst)
    if not any(p.is_partial() for p in dst):
        # Every rank's shard is the expected slice, so the global value is right (full_tensor is checked on
        # partial targets below and throughout the other tests).
        want = expected_local(full, dst, mesh.shape, mesh.get_coordinate())
        assert y.to_local().shape == want.shape, (src, dst, shape)
        torch.testing.assert_close(y.to_local(), want, msg=lambda m: f"{src} -> {dst} on {shape}: {m}")
    else:
        torch.testing.assert_close(y.full_tensor(), full, msg=lambda m: f"{src} -> {dst} on {shape} (full): {m}")
    # The source is never mutated by the redistribution.
    assert torch.equal(x.to_local(), before)


def check_against_torch(mesh, placements, shape):
    """Our distribute_tensor's local shard equals torch's for the same placements."""
    full = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = distribute_tensor(full, mesh, placements).to_local()
    theirs = tdt.distribute_tensor(full, mesh.to_torch(), [_torch_placement(p) for p in placements])
    assert torch.equal(ours, theirs.to_local()), (placements, shape)
    assert torch.equal(ours, expected_local(full, placements, mesh.shape, mesh.get_coordinate()))


def check_counts(mesh, src, dst, shape, expected: dict):
    x, _ = make_source(shape, mesh, src, seed=3)
    with comm.count_collectives() as counts:
        x.redistribute(mesh, dst)
    got = {k: v for k, v in counts.calls.items() if v}
    assert got == expected, f"{src} -> {dst}: collectives {got}, expected {expected}"


ONE_D = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]


@distributed(world_size=2)
def test_every_pair_1d():
    mesh = init_device_mesh("cpu", (2,))
    for shape in SHAPES[:2]:
        for src, dst in itertools.product(ONE_D, ONE_D):
            check_pair(mesh, [src], [dst], shape)
        for p in [Shard(0), Shard(1), Replicate()]:
            check_against_torch(mesh, [p], shape)
    # Tiny dims: one rank holds an empty shard.
    for src, dst in itertools.product(ONE_D[:4], ONE_D[:4]):
        check_pair(mesh, [src], [dst], (1, 3))


@distributed(world_size=2)
def test_collective_counts_1d():
    mesh = init_device_mesh("cpu", (2,))
    for shape in [(8, 6), (7, 5)]:
        check_counts(mesh, [Shard(0)], [Replicate()], shape, {"all_gather": 1})
        check_counts(mesh, [Shard(1)], [Replicate()], shape, {"all_gather": 1})
        check_counts(mesh, [Partial()], [Replicate()], shape, {"all_reduce": 1})
        check_counts(mesh, [Partial("max")], [Replicate()], shape, {"all_reduce": 1})
        check_counts(mesh, [Partial()], [Shard(0)], shape, {"reduce_scatter": 1})
        check_counts(mesh, [Partial()], [Shard(1)], shape, {"reduce_scatter": 1})
        check_counts(mesh, [Shard(0)], [Shard(1)], shape, {"all_to_all": 1})
        check_counts(mesh, [Shard(1)], [Shard(0)], shape, {"all_to_all": 1})
        check_counts(mesh, [Replicate()], [Shard(0)], shape, {})
        check_counts(mesh, [Replicate()], [Partial()], shape, {})


TWO_D_SINGLE = [Shard(0), Shard(1), Replicate(), Partial("sum")]
NESTED = [(StridedShard(0, split_factor=2), Shard(0))]  # (Shard(d), Shard(d)) are in the product already


@distributed(world_size=4)
def test_every_pair_2d():
    mesh = init_device_mesh("cpu", (2, 2))
    lists = [tuple(p) for p in itertools.product(TWO_D_SINGLE, TWO_D_SINGLE)] + NESTED
    lists += [(Partial("max"), Shard(1)), (Shard(0), Partial("avg")), (Partial("min"), Partial("min"))]
    for src, dst in itertools.product(lists, lists):
        check_pair(mesh, src, dst, (7, 5))
    some = [(Shard(0), Shard(1)), (Replicate(), Partial()), (Shard(1), Replicate()), (Shard(0), Shard(0)), *NESTED]
    for shape in [(101, 48), (3, 2)]:
        for src, dst in itertools.product(some, some):
            check_pair(mesh, src, dst, shape)
    for shape in SHAPES[:2]:
        for placements in [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Shard(0)), (Replicate(), Shard(1))]:
            check_against_torch(mesh, placements, shape)
    # torch's _StridedShard agrees with our strided layout on even shapes (and on 2x2 meshes in general).
    check_against_torch(mesh, (StridedShard(0, split_factor=2), Shard(0)), (8, 3))


@distributed(world_size=4)
def test_collective_counts_2d():
    mesh = init_device_mesh("cpu", (2, 2))
    shape = (7, 5)
    check_counts(mesh, (Shard(0), Shard(1)), (Replicate(), Shard(1)), shape, {"all_gather": 1})
    # Swapping the dims of two shards: each shard is in the other's way, so gather both (as torch does).
    check_counts(mesh, (Shard(0), Shard(1)), (Shard(1), Shard(0)), shape, {"all_gather": 2})
    # Nested all-to-all: the moved shard is the last applied on dim 1 and becomes the last applied on dim 0.
    check_counts(mesh, (Shard(0), Shard(1)), (Shard(0), Shard(0)), shape, {"all_to_all": 1})
    check_counts(mesh, (Shard(1), Shard(0)), (Shard(1), Shard(1)), shape, {"all_to_all": 1})
    check_counts(mesh, (Shard(0), Shard(0)), (Shard(0), Shard(1)), shape, {"all_to_all": 1})
    check_counts(mesh, (Replicate(), Shard(0)), (Replicate(), Shard(1)), shape, {"all_to_all": 1})
    check_counts(mesh, (Shard(0), Partial()), (Shard(0), Replicate()), shape, {"all_reduce": 1})
    check_counts(mesh, (Replicate(), Partial()), (Replicate(), Shard(0)), shape, {"reduce_scatter": 1})
    check_counts(mesh, (Shard(0), Shard(1)), (Replicate(), Replicate()), shape, {"all_gather": 2})
    check_counts(mesh, (Partial(), Partial()), (Replicate(), Replicate()), shape, {"all_reduce": 2})
    check_counts(mesh, (Partial(), Replicate()), (Shard(0), Replicate()), shape, {"reduce_scatter": 1})
    check_counts(mesh, (Replicate(), Replicate()), (Shard(0), Shard(0)), shape, {})
    check_counts(mesh, (Shard(0), Replicate()), (Shard(0), Shard(1)), shape, {})


@distributed(world_size=4)
def test_every_pair_3d():
    for mesh_shape in [(1, 2, 2), (2, 1, 2)]:
        mesh = init_device_mesh("cpu", mesh_shape)
        lists = [
            (Replicate(), Replicate(), Replicate()),
            (Shard(0), Shard(1), Replicate()),
            (Replicate(), Shard(0), Shard(0)),
            (Shard(0), Shard(0), Shard(0)),
            (Shard(1), StridedShard(0, split_factor=2), Shard(0)),
            (Partial(), Shard(1), Shard(0)),
            (Replicate(), Partial(), Partial()),
            (Shard(1), Replicate(), Shard(1)),
        ]
        for shape in SHAPES[:2]:
            for src, dst in itertools.product(lists, lists):
                check_pair(mesh, src, dst, shape)
        check_against_torch(mesh, (Shard(0), Shard(1), Shard(0)), (7, 5))
    assert dist.get_world_size() == 4
