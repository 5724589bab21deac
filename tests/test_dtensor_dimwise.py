"""Sharding rules for ops that used to fall back: dim-wise ops (pooling, upsampling, padding, group norm,
matrix functions, sort/topk/kthvalue, index_fill/index_copy, diagonal), view copies, untagged elementwise ops,
and a constant added to a Partial sum. Each keeps the shards it can, runs without the fallback and equals the
plain op."""

import torch
import torch.nn.functional as F

from lightning_shard import init_device_mesh
from lightning_shard.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    fallback_policy,
    reset_fallback_counts,
)
from tests.harness import distributed


def _data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _same(got, want):
    if isinstance(want, (tuple, list)):
        for g, w in zip(got, want):
            _same(g, w)
        return
    g = _full(got)
    assert g.shape == want.shape and g.dtype == want.dtype, (g.shape, want.shape)
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)


def _like(x, t, mesh):
    """``t`` as a replicated DTensor when ``x`` is a DTensor (an index vector), else plain."""
    return distribute_tensor(t, mesh, [Replicate()]) if isinstance(x, DTensor) else t


@distributed(world_size=2)
def test_dimwise_ops_keep_batch_shards_without_fallback():
    mesh = init_device_mesh("cpu", (2,))
    img = _data(4, 3, 6, 6)
    mats = _data(4, 3, 3, seed=1)
    spd = mats @ mats.transpose(-1, -2) + 3 * torch.eye(3)
    seq = _data(4, 7, seed=2)
    cases = [
        (img, lambda x: F.max_pool2d(x, 2, return_indices=True), Shard(0)),
        (img, lambda x: F.avg_pool2d(x, 2), Shard(1)),
        (img, lambda x: F.adaptive_avg_pool2d(x, 3), Shard(0)),
        (img, lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), Shard(1)),
        (img, lambda x: F.pad(x, (1, 2, 0, 1)), Shard(0)),
        (img, lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"), Shard(1)),
        (img, lambda x: F.group_norm(x, 3), Shard(0)),
        (spd, torch.linalg.cholesky, Shard(0)),
        (mats, torch.linalg.qr, Shard(0)),
        (mats, torch.linalg.det, Shard(0)),
        (seq, lambda x: torch.sort(x, dim=1), Shard(0)),
        (seq, lambda x: torch.topk(x, 3, dim=1), Shard(0)),
        (seq, lambda x: torch.kthvalue(x, 2, dim=0), Shard(1)),
        (seq, lambda x: torch.cummax(x, dim=1), Shard(0)),
        (seq, lambda x: F.glu(x[:, :6], dim=1), Shard(0)),
        (seq, lambda x: torch.diagonal(x), Replicate()),
        (img, lambda x: torch.diagonal(x, dim1=2, dim2=3), Shard(0)),
        (seq, lambda x: x.index_fill(1, _like(x, torch.tensor([0, 3]), mesh), -1.0), Shard(0)),
        (seq, lambda x: 2.0 - x, Shard(0)),
        (seq, lambda x: torch.floor_divide(x, 0.3), Shard(1)),
        (seq, F.hardswish, Shard(0)),
        (seq, lambda x: torch.permute_copy(x, (1, 0)), Shard(0)),
    ]
    with fallback_policy("error"):
        reset_fallback_counts()
        for k, (t, fn, p) in enumerate(cases):
            got = fn(distribute_tensor(t, mesh, [p]))
            _same(got, fn(t))
            first = got[0] if isinstance(got, (tuple, list)) else got
            if p.is_shard() and k not in (11, 12):  # a shard on the mixed dim is gathered; else kept
                assert first.placements != (Replicate(),), (k, first.placements)
    assert fallback_counts() == {}


@distributed(world_size=2)
def test_shard_on_a_mixed_dim_is_gathered_and_empty_shards_are_avoided():
    mesh = init_device_mesh("cpu", (2,))
    img = _data(1, 3, 4, 4)  # batch of one: rank 1 would hold no image
    with fallback_policy("error"):
        out = F.group_norm(distribute_tensor(img, mesh, [Shard(0)]), 3)
        _same(out, F.group_norm(img, 3))
        assert out.placements == (Replicate(),)
        pooled = F.max_pool2d(distribute_tensor(img, mesh, [Shard(2)]), 2)
        _same(pooled, F.max_pool2d(img, 2))
        assert pooled.placements == (Replicate(),)


@distributed(world_size=2)
def test_constant_added_to_a_partial_sum_once():
    mesh = init_device_mesh("cpu", (2,))
    x = _data(3, 4)
    rank = torch.distributed.get_rank()
    with fallback_policy("error"):
        p = DTensor.from_local(x * (rank + 1) / 3, mesh, [Partial()])
        out = p + 2.5
        assert out.placements == (Partial(),)
        _same(out, x + 2.5)
        p.sub_(1.0)
        assert p.placements == (Partial(),)
        _same(p, x - 1.0)
        d = distribute_tensor(x, mesh, [Shard(1)])
        _same(F.rms_norm(d, (4,), eps=1e-3), F.rms_norm(x, (4,), eps=1e-3))
