"""DTensor core API: conversions, metadata, autograd placements (vs torch's DTensor), distribute_*, errors."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from torch import nn

from lightning_shard import DeviceMesh, init_device_mesh
from lightning_shard.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    StridedShard,
    distribute_module,
    distribute_tensor,
    from_torch_dtensor,
    to_torch_dtensor,
)
from tests.harness import distributed


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _torch_placements(placements):
    out = []
    for p in placements:
        if p.is_shard():
            out.append(tdt.Shard(p.dim))
        elif p.is_partial():
            out.append(tdt.Partial(p.reduce_op))
        else:
            out.append(tdt.Replicate())
    return out


def _same_kind(ours, theirs) -> bool:
    """Placement lists equal by kind and dim (and reduce op)."""
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        b_shard = b.is_shard() or type(b).__name__ == "_StridedShard"  # torch's says is_shard() is False
        if isinstance(a, StridedShard) != (type(b).__name__ == "_StridedShard"):
            return False
        if a.is_shard() != b_shard or a.is_replicate() != b.is_replicate() or a.is_partial() != b.is_partial():
            return False
        if a.is_shard() and a.dim != b.dim:
            return False
    return True


def _raises_everywhere(exc, match, fn):
    """``fn`` raises ``exc`` matching ``match`` on this rank; return the message (compare across ranks)."""
    with pytest.raises(exc, match=match) as info:
        fn()
    return str(info.value)


# ----------------------------------------------------------------------------------------------- 2 ranks
@distributed(world_size=2)
def test_from_local_to_local_metadata():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    t = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    # Even shards without shape: the global shape multiplies the sharded dim.
    local = torch.arange(10.0).reshape(2, 5) + 10 * rank
    x = DTensor.from_local(local, mesh, [Shard(0)])
    assert x.shape == (4, 5) and x.stride() == (5, 1) and x.dtype == torch.float32 and not x.requires_grad
    assert x.placements == (Shard(0),) and x.device_mesh is mesh
    assert x.to_local().data_ptr() == local.data_ptr()  # zero-copy
    assert torch.equal(x.full_tensor(), torch.cat([torch.arange(10.0).reshape(2, 5) + 10 * r for r in range(2)]))
    # Uneven shards with shape and stride.
    mine = torch.chunk(t, 2)[rank]
    y = DTensor.from_local(mine, mesh, [Shard(0)], shape=(7, 5), stride=(5, 1))
    assert y.shape == (7, 5) and y.stride() == (5, 1) and y.to_local().shape == mine.shape
    assert torch.equal(y.full_tensor(), t)
    # Sharded on dim 1 of a transposed tensor: the global stride follows the local memory order.
    tt = t.t().contiguous().t()  # column-major 7x5
    z = DTensor.from_local(torch.chunk(tt, 2, dim=1)[rank], mesh, [Shard(1)], shape=(7, 5))
    assert z.stride() == (1, 7)  # torch asks for the stride with the shape; we infer it from the local layout
    assert torch.equal(z.full_tensor(), t)
    # Replicate, Partial: the global shape is the local shape; Partial(sum) sums terms.
    r = DTensor.from_local(torch.ones(3, 2), mesh, [Replicate()])
    p = DTensor.from_local(torch.ones(3, 2) * (rank + 1), mesh, [Partial()])
    assert r.shape == p.shape == (3, 2)
    assert torch.equal(p.full_tensor(), torch.full((3, 2), 3.0))
    m = DTensor.from_local(torch.ones(3, 2) * (rank + 1), mesh, [Partial("max")])
    assert torch.equal(m.full_tensor(), torch.full((3, 2), 2.0))
    # requires_grad follows the local tensor; dtype too.
    h = DTensor.from_local(torch.ones(2, 2, dtype=torch.float64, requires_grad=True), mesh, [Replicate()])
    assert h.requires_grad and h.dtype == torch.float64 and h.to_local().dtype == torch.float64
    # run_check=True broadcasts Replicate values from the first rank, as torch does.
    rc = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Replicate()], run_check=True)
    assert torch.equal(rc.to_local(), torch.zeros(2))
    ok = DTensor.from_local(mine, mesh, [Shard(0)], shape=(7, 5), run_check=True)
    assert torch.equal(ok.full_tensor(), t)
    # run_check=True catches wrong local shapes, on every rank, with the same message.
    wrong = torch.zeros(4, 5)  # rank 1 should hold 3 rows of 7
    msg = _raises_everywhere(
        ValueError,
        "rank 1 holds",
        lambda: DTensor.from_local(wrong, mesh, [Shard(0)], shape=(7, 5), run_check=True),
    )
    assert len(set(_gather(msg))) == 1
    msg = _raises_everywhere(
        ValueError,
        "ranks disagree on the global shape",
        lambda: DTensor.from_local(torch.zeros(rank + 1, 5), mesh, [Replicate()], run_check=True),
    )
    assert len(set(_gather(msg))) == 1


@distributed(world_size=2)
def test_autograd_placements_match_torch():
    """Gradients through from_local / to_local / redistribute / full_tensor: values and placements vs torch."""
    mesh = init_device_mesh("cpu", (2,))
    tmesh = mesh.to_torch()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    t = torch.randn(7, 5, generator=g)
    w = torch.randn(7, 5, generator=g)

    def both(fn):
        """Run ``fn(api)`` with our API and torch's; ``api`` gives DTensor, distribute_tensor, placements."""
        ours = fn(DTensor, distribute_tensor, mesh, lambda ps: ps)
        theirs = fn(tdt.DTensor, tdt.distribute_tensor, tmesh, _torch_placements)
        return ours, theirs

    for placements in ([Shard(0)], [Shard(1)], [Replicate()], [Partial()]):
        # from_local -> full_tensor: gradient of the local tensor.
        def from_local_prog(D, dist_t, m, conv, placements=placements):
            if placements[0].is_shard():
                local = torch.chunk(t, 2, dim=placements[0].dim)[rank].clone().requires_grad_()
            else:
                local = (t / 2 if placements[0].is_partial() else t).clone().requires_grad_()
            x = D.from_local(local, m, conv(placements), shape=t.shape, stride=t.stride())
            (x.full_tensor() * w).sum().backward()
            return local.grad

        ours, theirs = both(from_local_prog)
        torch.testing.assert_close(ours, theirs)

        if placements[0].is_partial():
            continue  # distribute_tensor takes no Partial
        # to_local / redistribute / full_tensor from a leaf DTensor: the leaf's gradient placements and values.
        for target in ([Replicate()], [Shard(0)], [Shard(1)]):  # torch refuses Partial targets (ours: below)

            def redistribute_prog(D, dist_t, m, conv, placements=placements, target=target):
                x = dist_t(t.clone().requires_grad_(), m, conv(placements))
                y = x.redistribute(m, conv(target))
                (y.full_tensor() * w).sum().backward()
                return x.grad

            ours, theirs = both(redistribute_prog)
            assert _same_kind(ours.placements, theirs.placements), (placements, target, ours, theirs)
            torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor())

        def to_local_prog(D, dist_t, m, conv, placements=placements):
            x = dist_t(t.clone().requires_grad_(), m, conv(placements))
            local = x.to_local()
            (local * local).sum().backward()
            return x.grad

        ours, theirs = both(to_local_prog)
        assert _same_kind(ours.placements, theirs.placements) and ours.placements == tuple(placements)
        torch.testing.assert_close(ours.to_local(), theirs.to_local())

        def to_local_grad_placements_prog(D, dist_t, m, conv, placements=placements):
            x = dist_t(t.clone().requires_grad_(), m, conv(placements))
            y = x.redistribute(m, conv([Replicate()]))
            # Each rank's local gradient is a partial term: say so, then the leaf gets the summed gradient.
            (y.to_local(grad_placements=conv([Partial()])) * w * (rank + 1)).sum().backward()
            return x.grad

        ours, theirs = both(to_local_grad_placements_prog)
        assert _same_kind(ours.placements, theirs.placements)
        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor())
        torch.testing.assert_close(ours.full_tensor(), 3 * w)

        def full_tensor_prog(D, dist_t, m, conv, placements=placements):
            x = dist_t(t.clone().requires_grad_(), m, conv(placements))
            (x.full_tensor() * w).sum().backward()
            return x.grad

        ours, theirs = both(full_tensor_prog)
        assert _same_kind(ours.placements, theirs.placements) and ours.placements == tuple(placements)
        torch.testing.assert_close(ours.full_tensor(), w)


