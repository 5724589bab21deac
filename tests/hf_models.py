"""Tiny random-init Hugging Face models, built from configs (no downloads): test material nobody here wrote.

Every factory returns a model in float32, eval-free (dropout 0), seeded, small enough for 2-4 CPU ranks:
hidden 64, 4 heads (2 KV heads where the family has grouped-query attention), 2 layers, vocabulary 128; the
mixture-of-experts families have 4 experts, 2 per token.

Example::

    model = build("llama")                       # LlamaForCausalLM
    ids = token_batch(batch=2, seq=8)
    loss = lm_loss(model, ids)                    # works for every family in FAMILIES

``FAMILIES`` maps each family to its builder and kind (``"causal"``, ``"masked"`` or ``"seq2seq"``).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
HIDDEN = 64
HEADS = 4
LAYERS = 2
MAX_POS = 64


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POS,
            tie_word_embeddings=False,
        )
    )


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POS,
        )
    )


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POS,
            tie_word_embeddings=True,
        )
    )


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=MAX_POS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            ffn_dim=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=MAX_POS,
            word_embed_proj_dim=HIDDEN,
            dropout=0.0,
            attention_dropout=0.0,
        )
    )


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=MAX_POS,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_kv=HIDDEN // HEADS,
            d_ff=2 * HIDDEN,
            num_layers=LAYERS,
            num_heads=HEADS,
            dropout_rate=0.0,
            tie_word_embeddings=True,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


# ------------------------------------------------------------------------------------------ more decoder LMs
# Each: (config class, causal-LM class, config arguments beyond the shared sizes). The arguments switch on
# what makes the family different from Llama where transformers has it off by default.
_LLAMA_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    max_position_embeddings=MAX_POS,
)
_GQA = dict(num_key_value_heads=2)
_NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
_SMALL_MOE = dict(intermediate_size=HIDDEN, num_experts_per_tok=2)
_DECODERS: dict[str, tuple[str, str, dict]] = {
    # soft-capped attention and final logits, alternating sliding-window layers, tied head
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, sliding_window=4,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16)),
    # per-head q/k RMSNorm (1 + weight), one sliding and one global layer
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, sliding_window=4,
               query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16)),
    # fused qkv_proj and gate_up_proj
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_LLAMA_SIZES, **_GQA, pad_token_id=0, eos_token_id=1)),
    # parallel attention and MLP from one LayerNorm, partial rotary, biases, "dense" output projection
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_LLAMA_SIZES, partial_rotary_factor=0.5, resid_pdrop=0.0,
            embd_pdrop=0.0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_LLAMA_SIZES, rotary_pct=0.5, **_NO_DROPOUT)),
    # fused query_key_value with 2 KV groups, parallel attention/MLP, "mlp_output += attention_output"
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, new_decoder_architecture=True, num_kv_heads=2,
               **_NO_DROPOUT)),
    # ALiBi position bias, fused query_key_value, embedding LayerNorm
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS,
              n_head=HEADS, **_NO_DROPOUT)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
             n_positions=MAX_POS, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
             eos_token_id=1)),
    # per-head q/k RMSNorm
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(_LLAMA_SIZES, **_GQA, eos_token_id=1, pad_token_id=0)),
    # q/k RMSNorm over the whole projection width (across heads)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_LLAMA_SIZES, **_GQA, eos_token_id=1, pad_token_id=0)),
    # one LayerNorm per head, kept in a ModuleList
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(_LLAMA_SIZES, **_GQA, partial_rotary_factor=0.5,
                 qk_layernorm=True)),
    # embedding, residual, attention and logit multipliers
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(_LLAMA_SIZES, **_GQA, embedding_multiplier=2.0,
                residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)),
    # top-2 of 4 experts (fused 3-D expert weights, routing by index/scatter)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_LLAMA_SIZES, **_GQA, **_SMALL_MOE,
                num_local_experts=4)),
    # experts plus a gated shared expert
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32)),
    # LayerNorm q/k norms with a (heads, head_dim) weight, logit scale, parallel attention/MLP, tied head
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(_LLAMA_SIZES, **_GQA, logit_scale=0.5, use_qk_norm=True,
               eos_token_id=1, pad_token_id=0)),
    # multi-head latent attention (low-rank q and kv projections), one dense layer then routed experts
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_LLAMA_SIZES, num_key_value_heads=HEADS,
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                    n_group=1, topk_group=1)),
    # per-head attention sinks (a parameter of the attention module), experts with biases
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(_LLAMA_SIZES, **_GQA, **_SMALL_MOE, head_dim=16,
                num_local_experts=4, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    # xIELU activation with learnable scalars, applied to the MLP's hidden activations; per-head q/k norms
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(_LLAMA_SIZES, **_GQA, eos_token_id=1, pad_token_id=0,
                bos_token_id=0)),
    # RMSNorm on the attention output before o_proj and on the MLP's hidden activations
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", dict(_LLAMA_SIZES, **_GQA, eos_token_id=1, pad_token_id=0,
               bos_token_id=0)),
    # a sigmoid output gate (gate_proj, full width) on the head-split attention output; shared + routed experts
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, num_experts=4,
              num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32, num_dense_layers=1,
              global_attn_every_n_layers=2, sliding_window=4, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # ---- further families (tests/test_hf_decoders.py: plan check and training under `slow`, but Gemma 3n and 4)
    # MoE with q/k RMSNorm over the whole projection width (as OLMo 2) and clipped q/k/v
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, num_experts=4, num_experts_per_tok=2,
              intermediate_size=32, clip_qkv=8.0, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # fused Wqkv with 2 KV heads and clip_qkv, experts in DbrxExperts (transformers 5.24 reads rope_theta from
    # attn_config, which its DbrxAttentionConfig does not define: passed here)
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS,
             max_seq_len=MAX_POS, vocab_size=VOCAB, resid_pdrop=0.0, emb_pdrop=0.0,
             attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
             ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}, eos_token_id=1, pad_token_id=0,
             bos_token_id=0)),
    # mixture of attention heads (routed q/o experts, shared kv_proj) and routed MLP experts
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
               num_hidden_layers=LAYERS, num_key_value_heads=2, kv_channels=16, intermediate_size=32,
               max_position_embeddings=MAX_POS, num_local_experts=4, num_experts_per_tok=2, eos_token_id=1,
               pad_token_id=0, bos_token_id=0)),
    # Granite's multipliers with routed experts; + a shared MLP with a fused gate/up input_linear
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, **_SMALL_MOE,
                   num_local_experts=4, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                   logits_scaling=4.0)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(_LLAMA_SIZES, **_GQA,
                         **_SMALL_MOE, num_local_experts=4, shared_intermediate_size=64, embedding_multiplier=2.0,
                         residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)),
    # a Mamba-2 layer then an attention layer, each with routed + shared experts
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(_LLAMA_SIZES, **_GQA,
                         **_SMALL_MOE, num_local_experts=4, shared_intermediate_size=64,
                         layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
                         mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4,
                         embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                         logits_scaling=4.0, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # latent attention without q LoRA (a plain q_proj beside low-rank kv), shared + routed experts
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_LLAMA_SIZES, num_key_value_heads=HEADS,
                    q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                    first_k_dense_replace=1, n_group=1, topk_group=1)),
    # latent attention (low-rank q and kv) with embedding and depth scaling
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(_LLAMA_SIZES, num_key_value_heads=HEADS,
                 q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                 scale_emb=2.0, dim_model_base=32, scale_depth=1.4, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # two latent attentions and two MLPs per layer, routed experts with "zero" (identity) experts
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
                      num_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                      max_position_embeddings=MAX_POS, ffn_hidden_size=2 * HIDDEN, q_lora_rank=32, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, head_dim=8, moe_topk=2,
                      n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32, eos_token_id=1,
                      pad_token_id=0, bos_token_id=0)),
    # fused gate_up_proj, partial interleaved rotary; GLM-4 adds post-attention/post-MLP norms
    "glm": ("GlmConfig", "GlmForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, eos_token_id=1, pad_token_id=0)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, eos_token_id=1, pad_token_id=0)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                 n_group=1, topk_group=1, use_qk_norm=True, eos_token_id=1, pad_token_id=0)),
    # biases everywhere, LayerNorm, c_fc/c_proj MLP, sliding window
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_LLAMA_SIZES, **_GQA, use_bias=True,
                   sliding_window=4, residual_dropout=0.0, embedding_dropout=0.0, eos_token_id=1, bos_token_id=0)),
    # parallel attention/MLP, logit scale, sliding layer with rotary and a global one without
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(_LLAMA_SIZES, **_GQA, logit_scale=0.5, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"], eos_token_id=1, pad_token_id=0)),
    # per-head q/k norms, post-norms, global NoPE layer
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(_LLAMA_SIZES, **_GQA, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"], eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, eos_token_id=1,
               pad_token_id=0, bos_token_id=0)),
    # a NoPE layer (no rotary) and a rotary one
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(_LLAMA_SIZES, **_GQA, no_rope_layers=[1, 0],
                eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # squared-ReLU up/down MLP (no gate), LayerNorm with 1 + weight, partial rotary
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                 eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # differential attention: two softmax maps per head pair, learnable lambdas, a group norm
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", dict(_LLAMA_SIZES, **_GQA, eos_token_id=1,
                  pad_token_id=0, bos_token_id=0)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, use_bias=True,
                 eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, moe_num_experts=4,
                     moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1,
                     eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # per-head query_layernorm/key_layernorm
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(_LLAMA_SIZES, **_GQA,
                         head_dim=16, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                       num_experts=4, moe_topk=2, intermediate_size=32, eos_token_id=1, pad_token_id=0,
                       bos_token_id=0)),
    # biases on q/k/v and on o_proj (a row-parallel bias, added once)
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, attention_bias=True,
                 attention_out_bias=True, residual_dropout=0.0, attention_dropout=0.0, eos_token_id=1,
                 pad_token_id=0, bos_token_id=0)),
    # squared-ReLU up/down MLP
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(_LLAMA_SIZES, **_GQA, eos_token_id=1, pad_token_id=0,
              bos_token_id=0)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, n_routed_experts=4,
              num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
              topk_group=1, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # chunked attention, a NoPE layer, weightless L2 q/k norm, temperature tuning, top-1 experts + shared expert
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                    intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                    interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=4, use_qk_norm=True,
                    eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                   sliding_window=4, query_pre_attn_scalar=16, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # a gated short-convolution layer (in_proj -> depthwise conv -> out_proj) and an attention layer
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(_LLAMA_SIZES, **_GQA, layer_types=["conv", "full_attention"],
             block_auto_adjust_ff_dim=False, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, moe_intermediate_size=32,
                 num_dense_layers=1, num_experts=4, num_experts_per_tok=2, layer_types=["conv", "full_attention"],
                 eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # dynamic mask attention (dt_proj, per-head A); CDMoE: experts as two nn.Embedding tables beside a dense MLP
    "doge": ("DogeConfig", "DogeForCausalLM", dict(_LLAMA_SIZES, **_GQA, keep_window_size=4, hidden_dropout=0.0,
             is_moe=True, num_experts=16, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # sinusoidal positions, fc1/fc2 on the decoder layer itself
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(vocab_size=VOCAB, d_model=HIDDEN, ffn_dim=2 * HIDDEN,
             num_layers=LAYERS, attention_heads=HEADS, max_position_embeddings=MAX_POS, dropout=0.0,
             attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0)),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", dict(_LLAMA_SIZES, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, activation_dropout=0.0, layerdrop=0.0)),
    # a global and a local (window 4) attention layer, no 1/sqrt(d) scaling
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                num_heads=HEADS, max_position_embeddings=MAX_POS, attention_types=[[["global", "local"], 1]],
                window_size=4, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0, eos_token_id=1,
                bos_token_id=0)),
    # post-LayerNorm, Conv1D fused c_attn
    "openai_gpt": ("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS,
                   n_head=HEADS, n_positions=MAX_POS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # sinusoidal positions added to sqrt(d)-scaled embeddings, attention Linears Wq/Wk/Wv/dense, Sequential FFN
    "ctrl": ("CTRLConfig", "CTRLLMHeadModel", dict(vocab_size=VOCAB, n_embd=HIDDEN, dff=2 * HIDDEN, n_layer=LAYERS,
             n_head=HEADS, n_positions=MAX_POS, resid_pdrop=0.0, embd_pdrop=0.0)),
    # sparsemixer routing, which samples in training mode (not compared with one process, see test_hf_decoders)
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(_LLAMA_SIZES, **_GQA, **_SMALL_MOE, num_local_experts=4,
               sliding_window=4, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # a gated delta-net (linear attention) layer and a gated full-attention layer (q_proj holds query and gate)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16,
                   layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # attention and Mamba-2 side by side in every layer, muP multipliers (embedding, LM head, key, MLP)
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(_LLAMA_SIZES, **_GQA, mamba_d_ssm=64,
                  mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=1, mamba_chunk_size=4, embedding_multiplier=2.0, lm_head_multiplier=0.5,
                  key_multiplier=0.5, mlp_multipliers=[0.5, 2.0], eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # a lightning (linear, per-head decay) attention layer with an output gate, and a softmax layer; experts
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(_LLAMA_SIZES, **_GQA, **_SMALL_MOE, head_dim=16,
                num_local_experts=4, layer_types=["linear_attention", "full_attention"], block_size=4,
                eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # per-layer token embeddings fed through a per-layer bottleneck (per_layer_input_gate 64 -> 16, then
    # per_layer_projection 16 -> 64), AltUp, LAuReL, and activation sparsity (mean + k * std of the gate
    # activations) in layer 0's MLP
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=VOCAB,
                hidden_size_per_layer_input=16, altup_num_inputs=2, laurel_rank=8, num_kv_shared_layers=0,
                activation_sparsity_pattern=[0.95, 0.0], eos_token_id=1, pad_token_id=0, bos_token_id=0)),
    # Gemma 3n's per-layer inputs, v_norm beside q/k norms
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(_LLAMA_SIZES, **_GQA, head_dim=16, sliding_window=4,
               layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=VOCAB,
               hidden_size_per_layer_input=16, num_kv_shared_layers=0, eos_token_id=1, pad_token_id=0,
               bos_token_id=0)),
}  # fmt: skip


def _decoder(family: str):
    import transformers

    config_cls, model_cls, kwargs = _DECODERS[family]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))


#: decoder LM families beyond the first five (tests/test_hf_decoders.py runs them under FSDP and TP).
DECODER_FAMILIES = tuple(_DECODERS)

# family -> (builder, loss kind)
FAMILIES: dict[str, tuple] = {
    "llama": (_llama, "causal"),
    "mistral": (_mistral, "causal"),
    "qwen2": (_qwen2, "causal"),
    "gpt2": (_gpt2, "causal"),
    "opt": (_opt, "causal"),
    "bert": (_bert, "masked"),
    "t5": (_t5, "seq2seq"),
    **{f: (lambda f=f: _decoder(f), "causal") for f in _DECODERS},
}
#: the families this module builds. Other modules add theirs to ``FAMILIES`` (tests/hf_models_decoders_recent.py
#: on import); tests parametrized over this tuple collect the same cases whatever pytest imported before them.
OWN_FAMILIES = tuple(FAMILIES)


def build(family: str, seed: int = 0) -> nn.Module:
    """A tiny random-init model of ``family`` (a key of ``FAMILIES``), float32, seeded.

    Example: ``build("t5")`` -> a 2-layer ``T5ForConditionalGeneration`` with tied embeddings.
    """
    builder, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = builder()
    model.config.use_cache = False
    return model.float()


def token_batch(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    """Token ids ``(batch, seq)`` in ``[0, VOCAB)``, the same on every rank for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own training loss on ``ids`` used as labels: next-token loss for causal LMs, masked-LM
    loss over every position for BERT, decoder loss for T5 (the ids are also the encoder input).

    Example: ``lm_loss(build("gpt2"), token_batch())`` -> a scalar tensor.
    """
    return model(input_ids=ids, labels=ids).loss


# ------------------------------------------------------------------------------------------------ Trainer runs
def token_dataset(n: int = 32, seq: int = 8, seed: int = 1):
    """``n`` rows of token ids (a TensorDataset), the same on every rank."""
    from torch.utils.data import TensorDataset

    return TensorDataset(token_batch(n, seq, seed))


def lit_hf(family: str, lr: float = 0.1, per_rank_batch: int = 2, save_dir: str | None = None, **save_kwargs):
    """A LightningModule training ``build(family)`` with ``lm_loss`` and SGD (momentum 0.9) on ``token_dataset``;
    with ``save_dir``, ``on_train_end`` writes the model with ``save_hf_pretrained(..., **save_kwargs)``.

    Example: ``Trainer(strategy="shard_fsdp_tp", max_steps=3).fit(lit_hf("t5"))``.
    """
    import lightning as L
    from torch.utils.data import DataLoader

    class LitHF(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(family)

        def training_step(self, batch, batch_idx):
            loss = lm_loss(self.model, batch[0])
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(token_dataset(), batch_size=per_rank_batch, shuffle=False)

        def on_train_end(self):
            if save_dir is not None:
                from lightning_shard.checkpoint import save_hf_pretrained

                save_hf_pretrained(self.model, save_dir, **save_kwargs)  # every rank; rank 0 writes

    return LitHF()


def reference_params(
    family: str,
    steps: int,
    world: int = 2,
    lr: float = 0.1,
    per_rank_batch: int = 2,
    initial: dict[str, torch.Tensor] | None = None,
):
    """One process, the same global batches as ``world`` data-parallel ranks of ``lit_hf(family)`` see under
    Lightning's DistributedSampler: ``{fqn: tensor}`` after ``steps`` SGD steps (from the parameter values
    ``initial`` when given, else from ``build(family)``'s)."""
    from tests.lightning_models import sampler_batches

    model = build(family)
    if initial is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(initial[name])
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = token_dataset()
    n = len(data)
    for idx in sampler_batches(world, per_rank_batch, n=n)[:steps]:
        opt.zero_grad()
        lm_loss(model, data[idx][0]).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}
