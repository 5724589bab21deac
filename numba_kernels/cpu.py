"""CPU kernels: one ``numba.njit(parallel=True, cache=True)`` pass per op per group.

All four ops are the same memory movement: a list of contiguous *segments*
("copy ``ncopy`` elements from here to there, casting, optionally dividing and
accumulating, then zero ``nzero`` elements"). The layout precomputes them as a
block table (see ``layout.py``), cut into blocks of at most ``BLOCK`` elements so
that ``prange`` balances one huge parameter against many small ones. So there is
exactly one kernel, compiled once for one signature: dtypes are carried as small
int codes and every buffer is passed both as a float32 view and a uint16 view
(the unused one is a 1-element dummy). Compile time therefore does not grow with
the number of dtype pairs.

Example::

    >>> import numpy as np
    >>> from numba_kernels.cpu import run_blocks
    >>> src = np.arange(4, dtype=np.float32); dst = np.zeros(6, np.float32)
    >>> blk = np.array([[0, 0, 0, 4, 2]], np.int64)   # param, src_rel, dst_rel, ncopy, nzero
    >>> z = np.zeros(1, np.int64)
    >>> run_blocks(blk, src, None, z, 0, dst, None, z, 0)
    >>> dst.tolist()
    [0.0, 1.0, 2.0, 3.0, 0.0, 0.0]
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import _casts

# Below this many elements the serial kernel wins: waking the prange thread pool
# costs more than copying a few hundred KB on one core.
SERIAL_THRESHOLD = 1 << 17

_DUMMY_F32 = np.zeros(1, np.float32)
_DUMMY_U16 = np.zeros(1, np.uint16)


@intrinsic
def _f32_to_bits(typingctx, x):
    """Reinterpret a float32 as its IEEE bits (zero-extended to int64)."""
    sig = types.int64(types.float32)

    def codegen(context, builder, signature, args):
        i32 = builder.bitcast(args[0], ir.IntType(32))
        return builder.zext(i32, ir.IntType(64))

    return sig, codegen


@intrinsic
def _bits_to_f32(typingctx, u):
    """Reinterpret the low 32 bits of an int64 as a float32."""
    sig = types.float32(types.int64)

    def codegen(context, builder, signature, args):
        i32 = builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(i32, ir.FloatType())

    return sig, codegen


_to_bf16 = njit(inline="always")(_casts.f32_bits_to_bf16)
_from_bf16 = njit(inline="always")(_casts.bf16_to_f32_bits)
_to_f16 = njit(inline="always")(_casts.f32_bits_to_f16)
_from_f16 = njit(inline="always")(_casts.f16_to_f32_bits)


@njit(inline="always")
def _load(code, af, a16, i):
    if code == 0:
        return af[i]
    if code == 1:
        return _bits_to_f32(_from_bf16(np.int64(a16[i])))
    return _bits_to_f32(_from_f16(np.int64(a16[i])))


@njit(inline="always")
def _store(code, af, a16, i, v):
    if code == 0:
        af[i] = v
    elif code == 1:
        a16[i] = _to_bf16(_f32_to_bits(v))
    else:
        a16[i] = _to_f16(_f32_to_bits(v))


@njit(inline="always")
def _block(b, blk, sf, s16, sbase, sc, df, d16, dbase, dc, has_div, div, acc):
    p = blk[b, 0]
    sb = sbase[p]
    so = sb + blk[b, 1]
    do = dbase[p] + blk[b, 2]
    nc = blk[b, 3]
    nz = blk[b, 4]
    if sb < 0:  # missing gradient (None): its slots become zeros
        nz += nc
        nc = 0
    plain = not has_div and not acc
    # The common combinations get their own tight loops (LLVM vectorises them);
    # everything else goes through the generic load/compute/store loop.
    if plain and sc == dc and sc == 0:
        for j in range(nc):
            df[do + j] = sf[so + j]
    elif plain and sc == dc:
        for j in range(nc):
            d16[do + j] = s16[so + j]
    elif plain and sc == 0 and dc == 1:
        for j in range(nc):
            d16[do + j] = _to_bf16(_f32_to_bits(sf[so + j]))
    elif plain and sc == 1 and dc == 0:
        for j in range(nc):
            df[do + j] = _bits_to_f32(np.int64(s16[so + j]) << 16)
    elif sc == 0 and dc == 1 and not acc:
        for j in range(nc):
            d16[do + j] = _to_bf16(_f32_to_bits(sf[so + j] / div))
    elif sc == 1 and dc == 0 and has_div and acc:
        for j in range(nc):
            df[do + j] = df[do + j] + _bits_to_f32(np.int64(s16[so + j]) << 16) / div
    elif sc == 1 and dc == 0 and has_div:
        for j in range(nc):
            df[do + j] = _bits_to_f32(np.int64(s16[so + j]) << 16) / div
    else:
        for j in range(nc):
            v = _load(sc, sf, s16, so + j)
            if has_div:
                v = v / div
            if acc:
                v = v + _load(dc, df, d16, do + j)
            _store(dc, df, d16, do + j, v)
    z = do + nc
    if dc == 0:
        for j in range(nz):
            df[z + j] = np.float32(0.0)
    else:
        for j in range(nz):
            d16[z + j] = np.uint16(0)


def _kernel_body(blk, sf, s16, sbase, sc, df, d16, dbase, dc, has_div, div, acc):
    for b in prange(blk.shape[0]):
        _block(b, blk, sf, s16, sbase, sc, df, d16, dbase, dc, has_div, div, acc)


# Same body twice: the parallel one for real buffers, the serial one for tiny
# ones (see SERIAL_THRESHOLD). Both cached on disk (__pycache__/*.nbi, *.nbc).
# error_model="numpy": x / 0 gives inf/nan like torch instead of raising.
_kernel_parallel = njit(parallel=True, cache=True, nogil=True, error_model="numpy")(_kernel_body)
_kernel_serial = njit(parallel=False, cache=True, nogil=True, error_model="numpy")(_kernel_body)


def run_blocks(
    blk: np.ndarray,
    src_f32: np.ndarray | None,
    src_u16: np.ndarray | None,
    src_base: np.ndarray,
    src_code: int,
    dst_f32: np.ndarray | None,
    dst_u16: np.ndarray | None,
    dst_base: np.ndarray,
    dst_code: int,
    divisor: float | None = None,
    accumulate: bool = False,
    total: int | None = None,
) -> None:
    """Run the block table ``blk`` (int64 ``(nblk, 5)``) over numpy views.

    ``src_*``/``dst_*``: the float32 view (code 0) or uint16 bit view (bf16/fp16);
    pass ``None`` for the one not used. ``total`` (elements moved) picks the
    serial kernel for tiny buffers. Callers (``ops.py``) have validated bounds.
    """
    kernel = _kernel_serial if total is not None and total < SERIAL_THRESHOLD else _kernel_parallel
    kernel(
        blk,
        _DUMMY_F32 if src_f32 is None else src_f32,
        _DUMMY_U16 if src_u16 is None else src_u16,
        src_base,
        np.int64(src_code),
        _DUMMY_F32 if dst_f32 is None else dst_f32,
        _DUMMY_U16 if dst_u16 is None else dst_u16,
        dst_base,
        np.int64(dst_code),
        divisor is not None,
        np.float32(1.0 if divisor is None else divisor),
        bool(accumulate),
    )


def warm() -> None:
    """Compile (or load from numba's disk cache) both CPU kernel variants.

    >>> warm()   # idempotent; a few ms once cached
    """
    if _kernel_parallel.signatures and _kernel_serial.signatures:
        return
    blk = np.zeros((1, 5), np.int64)
    base = np.zeros(1, np.int64)
    f = np.zeros(1, np.float32)
    h = np.zeros(1, np.uint16)
    for kernel in (_kernel_parallel, _kernel_serial):
        kernel(blk, f, h, base, np.int64(0), f, h, base, np.int64(0), False, np.float32(1.0), False)


def num_threads() -> int:
    """numba's CPU thread count (what ``prange`` uses)."""
    return numba.get_num_threads()
