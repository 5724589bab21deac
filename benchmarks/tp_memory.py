"""Memory per phase of a tensor-parallel step: ours (``lightning_shard.tp``) vs torch's ``parallelize_module``,
same model, same plan (``tp_step.py``'s), same batch.

Each variant runs in its own pair of fresh gloo processes (one warm-up step on a throwaway model first, so that
one-time loading is not counted), with ``MALLOC_MMAP_THRESHOLD_=131072``: every allocation above 128 KiB is
its own mapping, returned to the system when freed, so the resident set follows the live tensors (freed heap
memory that glibc keeps otherwise makes RSS depend on the allocation pattern; docs/benchmarks.md). At each
phase boundary the process reads its RSS and its peak RSS since the previous boundary (then resets the peak,
``/proc/self/clear_refs``), relative to a mark taken just before the model is built. Phases:

- ``setup``: build the model, ``parallelize_module`` (with ``--fsdp`` then ``fully_shard`` per block and on
  the root over a one-rank data-parallel mesh, as the Trainer strategies do at dp 1), the AdamW optimizer;
- ``forward``: logits and the loss (``F.cross_entropy`` on the gathered logits);
- ``backward``: ``loss.backward()``;
- ``optimizer``: ``opt.step()`` and ``opt.zero_grad()``;

for ``--steps`` steps (AdamW's state appears at the first ``step``). Figures are rank 0's, MiB, with the
ratio ours / torch of each phase's peak; ``--repeats`` alternates the variants and prints every run.

``--top N`` instead runs each variant once under torch's profiler (``profile_memory=True``) and lists the N
largest storages alive at each variant's peak (and at the peak and end of the phases named by ``--at``) with
the ops that allocated them: a diagnostic, not a measure (frees made on gloo's threads are not seen by the
profiler, so its running total drifts upward over steps).

    python benchmarks/tp_memory.py --repeats 3                    # the Trainer benchmark's GPT, TP 2, 2 steps
    python benchmarks/tp_memory.py --fsdp --repeats 3             # + fully_shard on a (1, 2) mesh
    python benchmarks/tp_memory.py --top 12 --at forward:1        # where the bytes are
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lightning_shard, tests.hf_models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tp_step, fsdp_vs_torch

from tp_step import _called_positionally, _full, build_model, gpt_plan, to_torch_style  # noqa: E402

VARIANTS = ("ours", "torch")
MMAP_THRESHOLD = "131072"
PHASES = ("setup", "forward", "backward", "optimizer")
MIB = 2**20


def _meshes(variant: str, tp: int, fsdp: bool):
    """The TP mesh and (with ``fsdp``) the one-rank data-parallel mesh, both sub-meshes of one root mesh."""
    if variant == "ours":
        from lightning_shard import init_device_mesh
    else:
        from torch.distributed.device_mesh import init_device_mesh
    if not fsdp:
        return init_device_mesh("cpu", (tp,), mesh_dim_names=("tensor_parallel",)), None
    root = init_device_mesh("cpu", (1, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    return root["tensor_parallel"], root["data_parallel"]


def _parallelize(variant: str, model, args, logits_of, ids):
    """``tp_step.py``'s plan on both sides; with ``--fsdp`` then ``fully_shard`` per block and on the root over a
    one-rank data-parallel mesh (what ``ShardFSDPTPStrategy(tensor_parallel_size=2)`` and
    ``ModelParallelStrategy(1, 2)`` do on 2 devices)."""
    from lightning_shard.tp import auto_tp_plan

    tp_mesh, dp_mesh = _meshes(variant, args.tp, args.fsdp)
    plan = auto_tp_plan(model, args.tp) if hasattr(model, "config") else gpt_plan(model, args.tp)
    if variant == "ours":
        from lightning_shard.fsdp import fully_shard
        from lightning_shard.tp import parallelize_module

        parallelize_module(model, tp_mesh, plan)
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        positional = _called_positionally(model, logits_of, ids, list(plan))
        for key, entry in plan.items():
            for style in entry if isinstance(entry, tuple) else (entry,):
                parallelize_module(model, tp_mesh, {key: to_torch_style(style, positional.get(key, True))})
    if dp_mesh is not None:
        blocks = model.model.layers if hasattr(model, "config") else model.blocks
        for block in blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def _mark() -> tuple[float, float]:
    """(RSS now, peak RSS since the previous mark) in MiB; resets the peak."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rss, hwm = (float(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))
    Path("/proc/self/clear_refs").write_text("5")
    return rss, hwm


