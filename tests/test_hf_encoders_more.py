"""More Hugging Face encoder and encoder-decoder families (``tests/hf_models_encoders_more.py``) trained through
the real ``Trainer(strategy="shard_fsdp_tp")`` on 2 CPU ranks, against one process, with
``tests/test_hf_extra.py``'s helpers:

* FSDP 2 (data parallel 2): 3 SGD steps on Lightning's DistributedSampler batches; the reference is the mean of
  the two ranks' losses, each on its own half of the global batch.
* TP 2 (the automatic plan, data parallel 1): the same batches on both ranks, the reference one process on them;
  no op may fall back to replication.

Every parameter is compared after the steps (< 1e-5, relative 1e-4 for weights that moved by ~1).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import strategies  # noqa: F401 - registers "shard_fsdp_tp"
from lightning_shard.tensor import fallback_counts, reset_fallback_counts
from tests import hf_models_encoders_more as E
from tests.harness import distributed
from tests.test_hf_extra import _coverage, _fit_and_compare

pytest.importorskip("transformers")


def _compare(family: str, tp: int) -> float:
    reset_fallback_counts()
    worst = _fit_and_compare(family, tp=tp, models=E)
    if tp > 1:
        assert fallback_counts() == {}, (family, fallback_counts())
    return worst


# ------------------------------------------------------------------------------------------------ plans
# What the automatic TP plan (TP 2) shards, per family: the smallest sharded fraction of weight-matrix elements,
# and a summary line (or its part) for a part left replicated.
PLANS = {
    "mt5": (1.0, None),  # gated-GELU FFN (wi_0, wi_1 up; wo down), the per-head relative_attention_bias split
    "marian": (0.9, "embed_positions: embedding left replicated"),
    "m2m_100": (1.0, None),  # sinusoidal positions: a buffer, no parameter
    "umt5": (1.0, None),  # a relative_attention_bias in every attention, split like the heads
    # transient-global attention: its LayerNorm over the global block sums acts on the head-split activations
    "longt5": (0.8, "global_input_layer_norm (weight (64,)) inside the attention acts on the head-split"),
    # the experts are nn.Linear pairs (MLPs, sharded), the router stays replicated
    "switch_transformers": (0.99, "router.classifier: Linear 64 -> 4 inside a block but not part of a recognised"),
    "nllb_moe": (0.99, "router.classifier: Linear 64 -> 4 inside a block but not part of a recognised"),
    "blenderbot": (0.9, None),
    "blenderbot_small": (0.9, None),
    # the global-local attention reshapes with its input's width: replicated
    "pegasus_x": (0.8, "PegasusXGlobalLocalAttention.forward reshapes its output with the width of its input"),
    "plbart": (0.9, None),
    # the per-layer prompts hold every head's keys and values: the attentions stay replicated
    "mvp": (0.35, "MvpAttention.forward concatenates its argument attn_prompt"),
    "prophetnet": (0.35, "ProphetNetAttention.forward reshapes its output with the width of its input"),
    "fsmt": (0.45, "Attention.forward reshapes its output with the width of its input (embed_dim from query)"),
    "bigbird_pegasus": (0.55, None),
    "t5gemma": (1.0, None),
    "t5gemma2": (0.95, None),
    "camembert": (0.95, None),
    "roformer": (0.9, None),
    # the LM head reads its decoder weight (tied to the token embedding) directly: both replicated
    "mobilebert": (0.4, "MobileBertLMPredictionHead reads self.decoder.weight directly"),
    "megatron_bert": (0.95, None),
    "convbert": (0.1, None),
    "fnet": (0.5, None),
    "squeezebert": (0.2, None),
    "flaubert": (1.0, None),
    "xlm_roberta_xl": (0.95, None),
    "roberta_prelayernorm": (0.95, None),
    "bert_generation": (1.0, None),
    "ibert": (0.0, None),
    "layoutlm": (0.9, None),
    "luke": (0.45, "Linear w2e_query (64, 64) inside the attention is neither q/k/v/o"),
    # the language adapters (64 -> 16 -> 64) are bottlenecks, replicated, and so the FFN beside them
    "xmod": (0.5, "have an MLP's shapes but their outer width 16 is no width an attention reads"),
    "roc_bert": (0.85, None),
    "yoso": (0.95, None),
    "mra": (0.95, None),
    "nomic_bert": (0.95, None),
    "gte": (0.95, None),
    "eurobert": (1.0, None),
    # random blocks drawn per head: the attention stays replicated
    "big_bird_block_sparse": (0.4, "BigBirdBlockSparseAttention draws random numbers in its code"),
}


# By default the plans that leave a part replicated and say why; ``slow`` checks the others' sharded fraction.
PLAN_DEFAULT = [f for f, (_, line) in PLANS.items() if line is not None]


@pytest.mark.parametrize(
    "family", [f if f in PLAN_DEFAULT else pytest.param(f, marks=pytest.mark.slow) for f in E.FAMILIES]
)
def test_plan_shards_what_it_can_and_says_why_not(family):
    from lightning_shard.tp import auto_tp_plan
    from lightning_shard.tp.coverage import tp_coverage

    model = E.build(family)
    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    least, line = PLANS[family]
    cov = tp_coverage(model, plan, summary)
    assert cov.sharded_fraction >= least, (family, cov.describe())
    if line is not None:
        assert any(line in s for s in summary), (family, summary)


# ------------------------------------------------------------------------------------------------ training
# By default: language adapters chosen per row (X-MOD), a bottleneck encoder whose LM head reads its tied weight
# (MobileBERT), an encoder-decoder with separate vocabularies whose attention reshapes with its input's width
# (FSMT); both ways. ``slow`` runs the others.
DEFAULT = ["xmod", "mobilebert", "fsmt"]
MORE = [f for f in E.FAMILIES if f not in DEFAULT]


@distributed(world_size=2)
def test_fsdp_trainer_matches_one_process():
    for family in DEFAULT:
        _compare(family, tp=1)


@distributed(world_size=2)
def test_tp_trainer_matches_one_process():
    for family in DEFAULT:
        _compare(family, tp=2)


@distributed(world_size=2)
def test_fsdp_layers_run_by_their_forward_method_match_one_process():
    """SqueezeBERT's encoder runs ``layer.forward(hidden_states, ...)`` over its layers, which skips every module
    hook, the ones an FSDP unit gathers its parameters in among them: with its layers as the units, the first step
    stopped with the engine's error naming a parameter still sharded. The units are chosen inside those layers."""
    _compare("squeezebert", tp=1)


