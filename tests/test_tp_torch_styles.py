"""torch's own parallel styles in a plan: converted to ours with the same arguments (or refused naming ours),
and a model parallelized with a torch-style plan computes what the single process computes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.tensor as tdt
import torch.distributed.tensor.parallel as tp_torch

from lightning_shard import init_device_mesh
from lightning_shard.tensor import DTensor, Partial, Replicate, Shard
from lightning_shard.tp import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from lightning_shard.tp._torch_styles import from_torch
from tests.harness import distributed
from tests.test_tp import VOCAB, B, T, _Toy, _toy_plan

# (torch's style, ours built with the same arguments); ours is the expected conversion.
PAIRS = [
    (tp_torch.ColwiseParallel(), ColwiseParallel()),
    (
        tp_torch.ColwiseParallel(input_layouts=tdt.Shard(1), output_layouts=tdt.Replicate(), use_local_output=False),
        ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False),
    ),
    (tp_torch.RowwiseParallel(), RowwiseParallel()),
    (
        tp_torch.RowwiseParallel(input_layouts=tdt.Replicate(), output_layouts=tdt.Shard(1)),
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    ),
    (tp_torch.SequenceParallel(), SequenceParallel()),
    (
        tp_torch.SequenceParallel(sequence_dim=0, use_local_output=True),
        SequenceParallel(sequence_dim=0, use_local_output=True),
    ),
    (
        tp_torch.PrepareModuleInput(input_layouts=(tdt.Shard(1), None), desired_input_layouts=(tdt.Replicate(), None)),
        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
    ),
    (
        tp_torch.PrepareModuleInput(
            input_kwarg_layouts={"x": tdt.Shard(1)},
            desired_input_kwarg_layouts={"x": tdt.Replicate()},
            use_local_output=True,
        ),
        PrepareModuleInput(
            input_kwarg_layouts={"x": Shard(1)}, desired_input_kwarg_layouts={"x": Replicate()}, use_local_output=True
        ),
    ),
    (
        tp_torch.PrepareModuleOutput(output_layouts=tdt.Partial(), desired_output_layouts=tdt.Replicate()),
        PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
    ),
]


@pytest.mark.parametrize("theirs, ours", PAIRS, ids=lambda s: type(s).__name__)
def test_torch_style_converts_to_ours_with_the_same_arguments(theirs, ours):
    converted = from_torch(theirs, "key")
    assert len(converted) == 1 and type(converted[0]) is type(ours)
    assert vars(converted[0]) == vars(ours)


def test_prepare_module_input_output_becomes_input_then_output():
    theirs = tp_torch.PrepareModuleInputOutput(
        input_layouts=tdt.Shard(1),
        desired_input_layouts=tdt.Replicate(),
        output_layouts=tdt.Replicate(),
        desired_output_layouts=tdt.Shard(1),
        use_local_input=True,
    )
    first, second = from_torch(theirs, "mlp")
    expected_in = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True)
    assert type(first) is PrepareModuleInput and vars(first) == vars(expected_in)
    expected_out = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    assert type(second) is PrepareModuleOutput and vars(second) == vars(expected_out)


def test_ours_and_other_values_pass_through():
    ours = ColwiseParallel()
    assert from_torch(ours, "k")[0] is ours
    assert from_torch("not a style", "k") == ["not a style"]  # parallelize_module's own type check names it


class _Float8Colwise(tp_torch.ColwiseParallel):
    """A torch style subclass (as float8 libraries ship): its _apply differs, so no exact conversion exists."""


def test_inexact_conversions_raise_naming_ours():
    with pytest.raises(TypeError, match=r"'w1'.*_Float8Colwise.*lightning_shard\.tp\.ColwiseParallel"):
        from_torch(_Float8Colwise(), "w1")
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = tp_torch.ColwiseParallel(output_layouts=_StridedShard(0, split_factor=2))
    with pytest.raises(TypeError, match=r"'w2'.*_StridedShard.*Shard / Replicate / Partial"):
        from_torch(strided, "w2")


@distributed(world_size=2)
def test_torch_style_plan_matches_our_plan_and_single_process():
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    # the subclass check, on a real mesh: nothing applied, nothing hangs
    with pytest.raises(TypeError, match=r"plan entry 'head'.*lightning_shard\.tp\.ColwiseParallel"):
        parallelize_module(_Toy(), tp_mesh, {"head": _Float8Colwise()})
    torch.manual_seed(0)
    model = _Toy()
    ref, ours_model = copy.deepcopy(model), copy.deepcopy(model)
    idx = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    ref_out = ref(idx)
    ref_out.square().mean().backward()

    to_seq = (tdt.Replicate(), tdt.Shard(1))
    torch_plan = _toy_plan(False)  # torch's styles and placements
    torch_plan["mlp"] = (
        torch_plan["mlp"],
        tp_torch.PrepareModuleOutput(output_layouts=to_seq[0], desired_output_layouts=to_seq[1]),
    )
    parallelize_module(model, tp_mesh, torch_plan)
    our_plan = _toy_plan(True)
    our_plan["mlp"] = (
        our_plan["mlp"],
        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    )
    parallelize_module(ours_model, tp_mesh, our_plan)

    out = model(idx)
    out.square().mean().backward()
    ours_out = ours_model(idx)
    ours_out.square().mean().backward()
    assert isinstance(out, DTensor) and out.placements == (Shard(2),)
    assert (out.full_tensor() - ref_out).abs().max() < 1e-5
    assert torch.equal(out.full_tensor(), ours_out.full_tensor())
    ref_params, our_params = dict(ref.named_parameters()), dict(ours_model.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == our_params[name].placements, name
        assert (p.grad.full_tensor() - ref_params[name].grad).abs().max() < 1e-5, name
