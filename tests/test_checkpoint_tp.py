"""Checkpoints of tensor-parallel and FSDP-over-TP (2-D) models: reshard to and from FSDP and plain models."""

import os

import torch

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
from lightning_shard.tp import auto_tp_plan, parallelize_module
from tests import tp_models
from tests.fsdp_models import full_state
from tests.harness import distributed


def _llama(seed):
    torch.manual_seed(seed)
    return tp_models.Llama()


def _layout(model, kind, meshes):
    if kind in ("TP", "DPxTP"):
        tp = meshes["TP"]
        parallelize_module(model, tp, auto_tp_plan(model, tp))
    if kind in ("DP", "DPxTP"):
        dp = meshes["DP"]
        for layer in model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def _check(tmp, meshes, src, dsts):
    model = _layout(_llama(0), src, meshes)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    set_model_state_dict(model, _llama(1).state_dict())  # full tensors cut into this layout
    osd = get_optimizer_state_dict(model, opt)  # creates the state (zeros)
    for st in osd["state"].values():
        st["step"].fill_(5.0)
    path = os.path.join(tmp, src)
    save({"model": get_model_state_dict(model), "optimizer": osd}, path)
    expected = full_state(model)
    assert all(torch.equal(expected[k], v) for k, v in full_state(_llama(1)).items())
    for dst in dsts:
        fresh = _layout(_llama(2), dst, meshes)
        fopt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
        state = {"model": get_model_state_dict(fresh), "optimizer": get_optimizer_state_dict(fresh, fopt)}
        load(state, path)
        set_optimizer_state_dict(fresh, fopt, state["optimizer"])
        got = full_state(fresh)
        for k in expected:
            assert torch.equal(got[k], expected[k]), f"{src} -> {dst}: {k}"
        steps = {float(s["step"]) for s in fopt.state.values()}
        assert steps == {5.0}, (src, dst, steps)


@distributed(world_size=2)
def test_tp_checkpoint_reshards_to_fsdp_and_plain(tmp_path):
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    meshes = {"TP": tp, "DP": dp}
    _check(str(tmp_path), meshes, "TP", ["plain", "DP"])
    _check(str(tmp_path), meshes, "DP", ["TP"])


@distributed(world_size=4)
def test_2d_checkpoint_reshards(tmp_path):
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    meshes = {"TP": root["tensor_parallel"], "DP": root["data_parallel"]}
    _check(str(tmp_path), meshes, "DPxTP", ["DP", "TP", "plain"])
    _check(str(tmp_path), meshes, "DP", ["DPxTP"])  # FSDP over TP needs its DP mesh from the same root
