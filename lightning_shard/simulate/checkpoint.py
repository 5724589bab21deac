"""Checkpoint saves and loads on the simulated accelerator cluster: the engine's own checkpoint code, with a
storage stand-in where bytes would be written or read.

A fake tensor has no bytes. Everything else of a checkpoint runs as on GPUs: the sharded and full state dicts
(the full one all-gathers each parameter over the mesh's groups, on the parameters' device, and stages it to
the host), DCP's planning and its ``.metadata``, the checksum planner's device-to-host staging of each entry,
the completion marker and the atomic publish (real files in a temporary directory), and on load the
validation against the metadata, the host shadow state and the copy into the model. ``simulated_storage``
swaps only the storage layer of ``lightning_shard.checkpoint.save_load``:

* ``RecordingWriter``: takes each entry from the planner as DCP's ``FileSystemWriter`` does (staged to the
  host), records its size, writes non-tensor entries for real and leaves a hole of the tensor's size (a
  sparse file), so every data file has its real length and the metadata its real offsets.
* ``StandInReader``: reads non-tensor entries (and verifies their checksums) for real; for a tensor entry it
  stages a host tensor of the entry's size, copies it into the load target and records the size.

Simplifications, all of the simulation, none of the engine: each simulated rank plans its DCP save alone and
publishes it (its peers' plans are not available in a fake world), so it also writes the plain tensors that
DCP's deduplication would leave to rank 0 (AdamW's step counters: bytes, not memory); and loaded tensors
have no values, so an optimizer step after a simulated load cannot read AdamW's step counter.

Example::

    with simulated_world(8) as world, simulated_storage() as storage:
        save({"model": get_model_state_dict(model)}, tmp)
    storage.written
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_shard.checkpoint import save_load
from lightning_shard.checkpoint._safe_io import SafeFileSystemReader
from lightning_shard.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from lightning_shard.simulate.memory import MemoryTracker
from lightning_shard.tensor import DTensor

__all__ = ["simulated_storage", "simulate_checkpoints", "StorageRecord", "RecordingWriter", "StandInReader"]


@dataclass
class StorageRecord:
    """Bytes this rank would have written and read (tensor data and pickled non-tensor entries), and the data
    files it created (sparse: their holes stand for the tensor bytes).

    Example: ``with simulated_storage() as record: save(state, path)``, then ``record.written``.
    """

    written: int = 0
    read: int = 0
    files: list[str] = field(default_factory=list)


_RECORD: StorageRecord | None = None


def _record() -> StorageRecord:
    if _RECORD is None:
        raise RuntimeError("simulate: the checkpoint storage stand-in is used outside simulated_storage()")
    return _RECORD


class RecordingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` with tensor bytes replaced by holes (see the module docstring).

    Example: ``dcp.save(state, storage_writer=RecordingWriter(tmp), no_dist=True)`` inside ``simulated_storage()``.
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0.distcp"  # one file per rank, as single_file_per_rank
        results, offset = [], 0
        path = os.path.join(os.fspath(self.path), name)
        with open(path, "wb") as f:
            for item in plan.items:
                data = planner.resolve_data(item)  # the checksum planner stages tensors to the host here
                if isinstance(data, torch.Tensor):
                    data = data.detach().cpu()  # FileSystemWriter's own copy (a no-op once on the host)
                    length = _tensor_file_bytes(data)
                    f.seek(length, io.SEEK_CUR)
                else:
                    payload = data.getvalue()
                    length = len(payload)
                    f.write(payload)
                results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
                offset += length
            f.truncate(offset)
        record = _record()
        record.written += offset
        record.files.append(path)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


class StandInReader(SafeFileSystemReader):
    """The engine's checking reader with tensor entries staged, not read (see the module docstring).

    Example: ``dcp.load(state, storage_reader=StandInReader(path), no_dist=True)`` inside ``simulated_storage()``.
    """

    def _read_one(self, stream, file: str, req: ReadItem, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            super()._read_one(stream, file, req, planner)
        else:
            target = planner.resolve_tensor(req).detach()
            # the bytes read to the host (new_empty: a fake tensor like the target, though DCP runs unfaked)
            staged = target.new_empty(tuple(req.lengths), device="cpu")
            target.copy_(staged)
            planner.commit_tensor(req, target)
        _record().read += self.storage_data[req.storage_index].length


def _tensor_file_bytes(t: torch.Tensor) -> int:
    """Bytes ``torch.save`` takes for ``t``'s data (its storage header is small and ignored)."""
    return t.numel() * t.element_size()


