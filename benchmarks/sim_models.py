"""Model factories for ``python -m lightning_shard.simulate`` (called on the meta device).

The Llama of ``tests/tp_models.py`` keeps its rotary tables in fp32, which meets bf16 queries under
``bf16-mixed`` (no autocast); the factories here keep those tables in bf16, as bf16 training recipes do.
"""

import torch

from tests.tp_models import Llama


def _bf16_buffers(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(torch.bfloat16)
    return model


def llama3_8b() -> Llama:
    """Llama-3-8B's shape: 32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256."""
    return _bf16_buffers(
        Llama(vocab=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden=14336, max_len=8192)
    )


def llama_tiny() -> Llama:
    """A small Llama for quick runs and tests."""
    return _bf16_buffers(Llama())


def llama3_70b() -> Llama:
    """Llama-3-70B's shape: 80 layers, hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256."""
    return _bf16_buffers(
        Llama(vocab=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden=28672, max_len=8192)
    )
