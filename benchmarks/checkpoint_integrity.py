"""Cost of checkpoint checksums: ``save`` / ``load`` with and without them, side by side in one run.

The same ``lightning_shard.checkpoint.save`` / ``load`` run three ways, interleaved repeat by repeat so that
machine noise hits all alike: with the default checksum (XXH3-64), with zlib's CRC-32 (the fallback when
``xxhash`` is missing), and with hashing switched off (the planner's and the reader's digest replaced by a
no-op; everything else identical). One process, no process group; the state is ``--tensors`` fp32 tensors
of ``--mib`` MiB each (a model and its optimizer state look the same to the writer).

Example::

    python benchmarks/checkpoint_integrity.py --dir bench-ckpt --tensors 16 --mib 16 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings

import torch

from lightning_shard.checkpoint import _integrity, load, save

_MODES = ("none", "crc32", "xxh3_64")


def _set_mode(mode: str) -> None:
    """Make ``save`` hash with ``mode`` ("none": a constant, no hashing at all); ``load`` follows the marker."""
    if mode == "none":
        _integrity.ALGORITHMS["none"] = lambda buf: "0"
    _integrity.DEFAULT_ALGORITHM = mode
    import lightning_shard.checkpoint.save_load as save_load

    save_load.DEFAULT_ALGORITHM = mode


def _state(n: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    numel = mib * 2**20 // 4
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}, "step": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="bench-ckpt", help="where to write (a real filesystem: fsync counts)")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    state = _state(args.tensors, args.mib)
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": 0}
    os.makedirs(args.dir, exist_ok=True)
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in _MODES}
    for r in range(args.repeats + 1):  # the first round warms caches and is dropped
        for mode in _MODES if r % 2 == 0 else reversed(_MODES):
            _set_mode(mode)
            path = os.path.join(args.dir, f"ckpt-{mode}")
            t0 = time.perf_counter()
            save(state, path)
            t1 = time.perf_counter()
            load(target, path)
            t2 = time.perf_counter()
            assert torch.equal(target["model"]["w0"], state["model"]["w0"])
            if r:
                times[mode]["save"].append(t1 - t0)
                times[mode]["load"].append(t2 - t1)
    hash_s = {}
    for mode in _MODES[1:]:  # the hashing alone, on the same tensors: the part of the difference that is CPU
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for t in state["model"].values():
                _integrity.digest(t, mode)
            runs.append(time.perf_counter() - t0)
        hash_s[mode] = statistics.median(runs)
    total = args.tensors * args.mib
    print(f"{args.tensors} x {args.mib} MiB fp32 ({total} MiB) in {args.dir}, median of {args.repeats} repeats")
    base = {k: statistics.median(times["none"][k]) for k in ("save", "load")}
    for mode in _MODES:
        cells = []
        for kind in ("save", "load"):
            med = statistics.median(times[mode][kind])
            cells.append(f"{kind} {med:.3f} s ({med / base[kind]:.3f}x)")
        if mode in hash_s:
            cells.append(f"hashing alone {hash_s[mode]:.3f} s = {hash_s[mode] / base['save']:.1%} of the save")
        print(f"  {mode:8s} " + "   ".join(cells))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
