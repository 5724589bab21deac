"""Optimizer group settings (lr, initial_lr, ...) that differ between a sharded checkpoint and the optimizer it
loads into: no mismatch, as with torch's ``Optimizer.load_state_dict`` (2 gloo ranks, through the Trainer).

Lightning's ``Tuner.lr_find`` saves a checkpoint, trains with an LR scheduler (which adds ``initial_lr`` to the
param groups) and restores the checkpoint into that optimizer; a run saved with a scheduler may resume without.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.tuner import Tuner

from tests.harness import distributed
from tests.lightning_models import LitGPT, reference_params
from tests.test_strategy import _max_diff, _trainer


@distributed(world_size=2)
def test_lr_find_restores_the_model_and_training_then_equals_one_process(tmp_path):
    module = LitGPT()
    trainer = _trainer(max_steps=4, default_root_dir=str(tmp_path))
    Tuner(trainer).lr_find(module, min_lr=1e-3, max_lr=1.0, num_training=6, update_attr=False)
    assert not list(tmp_path.glob(".lr_find*"))  # its temporary checkpoint was removed
    trainer.fit(module)  # from the restored initial weights, with the module's own lr
    assert _max_diff(module, reference_params(4)) < 1e-5


class LitScheduled(LitGPT):
    def configure_optimizers(self):
        opt = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@distributed(world_size=2)
def test_checkpoint_saved_with_a_scheduler_resumes_without_one_with_the_saved_lr(tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    _trainer(max_steps=2, enable_checkpointing=True, callbacks=[ckpt]).fit(LitScheduled())
    module = LitGPT()
    trainer = _trainer(max_steps=3)
    trainer.fit(module, ckpt_path=str(tmp_path / "last.ckpt"))
    group = trainer.optimizers[0].param_groups[0]
    assert group["lr"] == 0.1 * 0.5 * 0.5  # the saved lr: the scheduler halved it after each of the 2 steps
    assert group["initial_lr"] == 0.1  # a setting only the checkpoint had is loaded too
