"""Checksums of checkpoint entries, and the errors a damaged or unwritable checkpoint raises.

Every entry DCP writes (one tensor chunk, or one non-tensor value) is hashed at save time from the value
handed to the writer (:class:`ChecksumSavePlanner`; entries over 1 MiB on a :class:`BackgroundHasher` thread
while the writer writes), and the digests go into the completion marker. At load and in consolidation the
reader hashes each entry again right after reading and decoding it, before any value reaches the caller
(``_safe_io.SafeFileSystemReader``): a damaged byte that changes a loaded value is caught. The hash is
xxHash's XXH3-64 (~17-25 GB/s on one core here; its cost is measured by
``benchmarks/checkpoint_integrity.py``), or zlib's CRC-32 where the ``xxhash`` package is missing; the
marker names the algorithm used.

Example::

    planner = ChecksumSavePlanner()
    dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=planner)
    planner.digests()          # {"model.w|0,0": "9f2c...", ...}
    planner.close()
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import io
import os
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_shard.device import has_data

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; CRC-32 keeps checkpoints verifiable without it
    xxhash = None

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointWriteError",
    "BackgroundHasher",
    "ChecksumFileSystemWriter",
    "ChecksumSavePlanner",
    "DEFAULT_ALGORITHM",
    "digest",
    "entry_key",
    "failures_of",
]


def _crc32(buf: memoryview) -> str:
    return f"{zlib.crc32(buf):08x}"


def _xxh3(buf: memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


# name recorded in the marker -> function of the entry's bytes
ALGORITHMS: dict[str, Callable[[memoryview], str]] = {"crc32": _crc32}
if xxhash is not None:
    ALGORITHMS["xxh3_64"] = _xxh3
DEFAULT_ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"
NO_DATA = "no-data"  # the digest recorded for a tensor without bytes (a fake tensor of the simulator)


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or written. The message names the path (and the file and entry).

    Example::

        try:
            load(state, "ckpts/step3")
        except CheckpointError as err:   # CheckpointCorruptError too; a missing directory is FileNotFoundError
            print(err)                   # names the directory, the file and the entry
    """


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is damaged: truncated, unreadable, or its content differs from its checksum.

    >>> import tempfile
    >>> from torch import nn
    >>> from lightning_shard.checkpoint import get_model_state_dict, load, save
    >>> from lightning_shard.fsdp import fully_shard
    >>> model = fully_shard(nn.Linear(4, 2))
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     save({"model": get_model_state_dict(model)}, f"{tmp}/step1")
    ...     shard = f"{tmp}/step1/__0_0.distcp"
    ...     os.truncate(shard, os.path.getsize(shard) - 8)   # the disk lost the file's end after the save
    ...     try:
    ...         load({"model": get_model_state_dict(model)}, f"{tmp}/step1")
    ...     except CheckpointCorruptError as err:
    ...         print("is truncated" in str(err), isinstance(err, CheckpointError))
    True True
    """


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; ``errno`` is the OS error's (e.g. ``errno.ENOSPC``) when there was one.

    An ``OSError`` (not a :class:`CheckpointError`), so that ``except OSError`` handlers of disk problems see it.

    Example::

        try:
            save(state, "ckpts/step3")
        except CheckpointWriteError as err:   # the previous checkpoint is intact, the temp dir removed
            full = err.errno == errno.ENOSPC
    """

    def __init__(self, message: str, err: int | None = None) -> None:
        OSError.__init__(self, err, message) if err is not None else OSError.__init__(self, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _bytes_of(value: torch.Tensor | io.BytesIO | bytes) -> memoryview:
    if isinstance(value, io.BytesIO):
        return value.getbuffer()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return memoryview(value)
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # no copy for a contiguous CPU tensor


def digest(value: torch.Tensor | io.BytesIO | bytes, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Hex digest of a tensor's bytes (in contiguous order) or of a byte buffer.

    Example: ``digest(torch.ones(2))`` -> ``'...'`` (16 hex digits for XXH3-64).
    """
    try:
        fn = ALGORITHMS[algorithm]
    except KeyError:
        raise CheckpointError(
            f"the checkpoint's checksums use {algorithm!r}, which this installation cannot compute "
            f"(available: {sorted(ALGORITHMS)}); install the 'xxhash' package"
        ) from None
    return fn(_bytes_of(value))


def entry_key(index: MetadataIndex) -> str:
    """A stable name for one saved entry: its key and, for a tensor chunk, the chunk's offsets.

    Example: ``entry_key(MetadataIndex("model.w", [4, 0]))`` -> ``'model.w|4,0'``.
    """
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}|{','.join(str(int(o)) for o in index.offset)}"


class BackgroundHasher:
    """Digests computed on one worker thread while the caller goes on.

    XXH3 (``xxhash``) and CRC-32 (``zlib``) release the GIL on large buffers, so hashing one checkpoint entry
    runs beside the writer serialising and writing the next: on a machine with a spare core the checksums add
    little to a save's wall time. Values under ``inline_bytes`` are hashed at once (handing them to the thread
    costs more than hashing them). At most ``max_pending_bytes`` wait for the thread; beyond that ``submit``
    waits for the oldest, so a slow hash never keeps many entries (or device-to-host copies) alive.

    Example::

        hasher = BackgroundHasher("xxh3_64")
        hasher.submit("w", torch.ones(2**20))
        hasher.digests()            # {"w": "..."}: waits for the thread
    """

    INLINE_BYTES = 1 << 20  # below: hashed at once (the thread handoff costs ~tens of microseconds)
    MAX_PENDING_BYTES = 1 << 30

    def __init__(
        self,
        algorithm: str = DEFAULT_ALGORITHM,
        *,
        inline_bytes: int | None = None,
        max_pending_bytes: int | None = None,
    ) -> None:
        digest(b"", algorithm)  # an unknown algorithm fails here, not on the thread
        self.algorithm = algorithm
        self.inline_bytes = self.INLINE_BYTES if inline_bytes is None else inline_bytes
        self.max_pending_bytes = self.MAX_PENDING_BYTES if max_pending_bytes is None else max_pending_bytes
        self._done: dict[str, str] = {}
        self._pending: collections.deque[tuple[str, int, concurrent.futures.Future]] = collections.deque()
        self._pending_bytes = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, key: str, value: torch.Tensor | io.BytesIO | bytes) -> None:
        """Hash ``value`` under ``key`` (now if small, else on the thread); ``value`` must not change until
        :meth:`digests` returns."""
        if _without_data(value):  # the simulator's fake tensors: no bytes to hash, and its writer writes none
            self._done[key] = NO_DATA
            return
        size = _nbytes(value)
        if size < self.inline_bytes:
            self._done[key] = digest(value, self.algorithm)
            return
        while self._pending and self._pending_bytes + size > self.max_pending_bytes:
            self._collect_oldest()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")
        self._pending.append((key, size, self._pool.submit(digest, value, self.algorithm)))
        self._pending_bytes += size

    def _collect_oldest(self) -> None:
        key, size, future = self._pending.popleft()
        self._pending_bytes -= size
        self._done[key] = future.result()

    def digests(self) -> dict[str, str]:
        """Every digest (waits for the thread), keyed as submitted."""
        while self._pending:
            self._collect_oldest()
        return self._done

    def close(self) -> None:
        """Stop the thread (pending hashes are dropped); safe to call more than once."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()
        self._pending_bytes = 0


def _nbytes(value: torch.Tensor | io.BytesIO | bytes) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, io.BytesIO):
        return value.getbuffer().nbytes
    return len(value)


class ChecksumSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that hashes every entry as the writer asks for its data.

    Tensors are moved to the CPU here (the writer would copy them there next; on a CPU tensor its copy is a
    no-op), so each byte is read from device memory once. The hashing itself runs on a
    :class:`BackgroundHasher` thread, beside the writer serialising and writing the entry. ``digests()`` maps
    :func:`entry_key` to the digest once the writer is done; ``close()`` stops the thread (call it on every
    way out of the save).

    Example::

        planner = ChecksumSavePlanner()
        try:
            dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=planner)
            sums = planner.digests()
        finally:
            planner.close()
    """

    def __init__(self, *args: Any, algorithm: str = DEFAULT_ALGORITHM, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.algorithm = algorithm
        self._hasher = BackgroundHasher(algorithm)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            data = data.detach()
            if data.device.type != "cpu":
                data = data.cpu()
        # The writer only reads ``data`` (torch.save of a tensor, or the BytesIO's buffer): it stays unchanged
        # while the thread hashes it.
        self._hasher.submit(entry_key(write_item.index), data)
        return data

    def digests(self) -> dict[str, str]:
        """:func:`entry_key` -> digest of every entry the writer asked for (waits for the hashing thread)."""
        return self._hasher.digests()

    def close(self) -> None:
        """Stop the hashing thread."""
        self._hasher.close()


class ChecksumFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose write step ends only once the planner's hashing thread has hashed everything
    this rank wrote: a hashing failure then fails this rank's write step, which DCP reports on every rank, like
    a failed write (no rank is left waiting for digests that never come).

    Example: ``dcp.save(state, storage_writer=ChecksumFileSystemWriter(tmp), planner=ChecksumSavePlanner())``.
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        future.wait()
        if isinstance(planner, ChecksumSavePlanner):
            planner.digests()  # waits; raises the thread's error here, inside DCP's write step
        return future


def _without_data(data: torch.Tensor | io.BytesIO) -> bool:
    return isinstance(data, torch.Tensor) and not has_data(data)


def failures_of(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    """The underlying exceptions of a torch ``CheckpointException`` (rank, exception), or ``[(None, exc)]``."""
    if isinstance(exc, CheckpointException):
        out: list[tuple[int | None, BaseException]] = []
        for rank, wrapped in sorted(exc.failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            out.extend((rank, e) for _, e in failures_of(inner))
        return out
    return [(None, exc)]


def os_error_of(exc: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``exc``, its failures and its causes."""
    seen: set[int] = set()
    todo = [e for _, e in failures_of(exc)]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def free_bytes(path: str) -> int | None:
    """Bytes available to this user on the filesystem holding ``path`` (or its nearest existing parent)."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def write_error(exc: BaseException, path: str, tmp: str, needed: int) -> CheckpointWriteError:
    """A ``CheckpointWriteError`` saying what failed while writing ``tmp`` for ``path``: the OS error (ENOSPC
    named as such, also when torch's zip writer only reports a short write), the bytes needed and free."""
    oserr = os_error_of(exc)
    free = free_bytes(os.path.dirname(path))
    err = oserr.errno if oserr is not None else None
    if err is None and free is not None and free < needed:
        err = errno.ENOSPC  # torch's zip writer reports a short write as "unexpected pos ..." without errno
    if err is not None:
        name = errno.errorcode.get(err, str(err))
        what = f"{os.strerror(err)} ({name})"
    else:
        what = "; ".join(f"{'' if r is None else f'rank {r}: '}{type(e).__name__}: {e}" for r, e in failures_of(exc))
    where = f" writing {oserr.filename}" if oserr is not None and oserr.filename else f" writing into {tmp}"
    space = f"; {_size(free)} free on that filesystem" if free is not None else ""
    return CheckpointWriteError(
        f"save({path}) failed{where}: {what}. The checkpoint needs about {_size(needed)}{space}. The partial "
        f"directory was removed and the previous checkpoint at {path} (if any) is intact.",
        err,
    )


def _size(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"
