"""Decoder LM families of list A (``tests/hf_models_decoders_more.py``: OLMo 3, Ministral (+3), Qwen3.5 (+MoE),
Kimi Linear, Nemotron-H, Zamba2, Bamba, FalconMamba, xLSTM, MiniMax-M2, GLM-4-MoE-Lite, DeepSeek-V3.2, FlexOlmo,
EXAONE-MoE, Cohere 2 MoE, Granite SWA (+MoE), OLMo hybrid, LFM3, nanochat, CWM, Jais 2, GPT-NeoX-Japanese,
MiMo-V2-Flash, Solar Open, Reformer) under FSDP through the Trainer and under ``auto_tp_plan`` TP 2, each compared
with one process on the same data, with the helpers of ``tests/test_hf_decoders.py``.

The default run checks every family's plan, and trains under FSDP and TP the few families that bring a part the
other decoder tests do not have; ``slow`` trains every family both ways.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shard.tp import auto_tp_plan
from lightning_shard.tp.coverage import tp_coverage
from tests import hf_models
from tests import hf_models_decoders_more as more
from tests.harness import distributed
from tests.test_hf_decoders import _run_tp, assert_plan_replicates_only

pytest.importorskip("transformers")

FAMILIES = more.DECODER_FAMILIES_MORE
# DeepSeek-V3.2: the indexer's parameters get no gradient (one process leaves .grad None); MiMo-V2-Flash: value
# heads narrower than query/key heads, sliding layers with twice the KV heads and per-head sinks; Nemotron-H: a
# Mamba-2, an MoE, an attention and a relu2 MLP block in one model.
FSDP_DEFAULT = ("deepseek_v32",)
TP_DEFAULT = ("mimo_v2_flash", "nemotron_h")

# What auto TP leaves replicated, per family, as the part of a block (after "layers.<i>.") and why.
REPLICATED = {
    "olmo3": ("self_attn",),  # q_norm/k_norm over the whole projection width (as OLMo 2)
    "minimax_m2": ("self_attn", "mlp.gate", "mlp.experts"),  # as OLMo 3; router and fused 3-D experts
    "flex_olmo": ("self_attn", "mlp.gate", "mlp.experts"),
    # gated delta-net (conv over the fused q/k/v, per-head A_log/dt_bias); router, experts, shared expert gate
    "qwen3_5_text": ("linear_attn.",),
    "qwen3_5_moe_text": ("linear_attn.", "mlp.gate", "mlp.experts", "mlp.shared_expert_gate"),
    # Kimi delta attention (per-head gates b_proj, forget gate, short convs); latent attention; MoE
    "kimi_linear": ("self_attn", "mlp.gate", "mlp.experts"),
    "nemotron_h": ("mixer.conv1d", "mixer.gate", "mixer.experts"),  # Mamba-2 conv; router and fused experts
    # the shared block's attention holds per-layer LoRA adapters; its fused gate_up_proj MLP; per-layer Linear
    "zamba2": ("mamba.conv1d", "mamba_decoder.mamba.conv1d", "shared_transformer.", "linear"),
    "bamba": ("mamba.conv1d",),
    "falcon_mamba": ("mixer",),  # the selective scan's own x_proj, dt_proj, A_log (a 2-D parameter) and conv
    # the embedding read as .weight; the mLSTM layer's gates (ogate_preact full width, igate/fgate per head)
    "xlstm": ("embeddings", "mlstm_layer"),
    "glm4_moe_lite": ("self_attn.", "mlp.gate", "mlp.experts"),  # low-rank q and kv; MoE
    "deepseek_v32": ("self_attn.", "mlp.gate", "mlp.experts"),  # as DeepSeek-V3, with the indexer inside
    "exaone_moe": ("mlp.gate", "mlp.experts"),
    "cohere2_moe": ("mlp.gate", "mlp.experts"),
    "granite_swa": ("self_attn",),  # per-head sinks parameter (as gpt-oss)
    "granitemoe_swa": ("self_attn", "block_sparse_moe.", "shared_mlp."),  # sinks; MoE; fused gate/up input_linear
    "olmo_hybrid": ("linear_attn", "self_attn"),  # gated delta-net; width-wide q/k norms
    "lfm3": ("conv.conv", "self_attn"),  # depthwise conv; the per-head output gate g_proj (hidden -> heads)
    "mimo_v2_flash": ("self_attn", "mlp.gate", "mlp.experts"),  # sliding layers' per-head sinks; MoE
    "solar_open": ("mlp.gate", "mlp.experts"),
    # LSH attention (one shared query_key Linear), the FFN (its Linears in sibling modules), the LM head's decoder
    # (reads both reversible streams, 2 x hidden), the axial position tables (parameters read directly)
    "reformer": ("attention.", "feed_forward.", "decoder", "embeddings.position_embeddings"),
}

# Families the generic training runs leave to a test of their own (the plan check still covers them).
OWN_TEST = {
    # at lr 0.5 the tiny LFM3 blows up (loss 4.8 -> 6.0 in 3 steps) and amplifies float32 rounding: one float32
    # process ends 2.1e-3 from a float64 one, TP 2 1.3e-3 from one float32 process (8.4e-4 from float64);
    # test_lfm3_under_tp_matches_one_process trains it at lr 0.05
    "lfm3": ("tp",),
    # the reversible layers' backward recomputes each ReformerLayer (an FSDP unit by default) outside its hooks:
    # test_reformer_reversible_layers_under_fsdp makes the encoder the unit
    "reformer": ("fsdp",),
}


# ------------------------------------------------------------------------------------------------ plans
@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_plan_replicates_only_what_it_cannot_split(family):
    with more.registered():
        assert_plan_replicates_only(family, REPLICATED)


def test_unrecognised_layer_beside_blocks_of_its_class_is_a_block():
    # Reformer's LSH-attention layer (a shared query_key Linear) is a ReformerLayer like the local-attention one
    # the plan recognises. Taken for something outside the blocks, its FFN's first Linear (64 -> 128, the
    # vocabulary's shape here) was planned as an LM head in the middle of the network.
    with more.registered():
        model = hf_models.build("reformer")
    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    assert not [k for k in plan if k.startswith("reformer.encoder.layers.1.")], plan
    assert not [line for line in summary if "LM head," in line], summary
    line = next(s for s in summary if s.startswith("reformer.encoder.layers.1.feed_forward.dense.dense: "))
    assert "inside a block but not part of a recognised attention or MLP" in line, line


# ------------------------------------------------------------------------------------------------ training
def _comparable(families, mode):
    return [f for f in families if mode not in OWN_TEST.get(f, ())]


@distributed(world_size=2)
def test_decoders_auto_tp2_match_one_process():
    with more.registered():
        _run_tp(TP_DEFAULT)


@pytest.mark.slow
@distributed(world_size=2, timeout=1800)
def test_more_decoders_auto_tp2_match_one_process():
    with more.registered():
        _run_tp(_comparable([f for f in FAMILIES if f not in TP_DEFAULT], "tp"))


@distributed(world_size=2)
def test_decoders_under_fsdp_match_one_process():
    from tests.test_hf_fsdp import _run

    with more.registered():
        _run(FSDP_DEFAULT)


@pytest.mark.slow
@distributed(world_size=2, timeout=1800)
def test_more_decoders_under_fsdp_match_one_process():
    from tests.test_hf_fsdp import _run

    with more.registered():
        _run(_comparable([f for f in FAMILIES if f not in FSDP_DEFAULT], "fsdp"))


def _fit_reformer(fsdp_unit, tensor_parallel_size=1):
    with more.registered():
        module = hf_models.lit_hf("reformer")
    _fit_module(module, fsdp_unit, tensor_parallel_size)
    return {n: p.full_tensor() for n, p in module.model.named_parameters()}


def _fit_module(module, fsdp_unit, tensor_parallel_size):
    import lightning as L

    from strategies import ShardFSDPTPStrategy

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardFSDPTPStrategy(fsdp_unit=fsdp_unit, tensor_parallel_size=tensor_parallel_size),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)


@distributed(world_size=2)
def test_reformer_reversible_layers_under_fsdp():
    # The reversible layers run inside an autograd.Function whose backward recomputes each layer by calling
    # ReformerLayer.backward_pass: with the layers as units (the default) their parameters are still sharded
    # there. The error named an activation differing per rank; it must name fully_shard and the unit to choose.
    from transformers.models.reformer.modeling_reformer import ReformerEncoder

    with pytest.raises(RuntimeError, match=r"still sharded by fully_shard.*fsdp_unit=\{ReformerEncoder\}"):
        _fit_reformer("auto")
    # That unit (the module calling the Function) keeps them gathered through its backward: one process's result.
    ours = _fit_reformer({ReformerEncoder})
    with more.registered():
        ref = hf_models.reference_params("reformer", 3)
        initial = dict(hf_models.build("reformer").named_parameters())
    assert max((ref[n] - initial[n]).abs().max().item() for n in ref) > 1e-3  # the steps moved the weights
    assert max((ours[n] - ref[n]).abs().max().item() for n in ref) < 1e-6


@distributed(world_size=2)
def test_reformer_reversible_layers_under_tp():
    # TP 2 through the strategy still wraps every ReformerLayer in an FSDP unit (data parallel 1): in the
    # reversible backward a Linear's TP output hook got a DTensor on the 2-D mesh and failed on a placement count.
    from transformers.models.reformer.modeling_reformer import ReformerEncoder

    with pytest.raises(RuntimeError, match=r"still sharded by fully_shard.*fsdp_unit=\{ReformerEncoder\}"):
        _fit_reformer("auto", tensor_parallel_size=2)
    ours = _fit_reformer({ReformerEncoder}, tensor_parallel_size=2)
    with more.registered():
        ref = hf_models.reference_params("reformer", 3, world=1)  # both ranks train on the same batches
    assert max((ours[n] - ref[n]).abs().max().item() for n in ref) < 1e-6


def _reformer_with_dropout():
    config, model_cls, kwargs = more._DECODERS_MORE["reformer"]
    dropout = {f"{k}_dropout_prob": 0.1 for k in ("hidden", "local_attention_probs", "lsh_attention_probs")}
    more._DECODERS_MORE["reformer"] = (config, model_cls, {**kwargs, **dropout})
    try:
        with more.registered():
            return hf_models.build("reformer")
    finally:
        more._DECODERS_MORE["reformer"] = (config, model_cls, kwargs)


@distributed(world_size=2)
def test_reformer_with_dropout_under_tp_raises_before_replicated_weights_part_ways():
    # Each training forward of a ReformerLayer reseeds the CPU generator from OS entropy (torch.seed()), so within
    # the step the TP ranks draw different dropout masks on replicated activations (the strategy syncs the
    # generators only between steps). Their copies of the replicated weights were 7.7e-2 and 8.2e-2 apart after 3
    # steps with dropout 0.1 in two runs, with no error; with dropout 0 the reseeding is harmless (the test above).
    from transformers.models.reformer.modeling_reformer import ReformerEncoder

    with more.registered():
        module = hf_models.lit_hf("reformer")
    module.model = _reformer_with_dropout()
    with pytest.raises(RuntimeError, match=r"replicated differ across the ranks of a TP group.*torch\.seed\(\)"):
        _fit_module(module, {ReformerEncoder}, tensor_parallel_size=2)


@distributed(world_size=2)
def test_reformer_with_dropout_under_tp_raises_through_fabric():
    import lightning as L
    from transformers.models.reformer.modeling_reformer import ReformerEncoder

    from strategies import ShardFSDPTPFabricStrategy

    model = _reformer_with_dropout()
    strategy = ShardFSDPTPFabricStrategy(tensor_parallel_size=2, fsdp_unit={ReformerEncoder})
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup(model)
    with pytest.raises(RuntimeError, match=r"replicated differ across the ranks of a TP group.*torch\.seed\(\)"):
        fabric.backward(hf_models.lm_loss(model, hf_models.token_batch()))  # no model= named: every set-up one


@distributed(world_size=2)
def test_replicated_gradients_compared_across_tp_ranks():
    # The check behind the two tests above, on plain (replicated) parameters: equal gradients pass, different
    # ones and one present on some ranks only are named, and every rank gets the same answer (one collective of
    # the same size on every rank, whichever gradients exist).
    import torch.distributed as dist

    from lightning_shard.tp.input_check import replicated_gradients_apart

    rank = dist.get_rank()
    group = dist.group.WORLD
    params = {name: torch.nn.Parameter(torch.ones(3)) for name in ("same", "differs", "on_rank_0", "none")}
    params["same"].grad = torch.full((3,), 2.0)
    params["differs"].grad = torch.full((3,), 1.0 + rank)
    params["on_rank_0"].grad = torch.ones(3) if rank == 0 else None
    apart = replicated_gradients_apart(params.items(), group, torch.device("cpu"))
    assert [name for name, _ in apart] == ["on_rank_0", "differs"], apart
    assert apart[0][1] == float("inf") and apart[1][1] == pytest.approx(1 / 2)  # (6 - 3) / 6


@pytest.mark.slow
@distributed(world_size=2)
def test_lfm3_under_tp_matches_one_process():
    import copy

    from lightning_shard import init_device_mesh
    from lightning_shard.tp import parallelize_module
    from tests.test_hf_decoders import _full, _train

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    with more.registered():
        model = hf_models.build("lfm3")
    ref = copy.deepcopy(model)
    ref_losses = _train(ref, lr=0.05)
    parallelize_module(model, tp_mesh, auto_tp_plan(model, tp_mesh))
    losses = _train(model, lr=0.05)
    assert (losses - ref_losses).abs().max() < 1e-5, (losses, ref_losses)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.detach()), ref_params[name].detach(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ measurement
def _measure(families):
    """Every family under FSDP (Trainer) and TP 2 on 2 ranks; rank 0 prints one table row per family (or the
    error)."""
    import sys

    import torch.distributed as dist

    from lightning_shard import init_device_mesh
    from tests.test_hf_decoders import _tp_matches_one_process
    from tests.test_hf_fsdp import _fit_and_compare

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))

    def attempt(fn, family):
        try:
            return f"{fn(family) if fn is _fit_and_compare else fn(family, tp_mesh):.1e}"
        except Exception as e:  # noqa: BLE001 - a measurement: report and go on
            return f"{type(e).__name__}: {str(e)[:300]}"

    with more.registered():
        for family in families:
            skip = OWN_TEST.get(family, ())
            fsdp = "-" if "fsdp" in skip else attempt(_fit_and_compare, family)
            tp = "-" if "tp" in skip else attempt(_tp_matches_one_process, family)
            model = hf_models.build(family)
            plan, summary = auto_tp_plan(model, 2, return_summary=True)
            share = tp_coverage(model, plan, summary).sharded_fraction
            if dist.get_rank() == 0:
                row = f"| {family} | `{type(model).__name__}` | {fsdp} | {tp} | {100 * share:.0f}% |"
                print(row, file=sys.__stdout__, flush=True)


if __name__ == "__main__":  # python -m tests.test_hf_decoders_more [family ...]: the table in docs/huggingface.md
    import sys

    from tests.harness import run_distributed, shutdown_pools

    try:
        run_distributed(_measure, 2, sys.argv[1:] or list(FAMILIES), timeout=3600)
    finally:
        shutdown_pools()
