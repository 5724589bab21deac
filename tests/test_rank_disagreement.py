"""Ranks that disagree about the model or the run (``strategies/agreement.py``, ``lightning_shard/agreement.py``,
docs/strategy.md "Ranks that must agree"), simulated per rank with ``dist.get_rank()`` inside the test body, as a
stale checkout on one node, a ``configure_model`` that branches on the rank, or a per-node config file would make
them. Without the checks, through the Trainer (FSDP 2): an extra parameter, another shape, another
``tensor_parallel_size`` or ``sharding_strategy``, ``gradient_clip_val`` on one rank hung; a block frozen or
``.half()`` on one rank, the same parameters registered in another order, another ``fsdp_unit`` crashed in gloo (a
size mismatch naming nothing); a parameter trainable on one rank only, or another ``lr``, trained silently wrong;
another ``accumulate_grad_batches`` (2 and 1) raised the misleading "ran out of training batches". Fabric built
meshes of other shapes without an error. ``fully_shard`` alone trained silently wrong on parameters registered in
another order (ours and torch's FSDP2) or frozen on one rank (ours).

Each case raises a ``RanksDisagreeError`` on every rank, naming what differs and the ranks holding each
value: the strategy's arguments before the mesh, the model before sharding, the optimizers, trainable parameters
and loop settings at the first training step; ``fully_shard``'s units at the root's first forward. Ranks that
agree (with what may differ per rank: the planner's memory budget) train as one process does, with one small
all-gather per check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

import strategies
from lightning_shard import comm
from strategies.agreement import RanksDisagreeError
from tests.harness import distributed
from tests.lightning_models import LitGPT, reference_params
from tests.test_strategy import _trainer


def _other_model(case: str) -> nn.Module:
    """TinyGPT as rank 1 might build it when its code or config differs from rank 0's."""
    module = LitGPT().model
    if case == "extra parameter":
        module.extra = nn.Linear(4, 4)
    elif case == "other shape":
        module.blocks[0].up, module.blocks[0].down = nn.Linear(16, 32), nn.Linear(32, 16)
    elif case == "trains on one rank":
        module.frozen.requires_grad_(True)
    elif case == "other dtype":
        module.blocks[1].half()
    elif case == "other order":  # the same parameters, registered down-then-up: flat buffers laid out apart
        block = module.blocks[0]
        up, down = block.up, block.down
        del block.up, block.down
        block.down, block.up = down, up
    elif case == "other buffer":
        module.scale = torch.tensor([0.5, 0.5])
    elif case == "other class":  # the same parameters from a class another checkout names differently
        module.blocks[1].__class__ = type("PatchedBlock", (type(module.blocks[1]),), {})
    return module


MODEL_CASES = {
    "extra parameter": r"parameters: 'model\.extra\.weight': <absent> on rank 0, \(4, 4\) float32 requires_grad="
    r"True on rank 1; 'model\.extra\.bias'",
    "other shape": r"'model\.blocks\.0\.up\.weight': \(48, 16\) float32 requires_grad=True on rank 0, \(32, 16\) "
    r"float32 requires_grad=True on rank 1",
    "trains on one rank": r"'model\.frozen\.weight': \(16, 16\) float32 requires_grad=False on rank 0, \(16, 16\) "
    r"float32 requires_grad=True on rank 1",
    "other dtype": r"'model\.blocks\.1\.norm\.weight': \(16,\) float32 requires_grad=True on rank 0, \(16,\) "
    r"float16",
    "other order": r"the same entries in another order; at position 5: 'model\.blocks\.0\.up\.weight' on rank 0, "
    r"'model\.blocks\.0\.down\.weight' on rank 1",
    "other buffer": r"buffers: 'model\.scale': \(1,\) float32 on rank 0, \(2,\) float32 on rank 1",
    "other class": r"modules: 'model\.blocks\.1': tests\.fsdp_models\.Block on rank 0, tests\.test_rank_disagreement\."
    r"PatchedBlock on rank 1",
}


@distributed(world_size=2)
def test_models_that_differ_raise_on_every_rank_before_sharding():
    for case, expected in MODEL_CASES.items():
        module = LitGPT()
        if dist.get_rank() == 1:
            module.model = _other_model(case)
        with pytest.raises(RanksDisagreeError, match=r"disagree about the model \(before it is sharded\)") as error:
            _trainer(max_steps=1).fit(module)
        _matches(expected, str(error.value))
        assert (
            "fix: build the same model" in str(error.value)
            or "fix: register the same buffers" in str(error.value)
            or "fix: build the model from the same classes" in str(error.value)
        )


