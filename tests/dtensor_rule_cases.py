"""Shared checks for tables of DTensor rule cases: each op on ``Shard(0)`` and ``Replicate`` inputs (2 ranks)
equals the plain op without the fallback, with the expected output placement."""

import torch

from lightning_shard.tensor import Replicate, Shard, distribute_tensor, fallback_policy


def data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_same(got, want, name):
    """``got`` (DTensors or plain, possibly nested in tuples) equals ``want`` on full values."""
    if isinstance(want, (tuple, list)):
        for g, w in zip(got, want):
            assert_same(g, w, name)
        return
    g = got.full_tensor() if hasattr(got, "full_tensor") else got
    torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4, msg=name)


def check_rules_match_plain(mesh, cases) -> None:
    """``cases``: ``(name, fn, tensor inputs, the output's placement for Shard(0) inputs)``; a ``Replicate``
    input gives a ``Replicate`` output. Runs under ``fallback_policy("error")``.

    Example: ``check_rules_match_plain(mesh, [("rot90", lambda x: torch.rot90(x, 1, (1, 2)), [x], Shard(0))])``.
    """
    for name, fn, inputs, sharded_out in cases:
        want = fn(*inputs)
        for placement in (Shard(0), Replicate()):
            args = [distribute_tensor(t, mesh, [placement]) for t in inputs]
            with fallback_policy("error"):
                got = fn(*args)
            assert_same(got, want, name)
            first = got[0] if isinstance(got, tuple) else got
            expected = sharded_out if placement == Shard(0) else Replicate()
            assert first.placements == (expected,), (name, placement, first.placements)
