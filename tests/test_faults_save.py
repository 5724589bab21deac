"""A sharded save failing on one rank only, through the real Trainer and ``ModelCheckpoint``: every rank raises,
the last good checkpoint stays where it was (``save_top_k=1`` removes the older one only after the new one is
published) and resumes; ``ckpt_path="last"`` ignores what a crashed save left beside ``last.ckpt``."""

from __future__ import annotations

import errno
import glob
import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard.checkpoint import CheckpointWriteError
from tests.harness import distributed
from tests.lightning_models import LitGPT, reference_params
from tests.test_faults_midepoch import ResumableGPT
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path

TOL = 1e-5


def _max_diff(module, ref: dict) -> float:
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    assert ours.keys() == ref.keys()
    return max((ours[k] - ref[k]).abs().max().item() for k in ours)


def _fail_rank_one_from(monkeypatch, first_failing_save: int) -> None:
    """Rank 1's DCP writer raises ENOSPC from its ``first_failing_save``-th save on (a full disk on one node)."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data
    calls = [0]

    def write_data(self, plan, planner):
        calls[0] += 1
        if dist.get_rank() == 1 and calls[0] >= first_failing_save:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.path, "__1_0.distcp"))
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


@distributed(world_size=2)
def test_a_save_failing_on_one_rank_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    root = _shared_path(tmp_path, "ckpts")
    callback = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=1, save_last=True)
    _fail_rank_one_from(monkeypatch, first_failing_save=5)  # steps 1 and 2 save twice each (top-k, last)
    trainer = _trainer(max_steps=4, enable_checkpointing=True, callbacks=[callback])
    with pytest.raises(CheckpointWriteError, match="ENOSPC") as error:  # on both ranks, none left waiting
        trainer.fit(LitGPT())
    assert error.value.errno == errno.ENOSPC and "__1_0.distcp" in str(error.value)
    monkeypatch.undo()
    dist.barrier()
    # the step-2 checkpoint and last.ckpt (step 2) are intact; no temp dir of the failed save is left
    names = sorted(os.listdir(root))
    assert names == ["epoch=0-step=2.ckpt", "last.ckpt"], names
    for name in names:
        resumed = LitGPT(lr=0.5)
        trainer = _trainer(max_steps=2)  # reached already: restores only
        trainer.fit(resumed, ckpt_path=os.path.join(root, name))
        assert trainer.global_step == 2
        assert _max_diff(resumed, reference_params(2)) < TOL


@pytest.mark.slow
@distributed(world_size=2)
def test_resume_from_last_ignores_a_crashed_save_beside_it(tmp_path):
    root = _shared_path(tmp_path, "ckpts")
    callback = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_last=True)
    _trainer(max_steps=2, enable_checkpointing=True, callbacks=[callback], use_distributed_sampler=False).fit(
        ResumableGPT()
    )
    last = os.path.join(root, "last.ckpt")
    if dist.get_rank() == 0:  # a save of last.ckpt killed mid-write: a newer directory without the marker
        stale = f"{last}.tmp-0123456789abcd"
        os.makedirs(stale)
        with open(os.path.join(stale, "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * 64)
    dist.barrier()
    resumed = ResumableGPT(lr=0.5)  # mid-epoch: its data continues where the checkpoint stopped
    callback = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_last=True)
    trainer = _trainer(max_steps=4, enable_checkpointing=True, callbacks=[callback], use_distributed_sampler=False)
    trainer.fit(resumed, ckpt_path="last")
    assert trainer.ckpt_path == last, trainer.ckpt_path
    assert trainer.global_step == 4
    assert _max_diff(resumed, reference_params(4)) < TOL
    assert glob.glob(last + ".tmp-*") == []  # the next save of last.ckpt removed it
    assert torch.load(os.path.join(last, "meta.pt"), weights_only=True)["global_step"] == 4
