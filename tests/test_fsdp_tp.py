"""FSDP over TP on a (data_parallel, tensor_parallel) mesh, with TP applied by hand (the TP package has its
own 2-D tests): the data-parallel shard applies to the TP-local tensor and training matches one process."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard, summon_full_params
from lightning_shard.tensor import DTensor, Replicate, Shard, StridedShard, distribute_tensor
from tests.harness import distributed


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(6, 10)  # colwise: 10 rows over TP=2
        self.down = nn.Linear(10, 5)  # rowwise: 10 columns over TP=2
        self.norm = nn.LayerNorm(5)  # replicated in TP

    def forward(self, x):
        return self.norm(self.down(F.relu(self.up(x))))


def _tensor_parallel(model, tp_mesh):
    """Colwise up, rowwise down, replicated norm; activations enter and leave as plain tensors."""

    def dist_param(module, name, placements):
        p = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), tp_mesh, placements)))

    dist_param(model.up, "weight", [Shard(0)])
    dist_param(model.up, "bias", [Shard(0)])
    dist_param(model.down, "weight", [Shard(1)])
    dist_param(model.down, "bias", [Replicate()])
    dist_param(model.norm, "weight", [Replicate()])
    dist_param(model.norm, "bias", [Replicate()])

    def to_dtensor(module, args):
        return (DTensor.from_local(args[0], tp_mesh, [Replicate()]),)

    def to_local(module, args, out):
        return out.redistribute(tp_mesh, [Replicate()]).to_local()

    model.register_forward_pre_hook(to_dtensor)
    model.register_forward_hook(to_local)
    return model


@distributed(world_size=4)
def test_fsdp_over_tp_matches_single_process():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    dp_rank = mesh.get_local_rank("data_parallel")
    model = MLP()
    ref = copy.deepcopy(model)
    _tensor_parallel(model, mesh["tensor_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    assert model.up.weight.placements == (StridedShard(0, split_factor=2), Shard(0))
    assert model.down.weight.placements == (Shard(0), Shard(1))
    assert model.norm.weight.placements == (Shard(0), Replicate())
    assert model.up.weight.device_mesh == mesh
    # the sharded values are the true global tensors
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q.detach()), name
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)
        loss = F.mse_loss(model(x.chunk(2)[dp_rank]), y.chunk(2)[dp_rank])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = F.mse_loss(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.full_tensor() - q.detach()).abs().max() < 1e-5, name
    with summon_full_params(model, writeback=False):
        assert isinstance(model.up.weight, DTensor) and model.up.weight.placements == (Shard(0),)
        assert torch.allclose(model.up.weight.full_tensor(), ref.up.weight.detach(), atol=1e-5)
    assert dist.get_world_size() == 4
