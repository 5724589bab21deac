"""``save`` / ``load``: sharded checkpoints as torch.distributed.checkpoint (DCP) directories, published atomically.

Crash-safety protocol of ``save(state, path)`` (every rank calls it; ``path`` on a filesystem all ranks share):

1. Rank 0 draws a random id and broadcasts it (a tensor, no pickling); every rank writes its shards into
   ``<path>.tmp-<id>/`` through DCP (which also has rank 0 write DCP's ``.metadata``).
2. Barrier: every rank has finished writing (and fsynced: DCP's writer syncs files).
3. Rank 0 writes the completion marker ``.lightning_shard_complete`` (JSON) last, fsyncs it, then publishes:
   if ``path`` exists it is renamed to ``<path>.old-<id>``, the temp dir is renamed to ``path``
   (``os.replace``, atomic on POSIX), the old one deleted. Stale ``<path>.tmp-*`` / ``<path>.old-*`` left by
   crashed saves are deleted after a successful publish.
4. Barrier: when ``save`` returns, ``path`` is the new checkpoint on every rank.

A crash before step 3 leaves ``path`` untouched (the temp dir has no marker and is never loaded). The only
window where ``path`` does not exist is between the two renames of step 3 (two metadata operations on rank 0);
a crash there leaves the previous checkpoint complete at ``<path>.old-<id>`` and ``load(path)`` says so.

Example::

    save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt), "step": 3},
         "ckpt/step3")
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt), "step": 0}
    load(state, "ckpt/step3")            # tensors in place, "step" replaced by 3
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from lightning_shard.checkpoint._interop import to_torch
from lightning_shard.checkpoint._safe_io import SafeFileSystemReader, SafeLoadPlanner
from lightning_shard.checkpoint._validate import Problems, describe
from lightning_shard.tensor import DTensor

__all__ = ["save", "load", "MARKER", "FORMAT_VERSION"]

MARKER = ".lightning_shard_complete"
FORMAT_VERSION = 1
_PLAIN = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device)


# ------------------------------------------------------------------------------------------------ helpers
def _dist() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _agree_id() -> str:
    """A random id chosen by rank 0 and broadcast to all (one int64 tensor: no pickling)."""
    t = torch.tensor([int.from_bytes(os.urandom(7), "little") if _rank() == 0 else 0], dtype=torch.int64)
    if _dist():
        dist.broadcast(t, 0)
    return f"{int(t.item()):014x}"


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
    """Put loaded non-tensor values into the caller's containers (tensors were loaded in place)."""
    if isinstance(state, dict) and isinstance(loaded, Mapping):
        for k in state:
            if k in loaded:
                state[k] = _merge_back(state[k], loaded[k])
        return state
    if isinstance(state, list) and isinstance(loaded, list) and len(state) == len(loaded):
        for i in range(len(state)):
            state[i] = _merge_back(state[i], loaded[i])
        return state
    if isinstance(state, torch.Tensor):
        return state
    return loaded


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