def _measure(variant: str, args, ids: torch.Tensor) -> dict:
    """One variant: setup and ``args.steps`` steps, RSS and peak RSS per phase relative to the start."""
    gc.collect()
    dist.barrier()
    base, _ = _mark()
    out = {}

    def mark(name: str) -> None:
        rss, peak = _mark()
        out[name] = {"end_mib": rss - base, "peak_mib": peak - base}

    model, logits_of = build_model(args)
    model = _parallelize(variant, model, args, logits_of, ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mark("setup")
    for step in range(args.steps):
        loss = F.cross_entropy(_full(logits_of(model, ids)).flatten(0, 1).float(), ids.flatten())
        mark(f"forward:{step}")
        loss.backward()
        mark(f"backward:{step}")
        opt.step()
        opt.zero_grad()
        mark(f"optimizer:{step}")
        del loss
    return out


def _profile(variant: str, args, ids: torch.Tensor) -> dict:
    """One variant under the profiler (``--top``): setup, then ``args.steps`` steps, each phase in a
    ``record_function``; returns the largest storages alive at the peaks."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("phase:setup"):
            model, logits_of = build_model(args)
            model = _parallelize(variant, model, args, logits_of, ids)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(args.steps):
            with record_function(f"phase:forward:{step}"):
                loss = F.cross_entropy(_full(logits_of(model, ids)).flatten(0, 1).float(), ids.flatten())
            with record_function(f"phase:backward:{step}"):
                loss.backward()
            with record_function(f"phase:optimizer:{step}"):
                opt.step()
                opt.zero_grad()
            del loss
    return _account(prof, args.top, tuple(args.at))


def _account(prof, top: int, at: tuple = ()) -> dict:
    """Live bytes at the end of each phase and the peak inside it, from the profiler's allocation events."""
    allocs: list[tuple] = []  # (time, bytes (negative: a free), address, ops around it, outermost first)
    phases: list[tuple] = []  # (start, end, name)

    def walk(node, path: tuple) -> None:
        tag = str(node.typed[0])
        if tag.endswith("Allocation"):
            fields = node.typed[1]
            if fields.device.type == "cpu":
                allocs.append((node.start_time_ns, fields.alloc_size, fields.ptr, path))
            return
        name = node.name
        if name.startswith("phase:"):
            phases.append((node.start_time_ns, node.end_time_ns, name[len("phase:") :]))
            path = ()
        else:
            path = (*path, name)
        for child in node.children:
            walk(child, path)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, ())
    allocs.sort(key=lambda a: a[0])
    phases.sort()
    live, out, i = 0, {}, 0
    peak_live, peak_at = -1, 0
    for _start, end, name in phases:
        peak, phase_peak_at = live, i
        while i < len(allocs) and allocs[i][0] <= end:
            live += allocs[i][1]
            if live > peak:
                peak, phase_peak_at = live, i + 1
            if live > peak_live:
                peak_live, peak_at = live, i + 1
            i += 1
        out[name] = {"end_mib": live / MIB, "peak_mib": peak / MIB}
        if top and name in at:
            out[f"_top_peak:{name}"] = _largest_live(allocs[:phase_peak_at], top)
            out[f"_top_end:{name}"] = _largest_live(allocs[:i], top)
    if top:
        out["_top"] = _largest_live(allocs[:peak_at], top)
    return out


def _largest_live(allocs: list, top: int) -> list:
    """The ``top`` largest allocations alive after the last event of ``allocs`` (matched to frees by address),
    each with the outermost and innermost ops around it."""
    alive: dict[int, tuple] = {}
    for _, nbytes, ptr, path in allocs:
        if nbytes > 0:
            alive[ptr] = (nbytes, path)
        else:
            alive.pop(ptr, None)
    rows = []
    for nbytes, path in sorted(alive.values(), key=lambda x: -x[0])[:top]:
        where = " > ".join(path[:2]) + (f" ... {path[-1]}" if len(path) > 2 else "")
        rows.append((nbytes / MIB, where or "(outside any op)"))
    return rows


