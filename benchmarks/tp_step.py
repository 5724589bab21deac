"""Tensor-parallel training step: ours (``lightning_shard.tp``) vs torch's ``parallelize_module``, same plan.

Both libraries shard the same model with the same plan on the same TP mesh: ours gets ``auto_tp_plan(model)``
(what the ``shard_fsdp_tp`` strategy applies), torch gets that plan translated style by style into
``torch.distributed.tensor.parallel`` styles (``ColwiseParallel`` -> ``ColwiseParallel`` with the same
layouts, ...). For the tiny Hugging Face Llama this is torchtitan's Llama plan without sequence parallel:
vocab-parallel embedding, ``PrepareModuleInput`` before attention and MLP, q/k/v/gate/up column-wise,
o/down row-wise, LM head column-wise with gathered logits (HF's attention infers its local head count from
the shard, ``view(..., -1, head_dim)``, so neither side adjusts ``num_heads``). The benchmarks' GPT gets a
variant of its auto plan (``gpt_plan``), the same on both sides.

Each rank times forward + backward + AdamW step of both models, alternating blocks of ``--steps`` steps
(the order flips every repeat), after ``--warmup`` steps each. Per step it records wall time
(``time.perf_counter``) and this process's CPU time (``time.process_time``); a variant's figure is the
median over all its timed steps, the slowest rank's. Models are tiny on purpose: the step is dominated by
per-op host work (DTensor dispatch, hooks, autograd), which is what this measures.

    python benchmarks/tp_step.py --model hf-llama --repeats 5
    python benchmarks/tp_step.py --model gpt --repeats 5
    python benchmarks/tp_step.py --model hf-llama --profile 30     # cProfile of ours on rank 0, 30 steps

The first step's losses of both models are printed side by side (same initial weights, same batch): a
sanity check that both compute the same thing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lightning_shard, tests.hf_models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the GPT of fsdp_vs_torch.py

VARIANTS = ("ours", "torch")


def build_model(args) -> tuple[torch.nn.Module, callable]:
    """The model and its ``logits(model, ids)`` function (seeded: every call builds the same weights)."""
    torch.manual_seed(0)
    if args.model == "hf-llama":
        from tests import hf_models

        return hf_models.build("llama"), lambda m, ids: m(ids).logits
    from fsdp_vs_torch import GPT

    return GPT(args.vocab, args.dim, args.layers, args.heads, args.seq), lambda m, ids: m(ids)


def _torch_placement(p):
    import torch.distributed.tensor as tdt

    if p.is_shard():
        return tdt.Shard(p.dim)
    if p.is_partial():
        return tdt.Partial(p.reduce_op)
    return tdt.Replicate()


def _torch_layouts(layouts):
    if layouts is None:
        return None
    if isinstance(layouts, dict):
        return {k: _torch_placement(v) for k, v in layouts.items()}
    return tuple(None if p is None else _torch_placement(p) for p in layouts)


def to_torch_style(style, positional: bool = True):
    """torch's parallel style with the same arguments as our ``style`` (only the styles auto plans use).

    torch's ``PrepareModuleInput`` requires ``input_layouts`` to match the positional inputs one for one, while
    ours skips what is not passed: ``positional`` says whether the module is called with positional inputs
    (keep the positional layouts) or with keywords only (keep the keyword layouts)."""
    import torch.distributed.tensor.parallel as ttp

    name = type(style).__name__
    if name in ("ColwiseParallel", "RowwiseParallel"):
        return getattr(ttp, name)(
            input_layouts=_torch_layouts(style.input_layouts)[0],
            output_layouts=_torch_layouts(style.output_layouts)[0],
            use_local_output=style.use_local_output,
        )
    if name == "PrepareModuleInput":
        kw = style.with_kwargs and not positional
        return ttp.PrepareModuleInput(
            input_layouts=None if kw else _torch_layouts(style.input_layouts),
            desired_input_layouts=None if kw else _torch_layouts(style.desired_input_layouts),
            input_kwarg_layouts=_torch_layouts(style.input_kwarg_layouts) if kw else None,
            desired_input_kwarg_layouts=_torch_layouts(style.desired_input_kwarg_layouts) if kw else None,
            use_local_output=style.use_local_output,
        )
    if name == "SequenceParallel":
        return ttp.SequenceParallel(
            sequence_dim=style.sequence_sharding[0].dim, use_local_output=style.use_local_output
        )
    raise SystemExit(f"tp_step.py: no torch equivalent written for {style!r}; extend to_torch_style")


def _called_positionally(model, logits, ids, names) -> dict[str, bool]:
    """Whether each named submodule gets positional inputs, learnt from one forward of the unsharded model."""
    seen, handles = {}, []
    for name in names:

        def hook(module, args, kwargs, name=name) -> None:
            seen.setdefault(name, len(args) > 0)

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        logits(model, ids)
    for h in handles:
        h.remove()
    return seen


def gpt_plan(model, tp: int) -> dict:
    """The auto plan of the benchmarks' GPT without its ``PrepareModuleInput`` entries, plus its MLPs.

    The auto plan wraps each whole block's input as a DTensor (Megatron style) while the block's residual adds
    the row-parallel projection's local output to it, a DTensor plus a plain tensor, which neither library
    accepts under pure TP; it also leaves the MLP (``up``/``down``) replicated. So the GPT gets the auto plan's
    embedding, fused-qkv and LM-head entries and a column/row-parallel MLP, every output local."""
    from lightning_shard.tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel, auto_tp_plan

    plan = {k: v for k, v in auto_tp_plan(model, tp).items() if not isinstance(v, PrepareModuleInput)}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"], plan[f"blocks.{i}.down"] = ColwiseParallel(), RowwiseParallel()
    return plan


def parallelize(variant: str, model, tp: int, logits, ids):
    from lightning_shard.tp import auto_tp_plan

    plan = auto_tp_plan(model, tp) if hasattr(model, "config") else gpt_plan(model, tp)
    if variant == "ours":
        from lightning_shard import init_device_mesh
        from lightning_shard.tp import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tensor_parallel",)), plan)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tensor_parallel",))
    positional = _called_positionally(model, logits, ids, list(plan))
    for key, entry in plan.items():  # a plan entry may be a tuple of styles: apply them one after the other
        for style in entry if isinstance(entry, tuple) else (entry,):
            parallelize_module(model, mesh, {key: to_torch_style(style, positional.get(key, True))})
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Runner:
    """One variant's model, optimizer and step."""

    def __init__(self, variant: str, args, ids: torch.Tensor) -> None:
        model, self.logits = build_model(args)
        self.model = parallelize(variant, model, args.tp, self.logits, ids)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.ids = ids

    def step(self) -> torch.Tensor:
        logits = self.logits(self.model, self.ids)
        loss = F.cross_entropy(_full(logits).flatten(0, 1).float(), self.ids.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss


def _timed(runner: Runner, steps: int) -> tuple[list[float], list[float]]:
    wall, cpu = [], []
    dist.barrier()
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        runner.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    vocab = 128 if args.model == "hf-llama" else args.vocab
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    runners = {v: Runner(v, args, ids) for v in VARIANTS}
    first = {v: _full(r.step()).item() for v, r in runners.items()}
    for r in runners.values():
        for _ in range(args.warmup - 1):
            r.step()
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        _timed(runners["ours"], args.profile)
        prof.disable()
        if rank == 0:
            s = io.StringIO()
            stats = pstats.Stats(prof, stream=s).sort_stats(args.sort)
            stats.print_stats(args.top)
            if args.callers:
                stats.print_callers(args.callers)
            print(s.getvalue())
        dist.destroy_process_group()
        return
    times = {v: ([], []) for v in VARIANTS}
    per_repeat = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            wall, cpu = _timed(runners[v], args.steps)
            times[v][0].extend(wall)
            times[v][1].extend(cpu)
            per_repeat[v].append(statistics.median(wall))
    mine = torch.tensor(
        [[statistics.median(times[v][0]), statistics.median(times[v][1])] + per_repeat[v] for v in VARIANTS],
        dtype=torch.float64,
    )
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        worst = torch.stack(every).amax(0)  # the slowest rank per figure
        result = {
            v: {"wall_s": worst[i, 0].item(), "cpu_s": worst[i, 1].item(), "wall_s_per_repeat": worst[i, 2:].tolist()}
            for i, v in enumerate(VARIANTS)
        }
        result["first_loss"] = first
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["hf-llama", "gpt"], default="hf-llama")
    p.add_argument("--tp", type=int, default=2, help="TP size = number of gloo ranks")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=512, help="gpt only (the HF Llama's is 128)")
    p.add_argument("--dim", type=int, default=64, help="gpt only")
    p.add_argument("--layers", type=int, default=2, help="gpt only")
    p.add_argument("--heads", type=int, default=4, help="gpt only")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per repeat")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, help="cProfile this many steps of ours instead of timing")
    p.add_argument("--sort", default="tottime", help="pstats sort key for --profile")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--callers", default=None, help="with --profile: also print the callers of functions matching this")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/tp_step.{os.getpid()}.json"
    load_before = os.getloadavg()
    mp.spawn(worker, args=(args.tp, port, args, out), nprocs=args.tp, join=True)
    if args.profile:
        return
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    load = os.getloadavg()
    ours, theirs = result["ours"], result["torch"]
    print(
        f"model {args.model}, TP {args.tp}, {args.repeats} repeats x {args.steps} steps, "
        f"batch {args.batch} x seq {args.seq}"
    )
    print(f"first-step loss: ours {result['first_loss']['ours']:.6f}, torch {result['first_loss']['torch']:.6f}")
    print("| variant | wall ms/step | CPU ms/step | wall ms per repeat |")
    print("|---|---:|---:|---|")
    for v in VARIANTS:
        r = result[v]
        per = ", ".join(f"{t * 1e3:.1f}" for t in r["wall_s_per_repeat"])
        print(f"| {v} | {r['wall_s'] * 1e3:.1f} | {r['cpu_s'] * 1e3:.1f} | {per} |")
    ratios = [a / b for a, b in zip(ours["wall_s_per_repeat"], theirs["wall_s_per_repeat"])]
    print(
        f"ours / torch: wall {ours['wall_s'] / theirs['wall_s']:.3f}x, CPU {ours['cpu_s'] / theirs['cpu_s']:.3f}x; "
        f"per repeat wall {', '.join(f'{r:.2f}' for r in ratios)}"
    )
    print(f"load average before {load_before[0]:.2f}, after {load[0]:.2f} (1 min)")
    if args.json:
        result["load_avg"] = [load_before[0], load[0]]
        result["args"] = vars(args)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
