"""Reading DCP directories without unpickling code: a restricted metadata unpickler and a weights-only planner.

torch's ``FileSystemReader.read_metadata`` uses ``pickle.load`` and ``DefaultLoadPlanner.load_bytes`` uses
``torch.load(weights_only=False)``: a crafted checkpoint could run code on load. We replace both:

* ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which resolves only the DCP metadata dataclasses,
  ``torch.Size``, dtypes, layouts, memory formats and a few builtins; anything else raises.
* non-tensor values ("bytes" items) are read with ``torch.load(weights_only=True)``: tensors and plain
  containers (dict, list, tuple, str, int, float, bool, None) only.

Tensor data is already read with ``weights_only=True`` by torch's reader.

Example::

    reader = SafeFileSystemReader(path)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

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
    """A checkpoint file asked to unpickle something other than plain data."""


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


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` cannot execute code. Example: ``SafeFileSystemReader(path)``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