@distributed(world_size=2)
def test_distribute_tensor_src_data_rank():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    base = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    mine = base + rank  # ranks disagree
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        x = distribute_tensor(mine, mesh, placements)  # src_data_rank=0: rank 0's values everywhere
        assert torch.equal(x.full_tensor(), base)
        y = distribute_tensor(mine, mesh, placements, src_data_rank=None)  # each rank keeps its own slice
        want = torch.chunk(mine, 2, dim=placements[0].dim)[rank] if placements[0].is_shard() else mine
        assert torch.equal(y.to_local(), want)
        # Never aliases the caller's tensor (an in-place update of the DTensor leaves the input alone).
        y.to_local().add_(100)
        assert torch.equal(mine, base + rank)
    x = distribute_tensor(base.clone().requires_grad_(), mesh, [Shard(0)])
    assert x.is_leaf and x.requires_grad and x.placements == (Shard(0),)
    # Redistributing never aliases the source either (R -> S on dim 0 is a local slice).
    r = distribute_tensor(base, mesh, [Replicate()])
    s = r.redistribute(mesh, [Shard(0)])
    s.to_local().add_(1)
    assert torch.equal(r.to_local(), base)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 8)
        self.down = nn.Linear(8, 5)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@distributed(world_size=2)
def test_distribute_module_parameter_and_deepcopy():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    plain = _MLP()
    model = copy.deepcopy(plain)
    seen = []

    def partition_fn(name, module, m):
        seen.append(name)
        if name == "up":  # column-parallel: weight rows sharded, uneven bias on 3 of ... rows
            for key, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(key, nn.Parameter(distribute_tensor(p.data, m, [Shard(0)])))

    def input_fn(module, inputs, m):
        return tuple(distribute_tensor(x, m, [Replicate()]) for x in inputs)

    def output_fn(module, outputs, m):
        return outputs.full_tensor()

    distribute_module(model, mesh, partition_fn, input_fn, output_fn)
    assert set(seen) == {"", "up", "down"}
    assert model.up.weight.placements == (Shard(0),) and model.down.weight.placements == (Replicate(),)
    assert isinstance(model.up.weight, nn.Parameter) and isinstance(model.up.weight, DTensor)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    out = model(x)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, plain(x))

    # nn.Parameter(dtensor): still a DTensor, keeps placements and requires_grad.
    d = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    p = nn.Parameter(d)
    assert isinstance(p, DTensor) and isinstance(p, nn.Parameter) and p.requires_grad
    assert p.placements == (Shard(0),) and p.shape == (7, 5)
    assert torch.equal(p.to_local(), d.to_local())

    # deepcopy of a module with DTensor parameters: independent copies with the same layout and values.
    clone = copy.deepcopy(model)
    assert isinstance(clone.up.weight, nn.Parameter) and isinstance(clone.up.weight, DTensor)
    assert clone.up.weight.placements == (Shard(0),) and clone.up.weight.requires_grad
    assert clone.up.weight.to_local().data_ptr() != model.up.weight.to_local().data_ptr()
    assert torch.equal(clone.up.weight.full_tensor(), model.up.weight.full_tensor())
    torch.testing.assert_close(clone(x), plain(x))


