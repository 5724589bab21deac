"""Interruptions, stops and exceptions in Trainer runs with ``strategy="shard_fsdp_tp"`` (2 gloo ranks), compared
with one process on the same global batches, or with what Lightning's DDP strategy does on the same ranks:

* SLURM auto-requeue (``SIGUSR1``): the signal reaches the ranks at different points of a step (one inside
  ``training_step``, one after it, in the middle of a gradient accumulation); Lightning's handler saved right there,
  its collectives paired with training's, and the save hung on every rank (no checkpoint, no requeue). The strategy
  defers the save to the start of the next optimizer step on every rank (``strategies/requeue.py``): the
  ``hpc_ckpt_1.ckpt`` directory is complete, ``scontrol requeue`` runs once, and the requeued job resumes from it
  equal to one process training straight through.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EarlyStopping, GradientAccumulationScheduler, OnExceptionCheckpoint

import strategies
from tests.harness import distributed
from tests.test_faults_midepoch import ResumableGPT, _max_diff, _params, reference
from tests.test_multinode_flows import _environment, _slurm
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path
from tests.test_trainer_features import _full, _single_trainer, _worst
from tests.test_trainer_flows import ONE_PROCESS, Flow

TOL = 1e-5


class Requeued(ResumableGPT):
    """Counts a batch as consumed once trained (at its end), so a checkpoint saved at the start of a batch resumes
    at that batch. ``signal_at[rank]``: (batch index, "step" or "end") where the rank gets ``SIGUSR1``, once;
    ``killed_at``: the global step at which every rank dies (SLURM ending the job after the signal)."""

    signal_at: list[tuple[int, str]] | None = None
    killed_at: int | None = None
    interrupted_at: int | None = None  # batch index of epoch 0: KeyboardInterrupt (Ctrl+C) after the forward
    interrupted_in_backward = False  # instead: in the backward, between the two blocks' (one reduce-scatter done)
    _signalled = False

    def _signal(self, where: str, batch_idx: int) -> None:
        if self.signal_at and not self._signalled and self.signal_at[self.global_rank] == (batch_idx, where):
            self._signalled = True
            os.kill(os.getpid(), signal.SIGUSR1)

    def training_step(self, batch, batch_idx):
        if self.killed_at == self.global_step:
            raise RuntimeError("killed by SLURM")
        interrupt = self.interrupted_at == batch_idx and self.current_epoch == 0
        in_backward = interrupt and self.interrupted_in_backward
        hook = self.model.blocks[1].register_forward_hook(_interrupt_backward) if in_backward else None
        loss = super().training_step(batch, batch_idx)
        self._signal("step", batch_idx)  # between the forward and the backward
        if hook is not None:
            hook.remove()
        elif interrupt:
            raise KeyboardInterrupt
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        pass

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._loader.consumed = batch_idx + 1
        self._signal("end", batch_idx)


def _interrupt_backward(module, args, output):
    def interrupt(grad):
        raise KeyboardInterrupt

    if module.training and torch.is_grad_enabled():
        output.register_hook(interrupt)


def _slurm_job(root: str):
    """srun's variables for this rank of one node, and a ``scontrol`` that records its arguments."""
    bindir = os.path.join(root, f"bin{dist.get_rank()}")
    os.makedirs(bindir, exist_ok=True)
    with open(os.path.join(bindir, "scontrol"), "w") as f:
        f.write(f'#!/bin/sh\necho "$@" >> {root}/scontrol.log\n')
    os.chmod(os.path.join(bindir, "scontrol"), 0o755)
    values = _slurm(node=0, local=dist.get_rank(), per_node=2, nodes_=1)
    return _environment({**values, "PATH": f"{bindir}:{os.environ['PATH']}"})


def _fit(module, root: str, callbacks=(), ckpt_path=None, tp: int = 1) -> object:
    trainer = _trainer(
        default_root_dir=root, max_steps=6, accumulate_grad_batches=2, use_distributed_sampler=False, devices=2,
        callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp),
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)  # under SLURM, no ckpt_path: the latest hpc_ckpt_<n>.ckpt
    return trainer


