"""``LightningModule.load_from_checkpoint`` on a sharded checkpoint directory.

Lightning loads checkpoints with ``lightning.fabric.utilities.cloud_io._load``, which only reads files.
Importing ``strategies`` wraps the name Lightning's ``load_from_checkpoint`` uses so that a directory
written by this strategy (or by Lightning's ModelParallelStrategy or ``FSDPStrategy(state_dict_type="sharded")``)
is first consolidated (one tensor at a time, into a temporary file read with
``weights_only=True``) together with its ``meta.pt``; files and URLs go to Lightning's loader unchanged.

Example::

    import strategies
    model = MyModule.load_from_checkpoint("checkpoints/epoch=0-step=10.ckpt")   # a sharded directory
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core import saving

from lightning_shard.checkpoint import consolidate
from lightning_shard.checkpoint.save_load import MARKER


def is_sharded_checkpoint(path: Any) -> bool:
    """True for a DCP checkpoint directory: written by ``lightning_shard.checkpoint.save`` (it holds the
    completion marker) or by another tool such as Lightning's ModelParallelStrategy (DCP's ``.metadata``)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    return (Path(path) / MARKER).is_file() or (Path(path) / ".metadata").is_file()


def model_entry(entries: set[str], path: str | os.PathLike) -> str:
    """The top-level entry holding the LightningModule's weights in a checkpoint (directory or file) with these
    top-level ``entries``.

    ``"state_dict"`` in ours and in Lightning's ``ModelParallelStrategy`` directories; ``"model"`` in Lightning's
    ``FSDPStrategy(state_dict_type="sharded")`` directories (torch's FSDP1: the weights under "model", the
    optimizers' sharded state under "optimizer_{i}", keyed by parameter name as ours are).

    Example: ``model_entry({"model", "optimizer_0"}, "ckpt") == "model"``.
    """
    if "state_dict" in entries:
        return "state_dict"
    if "model" in entries:
        return "model"
    raise ValueError(
        f"shard_fsdp_tp: {path} holds no model weights for a LightningModule: its entries are {sorted(entries)}, "
        "expected 'state_dict' (this strategy, ModelParallelStrategy) or 'model' (FSDPStrategy with "
        "state_dict_type='sharded'); read it with lightning_shard.checkpoint.load (a directory) or torch.load (a "
        "file) into your own structure"
    )


def saved_keys(path: str | os.PathLike) -> set[str]:
    """Every key a sharded checkpoint directory stores, flattened as DCP names them
    (``"state_dict.blocks.0.up.weight"``, ``"optimizer_0.param_groups.0.lr"``, ...)."""
    from lightning_shard.checkpoint._safe_io import SafeFileSystemReader

    return set(SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata)


def optimizer_template_as_saved(optim_state: dict[str, Any], entry: str, keys: set[str]) -> None:
    """Make an optimizer-state template (``get_optimizer_state_dict``) ask for what the checkpoint's ``entry``
    holds, where torch's ``Optimizer.load_state_dict`` would not call a difference a mismatch.

    * Parameters without any state in the checkpoint are left out: a parameter no backward reached has no
      optimizer state (as on one device), while a fresh optimizer's template has state for every parameter.
      ``set_optimizer_state_dict`` then leaves such a parameter without state, as torch's load does.
    * Group settings (lr, betas, initial_lr, ...): the checkpoint's are the ones the optimizer gets. A setting only
      the optimizer has keeps its value: the ``initial_lr`` an LR scheduler added after the save (Lightning's
      ``lr_find`` restores its checkpoint into the optimizer it gave a scheduler). One only the checkpoint has is
      loaded (a run saved with a scheduler, resumed without).

    The state of a parameter the checkpoint has, and the parameters each group lists, stay strict.

    Example: ``optimizer_template_as_saved(state["optimizer_0"], "optimizer_0", saved_keys(path))``.
    """
    prefix = f"{entry}.state."
    with_state = set()  # every dotted prefix of a saved state key: the parameter FQNs are among them
    for key in keys:
        if key.startswith(prefix):
            parts = key[len(prefix) :].split(".")
            with_state.update(".".join(parts[:n]) for n in range(1, len(parts)))
    for fqn in [f for f in optim_state["state"] if f not in with_state]:
        del optim_state["state"][fqn]
    for i, group in enumerate(optim_state["param_groups"]):
        prefix = f"{entry}.param_groups.{i}."
        saved = {k[len(prefix) :] for k in keys if k.startswith(prefix)}
        if not saved:
            continue  # a group the checkpoint does not have: check_param_groups names the difference
        for name in [n for n in group if n != "params" and n not in saved]:
            del group[name]
        for name in saved - set(group):
            group[name] = None  # read from the checkpoint


def load_full_file(path: str | os.PathLike, *, weights_only: bool = True) -> Any:
    """``torch.load`` of a full checkpoint file onto the host, memory-mapped where the format allows.

    Every rank loads the whole file, but each copies only its shards out of it: with ``mmap=True`` the file's
    pages are read on demand (only the parts a rank copies) and shared through the page cache by the ranks
    of a node, instead of a private copy of the whole checkpoint in every process. Files in torch's legacy
    (non-zip) format cannot be mapped and are read whole.

    Example: ``state = load_full_file("last.ckpt")["state_dict"]``.
    """
    mmap = zipfile.is_zipfile(path)
    return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)


def load_sharded_as_full(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint in directory ``path`` as one in-memory dict of full tensors, like a full checkpoint.

    Consolidation verifies every checksum and merges Lightning's ``meta.pt`` (loops, callbacks such as a
    ``ModelCheckpoint``'s state with its tensors), so the result is what a full checkpoint would hold.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "consolidated.pt")
        consolidate(path, out)
        return torch.load(out, map_location="cpu", weights_only=True)


def _wrap(original):
    if getattr(original, "_shard_fsdp_tp", False):
        return original

    def pl_load(path_or_url, map_location=None, weights_only=None):
        if is_sharded_checkpoint(path_or_url):
            checkpoint = load_sharded_as_full(path_or_url)
            # FSDPStrategy(state_dict_type="sharded") keeps the weights under "model"; Lightning reads "state_dict"
            key = model_entry(set(checkpoint), path_or_url)
            checkpoint["state_dict"] = checkpoint.pop(key)
            return checkpoint
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._shard_fsdp_tp = True
    return pl_load


def install() -> None:
    """Make ``load_from_checkpoint`` accept our sharded directories (idempotent)."""
    saving.pl_load = _wrap(saving.pl_load)
