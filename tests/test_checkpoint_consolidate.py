"""Consolidation: streaming into torch.load(weights_only=True) and safetensors files, under a memory cap."""

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_shard.checkpoint import consolidate, save

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "U8": torch.uint8}


def _read_safetensors(path):
    """A minimal independent safetensors reader (the format: u64 header size, JSON header, raw bytes)."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    header.pop("__metadata__", None)
    data = blob[8 + n :]
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        raw = torch.frombuffer(bytearray(data[a:b]), dtype=torch.uint8) if b > a else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def _sample_state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(11, 4, generator=g),
            "blocks.0.w": torch.randn(3, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3),
            "count": torch.arange(5),
        },
        "optimizer": {
            "state": {"embed.weight": {"step": torch.tensor(2.0), "exp_avg": torch.randn(11, 4, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["embed.weight"]}],
        },
        "step": 7,
        "rng": torch.get_rng_state(),
    }


def _assert_tree_equal(a, b, where="state"):
    assert type(a) is type(b) or (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list))), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_consolidate_torch_and_safetensors_and_cli(tmp_path, capsys):
    state = _sample_state()
    ckpt = str(tmp_path / "ckpt")
    save(state, ckpt)
    out = str(tmp_path / "full.pt")
    consolidate(ckpt, out)
    _assert_tree_equal(torch.load(out, weights_only=True), state)
    _assert_tree_equal(torch.load(out, weights_only=True, mmap=True), state)

    st = str(tmp_path / "model.safetensors")
    consolidate(ckpt, st, safetensors=True)
    _assert_tree_equal(_read_safetensors(st), state["model"])

    cli = str(tmp_path / "cli.pt")
    env = dict(os.environ, PYTHONPATH=_ROOT)
    run = subprocess.run([sys.executable, "-m", "lightning_shard.checkpoint.consolidate", ckpt, cli], env=env)
    assert run.returncode == 0
    _assert_tree_equal(torch.load(cli, weights_only=True), state)
    from lightning_shard.checkpoint._consolidate import main  # the failing path in-process

    assert main([str(tmp_path / "nope"), cli]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_consolidate_costs_linear_in_the_number_of_entries(tmp_path, monkeypatch):
    # Consolidation loads one key at a time. Parsing DCP's whole index on each load, and handing each load the
    # whole index (torch's planner builds the set of its keys on every load), made it quadratic in the number of
    # entries: the MiniLM example's 436 entries spent 38 of 44 s unpickling the same index, and a model with
    # 12 000 entries 30 s more in the planner.
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from lightning_shard.checkpoint import _safe_io

    n = 20
    state = {"model": {f"layers.{i}.w": torch.full((3,), float(i)) for i in range(n)}, "step": 1}
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    save(state, ckpt)
    parses, index_keys_per_load = [], []
    parse = _safe_io.load_metadata
    monkeypatch.setattr(_safe_io, "load_metadata", lambda f: parses.append(1) or parse(f))
    plan = DefaultLoadPlanner.create_local_plan

    def counting_plan(self):
        index_keys_per_load.append(len(self.metadata.state_dict_metadata))
        return plan(self)

    monkeypatch.setattr(DefaultLoadPlanner, "create_local_plan", counting_plan)
    consolidate(ckpt, out)
    assert len(parses) == 1
    assert len(index_keys_per_load) == n + 1 and max(index_keys_per_load) == 1  # each load sees its own key
    _assert_tree_equal(torch.load(out, weights_only=True), state)


# A child process: cap the address space at (what it uses after imports) + BUDGET, then either load the whole
# checkpoint at once ("naive") or consolidate it ("stream"). Exit 0 on success, 3 on MemoryError.
_CHILD = textwrap.dedent(
    """
    import resource, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from lightning_shard.checkpoint import consolidate
    from lightning_shard.checkpoint._safe_io import SafeFileSystemReader, SafeLoadPlanner
    mode, ckpt, out = sys.argv[1:4]
    budget, n, numel = map(int, sys.argv[4:7])
    torch.zeros(1000).sum()  # warm up lazily initialised allocator state
    status = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("Vm")}
    vm, rss0 = status["VmSize"], status["VmRSS"]
    resource.setrlimit(resource.RLIMIT_AS, (vm + budget, vm + budget))
    try:
        if mode == "naive":
            state = {"model": {f"w{i}": torch.empty(numel) for i in range(n)}}
            dcp.load(state, storage_reader=SafeFileSystemReader(ckpt), planner=SafeLoadPlanner(), no_dist=True)
        else:
            consolidate(ckpt, out)
    except (MemoryError, RuntimeError) as e:
        if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        print("out of memory:", type(e).__name__, str(e)[:200])
        sys.exit(3)
    end = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("Vm")}
    print(f"peak address space above the post-import baseline: {(end['VmPeak'] - vm) / 2**20:.0f} MiB; "
          f"peak RSS above it: {(end['VmHWM'] - rss0) / 2**20:.0f} MiB")
    """
)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_consolidate_streams_under_a_memory_cap(tmp_path):
    # 6 tensors of 48 MiB (288 MiB): above glibc's largest mmap threshold, so freed tensors go back to the OS.
    n, numel = 6, 12 * 1024 * 1024
    mib = 1024 * 1024
    budget = 200 * mib  # > one tensor + its read buffers (~3 x 48 MiB), < the whole state (288 MiB)
    ckpt = str(tmp_path / "big")
    save({"model": {f"w{i}": torch.full((numel,), float(i)) + torch.arange(numel) for i in range(n)}}, ckpt)
    out = str(tmp_path / "big.pt")
    env = dict(os.environ, PYTHONPATH=_ROOT, MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1")

    def child(mode):
        args = [sys.executable, "-c", _CHILD, mode, ckpt, out, str(budget), str(n), str(numel)]
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)

    naive = child("naive")
    assert naive.returncode == 3, f"the cap must make loading everything at once fail:\n{naive.stdout}{naive.stderr}"
    streamed = child("stream")
    assert streamed.returncode == 0, streamed.stdout + streamed.stderr
    print(streamed.stdout)
    loaded = torch.load(out, weights_only=True, mmap=True)
    for i in range(n):
        w = loaded["model"][f"w{i}"]
        assert w.shape == (numel,) and w[0].item() == i and w[-1].item() == i + numel - 1
