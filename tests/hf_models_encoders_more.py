"""More tiny random-init Hugging Face encoder and encoder-decoder families: T5 variants (mT5, UMT5, LongT5,
Switch Transformers, T5Gemma, T5Gemma 2), BART-like translation and dialogue models, ProphetNet, FSMT, PEGASUS-X,
BigBird-PEGASUS, MVP, and BERT-like masked LMs with rotary, bottleneck, convolutional, Fourier, hashing,
multi-resolution, entity, layout and language-adapter parts.

Test material nobody here wrote, built from configs (no downloads), float32, seeded, 2 layers (per stack),
hidden 64 (4 heads), vocabulary 128, dropout 0, with what makes each family different switched on. The model
computes its own training loss from the inputs (``labels`` included), so one loop trains them all; the
interface is ``tests/hf_models_extra.py``'s, so ``tests/test_hf_extra.py``'s Trainer helpers take this module.

Example::

    model = build("switch_transformers")          # 4 experts, router z-loss and auxiliary loss in the loss
    batch = inputs("switch_transformers", rows=4)  # {"input_ids": ..., "labels": ...}
    loss = model(**batch).loss

``FAMILIES`` maps each family to ``(builder, input kind)``.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.hf_models import HEADS, HIDDEN, LAYERS, MAX_POS, VOCAB
from tests.hf_models_extra import _bert_sizes, _hf

SEQ = 8


# ------------------------------------------------------------------------------------------ T5 variants
def _t5_sizes(**kw) -> dict:
    return dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=LAYERS,
                num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
                relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0, **kw)  # fmt: skip


def _mt5():
    # gated-GELU FFN (wi_0, wi_1, wo), LM head untied from the shared embedding
    return _hf("MT5Config", "MT5ForConditionalGeneration", **_t5_sizes(feed_forward_proj="gated-gelu",
               tie_word_embeddings=False))  # fmt: skip


def _umt5():
    # a relative attention bias table in every layer (T5 has one in the first layer only)
    return _hf("UMT5Config", "UMT5ForConditionalGeneration", **_t5_sizes(feed_forward_proj="gated-gelu"))


def _longt5():
    # transient-global attention: local windows of radius 2 plus per-block global tokens (block 4)
    return _hf("LongT5Config", "LongT5ForConditionalGeneration", **_t5_sizes(encoder_attention_type="transient-global",
               local_radius=2, global_block_size=4))  # fmt: skip


def _switch_transformers():
    # top-1 routed experts in every second layer; the router's z-loss and auxiliary loss join the LM loss.
    # No router jitter: it draws from the random stream, so it is not a function of the batch.
    cfg = _t5_sizes(num_experts=4, expert_capacity=16, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                    router_jitter_noise=0.0, router_z_loss_coef=0.01, router_aux_loss_coef=0.01)  # fmt: skip
    cfg["num_layers"] = cfg["num_decoder_layers"] = 2
    model = _hf("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", **cfg)
    model.config.output_router_logits = True
    return model


def _t5gemma_stack(**kw) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POS,
                sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                final_logit_softcapping=30.0, attn_logit_softcapping=50.0, pad_token_id=0, eos_token_id=1,
                bos_token_id=2, **kw)  # fmt: skip


def _t5gemma():
    # Gemma 2 blocks as encoder and decoder: GQA, sliding/full layers, soft-capping, tied embeddings
    from transformers import T5GemmaConfig, T5GemmaForConditionalGeneration, T5GemmaModuleConfig

    cfg = T5GemmaConfig(encoder=T5GemmaModuleConfig(**_t5gemma_stack()),
                        decoder=T5GemmaModuleConfig(**_t5gemma_stack()), vocab_size=VOCAB, dropout_rate=0.0,
                        attention_dropout=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                        decoder_start_token_id=2)  # fmt: skip
    return T5GemmaForConditionalGeneration(cfg)


def _t5gemma2():
    # Gemma 3 blocks; the decoder merges self- and cross-attention into one attention; a SigLIP tower (unused
    # without images)
    from transformers import (
        SiglipVisionConfig,
        T5Gemma2Config,
        T5Gemma2DecoderConfig,
        T5Gemma2EncoderConfig,
        T5Gemma2ForConditionalGeneration,
        T5Gemma2TextConfig,
    )

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)  # fmt: skip
    enc = T5Gemma2EncoderConfig(text_config=T5Gemma2TextConfig(**_t5gemma_stack()), vision_config=vision,
                                mm_tokens_per_image=4)  # fmt: skip
    cfg = T5Gemma2Config(encoder=enc, decoder=T5Gemma2DecoderConfig(**_t5gemma_stack()), dropout_rate=0.0,
                         attention_dropout=0.0, image_token_index=VOCAB - 1, eoi_token_index=VOCAB - 2,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=2)  # fmt: skip
    return T5Gemma2ForConditionalGeneration(cfg)


# ------------------------------------------------------------------------------------------ BART-like seq2seq
def _bart_sizes(**kw) -> dict:
    return dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN,
                decoder_ffn_dim=2 * HIDDEN, max_position_embeddings=MAX_POS, dropout=0.0, attention_dropout=0.0,
                activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=0,
                bos_token_id=2, eos_token_id=1, decoder_start_token_id=2, **kw)  # fmt: skip


def _marian():
    # sinusoidal positions (a frozen table), scaled embeddings, shared encoder/decoder/LM-head embedding
    return _hf("MarianConfig", "MarianMTModel", **_bart_sizes(decoder_vocab_size=VOCAB, scale_embedding=True,
               share_encoder_decoder_embeddings=True))  # fmt: skip


def _m2m_100():
    # sinusoidal positions computed in forward (a buffer that grows), pre-LN layers
    return _hf("M2M100Config", "M2M100ForConditionalGeneration", **_bart_sizes(scale_embedding=True))


def _nllb_moe():
    # top-2 experts in every second layer with capacity, router z-loss and auxiliary loss in the loss
    model = _hf("NllbMoeConfig", "NllbMoeForConditionalGeneration", **_bart_sizes(num_experts=4, expert_capacity=16,
                encoder_sparse_step=2, decoder_sparse_step=2, router_z_loss_coef=0.01, router_aux_loss_coef=0.01,
                moe_token_dropout=0.0, output_router_logits=True))  # fmt: skip
    return model


def _blenderbot():
    return _hf("BlenderbotConfig", "BlenderbotForConditionalGeneration", **_bart_sizes())


def _blenderbot_small():
    return _hf("BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration", **_bart_sizes())


def _pegasus_x():
    # block-local encoder attention (block 4, staggered) with 2 global tokens
    return _hf("PegasusXConfig", "PegasusXForConditionalGeneration", **_bart_sizes(block_size=4, num_global_tokens=2,
               stagger_local_blocks=True))  # fmt: skip


def _plbart():
    return _hf("PLBartConfig", "PLBartForConditionalGeneration", **_bart_sizes())


def _mvp():
    # lightweight prompt tuning: per-layer prompt encoders (an embedding and an MLP) prepended as keys/values
    return _hf("MvpConfig", "MvpForConditionalGeneration", **_bart_sizes(use_prompt=True, prompt_length=4,
               prompt_mid_dim=32))  # fmt: skip


def _bigbird_pegasus():
    # full attention at this length (block-sparse needs a longer sequence)
    return _hf("BigBirdPegasusConfig", "BigBirdPegasusForConditionalGeneration", **_bart_sizes(
               attention_type="original_full"))  # fmt: skip


def _prophetnet():
    # n-gram (2) predicting decoder with main and predict streams, relative position buckets
    return _hf("ProphetNetConfig", "ProphetNetForConditionalGeneration", vocab_size=VOCAB, hidden_size=HIDDEN,
               encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN, num_encoder_layers=LAYERS,
               num_decoder_layers=LAYERS, num_encoder_attention_heads=HEADS, num_decoder_attention_heads=HEADS,
               max_position_embeddings=MAX_POS, ngram=2, num_buckets=8, relative_max_distance=16, dropout=0.0,
               attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=2, eos_token_id=1,
               decoder_start_token_id=2)  # fmt: skip


def _fsmt():
    # separate source and target vocabularies, untied output projection
    return _hf("FSMTConfig", "FSMTForConditionalGeneration", langs=["en", "de"], src_vocab_size=VOCAB,
               tgt_vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
               encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN,
               decoder_ffn_dim=2 * HIDDEN, max_position_embeddings=MAX_POS, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, pad_token_id=0, bos_token_id=2, eos_token_id=1, decoder_start_token_id=2,
               tie_word_embeddings=False)  # fmt: skip


# ------------------------------------------------------------------------------------------ masked LMs
def _roformer():
    # rotary positions in a BERT encoder, embedding size 32 projected up
    return _hf("RoFormerConfig", "RoFormerForMaskedLM", **_bert_sizes(embedding_size=32), pad_token_id=0)


def _megatron_bert():
    # pre-LN layers, a final LayerNorm
    return _hf("MegatronBertConfig", "MegatronBertForMaskedLM", **_bert_sizes(), pad_token_id=0)


def _mobilebert():
    # bottlenecks in and out of every layer (intra 32), shared key/query bottleneck, 2 stacked FFNs per layer,
    # NoNorm (an element-wise affine), trigram input embedding of size 16
    return _hf("MobileBertConfig", "MobileBertForMaskedLM", **_bert_sizes(embedding_size=16, intra_bottleneck_size=32,
               use_bottleneck_attention=False, key_query_shared_bottleneck=True, num_feedforward_networks=2,
               normalization_type="no_norm", trigram_input=True), pad_token_id=0)  # fmt: skip


def _convbert():
    # half the heads are span-based dynamic convolutions (head_ratio 2), grouped FFN Linears (2 groups)
    return _hf("ConvBertConfig", "ConvBertForMaskedLM", **_bert_sizes(embedding_size=32, head_ratio=2,
               conv_kernel_size=3, num_groups=2), pad_token_id=0)  # fmt: skip


def _fnet():
    # Fourier-transform token mixing instead of attention
    cfg = _bert_sizes()
    del cfg["num_attention_heads"], cfg["attention_probs_dropout_prob"]
    return _hf("FNetConfig", "FNetForMaskedLM", **cfg, use_tpu_fourier_optimizations=False, pad_token_id=0)


def _squeezebert():
    # grouped 1x1 convolutions for q/k/v and the FFN
    return _hf("SqueezeBertConfig", "SqueezeBertForMaskedLM", **_bert_sizes(embedding_size=HIDDEN, q_groups=2,
               k_groups=2, v_groups=2, post_attention_groups=2, intermediate_groups=2, output_groups=2),
               pad_token_id=0)  # fmt: skip


def _camembert():
    return _hf("CamembertConfig", "CamembertForMaskedLM", **_bert_sizes(), pad_token_id=1)


def _flaubert():
    # XLM encoder: language embeddings (langs per token), sinusoidal positions (a frozen table). Its pre-LN
    # path indexes the cache object per layer and fails in transformers 5.24, so post-LN.
    return _hf("FlaubertConfig", "FlaubertWithLMHeadModel", vocab_size=VOCAB, emb_dim=HIDDEN, n_layers=LAYERS,
               n_heads=HEADS, dropout=0.0, attention_dropout=0.0, max_position_embeddings=MAX_POS, n_langs=2,
               use_lang_emb=True, pre_norm=False, sinusoidal_embeddings=True, layerdrop=0.0, pad_index=0,
               pad_token_id=0)  # fmt: skip


def _xlm_roberta_xl():
    # pre-LN RoBERTa
    return _hf("XLMRobertaXLConfig", "XLMRobertaXLForMaskedLM", **_bert_sizes(), pad_token_id=1)


def _roberta_prelayernorm():
    return _hf("RobertaPreLayerNormConfig", "RobertaPreLayerNormForMaskedLM", **_bert_sizes(), pad_token_id=1)


def _bert_generation():
    # BERT as a causal decoder (no token types, no pooler)
    return _hf("BertGenerationConfig", "BertGenerationDecoder", **_bert_sizes(), is_decoder=True, pad_token_id=0)


def _ibert():
    # integer-only BERT's modules in float mode (QuantLinear, IntGELU, IntSoftmax, IntLayerNorm wrappers)
    return _hf("IBertConfig", "IBertForMaskedLM", **_bert_sizes(), quant_mode=False, pad_token_id=1)


def _layoutlm():
    # 2-D position embeddings of word boxes (x, y, height, width) added to the token embeddings
    return _hf("LayoutLMConfig", "LayoutLMForMaskedLM", **_bert_sizes(), max_2d_position_embeddings=64,
               pad_token_id=0)  # fmt: skip


def _luke():
    # entity embeddings (size 32, projected) and entity-aware attention; only words are given here
    return _hf("LukeConfig", "LukeForMaskedLM", **_bert_sizes(), entity_vocab_size=16, entity_emb_size=32,
               use_entity_aware_attention=True, pad_token_id=1)  # fmt: skip


def _xmod():
    # per-language bottleneck adapters (reduction 4) after every FFN, chosen by lang_ids
    return _hf("XmodConfig", "XmodForMaskedLM", **_bert_sizes(), languages=["en_XX", "de_DE"],
               default_language="en_XX", adapter_reduction_factor=4, pre_norm=False, adapter_layer_norm=False,
               adapter_reuse_layer_norm=True, ln_before_adapter=True, pad_token_id=1)  # fmt: skip


def _roc_bert():
    # pronunciation and shape embeddings concatenated with the token embedding and projected
    return _hf("RoCBertConfig", "RoCBertForMaskedLM", **_bert_sizes(), enable_pronunciation=True, enable_shape=True,
               pronunciation_embed_dim=16, pronunciation_vocab_size=32, shape_embed_dim=16, shape_vocab_size=32,
               concat_input=True, pad_token_id=0)  # fmt: skip


def _yoso():
    # LSH (hashing) attention: the expectation path in plain torch
    return _hf("YosoConfig", "YosoForMaskedLM", **_bert_sizes(), use_expectation=True, hash_code_len=4, num_hash=2,
               conv_window=None, use_fast_hash=False, lsh_backward=True, pad_token_id=1)  # fmt: skip


def _mra():
    # multi-resolution block attention
    return _hf("MraConfig", "MraForMaskedLM", **_bert_sizes(), block_per_row=2, approx_mode="full",
               initial_prior_first_n_blocks=0, initial_prior_diagonal_n_blocks=0, pad_token_id=1)  # fmt: skip


def _nomic_bert():
    # rotary, fused Wqkv, SwiGLU MLP
    return _hf("NomicBertConfig", "NomicBertForMaskedLM", **_bert_sizes(), pad_token_id=0)


def _gte():
    # rotary, fused qkv, gated MLP (up_gate_proj)
    return _hf("GteConfig", "GteForMaskedLM", **_bert_sizes(), pad_token_id=0)


def _big_bird_block_sparse():
    # block-sparse attention: blocks of 2 tokens, 1 random block per row drawn for each head from np.random seeded
    # per layer; it needs (5 + 2 * random blocks) * block size < the sequence length (16 tokens here)
    return _hf("BigBirdConfig", "BigBirdForMaskedLM", **_bert_sizes(attention_type="block_sparse", block_size=2,
               num_random_blocks=1), pad_token_id=0)  # fmt: skip


def _eurobert():
    # a Llama-style bidirectional encoder: GQA, RMSNorm, SwiGLU MLP, rotary
    return _hf("EuroBertConfig", "EuroBertForMaskedLM", vocab_size=VOCAB, hidden_size=HIDDEN,
               intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=2, max_position_embeddings=MAX_POS, pad_token_id=0, bos_token_id=2,
               eos_token_id=1, mask_token_id=3)  # fmt: skip


# family -> (builder, input kind), most-used first within each kind
FAMILIES: dict[str, tuple] = {
    "mt5": (_mt5, "seq2seq"),
    "marian": (_marian, "seq2seq"),
    "m2m_100": (_m2m_100, "seq2seq"),
    "umt5": (_umt5, "seq2seq"),
    "longt5": (_longt5, "seq2seq"),
    "switch_transformers": (_switch_transformers, "seq2seq"),
    "nllb_moe": (_nllb_moe, "seq2seq"),
    "blenderbot": (_blenderbot, "seq2seq"),
    "blenderbot_small": (_blenderbot_small, "seq2seq"),
    "pegasus_x": (_pegasus_x, "seq2seq"),
    "plbart": (_plbart, "seq2seq"),
    "mvp": (_mvp, "seq2seq"),
    "prophetnet": (_prophetnet, "seq2seq"),
    "fsmt": (_fsmt, "seq2seq"),
    "bigbird_pegasus": (_bigbird_pegasus, "seq2seq"),
    "t5gemma": (_t5gemma, "seq2seq"),
    "t5gemma2": (_t5gemma2, "seq2seq"),
    "camembert": (_camembert, "masked"),
    "roformer": (_roformer, "masked"),
    "mobilebert": (_mobilebert, "masked"),
    "megatron_bert": (_megatron_bert, "masked"),
    "convbert": (_convbert, "masked"),
    "fnet": (_fnet, "masked"),
    "squeezebert": (_squeezebert, "masked"),
    "flaubert": (_flaubert, "langs"),
    "xlm_roberta_xl": (_xlm_roberta_xl, "masked"),
    "roberta_prelayernorm": (_roberta_prelayernorm, "masked"),
    "bert_generation": (_bert_generation, "causal"),
    "ibert": (_ibert, "masked"),
    "layoutlm": (_layoutlm, "layout"),
    "luke": (_luke, "masked"),
    "xmod": (_xmod, "lang"),
    "roc_bert": (_roc_bert, "roc"),
    "yoso": (_yoso, "masked"),
    "mra": (_mra, "masked"),
    "nomic_bert": (_nomic_bert, "masked"),
    "gte": (_gte, "masked"),
    "eurobert": (_eurobert, "masked"),
    "big_bird_block_sparse": (_big_bird_block_sparse, "masked"),
}
SEQ_OF = {"big_bird_block_sparse": 16}  # families that need longer rows than SEQ


def build(family: str, seed: int = 0) -> nn.Module:
    """A tiny random-init model of ``family`` (a key of ``FAMILIES``), float32, seeded, in train mode.

    Example: ``build("mt5")`` -> a 2 + 2 layer ``MT5ForConditionalGeneration``.
    """
    builder, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = builder()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model.float().train()


def inputs(family: str, rows: int = 2, seq: int | None = None, seed: int = 1) -> dict[str, torch.Tensor]:
    """Keyword inputs (``labels`` included) for ``rows`` examples of ``family``, the same on every rank.

    Example: ``build("xmod")(**inputs("xmod")).loss`` -> a scalar.
    """
    kind = FAMILIES[family][1]
    seq = seq or SEQ_OF.get(family, SEQ)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB - 2, (rows, seq), generator=g)  # no pad/eos/bos/mask, no image tokens
    if kind == "causal":
        return {"input_ids": ids, "labels": ids}
    if kind == "seq2seq":  # the target is the source reversed, so the decoder has to read the encoder
        return {"input_ids": ids, "labels": ids.flip(1)}
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1)}  # masked LMs: the next token at every position
    if kind == "layout":  # boxes (x0, y0, x1, y1) with x0 <= x1, y0 <= y1, inside 0..63
        corner = torch.randint(0, 32, (rows, seq, 2), generator=g)
        size = torch.randint(0, 32, (rows, seq, 2), generator=g)
        batch["bbox"] = torch.cat([corner, corner + size], dim=-1)
    elif kind == "lang":  # the rows alternate between the two languages' adapters
        batch["lang_ids"] = torch.arange(rows) % 2
    elif kind == "langs":  # a language id per token (XLM), alternating by row
        batch["langs"] = (torch.arange(rows) % 2)[:, None].expand(rows, seq).contiguous()
    elif kind == "roc":
        batch["input_shape_ids"] = torch.randint(0, 32, (rows, seq), generator=g)
        batch["input_pronunciation_ids"] = torch.randint(0, 32, (rows, seq), generator=g)
    return batch


def loss_of(model: nn.Module, batch: dict) -> torch.Tensor:
    """The model's own training loss on ``batch`` (from ``inputs``)."""
    return model(**batch).loss


def select(batch: dict, idx) -> dict:
    """Rows ``idx`` of every tensor in ``batch`` (other values unchanged)."""
    return {k: v[idx] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
