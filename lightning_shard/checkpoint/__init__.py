"""Checkpoints: FQN-keyed model/optimizer state dicts, DCP save/load with atomic publish, consolidation.

Example::

    from lightning_shard.checkpoint import get_model_state_dict, get_optimizer_state_dict, save, load
    save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}, "ckpt")
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    load(state, "ckpt")                                   # reshards onto the current mesh, in place
    set_optimizer_state_dict(model, opt, state["optimizer"])
"""

from lightning_shard.checkpoint._consolidate import consolidate
from lightning_shard.checkpoint._integrity import CheckpointCorruptError, CheckpointError, CheckpointWriteError
from lightning_shard.checkpoint._safe_io import CheckpointSecurityError
from lightning_shard.checkpoint.huggingface import save_hf_pretrained
from lightning_shard.checkpoint.save_load import load, save
from lightning_shard.checkpoint.state_dict import (
    check_optimizer_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "save",
    "load",
    "consolidate",
    "save_hf_pretrained",
    "check_optimizer_state_dict",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointWriteError",
    "CheckpointSecurityError",
]
