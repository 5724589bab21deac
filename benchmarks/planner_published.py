"""Planner vs published large runs: peak memory per GPU and tokens/s per GPU.

Builds each published model shape on the meta device (Hugging Face configs, nothing allocated), plans the
published configuration with ``lightning_shard.planner`` and prints planner / published ratios. Goal: peak
within 15%, tokens/s within 25%. Run (about a minute on one CPU core):

    python benchmarks/planner_published.py
    python benchmarks/planner_published.py --simulate   # + reserved memory, simulated (8B 4 min, 70B 14-23 min)

``--simulate`` also runs each run with a published peak (``--only TEXT``: the runs whose name contains TEXT)
through ``lightning_shard.planner.reserved`` on fake tensors as rank 0, with this engine and with torch's FSDP2
(``--reference torch``), and replays the CUDA caching allocator on each (``lightning_shard.simulate.allocator``):
the published figures are peak *reserved* bytes. The simulated models are ``benchmarks.sim_models.llama3_8b`` and
``llama3_70b`` (the shapes of the Hugging Face configs, the Llama of ``tests/tp_models.py``), with cross-entropy
on fp32 logits as torchtitan (the 70B run with sequence and loss parallelism, as published).

Sources:
* torchtitan, docs/performance.md (commit 820504e20^ of pytorch/torchtitan, Dec 2024; also arXiv 2410.06511):
  Llama 3.1 8B, FSDP, 8 and 128 H100 (96 GB HBM2e, 500 W), local batch 2, seq 8192, selective (op) AC:
  5,762 / 5,605 TPS/GPU, 82.4 / 67.0 GiB. Llama 3.1 70B, FSDP 32 x TP 8 on 256 H100, local batch 16,
  full AC, torch.compile + Float8: 829 TPS/GPU, 71.9 GiB. torchtitan's 2-D plan uses sequence and loss
  parallelism. Their memory is the caching allocator's peak *reserved* memory.
* torchtitan, benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (pytorch/torchtitan, June 2025; same
  Grand Teton H100s): the same 70B configuration (FSDP 32 x TP 8, local batch 16, full AC, torch.compile) in
  bf16 without Float8, vanilla TP: 597.3 tokens/s per GPU; and Llama 3.1 8B on 64 H100, FSDP 8 x TP 8, local
  batch 12, per-op selective AC, torch.compile, bf16, vanilla TP: 4,378. No memory figures. torchtitan's TP
  plan uses sequence and loss parallelism.
* torchtitan, docs/performance.md at commit 0413364 of pytorch/torchtitan (the earlier version of the page):
  Llama 3 8B and 70B, FSDP only, 64 A100 80GB, local batch 1, seq 8192: 8B selective op AC 2,973 WPS (tokens/s
  per GPU), 70B full AC 331 WPS. bf16, no Float8; the page gives no memory figures and does not say whether
  torch.compile was on.
* The PyTorch FSDP paper (Zhao et al., arXiv 2304.11277) trains GPT-175B on 128 A100s; its figures could not be
  found in the reference library this script was written with, so that row prints the planner's prediction
  without a ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_shard.planner import estimate  # noqa: E402
from lightning_shard.planner.profile import profile_activations  # noqa: E402
from lightning_shard.planner.timing import step_time  # noqa: E402

GiB = 2**30


@dataclass(frozen=True)
class Run:
    name: str
    factory: str
    world: int
    mesh: tuple[int, int]
    batch: int
    seq_len: int
    ac: str
    device: str
    sp: bool = False
    lp: bool = False
    peak_gib: float | None = None
    tps: float | None = None
    note: str = ""


def llama(layers: int, dim: int, hidden: int, heads: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def gpt175b():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=50257, n_positions=2048, n_embd=12288, n_layer=96, n_head=96)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg)


MODELS = {
    "llama3.1-8b": lambda: llama(32, 4096, 14336, 32, 8),
    "llama3.1-70b": lambda: llama(80, 8192, 28672, 64, 8),
    "gpt-175b": gpt175b,
}

RUNS = [
    Run("torchtitan Llama 3.1 8B, 8 H100", "llama3.1-8b", 8, (8, 1), 2, 8192, "selective-op", "h100",
        peak_gib=82.4, tps=5762),
    Run("torchtitan Llama 3.1 8B, 128 H100", "llama3.1-8b", 128, (128, 1), 2, 8192, "selective-op", "h100",
        peak_gib=67.0, tps=5605),
    Run("torchtitan Llama 3.1 70B, 256 H100 (dp 32 x tp 8)", "llama3.1-70b", 256, (32, 8), 16, 8192, "full",
        "h100", sp=True, lp=True, peak_gib=71.9, tps=829, note="published run: torch.compile + Float8"),
    Run("torchtitan Llama 3.1 70B, 256 H100 (dp 32 x tp 8), bf16", "llama3.1-70b", 256, (32, 8), 16, 8192, "full",
        "h100", sp=True, lp=True, tps=597.3, note="published run: torch.compile, bf16, vanilla TP; no memory figure"),
    Run("torchtitan Llama 3.1 8B, 64 H100 (dp 8 x tp 8), bf16", "llama3.1-8b", 64, (8, 8), 12, 8192,
        "selective-op", "h100", sp=True, lp=True, tps=4378,
        note="published run: torch.compile, bf16, vanilla TP; no memory figure"),
    Run("torchtitan Llama 3 8B, 64 A100 (FSDP, bf16)", "llama3.1-8b", 64, (64, 1), 1, 8192, "selective-op", "a100",
        tps=2973, note="earlier torchtitan page: no memory figure"),
    Run("torchtitan Llama 3 70B, 64 A100 (FSDP, bf16)", "llama3.1-70b", 64, (64, 1), 1, 8192, "full", "a100",
        tps=331, note="earlier torchtitan page: no memory figure"),
    Run("FSDP paper GPT-175B, 128 A100", "gpt-175b", 128, (128, 1), 1, 2048, "full", "a100",
        note="published figures not found in the library"),
]  # fmt: skip


SIM_FACTORIES = {"llama3.1-8b": "llama3_8b", "llama3.1-70b": "llama3_70b"}  # benchmarks.sim_models, same shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--simulate", action="store_true", help="also simulate reserved memory (minutes)")
    parser.add_argument("--only", default="", help="simulate only the runs whose name contains this text")
    args = parser.parse_args()
    estimates = planner_table()
    if args.simulate:
        reserved_table(estimates, args.only)


def planner_table() -> dict:
    """The planner / published table; returns each run's estimate by name."""
    estimates = {}
    print("| run | mesh | planner peak | published peak | ratio | planner tokens/s/GPU | published | ratio | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    cache: dict = {}
    for run in RUNS:
        t0 = time.time()
        model = cache.setdefault(run.factory, MODELS[run.factory]())
        key = (run.factory, run.batch, run.seq_len)
        if key not in cache:
            cache[key] = profile_activations(model, precision="bf16-mixed", batch=run.batch, seq_len=run.seq_len)
        est = estimate(
            model, run.mesh, precision="bf16-mixed", batch=run.batch, seq_len=run.seq_len, activations=cache[key],
            activation_checkpointing=run.ac, sequence_parallel=run.sp, loss_parallel=run.lp,
        )  # fmt: skip
        t = step_time(est, run.device, devices_per_node=8)
        peak = est.device_total / GiB
        pr = f"{peak / run.peak_gib:.2f}" if run.peak_gib else "-"
        tr = f"{t.tokens_per_second_per_device / run.tps:.2f}" if run.tps else "-"
        print(
            f"| {run.name} | {est.config} | {peak:.1f} GiB | {run.peak_gib or '-'} | {pr} | "
            f"{t.tokens_per_second_per_device:,.0f} | {run.tps or '-'} | {tr} | {t.mfu:.0%} |"
            + (f" {run.note}" if run.note else "")
        )
        print(f"<!-- {run.name}: {time.time() - t0:.1f} s; " + est.summary().replace("\n", " / ") + " -->")
        estimates[run.name] = est
    return estimates


def reserved_table(estimates: dict, only: str = "") -> None:
    """Planner allocated vs simulated allocated and reserved (both engines) vs the published reserved peak, for
    the runs whose name contains ``only``."""
    from benchmarks import sim_models
    from lightning_shard.planner.reserved import simulation_request
    from lightning_shard.simulate.reference import TORCH_ENGINE
    from lightning_shard.simulate.run import simulate_training

    print()
    print("| run | planner allocated | simulated allocated | simulated reserved (ours) | reserved (torch FSDP2) "
          "| published reserved | ratio ours / published | torch / published |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for run in RUNS:
        if run.peak_gib is None or only not in run.name:
            continue
        est = estimates[run.name]
        if run.factory not in SIM_FACTORIES:
            print(f"| {run.name} | {est.device_total / GiB:.1f} GiB | not simulated: no simulator factory "
                  f"| | | {run.peak_gib} | | |")  # fmt: skip
            continue
        factory = getattr(sim_models, SIM_FACTORIES[run.factory])
        request = simulation_request(est, precision="bf16-mixed", batch=run.batch, seq_len=run.seq_len)
        t0 = time.time()
        ours = simulate_training(factory, request)
        t_ours = time.time() - t0
        theirs = simulate_training(factory, request, engine=TORCH_ENGINE)
        r_ours, r_torch = ours["peak_reserved_bytes"] / GiB, theirs["peak_reserved_bytes"] / GiB
        print(
            f"| {run.name} | {est.device_total / GiB:.1f} GiB | {ours['peak_device_bytes'] / GiB:.1f} GiB "
            f"(torch {theirs['peak_device_bytes'] / GiB:.1f}) | {r_ours:.1f} GiB | {r_torch:.1f} GiB | "
            f"{run.peak_gib} GiB | **{r_ours / run.peak_gib:.2f}** | **{r_torch / run.peak_gib:.2f}** |"
        )
        print(f"<!-- {run.name}: simulated in {time.time() - t0:.0f} s (ours {t_ours:.0f} s); allocated by phase "
              f"ours {ours['peak_by_phase']}, torch {theirs['peak_by_phase']}; reserved by phase ours "
              f"{ours['reserved_by_phase']}, torch {theirs['reserved_by_phase']} -->")  # fmt: skip


if __name__ == "__main__":
    main()
