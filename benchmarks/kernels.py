"""Benchmark: numba_kernels staging ops vs the torch FSDP2 path for the same step, and a plain copy.

For every op this times, on the same buffers:

* ``ours``  - the fused numba kernel (one pass);
* ``torch`` - what torch FSDP2 does for that step (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
  all-gather copy-in = per-param ``.to(dtype)`` (mixed precision) + ``torch._foreach_copy_`` into the
  all-gather input; copy-out = ``torch.split_with_sizes_copy``; reduce-scatter copy-in = per-grad
  ``.to(reduce_dtype)`` (when it differs) + ``torch._chunk_cat`` + ``div_``; post-reduce = ``div_`` +
  ``.to(float32)`` + ``add_`` into the fp32 grad;
* ``copy``  - ``dst.copy_(src)`` moving the same number of bytes (read + written) contiguously.

GB/s = (bytes read + bytes written by a single ideal pass) / seconds, the same byte count for all three
impls; the median of ``--reps`` repetitions after warm-up, the three impls timed round-robin so that
background load on a shared machine hits them alike (``--schedule interleaved``, the default), or each
impl's repetitions back to back (``--schedule blocked``). The two differ on CPU: after a multi-threaded
torch op, torch's OpenMP worker threads keep spinning for a while and take cores from the numba worker
threads that run next, so interleaving charges that to ours; blocked timing shows each impl on its own.

Usage::

    python benchmarks/kernels.py --device cpu --sizes small --json runs/kernels.json
    python benchmarks/kernels.py --device cuda            # 64 MB and 1 GB groups
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

import numba_kernels as nk

OPS = ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "post_reduce")


def group_shapes(total_bytes: int, n: int = 16, seed: int = 0) -> list[tuple[int, ...]]:
    """``n`` parameters of uneven shapes (dim 0 never a multiple of 8) totalling ~``total_bytes`` of fp32."""
    rng = random.Random(seed)
    weights = [rng.uniform(0.2, 2.0) for _ in range(n)]
    total = total_bytes // 4
    shapes = []
    for i, w in enumerate(weights):
        numel = int(total * w / sum(weights))
        inner = (1, 1000, 4096, 1536)[i % 4]
        d0 = max(1, numel // inner)
        d0 += 1 if d0 % 8 == 0 else 0
        shapes.append((d0,) if inner == 1 else (d0, inner))
    return shapes


def time_impls(
    device: str, fns: list[Callable[[], object]], reps: int, warmup: int = 1, blocked: bool = False
) -> list[float]:
    """Median seconds of each fn, measured round-robin (A B C A B C ...), or ``blocked`` (A A .. B B .. C C ..).

    Interleaving matters on a shared machine: a burst of someone else's load hits
    every impl alike instead of whichever happened to run during it.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    if device == "cuda":
        torch.cuda.synchronize()
    order = [k for k in range(len(fns)) for _ in range(reps)] if blocked else list(range(len(fns))) * reps
    for k in order:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[k]()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def bench_group(
    shapes: list[tuple[int, ...]],
    ws: int,
    device: str,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reps: int,
    label: str,
    blocked: bool = False,
) -> list[dict]:
    layout = nk.GroupLayout(shapes, ws)
    layout.warm(device, param_dtype, reduce_dtype)
    S, N, rank = layout.shard_numel, layout.unsharded_numel, ws - 1
    f32 = torch.float32
    padded = list(layout.padded_shard_numels)
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)

    def rnd(shape, dtype):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    def add(op: str, nbytes: int, ours: Callable, torch_path: Callable) -> None:
        copy_src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        copy_dst = torch.empty_like(copy_src)
        cases = (("ours", ours), ("torch", torch_path), ("copy", lambda: copy_dst.copy_(copy_src)))
        secs = time_impls(device, [fn for _, fn in cases], reps, blocked=blocked)
        for (impl, _), sec in zip(cases, secs):
            rows.append(
                {
                    "op": op,
                    "device": device,
                    "impl": impl,
                    "bytes": nbytes,
                    "seconds": sec,
                    "gbps": nbytes / sec / 1e9,
                    "case": label,
                    "world_size": ws,
                    "schedule": "blocked" if blocked else "interleaved",
                }
            )

    isz = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731

    # -- all-gather copy-in: fp32 sharded params (views of one flat shard) -> param_dtype AG input row
    shard = rnd((S,), f32)
    shard_views = list(torch.split(shard, padded))
    ag = torch.empty(ws, S, dtype=param_dtype, device=device)

    def torch_agin() -> None:
        inputs = [t.to(param_dtype) for t in shard_views]  # FSDP2: per-param cast (no-op if same dtype)
        torch._foreach_copy_(list(torch.split(ag[rank], padded)), inputs)

    add(
        "all_gather_copy_in",
        S * (4 + isz(param_dtype)),
        lambda: nk.all_gather_copy_in(layout, shard, ag, rank),
        torch_agin,
    )

    # -- all-gather copy-out: param_dtype AG output -> unsharded params
    gathered = rnd((ws, S), param_dtype)
    flat_full = torch.empty(N, dtype=param_dtype, device=device)
    # FSDP2's all_gather_outputs are padded unsharded tensors (ws * padded shard each)
    padded_outs = [torch.empty(ws, p, dtype=param_dtype, device=device) for p in padded]
    add(
        "all_gather_copy_out",
        ws * S * isz(param_dtype) + N * isz(param_dtype),
        lambda: nk.all_gather_copy_out(layout, gathered, flat_full),
        lambda: torch.split_with_sizes_copy(gathered, padded, dim=1, out=padded_outs),
    )

    # -- reduce-scatter copy-in: fp32 grads -> reduce_dtype RS input, predivide fused
    grads = [rnd(s, f32) for s in shapes]
    rs = torch.empty(ws, S, dtype=reduce_dtype, device=device)
    pre = float(ws)

    def torch_rsin() -> None:
        gs = grads if reduce_dtype == f32 else [g.to(reduce_dtype) for g in grads]
        torch._chunk_cat(gs, 0, ws, out=rs)
        rs.div_(pre)

    add(
        "reduce_scatter_copy_in",
        N * 4 + ws * S * isz(reduce_dtype),
        lambda: nk.reduce_scatter_copy_in(layout, grads, rs, predivide=pre),
        torch_rsin,
    )

    # -- post-reduce: reduce_dtype RS output -> fp32 sharded grad, postdivide + accumulate
    reduced = rs[0].clone()
    grad = rnd((S,), f32)
    post = 2.0

    def torch_post() -> None:
        reduced.div_(post)
        r = reduced if reduce_dtype == f32 else reduced.to(f32)
        grad.add_(r)

    add(
        "post_reduce",
        S * (isz(reduce_dtype) + 4 + 4),
        lambda: nk.post_reduce(layout, reduced, grad, postdivide=post, accumulate=True),
        torch_post,
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    p.add_argument("--sizes", choices=("small", "all"), default="all", help="small: skip the 1 GB group")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--schedule", choices=("interleaved", "blocked"), default="interleaved")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()

    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    groups = [("64MB", group_shapes(64 << 20))]
    if args.sizes == "all":
        groups.append(("1GB", group_shapes(1 << 30)))
    dtype_cases = [
        ("fp32->bf16", torch.bfloat16, torch.bfloat16),  # main row: bf16 params and reduce dtype
        ("fp32", torch.float32, torch.float32),  # same dtype: no cast anywhere
    ]
    rows: list[dict] = []
    print(
        f"torch threads={torch.get_num_threads()} numba threads={nk.cpu.num_threads()}  ws={args.world_size}  "
        f"schedule={args.schedule}"
    )
    for device in devices:
        for gname, shapes in groups:
            for dname, pdt, rdt in dtype_cases:
                label = f"{gname} {dname}"
                reps = args.reps if gname == "64MB" else max(3, args.reps // 3)
                new = bench_group(shapes, args.world_size, device, pdt, rdt, reps, label, args.schedule == "blocked")
                rows.extend(new)
                by = {(r["op"], r["impl"]): r for r in new}
                for op in OPS:
                    o, t, c = by[(op, "ours")], by[(op, "torch")], by[(op, "copy")]
                    print(
                        f"{device:4s} {label:15s} {op:23s} MB={o['bytes'] / 1e6:8.1f} "
                        f"ours={o['gbps']:6.2f} torch={t['gbps']:6.2f} copy={c['gbps']:6.2f} GB/s  "
                        f"ours/torch={t['seconds'] / o['seconds']:5.2f}x ours/copy={c['seconds'] / o['seconds']:4.2f}x",
                        flush=True,
                    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