@distributed(world_size=2)
def test_bad_input_errors_same_on_every_rank():
    mesh = init_device_mesh("cpu", (2,))
    other = DeviceMesh("cpu", [1, 0])  # same ranks, different order: a different mesh
    x = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    y = distribute_tensor(torch.randn(7, 5), other, [Shard(0)])
    t = torch.randn(7, 5)
    msgs = [
        _raises_everywhere(RuntimeError, r"aten\.add\.Tensor.*plain torch\.Tensor", lambda: x + t),
        _raises_everywhere(RuntimeError, r"aten\.mul\.Tensor.*plain torch\.Tensor", lambda: t * x),
        _raises_everywhere(RuntimeError, "different meshes", lambda: x + y),
        _raises_everywhere(
            ValueError, r"Shard\(dim=2\) is out of range", lambda: distribute_tensor(t, mesh, [Shard(2)])
        ),
        _raises_everywhere(ValueError, r"Shard\(dim=-3\) is out of range", lambda: x.redistribute(mesh, [Shard(-3)])),
        _raises_everywhere(
            ValueError,
            r"2 placements \[Shard\(dim=0\), Replicate\(\)\]",
            lambda: x.redistribute(mesh, [Shard(0), Replicate()]),
        ),
        _raises_everywhere(ValueError, r"0 placements", lambda: DTensor.from_local(t, mesh, [])),
        _raises_everywhere(TypeError, "is not a Placement", lambda: distribute_tensor(t, mesh, ["shard"])),
        _raises_everywhere(ValueError, "already a DTensor", lambda: distribute_tensor(x, mesh, [Shard(0)])),
        _raises_everywhere(ValueError, "reduce_op 'prod'", lambda: Partial("prod")),
        _raises_everywhere(RuntimeError, r"numpy\(\).*full_tensor\(\)\.numpy\(\).*to_local", lambda: x.numpy()),
    ]
    # A 0-dim plain tensor mixes fine (a scalar).
    torch.testing.assert_close((x * torch.tensor(2.0)).full_tensor(), x.full_tensor() * 2)
    assert len({tuple(m) for m in _gather(msgs)}) == 1
    # The group still works: nobody is stuck in a collective.
    assert torch.equal(x.full_tensor(), x.full_tensor())


