"""Tiny random-init Hugging Face decoder LMs of the families added in transformers 5.24 that
``tests/hf_models.py``'s ``DECODER_FAMILIES`` does not build (list B): test material nobody here wrote.

Each family is built as ``tests/hf_models.py`` builds its decoders (hidden 64, 4 heads, 2 KV heads where the family
has grouped-query attention, 2 layers, vocabulary 128, float32, seeded, dropout 0; mixture-of-experts families with
4 experts, 2 per token), with what makes the family differ from Llama switched on in its config. Importing this
module registers the families in ``hf_models.FAMILIES``, so ``hf_models.build``, ``lit_hf`` and
``reference_params`` (and through them ``tests.test_hf_fsdp._fit_and_compare``) build them by name.

Example::

    from tests import hf_models, hf_models_decoders_recent
    model = hf_models.build("dory")            # DoryForCausalLM: one recurrent layer looped twice
    loss = hf_models.lm_loss(model, hf_models.token_batch())
"""

from __future__ import annotations

from tests import hf_models
from tests.hf_models import HEADS, HIDDEN, LAYERS, MAX_POS, VOCAB

_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POS,
    head_dim=HIDDEN // HEADS,
)
_TOKENS = dict(eos_token_id=1, pad_token_id=0, bos_token_id=0)
_TWO_LAYERS = ["sliding_attention", "full_attention"]
# latent attention (DeepSeek-V3 style): low-rank q and kv projections
_MLA = dict(
    num_key_value_heads=HEADS,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    head_dim=8,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (config class, causal-LM class, config arguments)
DECODERS: dict[str, tuple[str, str, dict]] = {
    # xIELU activation with learnable scalars on the MLP's hidden activations, per-head q/k norms
    "apertus1p5_text": ("Apertus1p5TextConfig", "Apertus1p5TextForCausalLM", dict(_SIZES, **_TOKENS,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # routed experts plus shared experts (the text tower of a vision-language model)
    "aria_text": ("AriaTextConfig", "AriaTextForCausalLM", dict(_SIZES, **_TOKENS, moe_num_experts=4, moe_topk=2,
                  moe_num_shared_experts=1, intermediate_size=32)),
    # latent attention (low-rank q and kv, interleaved rotary), one dense layer then routed + shared experts
    "axk1": ("AXK1Config", "AXK1ForCausalLM", dict(_SIZES, **_TOKENS, **_MLA, **_MOE, n_routed_experts=4,
             n_shared_experts=1, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"])),
    # AXK1's parts plus a sparse indexer (top-4 keys per query) and a low-rank gated norm on the attention output
    "axk2": ("AXK2Config", "AXK2ForCausalLM", dict(_SIZES, **_TOKENS, **_MLA, **_MOE, n_routed_experts=4,
             n_shared_experts=1, mlp_layer_types=["dense", "sparse"], index_topk=4, index_head_dim=16,
             index_n_heads=2, gated_norm_rank=8, layer_types=["indexed_attention"] * LAYERS)),
    # a Kimi-delta linear attention layer (short convolutions, forget gate, gated norm) and a latent attention
    # layer; a dense layer then routed + shared experts
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(_SIZES, **_TOKENS, **_MLA,
                       moe_intermediate_size=32, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
                       num_expert_group=1, topk_group=1, first_k_dense_replace=1, linear_head_dim=16,
                       linear_num_heads=4, layer_types=["linear_attention", "full_attention"],
                       mlp_layer_types=["dense", "sparse"], num_nextn_predict_layers=0)),
    # byte latent transformer: a small entropy model sets the patch boundaries, a local encoder with hashed byte
    # n-gram embeddings, cross-attention between bytes and patches, a global transformer over patches
    "blt": ("BltConfig", "BltForCausalLM", dict(vocab_size=VOCAB, max_position_embeddings=MAX_POS, patch_size=2,
            patching_threshold=1.0, local_attention_window_len=8, cross_attn_k=2, encoder_hash_byte_group_size=[2, 3],
            encoder_hash_byte_group_vocab=97, **_TOKENS,
            patcher_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=MAX_POS, sliding_window=8),
            encoder_config=dict(vocab_size=VOCAB, hidden_size=32, hidden_size_global=HIDDEN, num_attention_heads=2,
                                num_hidden_layers=1, intermediate_size=64, max_position_embeddings=MAX_POS,
                                sliding_window=8, cross_attn_k=2),
            decoder_config=dict(vocab_size=VOCAB, hidden_size=32, hidden_size_global=HIDDEN, num_attention_heads=2,
                                num_hidden_layers=2, intermediate_size=64, max_position_embeddings=MAX_POS,
                                cross_attn_k=2),
            global_config=dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
                               num_hidden_layers=LAYERS, intermediate_size=2 * HIDDEN,
                               max_position_embeddings=MAX_POS))),
    # per-layer rotary tables (sliding and full layers, registered in the order of a set of layer types: per process,
    # with the string hash seed), logit scale, parallel attention/MLP, tied head
    "cohere_compass_text": ("CohereCompassTextConfig", "CohereCompassForCausalLM", dict(_SIZES, **_TOKENS,
                            sliding_window=4, layer_types=_TWO_LAYERS, logit_scale=0.5,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
    # relative position buckets, segment and prompt embeddings, attention and FFN under their own names
    "cpmant": ("CpmAntConfig", "CpmAntForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
               num_attention_heads=HEADS, dim_head=HIDDEN // HEADS, dim_ff=2 * HIDDEN, num_hidden_layers=LAYERS,
               position_bias_num_buckets=32, position_bias_max_distance=64, prompt_types=4, prompt_length=4,
               segment_types=4, init_std=0.02)),
    # hyper-connections (2 residual streams mixed by Sinkhorn iterations), compressed attention with a sparse
    # indexer and a grouped low-rank output, one key/value head, a hash-routed MoE layer then score-routed ones
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(_SIZES, **_TOKENS, num_key_value_heads=1,
                    q_lora_rank=32, **_MOE, intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                    num_hidden_layers=3,
                    layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention"], compress_rates={"compressed_sparse_attention": 2,
                    "heavily_compressed_attention": 4}, hc_mult=2, hc_sinkhorn_iters=3,
                    mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=4, o_groups=2, o_lora_rank=16,
                    index_n_heads=2, index_head_dim=16, index_topk=2, num_nextn_predict_layers=0,
                    qk_rope_head_dim=8)),
    # one recurrent layer looped twice between an input and an output layer (the same FSDP unit runs twice per
    # step); nGPT-style per-channel scales sqk/s_gate in the attention and suv_gate/suv_up in the MLP, L2 norms
    "dory": ("DoryConfig", "DoryForCausalLM", dict(_SIZES, **_TOKENS, num_hidden_layers=3, n_input_layers=1,
             n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2, sliding_window=4,
             layer_types=["full_attention", "sliding_attention", "full_attention"])),
    # latent attention with a sparse indexer and an output gate, a sliding-window layer, shared + routed experts
    "dots3_note_text": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM", dict(_SIZES, **_TOKENS, **_MOE,
                        **dict(_MLA, head_dim=16), n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
                        shared_experts_intermediate_size=32, mlp_layer_types=["dense", "sparse"], index_topk=4,
                        index_head_dim=16, index_n_heads=2, sliding_window=4,
                        layer_types=["indexed_attention", "sliding_attention"], per_layer_config={})),
    # per-head attention sinks, sliding and full layers, a dense layer then routed + shared experts
    "flint": ("FlintConfig", "FlintForCausalLM", dict(_SIZES, **_TOKENS, **_MOE, num_experts=4,
              shared_expert_intermediate_size=32, mlp_only_layers=[0], sliding_window=4, layer_types=_TWO_LAYERS)),
    # KV-shared layers (layers 2 and 3 read layers 0 and 1's keys/values: q_proj and o_proj only), a full layer
    # with attention_k_eq_v (keys serve as values, no v_proj) and head_dim 32 beside 16, double-wide MLPs
    "gemma4_unified_text": ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", dict(_SIZES, **_TOKENS,
                            num_hidden_layers=4, sliding_window=4, layer_types=_TWO_LAYERS * 2, global_head_dim=32,
                            num_global_key_value_heads=2, attention_k_eq_v=True, num_kv_shared_layers=2,
                            use_double_wide_mlp=True)),
    # latent attention with DeepSeek sparse attention's indexer, a dense layer then routed + shared experts
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(_SIZES, **_TOKENS, **_MLA, **_MOE,
                    n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                    mlp_layer_types=["dense", "sparse"], index_topk=4, index_head_dim=16, index_n_heads=2,
                    layer_types=["indexed_attention"] * LAYERS, indexer_types=["full"] * LAYERS)),
    # hierarchical reasoning: an L stack and an H stack (one layer each) run in cycles, 2 x (2 + 1) calls per
    # step, the first of each pair of L calls without gradient (num_hidden_layers 1 is per stack)
    "hrm_text": ("HrmTextConfig", "HrmTextForCausalLM", dict(_SIZES, **_TOKENS, num_hidden_layers=1, H_cycles=2,
                 L_cycles=2, L_bp_cycles=[1])),
    # a dense layer then routed + shared experts with a scaled router
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM", dict(_SIZES, **_TOKENS, **_MOE, num_experts=4, num_shared_experts=1,
              mlp_layer_types=["dense", "sparse"])),
    # hyper-connections, latent attention with learnable sinks, an output gate and a sparse indexer (the second
    # layer reuses the first's top-k), routed + shared experts
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", dict(_SIZES, **_TOKENS, **_MLA, **_MOE, n_routed_experts=4,
              n_shared_experts=1, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"], index_topk=4,
              index_head_dim=16, index_n_heads=2, layer_types=["indexed_attention"] * LAYERS,
              indexer_types=["full", "shared"])),
    # embedding, residual, attention and logit multipliers; post-norms after attention and MLP
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", dict(_SIZES, **_TOKENS, embedding_multiplier=2.0,
                    logits_scaling=0.5, residual_multiplier=0.5, attention_multiplier=0.2, use_post_norm=True)),
    # relative position logits (r_proj), short convolutions after attention and MLP, sliding and full layers,
    # routed + shared experts
    "inkling_text": ("InklingTextConfig", "InklingForCausalLM", dict(_SIZES, **_TOKENS, swa_num_attention_heads=HEADS,
                     swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=4, d_rel=8, rel_extent=16,
                     layer_types=["hybrid", "hybrid_sliding"], mlp_layer_types=["sparse"] * LAYERS, **_MOE,
                     n_routed_experts=4, n_shared_experts=1)),
    # q/k/v/o as modules of their own (short convolutions on k and v, a gated o), relative position bias, sinks,
    # soft-capped MLP and logits, routed experts
    "inkling2_text": ("Inkling2TextConfig", "Inkling2ForCausalLM", dict(_SIZES, **_TOKENS,
                      swa_num_attention_heads=HEADS, swa_num_key_value_heads=2, swa_head_dim=16,
                      sliding_window_size=4, d_rel=8, rel_extent=16, layer_types=["hybrid", "hybrid_sliding"],
                      **_MOE, n_routed_experts=4, unpadded_vocab_size=VOCAB, n_layers_per_attn_res_block=1)),
    # sliding and full layers, routed + shared experts
    "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM", dict(_SIZES, **_TOKENS, **_MOE, num_local_experts=4,
                 shared_expert_intermediate_size=32, sliding_window=4, layer_types=_TWO_LAYERS)),
    # a per-head output gate (g_proj), a different head count per layer (4, then 8), routed + shared experts
    "laguna": ("LagunaConfig", "LagunaForCausalLM", dict(_SIZES, **_TOKENS, **_MOE, num_experts=4,
               shared_expert_intermediate_size=32, sliding_window=4, layer_types=_TWO_LAYERS,
               num_attention_heads_per_layer=[HEADS, 2 * HEADS], mlp_layer_types=["dense", "sparse"])),
    # a gated delta-net (linear attention) layer and a sliding-window attention layer, routed + shared experts
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", dict(_SIZES, **_TOKENS, **_MOE, num_experts=4,
                  shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, sliding_window=4,
                  layer_types=["linear_attention", "sliding_attention"])),
    # sliding and full layers, routed experts in every layer
    "mellum": ("MellumConfig", "MellumForCausalLM", dict(_SIZES, **_TOKENS, **_MOE, num_local_experts=4,
               sliding_window=4, layer_types=_TWO_LAYERS, mlp_layer_types=["sparse"] * LAYERS)),
    # ModernBERT's blocks as a causal LM: GLU MLP with one fused Wi, global and local layers, prediction head
    "modernbert-decoder": ("ModernBertDecoderConfig", "ModernBertDecoderForCausalLM", dict(vocab_size=VOCAB,
                           hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, max_position_embeddings=MAX_POS, local_attention=4,
                           sliding_window=2, layer_types=["full_attention", "sliding_attention"], **_TOKENS,
                           cls_token_id=2, sep_token_id=1)),
    # hyper-connections, a gated delta-net layer with per-layer n-gram embeddings, an attention layer with a
    # sparse indexer, routed + shared experts
    "qwen4_exp_text": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", dict(_SIZES, **_TOKENS, **_MOE, num_experts=4,
                       shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       layer_types=["linear_attention", "indexed_attention"], hc_count=2, hc_lowrank=8,
                       ple_layer_ids=[1], ple_embed_dim=16, ngram_size=2, heads_per_ngram=2, ngram_vocab_size_base=97,
                       make_ngram_vocab_size_divisible_by=8, split_ngram_parts=1, indexer_n_heads=2,
                       indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2)),
    # latent attention (low-rank q and kv) in a dense model, tied head
    "youtu": ("YoutuConfig", "YoutuForCausalLM", dict(_SIZES, **_TOKENS, **_MLA)),
    # compressed convolutional attention (q/k convolutions, current and delayed values, learned temperatures),
    # residual scaling, an MLP router choosing one of 4 experts or none
    "zaya": ("ZayaConfig", "ZayaForCausalLM", dict(_SIZES, **_TOKENS, moe_intermediate_size=32, num_experts=4,
             num_experts_per_tok=1, router_hidden_size=16)),
}  # fmt: skip


