"""User hooks on sharded parameters, gradients and modules (docs/fsdp.md "Hooks on parameters, gradients and
modules"), each compared with one process running the same code on the same global batches: optimizer in
backward (one optimizer per parameter stepped in ``register_post_accumulate_grad_hook``), ``register_hook``
gradient clamping, hooks registered before or after ``fully_shard`` / ``parallelize_module``, gradient
accumulation without sync, CPU offload, FSDP 2, TP 2 and FSDP 2 x TP 2 (slow)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import CPUOffloadPolicy, fully_shard
from lightning_shard.tp import auto_tp_plan, parallelize_module
from tests import tp_models
from tests.fsdp_models import batches, full_state, loss_fn, max_diff, rank_slice
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset, sampler_batches

CLAMP, MICRO = 2e-3, 2


def _add_hooks(model, kind: str, sync: dict, calls: list) -> None:
    """``kind`` "optim": an SGD per parameter stepped in its post-accumulate-grad hook when ``sync["last"]``
    (the last micro-batch); "clamp": ``register_hook`` clamping each gradient to ``CLAMP``."""
    opts = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if kind == "optim":
            opts[p] = torch.optim.SGD([p], lr=0.1, momentum=0.9)

            def step(param):
                calls.append(param)
                if sync["last"]:
                    opts[param].step()
                    opts[param].zero_grad()

            p.register_post_accumulate_grad_hook(step)
        else:
            p.register_hook(lambda g: calls.append(g) or g.clamp(-CLAMP, CLAMP))


def _shard(model, mesh_kind: str, offload: bool = False) -> tuple[int, int]:
    """Shard ``model`` (a ``tp_models.Llama``); returns (data-parallel rank, data-parallel size)."""
    world = dist.get_world_size()
    if mesh_kind == "tp":
        tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor_parallel",))
        parallelize_module(model, tp, auto_tp_plan(model, tp))
        return 0, 1
    if mesh_kind == "fsdp":
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    else:  # fsdp x tp
        root = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        tp, dp = root["tensor_parallel"], root["data_parallel"]
        parallelize_module(model, tp, auto_tp_plan(model, tp))
    kwargs = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for layer in model.layers:
        fully_shard(layer, mesh=dp, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)
    return dp.get_local_rank(), dp.size()


def _micro_batches(x, y, rank: int, size: int, dp_size: int, accumulate: bool):
    """This rank's micro-batches; for the one-process reference (``size`` 1) micro-batch ``j`` holds every
    data-parallel rank's micro-batch ``j``, so a hook sees the same gradient both ways."""
    n = MICRO if accumulate else 1
    if size == 1:
        parts = [(rank_slice(x, q, dp_size).chunk(n), rank_slice(y, q, dp_size).chunk(n)) for q in range(dp_size)]
        return [(torch.cat([p[0][j] for p in parts]), torch.cat([p[1][j] for p in parts])) for j in range(n)]
    return list(zip(rank_slice(x, rank, size).chunk(n), rank_slice(y, rank, size).chunk(n)))


def _train(model, kind: str, rank: int, size: int, dp_size: int, accumulate: bool, sync: dict) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5) if kind == "clamp" else None
    for x, y in batches(3, 4):
        parts = _micro_batches(x, y, rank, size, dp_size, accumulate)
        for j, (xs, ys) in enumerate(parts):
            sync["last"] = j == len(parts) - 1
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(sync["last"])
            (loss_fn(model, xs, ys) / len(parts)).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()


def _check(mesh_kind: str, kind: str, when: str, accumulate: bool = False, offload: bool = False) -> None:
    torch.manual_seed(0)
    model = tp_models.Llama()
    ref, initial = copy.deepcopy(model), full_state(model)
    sync, ref_calls, calls = {}, [], []
    dp_size = 2 if mesh_kind != "tp" else 1
    _add_hooks(ref, kind, sync, ref_calls)
    _train(ref, kind, 0, 1, dp_size, accumulate, sync)
    if when == "before":
        _add_hooks(model, kind, sync, calls)
    rank, size = _shard(model, mesh_kind, offload)
    if when == "after":
        _add_hooks(model, kind, sync, calls)
    _train(model, kind, rank, size, dp_size, accumulate, sync)
    ours, theirs = full_state(model), full_state(ref)
    assert max_diff(theirs, initial) > 1e-3  # the hooks' steps moved the parameters: equality says something
    assert max_diff(ours, theirs) < (1e-5 if mesh_kind == "fsdp" else 5e-5)
    # register_hook runs per backward, as on one device; the post-accumulate hook per synced backward (FSDP2's)
    per_backward = MICRO if accumulate and (kind == "clamp" or mesh_kind == "tp") else 1
    assert len(calls) == len(ref_calls) // (MICRO if accumulate else 1) * per_backward


