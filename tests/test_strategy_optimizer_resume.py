"""Optimizer state that differs between a sharded checkpoint and the optimizer it loads into, where torch's
``Optimizer.load_state_dict`` sees no mismatch (2 gloo ranks, through the Trainer):

* group settings (lr, initial_lr, ...): Lightning's ``Tuner.lr_find`` saves a checkpoint, trains with an LR
  scheduler (which adds ``initial_lr`` to the param groups) and restores the checkpoint into that optimizer; a
  run saved with a scheduler may resume without;
* a parameter no backward reached has no state in the checkpoint, while a fresh optimizer has state for all.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.tuner import Tuner
from torch import nn

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


class LitUnused(LitGPT):
    """A Linear that forward never calls, and AdamW (its state is made for every parameter of a fresh optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.unused = nn.Linear(4, 4)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


@distributed(world_size=2)
def test_resume_with_a_parameter_no_backward_reached_equals_uninterrupted_training(tmp_path):
    uninterrupted = LitUnused()
    _trainer(max_steps=-1, max_epochs=2).fit(uninterrupted)

    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)  # at the epoch's end: the data resumes exactly
    _trainer(max_steps=-1, max_epochs=1, enable_checkpointing=True, callbacks=[ckpt]).fit(LitUnused())
    resumed = LitUnused()  # strict loading, into a fresh AdamW
    trainer = _trainer(max_steps=-1, max_epochs=2)
    trainer.fit(resumed, ckpt_path=str(tmp_path / "last.ckpt"))

    assert _max_diff(resumed, {n: p.full_tensor() for n, p in uninterrupted.model.named_parameters()}) < 1e-6
    start = LitUnused().unused.weight
    assert torch.equal(resumed.unused.weight.full_tensor(), start)  # never decayed: it never had a gradient
    assert resumed.unused.weight not in trainer.optimizers[0].state  # and has no state, as on one device