@pytest.mark.slow  # by default: MVP's plan and its reason line
@distributed(world_size=2)
def test_tp_prompt_keys_made_outside_the_attention_matches_one_process():
    """MVP's per-layer prompts (an embedding and an MLP in each stack) hold every head's keys and values, which
    its attention concatenates to its own. With the heads split, a rank's keys (its heads) met all heads: a shape
    error in the first forward. The attentions stay replicated."""
    _compare("mvp", tp=2)


@pytest.mark.slow  # by default: ProphetNet's plan, and a column-parallel head on a view with gaps (below)
@distributed(world_size=2)
def test_tp_ngram_stream_view_into_the_lm_head_matches_one_process():
    """ProphetNet's attention reshapes with its input's width (left replicated, as FSMT's), and its LM head reads
    the n-gram streams as ``hidden_states[:, T:].view(B, 2, T, -1)``, a view with gaps: made a DTensor with dense
    strides, the head's ``reshape`` took it for a view, which the local tensor refused."""
    _compare("prophetnet", tp=2)


@pytest.mark.slow
@distributed(world_size=2)
def test_fsdp_trainer_more_families_match_one_process():
    for family in MORE:
        _compare(family, tp=1)


@pytest.mark.slow
@distributed(world_size=2)
def test_tp_trainer_more_families_match_one_process():
    for family in MORE:
        _compare(family, tp=2)


@pytest.mark.slow
@distributed(world_size=4)
def test_fsdp2_x_tp2_matches_one_process():
    """FSDP 2 x TP 2 (4 ranks): experts as Linear MLPs (Switch Transformers), gated-GELU T5 (mT5), language
    adapters (X-MOD), the n-gram streams' view (ProphetNet)."""
    for family in ["switch_transformers", "mt5", "xmod", "prophetnet"]:
        _compare(family, tp=2)