@distributed(world_size=2)
def test_optimizer_in_backward_fsdp_matches_one_process():
    """Before, autograd never reached the sharded parameters' hooks: nothing trained, no error."""
    _check("fsdp", "optim", "after")


@distributed(world_size=2)
def test_register_hook_before_sharding_with_accumulation_fsdp():
    """Hooks registered before ``fully_shard`` were lost with the replaced parameter; without gradient sync a
    clamp ran once on the sum of the micro-batches instead of on each."""
    _check("fsdp", "clamp", "before", accumulate=True)


@distributed(world_size=2)
def test_register_hook_before_tensor_parallel():
    """``parallelize_module`` replaced the parameters and lost their hooks."""
    _check("tp", "clamp", "before")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh_kind", "kind", "when", "accumulate", "offload"),
    [
        ("fsdp", "optim", "after", True, False),
        ("fsdp", "optim", "after", False, True),
        ("fsdp", "clamp", "after", False, True),
        ("tp", "optim", "after", False, False),
        ("tp", "clamp", "after", True, False),
    ],
)
@distributed(world_size=2)
def test_gradient_hooks_more_cases(mesh_kind, kind, when, accumulate, offload):
    _check(mesh_kind, kind, when, accumulate, offload)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "when"), [("optim", "after"), ("clamp", "before")])
@distributed(world_size=4)
def test_gradient_hooks_fsdp_x_tp(kind, when):
    _check("fsdp_tp", kind, when)


# ------------------------------------------------------------------------------------------------ module hooks
def _add_module_hooks(model) -> None:
    """Forward pre-hooks (with kwargs) and forward hooks changing inputs and outputs, full backward (pre-)hooks
    changing gradients, on modules that are FSDP units, inside units, and TP-sharded."""
    first, second = model.layers
    first.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 1.5,), kwargs), with_kwargs=True)
    first.feed_forward.register_forward_hook(lambda m, args, out: out * 0.7)
    first.attention.register_forward_pre_hook(lambda m, args: (args[0] * 0.9, *args[1:]))
    second.feed_forward.register_full_backward_hook(lambda m, gin, gout: tuple(g * 2.0 for g in gin))
    second.register_full_backward_pre_hook(lambda m, gout: tuple(g * 0.5 for g in gout))
    model.norm.register_forward_hook(lambda m, args, out: out + 0.1)


def _train_module_hooks(model, rank: int, size: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scale_linears = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: out * 1.01 if isinstance(m, torch.nn.Linear) else None
    )
    try:
        for x, y in batches(3, 4):
            with torch.autograd.graph.save_on_cpu():  # user activation offloading
                loss = loss_fn(model, rank_slice(x, rank, size), rank_slice(y, rank, size))
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        scale_linears.remove()


def _check_module_hooks(mesh_kind: str, when: str) -> None:
    torch.manual_seed(0)
    model = tp_models.Llama()
    plain, ref = copy.deepcopy(model), copy.deepcopy(model)
    _add_module_hooks(ref)
    _train_module_hooks(ref, 0, 1)
    _train_module_hooks(plain, 0, 1)
    if when == "before":
        _add_module_hooks(model)
    rank, size = _shard(model, mesh_kind)
    if when == "after":
        _add_module_hooks(model)
    _train_module_hooks(model, rank, size)
    ours, theirs = full_state(model), full_state(ref)
    assert max_diff(theirs, full_state(plain)) > 1e-3  # the hooks changed training: equality says something
    assert max_diff(ours, theirs) < (1e-5 if mesh_kind == "fsdp" else 5e-5)


@distributed(world_size=2)
def test_module_hooks_and_saved_tensor_hooks_fsdp():
    _check_module_hooks("fsdp", "before")


@pytest.mark.slow
@pytest.mark.parametrize(("mesh_kind", "when"), [("fsdp", "after"), ("tp", "before"), ("tp", "after")])
@distributed(world_size=2)
def test_module_hooks_more_cases(mesh_kind, when):
    _check_module_hooks(mesh_kind, when)


