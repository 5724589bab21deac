"""Pointwise rules: broadcasting, in-place, Partial linearity, kind-preserving shards, the fast path."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_shard import init_device_mesh
from lightning_shard.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    StridedShard,
    distribute_tensor,
    fallback_counts,
    reset_fallback_counts,
)
from tests.harness import distributed


def _partial_of(full: torch.Tensor, mesh, op: str = "sum") -> DTensor:
    """A Partial DTensor whose reduction is ``full``: rank r holds full * w_r with sum(w) = 1 (or copies)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    if op == "sum":
        local = full * (rank + 1) / (world * (world + 1) / 2)
    else:
        local = full.clone()
    return DTensor.from_local(local, mesh, [Partial(op)])


@distributed(world_size=2)
def test_broadcasting_and_inplace_follow_the_sharded_operand():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    x, b, y = torch.randn(7, 5, generator=g), torch.randn(5, generator=g), torch.randn(7, 5, generator=g)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    out = dx + distribute_tensor(b, mesh, [Replicate()])
    assert out.placements == (Shard(0),) and torch.allclose(out.full_tensor(), x + b)
    mixed = dx * distribute_tensor(y, mesh, [Shard(1)])  # other operand redistributed (all-to-all)
    assert mixed.placements == (Shard(0),) and torch.allclose(mixed.full_tensor(), x * y)
    dz = distribute_tensor(x.clone(), mesh, [Replicate()])
    dz.add_(distribute_tensor(y, mesh, [Shard(1)]), alpha=2)  # self replicated: other is gathered
    assert dz.placements == (Replicate(),) and torch.allclose(dz.full_tensor(), x + 2 * y)
    cond = torch.where(dx > 0, dx, distribute_tensor(y, mesh, [Shard(0)]))
    assert torch.allclose(cond.full_tensor(), torch.where(x > 0, x, y))
    assert fallback_counts() == {}


@distributed(world_size=2)
def test_partial_survives_only_linear_ops():
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    pa, pb = _partial_of(a, mesh), _partial_of(b, mesh)
    r = distribute_tensor(b, mesh, [Replicate()])
    cases = [
        (pa + pb, a + b, Partial("sum")),
        (pa - r, a - b, Partial("sum")),  # the replicated operand becomes a partial term
        (pa * 3.0, a * 3.0, Partial("sum")),
        (pa * r, a * b, Partial("sum")),
        (pa / r, a / b, Partial("sum")),
        (-pa, -a, Partial("sum")),
        (pa * pb, a * b, Replicate()),  # not linear: reduced first
        (pa + 1.0, a + 1.0, Partial("sum")),  # the constant is added on one rank only
        (torch.exp(pa), torch.exp(a), Replicate()),
    ]
    for got, want, placement in cases:
        assert got.placements == (placement,), (got.placements, placement)
        assert torch.allclose(got.full_tensor(), want, atol=1e-6)
    avg = _partial_of(a, mesh, "avg")
    shifted = avg + 1.0  # adding a constant commutes with an average
    assert shifted.placements == (Partial("avg"),) and torch.allclose(shifted.full_tensor(), a + 1.0)
    mx = _partial_of(a, mesh, "max")
    assert (-mx).placements == (Replicate(),)  # neg turns max into min: reduce first
    assert torch.allclose((-mx).full_tensor(), -a)


@distributed(world_size=2)
def test_inplace_on_partial_that_would_need_reduction_is_refused():
    mesh = init_device_mesh("cpu", (2,))
    p = _partial_of(torch.ones(3), mesh)
    with pytest.raises(RuntimeError, match="in-place op would need its DTensor argument redistributed"):
        p.mul_(_partial_of(torch.ones(3), mesh))
    p.mul_(2.0)  # linear: fine
    assert torch.allclose(p.full_tensor(), torch.full((3,), 2.0))


@distributed(world_size=4)
def test_strided_shard_kind_is_kept_and_rms_norm_on_sharded_dim():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    x = torch.arange(40.0).reshape(8, 5)
    dx = distribute_tensor(x, mesh, [StridedShard(0, split_factor=2), Shard(0)])
    y = (dx * 2).detach()
    assert y.placements == dx.placements and torch.equal(y.full_tensor(), x * 2)
    one_d = init_device_mesh("cpu", (4,))
    z = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    out = F.rms_norm(distribute_tensor(z, one_d, [Shard(1)]), (8,), eps=1e-5)
    assert torch.allclose(out.full_tensor(), F.rms_norm(z, (8,), eps=1e-5), atol=1e-6)
