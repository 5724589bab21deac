"""Policies for ``fully_shard``: mixed precision and CPU offload (frozen dataclasses, as in torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute, gradient reduction and outputs. Sharded (master) parameters stay in their own
    dtype (fp32) always; only the all-gathered copy used for compute is cast.

    ``reduce_dtype=None`` means: fp32 when ``param_dtype`` is bf16 (bf16 gradient reduction loses accuracy at
    scale; this differs from torch, which reduces in ``param_dtype``), else ``param_dtype``.

    Example: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` computes in bf16, reduces in fp32:

    >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    >>> policy.compute_dtype(torch.float32), policy.gradient_dtype(torch.float32)
    (torch.bfloat16, torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                raise ValueError(f"MixedPrecisionPolicy: {name}={value} must be one of {_FLOATS} or None")

    def compute_dtype(self, orig: torch.dtype) -> torch.dtype:
        return self.param_dtype or orig

    def gradient_dtype(self, orig: torch.dtype) -> torch.dtype:
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        if self.param_dtype == torch.bfloat16:
            return torch.float32
        return self.param_dtype or orig


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default). Example: ``fully_shard(m, offload_policy=OffloadPolicy())``."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on CPU; the optimizer steps on CPU.

    Parameters are copied to the device for the all-gather; reduced gradients are copied back. On a CPU mesh
    this is a no-op move. ``pin_memory`` pins the CPU shards when CUDA is used (faster, async copies).

    Example: ``fully_shard(block, offload_policy=CPUOffloadPolicy())``.
    """

    pin_memory: bool = True
