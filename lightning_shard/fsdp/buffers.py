"""Allocation of FSDP's large per-step buffers on CPU: transparent huge pages, populated up front.

Every step allocates and frees buffers as large as a whole group's parameters: the all-gather output, the
unsharded parameters, the reduce-scatter input and the gradient shard. On CPU, blocks that large usually
come from fresh ``mmap``s, and the first write to fresh memory takes one page fault per 4 KiB page. On
our 2-core test machine that made copying 40 MB into a fresh buffer cost 26 ms against 5 ms into a reused
one. Asking the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) before the first write
takes one fault per 2 MiB instead, and the copy took 8 ms. Where the kernel does not offer transparent
huge pages, the advice is a no-op. Buffers from 256 KiB up are then populated in one call
(``MADV_POPULATE_WRITE``, Linux >= 5.14) instead of one trap per page on first write: on the benchmark GPT of
``benchmarks/fsdp_vs_torch.py`` the step took 1.29-1.30 s with both, 1.30-1.32 s without either (two runs
each). GPU memory comes from torch's caching allocator and is left alone. ``LIGHTNING_SHARD_HUGE_PAGES=0``
turns both off.

Example::

    buf = empty((2, 1 << 20), torch.float32, torch.device("cpu"))   # huge-page backed where possible
    populate_pages(unsharded.untyped_storage())                   # after a storage.resize_(n)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch

_PAGE = 4096
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_POPULATE_WRITE = 23  # linux >= 5.14; older kernels refuse it (EINVAL), which changes nothing
_POPULATE_MIN_BYTES = 256 << 10


def empty(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, with large CPU buffers backed by (huge) pages before anything writes them.

    >>> empty((4, 4), torch.float32, torch.device("cpu")).shape
    torch.Size([4, 4])
    """
    tensor = torch.empty(shape, dtype=dtype, device=device)
    populate_pages(tensor.untyped_storage())
    return tensor


def populate_pages(storage: torch.UntypedStorage) -> None:
    """Back a CPU ``storage`` of 256 KiB or more with pages now, before its first write: huge pages for its
    2 MiB-aligned part where the kernel offers them (smaller storages and other devices: nothing).

    >>> populate_pages(torch.empty(1 << 22).untyped_storage())
    """
    if storage.device.type != "cpu" or storage.nbytes() < _POPULATE_MIN_BYTES:
        return
    madvise = _madvise()
    if madvise is None:
        return
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    start = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
    end = (ptr + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a failure changes nothing
    start, end = -(-ptr // _PAGE) * _PAGE, (ptr + nbytes) // _PAGE * _PAGE
    if end > start:
        madvise(start, end - start, _MADV_POPULATE_WRITE)


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux") or os.environ.get("LIGHTNING_SHARD_HUGE_PAGES") == "0":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
