"""Host time of ``AdamW.step()`` on a fully sharded model: our fully_shard vs torch's FSDP2, same model, one run.

The model is ``tests.fsdp_models.TinyGPT`` with ``--blocks`` blocks (48 blocks: 289 trainable parameters),
``fully_shard``'ed per block and at the root on 2 gloo ranks, once with our engine and once with torch's. After
one forward/backward (so every parameter has a sharded gradient), ``opt.step()`` is timed ``--repeats`` times,
ours and torch's alternating, for ``AdamW(foreach=True)``, ``AdamW(foreach=False)`` and ``AdamW(fused=True)``;
medians on rank 0.

    python benchmarks/optimizer_step.py --json runs/optimizer_step.json

``--json`` writes ``{"foreach": {"ours_ms": ..., "torch_ms": ..., "ratio": ...}, "for_loop": {...}, "fused": {...}}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lightning_shard, tests.fsdp_models


def _shard(model, fully_shard, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, world: int, port: int, args: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from lightning_shard import init_device_mesh
    from lightning_shard.fsdp import fully_shard
    from tests.fsdp_models import batches, loss_fn, make_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    base = make_model(n_blocks=args["blocks"])
    models = {
        "ours": _shard(copy.deepcopy(base), fully_shard, mesh),
        "torch": _shard(copy.deepcopy(base), torch_fully_shard, mesh.to_torch()),
    }
    x, y = batches(1, 2 * world)[0]
    for m in models.values():
        loss_fn(m, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    n_params = sum(p.requires_grad for p in base.parameters())
    results = {}
    variants = {"foreach": {"foreach": True}, "for_loop": {"foreach": False}, "fused": {"fused": True}}
    for variant, kwargs in variants.items():
        opts = {
            k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, **kwargs)
            for k, m in models.items()
        }
        times: dict[str, list[float]] = {k: [] for k in opts}
        for r in range(args["warmup"] + args["repeats"]):
            for k, opt in opts.items():
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
                if r >= args["warmup"]:
                    times[k].append(dt * 1e3)
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["torch"])
        results[variant] = {
            "ours_ms": round(ours, 2),
            "torch_ms": round(theirs, 2),
            "ratio": round(ours / theirs, 3),
        }
    if rank == 0:
        results["trainable_parameters"] = n_params
        print(json.dumps(results, indent=1))
        if args["json"]:
            Path(args["json"]).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=48)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, vars(a)), nprocs=2, join=True)


if __name__ == "__main__":
    main()
