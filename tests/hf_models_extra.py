"""Still more tiny random-init Hugging Face models: state-space and hybrid LMs, code LMs, sparse-attention and
pooling encoders, convolutional and windowed vision models, speech CTC and a vision-language model.

Test material nobody here wrote, built from configs (no downloads), float32, seeded, 2 layers (or 2 stages),
hidden 32-64, vocabulary 128, dropout 0. Each family has a builder and an input kind; the model computes its own
training loss from the inputs (``labels`` included), so one loop trains them all.

Example::

    model = build("mamba")                    # MambaForCausalLM, slow (pure torch) path
    batch = inputs("mamba", rows=4, seed=3)   # {"input_ids": ..., "labels": ...}
    loss = model(**batch).loss

``FAMILIES`` maps each family to ``(builder, input kind)``.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.hf_models import HEADS, HIDDEN, LAYERS, MAX_POS, VOCAB

LABELS = 3  # classes for the classification heads
IMAGE, CHANNELS = 16, 3
AUDIO = 400  # wav2vec2 raw samples per row (conv strides 5*2*2 = 20 -> 19 frames)
SEQ = 8


def _hf(config_cls: str, model_cls: str, **kwargs):
    import transformers

    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))


# ------------------------------------------------------------------------------------------ decoder LMs
def _mamba():
    # The slow path: plain torch (no mamba-ssm / causal-conv1d kernels on CPU); a selective scan per layer.
    return _hf("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, state_size=8,
               num_hidden_layers=LAYERS, expand=2, conv_kernel=4, use_mambapy=False)  # fmt: skip


def _mamba2():
    return _hf("Mamba2Config", "Mamba2ForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, state_size=8,
               num_hidden_layers=LAYERS, expand=2, num_heads=8, head_dim=16, n_groups=1, conv_kernel=4,
               chunk_size=4)  # fmt: skip


def _gpt_bigcode():
    # multi-query attention: one shared key/value head, fused c_attn (q width + 2 * head_dim)
    return _hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS,
               n_head=HEADS, n_positions=MAX_POS, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               bos_token_id=0, eos_token_id=1)  # fmt: skip


def _codegen():
    # fused qkv_proj in a model-parallel interleaved layout (mp_num 4), partial rotary, parallel attention/MLP
    return _hf("CodeGenConfig", "CodeGenForCausalLM", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
               n_positions=MAX_POS, n_ctx=MAX_POS, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               bos_token_id=0, eos_token_id=1)  # fmt: skip


def _mpt():
    # ALiBi, fused Wqkv, no biases, LayerNorm without bias
    return _hf("MptConfig", "MptForCausalLM", d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS, expansion_ratio=2,
               max_seq_len=MAX_POS, vocab_size=VOCAB, resid_pdrop=0.0, emb_pdrop=0.0,
               attn_config={"alibi": True, "attn_pdrop": 0})  # fmt: skip


def _persimmon():
    # fused query_key_value, per-head q/k LayerNorm, partial rotary (half of each head)
    return _hf("PersimmonConfig", "PersimmonForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
               intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               max_position_embeddings=MAX_POS, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
               rope_parameters={"rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.5},
               pad_token_id=0, bos_token_id=0, eos_token_id=1)  # fmt: skip


def _jamba():
    # hybrid: a Mamba layer and an attention layer, experts on the second (slow Mamba path)
    return _hf("JambaConfig", "JambaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2, num_experts=2,
               num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
               attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
               mamba_dt_rank=8, max_position_embeddings=MAX_POS, pad_token_id=0, bos_token_id=0,
               eos_token_id=1)  # fmt: skip


def _zamba():
    # hybrid: Mamba layers; one shared attention block (its parameters tied) applied at layers 2 and 3
    return _hf("ZambaConfig", "ZambaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
               attention_hidden_size=2 * HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
               num_attention_heads=HEADS, attention_head_dim=32,
               num_key_value_heads=HEADS, n_mamba_heads=2, attn_layer_period=1, attn_layer_offset=0,
               use_mamba_kernels=False, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
               max_position_embeddings=MAX_POS, pad_token_id=0, bos_token_id=0, eos_token_id=1)  # fmt: skip


def _recurrent_gemma():
    # Griffin: a recurrent block (RG-LRU, conv1d) and a local multi-query attention block
    return _hf("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", num_hidden_layers=LAYERS, vocab_size=VOCAB,
               hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=HEADS, num_key_value_heads=1,
               lru_width=HIDDEN, attention_window_size=4, conv1d_width=4, logits_soft_cap=30.0,
               block_types=["recurrent", "attention"], pad_token_id=0, bos_token_id=0, eos_token_id=1)  # fmt: skip


# ------------------------------------------------------------------------------------------ encoders
def _bert_sizes(**kw) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=MAX_POS, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, **kw)  # fmt: skip


def _modernbert():
    # fused Wqkv, GLU MLP (Wi d -> 2 d_h, Wo), alternating global/local (window 4) attention, rotary
    return _hf("ModernBertConfig", "ModernBertForMaskedLM", vocab_size=VOCAB, hidden_size=HIDDEN,
               intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               max_position_embeddings=MAX_POS, local_attention=4, pad_token_id=0, eos_token_id=1, bos_token_id=2,
               cls_token_id=2, sep_token_id=1, attention_dropout=0.0, embedding_dropout=0.0,
               mlp_dropout=0.0)  # fmt: skip


def _longformer():
    # sliding-window attention (window 4 = 2 either side) plus global attention on no token
    return _hf("LongformerConfig", "LongformerForMaskedLM", **_bert_sizes(attention_window=4), pad_token_id=1)


def _big_bird():
    # block-sparse attention needs seq > (5 + 2 * random blocks) * block size; at SEQ 8 it falls back to full
    # attention (transformers warns), so the "original_full" path is what a tiny model trains.
    return _hf("BigBirdConfig", "BigBirdForMaskedLM", **_bert_sizes(attention_type="original_full"), pad_token_id=0)


def _funnel():
    # pooling between blocks (the sequence halves), relative positional attention, a decoder that upsamples
    return _hf("FunnelConfig", "FunnelForMaskedLM", vocab_size=VOCAB, block_sizes=[1, 1], num_decoder_layers=1,
               d_model=HIDDEN, n_head=HEADS, d_head=16, d_inner=2 * HIDDEN, hidden_dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0)  # fmt: skip


# ------------------------------------------------------------------------------------------ vision, speech
def _swin():
    # windowed attention (window 2) with shifted windows and a relative position bias table per head
    return _hf("SwinConfig", "SwinForImageClassification", image_size=IMAGE, patch_size=2, num_channels=CHANNELS,
               embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=2, mlp_ratio=2.0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=LABELS)  # fmt: skip


def _convnext():
    # depthwise convs, LayerNorm over channels, layer scale: no BatchNorm
    return _hf("ConvNextConfig", "ConvNextForImageClassification", num_channels=CHANNELS, patch_size=2,
               hidden_sizes=[16, 32], depths=[2, 2], num_stages=2, drop_path_rate=0.0, image_size=IMAGE,
               num_labels=LABELS)  # fmt: skip


def _resnet():
    # BatchNorm2d after every conv: per-rank batch statistics under data parallelism
    return _hf("ResNetConfig", "ResNetForImageClassification", num_channels=CHANNELS, embedding_size=16,
               hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=LABELS)  # fmt: skip


def _wav2vec2():
    # conv feature extractor (group norm on the first layer), a weight_norm'd grouped positional conv, CTC head
    return _hf("Wav2Vec2Config", "Wav2Vec2ForCTC", vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, intermediate_size=2 * HIDDEN, conv_dim=(16, 16, 16),
               conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=4,
               num_conv_pos_embedding_groups=4, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
               feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, apply_spec_augment=False, pad_token_id=0,
               ctc_loss_reduction="mean")  # fmt: skip


def _llava():
    # a tiny CLIP vision tower (8x8 image, 4x4 patches: 4 patch features) + projector + a tiny Llama
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        image_size=8,
        patch_size=4,
        num_channels=CHANNELS,
    )
    text = dict(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        pad_token_id=0,
    )
    return _hf("LlavaConfig", "LlavaForConditionalGeneration", vision_config=vision, text_config=text,
               image_token_index=LLAVA_IMAGE_TOKEN, image_seq_length=4, vision_feature_layer=-1,
               vision_feature_select_strategy="default", tie_word_embeddings=False)  # fmt: skip


def _mpnet():
    # one relative position table (buckets x heads) in the encoder, its bias added to every layer's scores
    return _hf("MPNetConfig", "MPNetForMaskedLM", **_bert_sizes())


def _esm():
    # rotary attention in a BERT-style encoder; a load pre-hook remaps old checkpoints' rotary keys
    return _hf("EsmConfig", "EsmForMaskedLM", **_bert_sizes(), position_embedding_type="rotary", pad_token_id=1,
               mask_token_id=2, token_dropout=False)  # fmt: skip


def _data2vec_text():
    return _hf("Data2VecTextConfig", "Data2VecTextForMaskedLM", **_bert_sizes(), pad_token_id=1)


def _xlnet():
    # two-stream relative attention on raw parameters (q, k, v, o, r, r_w_bias ...), no Linear projections
    return _hf("XLNetConfig", "XLNetLMHeadModel", vocab_size=VOCAB, d_model=HIDDEN, n_layer=LAYERS, n_head=HEADS,
               d_inner=2 * HIDDEN, dropout=0.0, mem_len=None)  # fmt: skip


def _dinov2():
    # layer scale, a mask token the forward never uses without bool_masked_pos, CLS + mean-pooled patch head
    return _hf("Dinov2Config", "Dinov2ForImageClassification", image_size=IMAGE, patch_size=4, num_channels=CHANNELS,
               hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, mlp_ratio=2, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=LABELS)  # fmt: skip


def _segformer():
    # overlapping patch-embedding convs, attention over a conv-reduced sequence, a depthwise conv inside the MLP
    return _hf("SegformerConfig", "SegformerForImageClassification", num_channels=CHANNELS, num_encoder_blocks=2,
               depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[3, 3], strides=[2, 2],
               num_attention_heads=[1, 2], mlp_ratios=[2, 2], hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=LABELS)  # fmt: skip


def _beit(shared: bool = False):
    # a relative position table (distances x heads) per layer, or one in the encoder shared by all layers, whose
    # bias the layer hands to its attention as the mask; layer scale; mean-pooled head
    where = "use_shared_relative_position_bias" if shared else "use_relative_position_bias"
    return _hf("BeitConfig", "BeitForImageClassification", image_size=IMAGE, patch_size=4, num_channels=CHANNELS,
               hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0, use_mean_pooling=True,
               num_labels=LABELS, **{where: True})  # fmt: skip


def _audio_sizes() -> dict:
    return dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=2 * HIDDEN, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
                activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                layerdrop=0.0, apply_spec_augment=False, pad_token_id=0, ctc_loss_reduction="mean")  # fmt: skip


def _wavlm():
    # gated relative position bias: a GRU-style gate (gru_rel_pos_linear) inside the attention, buckets x heads
    return _hf("WavLMConfig", "WavLMForCTC", **_audio_sizes(), num_buckets=32, max_bucket_distance=64)


def _rwkv():
    # time-mixing recurrence (key/value/receptance, per-channel decay) instead of attention
    return _hf("RwkvConfig", "RwkvForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
               attention_hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, context_length=MAX_POS)  # fmt: skip


def _rembert():
    # decoupled input/output embedding sizes, projected into and out of the encoder
    return _hf("RemBertConfig", "RemBertForMaskedLM", **_bert_sizes(), input_embedding_size=32,
               output_embedding_size=32)  # fmt: skip


def _nystromformer():
    # Nystrom landmark attention with a depthwise conv over the values inside the attention
    return _hf("NystromformerConfig", "NystromformerForMaskedLM", **_bert_sizes(), num_landmarks=4,
               segment_means_seq_len=SEQ)  # fmt: skip


LLAVA_IMAGE_TOKEN = VOCAB - 1

# family -> (builder, input kind)
FAMILIES: dict[str, tuple] = {
    "mamba": (_mamba, "causal"),
    "mamba2": (_mamba2, "causal"),
    "gpt_bigcode": (_gpt_bigcode, "causal"),
    "codegen": (_codegen, "causal"),
    "mpt": (_mpt, "causal"),
    "persimmon": (_persimmon, "causal"),
    "jamba": (_jamba, "causal"),
    "zamba": (_zamba, "causal"),
    "recurrent_gemma": (_recurrent_gemma, "causal"),
    "modernbert": (_modernbert, "masked"),
    "longformer": (_longformer, "masked"),
    "big_bird": (_big_bird, "masked"),
    "funnel": (_funnel, "masked"),
    "swin": (_swin, "image"),
    "convnext": (_convnext, "image"),
    "resnet": (_resnet, "image"),
    "wav2vec2": (_wav2vec2, "ctc"),
    "llava": (_llava, "vlm"),
    "mpnet": (_mpnet, "masked"),
    "esm": (_esm, "masked"),
    "data2vec_text": (_data2vec_text, "masked"),
    "xlnet": (_xlnet, "causal"),
    "dinov2": (_dinov2, "image"),
    "segformer": (_segformer, "image"),
    "beit": (_beit, "image"),
    "beit_shared_bias": (lambda: _beit(shared=True), "image"),
    "wavlm": (_wavlm, "ctc"),
    "rwkv": (_rwkv, "causal"),
    "rembert": (_rembert, "masked"),
    "nystromformer": (_nystromformer, "masked"),
}


def build(family: str, seed: int = 0) -> nn.Module:
    """A tiny random-init model of ``family`` (a key of ``FAMILIES``), float32, seeded, in train mode.

    Example: ``build("swin")`` -> a 2-stage ``SwinForImageClassification`` on 16x16 images.
    """
    builder, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = builder()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model.float().train()


def inputs(family: str, rows: int = 2, seq: int = SEQ, seed: int = 1) -> dict[str, torch.Tensor]:
    """Keyword inputs (``labels`` included) for ``rows`` examples of ``family``, the same on every rank.

    Example: ``build("resnet")(**inputs("resnet")).loss`` -> a scalar.
    """
    kind = FAMILIES[family][1]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (rows, seq), generator=g)  # no pad/eos/bos, no image token
    if kind == "causal":
        return {"input_ids": ids, "labels": ids}
    if kind == "masked":  # the next token at every position (the identity is too easy for Funnel's residual)
        return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}
    if kind == "image":
        pixels = torch.randn(rows, CHANNELS, IMAGE, IMAGE, generator=g)
        return {"pixel_values": pixels, "labels": torch.randint(0, LABELS, (rows,), generator=g)}
    if kind == "ctc":
        audio = torch.randn(rows, AUDIO, generator=g)
        return {"input_values": audio, "labels": torch.randint(1, 32, (rows, 4), generator=g)}
    # vlm: 4 image tokens (one image's 4 patch features) then text; the loss is on the text tokens only
    ids = torch.cat([torch.full((rows, 4), LLAVA_IMAGE_TOKEN), ids], dim=1)
    labels = ids.clone()
    labels[:, :4] = -100
    pixels = torch.randn(rows, CHANNELS, 8, 8, generator=g)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


def loss_of(model: nn.Module, batch: dict) -> torch.Tensor:
    """The model's own training loss on ``batch`` (from ``inputs``)."""
    return model(**batch).loss


def select(batch: dict, idx) -> dict:
    """Rows ``idx`` of every tensor in ``batch`` (other values unchanged)."""
    return {k: v[idx] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