def _loop_state(path: str) -> tuple[int, list]:
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
    return meta["global_step"], meta["loops"]["fit_loop"]["state_dict"]["combined_loader"]


@distributed(world_size=2, timeout=90)
def test_sigusr1_at_different_points_of_a_step_saves_and_requeues(tmp_path):
    root = _shared_path(tmp_path, "job")
    with _slurm_job(root):
        first = Requeued()
        # step 3's first micro-batch (batch 4): rank 0 inside training_step, rank 1 after the batch, its gradients
        # accumulated; Lightning's handler saved at both points
        first.signal_at, first.killed_at = [(4, "step"), (4, "end")], 4
        with pytest.raises(RuntimeError, match="killed by SLURM"):
            _fit(first, root)
        assert sorted(n for n in os.listdir(root) if "hpc" in n) == ["hpc_ckpt_1.ckpt"]
        with open(os.path.join(root, "scontrol.log")) as f:
            assert f.read() == "requeue 4242\n"  # rank 0 only, once
        # deferred to the next optimizer step's first micro-batch (batch 6): no gradient was accumulated yet
        assert _loop_state(os.path.join(root, "hpc_ckpt_1.ckpt")) == (3, [{"consumed": 6}])
        dist.barrier()
        requeued = Requeued()
        trainer = _fit(requeued, root)
    assert trainer.global_step == 6
    assert _max_diff(_params(requeued), reference(6)) < TOL


@pytest.mark.parametrize(("arch", "tp", "in_backward"), [("gpt", 1, False), ("gpt", 1, True), ("llama", 2, False)])
@distributed(world_size=2, timeout=90)
def test_keyboard_interrupt_on_every_rank_saves_a_resumable_on_exception_checkpoint(tmp_path, arch, tp, in_backward):
    """Ctrl+C inside ``training_step`` (the root unit unsharded) or in the middle of its backward: Lightning exits
    with ``SystemExit(1)`` after ``OnExceptionCheckpoint`` saved; its save raised a ``ValueError`` instead (the
    gathered parameters are not the optimizer's) and wrote nothing. After the backward's interrupt the same module
    object resumes: the unreduced gradients of the interrupted backward (the no-sync accumulation, the unsharded
    parameters' ``.grad``) survived Lightning's ``zero_grad`` and went into the next step, 0.17 off, no error.
    FSDP 2: compared with one process; TP 2: with the uninterrupted run."""
    root = _shared_path(tmp_path, "run")
    first = Requeued(arch=arch)
    first.interrupted_at, first.interrupted_in_backward = 4, in_backward  # the first micro-batch of step 3
    with pytest.raises(SystemExit):
        _fit(first, root, callbacks=[OnExceptionCheckpoint(root)], tp=tp)
    path = os.path.join(root, "on_exception.ckpt")
    assert _loop_state(path) == (2, [{"consumed": 4}])
    # after the backward's interrupt, the same module resumes (a notebook): its units were left mid-backward
    resumed = first if in_backward else Requeued(arch=arch)
    resumed.interrupted_at = None
    assert _fit(resumed, root, ckpt_path=path, tp=tp).global_step == 6
    if tp == 1:
        assert _max_diff(_params(resumed), reference(6)) < TOL
    else:
        straight = Requeued(arch=arch)
        _fit(straight, os.path.join(root, "straight"), tp=tp)
        assert _max_diff(_params(resumed), _params(straight)) < 5e-5


# ------------------------------------------------------------------ repeated and resumed fits, as one process does them
def _both(run) -> None:
    """``run(module, make_trainer, root)`` here (2 ranks) and in one process on the same global batches: the same
    optimizer steps and parameters."""
    ours, ref = Flow(), Flow(mirrors=dist.get_world_size())
    run(ours, lambda **kw: _trainer(max_steps=-1, **kw))
    run(ref, lambda **kw: _single_trainer(max_steps=-1, **ONE_PROCESS, **kw))
    assert ours.steps_seen == ref.steps_seen and ours.steps_seen
    assert _worst(_full(ours), _full(ref)) < TOL


def _fit_twice(module, make) -> None:
    trainer = make(max_epochs=1)
    trainer.fit(module)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module)  # continues with epoch 1 (a new optimizer: Lightning builds it again at every fit)


