"""``save`` / ``load``: sharded checkpoints as torch.distributed.checkpoint (DCP) directories, published atomically.

Crash-safety protocol of ``save(state, path)`` (every rank calls it; ``path`` on a filesystem all ranks share):

1. Rank 0 removes temp dirs of earlier failed saves of ``path``, draws a random id and broadcasts it; every rank
   writes its shards into ``<path>.tmp-<id>/`` through DCP (which also has rank 0 write DCP's ``.metadata``),
   hashing each entry as it hands it to the writer.
2. The digests are gathered on rank 0 (also a barrier: every rank has finished writing and fsynced).
3. Rank 0 writes the completion marker ``.lightning_shard_complete`` (JSON, with every entry's and file's
   checksum) last, fsyncs it, then publishes:
   if ``path`` exists, the temp dir and ``path`` swap names in one atomic step (Linux ``renameat2`` with
   ``RENAME_EXCHANGE``) and the temp dir, now the old checkpoint, is deleted; where the filesystem cannot swap,
   ``path`` is renamed to ``<path>.old-<id>``, the temp dir to ``path`` (``os.replace``), the old one deleted.
   Stale ``<path>.tmp-*`` / ``<path>.old-*`` left by crashed saves are deleted after a successful publish.
4. Rank 0 broadcasts the outcome: when ``save`` returns, ``path`` is the new checkpoint on every rank.

Any failure (a full disk, an I/O error, a rank's exception) removes the temp dir on every path out and raises an
``Exception`` naming the OS error, the path and the bytes needed; ``path`` is left as it was.

``load`` reads everything into new tensors first, verifying each entry's checksum, and copies into the caller's
tensors only once every rank has read everything: a failed load leaves the model and optimizer untouched.

A crash before step 3 leaves ``path`` untouched (the temp dir has no marker and is never loaded). With the
atomic swap ``path`` always holds a complete checkpoint, the previous or the new one. Only where the swap is not
available is there a window without ``path``, between the two renames (two metadata operations on rank 0); a
crash there leaves the previous checkpoint complete at ``<path>.old-<id>`` and ``load(path)`` says so.

Example::

    save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt), "step": 3},
         "ckpt/step3")
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt), "step": 0}
    load(state, "ckpt/step3")            # tensors in place, "step" replaced by 3
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import functools
import glob
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils.serialization import config as serialization_config

from lightning_shard import comm
from lightning_shard.checkpoint._integrity import (
    DEFAULT_ALGORITHM,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    ChecksumFileSystemWriter,
    ChecksumSavePlanner,
    digest,
    failures_of,
    write_error,
)
from lightning_shard.checkpoint._interop import to_torch
from lightning_shard.checkpoint._safe_io import (
    MARKER,
    CheckpointSecurityError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_files,
)
from lightning_shard.checkpoint._validate import Problems, castable, describe
from lightning_shard.tensor import DTensor

__all__ = [
    "save",
    "load",
    "MARKER",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointWriteError",
    "CheckpointSecurityError",
]

FORMAT_VERSION = 2  # 2: the marker records checksums
_PLAIN = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device)
_TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{14}$")  # <path>.tmp-<id>: a save in progress or one that failed


# ------------------------------------------------------------------------------------------------ helpers
# Control messages between ranks go through torch's object collectives (comm.broadcast_object /
# comm.all_gather_objects), which put their bytes on the device the group serves (CUDA for NCCL, CPU for gloo).
def _dist() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _fake_world() -> bool:
    """A rank of the simulator's fake world (``lightning_shard.simulate``): collectives carry no data, so DCP's
    planning cannot gather the other ranks' plans. Each simulated rank then plans, writes and publishes its own
    shards as a coordinator would (DCP without collectives, rank 0's steps too); the state dicts, the staging,
    the metadata and the engine's own collectives are those of a real save."""
    return _dist() and not comm._carries_data(None)


def _coordinator() -> bool:
    return _rank() == 0 or _fake_world()


def _remove_stale_temps(path: str) -> None:
    """Temp dirs of earlier saves of ``path`` that failed or crashed (one writer per path is assumed)."""
    for stale in glob.glob(glob.escape(path) + ".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _agree_id(path: str) -> str:
    """Rank 0 clears failed saves' temp dirs, then draws a random id that every rank receives."""
    ckpt_id = None
    if _coordinator():
        _remove_stale_temps(path)  # before anyone writes: a failed save's leftovers must not fill the disk
        ckpt_id = os.urandom(7).hex()
    return str(comm.broadcast_object(ckpt_id, 0)) if _dist() else str(ckpt_id)


def _to_dcp(obj: Any, where: str = "state") -> Any:
    """Copy the container tree, our DTensors replaced by torch DTensors viewing the same storage."""
    if isinstance(obj, DTensor):
        return to_torch(obj)
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        for k in obj:
            if not isinstance(k, (str, int)):
                raise TypeError(f"save/load: key {k!r} in {where} must be a str or int, got {type(k).__name__}")
        return {k: _to_dcp(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_dcp(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_to_dcp(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, _PLAIN):
        return obj
    raise TypeError(
        f"save/load: {where} is a {type(obj).__name__}; checkpoints hold only tensors and plain containers "
        "(dict, list, tuple, str, int, float, bool, None) so that loading never unpickles code. Convert it, e.g. "
        "to a dict of plain values or a tensor."
    )


def _merge_back(state: Any, loaded: Any) -> Any:
    """Put loaded non-tensor values into the caller's containers; the caller's tensors stay (``_commit``
    copies into them). A tuple is rebuilt (it cannot be changed in place) around the caller's tensors."""
    if isinstance(state, dict) and isinstance(loaded, Mapping):
        for k in state:
            if k in loaded:
                state[k] = _merge_back(state[k], loaded[k])
        return state
    if isinstance(state, list) and isinstance(loaded, list) and len(state) == len(loaded):
        for i in range(len(state)):
            state[i] = _merge_back(state[i], loaded[i])
        return state
    if isinstance(state, tuple) and isinstance(loaded, tuple) and len(state) == len(loaded):
        merged = [_merge_back(s, v) for s, v in zip(state, loaded)]
        return type(state)(*merged) if hasattr(state, "_fields") else type(state)(merged)  # a namedtuple or not
    if isinstance(state, torch.Tensor):
        return state
    return loaded


def _tuple_copies(state: Any, loaded: Any, where: str = "state", in_tuple: bool = False) -> list[tuple]:
    """(caller's tensor, loaded tensor) for every tensor inside a tuple. DCP stores a tuple as one object, not
    key by key, so ``_commit`` does not reach these; checked here, before anything is copied."""
    if isinstance(state, Mapping) and isinstance(loaded, Mapping):
        items = [(state[k], loaded[k], f"{where}[{k!r}]", in_tuple) for k in state if k in loaded]
    elif isinstance(state, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(state) == len(loaded):
        inner = in_tuple or isinstance(state, tuple)
        items = [(s, v, f"{where}[{i}]", inner) for i, (s, v) in enumerate(zip(state, loaded))]
    elif in_tuple and isinstance(state, torch.Tensor):
        if not isinstance(loaded, torch.Tensor) or loaded.shape != state.shape:
            seen = describe(loaded.shape, loaded.dtype) if isinstance(loaded, torch.Tensor) else type(loaded).__name__
            raise ValueError(
                f"load: {where} is a {describe(state.shape, state.dtype)} tensor, the checkpoint holds {seen} "
                "there; load into a state of the saved structure -- nothing was modified"
            )
        return [(state, loaded)]
    else:
        return []
    return [pair for item in items for pair in _tuple_copies(*item)]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_marker(tmp: str, ckpt_id: str, entries: dict[str, str], files: dict[str, str]) -> None:
    info = {
        "format": "lightning_shard.checkpoint/dcp",
        "version": FORMAT_VERSION,
        "id": ckpt_id,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "time": time.time(),
        "torch": torch.__version__,
        "checksums": {"algorithm": DEFAULT_ALGORITHM, "files": files, "entries": entries},
    }
    _write_file(os.path.join(tmp, MARKER), json.dumps(info).encode())
    _fsync_dir(tmp)


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(..., RENAME_EXCHANGE)``): at every
    moment each name holds one of the two complete directories. False where the system or the filesystem cannot
    (another OS, an old kernel or libc, some network filesystems): the caller then renames twice.

    Example: ``_exchange("ckpt.tmp-1a2b", "ckpt")`` -> ``ckpt`` is the new checkpoint, ``ckpt.tmp-1a2b`` the old.
    """
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _publish(tmp: str, path: str, ckpt_id: str) -> None:
    old = f"{path}.old-{ckpt_id}"
    if os.path.exists(path) and _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint (a crash here leaves it as stale)
    elif os.path.exists(path):
        os.replace(path, old)  # window opens: `path` is missing, `old` is complete
        try:
            os.replace(tmp, path)  # window closes
        except BaseException:
            os.replace(old, path)  # put the previous checkpoint back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")
    # Leftovers of saves that crashed (one writer per path at a time is assumed).
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _nbytes(obj: Any) -> int:
    """Bytes of the tensor data a checkpoint of ``obj`` holds (global sizes: every rank computes the total)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()  # DTensors report their global numel
    if isinstance(obj, Mapping):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _finish(tmp: str, path: str, ckpt_id: str, digests: list, extra_files: Mapping[str, bytes]) -> None:
    """Rank 0: extra files, the marker with every checksum, then the atomic publish."""
    entries: dict[str, str] = {}
    for part in digests:
        entries.update(part)
    try:  # every rank's data file must be here: a rank writing to its own disk would leave a hole in the checkpoint
        check_files(tmp, SafeFileSystemReader(tmp).read_metadata())
    except CheckpointCorruptError as e:
        raise CheckpointError(
            f"save: every rank wrote its shards, but rank 0 does not see them all in {tmp} ({e}); {path} must be "
            "on a filesystem every rank sees (a shared path, not a node-local disk); nothing was published"
        ) from e
    with open(os.path.join(tmp, ".metadata"), "rb") as f:
        files = {".metadata": digest(f.read(), DEFAULT_ALGORITHM)}
    for name, data in extra_files.items():
        _write_file(os.path.join(tmp, name), data)
        files[name] = digest(data, DEFAULT_ALGORITHM)
    _write_marker(tmp, ckpt_id, entries, files)
    _publish(tmp, path, ckpt_id)


def _remove(tmp: str) -> None:
    for _ in range(3):  # ranks may remove the same tree concurrently
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(tmp):
            return


# ------------------------------------------------------------------------------------------------ save
def save(state: Mapping[str, Any], path: str | os.PathLike, *, extra_files: Mapping[str, bytes] | None = None) -> None:
    """Write ``state`` as a DCP checkpoint directory at ``path``, atomically (see the module docstring).

    ``state`` is a dict of state dicts and plain values, e.g. ``{"model": get_model_state_dict(model),
    "optimizer": get_optimizer_state_dict(model, opt), "step": 3, "rng": torch.get_rng_state()}``. Our DTensors
    are written as torch DTensors (each rank its shard; replicated data once), plain tensors once (rank 0's
    value: store per-rank values under per-rank keys), other values as ``torch.save`` bytes read back with
    ``weights_only=True``. Every entry's checksum is recorded in the completion marker. Every rank must call it
    (collective); ``path`` must be on a filesystem all ranks see. If ``path`` exists it is replaced only once
    the new checkpoint is complete.

    Example::

        save({"model": get_model_state_dict(model), "step": step}, f"ckpts/step{step}")

    ``extra_files`` (name -> bytes) are written by rank 0 into the checkpoint directory before it is published,
    so they are part of the atomic checkpoint (the Lightning strategy keeps its loop state in ``meta.pt``).

    Raises ``CheckpointWriteError`` (an ``OSError``; ``errno`` e.g. ``ENOSPC``) naming the OS error, the path,
    the bytes needed and the bytes free when writing fails, on every rank; the temp dir is removed.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save: {path} exists and is not a directory; a sharded checkpoint is a directory")
    if not isinstance(state, Mapping):
        raise TypeError(f"save: state must be a dict (e.g. {{'model': ...}}), got {type(state).__name__}")
    converted = _to_dcp(state)
    needed = _nbytes(converted) + sum(len(v) for v in (extra_files or {}).values())
    ckpt_id = _agree_id(path)
    tmp = f"{path}.tmp-{ckpt_id}"
    try:
        _write_all(converted, tmp, path, ckpt_id, extra_files or {})
    except BaseException as e:
        _remove(tmp)  # on every rank and every way out: a failed save must not keep its space
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(e, (CheckpointError, TypeError, ValueError)):
            raise  # already says what is wrong
        raise write_error(e, path, tmp, needed) from (e if isinstance(e, Exception) else None)


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """torch.save without the CRC-32 of each zip record, while DCP writes a checkpoint.

    torch's zip writer computes those CRCs at save but torch's reader never checks them (a flipped byte loads
    silently: ``tests/test_checkpoint_integrity_overlap.py``); the marker's per-entry digests are the check, so the
    CRC pass is skipped (torch's documented ``set_crc32_options``; ``torch.load`` reads such files). The
    setting is process-wide: a ``torch.save`` on another thread meanwhile also skips it, and it is restored
    on every way out.
    """
    config = serialization_config.save
    before = config.compute_crc32
    config.compute_crc32 = False
    try:
        yield
    finally:
        config.compute_crc32 = before


def _agree_before_reading(error: Exception | None, path: str) -> None:
    """Raise on every rank if the checks before reading failed on any rank (one small all-gather).

    The checks read only local files; a directory that one rank does not see (a node-local disk) or a state that
    differs between ranks fails them on some ranks only, and those ranks would raise while the others entered DCP's
    collectives and waited for them until the process group's timeout. A failing rank raises its own error; the
    others a ``CheckpointError`` naming the failing ranks and the first error.
    """
    if not _dist() or _fake_world():
        if error is not None:
            raise error
        return
    outcomes = comm.all_gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
    if failed:
        raise CheckpointError(
            f"load({path}): the checks before reading failed on rank(s) {[rank for rank, _ in failed]} (rank "
            f"{failed[0][0]}: {failed[0][1]}); nothing was modified on any rank. If only some ranks fail, {path} is "
            "probably not on a filesystem every rank sees: use a shared path"
        )


def _write_all(converted: dict, tmp: str, path: str, ckpt_id: str, extra_files: Mapping[str, bytes]) -> None:
    os.makedirs(tmp, exist_ok=True)
    # An entry every rank holds (a plain tensor such as a BatchNorm's running statistics, which each
    # data-parallel rank keeps for its own batches; a replicated DTensor's chunk) is written by its lowest rank:
    # the documented "rank 0's value", the same rank as in a full checkpoint. DCP's default balances such
    # entries over the ranks instead, so the statistics saved came from any rank.
    planner = ChecksumSavePlanner(algorithm=DEFAULT_ALGORITHM, dedup_save_to_lowest_rank=True)
    try:
        with _without_zip_crc32():
            writer = ChecksumFileSystemWriter(tmp, sync_files=True)
            dcp.save(converted, storage_writer=writer, planner=planner, no_dist=not _dist() or _fake_world())
        mine = planner.digests()  # complete: the writer waited for them inside DCP's write step
    finally:
        planner.close()
    # Gathering the digests is also the barrier: every rank's files are written and synced.
    digests = comm.all_gather_objects(mine) if _dist() else [mine]
    error: BaseException | None = None
    if _coordinator():
        try:
            _finish(tmp, path, ckpt_id, digests, extra_files)
        except BaseException as e:  # tell the other ranks instead of leaving them waiting
            error = e
    outcome = None if error is None else f"{type(error).__name__}: {error}"
    if _dist():
        outcome = comm.broadcast_object(outcome, 0)
    if error is not None:
        raise error
    if outcome is not None:
        raise CheckpointError(
            f"save: rank 0 failed to publish {path} ({outcome}); the previous checkpoint (if any) is intact"
        )


# ------------------------------------------------------------------------------------------------ load
def check_checkpoint_dir(path: str, *, require_marker: bool = False) -> None:
    """Raise a clear error unless ``path`` is a checkpoint directory that can be loaded.

    A directory with our completion marker is ours. A directory at its final path with DCP's ``.metadata`` and
    no marker was written by another tool (torch's ``dcp.save``, Lightning's ModelParallelStrategy,
    torchtitan) and is accepted, unless ``require_marker=True``: our own saves only reach their final path
    complete. A ``<path>.tmp-<id>`` directory is a save that did not finish and is refused.

    Example: ``check_checkpoint_dir("ckpts/step3")``.
    """
    if not os.path.isdir(path):
        olds = sorted(g for g in glob.glob(glob.escape(path) + ".old-*") if os.path.exists(os.path.join(g, MARKER)))
        hint = (
            f"; a save was interrupted while publishing and the previous checkpoint is intact at {olds[-1]} "
            f"(rename it to {path})"
            if olds
            else ""
        )
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"load: {path} {what}; expected a checkpoint directory written by save(){hint}")
    has_marker = os.path.exists(os.path.join(path, MARKER))
    if not has_marker and _TMP_NAME.search(path):
        raise ValueError(
            f"load: {path} is the temporary directory of a save that did not finish (it has no completion marker "
            f"{MARKER!r}); load the checkpoint at {_TMP_NAME.sub('', path)} instead"
        )
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(
            f"load: {path} is not a complete checkpoint: it has no DCP '.metadata' file (an interrupted save, or not "
            "a checkpoint directory at all)"
        )
    if require_marker and not has_marker:
        raise ValueError(
            f"load: {path} has no completion marker {MARKER!r}: another tool wrote it (require_marker=True "
            "refuses such directories; the default accepts a DCP directory with a valid '.metadata')"
        )


def _top(key: str) -> str:
    return key.split(".", 1)[0]


def _validate(converted: dict, metadata: Metadata, path: str, strict: bool) -> dict[str, torch.dtype]:
    """Check ``converted`` against the checkpoint; return the saved dtype of every tensor key to load."""
    flat, _ = flatten_state_dict(converted)
    saved = metadata.state_dict_metadata
    problems = Problems(f"load({path})")
    saved_tops = {_top(k) for k in saved}
    absent = sorted({_top(k) for k in flat} - saved_tops)
    for top in absent:  # a whole entry missing: say so instead of listing its keys
        if strict:
            problems.add(
                f"the checkpoint has no {top!r} entry (it holds {sorted(saved_tops)}): it was saved without it "
                f"(e.g. a weights-only checkpoint has no optimizer state); leave {top!r} out of the state to load, "
                "or pass strict=False"
            )
    dtypes: dict[str, torch.dtype] = {}
    matched = 0
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            if strict and _top(key) not in absent:
                problems.missing([key])
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.mismatch(key, describe(value.shape, value.dtype), "a non-tensor value")
                continue
            if tuple(md.size) != tuple(value.shape):
                problems.mismatch(key, describe(value.shape, value.dtype), describe(md.size, md.properties.dtype))
                continue
            if not castable(md.properties.dtype, value.dtype):
                problems.dtype(key, value.dtype, md.properties.dtype)
                matched += 1
                continue
            dtypes[key] = md.properties.dtype
        elif isinstance(md, TensorStorageMetadata):
            problems.mismatch(key, f"a {type(value).__name__}", describe(md.size, md.properties.dtype))
            continue
        elif not isinstance(md, BytesStorageMetadata):
            problems.add(f"{key!r} has unknown storage metadata {type(md).__name__}")
            continue
        matched += 1
    if strict:
        # Only within the top-level entries asked for: loading {"model": ...} from a training checkpoint is fine.
        tops = {str(k) for k in converted}
        problems.unexpected(k for k in saved if _top(k) in tops and k not in flat)
    n_expected = sum(1 for k in flat if _top(k) not in absent)
    problems.raise_if_any(n_expected=n_expected, n_matched=matched)
    return dtypes


def _host_empty_like(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Host storage of ``value``'s shape holding ``dtype``: pinned when ``value`` is on an accelerator, so the
    copy into it at commit is a fast DMA. The load reads into host memory (as torch's DCP reader does), so a
    resumed run needs no second copy of its state in device memory."""
    pin = value.device.type not in ("cpu", "meta")
    return torch.empty(value.shape, dtype=dtype, device="cpu", pin_memory=pin)


def _empty_like(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New host storage in ``value``'s layout (same shard of the same mesh for a DTensor) holding ``dtype``.

    Example: ``_empty_like(torch.empty(4, device="meta"), torch.float32).device == torch.device("cpu")``.
    """
    if isinstance(value, TorchDTensor):
        local = _host_empty_like(value._local_tensor, dtype)
        meta = TensorMeta(value.shape, value.stride(), dtype)
        # The constructor, not ``from_local``: that one would move the local tensor to the mesh's device.
        return TorchDTensor(local, DTensorSpec(value.device_mesh, value.placements, meta), requires_grad=False)
    return _host_empty_like(value, dtype)


def _shadow(converted: dict, dtypes: dict[str, torch.dtype]) -> tuple[dict, dict, dict]:
    """(flat targets, flat new storage, nested new storage): the load reads into new storage only."""
    flat, mappings = flatten_state_dict(converted)
    fresh = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            # A key the checkpoint lacks (strict=False) keeps the caller's tensor: nothing reads into it.
            fresh[key] = _empty_like(value, dtypes[key]) if key in dtypes else value
        else:
            fresh[key] = copy.deepcopy(value)
    return flat, fresh, unflatten_state_dict(fresh, mappings)


def _commit(flat: dict, fresh: dict, dtypes: dict[str, torch.dtype], tuple_copies: list[tuple]) -> None:
    """Copy every loaded tensor into the caller's tensor (local shard for DTensors); no collective, no I/O."""
    with torch.no_grad():
        for target, value in tuple_copies:
            target.copy_(value)
        for key in dtypes:
            target, value = flat[key], fresh[key]
            if isinstance(target, TorchDTensor):
                target._local_tensor.copy_(value._local_tensor)
            else:
                target.copy_(value)


def _read_error(exc: BaseException, path: str) -> Exception:
    """An ``Exception`` for a failed DCP read (torch's ``CheckpointException`` is a ``BaseException``), of the
    first failure's class when it is one of ours, naming the ranks."""
    failures = failures_of(exc)
    rank, first = failures[0]
    ranks = sorted({r for r, _ in failures if r is not None})
    on = f" (on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks else ""
    if isinstance(first, (CheckpointError, CheckpointSecurityError)):
        return type(first)(f"load({path}) failed{on}: {first} -- nothing was modified")
    return CheckpointError(f"load({path}) failed{on}: {type(first).__name__}: {first} -- nothing was modified")


def load(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    strict: bool = True,
    require_marker: bool = False,
    before_commit: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``state`` (the same structure ``save`` was given), resharding.

    Tensors are loaded in place: DTensors (ours or torch's) receive the shard their current layout asks for,
    whatever mesh the checkpoint was saved on; plain tensors receive the full value. Non-tensor values are
    replaced in ``state``'s containers (and ``state`` is returned).

    All or nothing: every key, global shape and dtype is checked against the checkpoint's metadata and every
    file's size against its index first (one ``ValueError`` names the first offending keys; a
    ``CheckpointCorruptError`` names a truncated file). Then everything is read into new tensors, each entry
    verified against its checksum, and only when every rank has read everything are the values copied into
    ``state``. Any failure raises an ``Exception`` naming the file (and entry) with ``state`` untouched.
    ``before_commit(loaded)``, if given, sees the loaded state (same structure, new tensors; a key the
    checkpoint lacks under ``strict=False`` shows the caller's tensor) before that copy and may raise to abort
    it (it must decide alike on every rank). Tensors inside tuples are loaded in place too (the tuple is
    rebuilt around the caller's tensors).

    Saved bfloat16/float16 values load into float32/float64 tensors (and float32 into float64): exact
    widening casts, as torch's DCP does them; narrowing casts are refused. ``strict=False`` loads the keys
    present on both sides. Directories written by other tools (DCP's ``.metadata``, no marker) are read
    without checksums; ``require_marker=True`` refuses them.

    Example::

        state = {"model": get_model_state_dict(model), "step": 0}
        load(state, "ckpts/step3")          # the model's parameters now hold the checkpoint's values

    A round trip on one rank:

    >>> import tempfile
    >>> from torch import nn
    >>> from lightning_shard.checkpoint import get_model_state_dict
    >>> from lightning_shard.fsdp import fully_shard
    >>> model = fully_shard(nn.Linear(4, 2))
    >>> saved = model.weight.full_tensor().clone()
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     save({"model": get_model_state_dict(model), "step": 3}, f"{tmp}/step3")
    ...     with torch.no_grad():
    ...         _ = model.weight.zero_()
    ...     state = {"model": get_model_state_dict(model), "step": 0}
    ...     loaded = load(state, f"{tmp}/step3")   # fills state in place and returns it
    >>> loaded is state, state["step"], torch.equal(model.weight.full_tensor(), saved)
    (True, 3, True)
    """
    path = os.path.abspath(os.fspath(path))
    error: Exception | None = None
    try:  # the checks (no data read, no collective) ...
        check_checkpoint_dir(path, require_marker=require_marker)
        if not isinstance(state, dict):
            raise TypeError(f"load: state must be a dict (e.g. {{'model': ...}}), got {type(state).__name__}")
        reader = SafeFileSystemReader(path)
        metadata = reader.read_metadata()
        check_files(path, metadata)
        converted = _to_dcp(state)
        dtypes = _validate(converted, metadata, path, strict)
        flat, fresh, shadow = _shadow(converted, dtypes)
    except Exception as e:
        error = e
    _agree_before_reading(error, path)  # ... failed on some rank: every rank raises before DCP's collectives
    try:
        dcp.load(
            shadow,
            storage_reader=reader,
            planner=SafeLoadPlanner(allow_partial_load=True),  # strictness was checked above
            no_dist=not _dist() or _fake_world(),
        )
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _read_error(e, path) from (e if isinstance(e, Exception) else None)
    # dcp.load returns on a rank only once every rank's reads succeeded (it gathers their outcomes).
    if before_commit is not None:
        before_commit(shadow)
    _commit(flat, fresh, dtypes, _tuple_copies(state, shadow))
    _merge_back(state, shadow)  # non-tensor values; the caller's tensors stay (they were copied into)
    return state