def _decoder(family: str):
    import transformers

    config_cls, model_cls, kwargs = DECODERS[family]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))


#: the list-B decoder families this module builds (tests/test_hf_decoders_recent.py runs them)
RECENT_DECODER_FAMILIES = tuple(DECODERS)

# Variants for one targeted test each, built by name like the families but not in RECENT_DECODER_FAMILIES.
# Two query heads and two key/value heads: one key/value head per rank under TP 2, the shape with which a
# replicated KV-shared layer broadcast its rank's one head over both query heads instead of failing.
DECODERS["gemma4_unified_text_2_heads"] = (
    DECODERS["gemma4_unified_text"][0],
    DECODERS["gemma4_unified_text"][1],
    dict(DECODERS["gemma4_unified_text"][2], num_attention_heads=2, num_key_value_heads=2, head_dim=32,
         global_head_dim=32),
)  # fmt: skip


def _kv_shared(family: str) -> tuple[str, str, dict]:
    """``tests/hf_models.py``'s Gemma 3n or Gemma 4 with its last two of four layers KV-shared (there
    ``num_kv_shared_layers=0``)."""
    config_cls, model_cls, kwargs = hf_models._DECODERS[family]
    kwargs = dict(kwargs, num_hidden_layers=4, layer_types=kwargs["layer_types"] * 2, num_kv_shared_layers=2)
    if "activation_sparsity_pattern" in kwargs:
        kwargs["activation_sparsity_pattern"] = kwargs["activation_sparsity_pattern"] * 2
    return config_cls, model_cls, kwargs


DECODERS["gemma3n_kv_shared"] = _kv_shared("gemma3n")
DECODERS["gemma4_kv_shared"] = _kv_shared("gemma4")

hf_models.FAMILIES.update({f: (lambda f=f: _decoder(f), "causal") for f in DECODERS})
