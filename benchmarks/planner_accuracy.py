"""Planner accuracy: estimate vs measured per term, per model and mesh, on CPU gloo ranks.

Run (prints a markdown table; rank 0 only):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/planner_accuracy.py
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/planner_accuracy.py
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 1 benchmarks/planner_accuracy.py

Every mesh (dp, tp) with dp * tp = world size and tp dividing the head counts is measured for the reference
models of the TP tests (tests/tp_models.py), with ``lightning_shard.planner.measure.measure_step``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_shard.planner import estimate  # noqa: E402
from lightning_shard.planner.estimate import heads_of  # noqa: E402
from lightning_shard.planner.measure import measure_step  # noqa: E402
from tests.tp_models import GPT2, Bert, Llama  # noqa: E402

TERMS = ("params", "grads", "optimizer", "activations", "comm_total", "reduce_scatter_staging", "buffers")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    cases = [(Llama, "32-true", "adamw"), (GPT2, "32-true", "adamw"), (Bert, "bf16-mixed", "sgd")]
    rows = []
    for factory, precision, optimizer in cases:
        with torch.device("meta"):
            heads = heads_of(factory())
        for tp in [t for t in (1, 2, 4) if world % t == 0 and all(h % t == 0 for h in heads)]:
            mesh = (world // tp, tp)
            measured = measure_step(
                factory, mesh, precision=precision, batch=args.batch, seq_len=args.seq_len, optimizer=optimizer
            )
            with torch.device("meta"):
                model = factory()
            est = estimate(
                model, mesh, precision=precision, batch=args.batch, seq_len=args.seq_len, optimizer=optimizer
            )
            predicted = dict(
                params=est.params, grads=est.grads, optimizer=est.optimizer, activations=est.activations,
                comm_total=est.comm_total, reduce_scatter_staging=est.reduce_scatter_staging, buffers=est.buffers,
            )  # fmt: skip
            cells = [f"{predicted[t]} / {measured[t]} ({predicted[t] / max(1, measured[t]):.3f})" for t in TERMS]
            head = f"| {factory.__name__} | {precision}, {optimizer} | {mesh[0]} x {mesh[1]} | "
            rows.append(head + " | ".join(cells))
    if dist.get_rank() == 0:
        print(f"world size {world}, micro-batch {args.batch} x seq {args.seq_len}; cells: estimate / measured (ratio)")
        print("| model | precision, optimizer | mesh (dp x tp) | " + " | ".join(TERMS) + " |")
        print("|---|---|---|" + "---|" * len(TERMS))
        print("\n".join(r + " |" for r in rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
