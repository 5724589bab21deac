"""Random ops on DTensors equal, bit for bit, the same op on one device with the same seed, for sharded,
replicated and partial layouts on 2 ranks and a 2x2 mesh; afterwards every rank's RNG state is the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_shard import init_device_mesh
from lightning_shard.tensor import Partial, Replicate, Shard, distribute_tensor, fallback_counts, reset_fallback_counts
from tests.harness import distributed

R = Replicate()
S0, S1 = Shard(0), Shard(1)

# (name, op on a tensor x holding probabilities in [0.1, 0.9]); each must consume the generator like torch
OPS = [
    ("normal_", lambda x: x.normal_(1.0, 2.0)),
    ("uniform_", lambda x: x.uniform_(-1.0, 3.0)),
    ("bernoulli_float", lambda x: x.bernoulli_(0.3)),
    ("bernoulli_tensor", lambda x: x.bernoulli_(x.detach().clone())),
    ("bernoulli", lambda x: torch.bernoulli(x)),
    ("exponential_", lambda x: x.exponential_(1.5)),
    ("random_", lambda x: x.random_(0, 10)),
    ("rand_like", lambda x: torch.rand_like(x)),
    ("randn_like", lambda x: torch.randn_like(x)),
    ("randint_like", lambda x: torch.randint_like(x, 3, 17)),
    ("dropout", lambda x: F.dropout(x, 0.4, training=True)),
    ("native_dropout", lambda x: torch.ops.aten.native_dropout(x, 0.4, True)),
    ("native_dropout_bf16", lambda x: torch.ops.aten.native_dropout(x.bfloat16(), 0.25, True)),
]


def _rng_states_agree() -> bool:
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.get_rng_state().tolist())
    return all(s == states[0] for s in states)


def _check_all(mesh, layouts, shape=(7, 5), seeds=(0, 3)):
    base = torch.rand(shape, generator=torch.Generator().manual_seed(11)) * 0.8 + 0.1
    for placements in layouts:
        for name, op in OPS:
            for seed in seeds:
                x = distribute_tensor(base.clone(), mesh, [R if p.is_partial() else p for p in placements])
                if any(p.is_partial() for p in placements):
                    x = x.redistribute(mesh, placements)
                torch.manual_seed(seed)
                got = op(x)
                state_got = torch.get_rng_state()
                torch.manual_seed(seed)
                want = op(base.clone())
                state_want = torch.get_rng_state()
                got = got if isinstance(got, tuple) else (got,)
                want = want if isinstance(want, tuple) else (want,)
                for g, w in zip(got, want):
                    full = g.full_tensor()
                    assert full.dtype == w.dtype and torch.equal(full, w), (name, seed, placements)
                # the generator advanced exactly as on one device, and alike on every rank
                assert torch.equal(state_got, state_want), (name, placements)
                torch.set_rng_state(state_got)
                assert _rng_states_agree(), (name, placements)


@distributed(world_size=2)
def test_random_ops_match_one_device_2ranks():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2,))
    _check_all(mesh, [[S0], [S1], [R], [Partial()]])
    _check_all(mesh, [[S0]], shape=(1, 3), seeds=(5,))  # rank 1 holds an empty shard
    # dropout inside autograd: forward and gradient equal one device's
    base = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    x = distribute_tensor(base.clone().requires_grad_(), mesh, [S1])
    torch.manual_seed(9)
    y = F.dropout(x, 0.5, training=True) * 3
    y.sum().backward()
    ref = base.clone().requires_grad_()
    torch.manual_seed(9)
    ry = F.dropout(ref, 0.5, training=True) * 3
    ry.sum().backward()
    assert torch.equal(y.full_tensor(), ry) and torch.equal(x.grad.full_tensor(), ref.grad)
    assert fallback_counts() == {}, fallback_counts()


@distributed(world_size=4)
def test_random_ops_match_one_device_2x2_mesh():
    reset_fallback_counts()
    mesh = init_device_mesh("cpu", (2, 2))
    _check_all(mesh, [[S0, S1], [S0, S0], [R, S1], [Partial(), S0]], seeds=(1,))
    assert fallback_counts() == {}, fallback_counts()
