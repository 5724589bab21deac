"""``replay``: PyTorch's CUDA caching allocator, replayed on a trace of allocations and frees, for the bytes a
GPU would *reserve* (what ``torch.cuda.max_memory_reserved()`` and published runs report) where the simulator
counts the bytes tensors *allocate*.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (default settings: no ``max_split_size``, no
garbage-collection threshold):

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), at least 512;
* requests up to 1 MiB (``kSmallSize``) use the small pool, larger ones the large pool; a free block serves
  only requests of its own pool and of the stream it was allocated on (``Block.stream``);
* a request takes the smallest free block that fits (best fit, lowest address among equal sizes); with none,
  a new segment is reserved (``cudaMalloc``): 2 MiB (``kSmallBuffer``) for small requests, 20 MiB
  (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``), otherwise the request rounded up to 2 MiB
  (``kRoundLarge``);
* a block bigger than the request is split when the remainder is at least 512 bytes (small pool) or more than
  1 MiB (large pool); otherwise the whole block is handed out (and counted as allocated, as torch does);
* a freed block merges with its free neighbours of the same segment; segments are never returned to the
  device, except when a new one would exceed ``capacity``: then every wholly free segment is released and the
  reservation retried, as the allocator does before raising out-of-memory.

``expandable_segments=True`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) models one growing segment
per pool and stream: a request best-fits the free mapped blocks; failing that, pages (2 MiB small, 20 MiB
large) are mapped at the segment's end, extending its last block if that one is free; blocks split whenever
512 bytes remain. (Unmapping, on reaching ``capacity``, releases the free pages at segments' ends only.)

Stream ordering is the caller's business: a free in the trace is the moment the block returns to its pool (for
a block used on another stream with ``record_stream``, the simulator's tracker emits it when the allocation
stream next waits for that stream).

Example::

    r = replay([Alloc(1, 3 << 20), Free(1), Alloc(2, 1000)])
    r.peak_reserved   # 20 MiB + 2 MiB: a 20 MiB large segment, then a small 2 MiB one
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["Alloc", "Free", "Phase", "AllocatorConfig", "AllocatorReport", "AllocatorOutOfMemory", "replay"]

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests below it share 20 MiB segments
ROUND_LARGE = 2 << 20  # kRoundLarge
LARGE_BUFFER = 20 << 20  # kLargeBuffer


class Alloc(NamedTuple):
    """A tensor storage of ``nbytes`` created on ``stream`` (the current stream then); ``key`` is unique."""

    key: int
    nbytes: int
    stream: str = "default"


class Free(NamedTuple):
    """The storage ``key`` returns to its pool."""

    key: int


class Phase(NamedTuple):
    """The events that follow belong to phase ``name`` (for peaks by phase)."""

    name: str


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator's settings: ``expandable_segments`` as ``PYTORCH_CUDA_ALLOC_CONF``; ``capacity`` the device's
    memory in bytes (None: unlimited, segments are never released)."""

    expandable_segments: bool = False
    capacity: int | None = None


@dataclass
class AllocatorReport:
    """Peaks of a replay: ``reserved`` (segments), ``allocated`` (handed-out blocks, as torch's
    ``memory_allocated``: rounded, with unsplit remainders), ``requested`` (the bytes asked for), each also by
    phase; ``segments`` reserved at the end and ``releases`` (times cached segments were freed to fit)."""

    peak_reserved: int = 0
    peak_allocated: int = 0
    peak_requested: int = 0
    reserved_by_phase: dict[str, int] = field(default_factory=dict)
    allocated_by_phase: dict[str, int] = field(default_factory=dict)
    segments: int = 0
    releases: int = 0


class AllocatorOutOfMemory(RuntimeError):
    """A request that does not fit in ``capacity`` even after releasing every cached segment."""


