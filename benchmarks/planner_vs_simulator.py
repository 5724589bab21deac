"""Planner vs simulator: peak device memory per phase and collectives per step, on the same configurations.

For each configuration, ``lightning_shard.simulate.simulate_training`` runs the engine's real setup and two
training steps as rank 0 of N simulated accelerators (fake tensors, a memory tracker; see docs/gpu.md), and
``lightning_shard.planner.estimate`` predicts the same step without running it. Printed: planner / simulated
ratios of the peak and of each phase's peak (setup, forward, backward, optimizer; the simulator's second step,
when the optimizer state exists), the collective calls per step by kind, and the bytes sent. Goal: peak within
5%.

Run (about two minutes on one CPU core; rank 0 of each configuration):

    python benchmarks/planner_vs_simulator.py [--attention math|flash] [--only NAME]

What the planner is told so that both describe the same step:

* the loss: the simulator's ``model(x).float().mean()`` (``loss_fn``), not the planner's default cross-entropy;
* the attention kind, the same on both sides: ``--attention flash`` (default: what GPUs run; the simulator
  counts what flash attention saves and its backward workspaces) or ``math`` (torch's unfused path, which
  keeps the ``B x H x S x S`` scores, upcast to fp32, for backward);
* HYBRID_SHARD: the simulator's replicas are its nodes (``--devices-per-node``), the planner's ``replicas``.

Not compared: gradient clipping's all-reduce (the simulator clips every step; the planner does not count
clipping).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_shard.planner import estimate  # noqa: E402
from lightning_shard.planner.profile import profile_activations  # noqa: E402
from lightning_shard.simulate.run import SimulationRequest, simulate_training  # noqa: E402

MiB = 2**20
PHASES = ("setup", "forward", "backward", "optimizer")


def small_llama():
    """A Llama of the shape of tests/tp_models.Llama: 4 blocks, hidden 256, 8 heads (4 KV), FFN 704, vocab 4096,
    rotary tables in bf16 (benchmarks/sim_models.py)."""
    from benchmarks.sim_models import _bf16_buffers
    from tests.tp_models import Llama

    return _bf16_buffers(Llama(vocab=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, hidden=704, max_len=256))


def mean_loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().mean()  # the simulator's loss


@dataclass(frozen=True)
class Config:
    name: str
    devices: int
    tp: int = 1
    precision: str = "bf16-mixed"
    cpu_offload: bool = False
    hybrid: bool = False
    devices_per_node: int = 8
    batch: int = 2
    seq_len: int = 256
    ac: str | None = None  # activation checkpointing of every block: "full" or "selective-op"

    @property
    def replicas(self) -> int:
        return self.devices // min(self.devices_per_node, self.devices) if self.hybrid else 1


CONFIGS = [
    Config("dp 8", 8),
    Config("dp 4 x tp 2", 8, tp=2),
    Config("dp 8, CPU offload", 8, cpu_offload=True),
    Config("dp 4 x tp 2, CPU offload", 8, tp=2, cpu_offload=True),
    Config("dp 8", 8, precision="32-true"),
    Config("dp 4 x tp 2", 8, tp=2, precision="32-true"),
    Config("HSDP 4 x 4 (16 devices, 4 per node)", 16, hybrid=True, devices_per_node=4),
    Config("dp 8, full AC", 8, ac="full"),
    Config("dp 4 x tp 2, full AC", 8, tp=2, ac="full"),
    Config("dp 8, selective op AC", 8, ac="selective-op"),
]


def simulate(c: Config, attention: str) -> dict:
    request = SimulationRequest(
        attention=attention, checkpoint=False,
        devices=c.devices, tensor_parallel_size=c.tp, precision=c.precision, batch=c.batch, seq_len=c.seq_len,
        steps=2, cpu_offload=c.cpu_offload, devices_per_node=c.devices_per_node,
        sharding_strategy="HYBRID_SHARD" if c.hybrid else "FULL_SHARD", activation_checkpointing=c.ac or False,
    )  # fmt: skip
    return simulate_training(small_llama, request)


def plan(c: Config, attention: str, profiles: dict):
    with torch.device("meta"):
        model = small_llama()
    key = (c.precision, c.batch, c.seq_len)
    if key not in profiles:
        profiles[key] = profile_activations(
            model, precision=c.precision, batch=c.batch, seq_len=c.seq_len, loss_fn=mean_loss, attention=attention
        )
    return estimate(
        model, (c.devices // c.tp, c.tp), precision=c.precision, batch=c.batch, seq_len=c.seq_len,
        loss_fn=mean_loss, activations=profiles[key], cpu_offload=c.cpu_offload, replicas=c.replicas,
        activation_checkpointing=c.ac,
    )  # fmt: skip


def calls_by_kind(est) -> Counter:
    calls: Counter = Counter()
    for coll in est.collectives:
        calls[coll.kind] += coll.calls
    return calls


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else ("1.000" if not a else "-")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", choices=["math", "flash"], default="flash", help="for both planner and simulator")
    p.add_argument("--only", default=None, help="run only the configurations whose name contains this")
    args = p.parse_args()
    print(f"attention: {args.attention}; loss: model(x).float().mean(); micro-batch 2 x 256; Llama 4 x 256")
    print()
    print("| configuration | peak: planner / simulated (MiB) | ratio | setup | forward | backward | optimizer "
          "| planner peak phase | collective calls planner / simulated | comm bytes ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    profiles: dict = {}
    for c in CONFIGS:
        if args.only and args.only not in c.name:
            continue
        t0 = time.time()
        sim = simulate(c, args.attention)
        est = plan(c, args.attention, profiles)
        phases = [ratio(est.phases[ph], sim["peak_by_phase"].get(ph, 0)) for ph in PHASES]
        ours, theirs = calls_by_kind(est), Counter(sim["collectives_per_step"])
        kinds = sorted(set(ours) | set(theirs))
        calls = ", ".join(f"{k} {ours[k]}/{theirs[k]}" for k in kinds)
        print(
            f"| {c.name}, {c.precision} | {est.device_total / MiB:.2f} / {sim['peak_device_bytes'] / MiB:.2f} | "
            f"**{ratio(est.device_total, sim['peak_device_bytes'])}** | {' | '.join(phases)} | {est.peak_phase} | "
            f"{calls} | {ratio(est.comm_total, sim['comm_bytes_per_step'])} |",
            flush=True,
        )
        detail = {ph: f"{est.phases[ph] / MiB:.2f}/{sim['peak_by_phase'].get(ph, 0) / MiB:.2f}" for ph in PHASES}
        print(f"<!-- {c.name}: {time.time() - t0:.0f} s; phases MiB planner/simulated {detail} -->", flush=True)


if __name__ == "__main__":
    main()
