"""Step time of a sharded model: eager vs torch.compile (whole model) vs torch.compile per FSDP unit.

Each variant runs in fresh processes (``--world-size`` ranks, gloo on CPU): ``fully_shard`` per block and on
the root, then AdamW steps on the same data. Reported per variant: the first step (which includes
compilation) and the median of the remaining steps, in seconds, plus the loss of the last step (the
variants must agree).

    python benchmarks/compile_vs_eager.py --world-size 2 --steps 12 --dim 256 --blocks 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from benchmarks.fsdp_vs_torch import _free_port  # noqa: E402

VARIANTS = ("eager", "compile_model", "compile_units")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _worker(rank: int, world: int, port: int, variant: str, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_shard import init_device_mesh
    from lightning_shard.fsdp import fully_shard
    from strategies.compile import compile_fsdp_units

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    torch.manual_seed(0)
    model = Model(args.vocab, args.dim, args.blocks)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = model
    if variant == "compile_model":
        run = torch.compile(model)
    elif variant == "compile_units":
        compile_fsdp_units(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    times, loss = [], None
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(run(x).reshape(-1, args.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"first_step_s": times[0], "step_s": statistics.median(times[1:]), "loss": loss.item()}, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            out = os.path.join(tmp, f"{variant}.json")
            mp.spawn(_worker, args=(args.world_size, _free_port(), variant, args, out), nprocs=args.world_size)
            with open(out) as f:
                results[variant] = json.load(f)
    base = results.get("eager", {}).get("step_s")
    print(f"{'variant':<15}{'first step s':>14}{'step s':>10}{'vs eager':>10}{'last loss':>12}")
    for name, r in results.items():
        ratio = f"{r['step_s'] / base:.2f}x" if base else "-"
        print(f"{name:<15}{r['first_step_s']:>14.2f}{r['step_s']:>10.4f}{ratio:>10}{r['loss']:>12.5f}")


if __name__ == "__main__":
    main()
