"""Why FSDP's all-gathers and reduce-scatters run as pairwise sends on gloo: gloo's collectives and ours on the
same inputs, in one run.

For each input size and dtype: gloo's ``reduce_scatter_tensor`` (what torch's FSDP2 calls), gloo's in-place
``all_reduce`` of the same input (what DDP calls), ``lightning_shard.comm.reduce_scatter_into`` (on gloo:
point-to-point sends between each pair of ranks and a local sum), gloo's ``all_gather_into_tensor`` and
``lightning_shard.comm.all_gather_into`` (pairwise sends). They alternate, each after a barrier; the median of
``--reps`` is reported, slowest rank.

    python benchmarks/gloo_collectives.py --world-size 2 --json runs/gloo_collectives.json

``--json`` writes a list of rows ``{"mb", "dtype", "<kind>_ms"..., "<ratio>"...}`` (``mb``: the reduce-scatter's
input per rank, the all-gather's output; ratios: ours / gloo's).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lightning_shard
from benchmarks.fsdp_vs_torch import _free_port  # noqa: E402

KINDS = (
    "gloo_reduce_scatter_ms",
    "gloo_all_reduce_ms",
    "ours_reduce_scatter_ms",
    "gloo_all_gather_ms",
    "ours_all_gather_ms",
)
RATIOS = {
    "rs_vs_reduce_scatter": ("ours_reduce_scatter_ms", "gloo_reduce_scatter_ms"),
    "rs_vs_all_reduce": ("ours_reduce_scatter_ms", "gloo_all_reduce_ms"),
    "ag_vs_all_gather": ("ours_all_gather_ms", "gloo_all_gather_ms"),
}


def _time_ms(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _measure(x: torch.Tensor, group, reps: int) -> dict:
    from lightning_shard import comm

    world = dist.get_world_size(group)
    chunk, scratch, shard = x.new_empty(x.numel() // world), torch.empty_like(x), x[: x.numel() // world].clone()
    calls = {
        "gloo_reduce_scatter_ms": lambda: dist.reduce_scatter_tensor(chunk, x, group=group),
        "gloo_all_reduce_ms": lambda: dist.all_reduce(scratch, group=group),
        "ours_reduce_scatter_ms": lambda: comm.reduce_scatter_into(chunk, x, group),
        "gloo_all_gather_ms": lambda: dist.all_gather_into_tensor(scratch, shard, group=group),
        "ours_all_gather_ms": lambda: comm.all_gather_into(scratch, shard, group),
    }
    times = {k: [] for k in KINDS}
    for _ in range(reps):  # alternate, so background load hits all alike
        for kind in KINDS:
            scratch.copy_(x)  # the all-reduce overwrites it: fresh values each time
            times[kind].append(_time_ms(calls[kind]))
    return {k: statistics.median(v) for k, v in times.items()}


def _worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for mb in args.sizes_mb:
            n = int(mb * 2**20) // dtype.itemsize // world * world
            row = {"mb": mb, "dtype": str(dtype).removeprefix("torch.")}
            row.update(_measure(torch.randn(n).to(dtype), dist.group.WORLD, args.reps))
            rows.append(row)
    Path(f"{out_path}.{rank}").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(_worker, args=(args.world_size, _free_port(), args, out), nprocs=args.world_size)
        per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(args.world_size)]
    rows = []
    for ranked in zip(*per_rank):
        row = dict(ranked[0])
        for key in KINDS:
            row[key] = max(r[key] for r in ranked)  # the slowest rank finishes the collective
        for name, (ours, theirs) in RATIOS.items():
            row[name] = row[ours] / row[theirs]
        rows.append(row)
        times = "  ".join(f"{k.removesuffix('_ms')} {row[k]:6.2f}" for k in KINDS)
        ratios = "  ".join(f"{name} {row[name]:.2f}x" for name in RATIOS)
        print(f"{row['dtype']:>8} {row['mb']:5.1f} MB  {times} ms  {ratios}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
