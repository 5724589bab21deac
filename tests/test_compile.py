"""torch.compile (inductor, CPU) over the staging kernels, a whole sharded model, and each FSDP unit.

Compiling is slow on small CPUs: the models are tiny and each test compiles few graphs.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

import strategies
from numba_kernels import GroupLayout, all_gather_copy_in, all_gather_copy_out, post_reduce, reduce_scatter_copy_in
from tests.fsdp_models import batches, full_state, make_model, max_diff
from tests.harness import distributed
from tests.test_fabric import GLOBAL_BATCH, _adamw, _reference, _train
from tests.test_strategy import _max_diff, _trainer


def _stage(layout: GroupLayout, a: torch.Tensor, b: torch.Tensor):
    """All four staging ops, on tensors made inside the (compiled) function."""
    rs = torch.empty(2, layout.shard_numel)
    reduce_scatter_copy_in(layout, [a * 2, b], rs, predivide=2.0)
    full = [torch.empty(5, 3), torch.empty(4)]
    all_gather_copy_out(layout, rs, full)
    grad = torch.ones(layout.shard_numel)
    post_reduce(layout, rs[1], grad, postdivide=4.0, accumulate=True)
    gathered = torch.zeros(2, layout.shard_numel)
    all_gather_copy_in(layout, grad, gathered, rank=1)
    return full[0] + 1, full[1], gathered


@pytest.mark.slow
def test_staging_kernels_inside_a_compiled_function_equal_eager():
    torch._dynamo.reset()
    layout = GroupLayout([(5, 3), (4,)], world_size=2)
    a, b = torch.randn(5, 3), torch.randn(4)
    eager = _stage(layout, a, b)
    compiled = torch.compile(_stage)(layout, a, b)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
    assert torch.equal(eager[0], a + 1)  # the round trip itself: scatter (x2 / 2) then gather back


@distributed(world_size=2)
def test_whole_model_compiled_after_sharding_equals_one_process():
    # fabric.setup(torch.compile(model)) shards the model, then compiles the whole sharded model again.
    torch._dynamo.reset()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="shard_fsdp_tp")
    fabric.launch()
    model = fabric.setup_module(torch.compile(make_model(0)))
    assert isinstance(model._forward_module, torch._dynamo.eval_frame.OptimizedModule)
    opt = fabric.setup_optimizers(_adamw(model))
    steps = 2
    _train(fabric, model, opt, iter(batches(steps, GLOBAL_BATCH)), steps)
    # Inductor may sum in another order than eager: equal up to float rounding.
    assert max_diff(full_state(model.module), _reference(steps)) < 1e-5


@distributed(world_size=2)
def test_trainer_compile_fsdp_units_equals_one_process():
    from tests.lightning_models import LitGPT, reference_params

    torch._dynamo.reset()
    module = LitGPT()
    strategy = strategies.ShardFSDPTPStrategy(compile_fsdp_units=True)
    trainer = _trainer(max_steps=2, strategy=strategy)
    trainer.fit(module)
    assert strategy.parallel_summary["compiled_units"] == ["model.blocks.0", "model.blocks.1"]
    assert _max_diff(module, reference_params(2)) < 1e-5
    dist.barrier()
