"""Reading DCP directories without unpickling code: a restricted metadata unpickler and a weights-only planner.

torch's ``FileSystemReader.read_metadata`` uses ``pickle.load`` and ``DefaultLoadPlanner.load_bytes`` uses
``torch.load(weights_only=False)``: a crafted checkpoint could run code on load. We replace both:

* ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which resolves only the DCP metadata dataclasses,
  ``torch.Size``, dtypes, layouts, memory formats and a few builtins; anything else raises.
* non-tensor values ("bytes" items) are read with ``torch.load(weights_only=True)``: tensors and plain
  containers (dict, list, tuple, str, int, float, bool, None) only.

Tensor data is read with ``weights_only=True``. The reader also checks what it reads: every entry's bytes must
be present (a truncated file is named, with the entry and the sizes) and, when the checkpoint's completion marker
records checksums (``_integrity``), every entry must hash to its recorded digest, before the value is handed on.

Example::

    reader = SafeFileSystemReader(path)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import os
import pickle
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_shard.checkpoint._integrity import CheckpointCorruptError, digest, entry_key

MARKER = ".lightning_shard_complete"

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED = {
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"),
    ("pathlib", "Path"),  # maps a layout name to torch.strided etc.; runs no user code
}


class CheckpointSecurityError(RuntimeError):
    """A checkpoint file asked to unpickle something other than plain data.

    >>> import io, os, pickle
    >>> load_metadata(io.BytesIO(pickle.dumps(os.system)))   # what load() does with a ".metadata" file
    Traceback (most recent call last):
    ...
    lightning_shard.checkpoint._safe_io.CheckpointSecurityError: checkpoint metadata asks to load posix.system, ...
    """


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULE_PREFIXES):
            obj = super().find_class(module, name)
            # Dataclasses and enums only (their constructors just store fields): never functions, and never
            # classes with side effects such as FileSystemWriter.
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise CheckpointSecurityError(
            f"checkpoint metadata asks to load {module}.{name}, which is not plain checkpoint metadata; refusing to "
            "unpickle it (only DCP metadata classes, dtypes and builtins are allowed)"
        )


def load_metadata(f) -> Metadata:
    """Unpickle a DCP ``.metadata`` stream, allowing only metadata classes (see module docstring)."""
    return _MetadataUnpickler(f).load()


def read_marker(path: str) -> dict[str, Any] | None:
    """The completion marker of the checkpoint directory ``path`` (JSON), or None if it has none."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{marker}: the completion marker cannot be read ({e})") from e
    if not isinstance(info, dict):
        raise CheckpointCorruptError(f"{marker}: the completion marker is not a JSON object")
    return info


def verify_file(path: str, name: str, data: bytes, marker: dict[str, Any] | None) -> None:
    """Raise ``CheckpointCorruptError`` if file ``name`` of checkpoint ``path`` differs from its recorded digest."""
    sums = (marker or {}).get("checksums") or {}
    expected = (sums.get("files") or {}).get(name)
    if expected is not None and digest(data, sums["algorithm"]) != expected:
        raise CheckpointCorruptError(
            f"{os.path.join(path, name)} is corrupt: its checksum differs from the one recorded when the "
            "checkpoint was saved (the file was modified or damaged after saving)"
        )


