"""ShardedGradScaler ("16-mixed") on real gloo ranks with fp16 FSDP compute on CPU.

Lightning maps ``precision="16-mixed"`` to bf16 on CPU accelerators, so the Trainer tests cannot reach the
fp16 scaler path; these tests drive it directly with the same FSDP model the strategy would build.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import MixedPrecisionPolicy, fully_shard
from lightning_shard.tensor import DTensor
from strategies.precision import ShardedGradScaler
from tests.fsdp_models import batches, full_state, loss_fn, make_model, max_diff, rank_slice
from tests.harness import distributed


def _fsdp(model, param_dtype=torch.float16):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _local_grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters() if isinstance(p.grad, DTensor)]


@distributed(world_size=2)
def test_unscaled_gradients_match_fp32_and_the_step_is_taken():
    x, y = batches(1, 4)[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = rank_slice(x, rank, world), rank_slice(y, rank, world)
    fp32, scaled = _fsdp(make_model(), param_dtype=None), _fsdp(make_model())
    loss_fn(fp32, xs, ys).backward()
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD([p for p in scaled.parameters() if p.requires_grad], lr=0.1)
    scaler.scale(loss_fn(scaled, xs, ys)).backward()
    scaler.unscale_(opt)
    # fp16 compute rounds, so not bit-equal; a missing or doubled unscale would be off by 2**10.
    for want, got in zip(_local_grads(fp32), _local_grads(scaled)):
        assert (got - want).abs().max() <= 1e-2 * want.abs().max() + 1e-6
    before = full_state(scaled)
    scaler.step(opt)
    scaler.update()
    assert max_diff(before, full_state(scaled)) > 0
    assert scaler.get_scale() == 2.0**10


@pytest.mark.parametrize("fused", [False, True])  # fused: the kernel unscales and skips, told by the scaler
@distributed(world_size=2)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(fused):
    x, y = batches(1, 4)[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _fsdp(make_model())
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    scaler.scale(loss_fn(model, rank_slice(x, rank, world), rank_slice(y, rank, world))).backward()
    if rank == 1:  # only this rank's shard overflows
        next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("inf")
    before = {k: v.clone() for k, v in full_state(model).items()}
    scaler.step(opt)
    scaler.update()
    assert max_diff(before, full_state(model)) == 0  # rank 0 saw only finite gradients, yet skipped too
    assert scaler.get_scale() == 2.0**9