def _matches(pattern: str, text: str) -> bool:
    import re

    assert re.search(pattern, text), f"{pattern!r} not in {text!r}"
    return True


@distributed(world_size=2)
def test_strategy_arguments_that_differ_raise_before_the_mesh():
    rank = dist.get_rank()
    cases = [
        (
            dict(tensor_parallel_size=2 if rank == 0 else 1),
            r"'data_parallel_size': 1 on rank 0, 2 on rank 1; 'tensor_parallel_size': 2 on rank 0, 1 on rank 1",
        ),
        (dict(fsdp_unit="auto" if rank == 0 else {nn.Linear}), r"'fsdp_unit': 'auto' on rank 0, \{torch\.nn\."),
        (
            dict(sharding_strategy="FULL_SHARD" if rank == 0 else "SHARD_GRAD_OP"),
            r"'sharding_strategy': 'FULL_SHARD' on rank 0, 'SHARD_GRAD_OP' on rank 1; 'reshard_after_forward': "
            r"True on rank 0, False on rank 1",
        ),
    ]
    for kwargs, expected in cases:
        with pytest.raises(RanksDisagreeError, match=r"disagree about the strategy") as error:
            _trainer(strategy=strategies.ShardFSDPTPStrategy(**kwargs), max_steps=1).fit(LitGPT())
        _matches("strategy arguments: " + expected, str(error.value))
    with pytest.raises(RanksDisagreeError, match=r"'sync_batchnorm': 'TorchSyncBatchNorm' on rank 0, 'NoneType'"):
        _trainer(sync_batchnorm=rank == 0, max_steps=1).fit(LitGPT())


class _FreezeOnRankOne(Callback):
    """What a callback under a rank condition (``@rank_zero_only`` on the other side) does."""

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 1:
            pl_module.model.blocks[1].requires_grad_(False)


class _Lr(LitGPT):
    def __init__(self, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(lr=lr)
        self.weight_decay = weight_decay

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


@distributed(world_size=2)
def test_training_settings_that_differ_raise_at_the_first_step():
    rank = dist.get_rank()
    cases = [
        (_Lr(0.1 if rank == 0 else 0.2), {}, r"optimizers: 'optimizer 0 group 0 lr': 0\.1 on rank 0, 0\.2 on rank 1"),
        (_Lr(0.1, 0.01 * rank), {}, r"'optimizer 0 group 0 weight_decay': 0\.0 on rank 0, 0\.01 on rank 1"),
        (LitGPT(), dict(accumulate_grad_batches=2 + rank), r"'accumulate_grad_batches': 2 on rank 0, 3 on rank 1"),
        (LitGPT(), dict(gradient_clip_val=None if rank else 1.0), r"'gradient_clip_val': 1\.0 on rank 0, None on"),
        (
            LitGPT(),
            dict(callbacks=[_FreezeOnRankOne()]),
            r"trainable parameters: 'model\.blocks\.1\.norm\.weight': True on rank 0, False on rank 1",
        ),
    ]
    for module, kwargs, expected in cases:
        with pytest.raises(RanksDisagreeError, match=r"disagree at the first training step") as error:
            _trainer(max_steps=2, **kwargs).fit(module)
        _matches(expected, str(error.value))


@distributed(world_size=2)
def test_agreeing_ranks_train_like_one_process_with_one_small_gather_per_check():
    from unittest import mock

    from strategies import agreement

    gathers: list[int] = []

    def counted(*args, **kwargs):
        with comm.count_collectives() as counts:
            agreement_check(*args, **kwargs)
        gathers.append(sum(counts.calls.values()))

    agreement_check = agreement.check_ranks_agree
    # may differ per rank: the planner's budget (rank 0's planner decides for all), data_parallel_size "auto" or the
    # size it stands for; fsdp_unit as a set of classes
    strategy = strategies.ShardFSDPTPStrategy(
        fsdp_unit={type(LitGPT().model.blocks[0])},
        planner_device_memory=f"{1 + dist.get_rank()}GiB",
        data_parallel_size="auto" if dist.get_rank() == 0 else 2,
    )
    module = LitGPT()
    with mock.patch.object(agreement, "check_ranks_agree", counted):
        _trainer(strategy=strategy, max_steps=3).fit(module)
    ref = reference_params(3)
    ours = {n.removeprefix("model."): p.full_tensor() for n, p in module.named_parameters()}
    assert max((ours[n] - ref[n]).abs().max().item() for n in ref) < 1e-5
    assert gathers == [1, 1, 1]  # the strategy, the model, the first step; none in later steps


@distributed(world_size=2)
def test_fabric_checks_the_arguments_the_model_and_the_optimizers():
    import lightning as L

    rank = dist.get_rank()

    def fabric(**kwargs) -> L.Fabric:
        strategy = strategies.ShardFSDPTPFabricStrategy(**kwargs)
        f = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
        f.launch()
        return f

    with pytest.raises(RanksDisagreeError, match=r"'tensor_parallel_size': 1 on rank 0, 2 on rank 1"):
        fabric(tensor_parallel_size=1 + rank)
    f = fabric()
    with pytest.raises(RanksDisagreeError, match=r"'extra\.weight': <absent> on rank 0"):
        f.setup_module(_other_model("extra parameter") if rank else LitGPT().model)
    model = LitGPT().model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 - 0.4 * rank)
    with pytest.raises(RanksDisagreeError, match=r"'optimizer 0 group 0 momentum': 0\.9 on rank 0, 0\.5 on rank 1"):
        f.setup(model, optimizer)


