"""The four public staging ops: validation, then dispatch to cuda / cpu / reference.

Validation is metadata-only (shapes, dtypes, devices, contiguity) so it is cheap
enough to run every step, and it runs before any kernel launch: the kernels have
no bounds checks, so a mismatch must never reach them.

Example::

    >>> import torch
    >>> from numba_kernels import GroupLayout, reduce_scatter_copy_in, post_reduce
    >>> layout = GroupLayout([(3, 2), (5,)], world_size=2)
    >>> rs_in = torch.empty(2, layout.shard_numel, dtype=torch.bfloat16)
    >>> reduce_scatter_copy_in(layout, [torch.ones(3, 2), torch.ones(5)], rs_in, predivide=2.0)
    >>> grad = torch.zeros(layout.shard_numel)
    >>> post_reduce(layout, rs_in[0], grad, postdivide=1.0, accumulate=True)
    >>> grad.tolist()   # rank 0's shard: 2 of the 3 rows of the first parameter, 3 of the 5 of the second
    [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import cpu as _cpu
from . import reference as _ref
from ._casts import DTYPE_CODES, REFERENCE_ONLY_DTYPES
from .layout import GroupLayout

_IMPLS = ("auto", "cpu", "cuda", "reference")


def _opaque(fn):
    """torch.compile must not trace into the kernels: they read raw pointers through numpy views, which dynamo
    cannot follow ("Expected np.nditer base"). Under compilation each op is one opaque eager call (a graph
    break); in eager code the op is called directly, without the ~7 us of a ``torch.compiler.disable`` call."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return op


_TYPESTR = {4: "<f4", 2: "<u2"}


# --------------------------------------------------------------------------- validation


def _fmt(shape: Any) -> str:
    return str(tuple(shape))


def _check_tensor(op: str, name: str, t: Any, device: torch.device | None) -> torch.device:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_CODES and t.dtype not in REFERENCE_ONLY_DTYPES:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16, float64")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous (stride {t.stride()}); pass .contiguous()")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the other buffers are on {device}")
    return t.device


def _check_flat(op: str, name: str, t: torch.Tensor, shapes: tuple[tuple[int, ...], ...]) -> None:
    if tuple(t.shape) not in shapes:
        want = " or ".join(_fmt(s) for s in shapes)
        raise ValueError(f"{op}: {name} has shape {_fmt(t.shape)} but the layout expects {want}")


def _check_list(
    op: str,
    name: str,
    ts: Any,
    layout: GroupLayout,
    expected: Any,
    device: torch.device | None,
    allow_none: bool = False,
) -> tuple[torch.dtype | None, torch.device | None]:
    if not isinstance(ts, (list, tuple)):
        raise ValueError(f"{op}: {name} must be a tensor or a list of tensors, got {type(ts).__name__}")
    if len(ts) != layout.num_params:
        raise ValueError(f"{op}: {name} has {len(ts)} entries but the layout has {layout.num_params} params")
    dtype = None
    for i, t in enumerate(ts):
        if t is None and allow_none:
            continue
        device = _check_tensor(op, f"{name}[{i}]", t, device)
        want = expected(i)
        if t.shape != want:
            raise ValueError(f"{op}: {name}[{i}] has shape {_fmt(t.shape)} but the layout expects {_fmt(want)}")
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            raise ValueError(f"{op}: {name}[{i}] has dtype {t.dtype} but {name}[0..] have {dtype}")
    return dtype, device