class _Block:
    __slots__ = ("ptr", "size", "stream", "small", "prev", "next", "allocated", "segment")

    def __init__(self, ptr: int, size: int, stream: str, small: bool, segment: _Segment) -> None:
        self.ptr, self.size, self.stream, self.small, self.segment = ptr, size, stream, small, segment
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False


class _Segment:
    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size  # reserved (mapped, for an expandable segment) bytes


def round_size(nbytes: int) -> int:
    """``round_size``: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment reserved for a (rounded) request no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocator:
    """The allocator's state; ``malloc``/``free`` by key (see the module docstring)."""

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        self.config = config or AllocatorConfig()
        # (small pool?, stream) -> free blocks sorted by (size, address), as the allocator's BlockPool set
        self._free: dict[tuple[bool, str], list[tuple[int, int, _Block]]] = {}
        self._live: dict[int, tuple[_Block, int]] = {}  # key -> (block, requested bytes)
        self._tails: dict[tuple[bool, str], _Block] = {}  # expandable: each segment's last block
        self._next_ptr = 0
        self.reserved = self.allocated = self.requested = 0
        self.segments = self.releases = 0

    def malloc(self, key: int, nbytes: int, stream: str = "default") -> None:
        if key in self._live:
            raise ValueError(f"allocator replay: key {key} allocated twice without a free")
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, stream, size)
        if block is None:
            block = self._reserve(small, stream, size)
        if self._should_split(block, size):
            block = self._split(block, size)
        block.allocated = True
        self._live[key] = (block, nbytes)
        self.allocated += block.size
        self.requested += nbytes

    def free(self, key: int) -> None:
        block, nbytes = self._live.pop(key)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= nbytes
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove(neighbour)
                self._merge(block, neighbour)
        self._insert(block)

    # -- the free pools

    def _pool(self, small: bool, stream: str) -> list:
        return self._free.setdefault((small, stream), [])

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pool(block.small, block.stream), (block.size, block.ptr, block))

    def _remove(self, block: _Block) -> None:
        pool = self._pool(block.small, block.stream)
        i = bisect.bisect_left(pool, (block.size, block.ptr))
        del pool[i]

    def _best_fit(self, small: bool, stream: str, size: int) -> _Block | None:
        pool = self._pool(small, stream)
        i = bisect.bisect_left(pool, (size, -1))
        if self.config.expandable_segments:
            # the block at a segment's mapped end can grow: best fit treats it as the largest (it is chosen
            # only when no other free block fits; then _reserve maps what it lacks)
            tail = self._tails.get((small, stream))
            while i < len(pool) and pool[i][2] is tail:
                i += 1
        if i == len(pool):
            return None
        block = pool.pop(i)[2]
        return block

    # -- reserving memory

    def _reserve(self, small: bool, stream: str, size: int) -> _Block:
        if self.config.expandable_segments:
            return self._expand(small, stream, size)
        grow = allocation_size(size)
        self._fit_in_capacity(grow)
        block = _Block(self._next_ptr, grow, stream, small, _Segment(grow))
        self._next_ptr += grow
        self.reserved += grow
        self.segments += 1
        return block

    def _expand(self, small: bool, stream: str, size: int) -> _Block:
        """Map pages at the end of the (small, stream) segment until its last block holds ``size``."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tails.get((small, stream))
        if tail is not None and not tail.allocated:
            self._remove(tail)
            have = tail.size
        else:
            have = 0
        # best fit passed over the end block (it can grow); it may hold the request already: map nothing then
        grow = max(0, -(-(size - have) // page) * page)
        self._fit_in_capacity(grow)
        if tail is None:
            segment = _Segment(0)
            self.segments += 1
            tail = _Block(self._next_ptr, 0, stream, small, segment)
            self._next_ptr += 1 << 50  # a segment's virtual range: no other segment's address is in it
        elif tail.allocated:
            block = _Block(tail.ptr + tail.size, 0, stream, small, tail.segment)
            block.prev, tail.next = tail, block
            tail = block
        tail.size += grow
        tail.segment.size += grow
        self._tails[(small, stream)] = tail
        self.reserved += grow
        return tail

    def _fit_in_capacity(self, grow: int) -> None:
        capacity = self.config.capacity
        if capacity is None or self.reserved + grow <= capacity:
            return
        self._release_cached()
        if self.reserved + grow > capacity:
            raise AllocatorOutOfMemory(
                f"allocator replay: reserving {grow} bytes more than the {self.reserved} reserved exceeds the "
                f"capacity of {capacity} bytes ({self.allocated} allocated); the configuration does not fit"
            )

    def _release_cached(self) -> None:
        """``release_cached_blocks``: free every wholly free segment (expandable: unmap free segment ends)."""
        self.releases += 1
        if self.config.expandable_segments:
            for key, tail in list(self._tails.items()):
                if not tail.allocated:
                    self._unmap_tail(key, tail)
            return
        for pool in self._free.values():
            whole = [e for e in pool if e[2].prev is None and e[2].next is None]
            for size, _, _ in whole:
                self.reserved -= size
                self.segments -= 1
            pool[:] = [e for e in pool if e[2].prev is not None or e[2].next is not None]

    def _unmap_tail(self, key: tuple[bool, str], tail: _Block) -> None:
        """Unmap the whole pages of a segment's free last block (the block goes if nothing is left of it)."""
        page = SMALL_BUFFER if tail.small else LARGE_BUFFER
        unmap = tail.size // page * page
        if not unmap:
            return
        self._remove(tail)
        tail.size -= unmap
        tail.segment.size -= unmap
        self.reserved -= unmap
        if tail.size:
            self._insert(tail)
        elif tail.prev is not None:
            tail.prev.next = None
            self._tails[key] = tail.prev
        else:  # the segment is empty
            del self._tails[key]
            self.segments -= 1

    # -- splitting and merging

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _split(self, block: _Block, size: int) -> _Block:
        """Hand out the first ``size`` bytes of ``block``; the rest stays free in the pool."""
        used = _Block(block.ptr, size, block.stream, block.small, block.segment)
        used.prev, used.next = block.prev, block
        if block.prev is not None:
            block.prev.next = used
        block.prev = used
        block.ptr += size
        block.size -= size
        self._insert(block)
        return used

    def _merge(self, block: _Block, neighbour: _Block) -> None:
        """Absorb the free ``neighbour`` (just before or after ``block``) into ``block``."""
        if neighbour is block.prev:
            block.ptr = neighbour.ptr
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size
        for key, tail in self._tails.items():
            if tail is neighbour:
                self._tails[key] = block


