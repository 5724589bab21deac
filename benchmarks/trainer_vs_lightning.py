"""The same LightningModule through three Trainer strategies, in one run: ours ("shard_fsdp_tp"), Lightning's
``ModelParallelStrategy`` (hand-written torch FSDP2 ``fully_shard`` per block + root in ``configure_model``,
TP only when ``--tp > 1``) and DDP.

Reports the median step time (a callback times ``on_train_batch_start`` .. ``on_train_batch_end``, i.e.
forward, backward and optimizer step, after ``--warmup`` steps) and the peak memory per rank (CPU: growth of
the process's peak RSS from just before the model is built in ``configure_model``; CUDA:
``torch.cuda.max_memory_allocated``), as ratios ours / other. ``process_peak_mb`` is the whole process's peak
RSS (libraries, Lightning and everything loaded before the model included). Each repeat also prints the
step's CPU time (the rank's CPU time over the same interval, all its threads, gloo's included: it moves less
with the machine's load than the wall time; ``step_cpu_s_runs`` in the JSON).

    python benchmarks/trainer_vs_lightning.py --devices 2 --repeats 3 --json results.json

Each variant runs as its own ``python benchmarks/trainer_vs_lightning.py --variant NAME --out FILE``
subprocess, in which Lightning's own launcher starts the other ranks, so no state is shared between variants.
Variants are interleaved (the order rotates each repeat) so that load from other processes on the machine
hits them alike; the reported figure per variant is the median over repeats of the slowest rank's median.

``--json`` writes ``{"ours": {...}, "model_parallel": {...}, "ddp": {...}}`` with ``step_s``, ``peak_mb`` and
``process_peak_mb`` each (plus the per-repeat values, and rank 0's training loss per step of the first repeat:
the run prints the largest relative difference between ours and each other variant, so a baseline that trains
a different model shows).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the GPT of fsdp_vs_torch.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # strategies, lightning_shard

VARIANTS = ("ours", "model_parallel", "ddp")


_HWM_MAX = [0.0]  # --phases resets the kernel's peak-RSS mark at every phase boundary; this keeps the real peak


def _peak_rss_mb() -> float:
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, _HWM_MAX[0])


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _memory_mark() -> dict:
    """This process's RSS now, its peak RSS since the previous mark (then reset: ``/proc/self/clear_refs``), and
    glibc's malloc counters (``mallinfo2``): bytes in use (heap chunks + mmapped chunks), mmapped, heap free
    (freed but kept by the allocator), heap size. MB."""
    status = Path("/proc/self/status").read_text()
    field = {
        k: float(v.split()[0]) / 1024
        for k, v in (line.split(":", 1) for line in status.splitlines())
        if k in ("VmRSS", "VmHWM")
    }
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    _HWM_MAX[0] = max(_HWM_MAX[0], field["VmHWM"])
    Path("/proc/self/clear_refs").write_text("5")
    mb = 2**20
    return {
        "rss": field["VmRSS"],
        "peak": field["VmHWM"],
        "malloc_in_use": (mi.uordblks + mi.hblkhd) / mb,
        "mmapped": mi.hblkhd / mb,
        "heap_free": mi.fordblks / mb,
        "heap": mi.arena / mb,
    }


def _build_module(args):
    import lightning as L
    import torch
    import torch.nn.functional as F
    from fsdp_vs_torch import GPT
    from torch.utils.data import DataLoader, TensorDataset

    class BenchGPT(L.LightningModule):
        """A GPT of a few M parameters; built in configure_model so every strategy builds it at the same point."""

        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.base_rss = 0.0

        def configure_model(self) -> None:
            if self.model is not None:
                return
            if args.accelerator == "cuda":
                torch.cuda.reset_peak_memory_stats()
            self.base_rss = _peak_rss_mb()
            if args.phases:
                self.phase_marks = [("before model", -1, _memory_mark())]
            torch.manual_seed(0)
            self.model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
            if args.variant == "model_parallel":
                _torch_parallelize(self.model, self.device_mesh, args.tp)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            logits = self.model(x)
            return F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            n = (args.steps + args.warmup) * args.batch * args.devices
            g = torch.Generator().manual_seed(1)
            return DataLoader(TensorDataset(torch.randint(0, args.vocab, (n, args.seq), generator=g)), args.batch)

    return BenchGPT()


def _torch_parallelize(model, mesh, tp: int) -> None:
    """What a ModelParallelStrategy user writes: TP (if any) on the TP sub-mesh, then FSDP2 per block + root.

    Under TP each rank computes ``heads / tp`` whole heads, as our auto plan does. The fused ``qkv`` projection
    needs two changes for that with torch's styles: its output rows are regrouped so that ColwiseParallel's
    chunk ``r`` holds the q, k and v rows of heads ``r * heads / tp ..`` (the same function: the rows are only
    reordered), and the block's forward takes its widths from the local ``qkv`` output instead of the full
    hidden size of its input."""
    from torch.distributed.fsdp import fully_shard

    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in model.blocks:
            if block.heads % tp:
                raise SystemExit(f"--heads {block.heads} must divide by --tp {tp}")
            _group_qkv_rows_per_rank(block.qkv, tp)
            block.forward = types.MethodType(_local_heads_forward, block)
            parallelize_module(
                block,
                mesh["tensor_parallel"],
                {
                    "qkv": ColwiseParallel(),
                    "proj": RowwiseParallel(),
                    "up": ColwiseParallel(),
                    "down": RowwiseParallel(),
                },
            )
            block.heads //= tp
    dp_mesh = mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def _group_qkv_rows_per_rank(qkv, tp: int) -> None:
    """Reorder the ``[q | k | v]`` output rows of the fused projection into ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ..]``
    (``x_r``: rank ``r``'s contiguous share of the heads), so that an even split by rows gives each rank its
    own heads' q, k and v."""
    import torch

    d = qkv.out_features // 3
    order = torch.arange(3 * d).view(3, tp, d // tp).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        qkv.weight.copy_(qkv.weight[order])
        if qkv.bias is not None:
            qkv.bias.copy_(qkv.bias[order])


def _local_heads_forward(self, x):
    """``fsdp_vs_torch.Block.forward`` with the attention width of this rank (``3 * width`` = the local
    ``qkv`` output) in place of the input's hidden size; ``self.heads`` is this rank's head count."""
    import torch.nn.functional as F

    b, s, _ = x.shape
    qkv = self.qkv(self.norm1(x))
    width = qkv.shape[-1] // 3
    q, k, v = qkv.view(b, s, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.proj(att.transpose(1, 2).reshape(b, s, width))
    return x + self.down(F.gelu(self.up(self.norm2(x))))


def _callback(args, out: str):
    import lightning as L
    import torch

    class Timer(L.Callback):
        def _mark(self, pl_module, phase: str, step: int) -> None:
            if args.phases:
                pl_module.phase_marks.append((phase, step, _memory_mark()))

        def on_train_start(self, trainer, pl_module):
            self._mark(pl_module, "setup", -1)

        def on_before_backward(self, trainer, pl_module, loss):
            self._mark(pl_module, "forward", trainer.global_step)

        def on_after_backward(self, trainer, pl_module):
            self._mark(pl_module, "backward", trainer.global_step)

        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.cpu_times: list[float] = []  # this rank's CPU time, all its threads (gloo's too)
            self._t0 = self._c0 = 0.0

        def _sync(self):
            if args.accelerator == "cuda":
                torch.cuda.synchronize()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._mark(pl_module, "between steps", trainer.global_step - 1)
            self._sync()
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._mark(pl_module, "optimizer", trainer.global_step - 1)
            self._sync()
            self.times.append(time.perf_counter() - self._t0)
            self.cpu_times.append(time.process_time() - self._c0)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss.detach().float().cpu()))

        def on_train_end(self, trainer, pl_module):
            cuda = pl_module.device.type == "cuda"
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _peak_rss_mb() - pl_module.base_rss
            step = statistics.median(self.times[args.warmup :])
            cpu = statistics.median(self.cpu_times[args.warmup :])
            mine = torch.tensor([step, peak, _peak_rss_mb(), cpu], dtype=torch.float64, device=pl_module.device)
            # Every rank's figures, TP ranks included (our strategy's all_gather keeps one per data-parallel replica).
            every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(every, mine)
            every = torch.stack(every).cpu()
            if trainer.global_rank == 0:
                result = {
                    "step_s": float(every[:, 0].max()),
                    "peak_mb": float(every[:, 1].max()),
                    "process_peak_mb": float(every[:, 2].max()),
                    "step_cpu_s": float(every[:, 3].max()),
                    "per_rank": every.tolist(),
                    "steps_timed": len(self.times) - args.warmup,
                    "losses": self.losses,  # rank 0's training loss per step, to check the variants agree
                }
                if args.phases:
                    result["phase_marks"] = pl_module.phase_marks
                Path(out).write_text(json.dumps(result))

    return Timer()


def run_variant(args) -> None:
    """One Trainer run (this process is rank 0; Lightning's launcher starts the others)."""
    import lightning as L
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.devices))
    if args.variant == "ours":
        from strategies import ShardFSDPTPStrategy

        strategy = ShardFSDPTPStrategy(tensor_parallel_size=args.tp, loss_parallel=args.loss_parallel)
    elif args.variant == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices // args.tp, tensor_parallel_size=args.tp)
    else:
        strategy = "ddp"
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps + args.warmup,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[_callback(args, args.out)],
    )
    trainer.fit(_build_module(args))