@distributed(world_size=2)
def test_state_dict_hooks_run_on_sharded_model():
    """``set_model_state_dict`` copies into the shards without ``load_state_dict``: the modules' load post-hooks
    were skipped, silently."""
    from lightning_shard.checkpoint import get_model_state_dict, set_model_state_dict

    torch.manual_seed(0)
    model = tp_models.Llama()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    log = []
    model.layers[0].register_state_dict_pre_hook(lambda m, prefix, keep_vars: log.append(("save", prefix)))
    model.layers[0].register_load_state_dict_post_hook(lambda m, keys: log.append(("load", keys.missing_keys)))
    _shard(model, "fsdp")
    assert get_model_state_dict(model, full_state_dict=True).keys() == full.keys()
    assert log == [("save", "layers.0.")]
    log.clear()
    set_model_state_dict(model, {k: v for k, v in full.items() if k != "norm.weight"}, strict=False)
    assert ("load", ["norm.weight"]) in log


def _weight_normed() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    torch.nn.utils.parametrizations.weight_norm(model[0])
    return model


@distributed(world_size=2)
def test_load_pre_hooks_rewrite_an_old_checkpoint_on_a_sharded_model():
    """``weight_norm``'s load pre-hook turns an old checkpoint's ``weight_g``/``weight_v`` into its
    parametrization's keys, as Hugging Face's Mamba and ESM rewrite renamed keys. ``set_model_state_dict`` did
    not run load pre-hooks: with ``strict=False`` the weight silently kept its initial values."""
    from lightning_shard.checkpoint import set_model_state_dict

    torch.manual_seed(0)
    old = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(old[0])  # the deprecated form: keys weight_g and weight_v
    old_state = old.state_dict()
    keys = list(old_state)
    ref = _weight_normed()
    ref.load_state_dict(old_state)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    for strict in (False, True):
        model = _weight_normed()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert max_diff(full_state(model), full_state(ref)) > 1e-2  # a fresh init: equality below says something
        set_model_state_dict(model, old_state, strict=strict)
        assert max_diff(full_state(model), full_state(ref)) == 0
        assert list(old_state) == keys  # the caller's mapping is left as it was


# ------------------------------------------------------------------------------------------------ through the Trainer
class _LitOptimizerInBackward(LitGPT):
    """Manual optimization whose ``training_step`` only calls ``manual_backward``: one SGD per parameter steps in
    its post-accumulate-grad hook, registered once the strategy sharded the model."""

    def __init__(self, arch: str) -> None:
        super().__init__(arch=arch)
        self.automatic_optimization = False

    def on_train_start(self) -> None:
        _add_hooks(self.model, "optim", {"last": True}, [])

    def training_step(self, batch, batch_idx):
        self.manual_backward(loss_fn(self.model, *batch))

    def configure_optimizers(self):
        return None


def _reference_optimizer_in_backward(arch: str, steps: int, world: int) -> dict[str, torch.Tensor]:
    model = _seeded_model(arch)
    _add_hooks(model, "optim", {"last": True}, [])
    data, order = dataset(), iter(sampler_batches(world, 4))
    for _ in range(steps):
        loss_fn(model, *data[next(order)]).backward()
    return full_state(model)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_optimizer_in_backward_through_trainer(tp):
    import strategies
    from tests.test_strategy import _trainer

    module = _LitOptimizerInBackward("gpt" if tp == 1 else "llama")
    strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp)
    trainer = _trainer(strategy=strategy, max_steps=-1, max_epochs=1, limit_train_batches=3)
    trainer.fit(module)
    ref = _reference_optimizer_in_backward(module.arch, 3, dist.get_world_size() // tp)
    ours = full_state(module.model)
    assert max_diff(ref, full_state(_seeded_model(module.arch))) > 1e-3
    assert max_diff(ours, ref) < (1e-5 if tp == 1 else 5e-5)


class _TwiceCalled(torch.nn.Module):
    """A block called twice per forward (weight sharing across depth, as ALBERT and Universal Transformers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.block(self.inp(x))))


def _train_twice_called(model, x: torch.Tensor, y: torch.Tensor, calls: list, clamp: float) -> None:
    for p in model.parameters():
        p.register_hook(lambda g: calls.append(1) or g.clamp(-clamp, clamp))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@distributed(world_size=2)
def test_register_hook_on_a_unit_called_twice_runs_once_on_the_sum():
    """One device runs a leaf's ``register_hook`` once per backward, on the gradient summed over its uses. A unit
    called twice reduced once per call, so a clamp hook ran on each call's gradient: another result, no error."""
    torch.manual_seed(0)
    model = _TwiceCalled()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g) * 4
    # A bound that binds on the summed gradient of the block but not on each call's: the orders disagree.
    clamp, ref_calls, calls = 0.05, [], []
    _train_twice_called(ref, x, y, ref_calls, clamp)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_twice_called(model, rank_slice(x, rank, 2), rank_slice(y, rank, 2), calls, clamp)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5
    assert len(calls) == len(ref_calls)
