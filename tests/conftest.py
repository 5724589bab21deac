"""Shared pytest configuration: GPU tests skip without CUDA, worker pools stop at the end."""

import pytest
import torch

from tests.harness import shutdown_pools


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()


@pytest.fixture(autouse=True)
def _rank_zero_only_rank_restored():
    """Tests that run a strategy in the pytest process itself (e.g. the simulator's rank 3 of 8) set Lightning's
    ``rank_zero_only.rank``; restored after each test so that later tests' rank-zero warnings are not silenced."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    saved = rank_zero_only.rank, utils_rank_zero_only.rank
    yield
    rank_zero_only.rank, utils_rank_zero_only.rank = saved
