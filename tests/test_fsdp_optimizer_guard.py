"""An optimizer built between a forward with grad and its backward holds the root unit's *unsharded*
parameters (the root keeps them unsharded for the backward, as torch's FSDP2 does). Stepping it would update
temporaries while the sharded parameters stay put: no training, no error. The guard refuses such an optimizer
at ``optimizer.step()`` (any script) and at the strategies' optimizer setup, naming the parameter and the fix.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

import strategies
from lightning_shard.fsdp import check_optimizer_params, fully_shard
from lightning_shard.tensor import DTensor
from tests.fsdp_models import batches, loss_fn, make_model, rank_slice
from tests.harness import distributed


def _sharded_model():
    model = make_model(0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _local_batch():
    x, y = batches(1, 4)[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank_slice(x, rank, world), rank_slice(y, rank, world)


@distributed(world_size=2)
def test_optimizer_built_after_forward_is_refused_at_step():
    model = _sharded_model()
    x, y = _local_batch()
    loss = loss_fn(model, x, y)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # the root's parameters are unsharded right now
    loss.backward()
    before = model.norm.weight.full_tensor().clone()
    with pytest.raises(ValueError, match=r"holds the unsharded parameter 'embed.weight'.*before the first forward"):
        stale.step()
    assert torch.equal(model.norm.weight.full_tensor(), before)  # refused before anything was updated


@distributed(world_size=2)
def test_optimizer_built_in_time_trains_every_parameter():
    model = _sharded_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    check_optimizer_params(opt)
    x, y = _local_batch()
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    loss_fn(model, x, y).backward()
    opt.step()
    # after backward the parameters are the sharded ones again, and a new optimizer is fine too
    check_optimizer_params(torch.optim.SGD(model.parameters(), lr=0.1))
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor), n
        if p.requires_grad:
            assert not torch.equal(p.full_tensor(), before[n]), n  # the root's own parameters moved


@distributed(world_size=2)
def test_fabric_optimizer_built_after_forward_is_refused_under_tp():
    # With TP the unsharded parameters are TP DTensors, so a check for "plain tensor" alone lets them through.
    fabric = L.Fabric(
        accelerator="cpu", devices=2, strategy=strategies.ShardFSDPTPFabricStrategy(tensor_parallel_size=2)
    )
    fabric.launch()
    model = fabric.setup_module(make_model(0))
    x, y = batches(1, 2)[0]
    loss = loss_fn(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"holds the unsharded parameter '[\w.]+'"):
        fabric.setup_optimizers(opt)
    fabric.backward(loss)


@distributed(world_size=2)
def test_fabric_optimizer_built_after_forward_is_refused_with_the_fix():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="shard_fsdp_tp")
    fabric.launch()
    model = fabric.setup_module(make_model(0))
    x, y = _local_batch()
    loss = loss_fn(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"holds the unsharded parameter '[\w.]+'.*Build the optimizer before"):
        fabric.setup_optimizers(opt)
    fabric.backward(loss)


@distributed(world_size=2)
def test_trainer_optimizer_built_after_a_forward_in_configure_optimizers_is_refused():
    # The one way the Trainer reaches the hazard: a forward with grad inside configure_optimizers (after
    # sharding, before the optimizer is built from self.parameters()).
    from tests.lightning_models import LitGPT

    class ForwardFirst(LitGPT):
        def configure_optimizers(self):
            x, _ = batches(1, 2)[0]
            self(x).sum()  # e.g. probing output shapes, with grad enabled
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="shard_fsdp_tp", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"SGD param group 0 holds the unsharded parameter '[\w.]+'"):
        trainer.fit(ForwardFirst())


@distributed(world_size=2)
def test_optimizer_built_before_fully_shard_is_refused_at_step():
    # fully_shard registers new (sharded) parameters; an optimizer over the replaced ones steps parameters that
    # never get a gradient again: no training, no error
    model = make_model(0)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x, y = _local_batch()
    loss_fn(model, x, y).backward()
    with pytest.raises(ValueError, match="embed.weight.*fully_shard.TinyGPT. replaced.*built before fully_shard"):
        early.step()
