"""Self-checks of the kernels against the plain-torch reference (used by the test suites).

Lives in the package (not in ``tests/``) so that the CPU tests, the CUDA-simulator
subprocess and the GPU tests share one definition of "matches the reference",
and so that the FSDP layer can run the same check on a new machine.

Example::

    >>> from numba_kernels.testing import check_against_reference
    >>> n = check_against_reference("cpu", "cpu", world_sizes=(1, 3), seed=0)
    >>> n > 0
    True
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence

import torch

from . import ops
from . import reference as ref
from .layout import GroupLayout

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bit-exact equality, except that any NaN matches any NaN (payloads are not part of the contract).

    >>> assert_bits_equal(torch.tensor([float("nan"), -0.0]), torch.tensor([float("nan"), -0.0]))
    """
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    an, en = torch.isnan(a), torch.isnan(e)
    if not torch.equal(an, en):
        raise AssertionError(f"{what}: NaN positions differ")
    ab, eb = a.view(_BITS[a.dtype]), e.view(_BITS[e.dtype])
    bad = (ab != eb) & ~an
    if bool(bad.any()):
        idx = torch.nonzero(bad.reshape(-1))[0].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements differ, first at flat index {idx}: "
            f"{a.reshape(-1)[idx].item()!r} vs expected {e.reshape(-1)[idx].item()!r}"
        )


def random_shapes(rng: random.Random, n: int) -> list[tuple[int, ...]]:
    """Small shapes mixing 1-D/2-D/3-D, uneven and tiny dim 0, and zero-size parameters.

    >>> len(random_shapes(random.Random(0), 5))
    5
    """
    shapes: list[tuple[int, ...]] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.1:
            shapes.append((0,) if rng.random() < 0.5 else (0, rng.randint(1, 4)))
        elif kind < 0.2:
            shapes.append((rng.randint(1, 5), 0, 3))
        elif kind < 0.45:
            shapes.append((rng.randint(1, 40),))
        elif kind < 0.8:
            shapes.append((rng.randint(1, 13), rng.randint(1, 9)))
        else:
            shapes.append((rng.randint(1, 7), rng.randint(1, 4), rng.randint(1, 5)))
    return shapes


_SPECIALS = [
    float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -3e-39, 6e-8, 3e-5, 65504.0, 65519.0,
    65520.0, -70000.0, 3.3895314e38, 1.0 + 2**-8, 1.0 + 3 * 2**-9,
]  # fmt: skip


def random_values(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Normal values at several scales, with NaN/Inf/-0/subnormals/overflow-to-Inf cases mixed in."""
    x = torch.randn(tuple(shape), generator=gen) * (10.0 ** torch.randint(-6, 6, tuple(shape), generator=gen))
    flat = x.view(-1)
    if flat.numel():
        k = max(1, flat.numel() // 8)
        pos = torch.randint(0, flat.numel(), (k,), generator=gen)
        vals = torch.tensor(_SPECIALS)[torch.randint(0, len(_SPECIALS), (k,), generator=gen)]
        flat[pos] = vals
    return x.to(dtype).to(device)


def _cases(full: bool) -> Iterable[tuple[torch.dtype, torch.dtype]]:
    return itertools.product(DTYPES, DTYPES) if full else [
        (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16), (torch.float32, torch.float32),
    ]  # fmt: skip


def check_against_reference(
    impl: str,
    device: str,
    world_sizes: Iterable[int] = range(1, 9),
    seed: int = 0,
    n_params: int = 6,
    full: bool = True,
) -> int:
    """Run every op/form/dtype pair/divisor/accumulate combination against the reference.

    Raises ``AssertionError`` on the first mismatch; returns the number of comparisons.
    ``full=False`` checks a representative subset of dtype pairs (for the slow simulator).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    count = 0
    for ws in world_sizes:
        layout = GroupLayout(random_shapes(rng, n_params), ws)
        ws_, S = layout.world_size, layout.shard_numel
        for in_dt, out_dt in _cases(full):
            tag = f"ws={ws} shapes={[tuple(s) for s in layout.shapes]} {in_dt}->{out_dt}"
            # all-gather copy-in: flat and list form, first and last rank
            for rank in {0, ws - 1, rng.randrange(ws)}:
                shards = [
                    random_values(gen, layout.local_shape(i, rank), in_dt, device) for i in range(len(layout.shapes))
                ]
                flat = random_values(gen, (S,), in_dt, device)
                for src in (flat, shards):
                    a = random_values(gen, (ws_, S), out_dt, device)
                    b = a.clone()
                    ops.all_gather_copy_in(layout, src, a, rank, impl=impl)
                    ref.all_gather_copy_in(layout, src, b, rank)
                    assert_bits_equal(a, b, f"all_gather_copy_in {tag} rank={rank} list={isinstance(src, list)}")
                    count += 1
            # all-gather copy-out (same dtype): flat and list outputs
            gathered = random_values(gen, (ws_ * S,), out_dt, device)
            a = random_values(gen, (layout.unsharded_numel,), out_dt, device)
            b = a.clone()
            ops.all_gather_copy_out(layout, gathered, a, impl=impl)
            ref.all_gather_copy_out(layout, gathered, b)
            assert_bits_equal(a, b, f"all_gather_copy_out flat {tag}")
            la = [random_values(gen, s, out_dt, device) for s in layout.shapes]
            lb = [t.clone() for t in la]
            ops.all_gather_copy_out(layout, gathered.view(ws_, S), la, impl=impl)
            ref.all_gather_copy_out(layout, gathered.view(ws_, S), lb)
            for i, (x, y) in enumerate(zip(la, lb)):
                assert_bits_equal(x, y, f"all_gather_copy_out list[{i}] {tag}")
            count += 2
            # reduce-scatter copy-in: flat / list / list with None, divisor on/off
            grads = [random_values(gen, s, in_dt, device) for s in layout.shapes]
            with_none = [None if rng.random() < 0.3 else g for g in grads]
            flat_grads = random_values(gen, (layout.unsharded_numel,), in_dt, device)
            for src, div in itertools.product((flat_grads, grads, with_none), (None, 3.0, 0.1)):
                a = random_values(gen, (ws_, S), out_dt, device)
                b = a.clone()
                ops.reduce_scatter_copy_in(layout, src, a, predivide=div, impl=impl)
                ref.reduce_scatter_copy_in(layout, src, b, predivide=div)
                assert_bits_equal(a, b, f"reduce_scatter_copy_in {tag} div={div}")
                count += 1
            # post-reduce: divisor on/off, accumulate on/off
            reduced = random_values(gen, (S,), in_dt, device)
            for div, acc in itertools.product((None, 3.0, 8.0), (False, True)):
                a = random_values(gen, (S,), out_dt, device)
                b = a.clone()
                ops.post_reduce(layout, reduced, a, postdivide=div, accumulate=acc, impl=impl)
                ref.post_reduce(layout, reduced, b, postdivide=div, accumulate=acc)
                assert_bits_equal(a, b, f"post_reduce {tag} div={div} acc={acc}")
                count += 1
    return count
