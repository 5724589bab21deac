"""Checkpoint paths that not every rank sees (a node-local disk, a typo in a per-node mount): bad input must raise
a clear error on every rank, not leave the ranks that do see the path waiting in a collective, and a save must not
publish a checkpoint that lacks another rank's shard. Simulated on 2 gloo ranks of one machine by hiding the
directory from one rank."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch
import torch.distributed as dist

from lightning_shard.checkpoint import CheckpointError, load, save
from tests.harness import distributed
from tests.lightning_models import LitGPT
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path

TIMEOUT = 120  # a rank left waiting in a collective shows as the harness's TimeoutError, not a hang


def _hide_on_rank_one(monkeypatch, path: str) -> None:
    """``path`` (and everything under it) does not exist for rank 1, as on another node's local disk."""
    if dist.get_rank() != 1:
        return
    real_isdir, real_exists, real_is_dir, real_is_file = (
        os.path.isdir, os.path.exists, pathlib.Path.is_dir, pathlib.Path.is_file,
    )  # fmt: skip

    def hidden(p) -> bool:
        return os.path.abspath(os.fspath(p)).startswith(path)

    monkeypatch.setattr(os.path, "isdir", lambda p: False if hidden(p) else real_isdir(p))
    monkeypatch.setattr(os.path, "exists", lambda p: False if hidden(p) else real_exists(p))
    monkeypatch.setattr(pathlib.Path, "is_dir", lambda p, **k: False if hidden(p) else real_is_dir(p, **k))
    monkeypatch.setattr(pathlib.Path, "is_file", lambda p, **k: False if hidden(p) else real_is_file(p, **k))


@distributed(world_size=2, timeout=TIMEOUT)
def test_resume_from_a_path_one_rank_cannot_see_raises_on_every_rank(tmp_path, monkeypatch):
    path = _shared_path(tmp_path, "ckpt")
    trainer = _trainer(max_steps=1)
    trainer.fit(LitGPT())
    trainer.save_checkpoint(path)
    _hide_on_rank_one(monkeypatch, path)
    with pytest.raises(FileNotFoundError, match=r"a directory on rank\(s\) \[0\]; missing on rank\(s\) \[1\]"):
        _trainer(max_steps=2).fit(LitGPT(), ckpt_path=path)


@distributed(world_size=2, timeout=TIMEOUT)
def test_engine_load_of_a_directory_one_rank_cannot_see_raises_on_every_rank(tmp_path, monkeypatch):
    path = _shared_path(tmp_path, "ckpt")
    save({"model": {"w": torch.arange(4.0)}}, path)
    _hide_on_rank_one(monkeypatch, path)
    state = {"model": {"w": torch.zeros(4)}}
    if dist.get_rank() == 1:  # its own error ...
        with pytest.raises(FileNotFoundError, match="does not exist"):
            load(state, path)
    else:  # ... and on the rank that sees the directory, one naming rank 1 (instead of waiting for it in DCP)
        with pytest.raises(CheckpointError, match=r"failed on rank\(s\) \[1\].*shared path"):
            load(state, path)
    assert torch.equal(state["model"]["w"], torch.zeros(4))  # nothing loaded on either rank


@distributed(world_size=2, timeout=TIMEOUT)
def test_a_save_whose_shards_land_on_different_disks_is_not_published(tmp_path, monkeypatch):
    """Rank 1 writes into a directory rank 0 never sees (its own disk): rank 0 must not publish a checkpoint
    missing rank 1's file; every rank raises and the previous checkpoint stays."""
    from torch.distributed.checkpoint import FileSystemWriter

    path = _shared_path(tmp_path, "ckpt")
    save({"w": torch.arange(8.0)}, path)
    elsewhere = _shared_path(tmp_path, "rank1-local-disk")
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):  # rank 1's "local disk": its files go to another directory
        if dist.get_rank() == 1:
            local = os.path.join(elsewhere, os.path.basename(self.path))
            os.makedirs(local, exist_ok=True)
            self.path = type(self.path)(local) if not isinstance(self.path, str) else local
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    from lightning_shard import init_device_mesh
    from lightning_shard.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    big = distribute_tensor(torch.arange(16.0), mesh, [Shard(0)])
    with pytest.raises(CheckpointError, match="every rank"):
        save({"w": big}, path)
    monkeypatch.undo()
    dist.barrier()
    state = {"w": torch.zeros(8)}
    load(state, path)  # the previous checkpoint, intact
    assert torch.equal(state["w"], torch.arange(8.0))
    if dist.get_rank() == 0:
        shutil.rmtree(elsewhere, ignore_errors=True)