def _write_marker(tmp: str, ckpt_id: str) -> None:
    info = {
        "format": "lightning_shard.checkpoint/dcp",
        "version": FORMAT_VERSION,
        "id": ckpt_id,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "time": time.time(),
        "torch": torch.__version__,
    }
    marker = os.path.join(tmp, MARKER)
    with open(marker, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _publish(tmp: str, path: str, ckpt_id: str) -> None:
    old = f"{path}.old-{ckpt_id}"
    if os.path.exists(path):
        os.replace(path, old)  # window opens: `path` is missing, `old` is complete
        os.replace(tmp, path)  # window closes
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")
    # Leftovers of saves that crashed (one writer per path at a time is assumed).
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ save
def save(state: Mapping[str, Any], path: str | os.PathLike, *, extra_files: Mapping[str, bytes] | None = None) -> None:
    """Write ``state`` as a DCP checkpoint directory at ``path``, atomically (see the module docstring).

    ``state`` is a dict of state dicts and plain values, e.g. ``{"model": get_model_state_dict(model),
    "optimizer": get_optimizer_state_dict(model, opt), "step": 3, "rng": torch.get_rng_state()}``. Our DTensors
    are written as torch DTensors (each rank its shard; replicated data once), plain tensors once (rank 0's
    value: store per-rank values under per-rank keys), other values as ``torch.save`` bytes read back with
    ``weights_only=True``. Every rank must call it (collective); ``path`` must be on a filesystem all ranks
    see. If ``path`` exists it is replaced only once the new checkpoint is complete.

    Example::

        save({"model": get_model_state_dict(model), "step": step}, f"ckpts/step{step}")

    ``extra_files`` (name -> bytes) are written by rank 0 into the checkpoint directory before it is published,
    so they are part of the atomic checkpoint (the Lightning strategy keeps its loop state in ``meta.pt``).
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save: {path} exists and is not a directory; a sharded checkpoint is a directory")
    if not isinstance(state, Mapping):
        raise TypeError(f"save: state must be a dict (e.g. {{'model': ...}}), got {type(state).__name__}")
    converted = _to_dcp(state)
    ckpt_id = _agree_id()
    tmp = f"{path}.tmp-{ckpt_id}"
    os.makedirs(tmp, exist_ok=True)
    dcp.save(converted, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=not _dist())
    _barrier()  # every rank's files are written and synced
    error: BaseException | None = None
    if _rank() == 0:
        try:
            for name, data in (extra_files or {}).items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            _write_marker(tmp, ckpt_id)
            _publish(tmp, path, ckpt_id)
        except BaseException as e:  # tell the other ranks instead of leaving them in the barrier
            error = e
    ok = torch.tensor([0 if error is not None else 1])
    if _dist():
        dist.broadcast(ok, 0)
    if error is not None:
        raise error
    if not ok.item():
        raise RuntimeError(f"save: rank 0 failed to publish {path}; the previous checkpoint (if any) is intact")


# ------------------------------------------------------------------------------------------------ load
def check_checkpoint_dir(path: str, *, require_marker: bool = True) -> None:
    """Raise a clear error unless ``path`` is a complete checkpoint directory.

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
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(
            f"load: {path} is not a complete checkpoint: it has no DCP '.metadata' file (an interrupted save, or not "
            "a checkpoint directory at all)"
        )
    if require_marker and not os.path.exists(os.path.join(path, MARKER)):
        raise ValueError(
            f"load: {path} has no completion marker {MARKER!r}: the save that wrote it did not finish (a crashed "
            "save leaves such a directory) or another tool wrote it. If it is a complete DCP checkpoint written by "
            "torch.distributed.checkpoint, pass require_marker=False."
        )


def _validate(converted: dict, metadata, path: str, strict: bool) -> None:
    flat, _ = flatten_state_dict(converted)
    saved = metadata.state_dict_metadata
    problems = Problems(f"load({path})")
    matched = 0
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            if strict:
                problems.missing([key])
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.mismatch(key, describe(value.shape, value.dtype), "a non-tensor value")
                continue
            if tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
                problems.mismatch(key, describe(value.shape, value.dtype), describe(md.size, md.properties.dtype))
                continue
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
        problems.unexpected(k for k in saved if k.split(".", 1)[0] in tops and k not in flat)
    problems.raise_if_any(n_expected=len(flat), n_matched=matched)


def load(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    strict: bool = True,
    require_marker: bool = True,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``state`` (the same structure ``save`` was given), resharding.

    Tensors are loaded in place: DTensors (ours or torch's) receive the shard their current layout asks for,
    whatever mesh the checkpoint was saved on; plain tensors receive the full value. Non-tensor values are
    replaced in ``state``'s containers (and ``state`` is returned). Before reading any data, every key, global
    shape and dtype is checked against the checkpoint's metadata (missing keys, keys the checkpoint has under
    the same top-level entries but ``state`` lacks, mismatches): one ``ValueError`` names the first offending
    keys and nothing is modified. ``strict=False`` loads the keys present on both sides. Directories without
    the completion marker are refused (``require_marker=False`` reads DCP directories written by other tools).

    Example::

        state = {"model": get_model_state_dict(model), "step": 0}
        load(state, "ckpts/step3"); set_model_state_dict(model, state["model"])  # (already in place)
    """
    path = os.path.abspath(os.fspath(path))
    check_checkpoint_dir(path, require_marker=require_marker)
    if not isinstance(state, dict):
        raise TypeError(f"load: state must be a dict (e.g. {{'model': ...}}), got {type(state).__name__}")
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata()
    converted = _to_dcp(state)
    _validate(converted, metadata, path, strict)
    dcp.load(
        converted,
        storage_reader=reader,
        planner=SafeLoadPlanner(allow_partial_load=True),  # strictness was checked above
        no_dist=not _dist(),
    )
    _merge_back(state, converted)
    return state
