"""lightning_shard.fsdp.buffers: large CPU buffers are advised to use transparent huge pages."""

import os
import sys

import pytest
import torch

from lightning_shard.fsdp import buffers

THP = "/sys/kernel/mm/transparent_hugepage/enabled"
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists(THP), reason="needs Linux transparent huge pages"
)


def _advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding ``tensor`` carries the MADV_HUGEPAGE flag ("hg" in /proc/self/smaps)."""
    ptr = tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes() // 2
    in_mapping = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                in_mapping = start <= ptr < end
            elif in_mapping and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError("buffer not found in /proc/self/smaps")


@needs_thp
def test_large_cpu_buffers_are_advised_and_small_ones_left_alone(monkeypatch):
    monkeypatch.delenv("LIGHTNING_SHARD_HUGE_PAGES", raising=False)
    buffers._madvise.cache_clear()
    # 40 MiB: above glibc's largest mmap threshold, so a fresh mapping no earlier test has advised.
    big = buffers.empty((10, 1 << 20), torch.float32, torch.device("cpu"))
    assert _advised(big)
    assert big.shape == (10, 1 << 20) and big.dtype == torch.float32


@needs_thp
def test_advice_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LIGHTNING_SHARD_HUGE_PAGES", "0")
    buffers._madvise.cache_clear()
    try:
        big = buffers.empty(10 << 20, torch.float32, torch.device("cpu"))
        assert not _advised(big)
    finally:
        buffers._madvise.cache_clear()


def test_resized_storage_keeps_its_views_valid():
    # The unsharded-parameter path: free the storage, re-allocate it, advise, write through an old view.
    flat = torch.empty(3 << 20)
    view = flat[10:20]
    storage = flat.untyped_storage()
    storage.resize_(0)
    storage.resize_((3 << 20) * 4)
    buffers.advise_huge_pages(storage)
    flat.fill_(2.0)
    assert torch.equal(view, torch.full((10,), 2.0))
