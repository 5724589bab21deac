"""auto_tp_plan on the reference models: the plan's styles and the printed summary (no processes needed:
the plan only needs the TP size)."""

from __future__ import annotations

import pytest

from lightning_shard.tensor import Replicate, Shard
from lightning_shard.tp import (
    ColwiseParallel,
    DivideAttributes,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    auto_tp_plan,
)
from tests import tp_models


def _plan(model, tp=2, **kw):
    plan, summary = auto_tp_plan(model, tp, return_summary=True, **kw)
    print("\n".join(summary))
    return plan, summary


def _has(summary, *lines):
    for line in lines:
        assert line in summary, (line, summary)


def test_llama_plan_and_summary():
    plan, summary = _plan(tp_models.Llama(), sequence_parallel=True, loss_parallel=True)
    _has(
        summary,
        "sequence_parallel: on (sequence dim 1)",
        "layers.0.attention: attention, heads 4, kv heads 2 split over tp 2; divides n_heads, n_kv_heads by 2",
        "layers.1.attention.k_proj: ColwiseParallel",
        "layers.0.attention.o_proj: RowwiseParallel",
        "layers.0.feed_forward.gate_proj: ColwiseParallel",
        "layers.0.feed_forward.up_proj: ColwiseParallel",
        "layers.0.feed_forward.down_proj: RowwiseParallel",
        "layers.0.attention_norm: SequenceParallel",
        "norm: SequenceParallel",
    )
    assert any(s.startswith("output: ColwiseParallel (LM head, 101 classes") for s in summary)
    prep, divide = plan["layers.0.attention"]
    assert isinstance(prep, PrepareModuleInput) and prep.input_layouts == (Shard(1),)
    assert isinstance(divide, DivideAttributes) and divide.names == ("n_heads", "n_kv_heads")
    head = plan["output"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert plan["layers.1.feed_forward.down_proj"].output_layouts == (Shard(1),)
    assert plan["tok_embeddings"].output_layouts == (Shard(-2),)
    # Without sequence parallel: no norm styles, replicated outputs; the attention and MLP inputs are still
    # prepared once per module (Replicate -> Replicate), so q/k/v share one input gradient reduction.
    plan, summary = _plan(tp_models.Llama())
    assert not any(isinstance(v, SequenceParallel) for v in plan.values())
    prep, divide = plan["layers.0.attention"]
    assert isinstance(prep, PrepareModuleInput) and prep.input_layouts == (Replicate(),)
    assert prep.desired_input_layouts == (Replicate(),) and isinstance(divide, DivideAttributes)
    assert isinstance(plan["layers.0.feed_forward"], PrepareModuleInput)
    assert plan["output"].output_layouts == (Replicate(),) and plan["output"].use_local_output


def test_gqa_heads_not_divisible_are_reported():
    _, summary = _plan(tp_models.Llama(dim=48, n_heads=6, n_kv_heads=2), tp=4)
    _has(summary, "layers.0.attention: heads 6, kv heads 2 not divisible by tp 4, left replicated")
    plan, summary = _plan(tp_models.Llama(dim=48, n_heads=4, n_kv_heads=1, hidden=64), tp=2)
    _has(summary, "layers.0.attention: heads 4, kv heads 1 not divisible by tp 2, left replicated")
    assert "layers.0.attention.q_proj" not in plan and "layers.0.feed_forward.up_proj" in plan
    _, summary = _plan(tp_models.Llama(dim=48, n_heads=4, n_kv_heads=1, hidden=64), tp=2, sequence_parallel=True)
    _has(summary, "sequence_parallel: off (block layers.0 has no sharded attention submodule)")


def test_gpt2_fused_qkv_and_tied_head():
    plan, summary = _plan(tp_models.GPT2(), sequence_parallel=True)
    _has(
        summary,
        "transformer.wte: RowwiseParallel (vocab-parallel embedding, 101 rows; output reduce-scattered to the "
        "sequence dim)",
        "transformer.h.0.mlp.c_fc: ColwiseParallel",
        "transformer.h.0.mlp.c_proj: RowwiseParallel",
        "transformer.h.0.attn.c_proj: RowwiseParallel(input_layouts=Replicate())",
        "transformer.ln_f: SequenceParallel",
    )
    assert any("fused qkv" in s and s.startswith("transformer.h.1.attn.c_attn: ColwiseParallel") for s in summary)
    assert any("weight tied to transformer.wte (both Shard(0)" in s for s in summary)
    assert plan["transformer.h.0.attn.c_attn"].output_layouts == (Replicate(),)
    assert isinstance(plan["transformer.wte"], RowwiseParallel)


def test_demo_transformer_multihead_attention_left_replicated():
    plan, summary = _plan(tp_models.demo_transformer(), sequence_parallel=True)
    _has(
        summary,
        "sequence_parallel: off (nn.MultiheadAttention at transformer.encoder.layers.0.self_attn needs a "
        "replicated input)",
        "transformer.encoder.layers.0.linear1: ColwiseParallel",
        "transformer.decoder.layers.0.linear2: RowwiseParallel",
        "embedding: RowwiseParallel (vocab-parallel embedding, 101 rows; output all-reduced)",
    )
    assert any(
        s.startswith("transformer.decoder.layers.0.multihead_attn: nn.MultiheadAttention left replicated")
        for s in summary
    )
    assert not any(k.endswith("out_proj") or "self_attn" in k for k in plan)
    assert isinstance(plan["decoder"], ColwiseParallel)


def test_bert_classifier_gathers_before_pooling():
    plan, summary = _plan(tp_models.Bert(), sequence_parallel=True)
    _has(
        summary,
        "layers.0.attention: attention, heads 4 split over tp 2; divides num_attention_heads, hidden_size by 2",
        "embedding_norm: SequenceParallel",
        "layers.1.output_norm: SequenceParallel",
        "layers.1: output gathered from the sequence dim (no LM head follows)",
    )
    assert any(s.startswith("classifier: Linear 32 -> 3") and s.endswith("left replicated") for s in summary)
    assert isinstance(plan["layers.1"], PrepareModuleOutput)
    assert "classifier" not in plan and "pooler" not in plan


def test_sequence_parallel_auto_on_where_blocks_allow_it():
    for model in (tp_models.Llama(), tp_models.GPT2()):
        plan_auto, summary_auto = _plan(model, sequence_parallel="auto")
        plan_on, summary_on = _plan(model, sequence_parallel=True)
        assert summary_auto[0] == "sequence_parallel: on (sequence dim 1)", summary_auto[:2]
        assert {k: repr(v) for k, v in plan_auto.items()} == {k: repr(v) for k, v in plan_on.items()}
    # Structural reasons turn it off exactly as for True (never an error).
    _, summary = _plan(tp_models.demo_transformer(), sequence_parallel="auto")
    assert summary[0].startswith("sequence_parallel: off (nn.MultiheadAttention"), summary[0]


def test_sequence_parallel_auto_off_for_a_position_table_outside_the_blocks():
    _, summary = _plan(tp_models.LlamaWithPositionTable(), sequence_parallel="auto")
    assert summary[0] == (
        "sequence_parallel: off (parameter pos (16, 32) outside the blocks may be indexed by position, which "
        "sequence parallel would shard; pass sequence_parallel=True if it is not)"
    ), summary[0]
    _, summary = _plan(
        tp_models.LlamaWithPositionTable(), sequence_parallel=True
    )  # an explicit True is the user's call
    assert summary[0] == "sequence_parallel: on (sequence dim 1)", summary[0]


def test_sequence_parallel_rejects_other_values():
    with pytest.raises(ValueError, match="sequence_parallel='yes' must be True, False or 'auto'"):
        auto_tp_plan(tp_models.Llama(), 2, sequence_parallel="yes")


def test_mlp_with_a_reducing_activation_module_is_left_replicated():
    # An activation module without parameters that reduces over the hidden dim (here: centring each row) would
    # see only this rank's hidden columns once the MLP is split; the plan names it and keeps the MLP whole.
    import torch
    from torch import nn

    class Centred(nn.Module):
        def forward(self, x):
            return torch.relu(x - x.mean(-1, keepdim=True))

    class Mlp(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.up_proj, self.down_proj, self.act = nn.Linear(8, 32), nn.Linear(32, 8), act

        def forward(self, x):
            return self.down_proj(self.act(self.up_proj(x)))

    class Net(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.layers = nn.ModuleList([Mlp(act) for _ in range(2)])

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    plan, summary = _plan(Net(Centred()))
    assert not plan, plan
    line = "layers.0: Mlp's child Centred reduces over a dim in its code (mean): over the split hidden activations"
    _has(summary, f"{line} each rank would use its own shard's values, left replicated")
    plan, _ = _plan(Net(nn.GELU()))
    assert isinstance(plan["layers.0.up_proj"], ColwiseParallel) and isinstance(
        plan["layers.0.down_proj"], RowwiseParallel
    )
