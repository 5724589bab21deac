"""Planner: activation checkpointing, SP / loss parallel, HSDP, transients, time model, search, HF models,
LightningModules. Single process, meta-device models; oracles are real CPU runs or shapes, not the planner."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_shard.planner import Device, SavedTensorCounter, choose_configuration, estimate, plan, step_time
from tests.tp_models import Llama, LlamaAttention

B, T = 4, 16  # micro-batch and sequence length of every test here


def _meta(factory):
    with torch.device("meta"):
        return factory()


def _real_saved(model, batch=B, seq=T):
    """A real CPU forward + loss: bytes saved inside the blocks, by the loss, and in total (the oracle)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 101, (batch, seq))
    with SavedTensorCounter(model) as counter:
        logits = model(ids)
    with SavedTensorCounter(model) as loss_counter:
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), torch.zeros(batch * seq, dtype=torch.long))
    in_blocks = sum(b for path, b in counter.records if any(p.startswith("layers.") for p in path))
    return in_blocks, loss_counter.total, counter.total + loss_counter.total


def test_full_checkpointing_keeps_only_block_inputs():
    in_blocks, _, total = _real_saved(Llama())
    model = _meta(Llama)
    none = estimate(model, (1, 1), batch=B, seq_len=T)
    full = estimate(model, (1, 1), batch=B, seq_len=T, activation_checkpointing="full")
    assert none.activations == total
    block_input = B * T * 32 * 4  # (B, T, dim) fp32, one per block
    assert full.activations == total - in_blocks + 2 * block_input
    # backward recomputes one block: its saved bytes (half of the two identical blocks') come back as a transient
    assert full.transient_parts["block_backward"] - none.transient_parts["block_backward"] == in_blocks // 2


def test_module_policy_and_selective_op_lie_between_none_and_full():
    model = _meta(Llama)
    kw = dict(batch=B, seq_len=T)
    none = estimate(model, (1, 1), **kw).activations
    full = estimate(model, (1, 1), activation_checkpointing="full", **kw).activations
    attention = estimate(model, (1, 1), activation_checkpointing={LlamaAttention}, **kw).activations
    selective = estimate(model, (1, 1), activation_checkpointing="selective-op", **kw).activations
    assert full < attention < none and full < selective < none
    with pytest.raises(ValueError, match="activation_checkpointing"):
        estimate(model, (1, 1), activation_checkpointing="some", **kw)


