"""lightning_shard.checkpoint on real gloo groups: round trips, resharding, torch interop, bad input."""

import os

import torch
import torch.distributed as dist

from lightning_shard import init_device_mesh
from lightning_shard.checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from lightning_shard.fsdp import fully_shard
from tests.fsdp_models import batches, full_state, loss_fn, make_model, make_optimizer, rank_slice
from tests.harness import distributed


def _shared_dir(tmp_path) -> str:
    """pytest's tmp_path is passed to every rank, so it is shared (one machine)."""
    return str(tmp_path)


def _mesh(shape=None):
    world = dist.get_world_size()
    if shape is None or len(shape) == 1:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "data_parallel"))


def _fsdp(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _dp_coords(mesh):
    """(rank, world) of this rank's data shard: HSDP splits the batch over both mesh dims."""
    if mesh is None:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _steps(model, opt, data, mesh):
    rank, world = _dp_coords(mesh)
    for x, y in data:
        loss = loss_fn(model, rank_slice(x, rank, world), rank_slice(y, rank, world))
        opt.zero_grad()
        loss.backward()
        if mesh is None and dist.is_initialized():  # plain replicated model: every rank uses the full batch
            pass
        opt.step()


def _state(model, opt, step=0):
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt),
        "step": step,
        "extra": {"note": "", "lrs": [0.0]},
    }


def _assert_params_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _round_trip(tmp, sharded: bool, optim: str):
    data = batches(6, 4)
    mesh = _mesh() if sharded else None
    model = make_model()
    if sharded:
        _fsdp(model, mesh)
    opt = make_optimizer(model, 0.1, optim)
    _steps(model, opt, data[:3], mesh)
    path = os.path.join(tmp, f"ckpt-{sharded}-{optim}")
    st = _state(model, opt, step=3)
    st["extra"] = {"note": "hello", "lrs": [0.5, 0.25]}
    save(st, path)
    _steps(model, opt, data[3:], mesh)
    expected = full_state(model)

    fresh = make_model(seed=7)
    if sharded:
        _fsdp(fresh, mesh)
    opt2 = make_optimizer(fresh, 0.1, optim)
    state = _state(fresh, opt2)
    load(state, path)
    assert state["step"] == 3 and state["extra"] == {"note": "hello", "lrs": [0.5, 0.25]}
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, opt2, state["optimizer"])
    _steps(fresh, opt2, data[3:], mesh)
    _assert_params_equal(full_state(fresh), expected)


@distributed(world_size=2)
def test_round_trip_fsdp_and_plain_bitwise(tmp_path):
    tmp = _shared_dir(tmp_path)
    _round_trip(tmp, sharded=True, optim="adamw")
    _round_trip(tmp, sharded=True, optim="sgd")
    _round_trip(tmp, sharded=False, optim="adamw")
