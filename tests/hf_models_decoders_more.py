"""More tiny random-init Hugging Face decoder LMs (list A): test material nobody here wrote, built from configs.

The families of ``transformers``' causal-LM mapping that ``tests/hf_models.py`` does not build, most-used first:
OLMo 3, Ministral (+3), Qwen3.5 (+MoE, text), Kimi Linear, Nemotron-H, Zamba2, Bamba, FalconMamba, xLSTM,
MiniMax-M2, GLM-4-MoE-Lite, DeepSeek-V3.2, FlexOlmo, EXAONE-MoE, Cohere 2 MoE, Granite SWA (+MoE), OLMo hybrid,
LFM3, nanochat, CWM, Jais 2, GPT-NeoX-Japanese, MiMo-V2-Flash, Solar Open and Reformer. Same sizes as
``tests/hf_models.py`` (hidden 64, 4 heads, 2 KV heads, 2 layers where the family allows, vocabulary 128; 4 experts,
2 per token), each with what makes it differ from Llama switched on in its config.

Inside ``registered()`` the families are in ``hf_models.FAMILIES``, so ``hf_models.build``, ``lit_hf`` and
``reference_params`` (and the helpers of tests/test_hf_decoders.py built on them) take these names as well.
They are added only there, not on import: tests/test_hf_save.py and tests/test_hf_tp.py parametrize over
``hf_models.FAMILIES`` when pytest collects them, after this module.

Example::

    from tests import hf_models, hf_models_decoders_more as more

    with more.registered():
        model = hf_models.build("olmo3")        # Olmo3ForCausalLM
    loss = hf_models.lm_loss(model, hf_models.token_batch())
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tests import hf_models
from tests.hf_models import _GQA, _LLAMA_SIZES, HEADS, HIDDEN, LAYERS, MAX_POS, VOCAB

_IDS = dict(eos_token_id=1, pad_token_id=0, bos_token_id=0)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_ALTERNATING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])

# Each: (config class, causal-LM class, config arguments). As in ``hf_models._DECODERS``.
_DECODERS_MORE: dict[str, tuple[str, str, dict]] = {
    # OLMo 2's q/k RMSNorm over the whole projection width, with sliding-window layers
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(_LLAMA_SIZES, **_GQA, **_ALTERNATING, **_IDS)),
    # Mistral with a sliding and a full layer
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                  **_ALTERNATING, **_IDS)),
    # yarn rotary and Llama 4's position-dependent query scale (from position 4 on at this size)
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                    "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}, **_IDS)),
    # a gated delta-net (linear attention) layer and a gated full-attention layer (q_proj holds query and gate)
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                     layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_conv_kernel_dim=4, **_IDS)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                         layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4, num_experts=4, shared_expert_intermediate_size=32, **_MOE,
                         **_IDS)),
    # Kimi delta attention (per-head forget gate A_log, short convs) beside latent attention; dense then MoE
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(_LLAMA_SIZES, num_key_value_heads=HEADS,
                    layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                    num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
                    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                    linear_head_dim=16, linear_num_heads=HEADS, linear_conv_kernel_dim=4, **_IDS)),
    # one block each: Mamba-2, MoE (relu2 experts + shared), attention, relu2 MLP
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
                   layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                   num_attention_heads=HEADS, **_GQA, head_dim=16, max_position_embeddings=MAX_POS,
                   intermediate_size=2 * HIDDEN, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
                   ssm_state_size=8, chunk_size=4, use_mamba_kernels=False, n_routed_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                   **_IDS)),
    # Mamba-2 layers plus one shared attention+MLP block (with per-layer LoRA adapters) fed [h, embeddings]
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
               max_position_embeddings=MAX_POS, num_hidden_layers=3,
               layers_block_type=["linear_attention", "hybrid", "hybrid"],
               mamba_d_state=8, n_mamba_heads=4, num_attention_heads=HEADS, num_key_value_heads=HEADS,
               intermediate_size=2 * HIDDEN, chunk_size=4, use_mamba_kernels=False,
               use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True, **_IDS)),
    # a Mamba-2 layer then an attention layer (partial rotary)
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(_LLAMA_SIZES, **_GQA, attn_layer_indices=[1], mamba_n_heads=4,
              mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=4, **_IDS)),
    # Mamba with weightless RMS norms on B, C and dt (slow path: plain torch)
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
                     state_size=8, num_hidden_layers=LAYERS, expand=2, conv_kernel=4, use_mambapy=False,
                     use_associative_scan=False, **_IDS)),
    # mLSTM blocks (matrix memory, exponential gates, per-head norm), chunkwise native kernels in train mode
    "xlstm": ("xLSTMConfig", "xLSTMForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN, embedding_dim=HIDDEN,
              num_hidden_layers=LAYERS, num_blocks=LAYERS, num_heads=HEADS, mode="train", chunk_size=4,
              ffn_round_up_to_multiple_of=16, autocast_kernel_dtype="float32", **_IDS)),
    # q/k RMSNorm over the whole projection width, experts
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                   intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **_IDS)),
    # latent attention (low-rank q and kv), a dense layer then shared + routed experts
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(_LLAMA_SIZES, num_key_value_heads=HEADS,
                      mlp_layer_types=["dense", "sparse"], n_routed_experts=4, n_shared_experts=1, q_lora_rank=32,
                      kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **_MOE, **_IDS)),
    # DeepSeek-V3's latent attention with the sparse indexer choosing 4 keys per query (of 8)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(_LLAMA_SIZES, num_key_value_heads=HEADS,
                     n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                     mlp_layer_types=["dense", "sparse"], q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                     qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1, index_topk=4, index_head_dim=16,
                     index_n_heads=2, **_MOE, **_IDS)),
    # OLMo 2's width-wide q/k norms with experts
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(_LLAMA_SIZES, **_GQA, intermediate_size=32,
                  num_experts=4, num_experts_per_tok=2, **_IDS)),
    # EXAONE 4's per-head norms and sliding layers, a dense layer then shared + routed experts
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, **_ALTERNATING,
                   mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1, num_experts=4,
                   num_shared_experts=1, **_MOE, **_IDS)),
    # Cohere 2's parallel attention/MLP and logit scale, experts plus a shared expert averaged in
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, intermediate_size=32,
                    logit_scale=0.5,
                    **_ALTERNATING, num_experts=4, num_experts_per_tok=2, num_shared_experts=1, **_IDS)),
    # Granite's multipliers, a per-head attention sinks parameter, sliding layers
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(_LLAMA_SIZES, **_GQA, sliding_window=4,
                    layer_types=["full_attention", "sliding_attention"], embedding_multiplier=2.0,
                    residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0, **_IDS)),
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(_LLAMA_SIZES, **_GQA,
                       intermediate_size=HIDDEN, num_local_experts=4, num_experts_per_tok=2,
                       shared_intermediate_size=64, sliding_window=4,
                       layer_types=["full_attention", "sliding_attention"], embedding_multiplier=2.0,
                       residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0, **_IDS)),
    # a gated delta-net layer (negative eigenvalues allowed) and an OLMo attention layer
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(_LLAMA_SIZES, **_GQA,
                    layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, **_IDS)),
    # a short-conv layer, a sliding and a full attention layer with a per-head output gate, sandwich norms
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, num_hidden_layers=3,
             layer_types=["conv", "sliding_attention", "full_attention"], sliding_window=4, conv_L_cache=3,
             **_IDS)),
    # weightless RMS norms (q/k after rotary too), relu2 fc1/fc2 MLP, final logit soft-capping
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", dict(_LLAMA_SIZES, num_key_value_heads=HEADS, **_IDS)),
    # llama3 rotary scaling, a full and a sliding layer
    "cwm": ("CwmConfig", "CwmForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, sliding_window=4,
            layer_types=["full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0, "high_freq_factor": 4.0,
                             "low_freq_factor": 1.0, "original_max_position_embeddings": 4}, **_IDS)),
    # LayerNorm, biases, relu2 up/down MLP
    "jais2": ("Jais2Config", "Jais2ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, **_IDS)),
    # fused query_key_value, the output projection's bias a separate parameter (dense_bias) added in the layer
    "gpt_neox_japanese": ("GPTNeoXJapaneseConfig", "GPTNeoXJapaneseForCausalLM", dict(vocab_size=VOCAB,
                          hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          intermediate_multiple_size=2, max_position_embeddings=MAX_POS, attention_dropout=0.0,
                          hidden_dropout=0.0, **_IDS)),
    # per-head attention sinks and twice the KV heads in sliding layers, value head 8 (query/key 16), value scale
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                      v_head_dim=8, sliding_window=4, layer_types=["full_attention", "sliding_attention"],
                      mlp_layer_types=["dense", "sparse"], n_routed_experts=4, **_MOE, **_IDS)),
    # shared + routed experts in every layer
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                   n_routed_experts=4, n_shared_experts=1, **_MOE, **_IDS)),
    # local and LSH attention (hashing with a fixed seed), reversible layers, axial positions (2 x 4 = seq 8)
    "reformer": ("ReformerConfig", "ReformerModelWithLMHead", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
                 attention_head_size=HIDDEN // HEADS, num_attention_heads=HEADS, attn_layers=["local", "lsh"],
                 feed_forward_size=2 * HIDDEN, axial_pos_shape=[2, 4], axial_pos_embds_dim=[16, 48],
                 max_position_embeddings=8, local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=2,
                 hash_seed=0, is_decoder=True, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
                 lsh_attention_probs_dropout_prob=0.0, **_IDS)),
}  # fmt: skip


def _decoder(family: str):
    import transformers

    config_cls, model_cls, kwargs = _DECODERS_MORE[family]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    _trained_routing_bias(model)
    return model


def _trained_routing_bias(model) -> None:
    """DeepSeek-V3-style routers add a bias buffer (``e_score_correction_bias``, balanced during pre-training,
    not by gradients) to the scores they pick experts by; transformers initialises it to zeros, which would leave
    it out of the comparison. Give it values like a trained model's (seeded from the model's own parameters'
    stream: ``build`` seeds before building), large enough to change which experts are picked."""
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape) * 0.1)


#: the families of this module, most-used first (tests/test_hf_decoders_more.py runs them).
DECODER_FAMILIES_MORE = tuple(_DECODERS_MORE)


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """``hf_models.FAMILIES`` with this module's families added, removed again on exit."""
    added = {f: (lambda f=f: _decoder(f), "causal") for f in _DECODERS_MORE if f not in hf_models.FAMILIES}
    hf_models.FAMILIES.update(added)
    try:
        yield
    finally:
        for f in added:
            hf_models.FAMILIES.pop(f, None)
