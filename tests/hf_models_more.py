"""More tiny random-init Hugging Face models: encoders, encoder-decoders, speech, vision and task heads.

Test material nobody here wrote, built from configs (no downloads), float32, seeded, 2 layers, hidden 32-64.
Each family has a builder and an input maker, and the model computes its own training loss from the inputs
(``labels`` included), so one loop trains them all.

Example::

    model = build("albert")                 # AlbertForMaskedLM, one layer shared by both blocks
    batch = inputs("albert", rows=4, seed=3)   # {"input_ids": ..., "labels": ...}
    loss = model(**batch).loss

``FAMILIES`` maps each family to ``(builder, input kind)``; ``dropout=p`` builds the model with dropout ``p``
where its config has dropout knobs (0 otherwise).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.hf_models import HEADS, HIDDEN, LAYERS, MAX_POS, VOCAB

LABELS = 3  # classes for the classification heads
IMAGE, PATCH, CHANNELS = 8, 4, 3
MELS, AUDIO_POS = 8, 8  # whisper: input_features (batch, MELS, 2 * AUDIO_POS)


def _bert_like(p: float) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POS,
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=p,
    )


def _roberta(p):
    from transformers import RobertaConfig, RobertaForMaskedLM

    return RobertaForMaskedLM(RobertaConfig(**_bert_like(p), pad_token_id=1))


def _xlm_roberta(p):
    from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM

    return XLMRobertaForMaskedLM(XLMRobertaConfig(**_bert_like(p), pad_token_id=1))


def _electra(p):
    from transformers import ElectraConfig, ElectraForMaskedLM

    # embedding_size != hidden_size: ELECTRA projects the embeddings (embeddings_project) into the encoder.
    return ElectraForMaskedLM(ElectraConfig(**_bert_like(p), embedding_size=32))


def _albert(p):
    from transformers import AlbertConfig, AlbertForMaskedLM

    # One AlbertLayer (num_hidden_groups=1) applied num_hidden_layers times: parameters shared across blocks.
    cfg = _bert_like(p)
    return AlbertForMaskedLM(AlbertConfig(**cfg, embedding_size=32, num_hidden_groups=1, inner_group_num=1))


def _deberta_v2(p):
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    return DebertaV2ForMaskedLM(
        DebertaV2Config(
            **_bert_like(p),
            relative_attention=True,
            position_buckets=8,
            max_relative_positions=MAX_POS,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
        )
    )


def _distilbert(p):
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    return DistilBertForMaskedLM(
        DistilBertConfig(
            vocab_size=VOCAB,
            dim=HIDDEN,
            hidden_dim=2 * HIDDEN,
            n_layers=LAYERS,
            n_heads=HEADS,
            max_position_embeddings=MAX_POS,
            dropout=p,
            attention_dropout=p,
        )
    )


def _bert_seqcls(p):
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(**_bert_like(p), num_labels=LABELS))


def _roberta_seqcls(p):
    from transformers import RobertaConfig, RobertaForSequenceClassification

    return RobertaForSequenceClassification(RobertaConfig(**_bert_like(p), pad_token_id=1, num_labels=LABELS))


def _bert_tokcls(p):
    from transformers import BertConfig, BertForTokenClassification

    return BertForTokenClassification(BertConfig(**_bert_like(p), num_labels=LABELS))


def _bart_like(p: float) -> dict:
    return dict(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        max_position_embeddings=MAX_POS,
        dropout=p,
        attention_dropout=p,
        activation_dropout=p,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )


def _bart(p):
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(**_bart_like(p)))


def _mbart(p):
    from transformers import MBartConfig, MBartForConditionalGeneration

    return MBartForConditionalGeneration(MBartConfig(**_bart_like(p)))


def _pegasus(p):
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    return PegasusForConditionalGeneration(PegasusConfig(**_bart_like(p)))


def _whisper(p):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(
        WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=MELS,
            d_model=HIDDEN,
            encoder_layers=LAYERS,
            decoder_layers=LAYERS,
            encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS,
            encoder_ffn_dim=2 * HIDDEN,
            decoder_ffn_dim=2 * HIDDEN,
            max_source_positions=AUDIO_POS,
            max_target_positions=MAX_POS,
            dropout=p,
            attention_dropout=p,
            activation_dropout=p,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        )
    )


def _vit(p):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = _bert_like(p)
    for key in ("vocab_size", "max_position_embeddings"):
        cfg.pop(key)
    return ViTForImageClassification(
        ViTConfig(**cfg, image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, num_labels=LABELS)
    )


def _clip(p):
    from transformers import CLIPConfig, CLIPModel

    common = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, attention_dropout=p)  # fmt: skip
    text = dict(common, vocab_size=VOCAB, max_position_embeddings=MAX_POS, eos_token_id=2)
    vision = dict(common, image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))


# family -> (builder(dropout), input kind)
FAMILIES: dict[str, tuple] = {
    "roberta": (_roberta, "masked"),
    "xlm_roberta": (_xlm_roberta, "masked"),
    "electra": (_electra, "masked"),
    "albert": (_albert, "masked"),
    "deberta_v2": (_deberta_v2, "masked"),
    "distilbert": (_distilbert, "masked"),
    "bert_seqcls": (_bert_seqcls, "seqcls"),
    "roberta_seqcls": (_roberta_seqcls, "seqcls"),
    "bert_tokcls": (_bert_tokcls, "tokcls"),
    "bart": (_bart, "seq2seq"),
    "mbart": (_mbart, "seq2seq"),
    "pegasus": (_pegasus, "seq2seq"),
    "whisper": (_whisper, "speech"),
    "vit": (_vit, "image"),
    "clip": (_clip, "clip"),
}


def build(family: str, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """A tiny random-init model of ``family`` (a key of ``FAMILIES``), float32, seeded, in train mode.

    Example: ``build("deberta_v2")`` -> a 2-layer ``DebertaV2ForMaskedLM`` with relative position buckets.
    """
    builder, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = builder(dropout)
    model.config.use_cache = False
    return model.float().train()


def inputs(family: str, rows: int = 2, seq: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    """Keyword inputs (``labels`` included) for ``rows`` examples of ``family``, the same on every rank.

    Example: ``build("vit")(**inputs("vit")).loss`` -> a scalar.
    """
    kind = FAMILIES[family][1]
    g = torch.Generator().manual_seed(seed)
    # Token ids from 3 up: no pad (1) or eos (2) ids inside, which some heads treat specially.
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    if kind == "masked":
        return {"input_ids": ids, "labels": ids}
    if kind == "seqcls":
        return {"input_ids": ids, "labels": torch.randint(0, LABELS, (rows,), generator=g)}
    if kind == "tokcls":
        return {"input_ids": ids, "labels": torch.randint(0, LABELS, (rows, seq), generator=g)}
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (rows, seq // 2), generator=g)}
    if kind == "speech":
        feats = torch.randn(rows, MELS, 2 * AUDIO_POS, generator=g)
        return {"input_features": feats, "labels": torch.randint(3, VOCAB, (rows, seq // 2), generator=g)}
    pixels = torch.randn(rows, CHANNELS, IMAGE, IMAGE, generator=g)
    if kind == "image":
        return {"pixel_values": pixels, "labels": torch.randint(0, LABELS, (rows,), generator=g)}
    ids[:, -1] = 2  # CLIP pools the text at the eos token
    return {"input_ids": ids, "pixel_values": pixels, "return_loss": True}


def loss_of(model: nn.Module, batch: dict) -> torch.Tensor:
    """The model's own training loss on ``batch`` (from ``inputs``)."""
    return model(**batch).loss


def select(batch: dict, idx) -> dict:
    """Rows ``idx`` of every tensor in ``batch`` (other values unchanged)."""
    return {k: v[idx] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