@contextlib.contextmanager
def simulated_storage() -> Iterator[StorageRecord]:
    """Swap the storage layer of the engine's checkpoints for the stand-ins above inside the block.

    Example: ``with simulated_storage() as record: save(state, path); load(state, path)``.
    """
    global _RECORD
    if _RECORD is not None:
        raise RuntimeError("simulate: simulated_storage() is already active")
    swapped = {
        "ChecksumFileSystemWriter": RecordingWriter,
        "SafeFileSystemReader": StandInReader,
        "dcp": _RealIndexDCP,
        "to_torch": _unfaked(save_load.to_torch),
    }
    originals = {name: getattr(save_load, name) for name in swapped}
    _RECORD = StorageRecord()
    for name, value in swapped.items():
        setattr(save_load, name, value)
    try:
        yield _RECORD
    finally:
        for name, value in originals.items():
            setattr(save_load, name, value)
        _RECORD = None


def _unfaked(fn):
    """``fn`` with the fake mode suspended: DCP's planning (and the check of a strided layout when our DTensors
    become torch's) computes shard offsets with small host index tensors whose values it reads
    (``int(offsets[0])``, ``.tolist()``), which fake tensors cannot give. The state's fake tensors still
    dispatch to their own fake mode and the memory tracker stays active; only the tensors these functions
    create from Python values are real (index tensors of a few elements: no tensor data is allocated here)."""

    def unfaked(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return unfaked


class _RealIndexDCP:
    """``torch.distributed.checkpoint``'s ``save`` and ``load`` through ``_unfaked``."""

    save = staticmethod(_unfaked(dcp.save))
    load = staticmethod(_unfaked(dcp.load))


def simulate_checkpoints(model: nn.Module, optimizer: torch.optim.Optimizer, memory: MemoryTracker) -> dict:
    """A sharded save and load (DCP directories) and a full save and load (plain tensors, on the host of
    rank 0 / of every rank), each its own phase of ``memory``; returns the bytes each moved on this rank and
    the host memory peak of each phase (the staging: device peaks are in ``memory.peak_by_phase``).

    Example: ``simulate_checkpoints(model, optimizer, world.memory)["sharded_bytes_written"]``.
    """
    with tempfile.TemporaryDirectory(prefix="lightning_shard_sim_ckpt_") as root, simulated_storage() as storage:
        path = os.path.join(root, "sharded")
        _enter_phase(memory, "checkpoint_save")
        save_load.save(_sharded_state(model, optimizer), path)
        written = storage.written
        _enter_phase(memory, "checkpoint_load")
        state = _sharded_state(model, optimizer)
        save_load.load(state, path)
        set_optimizer_state_dict(model, optimizer, state["optimizer"])  # the hyperparameters, as the strategy
        read = storage.read
    _enter_phase(memory, "checkpoint_save_full")
    full = _full_save(model, optimizer)
    _enter_phase(memory, "checkpoint_load_full")
    _full_load(model, optimizer)
    phases = ("checkpoint_save", "checkpoint_load", "checkpoint_save_full", "checkpoint_load_full")
    return {
        "sharded_bytes_written": written,
        "sharded_bytes_read": read,
        "full_bytes_written": full,
        "host_peak_by_phase": {p: memory.peak_by_phase[p].get("cpu", 0) for p in phases},
    }


def _enter_phase(memory: MemoryTracker, name: str) -> None:
    """Start phase ``name`` with its peak at the bytes live now: a phase that allocates nothing on a device
    peaks at what it holds there (a sharded save's state dict views the parameters' own storage)."""
    memory.phase = name
    for device, live in memory.live.items():
        memory.peak_by_phase[name][device] = max(memory.peak_by_phase[name][device], live)


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def _full_save(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Rank 0 gathers the full state on its host (other ranks get ``{}``), as the strategy's full checkpoint;
    returns the tensor bytes it would ``torch.save``."""
    state = {
        "model": get_model_state_dict(model, full_state_dict=True, cpu_offload=True),
        "optimizer": get_optimizer_state_dict(model, optimizer, full_state_dict=True, cpu_offload=True),
    }
    return _tensor_bytes(state)


def _full_load(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank holds the full file's tensors on the host (``torch.load(map_location="cpu")``) and copies
    its shard of each into the model and the optimizer."""
    set_model_state_dict(model, _on_host_full(get_model_state_dict(model)))
    set_optimizer_state_dict(model, optimizer, _on_host_full(get_optimizer_state_dict(model, optimizer)))


def _on_host_full(obj):
    """``obj`` with every tensor replaced by a new host tensor of its global shape (what a full file holds)."""
    if isinstance(obj, torch.Tensor):
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        return torch.empty(tuple(obj.shape), dtype=local.dtype, device="cpu")
    if isinstance(obj, dict):
        return {k: _on_host_full(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_on_host_full(v) for v in obj]
    return obj


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