def undecodable(where: str, what: str, error: Exception) -> Exception:
    """The error for an entry that ``torch.load(weights_only=True)`` refused: ``CheckpointSecurityError`` when it
    asks for a Python global (a pickled object or code, never unpickled), else ``CheckpointCorruptError`` (damaged
    bytes; without checksums, as in directories of other tools, this is how damage shows, if it does).

    Example: ``raise undecodable("ckpt/__0_0.distcp (entry 'step')", "a plain value", e) from e``.
    """
    text = str(error)
    # torch's weights-only message is a page of advice to pass weights_only=False: keep the line that says why
    reason = next((line for line in text.splitlines() if "GLOBAL" in line or "Unsupported" in line), text)
    reason = f"{type(error).__name__}: {reason.strip() or text}"
    if "GLOBAL" in text:
        return CheckpointSecurityError(
            f"{where} asks to unpickle a Python object, not {what} ({reason}); refusing to run it: the checkpoint "
            "holds something other than tensors and plain containers (a checkpoint of another kind, or crafted)"
        )
    return CheckpointCorruptError(
        f"{where} cannot be read as {what} ({reason}): the file is damaged; restore it from a copy or use another "
        "checkpoint"
    )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that cannot execute code and checks every entry it reads.

    ``read_metadata`` uses the restricted unpickler; ``read_data`` names the file and entry of a truncated or
    unreadable entry and, for checkpoints whose marker records checksums, verifies each entry's digest before
    handing the value on. The metadata is parsed once per reader: a reader used for many ``dcp.load`` calls
    (consolidation loads one key at a time) would otherwise unpickle the whole index once per key; ``metadata=``
    hands it one parsed already (consolidation hands each load the index's entries of its key alone: torch's
    planner compares every key of the index with the keys asked for on each load). Example:
    ``SafeFileSystemReader(path)``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *args: Any,
        marker: Any = False,
        metadata: Metadata | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, *args, **kwargs)
        # ``marker``: the directory's marker if the caller read it already (False: read it here)
        self.marker = read_marker(os.fspath(path)) if marker is False else marker
        sums = (self.marker or {}).get("checksums") or {}
        self.algorithm: str | None = sums.get("algorithm")
        self.digests: dict[str, str] = sums.get("entries") or {}
        self._metadata: dict[tuple[str, Any], Metadata] = {}  # per (path, ``rank`` argument): what was parsed
        if metadata is not None:  # the caller parsed (and checked) it already, or serves a part of it
            self._metadata[(os.fspath(self.path), None)] = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        key = (os.fspath(self.path), rank)  # ``reset(checkpoint_id)`` may point the reader at another directory
        if key not in self._metadata:
            self._metadata[key] = self._parse_metadata(rank)
        metadata = self._metadata[key]
        metadata.storage_meta.load_id = self.load_id  # a new id per dcp.load (``reset``), as torch's reader sets it
        return metadata

    def _parse_metadata(self, rank: int | None) -> Metadata:
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        verify_file(os.fspath(self.path), os.path.basename(os.fspath(path)), data, self.marker)
        try:
            metadata = load_metadata(io.BytesIO(data))
        except CheckpointSecurityError:
            raise
        except Exception as e:
            raise CheckpointCorruptError(f"{path}: DCP's metadata cannot be read ({type(e).__name__}: {e})") from e
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def _verify(self, req: ReadItem, value: torch.Tensor | bytes, where: str) -> None:
        if self.algorithm is None:
            return  # a checkpoint written by another tool: no checksums to compare with
        key = entry_key(req.storage_index)
        expected = self.digests.get(key)
        if expected is None:
            raise CheckpointCorruptError(f"{where}: the completion marker records no checksum for entry {key!r}")
        if digest(value, self.algorithm) != expected:
            raise CheckpointCorruptError(
                f"{where} is corrupt: entry {req.storage_index.fqn!r} differs from its checksum recorded at save "
                "(the file was modified or damaged after saving); restore it from a copy or use another checkpoint"
            )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # torch's FileSystemReader.read_data, reading each entry whole so that it can be checked first.
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            file = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(file, "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_one(stream, os.fspath(file), req, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_one(self, stream, file: str, req: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[req.storage_index]
        stream.seek(info.offset)
        data = stream.read(info.length)
        where = f"{file} (entry {req.storage_index.fqn!r}, bytes {info.offset}..{info.offset + info.length})"
        if len(data) != info.length:
            raise CheckpointCorruptError(
                f"{where}: the file is truncated: {len(data)} of the entry's {info.length} bytes are present"
            )
        raw = io.BytesIO(data)
        if info.transform_descriptors:
            raw = self.transforms.transform_load_stream(req, info.transform_descriptors, raw)
        if req.type == LoadItemType.BYTE_IO:
            self._verify(req, data, where)
            try:
                planner.load_bytes(req, io.BytesIO(raw.read(-1)))
            except Exception as e:
                raise undecodable(where, "a plain value", e) from e
            return
        seekable = raw if raw.seekable() else io.BytesIO(raw.read(-1))
        try:
            tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        except Exception as e:
            raise undecodable(where, "a tensor", e) from e
        self._verify(req, tensor, where)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointCorruptError(f"{where}: entry has size {tuple(tensor.size())}, expected {target.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def check_files(path: str, metadata: Metadata) -> None:
    """Raise ``CheckpointCorruptError`` naming the file if a data file is missing or shorter than the entries
    DCP's metadata places in it (a truncated copy, a partial download). Reads no data, only file sizes.

    Example: ``check_files("ckpts/step3", SafeFileSystemReader("ckpts/step3").read_metadata())``.
    """
    ends: dict[str, tuple[int, str]] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, (-1, ""))[0]:
            ends[info.relative_path] = (end, index.fqn)
    for relative_path, (end, fqn) in sorted(ends.items()):
        file = os.path.join(path, relative_path)
        try:
            size = os.path.getsize(file)
        except OSError as e:
            raise CheckpointCorruptError(
                f"{file} is missing or unreadable ({e.strerror}); the checkpoint's metadata places entry {fqn!r} in it"
            ) from e
        if size < end:
            raise CheckpointCorruptError(
                f"{file} is truncated: it has {size} bytes, but the checkpoint's metadata places entry {fqn!r} "
                f"up to byte {end}"
            )