def test_loss_parallel_shards_the_loss_and_sequence_parallel_the_rest():
    _, loss_bytes, _ = _real_saved(Llama())
    model = _meta(Llama)
    kw = dict(batch=B, seq_len=T)
    tp2 = estimate(model, (1, 2), **kw)
    lp = estimate(model, (1, 2), loss_parallel=True, **kw)
    sp = estimate(model, (1, 2), sequence_parallel=True, **kw)
    assert tp2.activations - lp.activations == pytest.approx(loss_bytes / 2, abs=2)
    assert sp.activations < tp2.activations
    # the loss gradient at full vocabulary: two fp32 tensors in log-softmax backward; split over TP under LP
    # (give or take the scalar loss's own gradient: a few bytes)
    assert tp2.transient_parts["loss_gradient"] == pytest.approx(B * T * 101 * 8, abs=16)
    # under loss parallel each rank holds half the vocabulary, and the engine's log-softmax backward is
    # decomposed (grad - exp(out) * sum): exp(out) and the product are one more fp32 tensor than the fused kernel
    assert lp.transient_parts["loss_gradient"] == pytest.approx(B * T * 101 * (8 + 4) // 2, abs=16)
    assert lp.comm["all_gather"] < tp2.comm["all_gather"]  # no logits all-gather


def test_hsdp_shards_within_the_replica_group_and_auto_keeps_tp_1():
    model = _meta(Llama)
    kw = dict(batch=B, seq_len=T)
    hsdp = estimate(model, (8, 1), replicas=4, **kw)  # 4 replicas of 2-way sharding
    two_way = estimate(model, (2, 1), **kw)
    assert (hsdp.params, hsdp.grads, hsdp.optimizer) == (two_way.params, two_way.grads, two_way.optimizer)
    assert hsdp.comm["all_reduce"] > 0 and two_way.comm["all_reduce"] == 0
    result = plan(model, 4, 2, "1GB", hybrid_shard=True, **kw)
    assert result.choice.mesh == (4, 1) and result.choice.estimate.replicas == 2
    assert all("hybrid sharding" in o.reason for o in result.options if o.mesh[1] > 1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_causal_lm_is_planned(family):
    hf = pytest.importorskip("tests.hf_models")
    model = hf.build(family).to("meta")
    result = plan(model, 2, 2, "1GB", batch=2, seq_len=8)
    est = result.choice.estimate
    assert est.activations > 0 and est.model_flops > 0
    # the backward from the loss to the last block: two fp32 logits-sized gradients at once, then the final
    # RMSNorm's fp32 backward on (batch, seq, hidden), which holds at most five such tensors (at this tiny
    # vocabulary it can be the larger of the two)
    logits, hidden = 2 * 8 * hf.VOCAB, 2 * 8 * hf.HIDDEN
    assert 8 * logits <= est.transient_parts["loss_gradient"] <= max(8 * logits, 5 * 4 * hidden) + 16


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU()) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_flops_and_time_model_against_first_principles():
    model = _meta(_MLP)
    est = estimate(
        model, (2, 1), batch=2, seq_len=4, example_input=lambda b, t, d: (torch.randn(b, t, 8, device=d),),
        loss_fn=lambda out: out.sum(),
    )  # fmt: skip
    rows = 2 * 4
    assert est.model_flops == 3 * 2 * (2 * rows * 8 * 8)  # two 8x8 matmuls, backward = 2x forward
    ideal = Device("ideal", {"bf16": 1e12, "fp32": 1e12}, 2**30, math.inf, math.inf, math.inf, 0.5, latency=0.0)
    t = step_time(est, ideal, devices_per_node=8, precision="32-true")
    assert t.step == pytest.approx(est.hardware_flops / (1e12 * 0.5))  # nothing but compute is left
    assert t.mfu == pytest.approx(0.5) and t.tokens_per_second_per_device == pytest.approx(rows / t.step)
    # the two ReLUs write (rows, 8) fp32 each and the loss a scalar: memory-bound, 3 bytes moved per byte written
    assert est.memory_bound_bytes == 2 * rows * 8 * 4 + 4
    hbm = Device("finite HBM", ideal.peak_flops, 2**30, math.inf, math.inf, 1e6, 0.5, latency=0.0)
    extra = step_time(est, hbm, 8, "32-true").compute - t.compute
    assert extra == pytest.approx(3 * est.memory_bound_bytes * 3 / (1e6 * 0.7))
    slow = Device("slow links", ideal.peak_flops, 2**30, 1e3, 1e3, math.inf, 0.5, latency=0.0)
    assert step_time(est, slow, 8, "32-true").step > t.step  # communication longer than compute is exposed


def test_auto_picks_checkpointing_only_when_memory_forces_it():
    model = _meta(Llama)
    kw = dict(batch=B, seq_len=T, safety_margin=0.0, activation_checkpointing="auto")
    none = estimate(model, (2, 1), batch=B, seq_len=T)
    full = estimate(model, (2, 1), batch=B, seq_len=T, activation_checkpointing="full")
    roomy = plan(model, 2, 1, none.device_total * 2, **kw)
    assert roomy.choice.estimate.options.checkpointing is None  # recomputation only costs time
    tight = plan(model, 2, 1, (none.device_total + full.device_total) // 2, **kw)
    assert tight.choice.estimate.options.checkpointing == "full"
    assert "ac=full" in tight.table and "<- chosen" in tight.table and "pipeline" in tight.table
    # what a strategy with "auto" knobs applies: the same choice, every knob resolved
    budget = (none.device_total + full.device_total) // 2
    knobs = dict(batch=B, seq_len=T, safety_margin=0.0, activation_checkpointing="auto", reshard_after_forward="auto",
                 cpu_offload="auto")  # fmt: skip
    c = choose_configuration(model, 2, 1, budget, "32-true", **knobs)
    chosen = plan(model, 2, 1, budget, precision="32-true", **knobs).choice
    assert (c.tensor_parallel_size, c.activation_checkpointing, c.reshard_after_forward, c.cpu_offload) == (
        chosen.mesh[1], chosen.estimate.options.checkpointing, chosen.estimate.reshard_after_forward,
        chosen.estimate.cpu_offload,
    )  # fmt: skip
    assert chosen.estimate.device_total <= budget and "<- chosen" in c.table


class _PlainLightningModule(nn.Module):
    """The shape of an ordinary LightningModule: layers in __init__, no forward, training_step + dataloader."""

    def __init__(self):
        super().__init__()
        self.net = Llama()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def train_dataloader(self):
        x = torch.randint(0, 101, (3, 10))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=3)


def test_strategy_runs_training_step_on_a_batch_of_the_train_dataloader():
    pytest.importorskip("lightning")
    from strategies.auto import planner_step

    module = _meta(_PlainLightningModule)
    example_input, step, batch, seq_len = planner_step(module, 1, 2048)
    assert (batch, seq_len) == (3, 10)
    est = estimate(module, (1, 1), batch=batch, seq_len=seq_len, example_input=example_input, step=step)
    direct = estimate(_meta(Llama), (1, 1), batch=3, seq_len=10)
    assert est.activations == direct.activations and est.model_flops == direct.model_flops
    module.example_input_array = torch.zeros(5, 7, dtype=torch.long)
    _, step, batch, seq_len = planner_step(module, 1, 2048)
    assert step is None and (batch, seq_len) == (5, 7)


def test_strategy_auto_passes_its_checkpointing_and_hybrid_sharding_to_the_planner():
    L = pytest.importorskip("lightning")
    import strategies
    from strategies.precision import ShardPrecision
    from tests.tp_models import LlamaBlock

    class Plain(L.LightningModule):  # layers in __init__, no forward
        def __init__(self):
            super().__init__()
            self.net = Llama()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

        def train_dataloader(self):
            x = torch.randint(0, 101, (3, 10))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=3)

    strategy = strategies.ShardFSDPTPStrategy(
        tensor_parallel_size="auto", activation_checkpointing_policy={LlamaBlock}, sharding_strategy="HYBRID_SHARD",
        parallel_devices=[torch.device("cpu")] * 2,
    )  # fmt: skip
    strategy._lightning_module = Plain()
    strategy.precision_plugin = ShardPrecision("32-true", "cpu")
    from strategies import auto

    assert strategy._apply_auto(auto.Request(tensor_parallel_size="auto", **strategy._auto_request), 4) == 1
    table = strategy.planner_table
    assert table is not None and "micro-batch 3 x seq 10" in table  # the train batch, through training_step
    assert "ac={LlamaBlock}" in table and "hsdp 2x2" in table
    assert "hybrid sharding (HSDP) does not combine with TP" in table  # TP 2 is never offered


