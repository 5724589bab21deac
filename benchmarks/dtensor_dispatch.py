"""Per-op cost of DTensor dispatch in an optimizer's inner loop: our DTensor vs torch's DTensor vs plain tensors.

On CPU, torch's optimizers run their per-parameter ("for-loop") implementation, so every AdamW step sends
about ten pointwise ops per parameter through ``__torch_dispatch__``. This times AdamW's op sequence
(``mul_``, ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ``div_``, ``add_``, ``addcdiv_``) on one sharded
parameter, in one process (a one-rank gloo group), the three variants alternating.

    python benchmarks/dtensor_dispatch.py --json runs/dtensor_dispatch.json

``--json`` writes ``{"plain": us_per_op, "ours": ..., "torch": ...}`` (medians over ``--repeats``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lightning_shard

OPS_PER_ITERATION = 8


def _adamw_ops_us(param: torch.Tensor, iterations: int) -> float:
    """Microseconds per op of AdamW's update sequence on ``param`` (values kept finite, results unused)."""
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    t0 = time.perf_counter()
    for _ in range(iterations):
        param.mul_(1.0)
        exp_avg.lerp_(param, 0.1)
        exp_avg_sq.mul_(0.999).addcmul_(param, param, value=0.001)
        denom = exp_avg_sq.sqrt().div_(1.0).add_(1e-8)
        param.addcdiv_(exp_avg, denom, value=-0.0)
    return (time.perf_counter() - t0) / iterations / OPS_PER_ITERATION * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=2, default=[256, 256], help="global parameter shape")
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    import torch.distributed.tensor as torch_dtensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    from lightning_shard import init_device_mesh
    from lightning_shard.tensor import Shard, distribute_tensor

    x = torch.randn(*args.shape)
    torch_mesh = torch_init_device_mesh("cpu", (1,))
    params = {
        "plain": x.clone(),
        "ours": distribute_tensor(x.clone(), init_device_mesh("cpu", (1,)), [Shard(0)]),
        "torch": torch_dtensor.distribute_tensor(x.clone(), torch_mesh, [torch_dtensor.Shard(0)]),
    }
    times: dict[str, list[float]] = {name: [] for name in params}
    for param in params.values():
        _adamw_ops_us(param, 50)  # warm-up: rule loading, caches
    for _ in range(args.repeats):
        for name, param in params.items():
            times[name].append(_adamw_ops_us(param, args.iterations))
    result = {name: statistics.median(ts) for name, ts in times.items()}
    for name, us in result.items():
        print(f"{name:6s} {us:6.1f} us/op  (per repeat: {', '.join(f'{t:.1f}' for t in times[name])})")
    print(f"ours / torch: {result['ours'] / result['torch']:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
