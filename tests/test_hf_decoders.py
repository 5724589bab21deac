"""Decoder LM families beyond Llama/Mistral/Qwen2/GPT-2/OPT (``hf_models.DECODER_FAMILIES``: Gemma 1-3, Phi,
Phi-3, GPT-NeoX, Falcon, BLOOM, GPT-J, Qwen3, OLMo 1-2, StableLM, Granite, Mixtral, Qwen2-MoE, Qwen3-MoE, Cohere,
DeepSeek-V3, gpt-oss, Apertus, BitNet, AFMoE) under FSDP through the Trainer and under ``auto_tp_plan`` TP, each
compared with one process on the same data (tiny random-init configs, no downloads).

What TP must not do on these is train wrong without an error: a replicated parameter that sees only this rank's
heads (Qwen3's per-head ``q_norm``) gets a partial gradient; a per-head ``ModuleList`` of norms (StableLM) pairs
rank 1's heads with heads 0-1's norms; Apertus' learnable activation scalars see half the MLP's hidden units.
The plan either handles such a part or leaves its attention or MLP replicated.

The default run covers Gemma 2, Mixtral, BLOOM and Phi-3 under FSDP and those plus Qwen3, StableLM, Falcon,
DeepSeek-V3 and Apertus under TP; ``slow`` runs every family both ways and FSDP 2 x TP 2 on five.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from lightning_shard import init_device_mesh
from lightning_shard.tensor import DTensor, fallback_counts, reset_fallback_counts
from lightning_shard.tp import SequenceParallel, auto_tp_plan, parallelize_module
from lightning_shard.tp.coverage import tp_coverage
from tests import hf_models
from tests.harness import distributed

pytest.importorskip("transformers")

FSDP_DEFAULT = ("gemma2", "mixtral", "bloom", "phi3")
TP_DEFAULT = (*FSDP_DEFAULT, "qwen3", "stablelm", "falcon", "deepseek_v3", "apertus")
STEPS = 3

# What auto TP leaves replicated, per family, as the part of a block (after "layers.<i>.") and why.
REPLICATED = {
    "phi3": ("mlp.",),  # fused gate_up_proj: one Linear d -> 2*d_h, not an up/down pair of matching shapes
    "olmo2": ("self_attn",),  # q_norm/k_norm normalise over the whole projection width, across heads
    "stablelm": ("self_attn",),  # a ModuleList of one LayerNorm per head, indexed by head position
    "cohere": ("self_attn",),  # q_norm weight (heads, head_dim)
    "gpt_oss": ("self_attn", "mlp.router", "mlp.experts"),  # per-head sinks parameter; fused 3-D experts
    # low-rank q/kv projections (no q/k/v projections to split by heads); router and fused 3-D experts
    "deepseek_v3": ("self_attn.", "mlp.gate", "mlp.experts"),
    "mixtral": ("mlp.gate", "mlp.experts"),  # router and fused 3-D expert weights
    "qwen2_moe": ("mlp.gate", "mlp.experts", "mlp.shared_expert_gate"),
    "qwen3_moe": ("mlp.gate", "mlp.experts"),
    "apertus": ("mlp",),  # xIELU's learnable alpha_p/alpha_n act on the (split) hidden activations
    "bitnet": ("self_attn", "mlp"),  # attn_sub_norm over the whole attention width, ffn_sub_norm over the hidden
    "afmoe": ("self_attn", "mlp.router", "mlp.experts"),  # the output gate gate_proj; router and fused experts
}


# ------------------------------------------------------------------------------------------------ plans
@pytest.mark.parametrize("family", hf_models.DECODER_FAMILIES)
def test_decoder_plan_replicates_only_what_it_cannot_split(family):
    model = hf_models.build(family)
    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    cov = tp_coverage(model, plan, summary)
    parts = [fqn.split(".layers.", 1)[-1].split(".", 1)[-1] for fqn, _, _ in cov.replicated]
    unexpected = [p for p in parts if not p.startswith(REPLICATED.get(family, ()))]
    assert not unexpected, (family, cov.describe())
    if family not in REPLICATED:
        assert cov.sharded_fraction == 1.0, (family, cov.describe())


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_per_head_qk_norms_keep_replicated_parameters_with_summed_gradient(family):
    model = hf_models.build(family)
    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    for name in ("q_norm", "k_norm"):
        fqn = f"model.layers.1.self_attn.{name}"
        assert isinstance(plan[fqn], SequenceParallel), plan.get(fqn)
        assert f"{fqn}: per-head norm, parameters replicated, gradient summed over tp" in summary
    assert "model.layers.1.self_attn: attention, heads 4, kv heads 2 split over tp 2" in summary[4:], summary


@pytest.mark.parametrize(
    "family, why",
    [
        ("olmo2", "q_norm (weight (64,))"),
        ("stablelm", "q_layernorm (norms.0.weight (16,)"),
        ("cohere", "q_norm (weight (4, 16))"),
        ("gpt_oss", "sinks (4,)"),
        ("afmoe", "Linear gate_proj (64, 64) inside the attention is neither q/k/v/o nor part of an MLP"),
    ],
)
def test_attention_with_other_inner_parameters_is_left_replicated(family, why):
    model = hf_models.build(family)
    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    attn = "model.layers.0.self_attn"
    assert not [k for k in plan if k.startswith(attn)], plan
    line = next(s for s in summary if s.startswith(f"{attn}: "))
    assert why in line and line.endswith("left replicated"), line


@pytest.mark.parametrize(
    "family, why", [("apertus", "mlp.act_fn.alpha_p (1,)"), ("bitnet", "mlp.ffn_sub_norm.weight (128,)")]
)
def test_mlp_with_parameters_on_its_hidden_activations_is_left_replicated(family, why):
    # Split over TP, xIELU's scalar alpha_p would get each rank's half of its gradient: silently wrong.
    model = hf_models.build(family)
    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    assert not [k for k in plan if ".mlp" in k], plan
    line = next(s for s in summary if s.startswith("model.layers.0.mlp: "))
    assert why in line and line.endswith("left replicated"), line


def test_low_rank_attention_is_not_taken_for_an_mlp():
    # DeepSeek's q_a_proj (64 -> 32) feeds q_b_proj (32 -> 64): by shape alone a down/up pair, the reverse
    # of an MLP; planned as one, q_a_proj's row-parallel input would not be what the module hands it.
    model = hf_models.build("deepseek_v3")
    plan = auto_tp_plan(model, 2)
    assert not [k for k in plan if ".self_attn" in k], plan
    assert "model.layers.1.mlp.experts" not in plan and "model.layers.0.mlp.down_proj" in plan


# ------------------------------------------------------------------------------------------------ training
def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for i in range(steps):
        loss = hf_models.lm_loss(model, hf_models.token_batch(batch=2, seq=8, seed=10 + i))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_full(loss).detach())
    return torch.stack(losses)


def _tp_matches_one_process(family, tp_mesh, dp_mesh=None):
    model = hf_models.build(family)
    ref = copy.deepcopy(model)
    ref_losses = _train(ref)
    parallelize_module(model, tp_mesh, auto_tp_plan(model, tp_mesh))
    if dp_mesh is not None:
        from lightning_shard.fsdp import fully_shard
        from lightning_shard.fsdp.units import find_repeated_blocks

        for block in find_repeated_blocks(model):
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    reset_fallback_counts()
    losses = _train(model)
    assert fallback_counts() == {}, (family, fallback_counts())
    assert (losses - ref_losses).abs().max() < 1e-5, (family, losses, ref_losses)
    ref_params = dict(ref.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(ref_params), family
    worst = 0.0
    for name, p in model.named_parameters():
        # lr 0.5 moves some weights by ~1: a relative tolerance, far below what a wrong gradient gives (>1e-3)
        torch.testing.assert_close(_full(p.detach()), ref_params[name].detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{family} {n}: {m}")  # fmt: skip
        worst = max(worst, (_full(p.detach()) - ref_params[name].detach()).abs().max().item())
    return worst


def _run_tp(families, world=2):
    if world == 4:
        root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        tp_mesh, dp_mesh = root["tensor_parallel"], root["data_parallel"]
    else:
        tp_mesh, dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",)), None
    for family in families:
        start = time.perf_counter()
        _tp_matches_one_process(family, tp_mesh, dp_mesh)
        print(f"{family}: TP matches one process ({time.perf_counter() - start:.1f} s)")


@distributed(world_size=2)
def test_decoders_auto_tp2_match_one_process():
    _run_tp(TP_DEFAULT)


@pytest.mark.slow
@distributed(world_size=2)
def test_more_decoders_auto_tp2_match_one_process():
    _run_tp([f for f in hf_models.DECODER_FAMILIES if f not in TP_DEFAULT])


@pytest.mark.slow
@distributed(world_size=4)
def test_decoders_fsdp2_x_tp2_match_one_process():
    # Every data-parallel rank sees the same batches, so the averaged gradients equal one process's.
    _run_tp(["qwen3", "gemma3", "mixtral", "falcon", "deepseek_v3"], world=4)


@distributed(world_size=2)
def test_decoders_under_fsdp_match_one_process():
    from tests.test_hf_fsdp import _run

    _run(FSDP_DEFAULT)


@pytest.mark.slow
@distributed(world_size=2)
def test_more_decoders_under_fsdp_match_one_process():
    from tests.test_hf_fsdp import _run

    _run([f for f in hf_models.DECODER_FAMILIES if f not in FSDP_DEFAULT])


# ------------------------------------------------------------------------------------------------ measurement
def _measure(families):
    """Every family under FSDP (Trainer) and TP 2 on 2 ranks; rank 0 prints one table row per family."""
    import sys

    import torch.distributed as dist

    from tests.test_hf_fsdp import _fit_and_compare

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    for family in families:
        fsdp = _fit_and_compare(family)
        tp = _tp_matches_one_process(family, tp_mesh)
        model = hf_models.build(family)
        plan, summary = auto_tp_plan(model, 2, return_summary=True)
        share = tp_coverage(model, plan, summary).sharded_fraction
        if dist.get_rank() == 0:
            row = f"| {family} | `{type(model).__name__}` | {fsdp:.1e} | {tp:.1e} | {100 * share:.0f}% |"
            print(row, file=sys.__stdout__, flush=True)


if __name__ == "__main__":  # python -m tests.test_hf_decoders: the table in docs/huggingface.md
    from tests.harness import run_distributed, shutdown_pools

    try:
        run_distributed(_measure, 2, list(hf_models.DECODER_FAMILIES), timeout=3600)
    finally:
        shutdown_pools()
