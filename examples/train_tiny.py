"""Placeholder main job: train a tiny regression model data-parallel on 2 CPU processes.

Run with ``./dev demo`` (which calls ``torchrun --standalone --nproc-per-node 2 examples/train_tiny.py``).
The mesh comes from our engine; gradients are averaged over its data-parallel group. The fine-tuning
examples of the strategy issue replace this job.
"""

import torch
import torch.distributed as dist

from lightning_shard import init_device_mesh


def main(steps: int = 50) -> float:
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size() if dist.is_initialized() else _env_world(),), mesh_dim_names=("data_parallel",)
    )
    group, rank, world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(256, 8)
    y = (x.sum(dim=1, keepdim=True) * 0.5).sin()
    for _ in range(steps):
        xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]  # each rank its share of the batch
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
        opt.step()
    loss = loss.detach()
    dist.all_reduce(loss, group=group)
    final = loss.item() / world
    if rank == 0:
        print(f"final loss: {final:.6f} (world size {world})")
    dist.destroy_process_group()
    return final


def _env_world() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


if __name__ == "__main__":
    main()
