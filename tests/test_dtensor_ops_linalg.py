"""Batched matrix rules: factorizations (eig, lu, ldl, geqrf, pinv, householder) and solves (solve,
solve_triangular, cholesky_solve, lu_solve, ldl_solve, triangular_solve, ormqr, lu_unpack). On ``Shard(0)``
batches (uneven: 5 matrices on 2 ranks) and ``Replicate`` inputs they equal the plain op without the
fallback; same-shape operands keep the batch shard."""

import torch

from lightning_shard import init_device_mesh
from lightning_shard.tensor import Replicate, Shard
from tests.dtensor_rule_cases import check_rules_match_plain, data
from tests.harness import distributed

la = torch.linalg


def _cases():
    a = data(5, 4, 4) + 4 * torch.eye(4)  # well conditioned
    b = data(5, 4, 3, seed=1)
    spd = a @ a.mT + torch.eye(4)
    tri = torch.triu(a)
    lu, piv = la.lu_factor(a)
    ld, ldpiv = la.ldl_factor(spd)
    qr, tau = torch.geqrf(data(5, 4, 3, seed=2))
    return [
        # (name, fn, tensor inputs, output keeps Shard(0))
        ("eig", lambda x: la.eigvals(x), [a], True),
        ("lu", lambda x: la.lu(x), [a], True),
        ("ldl_factor", lambda x: la.ldl_factor(x), [spd], True),
        ("geqrf", lambda x: torch.geqrf(x), [b], True),
        ("pinv", lambda x: la.pinv(x), [b], True),
        ("pinverse", lambda x: torch.pinverse(x, rcond=1e-3), [b], True),
        ("solve", lambda x, y: la.solve(x, y), [a, b], True),
        ("solve with a broadcast rhs", lambda x, y: la.solve(x, y), [a, b[0]], False),
        ("lu_solve with a broadcast rhs", lambda x, p, y: la.lu_solve(x, p, y), [lu, piv, b[0]], False),
        ("solve_triangular", lambda x, y: la.solve_triangular(x, y, upper=True), [tri, b], True),
        ("cholesky_solve", lambda y, x: torch.cholesky_solve(y, x), [b, la.cholesky(spd)], True),
        ("triangular_solve", lambda y, x: torch.triangular_solve(y, x), [b, tri], True),
        ("householder_product", lambda x, t: la.householder_product(x, t), [qr, tau], True),
        ("ormqr", lambda x, t, y: torch.ormqr(x, t, y), [qr, tau, data(5, 4, 2, seed=3)], True),
        ("lu_solve", lambda x, p, y: la.lu_solve(x, p, y), [lu, piv, b], True),
        ("ldl_solve", lambda x, p, y: la.ldl_solve(x, p, y), [ld, ldpiv, b], True),
        ("lu_unpack", lambda x, p: torch.lu_unpack(x, p), [lu, piv], True),
    ]


@distributed(world_size=2)
def test_batched_matrix_ops_match_plain_and_keep_batch_shards():
    cases = [(name, fn, inputs, Shard(0) if keeps else Replicate()) for name, fn, inputs, keeps in _cases()]
    check_rules_match_plain(init_device_mesh("cpu", (2,)), cases)
