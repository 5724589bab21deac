"""Checksums of checkpoint entries, and the errors a damaged or unwritable checkpoint raises.

Every entry DCP writes (one tensor chunk, or one non-tensor value) is hashed at save time from the bytes
handed to the writer (:class:`ChecksumSavePlanner`), and the digests go into the completion marker. At load
and in consolidation the reader hashes each entry again right after reading it, before any value reaches
the caller (``_safe_io.SafeFileSystemReader``). The hash is xxHash's XXH3-64 (about 25 GB/s on one core
here, ~1% of a save; see ``benchmarks/checkpoint_integrity.py``), or zlib's CRC-32 where the ``xxhash``
package is missing; the marker names the algorithm used.

Example::

    planner = ChecksumSavePlanner()
    dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=planner)
    planner.digests            # {"model.w|0,0": "9f2c...", ...}
"""

from __future__ import annotations

import errno
import io
import os
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from lightning_shard.device import has_data

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; CRC-32 keeps checkpoints verifiable without it
    xxhash = None

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointWriteError",
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
    """A checkpoint could not be read or written. The message names the path (and the file and entry)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is damaged: truncated, unreadable, or its content differs from its checksum."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; ``errno`` is the OS error's (e.g. ``errno.ENOSPC``) when there was one.

    An ``OSError`` (not a :class:`CheckpointError`), so that ``except OSError`` handlers of disk problems see it.
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


class ChecksumSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that hashes every entry as the writer asks for its data.

    Tensors are moved to the CPU here (the writer would copy them there next; on a CPU tensor its copy is a
    no-op), so each byte is read from device memory once. ``digests`` maps :func:`entry_key` to the digest.
    """

    def __init__(self, *args: Any, algorithm: str = DEFAULT_ALGORITHM, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.algorithm = algorithm
        self.digests: dict[str, str] = {}

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            data = data.detach()
            if data.device.type != "cpu":
                data = data.cpu()
        # A tensor without data (the simulator's fake tensors) has no bytes to hash; its writer writes none.
        self.digests[entry_key(write_item.index)] = NO_DATA if _without_data(data) else digest(data, self.algorithm)
        return data


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
