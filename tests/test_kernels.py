"""numba_kernels: layout, CPU kernels vs the torch reference, the reference vs plain torch, bad input.

The CUDA kernels are covered by ``test_kernels_cudasim.py`` (numba's simulator, in
a subprocess) and by the ``gpu``-marked tests at the end of this file.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import numba_kernels as nk
from numba_kernels import reference as ref
from numba_kernels.testing import DTYPES, assert_bits_equal, check_against_reference, random_shapes, random_values
from shard_pytest import RunIf

# --------------------------------------------------------------------------- layout


def test_layout_matches_torch_chunk() -> None:
    layout = nk.GroupLayout([(5, 3), (4,), (0, 2), (1, 2, 2), torch.Size([9])], world_size=4)
    assert layout.rows_per_shard == (2, 1, 0, 1, 3)
    assert [layout.local_rows(0, r) for r in range(4)] == [2, 2, 1, 0]
    assert layout.padded_shard_numels == (6, 1, 0, 4, 3)
    assert layout.shard_numel == 14
    assert layout.shard_offsets.tolist() == [0, 6, 7, 7, 11]
    assert layout.unsharded_offsets.tolist() == [0, 15, 19, 19, 23]
    assert layout.unsharded_numel == 32
    assert layout.numels == (15, 4, 0, 4, 9)
    for i, shape in enumerate(layout.shapes):
        chunks = torch.chunk(torch.empty(shape), 4, dim=0) if shape[0] else ()
        rows = [c.shape[0] for c in chunks] + [0] * (4 - len(chunks))
        assert [layout.local_rows(i, r) for r in range(4)] == rows


def test_layout_is_immutable() -> None:
    layout = nk.GroupLayout([(4, 4)], 2)
    with pytest.raises(AttributeError):
        layout.world_size = 3
    with pytest.raises(ValueError):
        layout.shard_offsets[0] = 1  # read-only numpy array


@pytest.mark.parametrize(
    ("shapes", "ws", "match"),
    [([()], 2, "0-dim"), ([(2, -1)], 2, "negative"), ([(2,)], 0, "world_size"), ([(2,)], 1.5, "world_size")],
)
def test_layout_bad_input(shapes: list, ws: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        nk.GroupLayout(shapes, ws)


def test_warm_is_idempotent() -> None:
    layout = nk.GroupLayout([(3, 3)], 2)
    layout.warm("cpu", torch.bfloat16, torch.float32)
    layout.warm("cpu", torch.bfloat16, torch.float32)
    layout.warm("cpu", torch.float64, torch.float32)  # float64 takes the reference path: nothing to compile
    with pytest.raises(ValueError, match="param_dtype"):
        layout.warm("cpu", torch.int32, torch.float32)


# --------------------------------------------------------------------------- casts, bit-exact vs torch


def test_cast_16bit_to_f32_exhaustive() -> None:
    """Every bf16 and fp16 bit pattern -> float32 equals torch's conversion."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    layout = nk.GroupLayout([(65536,)], 1)
    for dt in (torch.bfloat16, torch.float16):
        src = bits.view(dt)
        out = torch.empty(65536)
        nk.post_reduce(layout, src, out, impl="cpu")
        assert_bits_equal(out, src.float(), f"{dt}->f32")


def test_cast_f32_to_16bit_vs_torch() -> None:
    """Random float32 bit patterns plus hand-picked edges -> bf16/fp16, equal to torch's RNE."""
    gen = torch.Generator().manual_seed(1)
    rand = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    # Every float32 near the fp16 subnormal/normal/overflow boundaries and bf16 ties.
    edges = []
    for center in (2.0**-25, 2.0**-24, 2.0**-15, 2.0**-14, 65504.0, 65520.0, 1.0, 3.4e38, 1e-40):
        c = torch.tensor([center, -center]).view(torch.int32)
        for s in c.tolist():
            edges.append(torch.arange(s - 70000, s + 70000, dtype=torch.int64))
    edges.append(torch.tensor([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7FC00000, 0x7F800001]))
    all_bits = torch.cat([rand.to(torch.int64)] + edges)
    all_bits = ((all_bits + 2**31) % 2**32 - 2**31).to(torch.int32)
    x = all_bits.view(torch.float32)
    layout = nk.GroupLayout([(x.numel(),)], 1)
    for dt in (torch.bfloat16, torch.float16):
        out = torch.empty(1, x.numel(), dtype=dt)
        nk.reduce_scatter_copy_in(layout, x, out, impl="cpu")
        assert_bits_equal(out[0], x.to(dt), f"f32->{dt}")
        # and with the parallel all-gather copy-in path
        out2 = torch.empty(1, x.numel(), dtype=dt)
        nk.all_gather_copy_in(layout, x, out2, 0, impl="cpu")
        assert_bits_equal(out2, out, f"f32->{dt} copy-in")


