"""Our fully_shard vs torch's fully_shard (FSDP2) vs DDP: same model, same data, same world size, one run.

Reports the median step time (forward + backward + optimizer step), the peak memory per rank and the bytes
communicated per step. Each variant runs in fresh processes so their peaks do not mix. On CPU the peak is
the growth of the process's peak RSS from just before the model is built; on CUDA it is
``torch.cuda.max_memory_allocated``.

    python benchmarks/fsdp_vs_torch.py --world-size 2 --steps 8 --json results.json

``--variants local`` adds the floor of the comparison: each rank trains its own whole replica with no
communication (the same compute on the same two cores, with the optimizer stepping every parameter).

``--json`` writes ``{"ours": {...}, "torch_fsdp2": {...}, "ddp": {...}}`` with ``step_s``, ``step_cpu_s`` (the
rank's CPU time per step, all its threads: compute, gloo's, numba's; median), ``peak_mb`` and
``comm_bytes`` each (comm bytes per rank and step: the tensors handed to the collectives, i.e. all-gather
inputs (this rank's shard) + reduce-scatter inputs + all-reduce tensors, as ``lightning_shard.comm`` counts),
plus on CPU ``library_mb`` (the RSS that loading the engine itself adds: for ours the numba kernels and
llvmlite, a fixed per-process cost) and ``model_peak_mb`` (``peak_mb`` without it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """About 25M parameters at the default size (vocab 8192, dim 512, 6 layers)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _TorchCommCounter:
    """Counts the bytes torch's FSDP2 sends through torch.distributed's Python collectives."""

    def __init__(self) -> None:
        self.bytes = 0
        self._saved = {}

    def __enter__(self):
        for name, size_of in (
            ("all_gather_into_tensor", lambda out, inp: inp),
            ("reduce_scatter_tensor", lambda out, inp: inp),
            ("all_gather_single", lambda out, inp: inp),  # torch >= 2.13 names
            ("reduce_scatter_single", lambda out, inp: inp),
        ):
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def wrapped(output, input, *a, _orig=original, _size=size_of, **k):
                t = _size(output, input)
                self.bytes += t.numel() * t.element_size()
                return _orig(output, input, *a, **k)

            setattr(dist, name, wrapped)
        original_ar = dist.all_reduce
        self._saved["all_reduce"] = original_ar

        def all_reduce(tensor, *a, **k):
            self.bytes += tensor.numel() * tensor.element_size()
            return original_ar(tensor, *a, **k)

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _worker(rank: int, world: int, port: int, variant: str, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    base_rss = _peak_rss_mb()
    library_mb = 0.0
    if not cuda:
        _load_engine(variant)  # its fixed cost, measured apart from what grows with the model
        library_mb = _peak_rss_mb() - base_rss
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    model, counter = _setup(variant, model, world, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times, cpu_times, bytes_per_step = [], [], []
    for step in range(args.steps + args.warmup):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        with counter() as c:
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)  # this rank's CPU time, all its threads (gloo's too)
            bytes_per_step.append(c.total())
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _peak_rss_mb() - base_rss
    result = {
        "step_s": statistics.median(times),
        "step_cpu_s": statistics.median(cpu_times),
        "peak_mb": peak,
        "library_mb": library_mb,
        "model_peak_mb": peak - library_mb,
        "comm_bytes": statistics.median(bytes_per_step),
    }
    with open(os.path.join(out_dir, f"{variant}.{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _load_engine(variant: str) -> None:
    """Import the variant's engine and what it loads on first use: fixed per-process costs, not the model's.

    Ours: the numba kernels (llvmlite), and ``torch.distributed.tensor``, which torch 2.13 imports at the first
    dispatch of any tensor subclass (ours included; ~28 MB of Python objects). torch's FSDP2 imports it too.
    """
    if variant == "ours":
        import torch.distributed.tensor  # noqa: F401

        import lightning_shard.fsdp  # noqa: F401
        from numba_kernels import GroupLayout

        GroupLayout([(1,)], 1).warm("cpu")
    elif variant == "torch_fsdp2":
        import torch.distributed.fsdp  # noqa: F401


class _OurCounter:
    def __init__(self) -> None:
        from lightning_shard import comm

        self._ctx = comm.count_collectives()

    def __enter__(self):
        self.counts = self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def total(self) -> int:
        return sum(self.counts.bytes.values())


class _TorchCounter(_TorchCommCounter):
    def total(self) -> int:
        return self.bytes


def _setup(variant: str, model: nn.Module, world: int, device: torch.device):
    if variant == "ours":
        from lightning_shard import init_device_mesh
        from lightning_shard.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("data_parallel",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, _OurCounter
    if variant == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, _TorchCounter
    if variant == "local":  # no communication at all: each rank trains its own whole replica
        return model, _NoCounter
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    counter = _DDPCounter()
    ddp.register_comm_hook(counter, _DDPCounter.hook)
    return ddp, counter.context


class _NoCounter:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def total(self) -> int:
        return 0


class _DDPCounter:
    """DDP all-reduces gradient buckets in C++; a comm hook sees each bucket."""

    def __init__(self) -> None:
        self.bytes = 0

    @staticmethod
    def hook(state: _DDPCounter, bucket):
        t = bucket.buffer()
        state.bytes += t.numel() * t.element_size()
        t.div_(dist.get_world_size())
        return dist.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value()[0])

    def context(self):
        counter = self

        class _Ctx:
            def __enter__(self):
                counter.bytes = 0
                return self

            def __exit__(self, *exc):
                return False

            def total(self):
                return counter.bytes

        return _Ctx()


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for variant in args.variants:
            mp.spawn(_worker, args=(args.world_size, _free_port(), variant, args, out_dir), nprocs=args.world_size)
            ranks = [_read_json(os.path.join(out_dir, f"{variant}.{r}.json")) for r in range(args.world_size)]
            results[variant] = {k: max(r[k] for r in ranks) for k in ranks[0]}
            print(variant, results[variant], flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--cpu", action="store_true", help="use CPU/gloo even when CUDA is present")
    p.add_argument("--variants", nargs="+", default=["ours", "torch_fsdp2", "ddp"])
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    results = run(args)
    if "ours" in results:
        for other in ("torch_fsdp2", "ddp", "local"):
            if other in results:
                keys = ("step_s", "peak_mb", "model_peak_mb")
                r = {k: results["ours"][k] / results[other][k] for k in keys if results[other][k]}
                print(f"ours / {other}: " + ", ".join(f"{k} {v:.3f}x" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
