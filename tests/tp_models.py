"""Four small reference models for the tensor-parallel tests, written plainly (nanoGPT style).

* ``Llama``: RMSNorm, rotary embeddings, grouped-query attention through ``F.scaled_dot_product_attention``,
  SwiGLU MLP, untied LM head. ``forward(idx) -> logits (B, T, vocab)``.
* ``GPT2``: LayerNorm, learned positions, one fused qkv Linear, GELU MLP, LM head tied to the token
  embedding. ``forward(idx) -> logits``.
* ``lightning.pytorch.demos.Transformer`` (built on ``nn.Transformer``): see ``demo_transformer()``.
* ``Bert``: post-LN encoder (token + position + token-type embeddings, embedding LayerNorm) with a
  classification head on the first token. ``forward(idx) -> class logits (B, n_classes)``.

Dropout probabilities are 0 so runs are deterministic and comparable with a single process.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, max_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_len).float(), freqs)  # (T, head_dim / 2)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """x: (B, T, H, D); rotate pairs (x[2i], x[2i+1]) by the position's angle."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_len: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        cos, sin = rotary_tables(self.head_dim, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, self.cos[:T], self.sin[:T]), apply_rotary(k, self.cos[:T], self.sin[:T])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden, max_len) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = LlamaAttention(dim, n_heads, n_kv_heads, max_len)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = SwiGLU(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=48, max_len=16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, n_heads, n_kv_heads, hidden, max_len) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


class LlamaWithPositionTable(Llama):
    """``Llama`` plus a learned table of positions added after the embedding and sliced by the sequence length
    the model's own code sees (under sequence parallel: the local shard's length, a silently wrong sum)."""

    def __init__(self, max_len: int = 16, **kw) -> None:
        super().__init__(max_len=max_len, **kw)
        self.pos = nn.Parameter(torch.randn(max_len, self.tok_embeddings.embedding_dim) * 0.02)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        x = x + self.pos[: x.size(1)]
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def compact_gpt(vocab=101, dim=32, n_layers=2, heads=4, max_len=16):
    """The benchmarks' GPT (benchmarks/fsdp_vs_torch.py): each block is one module whose norms, fused qkv,
    output projection and MLP Linears are all direct children."""
    from benchmarks.fsdp_vs_torch import GPT

    return GPT(vocab, dim, n_layers, heads, max_len)


# ----------------------------------------------------------------------------- GPT-2


class GPT2Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPT2MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = GPT2Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = GPT2MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, vocab=101, block_size=16, n_embd=32, n_head=4, n_layer=2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList(GPT2Block(n_embd, n_head) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ----------------------------------------------------------------------------- Lightning's demo Transformer


def demo_transformer(vocab=101, ninp=32, nhead=2, nhid=48, nlayers=1):
    """``lightning.pytorch.demos.Transformer``; ``forward(inputs, target)`` returns log-probabilities
    ``(B * T, vocab)`` (it applies ``log_softmax`` itself), for ``F.nll_loss``."""
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=vocab, ninp=ninp, nhead=nhead, nhid=nhid, nlayers=nlayers, dropout=0.0)


# ----------------------------------------------------------------------------- BERT


class BertSelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_attention_heads: int) -> None:
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.hidden_size = hidden_size
        self.head_dim = hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (
            p(x).view(B, T, self.num_attention_heads, self.head_dim).transpose(1, 2)
            for p in (self.query, self.key, self.value)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        y = scores.softmax(-1) @ v
        return self.dense(y.transpose(1, 2).reshape(B, T, self.hidden_size))


class BertMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class BertLayer(nn.Module):
    def __init__(self, hidden_size, heads, intermediate) -> None:
        super().__init__()
        self.attention = BertSelfAttention(hidden_size, heads)
        self.attention_norm = nn.LayerNorm(hidden_size)
        self.mlp = BertMLP(hidden_size, intermediate)
        self.output_norm = nn.LayerNorm(hidden_size)

    def forward(self, x):
        x = self.attention_norm(x + self.attention(x))  # post-LN, as in BERT
        return self.output_norm(x + self.mlp(x))


class Bert(nn.Module):
    def __init__(self, vocab=101, max_len=16, hidden_size=32, heads=4, intermediate=64, layers=2, n_classes=3):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden_size)
        self.position_embeddings = nn.Embedding(max_len, hidden_size)
        self.token_type_embeddings = nn.Embedding(2, hidden_size)
        self.embedding_norm = nn.LayerNorm(hidden_size)
        self.layers = nn.ModuleList(BertLayer(hidden_size, heads, intermediate) for _ in range(layers))
        self.pooler = nn.Linear(hidden_size, hidden_size)
        self.classifier = nn.Linear(hidden_size, n_classes)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        types = torch.zeros_like(idx)
        x = self.word_embeddings(idx) + self.position_embeddings(pos) + self.token_type_embeddings(types)
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(pooled)