def test_auto_offloads_only_when_nothing_else_fits():
    model = _meta(Llama)
    kw = dict(batch=B, seq_len=T)
    off = estimate(model, (2, 1), cpu_offload=True, activation_checkpointing="full", **kw)
    on = estimate(model, (2, 1), activation_checkpointing="full", **kw)
    assert off.device_total < on.device_total and off.cpu_bytes == on.model_states
    budget = (off.device_total + on.device_total) // 2
    result = plan(model, 2, 1, budget, safety_margin=0.0, cpu_offload="auto", activation_checkpointing="auto",
                  reshard_after_forward="auto", **kw)  # fmt: skip
    assert result.choice.estimate.cpu_offload and result.choice.fits
    assert len([o for o in result.options if o.estimate is not None]) == 8  # 1 mesh x 2 AC x 2 reshard x 2 offload
    assert step_time(off, "h100", 8).step > step_time(on, "h100", 8).step  # host copies and a host optimizer step


def test_auto_checkpointing_offers_nothing_to_checkpoint_on_a_model_without_blocks():
    # Before: "ac=full" was listed (and could be chosen) with the same estimate as "ac=none"; the strategy has
    # no repeated block to checkpoint there.
    model = _meta(lambda: nn.Sequential(nn.Embedding(101, 16), nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 101)))
    result = plan(model, 2, 2, "1GiB", batch=B, seq_len=T, activation_checkpointing="auto")
    assert {o.estimate.options.checkpointing for o in result.options if o.estimate} == {None}
    assert "ac=full" not in result.table


def test_a_fixed_tensor_parallel_size_is_the_only_mesh_searched():
    model = _meta(Llama)
    result = plan(model, 4, 4, "1GiB", batch=B, seq_len=T, tensor_parallel_size=2, activation_checkpointing="auto")
    assert {o.mesh for o in result.options} == {(2, 2)} and result.choice.mesh == (2, 2)
    c = choose_configuration(model, 4, 4, "1GiB", "32-true", batch=B, seq_len=T, tensor_parallel_size=2,
                             cpu_offload="auto")  # fmt: skip
    assert c.tensor_parallel_size == 2 and c.cpu_offload is False
    with pytest.raises(ValueError, match="tensor_parallel_size=3.*divisor of world_size=4"):
        plan(model, 4, 4, "1GiB", batch=B, seq_len=T, tensor_parallel_size=3)


