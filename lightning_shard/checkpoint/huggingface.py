"""Save a Hugging Face model from a sharded run in the format ``from_pretrained`` reads, one tensor at a time.

``save_hf_pretrained(model, directory)`` is collective: every rank calls it; each parameter is all-gathered in
turn (FSDP and TP shards alike), rank 0 writes it into a safetensors file and frees it before the next one.
No rank ever holds more than one full tensor beyond its shards, and rank 0 never holds the full model: a
safetensors header lists every tensor's shape and offset, and those are known from the DTensors' global
shapes before anything is gathered, so the header is written first and the data streams after it.

What is written, as ``PreTrainedModel.save_pretrained`` writes it:

* ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files of at most ``max_shard_size`` bytes
  each plus ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``);
* every parameter and persistent buffer of ``model.state_dict()``, in its own dtype, except that a tied
  tensor is written once, under the name Hugging Face keeps (the one that is not a tie target of
  ``_tied_weights_keys``, e.g. ``shared.weight`` for T5, ``model.embed_tokens.weight`` for Qwen2), and
  ``_keys_to_ignore_on_save`` are left out;
* ``config.json`` (``model.config.save_pretrained``) and, for generative models, ``generation_config.json``.

Every file (weight files, index, config) is first written into a staging directory inside ``directory``
and moved into place only after all of them were written, so a failed save (disk full) leaves the previous
save as it was and a crash never leaves a truncated file under a name ``from_pretrained`` reads; weight
files of an earlier save that this one does not replace (other shard counts) are removed then. Other files
in ``directory`` (a tokenizer) are left alone.

The engine does not import ``transformers``; the model only needs ``state_dict()`` (and, optionally,
``config``, ``_tied_weights_keys``, ``can_generate``). A model whose saved layout differs from its in-memory
one (``transformers`` weight conversions, e.g. fused MoE experts) is refused with the way around.

Example::

    from lightning_shard.checkpoint import save_hf_pretrained

    save_hf_pretrained(model, "out/my-llama")          # every rank; rank 0 writes
    # later, anywhere:  AutoModelForCausalLM.from_pretrained("out/my-llama")

From a LightningModule (``self.model`` is the Hugging Face model)::

    def on_train_end(self):
        save_hf_pretrained(self.model, "out/my-llama")
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import comm
from lightning_shard.checkpoint._consolidate import _SAFETENSORS_DTYPES
from lightning_shard.tensor import DTensor

__all__ = ["save_hf_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_LEFTOVER = re.compile(r"model.*\.safetensors(\.index\.json)?\.tmp-\d+")
_STAGING = ".save_hf_pretrained.tmp-"  # + pid: the directory every file is written into before the move
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


@dataclass(frozen=True)
class _Entry:
    """One tensor to write: its saved name, the model's tensor, and where its bytes go."""

    name: str
    tensor: torch.Tensor
    nbytes: int


def save_hf_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    save_config: bool = True,
) -> None:
    """Write ``model`` (a Hugging Face ``PreTrainedModel``, sharded or not) to ``directory`` so that
    ``from_pretrained(directory)`` gives the same weights bit for bit. Collective: call it on every rank.

    ``max_shard_size``: bytes per safetensors file (an int, or a string such as ``"5GB"``, ``"500MiB"``, as
    in ``save_pretrained``). ``save_config=False`` writes the weights only. See the module docstring for the
    files and the memory bound (one full tensor at a time).

    Example::

        save_hf_pretrained(model, "out/model", max_shard_size="2GB")
    """
    limit = _parse_size(max_shard_size)
    _check_no_adapters(model)
    _check_no_weight_conversion(model)
    entries = _entries(model)
    files = _split(entries, limit)
    rank = dist.get_rank() if dist.is_initialized() else 0
    error: BaseException | None = None
    staging = os.path.join(directory, f"{_STAGING}{os.getpid()}")
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            os.mkdir(staging)
        except OSError as e:
            error = e
    # Every rank takes part in every gather even after rank 0 failed to write, so nobody is left waiting in a
    # collective; the failure is raised on every rank at the end.
    for index, chunk in enumerate(files):
        name = _file_name(index, len(files))
        error = _write_file(os.path.join(staging, name), chunk, write=rank == 0 and error is None) or error
    if rank == 0 and error is None:
        try:
            _stage_rest(model, staging, files, save_config)
            _publish(str(directory), staging, files)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
    if rank == 0 and error is not None:
        # The previous save in ``directory`` is untouched: only the staging directory is dropped.
        shutil.rmtree(staging, ignore_errors=True)
    _raise_everywhere(error, rank)