def replay(trace: Iterable[Alloc | Free | Phase], config: AllocatorConfig | None = None) -> AllocatorReport:
    """Replay ``trace`` in order through a ``CachingAllocator`` and return its peaks (module docstring)."""
    allocator = CachingAllocator(config)
    report = AllocatorReport()
    phase = None
    for event in trace:
        if type(event) is Alloc:
            allocator.malloc(event.key, event.nbytes, event.stream)
            _peaks(report, allocator, phase)
        elif type(event) is Free:
            allocator.free(event.key)
        else:
            phase = event.name
            # a phase starts at what is reserved and allocated already, as the tracker's phase peaks do
            _peaks(report, allocator, phase)
    report.segments, report.releases = allocator.segments, allocator.releases
    return report


def _peaks(report: AllocatorReport, allocator: CachingAllocator, phase: str | None) -> None:
    report.peak_reserved = max(report.peak_reserved, allocator.reserved)
    report.peak_allocated = max(report.peak_allocated, allocator.allocated)
    report.peak_requested = max(report.peak_requested, allocator.requested)
    if phase is not None:
        by = report.reserved_by_phase
        by[phase] = max(by.get(phase, 0), allocator.reserved)
        by = report.allocated_by_phase
        by[phase] = max(by.get(phase, 0), allocator.allocated)