def test_the_first_train_batch_is_drawn_without_moving_any_random_generator():
    # A shuffling sampler draws its order from torch's generator: rank 0's planner moved rank 0's generator alone
    # before, so its dropout and data order left the stream a run without "auto" has.
    import random

    from strategies.auto import first_train_batch

    class Shuffled(_PlainLightningModule):
        def train_dataloader(self):
            x = torch.randint(0, 101, (12, 10))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=3, shuffle=True)

    module = Shuffled()
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    x, _ = first_train_batch(module)
    assert x.shape == (3, 10)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state


def test_the_planner_reads_the_dataloaders_passed_to_fit():
    # trainer.fit(model, train_dataloaders=loader): the planner found no data and fell back to TP 1 ("missing the
    # required forward"), the issue's own symptom on an ordinary LightningModule.
    from types import SimpleNamespace

    from strategies.auto import first_train_batch, planner_step

    x = torch.randint(0, 101, (6, 10))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=2)
    module = _meta(Llama)
    plain = _PlainLightningModule.__new__(_PlainLightningModule)
    nn.Module.__init__(plain)
    plain.net = module
    plain._trainer = SimpleNamespace(fit_loop=SimpleNamespace(_data_source=SimpleNamespace(instance=loader)))
    batch = first_train_batch(plain)
    assert torch.equal(batch[0], x[:2])
    example_input, step, b, t = planner_step(plain, 1, 2048)
    assert (b, t) == (2, 10) and step is not None
    est = estimate(plain, (1, 1), batch=b, seq_len=t, example_input=example_input, step=step)
    assert est.activations == estimate(_meta(Llama), (1, 1), batch=2, seq_len=10).activations


class _TwoSources(_PlainLightningModule):
    """A LightningModule trained on two dataloaders at once (``fit(train_dataloaders={"text": ..., "code": ...})``)."""

    def training_step(self, batch, batch_idx):
        return sum(super(_TwoSources, self).training_step(batch[key], batch_idx) for key in ("text", "code"))


def test_the_planner_reads_several_dataloaders_passed_to_fit_as_lightning_combines_them():
    # A dict (or list) of train dataloaders: the planner looked for one DataLoader only, found none and planned
    # its default token ids through forward instead of the user's training_step on the user's shapes.
    from types import SimpleNamespace

    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    from strategies.auto import first_train_batch, planner_step

    text, code = torch.randint(0, 101, (6, 10)), torch.randint(0, 101, (4, 10))
    loaders = {
        "text": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(text, text), batch_size=2, shuffle=True),
        "code": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(code, code), batch_size=2),
    }
    module = _TwoSources.__new__(_TwoSources)
    nn.Module.__init__(module)
    module.net = _meta(Llama)
    for given in (loaders, CombinedLoader(loaders, "max_size")):
        module._trainer = SimpleNamespace(fit_loop=SimpleNamespace(_data_source=SimpleNamespace(instance=given)))
        batch = first_train_batch(module)
        assert set(batch) == {"text", "code"}
        assert torch.equal(batch["text"][0], text[:2]) and torch.equal(batch["code"][1], code[:2])
    example_input, step, b, t = planner_step(module, 1, 2048)
    assert (b, t) == (2, 10) and step is not None
    est = estimate(module, (1, 1), batch=b, seq_len=t, example_input=example_input, step=step)
    assert est.activations == 2 * estimate(_meta(Llama), (1, 1), batch=2, seq_len=10).activations
    module._trainer.fit_loop._data_source.instance = [loaders["text"], loaders["code"]]
    pair = first_train_batch(module)
    assert isinstance(pair, list) and torch.equal(pair[1][0], code[:2])


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Llama()

    def forward(self, ids, mask):
        return self.net(ids * mask)


def test_a_list_example_input_array_is_unpacked_as_lightning_does():
    # Lightning calls model(*example_input_array) for a list (ModelSummary); the planner passed the list as one
    # argument and fell back ("missing 1 required positional argument: 'mask'").
    from strategies.auto import planner_step

    module = _meta(_TwoInputs)
    module.example_input_array = [torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long)]
    example_input, step, b, t = planner_step(module, 1, 2048)
    est = estimate(module, (1, 1), batch=b, seq_len=t, example_input=example_input, step=step)
    assert (b, t) == (B, T) and est.activations == estimate(_meta(Llama), (1, 1), batch=B, seq_len=T).activations


