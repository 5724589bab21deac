"""CLI: ``python -m lightning_shard.planner path.to.module:model_factory --devices 8 --memory 80GB ...``.

The factory is called under ``torch.device("meta")``: nothing is allocated. Prints the table of meshes and
the choice; exits with status 1 and the planner's message when nothing fits.

Example::

    python -m lightning_shard.planner my_project.models:build_llama --devices 16 --devices-per-node 8 \\
        --memory 80GB --precision bf16-mixed --batch 8 --seq-len 2048
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

from lightning_shard.planner.estimate import format_bytes
from lightning_shard.planner.plan import parse_bytes, plan


def _load(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"planner: expected 'package.module:factory', got {spec!r}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a zero batch, sequence or node size gives a plan of nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_shard.planner", description=__doc__.split("\n")[0])
    parser.add_argument("factory", help="package.module:callable returning the model (built on the meta device)")
    parser.add_argument("--devices", type=_positive_int, required=True, help="world size (all devices)")
    parser.add_argument("--devices-per-node", type=_positive_int, default=None, help="default: --devices (one node)")
    parser.add_argument("--memory", required=True, help="memory per device, e.g. 80GB, 24GiB")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--batch", type=_positive_int, required=True, help="micro-batch per data-parallel rank")
    parser.add_argument("--seq-len", type=_positive_int, required=True)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "sgd-nomomentum"])
    parser.add_argument("--safety-margin", type=float, default=0.1)
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--no-reshard-after-forward", action="store_true")
    parser.add_argument("--device", default="h100", help="time model: h100, a100 or cpu")
    parser.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "selective-op", "auto"])
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--loss-parallel", action="store_true")
    parser.add_argument("--hybrid-shard", action="store_true", help="HSDP: shard within a node, replicate across")
    parser.add_argument("--search", action="store_true", help="also search reshard_after_forward and CPU offload")
    parser.add_argument("--json", action="store_true", help="print the table rows as JSON too")
    parser.add_argument(
        "--simulate-reserved", action="store_true",
        help="run the choice in the fake-tensor simulator and replay the CUDA caching allocator: peak reserved",
    )  # fmt: skip
    parser.add_argument("--expandable-segments", action="store_true", help="with --simulate-reserved")
    args = parser.parse_args(argv)
    factory = _load(args.factory)
    with torch.device("meta"):
        model = factory()
    try:
        result = plan(
            model,
            args.devices,
            args.devices if args.devices_per_node is None else args.devices_per_node,
            parse_bytes(args.memory),
            precision=args.precision,
            batch=args.batch,
            seq_len=args.seq_len,
            safety_margin=args.safety_margin,
            cpu_offload="auto" if args.search and not args.cpu_offload else args.cpu_offload,
            reshard_after_forward="auto" if args.search else not args.no_reshard_after_forward,
            optimizer=args.optimizer,
            activation_checkpointing=None if args.activation_checkpointing == "none" else args.activation_checkpointing,
            sequence_parallel=args.sequence_parallel,
            loss_parallel=args.loss_parallel,
            hybrid_shard=args.hybrid_shard,
            device=args.device,
        )
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(result.table)
    dp, tp = result.choice.mesh
    t = result.choice.time
    print(f"choice: data_parallel_size={dp}, tensor_parallel_size={tp} ({result.choice.config}; "
          f"{format_bytes(result.choice.estimate.device_total)} per device, "
          f"{t.tokens_per_second_per_device:,.0f} tokens/s per device, MFU {t.mfu:.0%})")  # fmt: skip
    print(result.choice.estimate.summary())
    if args.json:
        print(json.dumps(result.rows))
    if args.simulate_reserved:
        return _print_reserved(factory, result, args)
    return 0


def _print_reserved(factory, result, args) -> int:
    """``--simulate-reserved``: the choice's simulated allocated and reserved peaks (``planner.reserved``)."""
    from lightning_shard.planner.reserved import simulated_reserved

    try:
        r = simulated_reserved(
            factory, result.choice.estimate, precision=args.precision, batch=args.batch, seq_len=args.seq_len,
            devices_per_node=args.devices if args.devices_per_node is None else args.devices_per_node,
            expandable_segments=args.expandable_segments,
        )  # fmt: skip
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(f"simulated ({result.choice.config}): peak allocated {format_bytes(r.peak_allocated)}, peak reserved "
          f"{format_bytes(r.peak_reserved)} (CUDA caching allocator replay, {r.reserved_over_allocated:.2f}x "
          f"allocated); planner allocated {format_bytes(r.planned_allocated)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