def worker(rank: int, world: int, port: int, variant: str, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    vocab = 128 if args.model == "hf-llama" else args.vocab
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    _measure(variant, argparse.Namespace(**{**vars(args), "steps": 1}), ids)  # one-time loading, not counted
    result = _profile(variant, args, ids) if args.top else _measure(variant, args, ids)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _spawn(variant: str, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/tp_memory.{os.getpid()}.{variant}.json"
    mp.spawn(worker, args=(args.tp, port, variant, args, out), nprocs=args.tp, join=True)
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["hf-llama", "gpt"], default="gpt")
    p.add_argument("--tp", type=int, default=2, help="TP size = number of gloo ranks")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192, help="gpt only")
    p.add_argument("--dim", type=int, default=256, help="gpt only")
    p.add_argument("--layers", type=int, default=4, help="gpt only")
    p.add_argument("--heads", type=int, default=4, help="gpt only")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternating (the order flips)")
    p.add_argument("--fsdp", action="store_true", help="also fully_shard on a one-rank data-parallel mesh")
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's mmap threshold alone (RSS then "
                   "includes freed memory the allocator keeps)")  # fmt: skip
    p.add_argument("--top", type=int, default=0, help="profiler diagnostic: the N largest storages at the peaks")
    p.add_argument("--at", nargs="*", default=[], help="with --top: also at the peak and end of these phases")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    if not args.default_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by glibc in the spawned processes
    if args.top:
        for v in VARIANTS:
            for key, rows in _spawn(v, args).items():
                if key.startswith("_top"):
                    kind, _, phase = key[len("_top_") :].partition(":")
                    where = "its peak" if key == "_top" else f"the {kind} of {phase}"
                    print(f"\n{v}: largest storages alive at {where} (torch profiler)")
                    for mib, op in rows:
                        print(f"  {mib:8.2f} MiB  {op}")
        return
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    load = [os.getloadavg()[0]]
    for rep in range(args.repeats):
        for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            runs[v].append(_spawn(v, args))
        load.append(os.getloadavg()[0])
    what = f"model {args.model}, TP {args.tp}{' + fully_shard (dp 1)' if args.fsdp else ''}"
    malloc = "default malloc" if args.default_malloc else f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
    print(f"{what}, rank 0, {malloc}, MiB above the start; median of {args.repeats} run(s), every run's peak")
    print("| phase | ours end | torch end | ours peak | torch peak | peak ours / torch | ours peaks | torch peaks |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    med = statistics.median
    for name in runs["ours"][0]:
        a = {k: med(r[name][k] for r in runs["ours"]) for k in ("end_mib", "peak_mib")}
        b = {k: med(r[name][k] for r in runs["torch"]) for k in ("end_mib", "peak_mib")}
        ratio = a["peak_mib"] / b["peak_mib"] if b["peak_mib"] else float("nan")
        every = [", ".join(f"{r[name]['peak_mib']:.1f}" for r in runs[v]) for v in VARIANTS]
        print(
            f"| {name} | {a['end_mib']:.1f} | {b['end_mib']:.1f} | {a['peak_mib']:.1f} | {b['peak_mib']:.1f} "
            f"| {ratio:.3f} | {every[0]} | {every[1]} |"
        )
    whole = {v: [max(x["peak_mib"] for x in r.values()) for r in runs[v]] for v in VARIANTS}
    print(
        f"whole run peak: ours {med(whole['ours']):.1f} MiB ({', '.join(f'{x:.1f}' for x in whole['ours'])}), torch "
        f"{med(whole['torch']):.1f} MiB ({', '.join(f'{x:.1f}' for x in whole['torch'])}): "
        f"{med(whole['ours']) / med(whole['torch']):.3f}x; load average {', '.join(f'{x:.1f}' for x in load)}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "load": load, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
