"""Fabric(strategy="shard_fsdp_tp") on real gloo ranks, compared with a single-process run on the same batches."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist

import strategies
from lightning_shard.tensor import DTensor
from tests.fsdp_models import TinyGPT, batches, full_state, loss_fn, make_model, max_diff
from tests.harness import distributed

STEPS, GLOBAL_BATCH, LR = 4, 8, 1e-3


def _fabric(strategy="shard_fsdp_tp", **kwargs) -> L.Fabric:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, **kwargs)
    fabric.launch()
    return fabric


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def _local(batch, rank, world):
    return tuple(t.chunk(world)[rank] for t in batch)


def _reference(steps: int, accumulate: int = 1, clip: float | None = None, seed: int = 0):
    """One process, the same global batches, loss averaged over the micro-batches of a step."""
    model = make_model(seed)
    opt = _adamw(model)
    data = iter(batches(steps * accumulate, GLOBAL_BATCH))
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x, y = next(data)
            (loss_fn(model, x, y) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return full_state(model)


def _train(fabric, model, opt, data, steps: int, accumulate: int = 1, clip: float | None = None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(steps):
        opt.zero_grad()
        for k in range(accumulate):
            x, y = _local(next(data), rank, world)
            with fabric.no_backward_sync(model, enabled=k < accumulate - 1):
                fabric.backward(loss_fn(model, x, y) / accumulate)
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()


@pytest.mark.slow
@distributed(world_size=2, fresh=True)
def test_string_and_instance_are_accepted_and_parity_with_one_process():
    # A new process: Fabric creates the process group itself (as under torchrun).
    fabric = _fabric()
    assert isinstance(fabric.strategy, strategies.ShardFSDPTPFabricStrategy)
    model = fabric.setup_module(make_model(0))
    opt = fabric.setup_optimizers(_adamw(model))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    _train(fabric, model, opt, iter(batches(STEPS, GLOBAL_BATCH)), STEPS)
    assert max_diff(full_state(model.module), _reference(STEPS)) < 1e-6

    instance = L.Fabric(accelerator="cpu", devices=2, strategy=strategies.ShardFSDPTPFabricStrategy())
    assert isinstance(instance.strategy, strategies.ShardFSDPTPFabricStrategy)


@distributed(world_size=2)
def test_joint_setup_remaps_the_optimizer_to_the_sharded_parameters():
    fabric = _fabric()
    model = make_model(0)
    model, opt = fabric.setup(model, _adamw(model))
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    _train(fabric, model, opt, iter(batches(STEPS, GLOBAL_BATCH)), STEPS)
    assert max_diff(full_state(model.module), _reference(STEPS)) < 1e-6


@distributed(world_size=2)
def test_optimizer_over_unsharded_parameters_is_refused():
    fabric = _fabric()
    stale = make_model(0)
    opt = _adamw(stale)
    fabric.setup_module(stale)
    with pytest.raises(ValueError, match="not sharded"):
        fabric.setup_optimizers(opt)


@distributed(world_size=2)
def test_no_backward_sync_accumulation_and_clipping_parity():
    fabric = _fabric()
    model = fabric.setup_module(make_model(0))
    opt = fabric.setup_optimizers(_adamw(model))
    _train(fabric, model, opt, iter(batches(3 * 2, GLOBAL_BATCH)), 3, accumulate=2, clip=0.05)
    assert max_diff(full_state(model.module), _reference(3, accumulate=2, clip=0.05)) < 1e-6


@distributed(world_size=2)
def test_init_module_meta_materialized_like_one_device():
    fabric = _fabric()
    torch.manual_seed(3)
    with fabric.init_module(empty_init=True):
        model = TinyGPT()
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    assert not any(p.is_meta for p in model.parameters())
    # One device, same RNG state, same procedure: every module's reset_parameters() in module order.
    torch.manual_seed(3)
    with torch.device("meta"):
        reference = TinyGPT()
    reference.to_empty(device="cpu")
    reference.head.weight = reference.embed.weight  # to_empty unties on one device; the sharded model keeps it
    with torch.no_grad():
        for m in reference.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    assert max_diff(full_state(model.module), full_state(reference)) == 0


# the full format's writer and reader are the Trainer's, tested by default (tests/test_strategy_checkpoint.py)
@pytest.mark.parametrize("state_dict_type", ["sharded", pytest.param("full", marks=pytest.mark.slow)])
@distributed(world_size=2)
def test_save_load_round_trip(state_dict_type):
    fabric = _fabric(strategy=strategies.ShardFSDPTPFabricStrategy(state_dict_type=state_dict_type))
    path = os.path.join(_tmpdir(), "ckpt")
    data = batches(2 * STEPS, GLOBAL_BATCH)
    model = fabric.setup_module(make_model(0))
    opt = fabric.setup_optimizers(_adamw(model))
    _train(fabric, model, opt, iter(data[:STEPS]), STEPS)
    fabric.save(path, {"model": model, "optimizer": opt, "step": STEPS})
    assert os.path.isdir(path) == (state_dict_type == "sharded")
    _train(fabric, model, opt, iter(data[STEPS:]), STEPS)
    expected = full_state(model.module)

    other = fabric.setup_module(make_model(1))  # different weights, fresh optimizer
    other_opt = fabric.setup_optimizers(_adamw(other))
    state = {"model": other, "optimizer": other_opt, "step": 0}
    remainder = fabric.load(path, state)
    assert state["step"] == STEPS and remainder == {}
    _train(fabric, other, other_opt, iter(data[STEPS:]), STEPS)
    assert max_diff(full_state(other.module), expected) == 0  # model and AdamW state restored exactly

    everything = fabric.load(path)  # no state: plain full tensors
    assert everything["step"] == STEPS and set(everything["model"]) == set(make_model(0).state_dict())


@pytest.mark.parametrize("state_dict_type", ["sharded", pytest.param("full", marks=pytest.mark.slow)])
@distributed(world_size=2)
def test_trainer_checkpoint_loads_in_fabric(state_dict_type):
    from tests.lightning_models import LitGPT
    from tests.test_strategy import _trainer

    path = os.path.join(_tmpdir(), "trainer.ckpt")
    lit = LitGPT()
    trainer = _trainer(max_steps=3, strategy=strategies.ShardFSDPTPStrategy(state_dict_type=state_dict_type))
    trainer.fit(lit)
    trainer.save_checkpoint(path)
    trained = full_state(lit)
    momentum = _momentum(lit, trainer.optimizers[0])

    fabric = _fabric()
    torch.manual_seed(5)
    module = LitGPT()  # other weights
    module = fabric.setup_module(module)
    opt = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    remainder = fabric.load(path, {"model": module, "optimizer": opt})
    assert max_diff(full_state(module.module), trained) == 0
    assert max_diff(_momentum(module.module, opt.optimizer), momentum) == 0
    assert remainder["global_step"] == 3  # the rest of Lightning's checkpoint comes back


@pytest.mark.parametrize("state_dict_type", ["sharded", pytest.param("full", marks=pytest.mark.slow)])
@distributed(world_size=2)
def test_failed_load_changes_nothing(state_dict_type):
    fabric = _fabric(strategy=strategies.ShardFSDPTPFabricStrategy(state_dict_type=state_dict_type))
    path = os.path.join(_tmpdir(), "ckpt")
    x, y = _local(batches(1, GLOBAL_BATCH)[0], dist.get_rank(), dist.get_world_size())

    def sgd(module, split: int):  # two param groups, as many as the saved optimizer: only their members differ
        params = list(module.parameters())
        return torch.optim.SGD([{"params": params[:split]}, {"params": params[split:]}], lr=0.1, momentum=0.9)

    model = fabric.setup_module(make_model(0))
    opt = fabric.setup_optimizers(sgd(model, 2))
    fabric.backward(loss_fn(model, x, y))
    opt.step()
    fabric.save(path, {"model": model, "optimizer": opt})

    other = fabric.setup_module(make_model(1))
    same, regrouped = sgd(other, 2), sgd(other, 4)
    same, regrouped = fabric.setup_optimizers(same, regrouped)
    for optimizer in (same, regrouped):  # momentum buffers that a partial load would overwrite
        fabric.backward(loss_fn(other, x, y))
        optimizer.step()
    before = _snapshot(other.module, same.optimizer, regrouped.optimizer)

    failures = [
        ({"model": other, "optimizer": regrouped}, "param group"),
        ({"model": other, "optimizer": same, "step": 0}, "'step'"),  # strict: a requested key is missing
    ]
    if state_dict_type == "sharded":  # meta.pt damaged after saving: its checksum fails
        failures.append(({"model": other, "optimizer": same}, "meta.pt"))
    for state, match in failures:
        if match == "meta.pt":
            _damage(os.path.join(path, "meta.pt"))
            fabric.barrier()
        with pytest.raises(Exception, match=match):
            fabric.load(path, state)
        after = _snapshot(other.module, same.optimizer, regrouped.optimizer)
        assert after.keys() == before.keys()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert changed == [], (match, changed)


@pytest.mark.slow  # the writer is the Trainer's (tests/test_strategy.py runs the same failure by default)
@distributed(world_size=2, timeout=90, fresh=True)  # before the fix, rank 1 waited in a barrier until the timeout
def test_full_save_failing_on_rank_0_raises_on_every_rank():
    from tests.test_strategy import _read, assert_failed_save_left_no_trace, failing_write_on_rank_0

    fabric = _fabric(strategy=strategies.ShardFSDPTPFabricStrategy(state_dict_type="full"))
    path = os.path.join(_tmpdir(), "full.ckpt")
    model = fabric.setup_module(make_model(0))
    fabric.save(path, {"model": model, "step": 1})
    previous = _read(path)
    with failing_write_on_rank_0(), pytest.raises(Exception, match="full.ckpt") as info:
        fabric.save(path, {"model": model, "step": 2})
    assert_failed_save_left_no_trace(path, previous, info.value)


def _damage(file: str) -> None:
    if dist.get_rank() == 0:
        with open(file, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))


def _snapshot(module, *optimizers) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, as full tensors."""
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    out = {f"param {n}": full(p) for n, p in module.named_parameters()}
    names = {p: n for n, p in module.named_parameters()}
    for i, optimizer in enumerate(optimizers):
        for p, state in optimizer.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    out[f"optimizer {i} {names[p]} {k}"] = full(v)
    return out


