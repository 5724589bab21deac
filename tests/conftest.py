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