def _fit_after_test(module, make) -> None:
    trainer = make(max_epochs=1, limit_test_batches=2)
    trainer.test(module, verbose=False)
    trainer.fit(module)


@pytest.mark.parametrize("run", [_fit_twice, _fit_after_test])
@distributed(world_size=2)
def test_a_second_call_on_the_same_trainer_trains_like_one_process(run):
    _both(run)


@distributed(world_size=2)
def test_resume_from_last_without_a_checkpoint_then_with_another_accumulation_in_a_new_trainer(tmp_path):
    """The module of a finished ``fit`` resumed by a new Trainer (a notebook): its parameters keep the last step's
    gradients, and the engine built the optimizer-state template without state ("unexpected keys ...
    momentum_buffer", nothing loaded). Compared with one process switching the accumulation at the same epoch."""
    root = _shared_path(tmp_path, "run")
    ours = Flow()
    first = _trainer(
        max_steps=-1, max_epochs=1, accumulate_grad_batches=2, default_root_dir=root, enable_checkpointing=True
    )
    first.fit(ours, ckpt_path="last")  # nothing saved yet: Lightning warns and trains from the start, as for DDP
    ckpt = os.path.join(root, "checkpoints", "epoch=0-step=4.ckpt")
    _trainer(max_steps=-1, max_epochs=2, default_root_dir=root).fit(ours, ckpt_path=ckpt)  # accumulation 1
    ref = Flow(mirrors=dist.get_world_size())
    schedule = GradientAccumulationScheduler({0: 2, 1: 1})
    _single_trainer(max_steps=-1, max_epochs=2, callbacks=[schedule], **ONE_PROCESS).fit(ref)
    assert ours.steps_seen == ref.steps_seen == [(0, 2), (0, 4), (0, 6), (0, 8), *[(1, b) for b in range(1, 9)]]
    assert _worst(_full(ours), _full(ref)) < TOL


# ------------------------------------------------------------------ stopping decisions the ranks disagree on
class RankMetric(Flow):
    """Logs a validation metric without ``sync_dist``: rank 0's improves every epoch, rank 1's worsens."""

    def validation_step(self, batch, batch_idx):
        sign = 1.0 if self.global_rank == 1 else -1.0
        self.log("rank_metric", torch.tensor(sign * self.current_epoch))


@distributed(world_size=2)
def test_early_stopping_on_a_metric_the_ranks_disagree_on_stops_every_rank_together():
    # EarlyStopping reduces its decision with strategy.reduce_boolean_decision(all=False): rank 1 decides for all
    stop = EarlyStopping(monitor="rank_metric", patience=0)
    trainer = _trainer(max_steps=-1, max_epochs=5, limit_train_batches=2, limit_val_batches=1, callbacks=[stop])
    module = RankMetric()
    trainer.fit(module)
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (trainer.current_epoch, trainer.global_step, module.steps_seen))
    assert seen[0] == seen[1] == (2, 4, [(0, 1), (0, 2), (1, 1), (1, 2)])


class FailsInValidation(Requeued):
    def validation_step(self, batch, batch_idx):
        self.model(batch[0])  # the units gathered, as in any evaluation forward
        raise RuntimeError("validation failed")


@distributed(world_size=2)
def test_an_exception_in_validation_on_every_rank_saves_a_resumable_on_exception_checkpoint(tmp_path):
    root = _shared_path(tmp_path, "run")
    run = dict(max_steps=4, val_check_interval=2, use_distributed_sampler=False, default_root_dir=root)
    with pytest.raises(RuntimeError, match="validation failed"):
        trainer = _trainer(
            limit_val_batches=1, callbacks=[OnExceptionCheckpoint(root)], enable_checkpointing=True, **run
        )
        trainer.fit(FailsInValidation())
    path = os.path.join(root, "on_exception.ckpt")
    assert _loop_state(path) == (2, [{"consumed": 2}])
    resumed = Requeued()
    _trainer(**run).fit(resumed, ckpt_path=path)
    assert _max_diff(_params(resumed), reference(4, accumulate=1)) < TOL
