"""Where an FSDP step's time goes: forward, backward and optimizer time, and inside them, for ours, the time
spent waiting on all-gathers (forward / backward) and reduce-scatters, in the staging kernels, and populating
fresh buffer pages. Same GPT and wrapping as ``benchmarks/fsdp_vs_torch.py``; rank 0's median per step.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/fsdp_phases.py ours          # or torch_fsdp2, ddp, local
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/fsdp_phases.py ours --steps 6

The timers wrap our functions (``CollectiveHandle.wait``, the kernels, ``buffers.populate_pages``) with
``time.perf_counter``; the other variants report only forward / backward / optimizer. ``process CPU time``
is the rank's CPU time over the step, all its threads (compute, gloo's, numba's) together.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.fsdp_vs_torch import GPT, _setup  # noqa: E402

_ACC: dict[str, float] = collections.defaultdict(float)
_PHASE = ["forward"]


def _timed(owner, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _ACC[key] += time.perf_counter() - t

    setattr(owner, name, wrapped)


def _instrument_ours() -> None:
    from lightning_shard.fsdp import buffers, collectives

    wait = collectives.CollectiveHandle.wait

    def timed_wait(self):
        t = time.perf_counter()
        try:
            return wait(self)
        finally:
            kind = "all_gather" if self.layout is not None else "reduce_scatter"
            _ACC[f"wait {kind} ({_PHASE[0]})"] += time.perf_counter() - t

    collectives.CollectiveHandle.wait = timed_wait
    for name in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "post_reduce"):
        _timed(collectives, name, f"kernel {name}")
    _timed(buffers, "populate_pages", "populate pages")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", choices=["ours", "torch_fsdp2", "ddp", "local"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.variant == "ours":
        _instrument_ours()
    torch.manual_seed(0)
    model, _ = _setup(args.variant, GPT(8192, 512, 6, 8, 128), dist.get_world_size(), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(args.steps + args.warmup):
        x = torch.randint(0, 8192, (4, 128), generator=g)
        _ACC.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        t1 = time.perf_counter()
        _PHASE[0] = "backward"
        loss.backward()
        _PHASE[0] = "forward"
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3, c3 = time.perf_counter(), time.process_time()
        if step >= args.warmup:
            times = {"step": t3 - t0, "process CPU time (all threads)": c3 - c0}
            rows.append({**times, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, **_ACC})
    if rank == 0:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        load = os.getloadavg()[0]
        print(f"{args.variant} (load average {load:.1f}), median ms per step:")
        for k in keys:
            print(f"  {k:40s} {statistics.median(r.get(k, 0.0) for r in rows) * 1e3:8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
