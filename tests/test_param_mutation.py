"""User code that changes parameter values between optimizer steps (weight clipping, re-initialising a head,
EMA-style blends, ``p.data = ...``) on ``fully_shard``ed parameters: the next steps must train as one process
does after the same change, or the change must be refused with a clear error."""

import pytest
import torch
import torch.distributed as dist

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from tests.fsdp_models import batches, full_state, make_model, max_diff, step_both
from tests.harness import distributed

CHANGES = {
    "in place through .data": lambda m: [p.data.mul_(0.5) for p in m.parameters()],
    "in place under no_grad": lambda m: [p.mul_(0.5) for p in m.parameters()],
    "clamp_ (WGAN weight clipping)": lambda m: [p.clamp_(-0.05, 0.05) for p in m.parameters()],
    "nn.init on one weight": lambda m: torch.nn.init.constant_(m.blocks[0].up.weight, 0.01),
    ".data = new value": lambda m: [setattr(p, "data", p.data * 0.5) for p in m.parameters()],
    # assigns .data of every parameter a slice of one vector (replicated under our DTensor)
    "vector_to_parameters": lambda m: torch.nn.utils.vector_to_parameters(
        torch.nn.utils.parameters_to_vector(m.parameters()) * 0.5, m.parameters()
    ),
}


def _shard(model):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@distributed(world_size=2)
def test_parameter_changes_between_steps_train_like_one_process():
    for name, change in CHANGES.items():
        ref, model = make_model(), _shard(make_model())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in enumerate(batches(3, 4)):
            if step == 1:
                with torch.no_grad():
                    change(ref)
                    change(model)
            step_both(ref, ref_opt, model, opt, x, y)
        assert max_diff(full_state(model), full_state(ref)) < 1e-6, name


@distributed(world_size=2)
def test_data_assignment_of_another_layout_is_refused_on_every_rank():
    model = _shard(make_model())
    weight = model.blocks[0].up.weight
    before = weight.full_tensor()
    with pytest.raises(TypeError, match=r"DTensor.data = .*same shape, dtype and mesh.*copy_"):
        weight.data = torch.zeros(weight.shape)  # a plain tensor: each rank's local shard is unknown
    with pytest.raises(TypeError, match="bfloat16"):
        weight.data = weight.data.to(torch.bfloat16)
    torch.testing.assert_close(weight.full_tensor(), before, rtol=0, atol=0)  # nothing half-changed
