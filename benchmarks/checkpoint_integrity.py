"""Cost of checkpoint checksums: ``save`` / ``load`` with and without them, side by side in one run.

The same ``lightning_shard.checkpoint.save`` / ``load`` run in several modes, interleaved round by round (the
order alternating) so that machine noise hits all alike; the ratio to ``none`` is taken within each round and
the median over rounds reported, with the min and max:

* ``none``: hashing switched off (the planner's and the reader's digest replaced by a constant), everything
  else identical -- the baseline;
* ``xxh3_64``: the default (XXH3-64, hashed on a background thread beside the writer);
* ``xxh3_64_inline``: XXH3-64 hashed in the writer's thread, before each entry is written (no overlap);
* ``crc32``: zlib's CRC-32 (the fallback when ``xxhash`` is missing), on the background thread;
* ``torch_zip_crc``: no hashing, and torch's zip writer computing its per-record CRC-32 as ``torch.save``
  does by default (``save`` turns it off: torch never checks it, the marker's digests are the check).

Each save is timed in wall time and in the process's CPU time (every thread: the background hashing counts
in full there even when it overlaps the writer).

One process, no process group; the state is ``--tensors`` fp32 tensors of ``--mib`` MiB each (a model and its
optimizer state look the same to the writer). Prints the load average before and after.

Example::

    python benchmarks/checkpoint_integrity.py --dir bench-ckpt --tensors 16 --mib 16 --repeats 15
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import time
import warnings

import torch

import lightning_shard.checkpoint.save_load as save_load
from lightning_shard.checkpoint import _integrity, load, save

# save: wall time; save_cpu: CPU time of the process (all threads: the hashing thread's work counts even when
# it overlaps the writer), steadier than wall time on a busy machine; load: wall time
_KINDS = ("save", "save_cpu", "load")
_MODES = ("none", "xxh3_64", "xxh3_64_inline", "crc32", "torch_zip_crc")
_ZIP_CRC_OFF = save_load._without_zip_crc32
_INLINE = _integrity.BackgroundHasher.INLINE_BYTES


def _set_mode(mode: str) -> None:
    """Make ``save`` hash as ``mode`` says; ``load`` follows the algorithm the marker names."""
    _integrity.ALGORITHMS["none"] = lambda buf: "0"
    algorithm = {"xxh3_64_inline": "xxh3_64", "torch_zip_crc": "none"}.get(mode, mode)
    _integrity.DEFAULT_ALGORITHM = algorithm
    save_load.DEFAULT_ALGORITHM = algorithm
    _integrity.BackgroundHasher.INLINE_BYTES = 1 << 62 if mode == "xxh3_64_inline" else _INLINE
    save_load._without_zip_crc32 = contextlib.nullcontext if mode == "torch_zip_crc" else _ZIP_CRC_OFF


def _state(n: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    numel = mib * 2**20 // 4
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}, "step": 1}


def _run(args, modes) -> dict[str, dict[str, list[float]]]:
    state = _state(args.tensors, args.mib)
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": 0}
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in _KINDS} for m in modes}
    for r in range(args.repeats + 1):  # the first round warms caches and is dropped
        for mode in modes if r % 2 == 0 else reversed(modes):
            _set_mode(mode)
            path = os.path.join(args.dir, f"ckpt-{mode}")
            t0, c0 = time.perf_counter(), time.process_time()
            save(state, path)
            t1, c1 = time.perf_counter(), time.process_time()
            if not args.no_load:
                load(target, path)
                assert torch.equal(target["model"]["w0"], state["model"]["w0"])
            t2 = time.perf_counter()
            shutil.rmtree(path)  # every save writes into an empty directory, as a first save would
            if r:
                times[mode]["save"].append(t1 - t0)
                times[mode]["save_cpu"].append(c1 - c0)
                times[mode]["load"].append(t2 - t1)
    return times


def _hash_alone(state_tensors, repeats: int) -> dict[str, float]:
    out = {}
    for mode in ("xxh3_64", "crc32"):
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for t in state_tensors:
                _integrity.digest(t, mode)
            runs.append(time.perf_counter() - t0)
        out[mode] = statistics.median(runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="bench-ckpt", help="where to write (a real filesystem: fsync counts)")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--modes", default=",".join(_MODES), help=f"comma-separated, from {_MODES}")
    parser.add_argument("--no-load", action="store_true", help="time saves only")
    args = parser.parse_args()
    modes = tuple(args.modes.split(","))
    assert modes[0] == "none" and set(modes) <= set(_MODES), modes
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.makedirs(args.dir, exist_ok=True)
    load_before = os.getloadavg()
    times = _run(args, modes)
    load_after = os.getloadavg()
    hash_s = _hash_alone(list(_state(args.tensors, args.mib)["model"].values()), args.repeats)
    total = args.tensors * args.mib
    print(f"{args.tensors} x {args.mib} MiB fp32 ({total} MiB) in {args.dir}, {args.repeats} rounds")
    print(
        f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f}"
    )
    kinds = _KINDS[:2] if args.no_load else _KINDS
    base = {k: times["none"][k] for k in kinds}
    for mode in modes:
        cells = []
        for kind in kinds:
            runs = times[mode][kind]
            ratios = sorted(t / b for t, b in zip(runs, base[kind]))
            cells.append(
                f"{kind} {statistics.median(runs):.3f} s, ratio to none: median {statistics.median(ratios):.3f}x "
                f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f})"
            )
        print(f"  {mode:15s} " + " | ".join(cells))
    if {"xxh3_64", "torch_zip_crc"} <= set(modes):  # the default save against torch's default writer, unhashed
        for kind in kinds:
            ratios = sorted(a / b for a, b in zip(times["xxh3_64"][kind], times["torch_zip_crc"][kind]))
            print(
                f"  xxh3_64 / torch_zip_crc, {kind}: median {statistics.median(ratios):.3f}x "
                f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f})"
            )
    save_none = statistics.median(base["save"])
    for mode, s in hash_s.items():
        print(f"  hashing alone, {mode}: {s:.4f} s = {s / save_none:.1%} of the median save without checksums")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