def _check_interop(mesh, x):
    """x -> torch's DTensor -> ours: zero-copy, same placements by kind, same global metadata and value."""
    t = to_torch_dtensor(x)
    assert isinstance(t, tdt.DTensor) and not isinstance(t, DTensor)
    assert t.shape == x.shape and t.stride() == x.stride() and t.dtype == x.dtype
    assert t.to_local().data_ptr() == x.to_local().data_ptr()
    assert _same_kind(x.placements, t.placements)
    for ours, theirs in zip(x.placements, t.placements):
        assert getattr(ours, "reduce_op", None) == getattr(theirs, "reduce_op", None)
        assert getattr(ours, "split_factor", 1) == getattr(theirs, "split_factor", 1)
    assert [g for g in t.device_mesh.get_all_groups()] == mesh.get_all_groups()
    torch.testing.assert_close(t.full_tensor(), x.full_tensor())
    back = from_torch_dtensor(t)
    assert isinstance(back, DTensor) and back.placements == x.placements and back.device_mesh == mesh
    assert back.shape == x.shape and back.stride() == x.stride()
    assert back.to_local().data_ptr() == x.to_local().data_ptr()
    return t


@distributed(world_size=2)
def test_interop_with_torch_dtensor():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(7, 5, generator=g)
    w = torch.randn(7, 5, generator=g)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        _check_interop(mesh, distribute_tensor(full, mesh, placements))
    for op in ("sum", "avg", "max", "min"):
        _check_interop(mesh, DTensor.from_local(torch.randn(3, 2) + rank, mesh, [Partial(op)]))
    # Column-major global stride survives both ways.
    _check_interop(mesh, DTensor.from_local(torch.randn(5, 3).t(), mesh, [Shard(1)], shape=(3, 10)))
    # torch's DTensor -> ours, uneven shards made by torch.
    t = tdt.distribute_tensor(full, mesh.to_torch(), [tdt.Shard(0)])
    x = from_torch_dtensor(t)
    assert x.placements == (Shard(0),) and x.to_local().data_ptr() == t.to_local().data_ptr()
    assert torch.equal(x.full_tensor(), full)
    # Autograd flows across both conversions, with the leaf's placements.
    leaf = distribute_tensor(full.clone().requires_grad_(), mesh, [Shard(1)])
    (to_torch_dtensor(leaf).full_tensor() * w).sum().backward()
    assert leaf.grad.placements == (Shard(1),)
    torch.testing.assert_close(leaf.grad.full_tensor(), w)
    tleaf = tdt.distribute_tensor(full.clone().requires_grad_(), mesh.to_torch(), [tdt.Shard(0)])
    (from_torch_dtensor(tleaf).full_tensor() * w).sum().backward()
    assert tleaf.grad.placements == (tdt.Shard(0),)
    torch.testing.assert_close(tleaf.grad.full_tensor(), w)
    with pytest.raises(TypeError, match="expected a lightning_shard DTensor"):
        to_torch_dtensor(full)
    with pytest.raises(TypeError, match="expected torch.distributed.tensor.DTensor"):
        from_torch_dtensor(full)