def _resolve_impl(op: str, impl: str, device: torch.device | None, dtypes: dict[str, torch.dtype | None]) -> str:
    """The implementation to run: ``auto`` picks the device's kernels, or torch's reference when one of the
    named tensors' ``dtypes`` has no kernel (float64); an explicit kernel for such a dtype raises."""
    if impl not in _IMPLS:
        raise ValueError(f"{op}: impl={impl!r} is not one of {_IMPLS}")
    no_kernel = {name: dt for name, dt in dtypes.items() if dt is not None and dt not in DTYPE_CODES}
    if no_kernel and impl in ("auto", "reference"):
        return "reference"
    if no_kernel:
        name, dt = next(iter(no_kernel.items()))
        raise ValueError(
            f"{op}: {name} has dtype {dt}, which no kernel handles (float32, bfloat16, float16); "
            "impl='auto' or 'reference' copies it with torch"
        )
    dev_type = "cpu" if device is None else device.type
    if impl == "auto":
        return "cuda" if dev_type == "cuda" else "cpu"
    if impl == "cpu" and dev_type != "cpu":
        raise ValueError(f"{op}: impl='cpu' needs CPU tensors, got {device}")
    if impl == "cuda" and dev_type != "cuda":
        from numba import config

        if not config.ENABLE_CUDASIM:  # the simulator runs CUDA kernels on CPU arrays
            raise ValueError(f"{op}: impl='cuda' needs CUDA tensors, got {device}")
    return impl


# --------------------------------------------------------------------------- buffer views


class _Span:
    """numpy view of raw memory ``[ptr, ptr + n * itemsize)`` via ``__array_interface__``."""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, n: int, typestr: str) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": typestr, "version": 3}


def _flat_side(t: torch.Tensor) -> tuple[int, int, int]:
    """(pointer, numel, dtype code) of a contiguous tensor."""
    return t.data_ptr(), t.numel(), DTYPE_CODES[t.dtype]


def _list_side(ts: Sequence[torch.Tensor | None], code: int, itemsize: int) -> tuple[int, int, np.ndarray]:
    """One span covering every tensor of a list: (pointer, numel, per-tensor element offsets; -1 = None).

    The kernels then address every tensor through one array, which is what lets a
    list of separately allocated tensors be handled by a single launch.
    """
    live = [(i, t.data_ptr(), t.numel()) for i, t in enumerate(ts) if t is not None and t.numel() > 0]
    base = np.zeros(max(1, len(ts)), np.int64)
    for i, t in enumerate(ts):
        if t is None:
            base[i] = -1
    if not live:
        return 0, 0, base
    lo = min(p for _, p, _ in live)
    hi = max(p + n * itemsize for _, p, n in live)
    for i, p, _ in live:
        base[i] = (p - lo) // itemsize
    return lo, (hi - lo) // itemsize, base