def _momentum(module, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            out[name] = buf.full_tensor() if isinstance(buf, DTensor) else buf
    return out


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _tmpdir() -> str:
    import tempfile

    return _broadcast(tempfile.mkdtemp() if dist.get_rank() == 0 else None)


def test_unsupported_precision_is_refused_with_the_supported_list():
    from strategies.fabric_precision import ShardFabricPrecision

    with pytest.raises(ValueError, match="precision='transformer-engine' is not supported"):
        ShardFabricPrecision("transformer-engine")  # Lightning checks for its package before the strategy sees it


@pytest.mark.parametrize("strict", [True, False])
@distributed(world_size=2)
def test_load_raw_of_a_whole_checkpoint_points_to_load(strict):
    """``load_raw`` of a whole ``fabric.save`` file raises naming the entry and ``fabric.load``: with
    ``strict=False`` it loaded nothing and said nothing."""
    fabric = _fabric(strategy=strategies.ShardFSDPTPFabricStrategy(state_dict_type="full"))
    path = os.path.join(_tmpdir(), "whole.ckpt")
    model = fabric.setup_module(make_model(0))
    fabric.save(path, {"model": model, "step": 1})
    other = fabric.setup_module(make_model(1))
    before = full_state(other.module)
    with pytest.raises(ValueError, match=r"entry 'model' holds the model's state dict.*fabric.load\(path, \{'model'"):
        fabric.load_raw(path, other, strict=strict)
    assert max_diff(full_state(other.module), before) == 0
