"""CUDA kernel (``numba.cuda``): the same block-table pass as ``cpu.py``, on torch's current stream.

Imported lazily by ``ops.py`` (only when a CUDA tensor or ``impl="cuda"`` shows
up), so machines without CUDA never touch numba.cuda. Tensors are handed to
numba through ``__cuda_array_interface__`` (no copies, no numba allocations);
the int64 block tables and per-param bases of the flat forms are torch tensors
cached on the layout per device. bf16/fp16 travel as uint16 bits and are
converted with the shared integer code in ``_casts.py``, so the results are
bit-identical to the CPU kernel.

Launch shape: one CUDA block per table row (grid-stride over rows), threads of
the block stride over the row's elements, so neighbouring threads touch
neighbouring addresses (coalesced) and one launch covers the whole group.

Under ``NUMBA_ENABLE_CUDASIM=1`` the very same kernel runs in numba's simulator
on numpy views of CPU tensors (``run_blocks_sim``); the two bit-cast primitives
are the only code that differs (libdevice on the GPU, numpy in the simulator).

Example (on a CUDA machine)::

    >>> import torch, numba_kernels as nk
    >>> layout = nk.GroupLayout([(5, 3)], world_size=2)
    >>> layout.warm("cuda", torch.bfloat16, torch.float32)  # needs CUDA  # doctest: +SKIP
    >>> shard = torch.randn(layout.shard_numel, device="cuda")  # needs CUDA  # doctest: +SKIP
    >>> ag = torch.empty(2, layout.shard_numel, dtype=torch.bfloat16, device="cuda")  # needs CUDA  # doctest: +SKIP
    >>> nk.all_gather_copy_in(layout, shard, ag, rank=0)   # impl="auto" -> this module; needs CUDA  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import torch
from numba import config, cuda

from . import _casts

SIM = bool(config.ENABLE_CUDASIM)
THREADS = 32 if SIM else 256
MAX_GRID = 4 if SIM else 8192

if SIM:

    def _f32_to_bits(x):
        return int(np.asarray(x, dtype=np.float32).view(np.uint32))

    def _bits_to_f32(u):
        return np.asarray(u & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _f32_to_bits(x):
        return np.int64(libdevice.float_as_int(x)) & 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def _bits_to_f32(u):
        return libdevice.int_as_float(np.int32(u))


_to_bf16 = cuda.jit(device=True, inline=True)(_casts.f32_bits_to_bf16)
_from_bf16 = cuda.jit(device=True, inline=True)(_casts.bf16_to_f32_bits)
_to_f16 = cuda.jit(device=True, inline=True)(_casts.f32_bits_to_f16)
_from_f16 = cuda.jit(device=True, inline=True)(_casts.f16_to_f32_bits)


@cuda.jit(device=True, inline=True)
def _load(code, af, a16, i):
    if code == 0:
        return af[i]
    if code == 1:
        return _bits_to_f32(_from_bf16(np.int64(a16[i])))
    return _bits_to_f32(_from_f16(np.int64(a16[i])))


@cuda.jit(device=True, inline=True)
def _store(code, af, a16, i, v):
    if code == 0:
        af[i] = v
    elif code == 1:
        a16[i] = _to_bf16(_f32_to_bits(v))
    else:
        a16[i] = _to_f16(_f32_to_bits(v))


@cuda.jit(cache=not SIM)
def _kernel(blk, sf, s16, sbase, sc, df, d16, dbase, dc, has_div, div, acc):
    plain = not has_div and not acc
    b = cuda.blockIdx.x
    while b < blk.shape[0]:
        p = blk[b, 0]
        sb = sbase[p]
        so = sb + blk[b, 1]
        do = dbase[p] + blk[b, 2]
        nc = blk[b, 3]
        nz = blk[b, 4]
        if sb < 0:  # missing gradient (None): zeros
            nz += nc
            nc = 0
        j = cuda.threadIdx.x
        while j < nc + nz:
            if j >= nc:
                if dc == 0:
                    df[do + j] = 0.0
                else:
                    d16[do + j] = 0
            elif plain and sc == dc:  # same dtype: move bits, never round-trip through float
                if sc == 0:
                    df[do + j] = sf[so + j]
                else:
                    d16[do + j] = s16[so + j]
            else:
                v = _load(sc, sf, s16, so + j)
                if has_div:
                    v = v / div
                if acc:
                    v = v + _load(dc, df, d16, do + j)
                _store(dc, df, d16, do + j, v)
            j += cuda.blockDim.x
        b += cuda.gridDim.x


def _grid(nblk: int) -> int:
    return max(1, min(nblk, MAX_GRID))


def run_blocks_sim(
    blk: np.ndarray,
    sf: np.ndarray | None,
    s16: np.ndarray | None,
    sbase: np.ndarray,
    sc: int,
    df: np.ndarray | None,
    d16: np.ndarray | None,
    dbase: np.ndarray,
    dc: int,
    divisor: float | None,
    accumulate: bool,
) -> None:
    """Run the kernel in numba's CUDA simulator on numpy views (``NUMBA_ENABLE_CUDASIM=1`` only)."""
    # Wrap as simulator "device arrays" so the simulator neither copies them in
    # and out (spans may cover memory between separate tensors) nor needs them writeable.
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as W

    f1, h1 = np.zeros(1, np.float32), np.zeros(1, np.uint16)
    _kernel[_grid(blk.shape[0]), THREADS](
        W(blk),
        W(f1 if sf is None else sf),
        W(h1 if s16 is None else s16),
        W(sbase),
        np.int64(sc),
        W(f1 if df is None else df),
        W(h1 if d16 is None else d16),
        W(dbase),
        np.int64(dc),
        divisor is not None,
        np.float32(1.0 if divisor is None else divisor),
        bool(accumulate),
    )