def _np_views(ptr: int, n: int, code: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    if n == 0:
        return None, None
    if code == 0:
        return np.asarray(_Span(ptr, n, "<f4")), None
    return None, np.asarray(_Span(ptr, n, "<u2"))


def _launch(
    impl: str,
    layout: GroupLayout,
    device: torch.device,
    table: np.ndarray,
    src: tuple[int, int, int],
    src_base: np.ndarray,
    dst: tuple[int, int, int],
    dst_base: np.ndarray,
    divisor: float | None,
    accumulate: bool,
    total: int,
) -> None:
    if table.shape[0] == 0:
        return
    if impl == "cpu" or (impl == "cuda" and device.type != "cuda"):
        sf, s16 = _np_views(*src)
        df, d16 = _np_views(*dst)
        if impl == "cpu":
            _cpu.run_blocks(table, sf, s16, src_base, src[2], df, d16, dst_base, dst[2], divisor, accumulate, total)
        else:
            from . import cuda as _cuda

            _cuda.run_blocks_sim(table, sf, s16, src_base, src[2], df, d16, dst_base, dst[2], divisor, accumulate)
        return
    from . import cuda as _cuda

    _cuda.run_blocks_device(layout, device, table, src, src_base, dst, dst_base, divisor, accumulate)


def _divisor(op: str, name: str, value: float | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{op}: {name} must be a number or None, got {value!r}") from e


# --------------------------------------------------------------------------- public ops


@_opaque
def all_gather_copy_in(
    layout: GroupLayout,
    sharded: torch.Tensor | Sequence[torch.Tensor],
    out: torch.Tensor,
    rank: int,
    *,
    impl: str = "auto",
) -> None:
    """Copy (and cast) this rank's flat shard into row ``rank`` of the all-gather buffer, in one pass.

    ``sharded`` is the flat shard ``(shard_numel,)`` (padding inside) or a list of
    per-param local shards ``(local_rows, *shape[1:])`` whose padding is zero-filled.
    ``out`` is ``(world_size, shard_numel)`` or flat, in the compute dtype; only
    row ``rank`` is written.

    >>> import torch
    >>> layout = GroupLayout([(3,)], world_size=2)
    >>> out = torch.zeros(2, layout.shard_numel, dtype=torch.bfloat16)
    >>> all_gather_copy_in(layout, [torch.tensor([3.0])], out, rank=1)
    >>> out[1].tolist()
    [3.0, 0.0]
    """
    op = "all_gather_copy_in"
    ws, S = layout.world_size, layout.shard_numel
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < ws:
        raise ValueError(f"{op}: rank {rank!r} is out of range [0, {ws})")
    rank = int(rank)
    device = _check_tensor(op, "out", out, None)
    _check_flat(op, "out", out, ((ws, S), (ws * S,)))
    flat = isinstance(sharded, torch.Tensor)
    if flat:
        _check_tensor(op, "sharded", sharded, device)
        _check_flat(op, "sharded", sharded, ((S,),))
        src_dtype = sharded.dtype
    else:
        src_dtype, _ = _check_list(op, "sharded", sharded, layout, lambda i: layout.local_shape(i, rank), device)
    impl = _resolve_impl(op, impl, device, {"out": out.dtype, "sharded": src_dtype})
    if impl == "reference":
        _ref.all_gather_copy_in(layout, sharded, out, rank)
        return
    dst = _flat_side(out)
    if flat:
        table = layout._table("agin_flat")
        src, src_base = _flat_side(sharded), layout._const("zero")
        dst_base = layout._const("row", rank)
    else:
        table = layout._table("agin_list", rank)
        code = DTYPE_CODES[sharded[0].dtype] if sharded else 0
        itemsize = 4 if code == 0 else 2
        ptr, n, src_base = _list_side(sharded, code, itemsize)
        src = (ptr, n, code)
        dst_base = layout._const("row_shard", rank)
    _launch(impl, layout, device, table, src, src_base, dst, dst_base, None, False, S)


@_opaque
def all_gather_copy_out(
    layout: GroupLayout,
    gathered: torch.Tensor,
    out: torch.Tensor | Sequence[torch.Tensor],
    *,
    impl: str = "auto",
) -> None:
    """Unpad the all-gather result into the unsharded parameters, in one pass (same dtype, no cast).

    ``gathered`` is ``(world_size, shard_numel)`` or flat; ``out`` is the flat
    unsharded buffer ``(unsharded_numel,)`` or a list of full-shape parameters.

    >>> import torch
    >>> layout = GroupLayout([(3,)], world_size=2)
    >>> full = torch.empty(3)
    >>> all_gather_copy_out(layout, torch.tensor([[1.0, 2.0], [3.0, 0.0]]), full)
    >>> full.tolist()
    [1.0, 2.0, 3.0]
    """
    op = "all_gather_copy_out"
    ws, S = layout.world_size, layout.shard_numel
    device = _check_tensor(op, "gathered", gathered, None)
    _check_flat(op, "gathered", gathered, ((ws, S), (ws * S,)))
    flat = isinstance(out, torch.Tensor)
    if flat:
        _check_tensor(op, "out", out, device)
        _check_flat(op, "out", out, ((layout.unsharded_numel,),))
        out_dtype = out.dtype
    else:
        out_dtype, _ = _check_list(op, "out", out, layout, lambda i: layout.shapes[i], device)
    if out_dtype is not None and out_dtype != gathered.dtype:
        raise ValueError(f"{op}: out has dtype {out_dtype} but gathered has {gathered.dtype}; no cast here")
    impl = _resolve_impl(op, impl, device, {"gathered": gathered.dtype})
    if impl == "reference":
        _ref.all_gather_copy_out(layout, gathered, out)
        return
    table = layout._table("agout")
    src, src_base = _flat_side(gathered), layout._const("shard")
    code = DTYPE_CODES[gathered.dtype]
    if flat:
        dst, dst_base = _flat_side(out), layout._const("unsharded")
    else:
        ptr, n, dst_base = _list_side(out, code, gathered.element_size())
        dst = (ptr, n, code)
    _launch(impl, layout, device, table, src, src_base, dst, dst_base, None, False, ws * S)


@_opaque
def reduce_scatter_copy_in(
    layout: GroupLayout,
    grads: torch.Tensor | Sequence[torch.Tensor | None],
    out: torch.Tensor,
    *,
    predivide: float | None = None,
    impl: str = "auto",
) -> None:
    """Chunk, pad, pre-divide and cast the unsharded gradients into the reduce-scatter input, in one pass.

    ``grads``: a list of full-shape gradients (``None`` entries give zeros) or the
    flat unsharded buffer. ``out``: ``(world_size, shard_numel)`` (or flat) in the
    reduce dtype. Each value is ``round_once(float32(g) / predivide)``.

    >>> import torch
    >>> layout = GroupLayout([(3,)], world_size=2)
    >>> out = torch.empty(2, layout.shard_numel)
    >>> reduce_scatter_copy_in(layout, [torch.tensor([2.0, 4.0, 6.0])], out, predivide=2.0)
    >>> out.tolist()
    [[1.0, 2.0], [3.0, 0.0]]
    """
    op = "reduce_scatter_copy_in"
    ws, S = layout.world_size, layout.shard_numel
    device = _check_tensor(op, "out", out, None)
    _check_flat(op, "out", out, ((ws, S), (ws * S,)))
    flat = isinstance(grads, torch.Tensor)
    if flat:
        _check_tensor(op, "grads", grads, device)
        _check_flat(op, "grads", grads, ((layout.unsharded_numel,),))
        grads_dtype = grads.dtype
    else:
        grads_dtype, _ = _check_list(op, "grads", grads, layout, lambda i: layout.shapes[i], device, allow_none=True)
    predivide = _divisor(op, "predivide", predivide)
    impl = _resolve_impl(op, impl, device, {"out": out.dtype, "grads": grads_dtype})
    if impl == "reference":
        _ref.reduce_scatter_copy_in(layout, grads, out, predivide=predivide)
        return
    table = layout._table("rsin")
    dst, dst_base = _flat_side(out), layout._const("shard")
    if flat:
        src, src_base = _flat_side(grads), layout._const("unsharded")
    else:
        live = [g for g in grads if g is not None]
        code = DTYPE_CODES[live[0].dtype] if live else 0
        ptr, n, src_base = _list_side(grads, code, 4 if code == 0 else 2)
        src = (ptr, n, code)
    _launch(impl, layout, device, table, src, src_base, dst, dst_base, predivide, False, ws * S)


@_opaque
def post_reduce(
    layout: GroupLayout,
    reduced: torch.Tensor,
    out: torch.Tensor,
    *,
    postdivide: float | None = None,
    accumulate: bool = False,
    impl: str = "auto",
) -> None:
    """Post-divide, upcast and (optionally) accumulate the reduce-scatter output into the fp32 grad shard.

    ``out = (out if accumulate else 0) + float32(reduced) / postdivide``, in one pass.
    ``reduced``: ``(shard_numel,)`` in the reduce dtype; ``out``: ``(shard_numel,)``
    (float32 normally; bf16/fp16 are rounded once).

    >>> import torch
    >>> layout = GroupLayout([(3,)], world_size=2)
    >>> grad = torch.ones(layout.shard_numel)
    >>> post_reduce(layout, torch.tensor([4.0, 8.0]), grad, postdivide=4.0, accumulate=True)
    >>> grad.tolist()
    [2.0, 3.0]
    """
    op = "post_reduce"
    S = layout.shard_numel
    device = _check_tensor(op, "reduced", reduced, None)
    _check_flat(op, "reduced", reduced, ((S,),))
    _check_tensor(op, "out", out, device)
    _check_flat(op, "out", out, ((S,),))
    postdivide = _divisor(op, "postdivide", postdivide)
    impl = _resolve_impl(op, impl, device, {"reduced": reduced.dtype, "out": out.dtype})
    if impl == "reference":
        _ref.post_reduce(layout, reduced, out, postdivide=postdivide, accumulate=accumulate)
        return
    table = layout._table("post")
    zero = layout._const("zero")
    _launch(
        impl, layout, device, table, _flat_side(reduced), zero, _flat_side(out), zero, postdivide, bool(accumulate), S
    )
