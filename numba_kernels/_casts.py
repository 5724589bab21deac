"""Bit-level float conversions of the CUDA kernels (and the formulas the CPU kernels use).

Every function here is plain Python on integers (the IEEE bit patterns, held in
int64 so that numba never mixes signed and unsigned types and silently promotes
to float64). ``cuda.py`` wraps them with ``numba.cuda.jit(device=True)``; the CUDA
simulator runs them as plain Python. On CPU, ``cpu.py`` writes the same formulas as
32-bit LLVM IR (``cpu._f32_to_bf16`` etc.), because numba's int64 versions do not
vectorise well there. The tests compare the CPU, CUDA-simulator and reference
results against torch bit for bit.

Rounding is round-to-nearest-even, the rule torch uses for ``.to(torch.bfloat16)``
and ``.to(torch.float16)``. NaN stays NaN (canonical quiet NaN; torch's own NaN
payload differs between its scalar and vectorised paths, so only "is NaN" is
part of the contract).

Example::

    >>> hex(f32_bits_to_bf16(0x3F800001))   # 1.0000001f -> 1.0 in bf16
    '0x3f80'
"""

from __future__ import annotations

import torch

# Small integer codes the kernels dispatch on, so that one compiled
# specialization serves every dtype pair (compile time stays a few seconds).
CODE_F32 = 0
CODE_BF16 = 1
CODE_F16 = 2

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: CODE_F32,
    torch.bfloat16: CODE_BF16,
    torch.float16: CODE_F16,
}

# Dtypes the staging ops accept but no kernel handles: their copies take the plain-torch reference path (a
# float64 model trains in float64; the kernels' float32 arithmetic would round its gradients).
REFERENCE_ONLY_DTYPES: tuple[torch.dtype, ...] = (torch.float64,)


def f32_bits_to_bf16(u):
    """float32 bits (int, 0 <= u < 2**32) -> bfloat16 bits, round-to-nearest-even.

    Same formula as ``c10::detail::round_to_nearest_even`` (c10/util/BFloat16.h):
    add 0x7FFF plus the lowest kept bit, then truncate. Inf survives because the
    bias never carries out of an all-zero mantissa; NaN is special-cased since
    the carry could turn a NaN into Inf.

    >>> hex(f32_bits_to_bf16(0x7F800001))
    '0x7fc0'
    """
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FC0 | ((u >> 16) & 0x8000)
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def bf16_to_f32_bits(h):
    """bfloat16 bits -> float32 bits (exact: bf16 is the top half of an f32).

    >>> hex(bf16_to_f32_bits(0x3F80))
    '0x3f800000'
    """
    return h << 16


def f32_bits_to_f16(u):
    """float32 bits -> IEEE half bits, round-to-nearest-even (incl. subnormals, overflow to Inf).

    >>> hex(f32_bits_to_f16(0x3F800000))
    '0x3c00'
    """
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN -> quiet NaN, sign kept
        return sign | 0x7E00
    if a >= 0x477FF000:  # >= 65520 rounds to Inf (also catches Inf)
        return sign | 0x7C00
    if a >= 0x38800000:  # normal half (>= 2**-14): rebias exponent, RNE on the 13 dropped bits
        r = a + 0xFFF + ((a >> 13) & 1)
        return sign | ((r >> 13) - 0x1C000)
    if a <= 0x33000000:  # <= 2**-25: rounds to (signed) zero; 2**-25 itself ties to even 0
        return sign
    # Half subnormal: value = m * 2**-24; shift the 24-bit significand into place with RNE.
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    shift = 126 - e
    r = (m + (1 << (shift - 1)) - 1 + ((m >> shift) & 1)) >> shift
    return sign | r


def f16_to_f32_bits(h):
    """IEEE half bits -> float32 bits (exact; subnormals normalised, NaN/Inf kept).

    >>> hex(f16_to_f32_bits(0x3C00))
    '0x3f800000'
    """
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return sign | 0x7F800000 | (m << 13)
    if e == 0:
        if m == 0:
            return sign
        # Subnormal half: normalise the significand (at most 10 shifts).
        e = 113
        while (m & 0x400) == 0:
            m = m << 1
            e -= 1
        return sign | (e << 23) | ((m & 0x3FF) << 13)
    return sign | ((e + 112) << 23) | (m << 13)
