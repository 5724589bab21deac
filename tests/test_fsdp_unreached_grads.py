"""Parameters a backward does not reach: one process leaves their ``.grad`` None (optimizers then skip them);
FSDP must too when no rank reached them, and must average as usual when only some ranks did."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from tests.harness import distributed


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        y = self.a(x)
        return (self.b(y) if use_b else y).square().sum()


@distributed(world_size=2)
def test_unreached_everywhere_is_none_reached_somewhere_is_averaged():
    torch.manual_seed(0)
    model = _Branches()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    (sum(ref(x[r : r + 1], use_b=r == 0) for r in range(2)) / 2).backward()  # b only in rank 0's half
    fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",)))
    rank = dist.get_rank()
    for step in range(2):  # the second backward accumulates into the first's gradients
        model(x[rank : rank + 1], use_b=rank == 0).backward()
        for name, p in model.named_parameters():
            expected = ref.get_parameter(name).grad
            if expected is None:
                assert p.grad is None, name  # was a zero gradient: weight decay and momentum moved it
            else:
                torch.testing.assert_close(p.grad.full_tensor(), (step + 1) * expected, msg=name)


@distributed(world_size=2)
def test_the_flags_are_read_only_by_a_group_this_rank_left_without_a_gradient(monkeypatch):
    # Reading the all-reduced flags waits for the device on an accelerator; every group read them at every end of
    # backward, though a rank that computed every gradient of a group itself knows the maximum already.
    from lightning_shard.fsdp import param_group

    reads = []
    read = param_group.GradientPresence._read
    monkeypatch.setattr(param_group.GradientPresence, "_read", staticmethod(lambda a: reads.append(1) or read(a)))
    torch.manual_seed(0)
    model = _Branches()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root's group: a, and unused, which no rank reaches
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(2):
        model(x, use_b=True).backward()
        assert len(reads) == step + 1  # the root's group only: b got every gradient here
        assert model.unused.weight.grad is None and model.b.weight.grad is not None
    model.b.bias.requires_grad_(False)  # frozen (fine-tuning): no rank computes its gradient, so b still knows
    model.zero_grad(set_to_none=True)
    model(x, use_b=True).backward()
    assert len(reads) == 3 and model.b.bias.grad is None and model.b.weight.grad is not None