def test_bf16_nan_is_quiet_and_keeps_sign() -> None:
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0])
    layout = nk.GroupLayout([(5,)], 1)
    out = torch.empty(1, 5, dtype=torch.bfloat16)
    nk.all_gather_copy_in(layout, x, out, 0, impl="cpu")
    bits = out.view(torch.int16)[0].tolist()
    assert [b & 0xFFFF for b in bits] == [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x8000]


# --------------------------------------------------------------------------- the reference vs plain torch


def _chunks(t: torch.Tensor, ws: int) -> list[torch.Tensor]:
    """torch.chunk on dim 0, padded with empty chunks up to ws (torch.chunk may return fewer)."""
    chunks = list(torch.chunk(t, ws, dim=0)) if t.shape[0] else []
    return chunks + [t[:0]] * (ws - len(chunks))


def _padded(c: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(c.reshape(c.shape[0], math.prod(c.shape[1:])), (0, 0, 0, rows - c.shape[0])).reshape(-1)


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_plain_torch(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for ws in range(1, 9):
        layout = nk.GroupLayout(random_shapes(rng, 5), ws)
        params = [torch.randn(s, generator=gen) for s in layout.shapes]
        R = layout.rows_per_shard
        # reduce-scatter input: per rank, cat of every param's padded chunk (FSDP2's _chunk_cat)
        expected = torch.stack(
            [torch.cat([_padded(_chunks(p, ws)[r], R[i]) for i, p in enumerate(params)]) for r in range(ws)]
        )
        out = torch.full((ws, layout.shard_numel), 7.0)
        ref.reduce_scatter_copy_in(layout, params, out)
        assert torch.equal(out, expected)
        out_div = torch.empty(ws, layout.shard_numel, dtype=torch.bfloat16)
        ref.reduce_scatter_copy_in(layout, [p.clone() for p in params], out_div, predivide=3.0)
        assert torch.equal(out_div, (expected / 3.0).to(torch.bfloat16))
        # all-gather copy-in: row `rank` is the rank's padded shards, cast
        for rank in range(ws):
            ag = torch.zeros(ws, layout.shard_numel, dtype=torch.float16)
            ref.all_gather_copy_in(layout, [_chunks(p, ws)[rank] for p in params], ag, rank)
            assert torch.equal(ag[rank], expected[rank].half())
            others = torch.cat([ag[:rank], ag[rank + 1 :]])
            assert not others.any()
        # all-gather copy-out: back to the full params, flat and list
        full = torch.empty(layout.unsharded_numel)
        ref.all_gather_copy_out(layout, expected, full)
        assert torch.equal(full, torch.cat([p.reshape(-1) for p in params]))
        outs = [torch.empty(s) for s in layout.shapes]
        ref.all_gather_copy_out(layout, expected, outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, params))
        # post-reduce
        red = expected[0].to(torch.bfloat16)
        g = torch.randn(layout.shard_numel, generator=gen)
        g0 = g.clone()
        ref.post_reduce(layout, red, g, postdivide=3.0, accumulate=True)
        assert torch.equal(g, g0 + red.float() / 3.0)
        ref.post_reduce(layout, red, g, postdivide=None, accumulate=False)
        assert torch.equal(g, red.float())


# --------------------------------------------------------------------------- CPU kernels vs the reference


@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_matches_reference(seed: int) -> None:
    assert check_against_reference("cpu", "cpu", world_sizes=range(1, 9), seed=seed) > 0


def test_auto_on_cpu_tensors_uses_cpu_kernel_and_matches() -> None:
    assert check_against_reference("auto", "cpu", world_sizes=(2, 5), seed=7, full=False) > 0


@pytest.mark.slow
def test_serial_kernel_is_compiled_serial() -> None:
    """numba's disk cache files compiled code by function name and signature, not by compile options; the
    serial kernel must not load the parallel one's entry (it did, until it got its own name). A serial kernel
    never starts numba's thread pool: checked in a new process, where nothing else has started it."""
    code = (
        "import numpy as np, numba.np.ufunc.parallel as par\n"
        "from numba_kernels import cpu\n"
        "z = np.zeros(1, np.int64); src = np.arange(4, dtype=np.float32); dst = np.zeros(4, np.float32)\n"
        "cpu.run_blocks(np.array([[0, 0, 0, 4, 0]], np.int64), src, None, z, 0, dst, None, z, 0, total=4)\n"
        "assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]\n"
        "print('thread pool started:', par._is_initialized)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "thread pool started: False" in out.stdout


def test_parallel_path_large_group() -> None:
    """Above the serial threshold the prange kernel runs; uneven shapes across many blocks."""
    gen = torch.Generator().manual_seed(3)
    layout = nk.GroupLayout([(1001, 97), (3,), (77777,), (129, 33, 5)], 3)
    grads = [random_values(gen, s, torch.float32, "cpu") for s in layout.shapes]
    a = torch.empty(3, layout.shard_numel, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    nk.reduce_scatter_copy_in(layout, grads, a, predivide=3.0, impl="cpu")
    ref.reduce_scatter_copy_in(layout, grads, b, predivide=3.0)
    assert_bits_equal(a, b, "rs copy-in")
    full = torch.empty(layout.unsharded_numel, dtype=torch.bfloat16)
    full_ref = torch.empty_like(full)
    nk.all_gather_copy_out(layout, a, full, impl="cpu")
    ref.all_gather_copy_out(layout, a, full_ref)
    assert_bits_equal(full, full_ref, "ag copy-out")
    g, g_ref = torch.randn(layout.shard_numel, generator=gen), None
    g_ref = g.clone()
    nk.post_reduce(layout, a[1], g, postdivide=2.0, accumulate=True, impl="cpu")
    ref.post_reduce(layout, a[1], g_ref, postdivide=2.0, accumulate=True)
    assert_bits_equal(g, g_ref, "post_reduce")


def test_empty_group_and_all_zero_size() -> None:
    for shapes in ([], [(0,), (0, 3)]):
        layout = nk.GroupLayout(shapes, 3)
        out = torch.empty(3, layout.shard_numel)
        nk.reduce_scatter_copy_in(layout, [torch.empty(s) for s in shapes], out)
        nk.all_gather_copy_in(layout, torch.empty(layout.shard_numel), out, 1)
        nk.all_gather_copy_out(layout, out, torch.empty(layout.unsharded_numel))
        nk.post_reduce(layout, torch.empty(layout.shard_numel), torch.empty(layout.shard_numel))


def test_requires_grad_and_views_work() -> None:
    layout = nk.GroupLayout([(4, 2), (3,)], 2)
    params = [torch.randn(4, 2, requires_grad=True), torch.randn(3, requires_grad=True)]
    flat = torch.empty(layout.unsharded_numel)
    views = [flat[:8].view(4, 2), flat[8:]]
    ag = torch.empty(2, layout.shard_numel)
    ref.reduce_scatter_copy_in(layout, [p.detach() for p in params], ag)
    nk.all_gather_copy_out(layout, ag, views)
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in params]))
    out = torch.empty(2, layout.shard_numel)
    nk.reduce_scatter_copy_in(layout, params, out)  # tensors requiring grad are read without autograd
    assert torch.equal(out, ag)


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def layout() -> nk.GroupLayout:
    return nk.GroupLayout([(5, 3), (4,), (8, 5)], world_size=2)