class _RouterJitter:
    """``tests/hf_models_encoders_more.py`` with Switch Transformers' router jitter on (0.1: the router's input is
    scaled by uniform noise in training mode), the random stream seeded from each batch before its forward, so the
    draws depend on the batch alone and one process can replay them."""

    inputs, select = staticmethod(E.inputs), staticmethod(E.select)

    @staticmethod
    def build(family: str, seed: int = 0):
        model = E.build(family, seed)
        for m in model.modules():
            if hasattr(m, "jitter_noise"):
                m.jitter_noise = 0.1
        return model

    @staticmethod
    def loss_of(model, batch):
        import torch

        torch.manual_seed(int(batch["input_ids"].sum()))
        return E.loss_of(model, batch)


@pytest.mark.slow
@distributed(world_size=2)
def test_tp_router_jitter_matches_one_process():
    """Under TP the router runs replicated on the all-reduced hidden states: every rank draws the jitter one
    process draws (the same seed), so the experts each rank routes to agree and the result is one process's."""
    _fit_and_compare("switch_transformers", tp=2, models=_RouterJitter)


@distributed(world_size=2)
def test_tp_random_blocks_drawn_per_head_match_one_process():
    """BigBird's block-sparse attention draws each head's random blocks from ``np.random`` seeded per layer. With
    the heads split, every rank drew the first heads' blocks: rank 1's heads attended to other blocks than on one
    device, with no error (1.6e-4 off one process after 3 steps). The attention stays replicated."""
    _compare("big_bird_block_sparse", tp=2)


@distributed(world_size=2)
def test_tp_loss_parallel_with_a_bias_added_to_the_logits_matches_one_process():
    """Marian (as BART, PEGASUS, Blenderbot, PLBart, MVP) adds ``final_logits_bias`` (1, vocab), a plain buffer, to
    its LM head's output in its own forward. Under the strategy's ``loss_parallel=True`` the head returned
    vocabulary-sharded logits, and the addition raised in the first step. Such a head gathers its logits instead
    (the summary says why); the loss is one process's."""
    import tests.test_hf_extra as T
    from strategies import ShardFSDPTPStrategy
    from tests.test_strategy import _trainer

    module = T._lit("marian", "sgd", E)
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    strategy = ShardFSDPTPStrategy(tensor_parallel_size=2, loss_parallel=True)
    _trainer(strategy=strategy, max_steps=T.STEPS).fit(module)
    ref, _ = T._reference("marian", 1, "sgd", E)
    assert max((ref[n] - initial[n]).abs().max().item() for n in ref) > 1e-3
    for n, p in module.model.named_parameters():
        got = T._full(p.detach())
        torch.testing.assert_close(got, ref[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"marian {n}: {m}")


@distributed(world_size=2)
def test_colwise_head_on_a_view_with_gaps_matches_one_process():
    """A column-parallel LM head on a replicated 4-D input that is a view with gaps (a slice, then a view):
    ``F.linear`` reshapes it to 2-D, which must copy, as on one device."""
    import torch

    from lightning_shard import init_device_mesh
    from lightning_shard.tensor import DTensor, Replicate
    from lightning_shard.tp import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    head, ref = torch.nn.Linear(8, 6), None
    ref = torch.nn.Linear(8, 6)
    ref.load_state_dict(head.state_dict())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    parallelize_module(head, mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    x = torch.randn(2, 9, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    streams = x[:, 3:].view(2, 2, 3, 8)  # strides (72, 24, 8, 1): every row skips the first 3 positions
    out = head(streams)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    want = ref(x_ref[:, 3:].view(2, 2, 3, 8))
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(head.weight.grad.full_tensor(), ref.weight.grad)


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
                res = f"{_compare(family, 2 if mode == 'tp' else 1):.1e}"
            except Exception as e:  # noqa: BLE001 - a measurement run reports every family
                res = f"{type(e).__name__}: {str(e)[:600]}"
            if dist.get_rank() == 0:
                cov = _coverage(family, models=E) if mode == "tp" else ""
                line = f"{family} {mode} {cov}: {res} ({time.perf_counter() - start:.1f} s)"
                print(line, file=sys.__stdout__, flush=True)


if __name__ == "__main__":  # python -m tests.test_hf_encoders_more [family ...]: the table in docs/huggingface.md
    import os
    import sys

    from tests.harness import run_distributed, shutdown_pools

    try:
        timeout = float(os.environ.get("MEASURE_TIMEOUT", 3600))
        run_distributed(_measure, 2, sys.argv[1:] or list(E.FAMILIES), timeout=timeout)
    finally:
        shutdown_pools()
