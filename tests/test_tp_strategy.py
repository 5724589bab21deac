"""The strategy's TP options through the Trainer on 2 gloo ranks (TP 2): the startup report (TP-sharded
fraction, replicated modules with reasons, a warning above 10% replicated), ``sequence_parallel`` and
``loss_parallel`` compared with a single-device run."""

from __future__ import annotations

from unittest import mock

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import strategies
from lightning_shard.tensor import DTensor
from tests import tp_models
from tests.harness import distributed
from tests.lightning_models import LitGPT, dataset, reference_params


def _trainer(strategy, max_steps=3):
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def _fit(module, **kw):
    """Fit with TP 2 and return (rank-0 info messages, rank-0 warnings)."""
    trainer = _trainer(strategies.ShardFSDPTPStrategy(tensor_parallel_size=2, **kw))
    with (
        mock.patch("strategies.strategy.rank_zero_info") as info,
        mock.patch("strategies.strategy.rank_zero_warn") as warn,
    ):
        trainer.fit(module)
    return [str(c.args[0]) for c in info.call_args_list], [str(c.args[0]) for c in warn.call_args_list]


def _max_diff(module, ref):
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    assert ours.keys() == ref.keys()
    return max((ours[k] - ref[k]).abs().max().item() for k in ours)


class LitDemo(L.LightningModule):
    """Lightning's demo Transformer (nn.MultiheadAttention: left replicated by the auto plan)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = tp_models.demo_transformer()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.nll_loss(self.model(x, y), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(dataset(), batch_size=4)


@distributed(world_size=2)
def test_startup_reports_tp_coverage_and_warns_when_mostly_replicated():
    infos_module = LitGPT(arch="llama")
    infos, warns = _fit(infos_module)
    line = next(m for m in infos if m.startswith("shard_fsdp_tp: mesh"))
    assert "TP shards 100.0% of weight-matrix elements" in line, line
    memory = next(m for m in infos if m.startswith("shard_fsdp_tp: parameters"))
    model = infos_module.model
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert infos_module.trainer.strategy.parallel_summary["parameter_bytes"] == (full, local)
    assert 0.3 * full < local < 0.7 * full, memory  # TP 2 halves the weight matrices; norms stay replicated
    assert f"{full / 1024:.2f} KiB in full, {local / 1024:.2f} KiB on this rank" in memory, memory
    assert warns == [], warns
    infos, warns = _fit(LitDemo())
    line = next(m for m in infos if m.startswith("shard_fsdp_tp: mesh"))
    assert "replicated: model.transformer.encoder.layers.0.self_attn (4,096" in line, line
    assert "nn.MultiheadAttention" in line, line
    assert len(warns) == 1 and "% of the weight-matrix elements replicated" in warns[0], warns
    assert "more than 10%" in warns[0] and "self_attn" in warns[0], warns


@distributed(world_size=2)
def test_sequence_parallel_and_loss_parallel_match_single_device():
    ref = reference_params(3, world=1, arch="llama")
    for sp, lp in ((True, False), (False, True), (True, True)):
        module = LitGPT(arch="llama")
        _fit(module, sequence_parallel=sp, loss_parallel=lp)
        plan = module.trainer.strategy.parallel_summary["tp_summary"]
        assert plan[0] == ("sequence_parallel: on (sequence dim 1)" if sp else plan[0]), plan[:2]
        assert _max_diff(module, ref) < 1e-5, (sp, lp)


@distributed(world_size=2)
def test_sequence_parallel_default_is_on_where_safe_and_off_for_a_position_table():
    ref = reference_params(3, world=1, arch="llama")
    module = LitGPT(arch="llama")
    _fit(module)  # defaults: sequence_parallel="auto"
    summary = module.trainer.strategy.parallel_summary["tp_summary"]
    assert summary[0] == "sequence_parallel: on (sequence dim 1)", summary[:2]
    assert _max_diff(module, ref) < 1e-5
    # A position table sliced by the local sequence length: "auto" keeps it off and training stays exact; forced
    # on, the same model trains wrong without an error (what the check prevents).
    ref = reference_params(3, world=1, arch="llama_pos")
    module = LitGPT(arch="llama_pos")
    _fit(module)
    summary = module.trainer.strategy.parallel_summary["tp_summary"]
    assert summary[0].startswith("sequence_parallel: off (parameter model.pos (16, 32) outside the blocks"), summary[0]
    assert _max_diff(module, ref) < 1e-5
    forced = LitGPT(arch="llama_pos")
    _fit(forced, sequence_parallel=True)
    assert _max_diff(forced, ref) > 1e-3


def test_options_need_the_auto_plan():
    with pytest.raises(ValueError, match="sequence_parallel=True applies to tp_plan='auto'"):
        strategies.ShardFSDPTPStrategy(tp_plan={}, sequence_parallel=True)
    with pytest.raises(TypeError, match="loss_parallel='yes' must be True or False"):
        strategies.ShardFSDPTPStrategy(loss_parallel="yes")
    with pytest.raises(TypeError, match="sequence_parallel='on' must be True, False or 'auto'"):
        strategies.ShardFSDPTPStrategy(sequence_parallel="on")
    strategies.ShardFSDPTPStrategy(tp_plan={})  # the default "auto" does not conflict with a user's plan


@distributed(world_size=2)
def test_sequence_length_not_divisible_raises():
    from lightning_shard import comm, init_device_mesh
    from lightning_shard.tp import auto_tp_plan, parallelize_module

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    model = tp_models.Llama()
    parallelize_module(model, tp_mesh, auto_tp_plan(model, tp_mesh, sequence_parallel=True))
    with comm.count_collectives() as counts, pytest.raises(ValueError, match="sequence length 7 is not divisible"):
        model(torch.zeros(2, 7, dtype=torch.long))
    assert sum(counts.calls.values()) == 0
    assert isinstance(model.output.weight, DTensor)
