"""Rank 0's memory while writing a sharded Hugging Face model: ``save_hf_pretrained`` (streams one gathered
tensor at a time) against gathering the full state dict on rank 0 first and writing it with safetensors'
``save_file`` (what one would do without it), in one run.

A Llama (hidden 512, 4 layers, vocabulary 32000, untied: 45M parameters, 180 MB in float32) is built on meta,
sharded with ``fully_shard`` over 2 CPU ranks and materialized, so each rank holds only its shards. Each
variant runs in its own ``torchrun`` job; rank 0 samples its resident memory (``/proc/self/statm``) every
millisecond during the save and reports the peak growth over the resident memory just before it.

    python benchmarks/hf_save_memory.py            # both variants, side by side
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("stream", "gather_then_save")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Peak:
    """Samples the resident memory in a thread until stopped."""

    def __init__(self) -> None:
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.001)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_mb())


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _variant(name: str, directory: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from lightning_shard.checkpoint import get_model_state_dict, save_hf_pretrained
    from lightning_shard.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = _model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    full_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    dist.barrier()
    before = _rss_mb()
    peak = _Peak()
    start = time.perf_counter()
    if name == "stream":
        save_hf_pretrained(model, directory, save_config=False)
    else:
        from safetensors.torch import save_file

        state = get_model_state_dict(model, full_state_dict=True, cpu_offload=True)
        if dist.get_rank() == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, "model.safetensors"))
        del state
    dist.barrier()
    seconds = time.perf_counter() - start
    growth = peak.stop() - before
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"peak_growth_mb": growth, "model_mb": full_mb, "seconds": seconds}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--dir")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.variant:
        _variant(args.variant, args.dir, args.out)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    results = {}
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29743"]
            cmd += [__file__, "--variant", variant, "--dir", tmp, "--out", out]
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            results[variant] = json.loads(Path(out).read_text())
    for variant, r in results.items():
        print(
            f"{variant:>17}: rank 0 peak growth {r['peak_growth_mb']:7.1f} MB while saving a "
            f"{r['model_mb']:.1f} MB model ({r['seconds']:.2f} s)"
        )
    ratio = results["stream"]["peak_growth_mb"] / results["gather_then_save"]["peak_growth_mb"]
    print(f"stream / gather_then_save peak growth: {ratio:.2f}")


if __name__ == "__main__":
    main()
