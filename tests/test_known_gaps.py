"""Known weak spots, each compared with one process (or checked to raise a clear error) on 2 gloo ranks:

* optimizers under TP: a fused step (``fused=True``) over a model whose TP plan leaves some parameters plain
  tensors (norm weights) raised ``IndexError`` in the fallback; it now takes one local fused call. The Adam
  family's distance from one process (up to ~2e-4 on a tiny Hugging Face Llama at lr 1e-2) is float noise:
  torch's own ``parallelize_module`` is as far or farther, it does not grow with the steps, and SGD is within
  1e-7 (``slow``: the optimizer matrix against torch's TP).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_shard import init_device_mesh
from lightning_shard.tensor import DTensor
from lightning_shard.tp import auto_tp_plan, parallelize_module
from tests import hf_models, tp_models
from tests.harness import distributed

VOCAB = 101


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tp_mesh():
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))


def _batches(steps: int, vocab: int = VOCAB) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, vocab, (2, 8), generator=g), torch.randint(0, vocab, (2, 8), generator=g))
        for _ in range(steps)
    ]


def _loss(model, idx, tgt) -> torch.Tensor:
    if isinstance(model, tp_models.Llama):
        return F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten(0, 1))
    return model(input_ids=idx, labels=tgt).loss


def _train(model, make_opt, batches) -> dict[str, torch.Tensor]:
    opt = make_opt(model.parameters())
    for idx, tgt in batches:
        _loss(model, idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    return {n: _full(p.detach()) for n, p in model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------------------------------ 1. optimizers under TP
@distributed(world_size=2)
def test_fused_step_with_parameters_the_plan_leaves_plain():
    mesh = _tp_mesh()
    for make_opt in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    ):
        torch.manual_seed(0)
        model = tp_models.Llama()
        ref = copy.deepcopy(model)
        batches = _batches(3)
        expected = _train(ref, make_opt, batches)
        parallelize_module(model, mesh, auto_tp_plan(model, mesh, sequence_parallel=False, loss_parallel=False))
        assert not isinstance(model.norm.weight, DTensor)  # the case: plain and sharded parameters in one step
        assert _worst(_train(model, make_opt, batches), expected) < 1e-5


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_loop_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False, amsgrad=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
}


def _torch_tp(model, mesh) -> None:
    """torch's own ``parallelize_module`` with the plan ``auto_tp_plan`` makes for a Hugging Face Llama
    (Hugging Face's attention reshapes with -1 heads, so no attribute changes are needed)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh.to_torch(), plan)


@pytest.mark.slow
@distributed(world_size=2)
def test_optimizers_under_tp_as_close_to_one_process_as_torch_tp():
    """Each optimizer, 5 steps on a tiny Hugging Face Llama under TP 2: ours is within float noise of one
    process, where the noise is what torch's own TP gives on the same model, plan and batches (Adam-style
    normalisers turn 1e-7 gradient rounding on near-zero gradients into steps of a good part of ``lr``)."""
    mesh = _tp_mesh()
    batches = _batches(5, hf_models.VOCAB)
    for name, make_opt in OPTIMIZERS.items():
        base = hf_models.build("llama")
        ref, ours, theirs = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        expected = _train(ref, make_opt, batches)
        parallelize_module(ours, mesh, auto_tp_plan(ours, mesh, sequence_parallel=False, loss_parallel=False))
        _torch_tp(theirs, mesh)
        ours_off = _worst(_train(ours, make_opt, batches), expected)
        torch_off = _worst(_train(theirs, make_opt, batches), expected)
        assert ours_off <= max(2 * torch_off, 1e-6), (name, ours_off, torch_off)