def _variant_cmd(args, variant: str, out: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--out", out]
    for name in ("devices", "tp", "steps", "warmup", "batch", "seq", "vocab", "dim", "layers", "heads"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return (
        cmd
        + ["--accelerator", args.accelerator, "--precision", args.precision]
        + (["--phases"] if args.phases else [])
        + (["--loss-parallel"] if args.loss_parallel else [])
    )


def main_compare(args) -> dict:
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = args.variants[rep % len(args.variants) :] + args.variants[: rep % len(args.variants)]
            for variant in order:
                out = os.path.join(tmp, f"{variant}.{rep}.json")
                t0 = time.time()
                env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
                proc = subprocess.run(_variant_cmd(args, variant, out), capture_output=True, text=True, env=env)
                if not os.path.exists(out):
                    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
                    raise SystemExit(f"variant {variant} failed (exit code {proc.returncode})")
                if proc.returncode != 0:
                    # The result was written at the end of training; seen with ModelParallelStrategy: a crash at
                    # interpreter exit ("terminate called without an active exception").
                    print(f"note: variant {variant} exited with code {proc.returncode} after writing its result")
                r = json.loads(Path(out).read_text())
                runs[variant].append(r)
                print(
                    f"repeat {rep} {variant:15s} step {r['step_s'] * 1e3:8.1f} ms  "
                    f"CPU {r['step_cpu_s'] * 1e3:8.1f} ms  peak {r['peak_mb']:8.1f} MB  "
                    f"process peak {r['process_peak_mb']:8.1f} MB  "
                    f"(wall {time.time() - t0:.0f}s, load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    results = {
        v: {
            "step_s": statistics.median(r["step_s"] for r in rs),
            "peak_mb": statistics.median(r["peak_mb"] for r in rs),
            "process_peak_mb": statistics.median(r["process_peak_mb"] for r in rs),
            "step_s_runs": [r["step_s"] for r in rs],
            "step_cpu_s_runs": [r["step_cpu_s"] for r in rs],
            "peak_mb_runs": [r["peak_mb"] for r in rs],
            "losses": rs[0].get("losses"),
            "phase_marks_runs": [r.get("phase_marks") for r in rs],  # --phases: rank 0's, per repeat
        }
        for v, rs in runs.items()
    }
    print(
        f"\n| variant | step (ms), median of {args.repeats} | peak MB/rank | process peak MB/rank "
        "| step ms per repeat | peak MB per repeat |"
    )
    print("|---|---:|---:|---:|---|---|")
    for v, r in results.items():
        per = ", ".join(f"{s * 1e3:.0f}" for s in r["step_s_runs"])
        mem = ", ".join(f"{m:.0f}" for m in r["peak_mb_runs"])
        print(f"| {v} | {r['step_s'] * 1e3:.1f} | {r['peak_mb']:.1f} | {r['process_peak_mb']:.1f} | {per} | {mem} |")
    if args.phases:
        _print_phases(runs)
    if "ours" in results:
        for other in ("model_parallel", "ddp"):
            if other in results and runs["ours"][0].get("losses") and runs[other][0].get("losses"):
                a, b = runs["ours"][0]["losses"], runs[other][0]["losses"]
                diff = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
                print(f"loss per step, ours vs {other} (repeat 0): largest relative difference {diff:.2e}; "
                      f"ours {[round(x, 5) for x in a[:5]]}, {other} {[round(y, 5) for y in b[:5]]}")  # fmt: skip
        for other in ("model_parallel", "ddp"):
            if other in results:
                keys = ("step_s", "peak_mb", "process_peak_mb")
                ratio = {k: results["ours"][k] / results[other][k] for k in keys if results[other][k]}
                print(f"ours / {other}: " + ", ".join(f"{k} {v:.3f}x" for k, v in ratio.items()))
    return results


def _print_phases(runs: dict) -> None:
    """Rank 0's memory at each phase boundary of the first repeat (``--phases``): MB above the mark taken just
    before the model is built, for the setup, the first two steps and the last."""
    for variant, rs in runs.items():
        marks = rs[0].get("phase_marks")
        if not marks:
            continue
        base = marks[0][2]
        last = max(step for _, step, _ in marks)
        print(
            f"\n{variant} (rank 0, repeat 0): MB above the mark before the model is built (RSS then "
            f"{base['rss']:.1f} MB, malloc in use {base['malloc_in_use']:.1f} MB)"
        )
        print("| step | phase | peak RSS in phase | RSS at end | malloc in use | of which mmapped | heap free (kept) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for phase, step, m in marks[1:]:
            if step in (-1, 0, 1, last):
                print(
                    f"| {step if step >= 0 else '-'} | {phase} | {m['peak'] - base['rss']:.1f} "
                    f"| {m['rss'] - base['rss']:.1f} "
                    f"| {m['malloc_in_use'] - base['malloc_in_use']:.1f} | {m['mmapped'] - base['mmapped']:.1f} "
                    f"| {m['heap_free'] - base['heap_free']:.1f} |"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (1 on CPU: data_parallel_size=devices)")
    p.add_argument(
        "--loss-parallel", action="store_true", help="ours with loss_parallel=True (the LM head's logits not gathered)"
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="32-true")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every variant")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--json", type=str, default=None)
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set for every variant, e.g. NUMBA_NUM_THREADS=1",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="record rank 0's RSS, peak RSS and malloc counters at each phase boundary (CPU, Linux, glibc)",
    )
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one Trainer run
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        run_variant(args)
        return
    results = main_compare(args)
    for r in results.values():
        r.update(env=args.env, devices=args.devices, tp=args.tp)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
