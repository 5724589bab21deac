"""fully_shard on real gloo groups: parity with a single process and torch FSDP2, memory, communication."""

import contextlib
import copy
import ctypes
import os
import resource
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_shard import comm, init_device_mesh
from lightning_shard.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    summon_full_params,
)
from lightning_shard.tensor import DTensor, Replicate, Shard
from numba_kernels import GroupLayout
from tests.fsdp_models import (
    batches,
    full_state,
    loss_fn,
    make_model,
    make_optimizer,
    max_diff,
    rank_slice,
    train_reference,
)
from tests.harness import distributed


def _dp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))


def _shard(model, mesh, **kwargs):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _torch_shard(model, mesh, **kwargs):
    """The same wrapping with torch's FSDP2 (the oracle)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh.to_torch(), **kwargs)
    torch_fully_shard(model, mesh=mesh.to_torch(), **kwargs)
    return model


def _train(model, data, optim="sgd", lr=0.1, dp_rank=None, dp_world=None):
    rank = dist.get_rank() if dp_rank is None else dp_rank
    world = dist.get_world_size() if dp_world is None else dp_world
    opt = make_optimizer(model, lr, optim)
    losses = []
    for x, y in data:
        loss = loss_fn(model, rank_slice(x, rank, world), rank_slice(y, rank, world))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _storage_freed(model) -> bool:
    groups = [m._fsdp_state.group for m in model.modules() if isinstance(m, FSDPModule)]
    return all(g is None or g.unsharded_flat.untyped_storage().nbytes() == 0 for g in groups)


# ---------------------------------------------------------------------------------------------- 2 ranks
@distributed(world_size=2)
def test_parity_with_single_process_and_torch_fsdp2():
    data = batches(5, 4)
    model = make_model()
    ref, _ = train_reference(model, data)
    theirs = copy.deepcopy(model)
    mesh = _dp_mesh()
    _shard(model, mesh)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
    _torch_shard(theirs, mesh)
    _train(model, data)
    _train(theirs, data)
    ours = full_state(model)
    assert max_diff(ours, full_state(ref)) < 1e-5
    assert max_diff(ours, full_state(theirs)) < 1e-5
    assert _storage_freed(model)
    # frozen parameters have no gradient and did not move
    assert model.frozen.weight.grad is None
    assert torch.equal(ours["frozen.weight"], make_model().frozen.weight.detach())


@distributed(world_size=2)
def test_gradient_accumulation_without_sync_communicates_once():
    data = batches(3, 8)
    model = make_model()
    ref, _ = train_reference(model, data)
    _shard(model, _dp_mesh())
    opt = make_optimizer(model, 0.1, "sgd")
    rank, world = dist.get_rank(), dist.get_world_size()
    for x, y in data:
        xs, ys = rank_slice(x, rank, world).chunk(2), rank_slice(y, rank, world).chunk(2)
        opt.zero_grad()
        model.set_requires_gradient_sync(False)
        with comm.count_collectives() as counts:
            (loss_fn(model, xs[0], ys[0]) / 2).backward()
        assert counts.calls["reduce_scatter"] == 0
        model.set_requires_gradient_sync(True)
        with comm.count_collectives() as counts:
            (loss_fn(model, xs[1], ys[1]) / 2).backward()
        assert counts.calls["reduce_scatter"] == len(model.blocks) + 1
        opt.step()
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}


@distributed(world_size=2)
def test_gradients_freed_by_zero_grad_and_accumulated_without_it():
    _check_gradients_freed_and_accumulated()


@contextlib.contextmanager
def _gloo_collectives():
    """On gloo, FSDP's all-gathers and reduce-scatters run as pairwise sends (``comm._runs_pairwise``), which
    every other test here takes; this runs gloo's own collectives instead, the calls an NCCL group gets. Yields
    the input sizes of the reduce-scatters issued (a pairwise path taken by mistake leaves it empty)."""
    original_pairwise, original_reduce_scatter = comm._PAIRWISE_ON_GLOO, comm._reduce_scatter_single
    calls = []

    def counting_reduce_scatter(output, input, *args, **kwargs):
        calls.append(input.numel())
        return original_reduce_scatter(output, input, *args, **kwargs)

    comm._PAIRWISE_ON_GLOO, comm._reduce_scatter_single = False, counting_reduce_scatter
    try:
        yield calls
    finally:
        comm._PAIRWISE_ON_GLOO, comm._reduce_scatter_single = original_pairwise, original_reduce_scatter


@distributed(world_size=2)
def test_gradient_reduction_by_gloo_collectives_freed_and_accumulated():
    with _gloo_collectives() as calls:
        _check_gradients_freed_and_accumulated()
    assert len(calls) == 5 * (len(make_model().blocks) + 1)  # 5 backward passes, one per group each


@distributed(world_size=2)
def test_gloo_collectives_parity_mixed_precision_offload():
    with _gloo_collectives() as calls:
        test_parity_with_single_process_and_torch_fsdp2.__wrapped__()
        test_bf16_mixed_precision_close_to_fp32.__wrapped__()
        test_cpu_offload_parity.__wrapped__()
        test_gradient_accumulation_without_sync_communicates_once.__wrapped__()
    assert calls


@distributed(world_size=4)
def test_gloo_collectives_hsdp_and_four_ranks():
    with _gloo_collectives() as calls:
        test_hsdp_two_by_two_parity.__wrapped__()
    assert len(calls) == 3 * (len(make_model().blocks) + 1)  # per step and group: one shard-group reduce-scatter
    with _gloo_collectives() as calls:
        test_four_ranks_uneven_parity.__wrapped__()
    assert calls


def _eventually(predicate, timeout_s: float = 2.0) -> bool:
    """Whether ``predicate()`` becomes true within ``timeout_s`` (polled every 5 ms)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _check_gradients_freed_and_accumulated():
    (x1, y1), (x2, y2) = batches(2, 8)
    model = make_model()
    ref = copy.deepcopy(model)
    _shard(model, _dp_mesh())
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [m._fsdp_state.group for m in [*model.blocks, model]]
    opt = make_optimizer(model, 0.1, "sgd")

    def backward(x, y):
        loss_fn(model, rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        loss_fn(ref, x, y).backward()

    def assert_grads_match():
        ours, want = _full_grads(model), _full_grads(ref)
        assert (
            max_diff({k: v for k, v in ours.items() if v is not None}, {k: v for k, v in want.items() if v is not None})
            < 1e-6
        )

    backward(x1, y1)  # the reduce-scatter writes straight into the gradient buffer
    assert_grads_match()
    backward(x2, y2)  # no zero_grad: the second reduce is added to the first
    assert_grads_match()
    opt.zero_grad(set_to_none=False)  # zeroed views into the buffer: kept, accumulated into
    ref.zero_grad(set_to_none=False)
    kept = [g.grad_flat for g in groups]
    backward(x2, y2)
    assert_grads_match()
    assert all(g.grad_flat is k for g, k in zip(groups, kept))
    del kept
    opt.zero_grad()  # set_to_none: frees the buffer at once, as torch frees its gradients
    ref.zero_grad()
    # gloo's worker thread can hold the last collective's input (here a .grad view, all-gathered by
    # full_tensor() above) for a few ms after the collective returned: allow it that long.
    assert _eventually(lambda: all(g.grad_flat is None for g in groups))
    loss = loss_fn(model, rank_slice(x1, rank, world), rank_slice(y1, rank, world))
    loss.backward()
    loss_fn(ref, x1, y1).backward()
    assert_grads_match()
    held = next(p.grad for p in model.parameters() if p.grad is not None)  # a gradient the user holds on to
    held_values = held.to_local().clone()
    loss = loss_fn(model, rank_slice(x2, rank, world), rank_slice(y2, rank, world))
    opt.zero_grad()  # after forward, before backward: Lightning's order
    ref.zero_grad()
    loss.backward()
    loss_fn(ref, x2, y2).backward()
    assert torch.equal(held.to_local(), held_values)  # never overwritten by a later reduction
    assert_grads_match()


@distributed(world_size=2)
def test_collective_counts_per_step():
    x, y = batches(1, 4)[0]
    for reshard_after_forward, gathers_per_block in ((True, 2), (False, 1)):
        model = _shard(make_model(), _dp_mesh(), reshard_after_forward=reshard_after_forward)
        with comm.count_collectives() as counts:
            loss_fn(model, x, y).backward()
        n_blocks = len(model.blocks)
        # The root keeps its parameters between forward and backward (as torch's fully_shard does).
        assert counts.calls["all_gather"] == gathers_per_block * n_blocks + 1
        assert counts.calls["reduce_scatter"] == n_blocks + 1
        assert counts.calls["all_reduce"] == 0
        assert counts.calls["all_reduce_flags"] == n_blocks + 1  # which parameters got a gradient, per group
        assert _storage_freed(model)


@distributed(world_size=2)
def test_reshard_after_forward_false_parity_and_memory():
    data = batches(4, 4)
    model = make_model()
    ref, _ = train_reference(model, data)
    _shard(model, _dp_mesh(), reshard_after_forward=False)
    x, y = data[0]
    loss = loss_fn(model, x, y)
    # unsharded parameters are kept until backward
    assert all(m._fsdp_state.group.is_unsharded for m in model.blocks)
    loss.backward()
    assert _storage_freed(model)
    model.zero_grad()
    _train(model, data)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


@distributed(world_size=2)
def test_memory_is_the_sharded_share():
    model = _shard(make_model(), _dp_mesh())
    world = dist.get_world_size()
    full_numel = sum(p.numel() for p in make_model().parameters())
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    # Each rank stores 1/world of every parameter, up to the padding of uneven dim-0 sizes.
    assert full_numel / world <= sum(m._fsdp_state.group.layout.shard_numel for m in [*model.blocks, model])
    assert abs(local_numel - full_numel / world) <= sum(p.shape[0] for p in model.parameters())
    data = batches(2, 4)
    _train(model, data)
    for p in model.parameters():
        if p.requires_grad:
            assert p.grad.to_local().shape == p.to_local().shape
    opt_state_numel = sum(p.to_local().numel() for p in model.parameters() if p.requires_grad)
    assert opt_state_numel <= local_numel
    assert _storage_freed(model)


@distributed(world_size=2)
def test_bf16_mixed_precision_close_to_fp32():
    data = batches(4, 4)
    model = make_model()
    _, ref_losses = train_reference(model, data)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    _shard(model, _dp_mesh(), mp_policy=mp)
    group = model.blocks[0]._fsdp_state.group
    assert group.compute_dtype == torch.bfloat16 and group.reduce_dtype == torch.float32
    losses = _train(model, data)
    for ours, ref in zip(losses, ref_losses):
        total = ours.clone()
        dist.all_reduce(total)
        assert abs(total.item() / dist.get_world_size() - ref) <= 1e-2 * abs(ref)
    for p in model.parameters():
        assert p.dtype == torch.float32  # master weights stay fp32


@distributed(world_size=2)
def test_cpu_offload_parity():
    data = batches(3, 4)
    model = make_model()
    ref, _ = train_reference(model, data)
    _shard(model, _dp_mesh(), offload_policy=CPUOffloadPolicy())
    _train(model, data)
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


@distributed(world_size=2)
def test_adamw_parity():
    data = batches(4, 4)
    model = make_model()
    ref, _ = train_reference(model, data, optim="adamw")
    _shard(model, _dp_mesh())
    _train(model, data, optim="adamw")
    assert max_diff(full_state(model), full_state(ref)) < 2e-4


@distributed(world_size=2)
def test_eval_no_grad_inference_matches_and_frees():
    model = make_model()
    ref = copy.deepcopy(model).eval()
    _shard(model, _dp_mesh(), reshard_after_forward=False)
    model.eval()
    x, _ = batches(1, 4)[0]
    with torch.no_grad():
        out = model(x)
    assert torch.allclose(out, ref(x), atol=1e-6)
    assert _storage_freed(model)


class _Twice(nn.Module):
    """A block called twice per forward and a block whose forward is skipped."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(4, 8)
        self.shared = nn.Linear(8, 8)
        self.skipped = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h)


@distributed(world_size=2)
def test_module_called_twice_and_skipped_module():
    torch.manual_seed(4)
    xs, ys = torch.randn(4, 8, 4), torch.randn(4, 8, 3)
    model = _Twice()
    ref = copy.deepcopy(model)
    mesh = _dp_mesh()
    for m in (model.shared, model.skipped, model.out):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for x, y in zip(xs, ys):
        for m, opt, xb, yb in ((model, opts[0], x.chunk(world)[rank], y.chunk(world)[rank]), (ref, opts[1], x, y)):
            opt.zero_grad()
            F.mse_loss(m(xb), yb).backward()
            opt.step()
    assert model.skipped.weight.grad is None
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


@distributed(world_size=2)
def test_summon_full_params_read_edit_and_rank0_only():
    model = make_model()
    expected = full_state(model)
    _shard(model, _dp_mesh())
    with summon_full_params(model):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.norm.weight.fill_(2.0)
    assert max_diff(got, expected) == 0
    assert torch.equal(model.norm.weight.full_tensor(), torch.full_like(expected["norm.weight"], 2.0))
    x, _ = batches(1, 2)[0]
    with summon_full_params(model, writeback=False, rank0_only=True):
        if dist.get_rank() == 0:
            model(x)  # generation on one rank: no collective may run
            assert not isinstance(model.head.weight, DTensor)
        else:
            assert isinstance(model.head.weight, DTensor)
    assert isinstance(model.norm.weight, DTensor)
    with (
        pytest.raises(ValueError, match="rank0_only=True cannot write back"),
        summon_full_params(model, rank0_only=True),
    ):
        pass


@distributed(world_size=2)
def test_explicit_unshard_reshard_and_prefetch():
    model = _shard(make_model(n_blocks=3), _dp_mesh())
    handle = model.blocks[0].unshard(async_op=True)
    handle.wait()
    assert not isinstance(model.blocks[0].up.weight, DTensor)
    model.blocks[0].reshard()
    assert isinstance(model.blocks[0].up.weight, DTensor)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks[:-1]):
        block.set_modules_to_forward_prefetch([blocks[i + 1]])
    for i, block in enumerate(blocks[1:], start=1):
        block.set_modules_to_backward_prefetch([blocks[i - 1]])
    data = batches(3, 4)
    ref, _ = train_reference(make_model(n_blocks=3), data)
    _train(model, data)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5
    assert _storage_freed(model)


@distributed(world_size=2)
def test_forward_prefetch_by_default_and_unused_prefetch_dropped():
    data = batches(4, 4)
    model = make_model(n_blocks=3)
    ref = copy.deepcopy(model)
    _shard(model, _dp_mesh())
    blocks, ref_blocks = list(model.blocks), list(ref.blocks)
    group2 = blocks[2]._fsdp_state.group
    seen = []
    # Runs after FSDP's own pre-forward hook (prepended): block 1 is unsharded, block 2's gather may be started.
    blocks[1].register_forward_pre_hook(lambda m, a: seen.append(group2.pending_all_gather is not None))
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = [make_optimizer(m, 0.1, "sgd") for m in (model, ref)]
    after_forward = []

    def step(x, y):
        for m, opt, xb, yb in (
            (model, opts[0], rank_slice(x, rank, world), rank_slice(y, rank, world)),
            (ref, opts[1], x, y),
        ):
            opt.zero_grad()
            loss = loss_fn(m, xb, yb)
            if m is model:
                after_forward.append((group2.pending_all_gather is not None, group2.is_unsharded))
            loss.backward()
            opt.step()

    step(*data[0])
    assert seen == [False]  # first step: no forward order recorded yet
    step(*data[1])
    assert seen == [False, True]  # block 1's forward started block 2's all-gather
    model.blocks, ref.blocks = nn.ModuleList(blocks[:2]), nn.ModuleList(ref_blocks[:2])  # block 2 skipped
    step(*data[2])
    assert after_forward[-1] == (False, False)  # the unused prefetch was dropped when forward ended
    model.blocks, ref.blocks = nn.ModuleList(blocks), nn.ModuleList(ref_blocks)
    step(*data[3])  # block 2 must be gathered afresh, after the optimizer steps in between
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


@distributed(world_size=2)
def test_meta_init_materialised_shard_by_shard():
    with torch.device("meta"):
        model = make_model()
    _shard(model, _dp_mesh())
    with pytest.raises(RuntimeError, match="still on the meta device"):
        model(batches(1, 2)[0][0])
    model.to_empty(device="cpu")
    ref = make_model()
    with torch.no_grad():  # load the reference values shard by shard
        for p, q in zip(model.parameters(), ref.parameters()):
            start = dist.get_rank() * -(-p.shape[0] // dist.get_world_size())
            p.to_local().copy_(q.detach()[start : start + p.to_local().shape[0]])
        model.scale.copy_(ref.scale)  # buffers are plain tensors: to_empty leaves them uninitialised
    assert max_diff(full_state(model), full_state(ref)) == 0
    data = batches(2, 4)
    ref_trained, _ = train_reference(ref, data)
    _train(model, data)
    assert max_diff(full_state(model), full_state(ref_trained)) < 1e-5


def _module_visits_sharding_the_root(blocks: int) -> int:
    """How many modules ``named_modules`` yields while ``fully_shard`` wraps the root of ``blocks`` sharded blocks."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(blocks)])
    for block in model:
        fully_shard(block, mesh=_dp_mesh())
    visits = [0]
    walk = nn.Module.named_modules

    def counting(self, *args, **kwargs):
        for item in walk(self, *args, **kwargs):
            visits[0] += 1
            yield item

    nn.Module.named_modules = counting
    try:
        fully_shard(model, mesh=_dp_mesh())
    finally:
        nn.Module.named_modules = walk
    return visits[0]


@distributed(world_size=1)
def test_sharding_the_root_visits_each_module_a_bounded_number_of_times():
    # The bottom-up check asked, for every parameter the blocks had sharded, which block manages it by walking
    # every module: quadratic in the model's size (fully_shard of an 800-block root took 39 s, torch's 3 s).
    small, large = _module_visits_sharding_the_root(8), _module_visits_sharding_the_root(32)
    assert large < 5 * small, (small, large)  # 4x the blocks: linear is about 4x the visits, quadratic 16x


@distributed(world_size=2)
def test_bad_input_errors_and_model_stays_usable():
    mesh = _dp_mesh()
    model = make_model()
    fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match="applied to it twice"):
        fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match="ModuleList has no forward"):
        fully_shard(model.blocks, mesh=mesh)
    tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tensor_parallel",))
    with pytest.raises(ValueError, match="no \\(or not only a\\) data-parallel dimension"):
        fully_shard(model.blocks[1], mesh=tp_mesh)
    with pytest.raises(ValueError, match="reshard_after_forward=3"):
        fully_shard(model.blocks[1], mesh=mesh, reshard_after_forward=3)
    top = make_model()
    fully_shard(top, mesh=mesh)
    with pytest.raises(ValueError, match="apply fully_shard bottom-up"):
        fully_shard(top.blocks[0], mesh=mesh)
    ints = nn.Module()
    ints.register_parameter("ids", nn.Parameter(torch.arange(4), requires_grad=False))
    with pytest.raises(ValueError, match="'ids' has dtype torch.int64"):
        fully_shard(ints, mesh=mesh)
    # the partly wrapped model still trains after the errors
    fully_shard(model.blocks[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = batches(2, 4)
    ref, _ = train_reference(make_model(), data)
    _train(model, data)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


# ---------------------------------------------------------------------------------------------- 4 ranks
class _Gained(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.gain = nn.Parameter(torch.tensor(-0.3))

    def forward(self, x):
        return super().forward(x) * self.gain


class _Scaled(nn.Module):
    """A learnable 0-dim temperature in the root and in a unit (as CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Gained()
        self.out = nn.Linear(4, 4)
        self.temperature = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return (self.out(self.inner(x)) * self.temperature.exp()).square().mean()


@distributed(world_size=2)
def test_scalar_parameters_stay_whole_on_every_rank_and_train_as_one_process():
    # fully_shard refused 0-dim parameters (as torch's does), so CLIP-style temperatures could not be trained.
    from lightning_shard.checkpoint import get_model_state_dict

    torch.manual_seed(0)
    model, rank = _Scaled(), dist.get_rank()
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.temperature.shape == () and model.temperature.placements == (Replicate(),)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    x = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1))
    for batch in x:
        model(batch[2 * rank : 2 * rank + 2]).backward()
        ((ref(batch[:2]) + ref(batch[2:])) / 2).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref.get_parameter(name).grad, msg=name)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref.get_parameter(name), msg=name)
    with summon_full_params(model, writeback=True):
        assert model.inner.gain.shape == ()
        model.inner.gain.add_(1.0)
    assert torch.allclose(model.inner.gain.full_tensor(), ref.inner.gain + 1.0)
    full = get_model_state_dict(model, full_state_dict=True)
    assert full["temperature"].shape == () and torch.allclose(full["temperature"], ref.temperature)


@distributed(world_size=4)
def test_four_ranks_uneven_parity():
    data = batches(3, 8)
    model = make_model()
    ref, _ = train_reference(model, data)
    _shard(model, _dp_mesh())
    assert [model.embed.weight.to_local().shape[0]] != [101 // 4]  # 26, 26, 26, 23 rows
    _train(model, data)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


@distributed(world_size=4)
def test_reshard_after_forward_to_two_ranks_parity_memory_and_communication():
    data = batches(3, 8)
    model = make_model()
    ref, _ = train_reference(model, data)
    theirs = copy.deepcopy(model)
    mesh = _dp_mesh()
    _shard(model, mesh, reshard_after_forward=2)
    _torch_shard(theirs, mesh, reshard_after_forward=2)

    # One step watched: between forward and backward each block holds a 2-way shard (not its unsharded
    # parameters), and its backward all-gather sends that 2-way shard (over its 2-rank group).
    probe = _shard(make_model(), mesh, reshard_after_forward=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data[0]
    blocks = [b._fsdp_state.group for b in probe.blocks]
    root = probe._fsdp_state.group
    with comm.count_collectives() as counts:
        loss = loss_fn(probe, rank_slice(x, rank, world), rank_slice(y, rank, world))
        for g in blocks:
            assert g.post_forward.held and g.unsharded_flat.untyped_storage().nbytes() == 0
            assert g.post_forward.layout.world_size == 2
        loss.backward()
    four_way = sum(g.layout.shard_numel for g in blocks) + root.layout.shard_numel
    two_way = sum(g.post_forward.layout.shard_numel for g in blocks)
    assert counts.bytes["all_gather"] == 4 * (four_way + two_way)  # fp32
    assert not any(g.post_forward.held for g in blocks) and _storage_freed(probe)

    _train(model, data)
    _train(theirs, data)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5
    assert max_diff(full_state(model), full_state(theirs)) < 1e-5


@distributed(world_size=4)
def test_hsdp_two_by_two_parity():
    data = batches(3, 8)
    model = make_model()
    ref, _ = train_reference(model, data)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "data_parallel"))
    _shard(model, mesh)
    assert model.embed.weight.placements == (Replicate(), Shard(0))
    with comm.count_collectives() as counts:
        _train(model, data)
    assert counts.calls["all_reduce"] == len(data) * (len(model.blocks) + 1)  # one per group across replicas
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


@distributed(world_size=4)
def test_parameters_with_fewer_rows_than_ranks():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(2, 4), nn.Linear(4, 3), nn.Linear(3, 1))  # 2, 3 and 1 rows over 4 ranks
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=_dp_mesh())
    assert [p.to_local().shape[0] for p in model.parameters()][:1] == [1 if dist.get_rank() < 2 else 0]
    idx = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1], [1, 1, 0]])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for _ in range(2):
        for m, opt, x in ((model, opts[0], idx[dist.get_rank() : dist.get_rank() + 1]), (ref, opts[1], idx)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@distributed(world_size=2, fresh=True)
def test_meta_model_larger_than_the_memory_cap_is_sharded_and_materialized():
    """16 x (2048 x 2048) fp32 = 256 MiB of parameters; each process may map only 200 MiB more than it has:
    the whole model cannot be allocated, but its half (128 MiB) plus one full parameter at a time can."""
    torch.distributed.init_process_group("gloo")
    mesh = _dp_mesh()
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(16)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Large buffers straight from mmap and back on free, so the address space follows live memory
    # (glibc's dynamic threshold would otherwise keep freed buffers in the heap and the cap would measure that).
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    libc.mallopt(-8, 1)  # M_ARENA_MAX = 1: a thread started under the cap reserves no 64 MiB arena of its own
    # The model was built on meta, so materializing it is where the kernels would first load (LLVM's mappings
    # and numba's worker threads, tens of MiB of address space whatever the model): load them before the cap.
    GroupLayout([(1,)], 1).warm("cpu")
    cap = _vm_bytes() + 200 * 2**20
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        with pytest.raises((RuntimeError, MemoryError)):
            torch.empty(256 * 2**20 // 4)  # the full model does not fit under the cap
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for layer in model:
            layer.reset_parameters()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    local = sum(p.to_local().numel() for p in model.parameters())
    assert local == 16 * 2048 * 2048 // 2
    # the values are exactly what one device gives for the same seed (first layer checked)
    torch.manual_seed(0)
    expected = nn.Linear(2048, 2048, bias=False).weight.detach()
    assert torch.equal(model[0].weight.full_tensor(), expected)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("meta_first", [True, False])
@distributed(world_size=2)
def test_group_mixing_meta_and_real_parameters_keeps_the_real_values(meta_first):
    # The group's first parameter decided its device: a meta one first dropped the real ones' values (the flat
    # shard on meta), a real one first raised "Cannot copy out of meta tensor".
    from lightning_shard.fsdp import built_on_meta

    torch.manual_seed(0)
    real = nn.Linear(4, 6)
    with torch.device("meta"):
        new = nn.Linear(4, 6)
    model = nn.Sequential(new, real) if meta_first else nn.Sequential(real, new)
    expected = {n: p.detach().clone() for n, p in real.named_parameters()}
    fully_shard(model, mesh=_dp_mesh())
    for name, want in expected.items():
        got = getattr(real, name)
        assert not got.is_meta and not built_on_meta(got)
        assert torch.equal(got.full_tensor(), want), name
    assert all(not p.is_meta and built_on_meta(p) for p in new.parameters())