def _engine_model(case: str) -> nn.Module:
    from tests.fsdp_models import make_model

    model = make_model()
    if dist.get_rank() == 1:
        if case == "other order":
            block = model.blocks[0]
            up, down = block.up, block.down
            del block.up, block.down
            block.down, block.up = down, up
        elif case == "frozen on one rank":
            model.blocks[1].up.requires_grad_(False)
        elif case == "extra parameter":
            model.extra = nn.Linear(4, 4)
    return model


def _engine_shard(model: nn.Module) -> nn.Module:
    from lightning_shard import init_device_mesh
    from lightning_shard.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


ENGINE_CASES = {
    "other order": r"'blocks\.0 \(FSDPBlock\)': \['norm\.weight .*'up\.weight \(48, 16\).* on rank 0, \['norm\.weight"
    r".*'down\.weight \(16, 48\)",
    "frozen on one rank": r"'blocks\.1 \(FSDPBlock\)'.*up\.weight \(48, 16\) float32 requires_grad=True.* on rank 0"
    r".*requires_grad=False",
    "extra parameter": r"'root \(FSDPTinyGPT\)'",
}


@distributed(world_size=2)
def test_fully_shard_checks_the_units_at_the_first_forward():
    from tests.fsdp_models import batches, loss_fn, make_model, make_optimizer, train_reference

    for case, expected in ENGINE_CASES.items():
        model = _engine_shard(_engine_model(case))
        x, y = batches(1, 4)[0]
        with pytest.raises(RanksDisagreeError, match=r"fully_shard: the ranks disagree about the FSDP units") as error:
            loss_fn(model, x, y)
        _matches("FSDP units: " + expected, str(error.value))
    # ranks that agree: one gather at the first forward, none after; trains like one process
    data = batches(3, 4)
    ref, _ = train_reference(make_model(), data)
    model = _engine_shard(make_model())
    optimizer = make_optimizer(model, 0.1, "sgd")
    with comm.count_collectives() as counts:
        for x, y in data:
            rank_batch = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
            loss_fn(model, x[rank_batch], y[rank_batch]).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert counts.calls["all_gather_object"] == 1
    ours = {n: p.full_tensor() for n, p in model.named_parameters()}
    assert max((ours[n] - p).abs().max().item() for n, p in ref.named_parameters()) < 1e-5


@distributed(world_size=2)
def test_tensor_parallel_ranks_that_differ_raise():
    from tests.tp_models import Llama

    rank = dist.get_rank()
    module = LitGPT(arch="llama")
    if rank == 1:
        torch.manual_seed(0)
        module.model = Llama(vocab=101, hidden=64)  # a per-node config with another MLP width
    tp = strategies.ShardFSDPTPStrategy(tensor_parallel_size=2)
    expected = r"'model\.layers\.0\.feed_forward\.gate_proj\.weight': \(48, 32\) float32 .* on rank 0, \(64, 32\)"
    with pytest.raises(RanksDisagreeError, match=expected):
        _trainer(strategy=tp, max_steps=1).fit(module)
    tp = strategies.ShardFSDPTPStrategy(tensor_parallel_size=2)
    with pytest.raises(RanksDisagreeError, match=r"'optimizer 0 group 0 lr': 0\.1 on rank 0, 0\.2 on rank 1"):
        _trainer(strategy=tp, max_steps=1).fit(LitGPT(lr=0.1 * (1 + rank), arch="llama"))
