"""lightning_shard.comm: the collective wrappers' own choices, checked against torch.distributed on gloo ranks."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_shard import comm, init_device_mesh
from tests.harness import distributed


def _gloo_reduce_scatter(x: torch.Tensor, op: str, group) -> torch.Tensor:
    """gloo's own reduce-scatter of ``x`` (this process's chunk), the reference for the pairwise one."""
    out = x.new_empty(x.numel() // dist.get_world_size(group))
    reduce_op = dist.ReduceOp.SUM if op == "avg" else comm.REDUCE_OPS[op]
    dist.reduce_scatter_tensor(out, x.clone(), op=reduce_op, group=group)
    return out / dist.get_world_size(group) if op == "avg" else out


def _check_pairwise_equals_gloo(group, exact_sum: bool) -> None:
    g = torch.Generator().manual_seed(dist.get_rank())
    size = dist.get_world_size(group)
    assert comm._runs_pairwise(torch.ones(1), group)
    for dtype in (torch.float32, torch.bfloat16):
        for chunk_numel in (1, 1001, (1 << 16) + 3):
            x = torch.randn(size, chunk_numel, generator=g).to(dtype).view(-1)
            for op in ("sum", "avg", "max", "min"):
                expected = _gloo_reduce_scatter(x, op, group)
                for async_op in (False, True):
                    out = torch.full_like(expected, float("nan"))
                    staged = x.clone()
                    with comm.count_collectives() as counts:
                        work = comm.reduce_scatter_into(out, staged, group, op, async_op=async_op)
                    if async_op:
                        work.wait()
                    else:
                        assert work is None
                    assert torch.equal(staged, x), "the input is left as it was"
                    assert counts.calls == {"reduce_scatter": 1}
                    assert counts.bytes["reduce_scatter"] == x.numel() * x.element_size()
                    if exact_sum or op in ("max", "min"):
                        assert torch.equal(out, expected), (dtype, chunk_numel, op)
                    else:  # another summation order than gloo's over more than two ranks: a few roundings apart
                        tol = {"atol": 0.1, "rtol": 0.02} if dtype == torch.bfloat16 else {}
                        torch.testing.assert_close(out, expected, msg=str((dtype, chunk_numel, op)), **tol)
            shard = x[:chunk_numel].clone()
            expected = x.new_empty(size * chunk_numel)
            dist.all_gather_into_tensor(expected, shard, group=group)
            for in_output in (False, True):  # the input apart, or already this rank's chunk of the output
                out = torch.full_like(expected, float("nan"))
                rank = dist.get_group_rank(group, dist.get_rank())
                inp = out.view(size, -1)[rank] if in_output else shard
                inp.copy_(shard)
                comm.all_gather_into(out, inp, group, async_op=True).wait()
                assert torch.equal(out, expected), (dtype, chunk_numel, in_output)


@distributed(world_size=4)
def test_pairwise_collectives_equal_gloos_own_on_a_sub_group_and_the_world():
    # A 2x2 mesh: the "data_parallel" groups are {0, 2} and {1, 3}, so the group rank differs from the global
    # rank on ranks 1, 2, 3 (chunks must be picked by group rank). On two ranks the sum is gloo's bit for bit.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    _check_pairwise_equals_gloo(mesh.get_group("data_parallel"), exact_sum=True)
    _check_pairwise_equals_gloo(dist.group.WORLD, exact_sum=False)


@distributed(world_size=2)
def test_pairwise_gathers_and_reductions_in_flight_together_do_not_mix():
    # FSDP has a prefetch all-gather and a reduce-scatter in flight on one group at once; their messages have
    # the same sizes here, so a receive matched to the other kind's send would show as a wrong value.
    group, rank = dist.group.WORLD, dist.get_rank()
    shard = torch.full((8,), float(rank + 1))
    staged = torch.arange(16, dtype=torch.float32) * (rank + 1)
    gathered, reduced = torch.empty(16), torch.empty(8)
    first = comm.all_gather_into(gathered, shard, group, async_op=True)
    second = comm.reduce_scatter_into(reduced, staged, group, async_op=True)
    third = comm.all_gather_into(torch.empty(16), shard * 10, group, async_op=True)
    second.wait(), first.wait(), third.wait()
    assert torch.equal(gathered, torch.cat([torch.full((8,), 1.0), torch.full((8,), 2.0)]))
    assert torch.equal(reduced, torch.arange(16, dtype=torch.float32).view(2, 8)[rank] * 3)


@pytest.mark.parametrize(
    ("config", "device", "pairwise"),
    [
        ("cpu:gloo,cuda:gloo", "cpu", True),  # a gloo world
        ("cpu:gloo,cuda:nccl", "cpu", True),  # an accelerator mesh's group carrying a host tensor
        ("cpu:gloo,cuda:nccl", "meta", False),  # ... and an accelerator tensor: NCCL's reduce-scatter
        ("cuda:nccl", "meta", False),
    ],
)
def test_only_host_tensors_on_a_gloo_backend_run_pairwise(monkeypatch, config, device, pairwise):
    # A GPU mesh's groups are "cpu:gloo,cuda:nccl": the choice of path must follow the backend of the tensor's
    # device. (Deciding by "gloo" in the backend name sent FSDP's GPU gradients from 4 MiB to an NCCL all-reduce,
    # twice the bytes of a reduce-scatter.) "meta" stands for the accelerator: anything but the host.
    group = object()
    monkeypatch.setattr(dist, "get_backend_config", lambda g: config if g is group else "gloo")
    try:
        assert comm._runs_pairwise(torch.empty(4, device=device), group) is pairwise
    finally:
        comm._SERVED.pop(id(group), None)


def test_a_pairwise_wait_that_failed_fails_again_and_never_reduces():
    # A receive from a peer that is gone raises; waiting once more must not report the collective finished (nor
    # run the local reduction on a half-received buffer).
    class Gone:
        def wait(self):
            raise RuntimeError("peer gone")

    reduced = []
    work = comm.PairwiseWork([Gone()], finish=lambda: reduced.append(True))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="peer gone"):
            work.wait()
    assert not reduced and not work.is_completed()


def test_a_pairwise_wait_gives_its_timeout_to_the_sends_and_receives():
    # Work.wait(timeout) bounds the whole wait; the pairwise handle dropped the timeout, so a caller's bound on a
    # collective whose peer never arrives became the group's (30 minutes by default).
    given = []

    class Recorded:
        def wait(self, *timeout):
            given.append(timeout)
            time.sleep(0.05)

    assert comm.PairwiseWork([Recorded(), Recorded()]).wait(timedelta(seconds=5))
    first, second = (t[0] for t in given)
    assert timedelta(seconds=4.9) < first <= timedelta(seconds=5) and second < first - timedelta(seconds=0.04)
    given.clear()
    comm.PairwiseWork([Recorded()]).wait()
    assert given == [()]  # no timeout asked: the group's own