def test_no_fit_advice_for_a_smaller_micro_batch_runs_that_micro_batch():
    # The strategy's inputs ignored the micro-batch the planner asked for, so "micro-batch 4" reported the
    # unchanged requirement of 8.
    from lightning_shard.planner import NoFitError
    from lightning_shard.planner.estimate import format_bytes
    from strategies.auto import planner_step

    module = _meta(Llama)
    module.example_input_array = torch.zeros(8, T, dtype=torch.long)
    example_input, step, b, t = planner_step(module, 1, 2048)
    assert example_input(4, t, torch.device("meta"))[0].shape == (4, T)
    with pytest.raises(NoFitError) as raised:
        plan(module, 1, 1, 1024, batch=b, seq_len=t, example_input=example_input, step=step)
    four = estimate(_meta(Llama), (1, 1), batch=4, seq_len=T).device_total
    assert f"micro-batch 4: {format_bytes(four)} per device" in str(raised.value)


def test_no_fit_advice_names_sequence_and_loss_parallelism_under_tensor_parallelism():
    # Before, the knobs were checkpointing, offload, resharding, micro-batch and devices; on a long sequence or a
    # large vocabulary sharding the activations and logits over TP is often the largest saving.
    from lightning_shard.planner import NoFitError
    from lightning_shard.planner.estimate import format_bytes

    model = _meta(Llama)
    with pytest.raises(NoFitError) as raised:
        plan(model, 4, 4, 1024, batch=B, seq_len=T)
    message = str(raised.value)
    both = estimate(model, (2, 2), batch=B, seq_len=T, sequence_parallel=True, loss_parallel=True).device_total
    assert (
        "loss parallelism (loss_parallel=True) on" in message and "sequence parallelism (sequence_parallel" in message
    )
    assert f"sequence_parallel=True, loss_parallel=True) on 2x2 ac=none: {format_bytes(both)} per device" in message
    # never where auto_tp_plan keeps it off (a position table outside the blocks: True would train wrong)
    from tests.tp_models import LlamaWithPositionTable

    with pytest.raises(NoFitError) as raised:
        plan(_meta(LlamaWithPositionTable), 4, 4, 1024, batch=B, seq_len=T)
    assert "loss parallelism (loss_parallel=True) on" in str(raised.value)
    assert "sequence_parallel=True" not in str(raised.value)


def test_strategy_plans_sequence_parallel_auto_per_tp_size_as_the_plan_decides_it():
    # sequence_parallel="auto" (the default) was planned as off: the planner overestimated every TP configuration
    # of a model that does get sequence parallelism, and could choose checkpointing or offload it did not need.
    # The decision depends on the TP size: an MLP hidden size of 50 splits over 2 ranks, not over 4.
    pytest.importorskip("lightning")
    import strategies
    from lightning_shard.planner.plan import sequence_parallel_applies
    from strategies import auto
    from strategies.precision import ShardPrecision

    class Odd(_PlainLightningModule):
        def __init__(self):
            super().__init__()
            self.net = Llama(hidden=50)

    assert sequence_parallel_applies(Odd(), 2) and not sequence_parallel_applies(Odd(), 4)
    tables = {}
    for sp in ("auto", False):
        strategy = strategies.ShardFSDPTPStrategy(
            tensor_parallel_size="auto", sequence_parallel=sp, parallel_devices=[torch.device("cpu")] * 4
        )
        strategy._lightning_module = Odd()
        strategy.precision_plugin = ShardPrecision("32-true", "cpu")
        strategy._apply_auto(auto.Request(tensor_parallel_size="auto", **strategy._auto_request), 4)
        tables[sp] = strategy.planner_table
    assert "2x2 ac=none sp " in tables["auto"] and " sp " not in tables[False]


def test_the_planners_batch_leaves_the_loaders_own_generator_and_workers_alone():
    # The planner drew its batch through the loader: a DataLoader(generator=g) drew its shuffle order and worker
    # seed from g (rank 0's first epoch then differed from a run without "auto"), and persistent workers stayed.
    from strategies.auto import first_train_batch

    generator = torch.Generator().manual_seed(3)
    x = torch.arange(12).reshape(12, 1)

    class Seeded(_PlainLightningModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=3, shuffle=True,
                                               generator=generator)  # fmt: skip

    state = generator.get_state()
    batch = first_train_batch(Seeded())
    assert batch[0].shape == (3, 1) and torch.equal(generator.get_state(), state)
