"""Consolidate a sharded (DCP) checkpoint into one file, streaming one tensor at a time (CLI: consolidate.py).

``consolidate(IN, OUT)`` writes a ``torch.save``-format file (a zip archive) that
``torch.load(OUT, weights_only=True)`` reads, holding the same nested structure ``save`` was given, e.g.
``{"model": {fqn: tensor}, "optimizer": {...}, "step": 3}``. ``safetensors=True`` writes the model weights
only (``state["model"]`` if there is such an entry, else every tensor) as a ``.safetensors`` file.

How it streams: the file's index is written first, from DCP's metadata alone (every tensor's global shape and
dtype is known without reading data): for torch format the pickle ``data.pkl`` refers to storages by key, for
safetensors the JSON header holds every offset. Then each tensor is read alone (``dcp.load`` of one key,
without a process group), appended to the output, and freed. Peak memory is about the largest tensor plus
twice its largest saved shard (torch's reader holds a shard's bytes and the shard while copying), independent
of the model size.

Example::

    python -m lightning_shard.checkpoint.consolidate ckpts/step3 model.pt
    python -m lightning_shard.checkpoint.consolidate ckpts/step3 model.safetensors --safetensors
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import json
import os
import pickle
import struct
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from lightning_shard.checkpoint._safe_io import SafeFileSystemReader, SafeLoadPlanner, check_files, verify_file
from lightning_shard.checkpoint.save_load import _read_error, check_checkpoint_dir

__all__ = ["consolidate", "main"]

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class _Reader:
    """Reads one key of a DCP directory at a time, in this process only (no process group needed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        reader = SafeFileSystemReader(path)
        self.marker = reader.marker
        self.metadata: Metadata = reader.read_metadata()
        check_files(path, self.metadata)  # a missing or truncated file is named before anything is written
        self._chunks: dict[str, dict] = collections.defaultdict(dict)  # key -> its saved chunks (storage_data)
        for index, info in (self.metadata.storage_data or {}).items():
            self._chunks[index.fqn][index] = info

    def tensor(self, key: str) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        self._load({key: out})
        return out

    def value(self, key: str) -> Any:
        holder: dict[str, Any] = {key: 0}  # placeholder (DCP skips None values); replaced by the loaded value
        self._load(holder)
        return holder[key]

    def _load(self, state: dict[str, Any]) -> None:
        with warnings.catch_warnings():  # "no process group: assuming a single process" is exactly our intent
            warnings.simplefilter("ignore", UserWarning)
            self._load_quiet(state)

    def _load_quiet(self, state: dict[str, Any]) -> None:
        try:
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(self.path, marker=self.marker, metadata=self._metadata_of(state)),
                planner=SafeLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )
        except BaseException as e:  # torch's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _read_error(e, self.path) from (e if isinstance(e, Exception) else None)

    def _metadata_of(self, keys) -> Metadata:
        """The index restricted to ``keys``: each load then costs the size of its keys, not of the whole index
        (DCP's planner builds the set of the index's keys on every load: quadratic over one load per key)."""
        planner_data = self.metadata.planner_data
        return dataclasses.replace(
            self.metadata,
            state_dict_metadata={k: self.metadata.state_dict_metadata[k] for k in keys},
            storage_data={i: info for k in keys for i, info in self._chunks[k].items()},
            planner_data={k: planner_data[k] for k in keys if k in planner_data} if planner_data else planner_data,
            storage_meta=StorageMeta(),
        )

    def path_of(self, key: str) -> tuple:
        return tuple(self.metadata.planner_data.get(key, (key,)))