# ------------------------------------------------------------------------------------------------ what to write
def _entries(model: nn.Module) -> list[_Entry]:
    """The tensors of ``model.state_dict()`` Hugging Face saves, each tied tensor once, in state-dict order."""
    state = model.state_dict(keep_vars=True)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    names_of: dict[int, list[str]] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and key not in ignored:
            names_of.setdefault(id(value), []).append(key)
    tied_targets = _tied_weight_patterns(model)
    entries = []
    for names in names_of.values():
        name = _kept_name(names, tied_targets)
        tensor = state[name]
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(
                f"save_hf_pretrained: {name!r} has dtype {tensor.dtype}, which safetensors cannot store; cast the "
                "model (e.g. model.float()) or drop the tensor from the state dict first"
            )
        entries.append(_Entry(name, tensor, tensor.numel() * tensor.element_size()))
    return entries


def _tied_weight_patterns(model: nn.Module) -> list[str]:
    """Full names (regular expressions, as Hugging Face reads them) of the tie targets of every submodule."""
    patterns = []
    for prefix, sub in model.named_modules():
        tied = getattr(sub, "_tied_weights_keys", None) or {}
        patterns.extend(f"{prefix}.{key}" if prefix else key for key in tied)
    return patterns


def _kept_name(names: list[str], tied_targets: list[str]) -> str:
    """Hugging Face's rule (``remove_tied_weights_from_state_dict``): drop the names that are tie targets,
    keep the one name that is not (or the last in sorted order when all are)."""
    if len(names) == 1:
        return names[0]
    ordered = sorted(names)
    targets = [n for n in ordered if any(re.search(p, n) for p in tied_targets)]
    kept = [n for n in ordered if n not in targets] or ordered[-1:]
    if len(kept) > 1:
        raise ValueError(
            f"save_hf_pretrained: {kept} are one tied tensor, but the model declares none of them as a tie target "
            f"(_tied_weights_keys); from_pretrained could not tie them again. Declare the tie in the model class's "
            "_tied_weights_keys, or untie them before saving"
        )
    return kept[0]


def _check_no_adapters(model: nn.Module) -> None:
    """Refuse a model holding peft adapters (a ``PeftModel``, or LoRA layers injected into a model).

    Why: its state dict names the weights ``base_model.model.<name>`` and ``<module>.base_layer.weight`` plus
    ``lora_A.<adapter>.weight``, none of which ``from_pretrained`` looks for: it loaded a model with every weight
    newly initialised, printing a load report but raising nothing."""
    tuned = [name for name, m in model.named_modules() if callable(getattr(m, "get_base_layer", None))]
    if not tuned and not isinstance(getattr(model, "peft_config", None), dict):
        return
    where = f" ({tuned[0]!r} and {len(tuned) - 1} more)" if tuned else ""
    raise TypeError(
        f"save_hf_pretrained: {type(model).__name__} holds peft adapters{where}; from_pretrained would find none "
        "of its weights under their saved names and load a randomly initialised model. Save the adapters with "
        "peft instead: sd = get_model_state_dict(peft_model, full_state_dict=True, cpu_offload=True) on every rank, "
        "then on rank 0 peft_model.save_pretrained(directory, state_dict=sd) (read back with "
        "PeftModel.from_pretrained(base_model, directory)); or merge them into the base weights in one process "
        "(merge_and_unload()) and save that model"
    )


