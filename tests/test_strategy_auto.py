"""The strategy's "auto" knobs (activation checkpointing, reshard_after_forward, CPU offload, TP size) through
the real Trainer on 2 gloo ranks: decided once by rank 0's planner, applied on every rank, and trained equal to
a single-process reference. The memory budgets come from the planner's own per-configuration estimates (what
it predicts each choice needs); what is checked is what the strategy does with them."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import strategies
from lightning_shard.planner import Configuration, NoFitError, estimate
from tests.fsdp_models import SEQ, VOCAB
from tests.harness import distributed
from tests.lightning_models import LitGPT, reference_params
from tests.test_strategy import _max_diff, _trainer
from tests.tp_models import Llama, LlamaBlock

BATCH = 16  # per rank: activations outweigh the model states, so checkpointing matters to the estimate
MARGIN = 0.1  # the planner's default safety margin, which the strategy keeps


def _predicted(ac) -> int:
    """The planner's per-device peak for the strategy's (2, 1) mesh with or without checkpointing."""
    with torch.device("meta"):
        model = Llama(vocab=VOCAB)
    return estimate(model, (2, 1), batch=BATCH, seq_len=SEQ, activation_checkpointing=ac).device_total


def _checkpointed(module) -> list[str]:
    """The classes (as the user wrote them, not FSDP's subclass) whose forward is recomputed in backward."""
    return sorted(
        {"LlamaBlock" if isinstance(m, LlamaBlock) else type(m).__name__ for m in module.modules()
         if getattr(m, "_ls_checkpointed", False)}
    )  # fmt: skip


@distributed(world_size=2)
def test_auto_turns_checkpointing_on_when_the_budget_needs_it_and_trains_like_one_process():
    none, full = _predicted(None), _predicted("full")
    assert full < none  # the premise: checkpointing is what makes it fit
    memory = int((none + full) / 2 / (1 - MARGIN))  # between the two, after the margin
    module = LitGPT(arch="llama", per_rank_batch=BATCH)
    strategy = strategies.ShardFSDPTPStrategy(activation_checkpointing_policy="auto", planner_device_memory=memory)
    trainer = _trainer(strategy=strategy, max_steps=2)
    trainer.fit(module)
    assert _checkpointed(module) == ["LlamaBlock"]
    assert sum(getattr(m, "_ls_checkpointed", False) for m in module.modules()) == 2  # both blocks
    assert strategy.activation_checkpointing_policy == {LlamaBlock}
    assert strategy.parallel_summary["auto"]["auto"] == ["activation_checkpointing_policy"]
    assert "<- chosen" in strategy.parallel_summary["planner_table"]
    assert module.device_mesh.shape == (2, 1)  # tensor_parallel_size=1 stays as given
    assert _max_diff(module, reference_params(2, per_rank_batch=BATCH, arch="llama")) < 1e-5


@distributed(world_size=2)
def test_auto_with_a_huge_budget_picks_no_checkpointing_and_no_offload():
    module = LitGPT(arch="llama")
    strategy = strategies.ShardFSDPTPStrategy(
        tensor_parallel_size="auto", activation_checkpointing_policy="auto", reshard_after_forward="auto",
        cpu_offload="auto", planner_device_memory="1TiB",
    )  # fmt: skip
    trainer = _trainer(strategy=strategy, max_steps=1)
    trainer.fit(module)
    assert _checkpointed(module) == [] and strategy.activation_checkpointing_policy is None
    assert strategy.cpu_offload is False and strategy.reshard_after_forward in (True, False)
    chosen = strategy.parallel_summary["auto"]
    assert chosen["auto"] == ["tensor_parallel_size", "activation_checkpointing_policy", "reshard_after_forward",
                              "cpu_offload"]  # fmt: skip
    assert module.device_mesh.shape == (2 // chosen["tensor_parallel_size"], chosen["tensor_parallel_size"])
    assert "planner" in chosen["decided_by"] and "1.00 TiB" in strategy.planner_table


@distributed(world_size=2)
def test_every_rank_applies_rank_zeros_configuration():
    import lightning_shard.planner as planner

    # Rank 1's planner would decide otherwise (another node's memory, another first batch): it must not matter.
    other = Configuration(1, "full", False, True, "rank 1's table")
    patch = mock.patch.object(planner, "choose_configuration", return_value=other)
    module = LitGPT(arch="llama")
    strategy = strategies.ShardFSDPTPStrategy(
        activation_checkpointing_policy="auto", reshard_after_forward="auto", cpu_offload="auto",
        planner_device_memory="1TiB",
    )  # fmt: skip
    with patch if dist.get_rank() == 1 else contextlib.nullcontext():
        _trainer(strategy=strategy, max_steps=1).fit(module)
    applied = (_checkpointed(module), strategy.reshard_after_forward, strategy.cpu_offload, strategy.planner_table)
    seen = [None, None]
    dist.all_gather_object(seen, applied)
    assert seen[0] == seen[1], seen
    assert seen[0][0] == [] and seen[0][2] is False and "rank 1" not in seen[0][3]


@distributed(world_size=2, timeout=120)
def test_a_budget_nothing_fits_raises_no_fit_on_every_rank():
    strategy = strategies.ShardFSDPTPStrategy(
        activation_checkpointing_policy="auto", cpu_offload="auto", planner_device_memory=1024
    )
    with pytest.raises(NoFitError, match=r"over the budget(.|\n)*activation_checkpointing_policy='auto'"):
        _trainer(strategy=strategy, max_steps=1).fit(LitGPT(arch="llama"))


@distributed(world_size=2)
def test_auto_plans_on_the_dataloaders_passed_to_fit():
    # The planner read only the module's and the datamodule's train_dataloader: with loaders passed to fit it
    # planned the module's own batch of 4 (or, without one, fell back to TP 1), not the 3 rows the run trains on.
    from torch.utils.data import DataLoader

    from tests.lightning_models import dataset

    module = LitGPT(arch="llama")
    strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size="auto", planner_device_memory="1TiB")
    _trainer(strategy=strategy, max_steps=1).fit(module, train_dataloaders=DataLoader(dataset(), batch_size=3))
    assert f"micro-batch 3 x seq {SEQ}" in strategy.planner_table


def test_a_model_built_in_configure_model_gets_the_defaults_with_the_reason():
    from strategies import auto
    from strategies.precision import ShardPrecision

    strategy = strategies.ShardFSDPTPStrategy(
        tensor_parallel_size="auto", activation_checkpointing_policy="auto", cpu_offload="auto",
        reshard_after_forward="auto", parallel_devices=[torch.device("cpu")] * 2,
    )  # fmt: skip
    strategy._lightning_module = LitGPT(meta_init=True)  # no layers until configure_model
    strategy.precision_plugin = ShardPrecision("32-true", "cpu")
    request = auto.Request(tensor_parallel_size="auto", **strategy._auto_request)
    assert strategy._apply_auto(request, 2) == 1
    assert (strategy.activation_checkpointing_policy, strategy.reshard_after_forward, strategy.cpu_offload) == (
        None, True, False,
    )  # fmt: skip
    assert "configure_model" in strategy.auto_configuration["decided_by"] and strategy.planner_table is None