_STREAMS: dict[int, object] = {}
_DUMMIES: dict[tuple[str, int], object] = {}


def _stream(device: torch.device):
    handle = torch.cuda.current_stream(device).cuda_stream
    s = _STREAMS.get(handle)
    if s is None:
        s = _STREAMS[handle] = cuda.external_stream(handle)
    return s


def _dummy(device: torch.device, code: int):
    key = (str(device), code)
    d = _DUMMIES.get(key)
    if d is None:
        t = torch.zeros(1, dtype=torch.float32 if code == 0 else torch.int16, device=device)
        if code != 0:
            t = t.view(torch.uint16) if hasattr(torch, "uint16") else t
        d = _DUMMIES[key] = (t, cuda.as_cuda_array(t.detach()))
    return d[1]


def _views(ptr: int, n: int, code: int, device: torch.device):
    """(float32 view, uint16 view) of device memory ``[ptr, ptr + n * itemsize)``."""
    if n == 0:
        return _dummy(device, 0), _dummy(device, 1)
    desc = {"shape": (n,), "typestr": "<f4" if code == 0 else "<u2", "data": (ptr, False), "version": 3}
    arr = cuda.from_cuda_array_interface(desc, owner=None, sync=False)
    return (arr, _dummy(device, 1)) if code == 0 else (_dummy(device, 0), arr)


def _base(layout, arr: np.ndarray, device: torch.device):
    # Layout-owned arrays are read-only and cached per device; per-call arrays
    # (list forms: offsets of each tensor inside the span) are uploaded per call.
    if not arr.flags.writeable:
        t = layout._device_tensor(arr, device)
    else:
        t = torch.from_numpy(arr).to(device, non_blocking=True)
    return cuda.as_cuda_array(t)


def run_blocks_device(
    layout,
    device: torch.device,
    table: np.ndarray,
    src: tuple[int, int, int],
    src_base: np.ndarray,
    dst: tuple[int, int, int],
    dst_base: np.ndarray,
    divisor: float | None,
    accumulate: bool,
) -> None:
    """Launch the kernel on ``device``'s current torch stream (asynchronous, like any torch op)."""
    with cuda.gpus[device.index if device.index is not None else torch.cuda.current_device()]:
        blk = cuda.as_cuda_array(layout._device_tensor(table, device))
        sf, s16 = _views(*src, device)
        df, d16 = _views(*dst, device)
        _kernel[_grid(table.shape[0]), THREADS, _stream(device)](
            blk,
            sf,
            s16,
            _base(layout, src_base, device),
            np.int64(src[2]),
            df,
            d16,
            _base(layout, dst_base, device),
            np.int64(dst[2]),
            divisor is not None,
            np.float32(1.0 if divisor is None else divisor),
            bool(accumulate),
        )


def warm(device: torch.device) -> None:
    """Compile (or load from the on-disk cache) the CUDA kernel for ``device``; idempotent."""
    if SIM or getattr(warm, "_done", set()).__contains__(str(device)):
        return
    blk = torch.zeros(1, 5, dtype=torch.int64, device=device)  # one empty row: launches, writes nothing
    base = torch.zeros(1, dtype=torch.int64, device=device)
    with cuda.gpus[device.index if device.index is not None else torch.cuda.current_device()]:
        f, h = _dummy(device, 0), _dummy(device, 1)
        b = cuda.as_cuda_array(base)
        _kernel[1, THREADS, _stream(device)](
            cuda.as_cuda_array(blk), f, h, b, np.int64(0), f, h, b, np.int64(0), False, np.float32(1.0), False
        )
    torch.cuda.current_stream(device).synchronize()
    warm._done = getattr(warm, "_done", set()) | {str(device)}


# The argument types every kernel of this module is launched with (``run_blocks_device`` and ``warm``:
# C-contiguous device arrays from ``__cuda_array_interface__``, numpy scalars), one entry per
# ``cuda.jit`` kernel. ``compile_ptx`` compiles exactly these, so a kernel missing here fails the PTX test.
LAUNCH_SIGNATURES: dict[str, str] = {
    "_kernel": (
        "void(int64[:, ::1], float32[::1], uint16[::1], int64[::1], int64,"
        " float32[::1], uint16[::1], int64[::1], int64, boolean, float32, boolean)"
    ),
}


def compile_ptx(cc: tuple[int, int]) -> dict[str, str]:
    """Compile every kernel of this module to PTX for compute capability ``cc``; no GPU needed.

    Uses numba's libNVVM (the ``nvidia-cuda-nvcc-cu12`` wheel that ``numba-cuda[cu12]`` installs) with
    each kernel's own ``cuda.jit`` options and its launch signature from ``LAUNCH_SIGNATURES``; any
    compile error propagates. Not available under ``NUMBA_ENABLE_CUDASIM=1`` (the simulator compiles nothing).

    Example::

        >>> from numba_kernels import cuda as kc
        >>> ptx = kc.compile_ptx((9, 0))
        >>> ".target sm_90" in ptx["_kernel"]
        True
    """
    if SIM:
        raise RuntimeError("numba_kernels.cuda.compile_ptx: unset NUMBA_ENABLE_CUDASIM (the simulator has no compiler)")
    out = {}
    for name, sig in LAUNCH_SIGNATURES.items():
        kernel = globals()[name]
        opts = kernel.targetoptions
        ptx, _ = cuda.compile_ptx(
            kernel.py_func,
            sig,
            cc=cc,
            debug=opts.get("debug"),
            lineinfo=opts.get("lineinfo", False),
            fastmath=opts.get("fastmath", False),
            opt=opts.get("opt"),
        )
        out[name] = ptx
    return out
