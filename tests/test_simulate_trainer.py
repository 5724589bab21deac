"""A real ``lightning.Trainer`` fit with ``shard_fsdp_tp`` as one rank of a simulated accelerator cluster:
Lightning's loop, the strategy's hooks, the precision plugin (bf16-mixed), gradient clipping by norm and the
batch transfer, on fake tensors of the stand-in accelerator (docs/gpu.md). A host tensor meeting a device one
raises there, and every collective's tensors are checked against the device the group serves."""

import pytest
import torch

from lightning_shard import comm
from lightning_shard.simulate import simulated_world
from tests.fsdp_models import SEQ, VOCAB
from tests.lightning_models import LitGPT, loss_fn
from tests.sim_helpers import Batches, lightning_value_reads_answered_locally, sim_trainer


class _SimLitGPT(LitGPT):
    """``LitGPT`` without value reads: no logging (a logged fake loss has no value), batches as a sized list."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_fn(self.model, x, y)

    def train_dataloader(self):
        return Batches([(torch.randint(0, VOCAB, (4, SEQ)), torch.randint(0, VOCAB, (4, SEQ))) for _ in range(3)])


@pytest.mark.parametrize(
    "strategy_kwargs, meta_init, per_node, mesh_shape",
    [
        ({}, False, 8, (8, 1)),
        ({"tensor_parallel_size": 2}, False, 8, (4, 2)),
        # HSDP on the simulated cluster runs by default in test_gpu_review.py (setup and a bf16 step with clipping)
        pytest.param({"sharding_strategy": "HYBRID_SHARD"}, False, 4, (2, 4, 1), marks=pytest.mark.slow),
        ({"cpu_offload": True}, True, 8, (8, 1)),
    ],
    ids=["fsdp", "tp2", "hybrid", "offload_meta_init"],
)
def test_trainer_fit_with_bf16_mixed_and_clipping_as_rank_5_of_8(strategy_kwargs, meta_init, per_node, mesh_shape):
    with simulated_world(8, rank=5, devices_per_node=per_node) as world, lightning_value_reads_answered_locally():
        module = _SimLitGPT(arch="gpt", meta_init=meta_init)
        trainer = sim_trainer(world, per_node=per_node, precision="bf16-mixed", gradient_clip_val=1.0,
                              max_steps=2, strategy_kwargs=strategy_kwargs)  # fmt: skip
        with comm.count_collectives() as counts:
            trainer.fit(module)
        strategy = trainer.strategy
        assert trainer.global_step == 2 and strategy.root_device == torch.device(world.device_type, 5 % per_node)
        assert tuple(strategy.device_mesh.shape) == mesh_shape
        shard_device = "cpu" if strategy_kwargs.get("cpu_offload") else world.device_type
        params = list(module.model.parameters())
        assert params and all(p.to_local().device.type == shard_device for p in params)
        assert all(b.device == strategy.root_device for b in module.model.buffers())
        # Lightning zeroes the gradients before each step's backward: the last step's are still there, sharded
        trained = [p for p in params if p.requires_grad]  # TinyGPT has a frozen layer
        assert all(p.grad is not None and p.grad.to_local().device.type == shard_device for p in trained)
    # two steps of all-gathers and reduce-scatters, and clipping's all-reduce of the norm (TP adds its own)
    assert counts.calls["all_gather"] > 0 and counts.calls["reduce_scatter"] > 0 and counts.calls["all_reduce"] >= 2
    if mesh_shape == (8, 1):
        assert counts.calls["all_reduce"] == 2  # clipping's norm, once per step
