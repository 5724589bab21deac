"""Mesh-aware clip_grad_norm_ vs torch.nn.utils.clip_grad_norm_ on the full gradients."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import comm, init_device_mesh
from lightning_shard.tensor import DTensor, Partial, Replicate, Shard, StridedShard, distribute_tensor
from lightning_shard.utils import clip_grad_norm_
from tests.harness import distributed


def _param(full_grad, mesh=None, placements=None, seed=0):
    """A parameter (DTensor when ``mesh`` is given) whose gradient's global value is ``full_grad``."""
    if mesh is None:
        p = nn.Parameter(torch.zeros_like(full_grad))
        p.grad = full_grad.clone()
        return p
    p = nn.Parameter(distribute_tensor(torch.zeros_like(full_grad), mesh, [Replicate()] * mesh.ndim))
    partial = [i for i, pl in enumerate(placements) if pl.is_partial()]
    if partial:  # per-rank terms that sum to full_grad along the partial mesh dim
        (i,) = partial
        g = torch.Generator().manual_seed(seed)
        terms = [torch.randn(full_grad.shape, generator=g) for _ in range(mesh.size(i) - 1)]
        terms.append(full_grad - sum(terms))
        rest = [Replicate() if pl.is_partial() else pl for pl in placements]
        local = distribute_tensor(terms[mesh.get_local_rank(i)], mesh, rest, src_data_rank=None).to_local()
        grad = DTensor.from_local(local, mesh, placements, shape=full_grad.shape, stride=full_grad.stride())
    else:
        grad = distribute_tensor(full_grad, mesh, placements)
    p.grad = grad.redistribute(mesh, placements)
    return p


def _full_grad(p):
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


def _check(layout, norm_type, max_norm_scale, expected_all_reduces):
    """``layout``: list of (shape, mesh or None, placements); compare with torch on the full gradients."""
    g = torch.Generator().manual_seed(1)
    fulls = [torch.randn(shape, generator=g) for shape, _, _ in layout]
    ours = [_param(f, m, pl, seed=k) for k, (f, (_, m, pl)) in enumerate(zip(fulls, layout))]
    ref = [_param(f) for f in fulls]
    ref_total = torch.nn.utils.clip_grad_norm_(ref, math.inf, norm_type=norm_type)  # just the norm
    max_norm = float(ref_total) * max_norm_scale
    ref_total = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    with comm.count_collectives() as counts:
        total = clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    assert not isinstance(total, DTensor) and total.ndim == 0
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-5)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(_full_grad(p), r.grad, rtol=1e-5, atol=1e-6)
    got = counts.calls["all_reduce"]
    assert got == expected_all_reduces, f"{got} all-reduces, expected {expected_all_reduces} ({norm_type})"
    assert dict(counts.calls).keys() <= {"all_reduce"}
    # The same total everywhere.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total.item())
    assert len(set(everyone)) == 1


@distributed(world_size=2)
def test_clip_grad_norm_1d():
    mesh = init_device_mesh("cpu", (2,))
    layout = [
        ((7, 5), mesh, [Shard(0)]),
        ((101, 48), mesh, [Shard(1)]),
        ((3,), mesh, [Shard(0)]),  # uneven: 2 and 1
        ((1, 4), mesh, [Shard(0)]),  # one rank holds an empty shard
        ((6, 2), mesh, [Replicate()]),  # counted once, not once per rank
        ((4, 3), None, None),  # plain tensor
    ]
    for norm_type in (2.0, 1.0, math.inf):
        _check(layout, norm_type, 0.3, expected_all_reduces=1)  # one all-reduce for all sharded grads
        _check(layout, norm_type, 2.0, expected_all_reduces=1)  # no clipping: max_norm above the norm
    # A Partial gradient is reduced first (one more all-reduce); plain + replicated only: no collective.
    _check(layout + [((5, 5), mesh, [Partial()])], 2.0, 0.5, expected_all_reduces=2)
    _check([((6, 2), mesh, [Replicate()]), ((4, 3), None, None)], 2.0, 0.5, expected_all_reduces=0)
    _check(layout, 3.0, 0.5, expected_all_reduces=1)
    # Errors: same everywhere, before any hang.
    bad = _param(torch.full((7, 5), math.inf), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="total norm of order 2.0"):
        clip_grad_norm_([bad], 1.0, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="norm_type -1.0"):
        clip_grad_norm_([bad], 1.0, norm_type=-1)
    assert float(clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0)) == 0.0  # no gradients


@distributed(world_size=4)
def test_clip_grad_norm_2d_and_two_meshes():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    flat = init_device_mesh("cpu", (4,))  # a second mesh over the same ranks
    tp = mesh["tensor_parallel"]  # a sub-mesh (1-D) of the first
    layout = [
        ((7, 5), mesh, [Shard(0), Shard(1)]),
        ((101, 48), mesh, [Shard(0), Shard(0)]),
        ((9, 5), mesh, [StridedShard(0, split_factor=2), Shard(0)]),
        ((7, 5), mesh, [Shard(1), Replicate()]),
        ((5, 7), mesh, [Replicate(), Shard(0)]),
        ((3, 3), mesh, [Replicate(), Replicate()]),
        ((2, 3), None, None),
    ]
    # Groups: all 4 ranks, data_parallel, tensor_parallel -> 3 all-reduces.
    for norm_type in (2.0, 1.0, math.inf):
        _check(layout, norm_type, 0.4, expected_all_reduces=3)
    # The other meshes reduce over the same groups of ranks: still 3 all-reduces.
    more = layout + [((11, 2), flat, [Shard(0)]), ((5, 3), tp, [Shard(1)]), ((4,), flat, [Replicate()])]
    _check(more, 2.0, 0.4, expected_all_reduces=3)
    # A Partial on one mesh dim: reduced first (+1), then counted with the tensor_parallel group.
    _check(layout + [((6, 4), mesh, [Partial(), Shard(0)])], 2.0, 0.4, expected_all_reduces=4)
    _check(layout[:1] + [((6, 4), mesh, [Partial(), Shard(0)])], math.inf, 0.4, expected_all_reduces=3)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@distributed(world_size=2)
def test_torch_clip_grad_norm_on_our_dtensors_matches_full_gradients(norm_type):
    """Users call ``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` themselves (manual optimization,
    ``on_before_optimizer_step``): on our sharded gradients it must clip as on the full ones."""
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(3)
    fulls = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g), torch.randn(2, 2, generator=g)]
    layouts = [[Shard(0)], [Replicate()], [Shard(1)]]
    ours = [_param(f, mesh, pl) for f, pl in zip(fulls, layouts)]
    ref = [_param(f) for f in fulls]
    max_norm = 0.5 * float(torch.nn.utils.clip_grad_norm_(ref, math.inf, norm_type=norm_type))
    ref_total = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    total = torch.nn.utils.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-5)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(_full_grad(p), r.grad, rtol=1e-5, atol=1e-6)
