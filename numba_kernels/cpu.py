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

import os
import types as types_module

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# Numba's default OpenMP layer keeps its worker threads spinning after each parallel kernel. Next to torch's
# own threads, in several ranks per machine, the spinning threads take the cores from the compute that follows
# (measured: a 4x slower training step on 2 CPU ranks). The workqueue layer's idle threads sleep instead. A
# layer chosen by the user (NUMBA_THREADING_LAYER) is kept.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

# Below this many elements the serial kernel wins: waking the prange thread pool
# costs more than copying a few hundred KB on one core.
SERIAL_THRESHOLD = 1 << 17

_DUMMY_F32 = np.zeros(1, np.float32)
_DUMMY_U16 = np.zeros(1, np.uint16)


@intrinsic
def _copy_elements(typingctx, dst, dst_start, src, src_start, n):
    """``dst[dst_start : dst_start + n] = src[src_start : src_start + n]`` (same dtype) through libc's
    ``memcpy``, which picks the fastest stores for the size (one thread, 12.6 MB: libc's memcpy 0.81 ms,
    our earlier element loop 1.15 ms). Lowered to the ``llvm.memcpy`` intrinsic, which links to the
    ``memcpy`` symbol by name, so the kernel stays cacheable on disk."""
    sig = types.void(dst, types.int64, src, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        dst_arr = context.make_array(signature.args[0])(context, builder, args[0])
        src_arr = context.make_array(signature.args[2])(context, builder, args[2])
        itemsize = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        dst_ptr = builder.gep(dst_arr.data, [args[1]])
        src_ptr = builder.gep(src_arr.data, [args[3]])
        cgutils.raw_memcpy(builder, dst_ptr, src_ptr, args[4], itemsize)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _zero_elements(typingctx, dst, start, n):
    """``dst[start : start + n] = 0`` through libc's ``memset`` (the ``llvm.memset`` intrinsic)."""
    sig = types.void(dst, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        itemsize = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        ptr = builder.gep(arr.data, [args[1]])
        cgutils.memset(builder, ptr, builder.mul(args[2], ir.Constant(args[2].type, itemsize)), 0)
        return context.get_dummy_value()

    return sig, codegen


_I32 = ir.IntType(32)


def _i32(value: int) -> ir.Constant:
    """A 32-bit integer constant for the cast intrinsics' IR."""
    return ir.Constant(_I32, value)


@intrinsic
def _f32_to_bf16(typingctx, x):
    """float32 -> bfloat16 bits, round-to-nearest-even: ``_casts.f32_bits_to_bf16`` in 32-bit integer IR.

    The same formula written in Python runs on int64 (numba's integer type), which halves the vector width
    LLVM can use; in 32-bit lanes, with the NaN case as a select, the loop vectorises fully (one thread,
    4M elements: 0.68 ms against 1.39 ms; torch's own cast 0.62 ms).
    """
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        u = builder.bitcast(args[0], _I32)
        high = builder.lshr(u, _i32(16))
        rounded = builder.lshr(builder.add(builder.add(u, _i32(0x7FFF)), builder.and_(high, _i32(1))), _i32(16))
        is_nan = builder.icmp_unsigned(">", builder.and_(u, _i32(0x7FFFFFFF)), _i32(0x7F800000))
        quiet_nan = builder.or_(builder.and_(high, _i32(0x8000)), _i32(0x7FC0))
        return builder.trunc(builder.select(is_nan, quiet_nan, rounded), ir.IntType(16))

    return sig, codegen


@intrinsic
def _bf16_to_f32(typingctx, h):
    """bfloat16 bits -> float32 (exact: the top half of the float32), in 32-bit integer IR (see _f32_to_bf16)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _i32(16)), ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_to_f16(typingctx, x):
    """float32 -> IEEE half bits, round-to-nearest-even: ``_casts.f32_bits_to_f16`` in 32-bit integer IR, its
    five cases (NaN, overflow, normal, underflow to zero, subnormal) computed side by side and picked with
    selects, so the loop vectorises (see _f32_to_bf16)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        u = builder.bitcast(args[0], _I32)
        sign = builder.and_(builder.lshr(u, _i32(16)), _i32(0x8000))
        a = builder.and_(u, _i32(0x7FFFFFFF))
        # normal half: rebias the exponent, round the 13 dropped bits to nearest even
        lsb = builder.and_(builder.lshr(a, _i32(13)), _i32(1))
        normal = builder.sub(builder.lshr(builder.add(builder.add(a, _i32(0xFFF)), lsb), _i32(13)), _i32(0x1C000))
        # subnormal half: shift the 24-bit significand right by 126 - exponent (14..24 in this range; other
        # lanes shift by 14, so that no shift reaches 32 bits, which LLVM leaves undefined), rounding to even
        in_subnormal_range = builder.and_(
            builder.icmp_unsigned(">", a, _i32(0x33000000)), builder.icmp_unsigned("<", a, _i32(0x38800000))
        )
        shift = builder.select(in_subnormal_range, builder.sub(_i32(126), builder.lshr(a, _i32(23))), _i32(14))
        m = builder.or_(builder.and_(a, _i32(0x7FFFFF)), _i32(0x800000))
        half_ulp = builder.sub(builder.shl(_i32(1), builder.sub(shift, _i32(1))), _i32(1))
        odd = builder.and_(builder.lshr(m, shift), _i32(1))
        subnormal = builder.lshr(builder.add(builder.add(m, half_ulp), odd), shift)
        r = builder.select(builder.icmp_unsigned("<=", a, _i32(0x33000000)), _i32(0), subnormal)
        r = builder.select(builder.icmp_unsigned(">=", a, _i32(0x38800000)), normal, r)
        r = builder.select(builder.icmp_unsigned(">=", a, _i32(0x477FF000)), _i32(0x7C00), r)
        r = builder.select(builder.icmp_unsigned(">", a, _i32(0x7F800000)), _i32(0x7E00), r)
        return builder.trunc(builder.or_(sign, r), ir.IntType(16))

    return sig, codegen


@intrinsic
def _f16_to_f32(typingctx, h):
    """IEEE half bits -> float32 (exact): ``_casts.f16_to_f32_bits`` in 32-bit integer IR, the subnormal
    normalisation done with a count of leading zeros instead of a loop (see _f32_to_f16)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        h = builder.zext(args[0], _I32)
        sign = builder.shl(builder.and_(h, _i32(0x8000)), _i32(16))
        e = builder.and_(builder.lshr(h, _i32(10)), _i32(0x1F))
        m = builder.and_(h, _i32(0x3FF))
        m_bits = builder.shl(m, _i32(13))
        inf_nan = builder.or_(_i32(0x7F800000), m_bits)
        normal = builder.or_(builder.shl(builder.add(e, _i32(112)), _i32(23)), m_bits)
        # subnormal: shift the leading one of m to bit 10 (s = 1..10 places), lowering the exponent as much
        s = builder.sub(builder.ctlz(m, ir.Constant(ir.IntType(1), 0)), _i32(21))
        subnormal = builder.or_(
            builder.shl(builder.sub(_i32(113), s), _i32(23)),
            builder.shl(builder.and_(builder.shl(m, s), _i32(0x3FF)), _i32(13)),
        )
        r = builder.select(builder.icmp_unsigned("==", m, _i32(0)), _i32(0), subnormal)
        r = builder.select(builder.icmp_unsigned("!=", e, _i32(0)), normal, r)
        r = builder.select(builder.icmp_unsigned("==", e, _i32(0x1F)), inf_nan, r)
        return builder.bitcast(builder.or_(sign, r), ir.FloatType())

    return sig, codegen


# Element loaders/storers, one per dtype code, all with the same signature
# (float32 view, uint16 view, index[, value]). ``_make_seg`` below builds one
# segment loop per (src, dst) dtype pair from them: each pair gets its own
# branch-free inner loop that LLVM can vectorise, while the kernel keeps one
# external signature (one compile, one cache entry).
@njit(inline="always")
def _ld_f32(af, a16, i):
    return af[i]


@njit(inline="always")
def _ld_bf16(af, a16, i):
    return _bf16_to_f32(a16[i])


@njit(inline="always")
def _ld_f16(af, a16, i):
    return _f16_to_f32(a16[i])


@njit(inline="always")
def _st_f32(af, a16, i, v):
    af[i] = v


@njit(inline="always")
def _st_bf16(af, a16, i, v):
    a16[i] = _f32_to_bf16(v)


@njit(inline="always")
def _st_f16(af, a16, i, v):
    a16[i] = _f32_to_f16(v)


def _make_seg(ld, st, ldd):
    """Specialised segment loop for one (load, store) dtype pair.

    ``ld``/``st``/``ldd`` are closure constants (not arguments) so the calls are
    static and the kernel stays cacheable on disk.
    """

    @njit
    def seg(sf, s16, df, d16, n, has_div, div, acc):
        # sf/s16/df/d16 are already sliced to the segment, so indices run from 0 and
        # numba can drop its negative-index wraparound checks (which block SIMD).
        if acc and has_div:
            for j in range(n):
                st(df, d16, j, ldd(df, d16, j) + ld(sf, s16, j) / div)
        elif acc:
            for j in range(n):
                st(df, d16, j, ldd(df, d16, j) + ld(sf, s16, j))
        elif has_div:
            for j in range(n):
                st(df, d16, j, ld(sf, s16, j) / div)
        else:
            for j in range(n):
                st(df, d16, j, ld(sf, s16, j))

    return seg


_LD = (_ld_f32, _ld_bf16, _ld_f16)
_ST = (_st_f32, _st_bf16, _st_f16)
_seg00, _seg01, _seg02 = (_make_seg(_LD[0], _ST[d], _LD[d]) for d in range(3))
_seg10, _seg11, _seg12 = (_make_seg(_LD[1], _ST[d], _LD[d]) for d in range(3))
_seg20, _seg21, _seg22 = (_make_seg(_LD[2], _ST[d], _LD[d]) for d in range(3))


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
    if nc > 0:
        # Slicing the unused 1-element dummy view just yields an empty slice.
        a_f = sf[so : so + nc]
        a_h = s16[so : so + nc]
        o_f = df[do : do + nc]
        o_h = d16[do : do + nc]
        if sc == dc and not has_div and not acc:
            # Same dtype: move the bits, never round-trip through float.
            if sc == 0:
                _copy_elements(df, do, sf, so, nc)
            else:
                _copy_elements(d16, do, s16, so, nc)
        elif sc == 0:
            if dc == 0:
                _seg00(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
            elif dc == 1:
                _seg01(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
            else:
                _seg02(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
        elif sc == 1:
            if dc == 0:
                _seg10(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
            elif dc == 1:
                _seg11(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
            else:
                _seg12(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
        else:
            if dc == 0:
                _seg20(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
            elif dc == 1:
                _seg21(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
            else:
                _seg22(a_f, a_h, o_f, o_h, nc, has_div, div, acc)
    if nz > 0:
        if dc == 0:
            _zero_elements(df, do + nc, nz)
        else:
            _zero_elements(d16, do + nc, nz)


def _kernel_body(blk, sf, s16, sbase, sc, df, d16, dbase, dc, has_div, div, acc):
    for b in prange(blk.shape[0]):
        _block(b, blk, sf, s16, sbase, sc, df, d16, dbase, dc, has_div, div, acc)


def _renamed(fn, name: str):
    """``fn`` as a new function object called ``name``. numba's disk cache files its entries by function name
    and signature, not by compile options: compiled from one function, the serial kernel would load the
    parallel one's cache entry (or the reverse), and what runs would depend on which was compiled first."""
    copy = types_module.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = name
    return copy


# Same body twice: the parallel one for real buffers, the serial one for tiny
# ones (see SERIAL_THRESHOLD). Both cached on disk (__pycache__/*.nbi, *.nbc), under
# different names (see _renamed). Running the serial one for every buffer when numba has
# one thread was measured and dropped: same step time, higher peak (docs/kernels.md).
# error_model="numpy": x / 0 gives inf/nan like torch instead of raising.
_kernel_parallel = njit(parallel=True, cache=True, nogil=True, error_model="numpy")(_kernel_body)
_kernel_serial = njit(parallel=False, cache=True, nogil=True, error_model="numpy")(
    _renamed(_kernel_body, "_kernel_body_serial")
)


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
        _readonly(blk),
        _DUMMY_F32 if src_f32 is None else src_f32,
        _DUMMY_U16 if src_u16 is None else src_u16,
        _readonly(src_base),
        np.int64(src_code),
        _DUMMY_F32 if dst_f32 is None else dst_f32,
        _DUMMY_U16 if dst_u16 is None else dst_u16,
        _readonly(dst_base),
        np.int64(dst_code),
        divisor is not None,
        np.float32(1.0 if divisor is None else divisor),
        bool(accumulate),
    )


def _readonly(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only array. numba compiles one specialization per array mutability: passing the
    index tables always read-only (as the layout caches them) keeps it to the one ``warm`` compiled, instead
    of compiling new ones, with their time and memory, during the first training step."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


def warm() -> None:
    """Compile (or load from numba's disk cache) both CPU kernel variants.

    >>> warm()   # idempotent; a few ms once cached
    """
    if _kernel_parallel.signatures and _kernel_serial.signatures:
        return
    blk = _readonly(np.zeros((1, 5), np.int64))
    base = _readonly(np.zeros(1, np.int64))
    f = np.zeros(1, np.float32)
    h = np.zeros(1, np.uint16)
    for kernel in (_kernel_parallel, _kernel_serial):
        kernel(blk, f, h, base, np.int64(0), f, h, base, np.int64(0), False, np.float32(1.0), False)


def num_threads() -> int:
    """numba's CPU thread count (what ``prange`` uses)."""
    return numba.get_num_threads()
