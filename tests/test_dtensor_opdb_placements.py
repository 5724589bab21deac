"""torch's operator database through our DTensor with the placements of tensor parallelism, on 2 ranks.

Uses the harness of ``benchmarks/dtensor_opdb.py`` with its ``--placements`` modes other than the default
(Replicate, then Shard(0)): every tensor argument of 2+ dims on dim 1 (``shard1``), every one on its last dim
(``shard_last``), the first on its last dim and the others Replicate (``mixed``), the arguments in turn on
their last dim and on dim 0 (``alternate``), the first argument (if floating) or every floating one as
``Partial("sum")`` (``partial``, ``partial_all``), the first as ``Partial("avg")`` (``partial_avg``). The
samples' odd sizes give uneven shards on 2 ranks. Each run is compared with the plain op on the same sample.
The quick tests cover the op families real models use (views, the matmul family, reductions, softmax and
norms, indexing, cat, where) and each op a mode found wrong or raising; the whole database in every mode runs
under ``-m slow``.
"""

import pytest
import torch

from lightning_shard import init_device_mesh
from lightning_shard.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tests.harness import distributed
from tests.opdb import harness, run_ours

pytest.importorskip("expecttest")  # torch.testing._internal imports it

MODES = ("shard1", "shard_last", "mixed", "alternate", "partial", "partial_all", "partial_avg")

SUBSET = [
    "reshape", "matmul", "nn.functional.linear", "sum", "softmax", "nn.functional.layer_norm", "index_select",
    "cat", "where",
]  # fmt: skip
# The ops a mode found wrong or raising, in that mode.
FOUND = {"unbind_copy": "shard1", "int": "partial", "count_nonzero": "partial", "frexp": "partial"}


def _run(names, modes_of, samples: int = 3):
    """{(op key, mode): (status, detail)} of ``names`` (None: all of op_db), each in ``modes_of(name)``, on the
    first ``samples`` samples."""
    fwd = harness("dtensor_opdb")

    def one(opinfo, lib):
        return {
            (fwd.op_key(opinfo), mode): fwd.run_op(opinfo, "ours", lib, samples, placements=mode)
            for mode in modes_of(opinfo.name)
        }

    return run_ours(names, one)


@distributed(world_size=2)
def test_unbind_copy_along_a_sharded_dim():
    """``unbind_copy`` shares ``unbind``'s rule: the dim to gather is its second argument, not dim 0."""
    mesh = init_device_mesh("cpu", (2,))
    x = torch.arange(4 * 5 * 3, dtype=torch.float32).reshape(4, 5, 3)
    for dim in (1, 2, -1):
        dx = distribute_tensor(x, mesh, [Shard(dim % 3)])
        got = torch.unbind_copy(dx, dim)
        want = torch.unbind_copy(x, dim)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert isinstance(g, DTensor)
            torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=0)


@distributed(world_size=2)
def test_partial_arguments_sum_to_the_sample():
    """The harness's Partial arguments are pending sums of ``x`` whose addends differ from ``x / 2``, so a rule
    that applies a non-linear op to each addend cannot match the plain op by chance."""
    h = harness("dtensor_opdb")
    mesh = init_device_mesh("cpu", (2,))
    lib = h._libs(mesh, mesh.to_torch())["ours"]
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([0, 2])
    first, other, ints = h._distribute(lib, (x, x, index), "partial")
    assert first.placements == (Partial("sum"),) and other.placements == (Replicate(),)
    assert ints.placements == (Replicate(),)  # an index tensor is never a pending sum
    torch.testing.assert_close(first.full_tensor(), x, rtol=0, atol=0)
    addends = [torch.empty_like(x) for _ in range(2)]
    torch.distributed.all_gather(addends, first.to_local())
    assert not torch.allclose(addends[0].abs() + addends[1].abs(), x.abs())
    placements = [t.placements for t in h._distribute(lib, (x, x, index), "partial_all")]
    assert placements == [(Partial("sum"),), (Partial("sum"),), (Replicate(),)]
    avg = h._distribute(lib, (x.clone().fill_(float("inf")), x), "partial_avg")
    assert avg[0].placements == (Partial("avg"),) and torch.isinf(avg[0].full_tensor()).all()
    (avg,) = h._distribute(lib, (x,), "partial_avg")
    torch.testing.assert_close(avg.full_tensor(), x, rtol=0, atol=0)
    torch.distributed.all_gather(addends, avg.to_local())
    assert not torch.allclose((addends[0].abs() + addends[1].abs()) / 2, x.abs())


def _pending_sum(x: torch.Tensor, mesh) -> DTensor:
    """``x`` as a ``Partial("sum")`` of unequal terms on 2 ranks: ``2x`` and ``-x``."""
    return DTensor.from_local(2 * x if torch.distributed.get_rank() == 0 else -x, mesh, [Partial("sum")])


@distributed(world_size=2)
def test_partial_sum_cast_to_integer_and_counted():
    """Truncating or counting each term of a pending sum is not truncating or counting the sum: reduce first."""
    mesh = init_device_mesh("cpu", (2,))
    x = torch.tensor([[0.7, -1.2, 0.0], [2.5, 0.3, -0.6]])
    px = _pending_sum(x, mesh)
    for dtype in (torch.int64, torch.int8, torch.bool):
        torch.testing.assert_close(px.to(dtype).full_tensor(), x.to(dtype), rtol=0, atol=0)
    assert px.to(torch.float64).placements == (Partial("sum"),)  # a float cast stays a pending sum
    torch.testing.assert_close(torch.count_nonzero(px).full_tensor(), torch.count_nonzero(x))
    torch.testing.assert_close(torch.count_nonzero(px, 1).full_tensor(), torch.count_nonzero(x, 1))
    ints = torch.zeros(2, 3, dtype=torch.int64)
    ints.copy_(px.full_tensor())  # the plain reference of a copy_ into an integer DTensor
    dints = distribute_tensor(torch.zeros(2, 3, dtype=torch.int64), mesh, [Replicate()])
    dints.copy_(px)
    torch.testing.assert_close(dints.full_tensor(), ints, rtol=0, atol=0)


@distributed(world_size=2)
def test_frexp_of_a_partial_sum():
    """frexp has two outputs: off the same-layout fast path (a Partial input), the rule must place both."""
    mesh = init_device_mesh("cpu", (2,))
    x = torch.tensor([[0.7, -1.2, 3.0], [0.0, 5.5, -0.25]])
    px = _pending_sum(x, mesh)
    mantissa, exponent = torch.frexp(px)
    want = torch.frexp(x)
    torch.testing.assert_close(mantissa.full_tensor(), want.mantissa, rtol=0, atol=0)
    torch.testing.assert_close(exponent.full_tensor(), want.exponent, rtol=0, atol=0)


@distributed(world_size=2, timeout=600)
def test_op_database_subset_in_tensor_parallel_placements():
    # The common ops on their first sample in every mode (the whole database runs 3 under -m slow); the ops a mode
    # found, on 3 in that mode.
    results = _run(SUBSET, lambda name: MODES, samples=1) | _run(list(FOUND), lambda name: (FOUND[name],))
    assert len(results) >= (len(SUBSET) - 2) * len(MODES) + len(FOUND), sorted(results)  # names that left op_db
    bad = {k: r for k, r in results.items() if r[0] not in ("clean", "fallback")}
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@distributed(world_size=2, timeout=7200)
def test_full_op_database_in_tensor_parallel_placements_has_no_wrong_result(mode):
    results = _run(None, lambda name: (mode,))
    wrong = {k: r for k, r in results.items() if r[0] == "wrong"}
    assert not wrong, wrong
