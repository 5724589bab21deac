"""CLI: ``python -m lightning_shard.simulate MODULE:FACTORY --devices N ...``: simulate training as rank R of N
accelerators on this CPU and report peak device memory, collectives and communication per step.

The factory is called under ``torch.device("meta")`` (token ids in, logits out), as the planner's CLI does.
With ``--reference torch`` the same simulation runs a second time with torch's own FSDP2 (and torchtitan's
Llama tensor-parallel plan when T > 1; ``lightning_shard.simulate.reference``), and the report adds torch's
figures and the ratios ours / torch. ``peak_reserved_bytes`` is the CUDA caching allocator's peak reserved
memory (``torch.cuda.max_memory_reserved``), replayed from the run's allocations and their streams
(``lightning_shard.simulate.allocator``); ``peak_device_bytes`` the bytes tensors held. Attention is counted as
a GPU's flash attention keeps it (``lightning_shard.simulate.attention``); ``--attention math`` counts torch's
math path instead. ``--activation-checkpointing selective-op`` applies torchtitan's selective op policy
(``lightning_shard.simulate.selective_ac``), ``--loss cross-entropy`` torchtitan's loss, and ``--loss-parallel``
(T > 1, cross-entropy) computes it on vocabulary-sharded logits (``lightning_shard.tp.loss_parallel``).

Example::

    python -m lightning_shard.simulate benchmarks.sim_models:llama3_8b --devices 16 --tensor-parallel-size 2 \\
        --precision bf16-mixed --batch 1 --seq-len 8192 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lightning_shard.simulate.run import SimulationRequest, simulate_training


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_shard.simulate", description=__doc__.split("\n")[0])
    p.add_argument("factory", help="package.module:callable returning the model (called on the meta device)")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--sharding-strategy", default="FULL_SHARD")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true", help="with T > 1: shard activations between blocks")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument(
        "--activation-checkpointing", nargs="?", const="full", default=False, choices=["full", "selective-op"],
        help="checkpoint every block: full (the default when given) or torchtitan's selective op policy",
    )  # fmt: skip
    p.add_argument("--no-checkpoint", action="store_true", help="skip the sharded and full checkpoint save and load")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--reference", choices=["torch"], default=None, help="also run torch's FSDP2 and compare")
    p.add_argument("--attention", choices=["flash", "math"], default="flash", help="how SDPA's memory is counted")
    p.add_argument("--loss", choices=["mean", "cross-entropy"], default="mean", help="on the fp32 logits")
    p.add_argument(
        "--loss-parallel", action="store_true",
        help="with T > 1 and --loss cross-entropy: vocabulary-sharded logits and loss, as the strategy's flag",
    )  # fmt: skip
    p.add_argument("--expandable-segments", action="store_true", help="replay the allocator with them on")
    p.add_argument("--device-memory", type=float, default=None, help="GiB per device for the allocator replay")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids' range when the model has no nn.Embedding")
    p.add_argument("--json", default=None, help="write the report to this file")
    args = p.parse_args(argv)
    try:
        _check_writable(args.json)
        factory = _load(args.factory)
        request = SimulationRequest(
            devices=args.devices, tensor_parallel_size=args.tensor_parallel_size,
            sharding_strategy=args.sharding_strategy, precision=args.precision, batch=args.batch,
            seq_len=args.seq_len, steps=args.steps, cpu_offload=args.cpu_offload,
            activation_checkpointing=args.activation_checkpointing, rank=args.rank,
            devices_per_node=args.devices_per_node, checkpoint=not args.no_checkpoint, attention=args.attention,
            sequence_parallel=args.sequence_parallel, expandable_segments=args.expandable_segments, loss=args.loss,
            loss_parallel=args.loss_parallel, vocab_size=args.vocab_size,
            device_memory=None if args.device_memory is None else int(args.device_memory * (1 << 30)),
        )  # fmt: skip
        report = simulate_training(factory, request)
        if args.reference:
            from lightning_shard.simulate.reference import TORCH_ENGINE, compare

            report = compare(report, simulate_training(factory, request, engine=TORCH_ENGINE))
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 1
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _print(report: dict) -> None:
    reference = report.get("reference")
    if reference is None:
        for key, value in report.items():
            print(f"{key:26s} {_fmt(value)}")
        return
    print(f"{'':26s} {'lightning_shard':>34s} {reference['engine']:>34s}  ratio")
    ratios = report["ratio_to_reference"]
    for key, value in report.items():
        if key in ("reference", "ratio_to_reference", "engine"):
            continue
        if key in ("peak_by_phase", "reserved_by_phase"):
            label = "  peak " if key == "peak_by_phase" else "  reserved "
            for phase in value:
                ratio = ratios[key].get(phase)
                print(
                    f"{label + phase:26s} {_fmt(value[phase]):>34s} {_fmt(reference[key].get(phase, 0)):>34s}"
                    f"  {_fmt_ratio(ratio)}"
                )
            continue
        print(f"{key:26s} {_fmt(value):>34s} {_fmt(reference.get(key)):>34s}  {_fmt_ratio(ratios.get(key))}")


def _fmt_ratio(ratio) -> str:
    if ratio is None:
        return ""
    return json.dumps(ratio) if isinstance(ratio, dict) else f"{ratio:.3f}"


def _fmt(value) -> str:
    if isinstance(value, int) and value >= 1 << 20:
        return f"{value / (1 << 30):.2f} GiB ({value})"
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _check_writable(path: str | None) -> None:
    """Refuse a ``--json`` path that cannot be written before the simulation runs, not after."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"simulate: --json {path!r}: the folder {folder!r} does not exist or is not writable")
    if os.path.isdir(path) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"simulate: --json {path!r} is a folder or a file that cannot be written; name a new file")


def _load(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"simulate: expected 'package.module:factory', got {spec!r}")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"simulate: cannot load the factory {spec!r}: {e}") from e
    return obj


if __name__ == "__main__":
    sys.exit(main())