# ----------------------------------------------------------------------------------------------- 4 ranks
@distributed(world_size=4)
def test_2d_conversions_and_autograd():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tmesh = mesh.to_torch()
    g = torch.Generator().manual_seed(0)
    t = torch.randn(101, 48, generator=g)
    w = torch.randn(101, 48, generator=g)
    for placements in ([Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)]):
        ours = distribute_tensor(t.clone().requires_grad_(), mesh, placements)
        theirs = tdt.distribute_tensor(t.clone().requires_grad_(), tmesh, _torch_placements(placements))
        assert ours.to_local().shape == theirs.to_local().shape and torch.equal(ours.to_local(), theirs.to_local())
        # from_local of those shards with the global shape rebuilds the same DTensor.
        back = DTensor.from_local(ours.to_local().detach(), mesh, placements, shape=t.shape, run_check=True)
        assert torch.equal(back.full_tensor(), t)
        for target in ([Replicate(), Replicate()], [Shard(1), Replicate()], [Replicate(), Shard(0)]):
            a = ours.redistribute(mesh, target)
            b = theirs.redistribute(tmesh, _torch_placements(target))
            (a.full_tensor() * w).sum().backward()
            (b.full_tensor() * w).sum().backward()
        assert _same_kind(ours.grad.placements, theirs.grad.placements)
        torch.testing.assert_close(ours.grad.to_local(), theirs.grad.to_local())
        torch.testing.assert_close(ours.grad.full_tensor(), 3 * w)
    # Partial targets (torch refuses them; ours keep the value on one rank per group for sum): the gradient
    # flows back as the input's placements.
    x = distribute_tensor(t.clone().requires_grad_(), mesh, [Shard(1), Shard(0)])
    y = x.redistribute(mesh, [Partial(), Shard(0)])
    assert torch.equal(y.full_tensor(), t)
    (y.full_tensor() * w).sum().backward()
    assert x.grad.placements == (Shard(1), Shard(0))
    torch.testing.assert_close(x.grad.full_tensor(), w)
    with pytest.raises(ValueError, match="1 placements"):
        distribute_tensor(t, mesh, [Shard(0)])


@distributed(world_size=4)
def test_interop_2d_nested_and_strided():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    for placements in (
        [Shard(0), Shard(1)],
        [Shard(0), Shard(0)],
        [Replicate(), Shard(1)],
        [Partial(), Shard(0)],
        [StridedShard(0, split_factor=2), Shard(0)],  # FSDP over TP; torch's layout agrees on 2x2 meshes
    ):
        x = distribute_tensor(full, mesh, [Replicate(), Replicate()]).redistribute(mesh, placements)
        t = _check_interop(mesh, x)
        # torch computes on it: its own redistribution gives the same value.
        if not any(p.is_partial() for p in placements):
            assert torch.equal(t.redistribute(t.device_mesh, [tdt.Replicate()] * 2).to_local(), full)
    # A split_factor that does not describe our layout in torch's terms: refused on every rank, no hang.
    x = distribute_tensor(full, mesh, [StridedShard(0, split_factor=3), Shard(0)])
    with pytest.raises(ValueError, match="different layout in torch's _StridedShard"):
        to_torch_dtensor(x)
    assert torch.equal(x.full_tensor(), full)


def test_same_storage_on_tensors_without_memory():
    """Meta and fake tensors all have data pointer 0: aliasing is decided by storage identity, not pointers
    (distribute_tensor and redistribute clone a local shard only when it aliases its source)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_shard.device import same_storage as _shares_storage

    a, b = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta")
    assert _shares_storage(a, a[1:]) and not _shares_storage(a, b)
    with FakeTensorMode():
        c, d = torch.empty(4, 4), torch.empty(4, 4)
        assert _shares_storage(c, c.t()) and not _shares_storage(c, d)
    e = torch.zeros(3)
    assert _shares_storage(e, e[1:]) and not _shares_storage(e, e.clone())
