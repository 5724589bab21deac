"""Why FSDP's gradient reduce-scatter runs as an all-reduce on gloo: both, on the same inputs, in one run.

For each input size: gloo's ``reduce_scatter_tensor`` into a chunk-sized output (what torch FSDP2 calls)
vs ``lightning_shard.comm.reduce_scatter_scratch`` (on gloo: an all-reduce of the input in place, the
chunk being a view of it). The two alternate, each after a barrier; the median of ``--reps`` is reported,
slowest rank.

    python benchmarks/gloo_reduce_scatter.py --world-size 2 --json runs/gloo_reduce_scatter.json

``--json`` writes a list of rows ``{"mb", "dtype", "reduce_scatter_ms", "scratch_ms", "ratio"}``
(``mb``: input size per rank; ratio = scratch / reduce_scatter).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lightning_shard


def _time_ms(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _measure(x: torch.Tensor, group, reps: int) -> dict:
    from lightning_shard import comm

    scratch, out = torch.empty_like(x), x.new_empty(x.numel() // dist.get_world_size(group))
    times = {"reduce_scatter_ms": [], "scratch_ms": []}
    for _ in range(reps):  # alternate, so background load hits both alike
        times["reduce_scatter_ms"].append(_time_ms(lambda: dist.reduce_scatter_tensor(out, x)))
        scratch.copy_(x)  # the input is overwritten: fresh values each time, as in FSDP's staging buffer
        times["scratch_ms"].append(_time_ms(lambda: comm.reduce_scatter_scratch(scratch, group)))
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 3, 12, 25, 50])
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
        for key in ("reduce_scatter_ms", "scratch_ms"):
            row[key] = max(r[key] for r in ranked)  # the slowest rank finishes the collective
        row["ratio"] = row["scratch_ms"] / row["reduce_scatter_ms"]
        rows.append(row)
        print(
            f"{row['dtype']:>8} {row['mb']:6.1f} MB  reduce_scatter {row['reduce_scatter_ms']:7.2f} ms  "
            f"scratch {row['scratch_ms']:7.2f} ms  ratio {row['ratio']:.2f}x",
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
