"""Rules added for ops torch's DTensor computes and ours used to send to the replicate fallback: scatter
views, pixel/channel shuffle, grid sampling, rot90, bucketize, prelu, logsigmoid, vdot/addr, ``norm(p, dim)``,
narrow_copy, squeeze_copy, aminmax, global reductions (median, trace, histc, dist), out-of-place fill, and
batch norm as a replicate rule (running statistics written back). Each runs on ``Shard(0)`` and
``Replicate`` inputs on 2 ranks without the fallback and equals the plain op."""

import torch
import torch.nn.functional as F

from lightning_shard import init_device_mesh
from lightning_shard.tensor import (
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    fallback_policy,
    reset_fallback_counts,
)
from tests.dtensor_rule_cases import assert_same, check_rules_match_plain, data
from tests.harness import distributed

S, R = Shard(0), Replicate()


def _cases():
    img = data(5, 8, 4, 4)
    grid = data(5, 3, 3, 2, seed=1).tanh()
    m = data(5, 6, seed=2)
    v = data(7, seed=3)
    return [
        # (name, fn, tensor inputs, the output's placement for Shard(0) inputs)
        ("select_scatter", lambda x, s: torch.select_scatter(x, s, 1, 2), [m, data(5, seed=4)], S),
        ("diagonal_scatter", lambda x, s: torch.diagonal_scatter(x, s, 0, 1, 2), [img, data(5, 4, 4)], S),
        ("slice_scatter", lambda x, s: torch.slice_scatter(x, s, 1, 1, 3), [m, data(5, 2, seed=5)], S),
        ("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), [img], S),
        ("pixel_unshuffle", lambda x: F.pixel_unshuffle(x, 2), [img], S),
        ("channel_shuffle", lambda x: F.channel_shuffle(x, 2), [img], S),
        ("grid_sample", lambda x, g: F.grid_sample(x, g, align_corners=False), [img, grid], S),
        ("rot90", lambda x: torch.rot90(x, 1, (2, 3)), [img], S),
        ("rot90 of the sharded dim", lambda x: torch.rot90(x, 1, (0, 1)), [m], R),
        ("bucketize", lambda x, b: torch.bucketize(x, b), [m, torch.linspace(-1, 1, 5)], S),
        ("prelu", lambda x, w: F.prelu(x, w), [img, data(8, seed=6)], S),
        ("logsigmoid", lambda x: F.logsigmoid(x), [m], S),
        ("vdot", lambda x, y: torch.vdot(x, y), [v, data(7, seed=7)], Partial()),
        ("addr", lambda a, x, y: torch.addr(a, x, y), [data(7, 6), v, data(6, seed=8)], S),
        ("pairwise_distance", lambda x, y: F.pairwise_distance(x, y), [m, data(5, 6, seed=9)], S),
        ("narrow_copy", lambda x: torch.narrow_copy(x, 1, 1, 3), [m], S),
        ("squeeze_copy", lambda x: torch.squeeze_copy(x), [data(5, 1, 3)], S),
        ("aminmax over a dim", lambda x: torch.aminmax(x, dim=1), [m], S),
        ("aminmax", lambda x: torch.aminmax(x), [m], R),
        ("median", lambda x: torch.median(x), [m], R),
        ("trace", lambda x: torch.trace(x), [m], R),
        ("histc", lambda x: torch.histc(x, bins=4), [m], R),
        ("dist", lambda x, y: torch.dist(x, y), [m, data(5, 6, seed=10)], R),
        ("fill", lambda x: torch.fill(x, 2.5), [m], S),
        ("tril", lambda x: torch.tril(x, 1), [img], S),
        ("max_pool2d backward", _max_pool_grad, [img], S),
    ]


def _max_pool_grad(x):
    out, idx = torch.ops.aten.max_pool2d_with_indices(x, [2, 2])
    return torch.ops.aten.max_pool2d_with_indices_backward(out, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)


@distributed(world_size=2)
def test_rules_match_plain_without_fallback():
    check_rules_match_plain(init_device_mesh("cpu", (2,)), _cases())


@distributed(world_size=2)
def test_batch_norm_replicate_rule_updates_running_stats_without_fallback():
    mesh = init_device_mesh("cpu", (2,))
    x, w, b = data(6, 3, 4), data(3, seed=1), data(3, seed=2)
    rm, rv = torch.zeros(3), torch.ones(3)
    want = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.3)
    for placement in (Shard(0), Replicate()):
        d = [distribute_tensor(t, mesh, [placement]) for t in (x, torch.zeros(3), torch.ones(3), w, b)]
        reset_fallback_counts()
        with fallback_policy("error"):
            got = F.batch_norm(d[0], d[1], d[2], d[3], d[4], training=True, momentum=0.3)
        assert fallback_counts() == {}
        assert_same(got, want, "batch_norm")
        assert_same(d[1], rm, "running_mean")
        assert_same(d[2], rv, "running_var")
        assert d[1].placements == (placement,)  # written back into its own shards