# ------------------------------------------------------------------------------------------------ torch format
class _TensorRef:
    """Stands for a tensor in the pickle; becomes ``_rebuild_tensor_v2(storage key ...)``."""

    def __init__(self, storage_key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.storage_key, self.shape, self.dtype = storage_key, shape, dtype


class _StorageRef:
    def __init__(self, ref: _TensorRef) -> None:
        self.ref = ref


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


class _IndexPickler(pickle.Pickler):
    """Pickles the object tree exactly as ``torch.save`` would, with tensors' data left to later records.

    Tensors already in memory (e.g. a ``ModelCheckpoint``'s ``best_model_score`` in Lightning's ``meta.pt``)
    are referenced the same way and collected in ``inline`` (storage key -> tensor) for the caller to write,
    so the file stays readable with ``weights_only=True``.
    """

    def __init__(self, *args: Any, first_key: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inline: dict[str, torch.Tensor] = {}
        self.next_key = first_key

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided:
                raise TypeError(f"consolidate: cannot store a {type(obj).__name__} ({obj.layout}) as plain data")
            t = obj.detach().to("cpu").contiguous()
            key = str(self.next_key)
            self.next_key += 1
            self.inline[key] = t
            obj = _TensorRef(key, tuple(t.shape), t.dtype)
        if isinstance(obj, _TensorRef):
            args = (_StorageRef(obj), 0, torch.Size(obj.shape), _contiguous_stride(obj.shape), False)
            return torch._utils._rebuild_tensor_v2, (*args, collections.OrderedDict())
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            ref = obj.ref
            storage_type = getattr(torch, torch.TypedStorage(dtype=ref.dtype, _internal=True)._pickle_storage_type())
            numel = 1
            for s in ref.shape:
                numel *= s
            return ("storage", storage_type, ref.storage_key, "cpu", numel)
        return None


def _tree(reader: _Reader, keys: list[str]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The nested object with placeholders for tensors, and (storage key, DCP key) in write order."""
    root: dict[str, Any] = {}
    tensors: list[tuple[str, str]] = []
    for key in keys:
        md = reader.metadata.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            storage_key = str(len(tensors))
            tensors.append((storage_key, key))
            value: Any = _TensorRef(storage_key, tuple(md.size), md.properties.dtype)
        else:
            value = reader.value(key)  # small plain values, read with weights_only=True
        set_element(root, reader.path_of(key), value)
    return root, tensors


def _write_torch(reader: _Reader, keys: list[str], out_file: str, extra: dict[str, Any] | None = None) -> None:
    root, tensors = _tree(reader, keys)
    root.update(extra or {})  # e.g. Lightning's meta.pt: loops, callbacks, hyperparameters
    buf = io.BytesIO()
    pickler = _IndexPickler(buf, protocol=2, first_key=len(tensors))
    pickler.dump(root)
    data = buf.getvalue()
    writer = torch._C.PyTorchFileWriter(out_file)
    # The records torch.save writes, in its order (see torch.serialization._save).
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", len("1"))
    alignment = str(torch.serialization._get_storage_alignment())
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for storage_key, key in tensors:
        t = reader.tensor(key)
        storage = t.untyped_storage()
        writer.write_record(f"data/{storage_key}", storage, storage.nbytes())
        del t, storage  # one tensor at a time
    for storage_key, t in pickler.inline.items():
        storage = t.untyped_storage()
        writer.write_record(f"data/{storage_key}", storage, storage.nbytes())
    writer.write_end_of_file()


# ------------------------------------------------------------------------------------------------ safetensors
def _model_keys(reader: _Reader) -> list[tuple[str, str]]:
    """(safetensors name, DCP key) of the model weights: the "model" entry (or Lightning's "state_dict") if
    present, else every tensor."""
    md = reader.metadata.state_dict_metadata
    tensors = [k for k, v in md.items() if isinstance(v, TensorStorageMetadata)]
    under_model = [k for k in tensors if reader.path_of(k)[0] in ("model", "state_dict")]
    if under_model:
        return [(".".join(str(p) for p in reader.path_of(k)[1:]), k) for k in under_model]
    return [(".".join(str(p) for p in reader.path_of(k)), k) for k in tensors]


def _write_safetensors(reader: _Reader, out_file: str) -> None:
    entries = _model_keys(reader)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, key in entries:
        md = reader.metadata.state_dict_metadata[key]
        if md.properties.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"consolidate: {key!r} has dtype {md.properties.dtype}, which safetensors cannot store")
        nbytes = md.properties.dtype.itemsize
        for s in md.size:
            nbytes *= s
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[md.properties.dtype],
            "shape": list(md.size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(out_file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, key in entries:
            t = reader.tensor(key)
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # no extra copy
            del t


# ------------------------------------------------------------------------------------------------ entry points
def _lightning_meta(sharded_dir: str, marker: dict[str, Any] | None) -> dict[str, Any]:
    """The non-tensor part of a checkpoint written by the Lightning strategy (``meta.pt``), if any, so the
    consolidated file is a complete Lightning checkpoint that ``fit(ckpt_path=...)`` resumes from. Verified
    against its checksum; read with ``weights_only=True``."""
    meta = os.path.join(sharded_dir, "meta.pt")
    if not os.path.isfile(meta):
        return {}
    with open(meta, "rb") as f:
        data = f.read()
    verify_file(sharded_dir, "meta.pt", data, marker)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _check_output(out_file: str, overwrite: bool) -> None:
    """Refuse an output path before anything is read or written."""
    if os.path.isdir(out_file):
        raise IsADirectoryError(f"consolidate: the output {out_file} is a directory; give a file name")
    if os.path.exists(out_file) and not overwrite:
        raise FileExistsError(
            f"consolidate: the output {out_file} exists; pass overwrite=True (CLI: --overwrite) to replace it"
        )
    parent = os.path.dirname(out_file) or "."
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"consolidate: the output's directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"consolidate: the output's directory {parent} is not writable")


def consolidate(
    sharded_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    safetensors: bool = False,
    require_marker: bool = False,
    overwrite: bool = False,
) -> None:
    """Write the checkpoint directory ``sharded_dir`` as one file ``out_file``, one tensor at a time.

    Runs in one process (no process group, any machine that sees the directory). The output path is checked
    first (an existing file is refused unless ``overwrite=True``); the output is written to ``<out_file>.tmp``
    and renamed when complete. Every entry is verified against the checksum recorded at save (a mismatch
    raises ``CheckpointCorruptError`` naming the file and entry, and no output is left). Directories written
    by other tools (no marker) are read without checksums unless ``require_marker=True``. See the module
    docstring for formats and memory.

    Example::

        consolidate("ckpts/step3", "step3.pt")
        torch.load("step3.pt", weights_only=True)["model"]["embed.weight"]

    >>> import tempfile
    >>> from torch import nn
    >>> from lightning_shard.checkpoint import get_model_state_dict, save
    >>> from lightning_shard.fsdp import fully_shard
    >>> model = fully_shard(nn.Linear(4, 2))
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     save({"model": get_model_state_dict(model), "step": 3}, f"{tmp}/step3")
    ...     consolidate(f"{tmp}/step3", f"{tmp}/step3.pt")
    ...     full = torch.load(f"{tmp}/step3.pt", weights_only=True)
    >>> full["step"], torch.equal(full["model"]["weight"], model.weight.full_tensor())
    (3, True)
    """
    sharded_dir = os.path.abspath(os.fspath(sharded_dir))
    out_file = os.path.abspath(os.fspath(out_file))
    check_checkpoint_dir(sharded_dir, require_marker=require_marker)
    _check_output(out_file, overwrite)  # before anything is read or written
    reader = _Reader(sharded_dir)
    tmp = out_file + ".tmp"
    try:
        if safetensors:
            _write_safetensors(reader, tmp)
        else:
            meta = _lightning_meta(sharded_dir, reader.marker)
            _write_torch(reader, list(reader.metadata.state_dict_metadata), tmp, meta)
        os.replace(tmp, out_file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m lightning_shard.checkpoint.consolidate IN OUT [--safetensors] [--overwrite]``."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_shard.checkpoint.consolidate",
        description="Consolidate a sharded lightning_shard/DCP checkpoint directory into one file, streaming.",
    )
    parser.add_argument("sharded_dir", help="checkpoint directory written by lightning_shard.checkpoint.save")
    parser.add_argument("out_file", help="output file (torch.load(..., weights_only=True) format by default)")
    parser.add_argument("--safetensors", action="store_true", help="write the model weights only, as safetensors")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument(
        "--require-marker",
        action="store_true",
        help="refuse a DCP directory without lightning_shard's completion marker (one written by another tool)",
    )
    parser.add_argument("--no-require-marker", action="store_true", help=argparse.SUPPRESS)  # the default now
    args = parser.parse_args(argv)
    try:
        consolidate(
            args.sharded_dir,
            args.out_file,
            safetensors=args.safetensors,
            require_marker=args.require_marker,
            overwrite=args.overwrite,
        )
    except Exception as e:  # a one-line message naming the file, not a traceback
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
