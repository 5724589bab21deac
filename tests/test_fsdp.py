"""fully_shard on real gloo groups: parity with a single process and torch FSDP2, memory, communication."""

import torch.distributed as dist

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from lightning_shard.tensor import DTensor, Shard
from tests.fsdp_models import (
    batches,
    full_state,
    loss_fn,
    make_model,
    make_optimizer,
    max_diff,
    rank_slice,
    train_reference,
)
from tests.harness import distributed


def _dp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))


def _shard(model, mesh, **kwargs):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _train(model, data, optim="sgd", lr=0.1):
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = make_optimizer(model, lr, optim)
    for x, y in data:
        loss = loss_fn(model, rank_slice(x, rank, world), rank_slice(y, rank, world))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@distributed(world_size=2)
def test_parity_with_single_process_sgd():
    data = batches(5, 4)
    model = make_model()
    ref, _ = train_reference(model, data)
    _shard(model, _dp_mesh())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
    _train(model, data)
    diff = max_diff(full_state(model), full_state(ref))
    assert diff < 1e-5, diff
