"""Resuming mid-epoch with gradient accumulation through the real Trainer: ``accumulate_grad_batches=2``, a
checkpoint written by ``ModelCheckpoint(every_n_train_steps=3)`` in the middle of an epoch, the run killed by an
exception in the middle of the next accumulation, ``trainer.fit(..., ckpt_path="last")``: the resumed run equals
the uninterrupted one and single-process SGD over the same global batches.

Lightning restarts a plain ``DataLoader`` from the start of the epoch when resuming mid-epoch (it warns: "your
dataloader is not resumable"), replaying batches whatever the strategy; ``ResumableGPT``'s loader implements the
``state_dict`` / ``load_state_dict`` interface Lightning asks for, so the data continues where it stopped.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from tests.fsdp_models import loss_fn
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset
from tests.test_checkpoint_interop_fsdp import epochs
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path

TOL = 1e-5


class _SkippingSampler(Sampler):
    """Lightning's DistributedSampler (shuffled, seed 0) that leaves out the first ``skip`` samples once."""

    def __init__(self, inner: DistributedSampler) -> None:
        self.inner, self.skip = inner, 0

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return iter(list(self.inner)[skip:])

    def __len__(self) -> int:
        return len(self.inner)


class ResumableLoader(DataLoader):
    """A DataLoader with Lightning's resumable-loader interface. Its state is the number of batches the module
    consumed this epoch (``consumed``, set by the module): Lightning's fetcher reads one batch ahead, so what the
    loader yielded is one more than what was trained on."""

    consumed = 0

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.skip = state["consumed"] * self.batch_size


class ResumableGPT(LitGPT):
    """LitGPT whose training data resumes mid-epoch (``Trainer(use_distributed_sampler=False)``)."""

    fail_at: tuple[int, int] | None = None  # (global_step, batch_idx): raise there, on every rank

    def train_dataloader(self):
        data = dataset()
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        sampler = _SkippingSampler(DistributedSampler(data, shuffle=True, seed=0, **kwargs))
        self._loader = ResumableLoader(data, batch_size=self.per_rank_batch, sampler=sampler)
        return self._loader

    def training_step(self, batch, batch_idx):
        if self.fail_at == (self.trainer.global_step, batch_idx):
            raise RuntimeError("interrupted")
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch, batch_idx):
        # a checkpoint written at this batch's end (ModelCheckpoint's hook runs before the module's) counts it
        self._loader.consumed = batch_idx + 1

    def on_train_epoch_start(self):
        self._loader.consumed = 0


def reference(steps: int, accumulate: int = 2) -> dict[str, torch.Tensor]:
    """Single-process SGD over the global batches the 2 ranks see (epochs reshuffled), ``accumulate`` per step."""
    model = _seeded_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, batches = dataset(), iter(epochs(2))
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x, y = data[next(batches)]
            (loss_fn(model, x, y) / accumulate).backward()
        opt.step()
    return {f"model.{n}": p.detach() for n, p in model.named_parameters()}


def _params(module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().clone() for n, p in module.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _fit(module, steps: int, callbacks=(), ckpt_path=None):
    trainer = _trainer(
        max_steps=steps, accumulate_grad_batches=2, use_distributed_sampler=False,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


@distributed(world_size=2)
def test_resume_mid_epoch_with_gradient_accumulation_from_last(tmp_path):
    # 8 micro-batches per rank and epoch = 4 optimizer steps; 6 steps cross into the second epoch
    straight = ResumableGPT()
    _fit(straight, 6)
    expected = _params(straight)
    assert _max_diff(expected, reference(6)) < TOL

    root = _shared_path(tmp_path, "ckpts")

    def checkpoint_callback():
        return ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1, save_last=True)

    first = ResumableGPT()
    first.fail_at = (3, 7)  # step 4's second micro-batch: its first one already added its gradients
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, 6, callbacks=[checkpoint_callback()])
    assert sorted(os.listdir(root)) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    meta = torch.load(os.path.join(root, "last.ckpt", "meta.pt"), weights_only=True)
    assert meta["global_step"] == 3 and meta["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"consumed": 6}]
    dist.barrier()

    resumed = ResumableGPT(lr=0.5)  # the optimizer state (and lr) come from the checkpoint
    trainer = _fit(resumed, 6, callbacks=[checkpoint_callback()], ckpt_path="last")
    assert trainer.global_step == 6
    diff = _max_diff(_params(resumed), expected)
    assert diff == 0.0, diff