def _check_no_weight_conversion(model: nn.Module) -> None:
    """Refuse models that ``transformers`` saves in another layout than the one in memory."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # no transformers, or a version without weight conversions
        return
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        try:
            conversions = get_model_conversion_mapping(model, add_legacy=False)
        except Exception:  # noqa: BLE001 - not a transformers model: nothing to convert
            return
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    if conversions:
        raise NotImplementedError(
            f"save_hf_pretrained: {type(model).__name__} stores its weights in another layout than it holds them "
            f"in memory ({len(conversions)} transformers weight conversions), which needs the whole state dict at "
            "once. Gather it on rank 0 and let transformers save it: sd = get_model_state_dict(model, "
            "full_state_dict=True, cpu_offload=True); then on rank 0 model.save_pretrained(directory, state_dict=sd)"
        )


# ------------------------------------------------------------------------------------------------ files
def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]I?B)\s*", str(size).upper())
    if match is None:
        raise ValueError(
            f"save_hf_pretrained: max_shard_size={size!r}; use a positive number of bytes or a string such as "
            "'5GB' or '500MiB'"
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def _split(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Consecutive entries per file, at most ``limit`` bytes each (a larger tensor gets a file of its own)."""
    files: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


def _file_name(index: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _header(entries: list[_Entry]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        dtype = _SAFETENSORS_DTYPES[e.tensor.dtype]
        header[e.name] = {"dtype": dtype, "shape": list(e.tensor.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(blob)) + blob


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU (collective for a DTensor: every rank gathers it, in the same order)."""
    with torch.no_grad():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        return full.cpu().contiguous()


def _write_file(path: str, entries: list[_Entry], write: bool) -> BaseException | None:
    """Gather each tensor of one file in turn; rank 0 (``write``) streams it into ``path`` and frees it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    error: BaseException | None = None
    f = None
    if write:
        try:
            f = open(tmp, "wb")  # noqa: SIM115 - closed below, also when a write fails
            f.write(_header(entries))
        except OSError as e:
            error, f = e, None
    for e in entries:
        full = _full(e.tensor)  # on every rank, even when rank 0 can no longer write
        if f is not None and error is None and full.numel():
            try:
                f.write(memoryview(full.reshape(-1).view(torch.uint8).numpy()))
            except OSError as err:
                error = err
        del full
    if f is not None:
        try:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            if error is None:
                os.replace(tmp, path)
        except OSError as err:
            error = error or err
    if error is not None and os.path.exists(tmp):
        os.remove(tmp)
    return error


def _stage_rest(model: nn.Module, staging: str, files: list[list[_Entry]], save_config: bool) -> None:
    """Rank 0: the index (or none for one file) and the config files, written into ``staging``."""
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for chunk in files for e in chunk)},
            "weight_map": {e.name: _file_name(i, len(files)) for i, chunk in enumerate(files) for e in chunk},
        }
        _write_text(os.path.join(staging, INDEX_FILE), json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = getattr(model, "config", None)
    if save_config and config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(staging)
        generation = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", None)
        if generation is not None and callable(can_generate) and can_generate():
            generation.save_pretrained(staging)


def _publish(directory: str, staging: str, files: list[list[_Entry]]) -> None:
    """Rank 0, once every file is written: move them into ``directory`` (weight files first, the index last),
    remove the weight files of an earlier save this one does not replace, and the staging directory."""
    written = {_file_name(i, len(files)) for i in range(len(files))}
    if len(files) > 1:
        written.add(INDEX_FILE)
    staged = sorted(os.listdir(staging), key=lambda name: name == INDEX_FILE)
    for name in staged:
        os.replace(os.path.join(staging, name), os.path.join(directory, name))
    for stale in glob.glob(os.path.join(glob.escape(directory), "model*.safetensors*")):
        base = os.path.basename(stale)
        weights = base in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.fullmatch(base) or _LEFTOVER.fullmatch(base)
        if weights and base not in written:
            os.remove(stale)  # an earlier save's files (another shard count), or a crashed save's temporaries
    for leftover in glob.glob(os.path.join(glob.escape(directory), f"{_STAGING}*")):
        shutil.rmtree(leftover, ignore_errors=True)  # ours, now empty, or a crashed save's staging directory


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _raise_everywhere(error: BaseException | None, rank: int) -> None:
    """Rank 0's write error (if any) raised on every rank; a barrier so the files exist when all return."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    message = comm.broadcast_object(None if error is None else f"{type(error).__name__}: {error}", src=0)
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"save_hf_pretrained: rank 0 failed to write the files: {message}")
