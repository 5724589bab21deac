"""The distributed test harness itself: results, failures, timeouts and worker reuse."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.harness import distributed, run_distributed


def _sum_of_ranks(expected):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    assert t.item() == expected


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        t = torch.zeros(1)
        dist.recv(t, src=1)  # rank 1 never sends


def _pid_file(path):
    with open(f"{path}.{dist.get_rank()}", "a") as f:
        f.write(f"{os.getpid()}\n")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_runs_on_n_ranks(world_size):
    run_distributed(_sum_of_ranks, world_size, sum(range(world_size)))


def test_failing_rank_traceback_is_reported():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_distributed(_fail_on_rank_one, 2)
    run_distributed(_sum_of_ranks, 2, 1.0)  # a fresh pool replaces the broken one


@pytest.mark.slow
def test_hang_times_out_with_clear_message():
    with pytest.raises(TimeoutError, match=r"did not finish within 5s on ranks \[0\]"):
        run_distributed(_hang_on_rank_zero, 2, timeout=5)
    run_distributed(_sum_of_ranks, 2, 1.0)


def _seed_everything_and_set_a_variable():
    import lightning as L

    L.seed_everything(3)
    os.environ["LIGHTNING_SHARD_TEST_LEAK"] = "1"


def _environment_is_the_workers(pid_path):
    assert "PL_GLOBAL_SEED" not in os.environ and "LIGHTNING_SHARD_TEST_LEAK" not in os.environ
    _pid_file(pid_path)


def test_a_test_bodys_environment_changes_end_with_it(tmp_path):
    # seed_everything's PL_GLOBAL_SEED would otherwise seed every later Trainer's distributed sampler in the worker
    run_distributed(_pid_file, 1, tmp_path / "pids")
    run_distributed(_seed_everything_and_set_a_variable, 1)
    run_distributed(_environment_is_the_workers, 1, tmp_path / "pids")
    pids = (tmp_path / "pids.0").read_text().split()
    assert len(pids) == 2 and pids[0] == pids[1]  # the same worker process


def test_workers_are_reused_between_tests(tmp_path):
    run_distributed(_pid_file, 2, tmp_path / "pids")
    run_distributed(_pid_file, 2, tmp_path / "pids")
    for rank in range(2):
        pids = (tmp_path / f"pids.{rank}").read_text().split()
        assert len(pids) == 2 and pids[0] == pids[1]


@distributed(world_size=2)
def test_decorator_passes_parameters(tmp_path):
    assert tmp_path.exists() and dist.get_world_size() == 2


@pytest.mark.gpu
def test_gpu_marker_skips_without_cuda():
    assert torch.cuda.is_available()


def _assert_with_values():
    got = dist.get_rank() + 40
    assert got == 2


def test_worker_assertions_show_values():
    with pytest.raises(AssertionError, match=r"assert 40 == 2"):
        run_distributed(_assert_with_values, 1)
