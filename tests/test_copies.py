"""Copies of a sharded model: ``copy.deepcopy`` of a ``fully_shard`` module is refused with an error naming it
(as torch's FSDP2 refuses it; it crashed the process before), a mesh is shared by copies, and the
``StochasticWeightAveraging`` callback (an unsharded deep copy of the whole model) is refused by the strategy
on every rank, as Lightning's FSDPStrategy refuses it (2 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
from lightning.pytorch.callbacks import StochasticWeightAveraging

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from tests.fsdp_models import batches, loss_fn, make_model
from tests.harness import distributed
from tests.lightning_models import LitGPT
from tests.test_strategy import _trainer


@distributed(world_size=2)
def test_deepcopy_of_a_sharded_model_is_refused_and_a_mesh_is_shared():
    mesh = init_device_mesh("cpu", (2,))
    assert copy.deepcopy(mesh) is mesh
    model = make_model()
    model.mesh = mesh  # an unsharded module holding a mesh copies (what a copy before sharding needs)
    assert copy.deepcopy(model).mesh is mesh
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = batches(1, 4)[0]
    loss_fn(model, x, y).backward()  # the unsharded storage has been allocated and freed again
    with pytest.raises(TypeError, match="FSDPTinyGPT is sharded by fully_shard and cannot be deep-copied"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="FSDPBlock"):
        copy.deepcopy(model.blocks)


@distributed(world_size=2)
def test_stochastic_weight_averaging_is_refused_on_every_rank():
    trainer = _trainer(callbacks=[StochasticWeightAveraging(swa_lrs=0.05)])
    with pytest.raises(ValueError, match="StochasticWeightAveraging callback does not support sharded models"):
        trainer.fit(LitGPT())
