"""More Hugging Face families (``tests/hf_models_extra.py``: Mamba, Mamba-2, Jamba, Zamba, RecurrentGemma,
GPT-BigCode, CodeGen, MPT, Persimmon, ModernBERT, Longformer, BigBird, Funnel, Swin, ConvNeXt, ResNet, wav2vec2,
LLaVA) trained through the real ``Trainer(strategy="shard_fsdp_tp")`` on 2 CPU ranks, against one process:

* FSDP (data parallel 2): ``STEPS`` SGD steps on Lightning's DistributedSampler batches. The reference is what
  data parallelism computes, as torch's FSDP2 / DDP define it: the mean of the two ranks' losses, each on its
  own half of the global batch (one process runs the halves one after the other). For a family with BatchNorm
  (ResNet) this is not the loss of the whole batch (each rank normalises with its own half's statistics, as in
  torch's FSDP2 without SyncBatchNorm), and each rank's running statistics follow its own halves only: the
  reference keeps one set of buffers per rank, and every rank's buffers are compared with its own set.
* TP 2 (``tensor_parallel_size=2``, the automatic plan, data parallel 1): the same batches on both ranks, the
  reference is one process on the whole batch.

Every parameter is compared after the steps (< 1e-5, relative 1e-4 for weights that moved by ~1).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import strategies  # noqa: F401 - registers "shard_fsdp_tp"
from lightning_shard.tensor import DTensor
from tests import hf_models_extra as X
from tests.harness import distributed
from tests.test_strategy import _trainer

pytest.importorskip("transformers")

ROWS, PER_RANK, STEPS, LR = 12, 2, 3, 0.1


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _optimizer(params, kind: str):
    if kind == "decay":  # weight decay changes a parameter that has a zero gradient, not one with none
        return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.5)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _lit(family: str, optimizer: str = "sgd", models=X):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    train = models.inputs(family, ROWS, seed=1)
    keys = [k for k, v in train.items() if isinstance(v, torch.Tensor)]

    class LitExtra(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = models.build(family)

        def training_step(self, batch, batch_idx):
            return models.loss_of(self.model, dict(zip(keys, batch)))

        def configure_optimizers(self):
            return _optimizer(self.parameters(), optimizer)

        def train_dataloader(self):
            return DataLoader(TensorDataset(*(train[k] for k in keys)), batch_size=PER_RANK)

    return LitExtra()


def _reference(family: str, dp: int, optimizer: str = "sgd", models=X):
    """One process, torch FSDP2 / DDP semantics over ``dp`` ranks: per step, the mean of the ranks' losses on
    their parts of the global batch; each rank's buffers (BatchNorm running statistics) updated by its parts only.
    Returns ``(params, [buffers of rank r])``."""
    from tests.lightning_models import sampler_batches

    model = models.build(family)
    opt = _optimizer(model.parameters(), optimizer)
    data = models.inputs(family, ROWS, seed=1)
    buffers = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(dp)]
    for idx in sampler_batches(dp, PER_RANK, n=ROWS)[:STEPS]:
        for r in range(dp):
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(buffers[r][n])
            (models.loss_of(model, models.select(data, idx[r * PER_RANK : (r + 1) * PER_RANK])) / dp).backward()
            buffers[r] = {n: b.clone() for n, b in model.named_buffers()}
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, buffers


def _fit(family: str, tp: int, optimizer: str = "sgd", models=X):

    from strategies import ShardFSDPTPStrategy

    module = _lit(family, optimizer, models)
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = _trainer(strategy=ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=STEPS)
    trainer.fit(module)
    return module, trainer, initial


def _fit_and_compare(family: str, tp: int = 1, optimizer: str = "sgd", models=X) -> float:
    """Train ``family`` of ``models`` (a module with ``tests/hf_models_extra.py``'s ``build``, ``inputs``,
    ``loss_of`` and ``select``) through the Trainer (FSDP 2, or TP 2 with ``tp=2``) and compare every parameter (and
    buffer) with the reference; returns the largest parameter difference."""
    world = dist.get_world_size()
    dp = world // tp
    module, trainer, initial = _fit(family, tp, optimizer, models)
    ref, ref_buffers = _reference(family, dp, optimizer, models)
    ours = dict(module.model.named_parameters())
    assert list(ours) == list(ref), family  # nothing untied or lost
    assert all(isinstance(p, DTensor) for p in ours.values()), family
    moved = max((ref[n] - initial[n]).abs().max().item() for n in ref)
    assert moved > 1e-3, (family, moved)  # the steps changed the weights, so the comparison means something
    worst = 0.0
    for n, p in ours.items():
        got = _full(p.detach())
        if torch.equal(ref[n], initial[n]):  # no gradient in one process (unused): left exactly as it was
            assert torch.equal(got, initial[n]), (family, n, (got - initial[n]).abs().max().item())
        torch.testing.assert_close(got, ref[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{family} {n}: {m}")
        worst = max(worst, (got - ref[n]).abs().max().item())
    mine = ref_buffers[dist.get_rank() // tp] if dp > 1 else ref_buffers[0]
    for n, b in module.model.named_buffers():
        torch.testing.assert_close(_full(b), mine[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{family} {n}: {m}")
    return worst


def _coverage(family: str, models=X) -> str:
    from lightning_shard.tp import auto_tp_plan
    from lightning_shard.tp.coverage import tp_coverage

    model = models.build(family)
    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    return f"{100 * tp_coverage(model, plan, summary).sharded_fraction:.0f}%"


# ------------------------------------------------------------------------------------------------ plans
# What the automatic TP plan (TP 2) shards, per family: the smallest sharded fraction of weight-matrix elements,
# and a summary line (its start after the layer index, and the reason) for a part left replicated.
PLANS = {
    # the mixer's in_proj (x and gate z) looks like a fused qkv: sharded, output gathered; x_proj/dt_proj, the
    # conv and A/D act on the gathered activations, replicated
    "mamba": (0.85, "mixer.x_proj: Linear 128 -> 20 inside a block but not part of a recognised"),
    "mamba2": (0.95, None),
    "gpt_bigcode": (1.0, None),  # multi-query fused c_attn: output gathered
    "codegen": (1.0, None),
    "mpt": (1.0, None),
    "persimmon": (1.0, None),  # fused qkv: the per-head q/k LayerNorms run on the gathered output
    "jamba": (0.55, "mamba.dt_proj: Linear 8 -> 128 inside a block"),
    "zamba": (0.85, "linear: Linear 64 -> 64 inside a block"),
    "recurrent_gemma": (0.55, "temporal_block: heads 4, kv heads 1 not divisible by tp 2, left replicated"),
    "modernbert": (0.05, "attn.Wqkv: Linear 64 -> 192 outside the blocks"),
    "longformer": (0.4, "attention.self: Linear query_global (64, 64) inside the attention is neither q/k/v/o"),
    "big_bird": (0.9, None),
    "funnel": (0.05, "ffn: MLP holds funnel.encoder.blocks.0.0.ffn.layer_norm.weight (64,) besides its Linears"),
    "swin": (0.4, "attention: relative_position_bias (relative_position_bias_table (9, 2)) inside the attention"),
    "convnext": (0.0, "layers.0: MLP holds convnext.encoder.stages.0.layers.0.layer_scale_parameter (16,)"),
    "resnet": (0.0, None),
    "wav2vec2": (0.85, None),
    "llava": (0.9, "position_embedding: embedding left replicated (CLIPVisionEmbeddings reads"),
    # the encoder's relative position table (buckets x heads) is split like the heads it biases
    "mpnet": (0.95, "relative_attention_bias: ColwiseParallel (per-head table shared by the attentions"),
    "esm": (0.9, None),
    "data2vec_text": (0.95, None),
    "xlnet": (0.05, "ff: MLP holds transformer.layer.0.ff.layer_norm.weight (64,) besides its Linears"),
    "dinov2": (0.85, None),
    "segformer": (0.2, "attention: heads 1 not divisible by tp 2, left replicated"),
    # the relative position bias covers every head: the attentions stay replicated, the MLPs are sharded
    "beit": (0.4, "attention: per-head parameter beit.layers.0.relative_position_bias.relative_position_bias_table"),
    "beit_shared_bias": (0.4, "attention: per-head parameter beit.shared_position_bias.relative_position_bias_table"),
    "wavlm": (0.4, "attention: Linear gru_rel_pos_linear (16, 8) inside the attention is neither q/k/v/o"),
    "rwkv": (0.3, None),
    "rembert": (0.9, None),
    "nystromformer": (0.5, "inside the attention acts on the head-split activations"),
}


@pytest.mark.parametrize("family", list(X.FAMILIES))
def test_plan_shards_what_it_can_and_says_why_not(family):
    from lightning_shard.tp import auto_tp_plan
    from lightning_shard.tp.coverage import tp_coverage

    model = X.build(family)
    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    least, line = PLANS[family]
    cov = tp_coverage(model, plan, summary)
    assert cov.sharded_fraction >= least, (family, cov.describe())
    if line is not None:
        assert any(line in s for s in summary), (family, summary)


# ------------------------------------------------------------------------------------------------ training
# By default: a state-space LM (Mamba-2), a hybrid with experts (Jamba), BatchNorm (ResNet), a weight_norm'd
# conv (wav2vec2) and a vision-language model (LLaVA); ``slow`` runs the others.
DEFAULT = ["mamba2", "jamba", "resnet", "wav2vec2", "llava"]
MORE = [f for f in X.FAMILIES if f not in DEFAULT]


@distributed(world_size=2)
def test_fsdp_trainer_matches_one_process():
    for family in DEFAULT:
        _fit_and_compare(family, tp=1)


@distributed(world_size=2)
def test_tp_trainer_matches_one_process():
    for family in DEFAULT:
        _fit_and_compare(family, tp=2)


@distributed(world_size=2)
def test_tp_relative_position_table_outside_the_attentions_matches_one_process():
    """MPNet looks up one relative-position bias (buckets x heads) in its encoder and adds it to every layer's
    attention scores. The automatic plan made the table vocabulary-parallel (all heads on every rank) while the
    attentions split the heads: a shape error in the first forward."""
    _fit_and_compare("mpnet", tp=2)


@distributed(world_size=2)
def test_tp_relative_position_bias_made_outside_the_attention_matches_one_process():
    """BEiT's layer (or, shared, its encoder) turns a (distances x heads) table into a bias of every head and hands
    it to the attention as its mask. The automatic plan split the attention's heads: each rank's scores met the
    bias of all heads, a shape error in the first forward (with one head per rank, a broadcast)."""
    _fit_and_compare("beit_shared_bias", tp=2)


@pytest.mark.slow
@distributed(world_size=2)
def test_fsdp_trainer_more_families_match_one_process():
    for family in MORE:
        _fit_and_compare(family, tp=1)


@pytest.mark.slow
@distributed(world_size=2)
def test_tp_trainer_more_families_match_one_process():
    for family in MORE:
        _fit_and_compare(family, tp=2)


def _unused_keep_no_gradient(families) -> None:
    for family in families:
        for tp in (1, 2):
            _fit_and_compare(family, tp=tp, optimizer="decay")


@distributed(world_size=2, timeout=150)
def test_layerdrop_runs_every_layer_on_every_rank_under_fsdp():
    """wav2vec2 with LayerDrop 0.5 under FSDP, each rank's random state different (as on ranks whose batches
    used different amounts of randomness): Hugging Face runs every layer on every rank when its encoder reads
    as FSDP-managed, the mark torch's ``fully_shard`` sets; without it each rank skipped layers by its own draw,
    the ranks' all-gathers stopped pairing up and training hung. Every layer running means the result of one
    process without LayerDrop."""
    import lightning as L

    from strategies import ShardFSDPTPStrategy

    class DifferentDrawsPerRank(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.manual_seed(1000 * trainer.global_rank + batch_idx)

    module = _lit("wav2vec2")
    module.model.config.layerdrop = 0.5  # read by the encoder at every forward
    trainer = _trainer(strategy=ShardFSDPTPStrategy(), max_steps=STEPS, callbacks=[DifferentDrawsPerRank()])
    trainer.fit(module)
    ref, _ = _reference("wav2vec2", dp=2)
    for n, p in module.model.named_parameters():
        torch.testing.assert_close(_full(p.detach()), ref[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


@distributed(world_size=2, timeout=120)
def test_generate_with_different_lengths_per_rank_under_fsdp():
    """``generate`` in a validation loop: each rank stops after its own number of tokens. Hugging Face keeps the
    finished ranks running forwards (``synced_gpus``) while any rank generates, when the model reads as
    FSDP-managed; without that the ranks ran different numbers of forwards and their all-gathers hung."""
    from lightning_shard import init_device_mesh
    from lightning_shard.fsdp import fully_shard
    from tests.hf_models import build, token_batch

    rank = dist.get_rank()
    ref, model = build("llama").eval(), build("llama").eval()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    prompt = token_batch(2, 5, seed=7)[rank : rank + 1]
    new_tokens = 3 if rank == 0 else 7
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        want = ref.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert got.shape[1] == 5 + new_tokens
    assert torch.equal(got, want)


@distributed(world_size=2)
def test_parameters_unused_on_every_rank_keep_no_gradient():
    # BigBird's pooler (a masked-LM head does not read it) and wav2vec2's masked_spec_embed (no masking) get no
    # gradient in one process, so the optimizer leaves them alone (torch's optimizers skip a None gradient). Both
    # were handed a zero gradient, under FSDP and under TP (FSDP over a data-parallel dim of 1): weight decay then
    # shrank them every step, as would AdamW's, and Adam's momentum would move them.
    _unused_keep_no_gradient(["big_bird"])


@pytest.mark.slow
@distributed(world_size=2)
def test_more_parameters_unused_on_every_rank_keep_no_gradient():
    _unused_keep_no_gradient(["wav2vec2", "longformer"])


# ------------------------------------------------------------------------------------------------ measurement
def _measure(families, modes=("fsdp", "tp")):
    """Every family under FSDP 2 and TP 2 through the Trainer; rank 0 prints one line per family and mode
    (the difference, or the error)."""
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    for family in families:
        for mode in modes:
            start = time.perf_counter()
            try:
                res = f"{_fit_and_compare(family, 2 if mode == 'tp' else 1):.1e}"
            except Exception as e:  # noqa: BLE001 - a measurement run reports every family
                res = f"{type(e).__name__}: {str(e)[:400]}"
            if dist.get_rank() == 0:
                cov = _coverage(family) if mode == "tp" else ""
                line = f"{family} {mode} {cov}: {res} ({time.perf_counter() - start:.1f} s)"
                print(line, file=sys.__stdout__, flush=True)


if __name__ == "__main__":  # python -m tests.test_hf_extra [family ...]: the table in docs/huggingface.md
    import os
    import sys

    from tests.harness import run_distributed, shutdown_pools

    try:
        timeout = float(os.environ.get("MEASURE_TIMEOUT", 3600))
        run_distributed(_measure, 2, sys.argv[1:] or list(X.FAMILIES), timeout=timeout)
    finally:
        shutdown_pools()


def test_models_that_skip_layers_by_each_ranks_draw_are_named():
    """BART skips layers by its own ``torch.rand`` per rank (``encoder_layerdrop``); the strategy warns with these
    names. wav2vec2 asks ``is_fsdp_managed_module`` first and runs every layer under ``fully_shard``: not named."""
    from transformers import BartConfig, BartForConditionalGeneration

    from strategies.parallelize import random_layer_skipping
    from tests.hf_models_more import _bart_like

    bart = BartForConditionalGeneration(BartConfig(**_bart_like(0.0), encoder_layerdrop=0.2))
    assert random_layer_skipping(bart) == ["model.encoder (BartEncoder, layerdrop=0.2)"]
    speech = X.build("wav2vec2")
    speech.config.layerdrop = 0.5
    assert speech.wav2vec2.encoder.config.layerdrop == 0.5
    assert random_layer_skipping(speech) == []
    assert random_layer_skipping(BartForConditionalGeneration(BartConfig(**_bart_like(0.0)))) == []
