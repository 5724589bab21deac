"""FFTs: ``_fft_r2c``, ``_fft_c2c`` and ``_fft_c2r`` (every ``torch.fft`` function and ``stft`` lower to them).

An FFT mixes the dims it transforms and treats every other dim as a batch dim. So shards on the other dims
stay (``fft.fft(x, dim=-1)`` of a ``Shard(0)`` batch runs locally and returns ``Shard(0)``), a shard on a
transformed dim is gathered first, and a ``Partial`` is reduced first (the FFT is linear, but the real and
complex ops here also halve or conjugate, and torch's DTensor reduces too). Sizes in the arguments
(``last_dim_size`` of ``_fft_c2r``) are of a transformed dim, which is whole, so they stay global.

Example::

    x = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
    torch.fft.rfft(x).placements        # (Shard(dim=0),): 8 independent rows
    torch.fft.fft2(x).placements        # (Replicate(),): dim 0 is transformed
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.ops._common import normalize_dim
from lightning_shard.tensor.ops._registry import OpCall, register
from lightning_shard.tensor.ops.dimwise import dimwise
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten


def _transformed(call: OpCall, spec: DTensorSpec):
    dims = {normalize_dim(d, spec.ndim) for d in call.args[1]}
    return dims, (lambda d: d)


register(aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default)(dimwise(_transformed))
