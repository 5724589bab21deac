"""torch's operator database through our DTensor with the placements of tensor parallelism, on 2 ranks.

Uses the harness of ``benchmarks/dtensor_opdb.py`` with its ``--placements`` modes other than the default
(Replicate, then Shard(0)): every tensor argument of 2+ dims on dim 1 (``shard1``), every one on its last dim
(``shard_last``), the first on its last dim and the others Replicate (``mixed``), the arguments in turn on
their last dim and on dim 0 (``alternate``). The samples' odd sizes give uneven shards on 2 ranks. Each run is
compared with the plain op on the same sample. The quick tests cover the op families real models use (views,
the matmul family, reductions, softmax and norms, indexing, cat/stack, where) and each op a mode found wrong;
the whole database in every mode runs under ``-m slow``.
"""

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

from lightning_shard import init_device_mesh
from lightning_shard.tensor import DTensor, Shard, distribute_tensor
from tests.harness import distributed

pytest.importorskip("expecttest")  # torch.testing._internal imports it

MODES = ("shard1", "shard_last", "mixed", "alternate")

SUBSET = [
    "reshape", "transpose", "matmul", "addmm", "nn.functional.linear",
    "sum", "mean", "softmax", "nn.functional.layer_norm",
    "index_select", "cat", "stack", "where", "unbind_copy",
]  # fmt: skip


def _harness():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "dtensor_opdb.py"
    spec = importlib.util.spec_from_file_location("dtensor_opdb", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(names, modes):
    h = _harness()
    mesh = init_device_mesh("cpu", (2,))
    lib = h._libs(mesh, mesh.to_torch())["ours"]
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for opinfo in h.select_ops(names):
            for mode in modes:
                results[h.op_key(opinfo), mode] = h.run_op(opinfo, "ours", lib, 3, placements=mode)
    # torch's op database disables torch.backends' global flags; later tests in this reused worker set them
    # (see tests/test_dtensor_opdb.py).
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return results


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


@distributed(world_size=2, timeout=600)
def test_op_database_subset_in_tensor_parallel_placements():
    results = _run(SUBSET, MODES)
    assert len(results) >= (len(SUBSET) - 2) * len(MODES), sorted(results)  # names that left op_db
    bad = {k: r for k, r in results.items() if r[0] not in ("clean", "fallback")}
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@distributed(world_size=2, timeout=7200)
def test_full_op_database_in_tensor_parallel_placements_has_no_wrong_result(mode):
    results = _run(None, (mode,))
    wrong = {k: r for k, r in results.items() if r[0] == "wrong"}
    assert not wrong, wrong