def test_bad_all_gather_copy_in(layout: nk.GroupLayout) -> None:
    S = layout.shard_numel
    out = torch.empty(2, S, dtype=torch.bfloat16)
    shards = [torch.empty(layout.local_shape(i, 1)) for i in range(3)]
    with pytest.raises(ValueError, match=r"rank 2 is out of range"):
        nk.all_gather_copy_in(layout, shards, out, 2)
    with pytest.raises(ValueError, match=r"rank -1 is out of range"):
        nk.all_gather_copy_in(layout, shards, out, -1)
    with pytest.raises(ValueError, match=r"sharded\[2\] has shape \(3, 5\) but the layout expects \(4, 5\)"):
        nk.all_gather_copy_in(layout, shards[:2] + [torch.empty(3, 5)], out, 1)
    with pytest.raises(ValueError, match=r"sharded has 2 entries but the layout has 3 params"):
        nk.all_gather_copy_in(layout, shards[:2], out, 1)
    with pytest.raises(ValueError, match=rf"sharded has shape \({S + 1},\)"):
        nk.all_gather_copy_in(layout, torch.empty(S + 1), out, 1)
    with pytest.raises(ValueError, match=r"out has shape"):
        nk.all_gather_copy_in(layout, torch.empty(S), torch.empty(3, S), 1)
    with pytest.raises(ValueError, match=r"out has dtype torch.float64, which no kernel handles"):
        nk.all_gather_copy_in(layout, torch.empty(S), torch.empty(2, S, dtype=torch.float64), 1, impl="cpu")
    with pytest.raises(ValueError, match=r"out has dtype torch.int32; supported"):
        nk.all_gather_copy_in(layout, torch.empty(S), torch.empty(2, S, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match=r"out is not contiguous"):
        nk.all_gather_copy_in(layout, torch.empty(S), torch.empty(S, 2).t(), 1)
    with pytest.raises(ValueError, match=r"sharded\[1\] has dtype torch.float16 but"):
        bad = [shards[0], shards[1].half(), shards[2]]
        nk.all_gather_copy_in(layout, bad, out, 1)
    with pytest.raises(ValueError, match=r"sharded\[0\] must be a torch.Tensor"):
        nk.all_gather_copy_in(layout, [None, shards[1], shards[2]], out, 1)
    with pytest.raises(ValueError, match=r"impl='cuda' needs CUDA tensors"):
        nk.all_gather_copy_in(layout, torch.empty(S), out, 1, impl="cuda")
    with pytest.raises(ValueError, match=r"impl='gpu' is not one of"):
        nk.all_gather_copy_in(layout, torch.empty(S), out, 1, impl="gpu")


def test_bad_all_gather_copy_out(layout: nk.GroupLayout) -> None:
    S = layout.shard_numel
    g = torch.empty(2, S)
    with pytest.raises(ValueError, match=r"out\[2\] has shape \(7, 5\) but the layout expects \(8, 5\)"):
        nk.all_gather_copy_out(layout, g, [torch.empty(5, 3), torch.empty(4), torch.empty(7, 5)])
    with pytest.raises(ValueError, match=r"out has dtype torch.bfloat16 but gathered has torch.float32"):
        nk.all_gather_copy_out(layout, g, torch.empty(layout.unsharded_numel, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out has shape \(5,\) but the layout expects"):
        nk.all_gather_copy_out(layout, g, torch.empty(5))
    with pytest.raises(ValueError, match=r"gathered has shape"):
        nk.all_gather_copy_out(layout, torch.empty(2, S - 1), torch.empty(layout.unsharded_numel))
    with pytest.raises(ValueError, match=r"out\[1\] is not contiguous"):
        nk.all_gather_copy_out(layout, g, [torch.empty(5, 3), torch.empty(8)[::2], torch.empty(8, 5)])
    with pytest.raises(ValueError, match=r"out\[0\] is on meta but the other buffers are on cpu"):
        nk.all_gather_copy_out(layout, g, [torch.empty(5, 3, device="meta"), torch.empty(4), torch.empty(8, 5)])


def test_bad_reduce_scatter_copy_in(layout: nk.GroupLayout) -> None:
    S = layout.shard_numel
    out = torch.empty(2, S, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"grads\[2\] has shape \(7, 5\) but the layout expects \(8, 5\)"):
        nk.reduce_scatter_copy_in(layout, [torch.empty(5, 3), None, torch.empty(7, 5)], out)
    with pytest.raises(ValueError, match=r"grads has 4 entries"):
        nk.reduce_scatter_copy_in(layout, [None] * 4, out)
    with pytest.raises(ValueError, match=r"grads has shape"):
        nk.reduce_scatter_copy_in(layout, torch.empty(layout.unsharded_numel + 1), out)
    with pytest.raises(ValueError, match=r"predivide must be a number"):
        nk.reduce_scatter_copy_in(layout, [None] * 3, out, predivide="x")
    with pytest.raises(ValueError, match=r"grads\[0\] has dtype torch.int64"):
        nk.reduce_scatter_copy_in(layout, [torch.zeros(5, 3, dtype=torch.long), None, None], out)


def test_bad_post_reduce(layout: nk.GroupLayout) -> None:
    S = layout.shard_numel
    with pytest.raises(ValueError, match=rf"reduced has shape \(2, {S}\)"):
        nk.post_reduce(layout, torch.empty(2, S), torch.empty(S))
    with pytest.raises(ValueError, match=r"out has shape"):
        nk.post_reduce(layout, torch.empty(S), torch.empty(S + 1))
    with pytest.raises(ValueError, match=r"out has dtype torch.float64, which no kernel handles"):
        nk.post_reduce(layout, torch.empty(S), torch.empty(S, dtype=torch.float64), impl="cpu")


def test_failed_validation_writes_nothing(layout: nk.GroupLayout) -> None:
    out = torch.zeros(2, layout.shard_numel)
    with pytest.raises(ValueError):
        nk.reduce_scatter_copy_in(layout, [torch.ones(5, 3), torch.ones(4), torch.ones(9, 5)], out)
    assert not out.any()


# --------------------------------------------------------------------------- real GPU


# Lightning's RunIf: `PL_RUN_CUDA_TESTS=1` (the GPU test plan in docs/gpu.md) keeps only tests marked with it.
gpu = RunIf(min_cuda_gpus=1)


@pytest.mark.gpu
@gpu
def test_gpu_matches_reference() -> None:
    assert check_against_reference("cuda", "cuda", world_sizes=range(1, 9), seed=0) > 0


@pytest.mark.gpu
@gpu
def test_gpu_auto_and_large_group() -> None:
    layout = nk.GroupLayout([(1001, 97), (3,), (77777,), (129, 33, 5)], 3)
    layout.warm("cuda", torch.bfloat16, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for dt in DTYPES:
        grads = [random_values(gen, s, torch.float32, "cuda") for s in layout.shapes]
        a = torch.empty(3, layout.shard_numel, dtype=dt, device="cuda")
        b = torch.empty_like(a)
        nk.reduce_scatter_copy_in(layout, grads, a, predivide=3.0)
        ref.reduce_scatter_copy_in(layout, grads, b, predivide=3.0)
        assert_bits_equal(a, b, f"rs copy-in {dt}")


@pytest.mark.gpu
@gpu
def test_gpu_runs_on_current_stream() -> None:
    layout = nk.GroupLayout([(4096, 64)], 2)
    x = torch.randn(layout.shard_numel, device="cuda")
    out = torch.empty(2, layout.shard_numel, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        nk.all_gather_copy_in(layout, x, out, 1)
        expected = x.to(torch.bfloat16)
    s.synchronize()
    assert torch.equal(out[1], expected)


def test_numpy_free_of_warnings_on_special_values() -> None:
    # the CPU kernel itself must not emit floating-point warnings for NaN/Inf inputs
    layout = nk.GroupLayout([(4,)], 1)
    with np.errstate(all="raise"):
        nk.post_reduce(layout, torch.tensor([np.inf, np.nan, 1.0, 0.0]), torch.zeros(4), postdivide=0.0)
