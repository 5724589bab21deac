"""``GroupLayout``: the static geometry of one FSDP parameter group.

Built once per parameter group and reused every step: offsets of every
parameter in the flat shard buffer, the all-gather / reduce-scatter buffers and
the unsharded flat buffer, plus the precomputed *block tables* the kernels walk.

Sharding follows ``torch.chunk`` on dim 0 (as torch FSDP2 does):
``rows_per_shard = ceil(dim0 / world_size)`` and rank ``r`` holds rows
``[r * rows_per_shard, min(dim0, (r + 1) * rows_per_shard))``, possibly none.
Every rank's shard of parameter ``i`` is padded to
``padded_shard_numels[i] = rows_per_shard[i] * prod(shape[1:])``.

Block table rows are ``(param, src_rel, dst_rel, ncopy, nzero)``: copy ``ncopy``
elements from ``src_base[param] + src_rel`` to ``dst_base[param] + dst_rel``, then
zero the ``nzero`` elements after them. The per-param bases come from the layout
(flat buffers) or from the tensors' addresses (list forms), so one table serves
both forms.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# Segments are cut into blocks of at most this many elements (128 KB of fp32) so
# that the parallel loop balances and each CUDA thread block has enough work.
BLOCK = 1 << 15


def _split_segments(segs: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """Cut segments ``(param, src_rel, dst_rel, ncopy, nzero)`` into blocks of <= ``block`` elements."""
    segs = segs[(segs[:, 3] + segs[:, 4]) > 0]
    if len(segs) == 0:
        return np.zeros((0, 5), np.int64)
    total = segs[:, 3] + segs[:, 4]
    nblk = (total + block - 1) // block
    rep = np.repeat(np.arange(len(segs)), nblk)
    # position of each block inside its segment
    first = np.cumsum(nblk) - nblk
    start = (np.arange(len(rep)) - first[rep]) * block
    s = segs[rep]
    end = np.minimum(start + block, total[rep])
    ncopy = np.clip(np.minimum(end, s[:, 3]) - start, 0, None)
    out = np.empty((len(rep), 5), np.int64)
    out[:, 0] = s[:, 0]
    out[:, 1] = s[:, 1] + np.minimum(start, s[:, 3])
    out[:, 2] = s[:, 2] + start
    out[:, 3] = ncopy
    out[:, 4] = (end - start) - ncopy
    return np.ascontiguousarray(out)


class GroupLayout:
    """Immutable layout of one parameter group sharded on dim 0 over ``world_size`` ranks.

    Example::

        >>> layout = GroupLayout([(5, 3), (4,)], world_size=4)
        >>> layout.rows_per_shard, layout.padded_shard_numels, layout.shard_numel
        ((2, 1), (6, 1), 7)
        >>> layout.shard_offsets.tolist(), layout.unsharded_offsets.tolist(), layout.unsharded_numel
        ([0, 6], [0, 15], 19)
        >>> [layout.local_rows(0, r) for r in range(4)]
        [2, 2, 1, 0]
    """

    __slots__ = (
        "world_size",
        "shapes",
        "numels",
        "rows_per_shard",
        "inner_numels",
        "padded_shard_numels",
        "shard_offsets",
        "shard_numel",
        "unsharded_offsets",
        "unsharded_numel",
        "_local_rows",
        "_cache",
        "_lock",
        "_frozen",
    )

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]], world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"GroupLayout: world_size must be an int >= 1, got {world_size!r}")
        norm: list[torch.Size] = []
        for i, s in enumerate(shapes):
            try:
                size = torch.Size(tuple(int(d) for d in s))
            except TypeError as e:
                raise ValueError(f"GroupLayout: shapes[{i}] = {s!r} is not a sequence of ints") from e
            if len(size) == 0:
                raise ValueError(
                    f"GroupLayout: shapes[{i}] is 0-dim; view 0-dim parameters as shape (1,) before building"
                )
            if any(d < 0 for d in size):
                raise ValueError(f"GroupLayout: shapes[{i}] = {tuple(size)} has a negative dimension")
            norm.append(size)
        n = len(norm)
        numels = tuple(math.prod(s) for s in norm)
        inner = tuple(math.prod(s[1:]) for s in norm)
        rows = tuple(-(-s[0] // world_size) for s in norm)
        padded = tuple(r * c for r, c in zip(rows, inner))
        local = np.zeros((n, world_size), np.int64)
        for i, s in enumerate(norm):
            for r in range(world_size):
                local[i, r] = max(0, min(s[0], (r + 1) * rows[i]) - r * rows[i])
        shard_off = np.zeros(n, np.int64)
        if n:
            shard_off[1:] = np.cumsum(padded)[:-1]
        unsh_off = np.zeros(n, np.int64)
        if n:
            unsh_off[1:] = np.cumsum(numels)[:-1]
        shard_off.setflags(write=False)
        unsh_off.setflags(write=False)
        local.setflags(write=False)
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "shapes", tuple(norm))
        object.__setattr__(self, "numels", numels)
        object.__setattr__(self, "rows_per_shard", rows)
        object.__setattr__(self, "inner_numels", inner)
        object.__setattr__(self, "padded_shard_numels", padded)
        object.__setattr__(self, "shard_offsets", shard_off)
        object.__setattr__(self, "shard_numel", int(sum(padded)))
        object.__setattr__(self, "unsharded_offsets", unsh_off)
        object.__setattr__(self, "unsharded_numel", int(sum(numels)))
        object.__setattr__(self, "_local_rows", local)
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"GroupLayout is immutable (tried to set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"GroupLayout is immutable (tried to delete {name!r})")

    def __repr__(self) -> str:
        return (
            f"GroupLayout(params={len(self.shapes)}, world_size={self.world_size}, "
            f"shard_numel={self.shard_numel}, unsharded_numel={self.unsharded_numel})"
        )

    @property
    def num_params(self) -> int:
        """Number of parameters in the group.

        >>> GroupLayout([(2,), (3, 3)], 2).num_params
        2
        """
        return len(self.shapes)

    def local_rows(self, i: int, rank: int) -> int:
        """Valid (unpadded) rows of parameter ``i`` held by ``rank``.

        >>> GroupLayout([(5,)], 4).local_rows(0, 2)
        1
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"local_rows: rank {rank} out of range [0, {self.world_size})")
        return int(self._local_rows[i, rank])

    def local_shape(self, i: int, rank: int) -> torch.Size:
        """Shape of rank ``rank``'s unpadded shard of parameter ``i``.

        >>> GroupLayout([(5, 2)], 4).local_shape(0, 3)
        torch.Size([0, 2])
        """
        return torch.Size((self.local_rows(i, rank), *self.shapes[i][1:]))

    # ---- cached tables (internal; built lazily, then reused every step) ----

    def _cached(self, key: Any, build: Any) -> Any:
        cache = self._cache
        val = cache.get(key)
        if val is None:
            with self._lock:
                val = cache.get(key)
                if val is None:
                    val = build()
                    if isinstance(val, np.ndarray):
                        val.setflags(write=False)
                    cache[key] = val
        return val

    def _table(self, op: str, rank: int = 0) -> np.ndarray:
        """Block table for ``op`` in {"agin_flat", "agin_list", "agout", "rsin", "post"}."""
        return self._cached(("table", op, rank), lambda: self._build_table(op, rank))

    def _build_table(self, op: str, rank: int) -> np.ndarray:
        n, ws, S = self.num_params, self.world_size, self.shard_numel
        if op in ("agin_flat", "post"):
            return _split_segments(np.array([[0, 0, 0, S, 0]], np.int64))
        rows = np.asarray(self.rows_per_shard, np.int64)
        inner = np.asarray(self.inner_numels, np.int64)
        padded = np.asarray(self.padded_shard_numels, np.int64)
        if op == "agin_list":
            valid = self._local_rows[:, rank] * inner
            segs = np.stack([np.arange(n), np.zeros(n, np.int64), np.zeros(n, np.int64), valid, padded - valid], 1)
            return _split_segments(segs.astype(np.int64))
        # per (param, rank) segments
        p = np.repeat(np.arange(n, dtype=np.int64), ws)
        r = np.tile(np.arange(ws, dtype=np.int64), n)
        valid = self._local_rows.reshape(-1) * inner[p]
        unsh_rel = r * rows[p] * inner[p]  # relative to the param's start in the unsharded buffer
        ag_rel = r * S  # relative to the param's offset inside a shard row
        if op == "agout":
            segs = np.stack([p, ag_rel, unsh_rel, valid, np.zeros_like(p)], 1)
        elif op == "rsin":
            segs = np.stack([p, unsh_rel, ag_rel, valid, padded[p] - valid], 1)
        else:
            raise KeyError(op)
        return _split_segments(segs.astype(np.int64))

    def _const(self, name: str, rank: int = 0) -> np.ndarray:
        """Small per-param base arrays for the flat forms."""

        def build() -> np.ndarray:
            if name == "zero":
                return np.zeros(max(1, self.num_params), np.int64)
            if name == "shard":
                return self.shard_offsets.copy() if self.num_params else np.zeros(1, np.int64)
            if name == "unsharded":
                return self.unsharded_offsets.copy() if self.num_params else np.zeros(1, np.int64)
            if name == "row":  # start of rank's row in the all-gather buffer
                return np.array([rank * self.shard_numel], np.int64)
            if name == "row_shard":
                return (self.shard_offsets + rank * self.shard_numel).astype(np.int64)
            raise KeyError(name)

        return self._cached(("const", name, rank), build)

    def _device_tensor(self, arr: np.ndarray, device: torch.device) -> torch.Tensor:
        """``arr`` as an int64 tensor on ``device``, cached per (array, device) for the layout's life."""
        key = ("dev", id(arr), str(device))
        return self._cached(key, lambda: torch.from_numpy(np.array(arr)).to(device))

    def warm(
        self,
        device: torch.device | str,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        """Compile (or load from numba's disk cache) the kernels for ``device`` and build the tables.

        FSDP calls this when it builds the layout so no compile cost lands on the
        first step. Idempotent; cheap the second time.

        >>> GroupLayout([(4, 4)], 2).warm("cpu", torch.bfloat16, torch.float32)
        """
        from ._casts import DTYPE_CODES, REFERENCE_ONLY_DTYPES

        for name, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dt not in DTYPE_CODES and dt not in REFERENCE_ONLY_DTYPES:
                raise ValueError(f"GroupLayout.warm: {name}={dt} is not one of float32, bfloat16, float16, float64")
        dev = torch.device(device)
        for op in ("agin_flat", "agout", "rsin", "post"):
            self._table(op)
        warm_kernels(dev)
        if dev.type == "cuda":
            for op in ("agin_flat", "agout", "rsin", "post"):
                self._device_tensor(self._table(op), dev)
            for name in ("shard", "unsharded", "zero"):
                self._device_tensor(self._const(name), dev)


def warm_kernels(device: torch.device | str) -> None:
    """Load the kernels for ``device``'s type (compiled once, then read from numba's disk cache).

    The first load in a process sets up numba's compiler machinery and LLVM: ~46 MB of resident memory and
    ~0.3 s with a warm disk cache, whatever the model (docs/kernels.md). The strategy calls this when it sets
    up the process, before the model is built, so the first training step does not pay for it and the
    allocations do not interleave with the model's. Idempotent.

    >>> warm_kernels("cpu")
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        from . import cuda as _cuda

        _cuda.warm(dev)
    else:
        from . import cpu as _cpu

        _cpu.warm()
