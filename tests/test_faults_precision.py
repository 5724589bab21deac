"""Non-finite values through the real Trainer on 2 gloo ranks.

``"16-mixed"``: Lightning turns ``precision="16-mixed"`` into bf16 on a CPU accelerator, so the strategy's fp16
plugin is passed explicitly (``plugins=[ShardPrecision("16-mixed", "cpu")]``): fp16 autocast, fp16 all-gathers,
``ShardedGradScaler``. An overflow on one rank only must make every rank skip that optimizer step and halve the
scale together. ``"32-true"`` with a NaN loss on every rank: as with DDP, the step is taken and the parameters
become NaN on every rank; no rank hangs.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.distributed as dist

from lightning_shard.tensor import DTensor
from strategies.precision import ShardedGradScaler, ShardPrecision
from tests.harness import distributed
from tests.lightning_models import LitGPT
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path

INIT_SCALE = 2.0**8  # torch's default (2**16) overflows this model's first fp16 backward on its own


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


class OverflowOnRankOne(LitGPT):
    """At optimizer step 2 (``batch_idx == 1``) rank 1 adds ``1e35 * embed.weight[100].sum()`` to its loss: in fp16
    that term is inf, and its gradient (inf) lands only in row 100 of the embedding, which after the
    reduce-scatter lives in rank 1's shard (rows 51-100): rank 0's gradients stay finite."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1 and self.global_rank == 1:
            loss = loss + 1e35 * self.model.embed.weight[100].sum()
        return loss


class Snapshots(L.Callback):
    """This rank's parameter shards, momentum buffers and the loss scale after every optimizer step."""

    def __init__(self) -> None:
        self.params, self.momentum, self.scales, self.found_inf, self.local_finite = [], [], [], [], []

    def on_after_backward(self, trainer, pl_module):
        grads = [_local(p.grad) for p in pl_module.parameters() if p.grad is not None]
        self.local_finite.append(all(torch.isfinite(g).all() for g in grads))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        scaler = trainer.precision_plugin.scaler
        self.found_inf.append(any(v.item() for v in scaler._found_inf_per_device(optimizer).values()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        self.params.append([_local(p) for p in pl_module.parameters()])
        self.momentum.append([_local(opt.state[p]["momentum_buffer"]) for p in opt.state])
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@distributed(world_size=2)
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    snapshots = Snapshots()
    plugin = ShardPrecision("16-mixed", "cpu")
    plugin.scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    trainer = _trainer(max_steps=4, plugins=[plugin], callbacks=[snapshots])
    module = OverflowOnRankOne()
    trainer.fit(module)
    assert trainer.precision_plugin.precision == "16-mixed" and trainer.precision_plugin.scaler is not None
    rank = dist.get_rank()
    # only rank 1's gradient shards held the inf at step 2 ...
    assert snapshots.local_finite == [True, rank == 0, True, True], (rank, snapshots.local_finite)
    # ... and the flag every rank acted on: found on both, although only rank 1's gradients held an inf
    assert snapshots.found_inf == [False, True, False, False], (rank, snapshots.found_inf)
    assert snapshots.scales == [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE / 2], snapshots.scales
    assert _same(snapshots.params[1], snapshots.params[0])  # step 2 skipped: shards and momentum untouched
    assert _same(snapshots.momentum[1], snapshots.momentum[0])
    assert not _same(snapshots.params[2], snapshots.params[1])  # step 3 taken
    for step in snapshots.params:
        assert all(torch.isfinite(p).all() for p in step)
    # every rank took and skipped the same steps: each rank's shards agree with the full parameters seen by all
    full = [p.full_tensor() for p in module.parameters()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [f.sum().item() for f in full])
    assert gathered[0] == gathered[1]
    # the lowered scale is part of the checkpoint and comes back on resume
    path = _shared_path(tmp_path, "ckpt")
    trainer.save_checkpoint(path)
    plugin = ShardPrecision("16-mixed", "cpu")
    plugin.scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    resumed = _trainer(max_steps=4, plugins=[plugin])
    resumed.fit(LitGPT(), ckpt_path=path)  # step 4 reached: restores only
    assert resumed.precision_plugin.scaler.get_scale() == INIT_SCALE / 2


class NaNLoss(LitGPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 1 else loss


@distributed(world_size=2)
def test_a_nan_loss_on_every_rank_with_32_true_is_trained_on_as_in_ddp():
    module = NaNLoss()
    trainer = _trainer(max_steps=3)
    trainer.fit(module)  # no rank hangs; Lightning does not stop on a NaN loss (as for DDP)
    assert trainer.global_step == 3
    trainable = [p.full_tensor() for p in module.parameters() if p.requires_grad]
    frozen = [p.full_tensor() for p in module.parameters() if not p.requires_grad]
    assert all(torch.isnan(p).all() for p in trainable)  # SGD applied the NaN gradients, like torch
    assert all(torch.isfinite(p).all() for p in frozen)
    assert math.isnan(trainer.callback_metrics["train_loss"].item())
