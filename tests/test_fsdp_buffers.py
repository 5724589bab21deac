"""lightning_shard.fsdp.buffers: large CPU buffers get transparent huge pages and are populated up front."""

import os
import sys

import pytest
import torch

from lightning_shard.fsdp import buffers

THP = "/sys/kernel/mm/transparent_hugepage/enabled"
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists(THP), reason="needs Linux transparent huge pages"
)


def _mapping_field(tensor: torch.Tensor, field: str) -> str:
    """``field`` of the /proc/self/smaps entry of the mapping that holds ``tensor``'s middle byte."""
    ptr = tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes() // 2
    in_mapping = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                in_mapping = start <= ptr < end
            elif in_mapping and head == field + ":":
                return line.split(":", 1)[1].strip()
    raise AssertionError("buffer not found in /proc/self/smaps")


def _advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding ``tensor`` carries the MADV_HUGEPAGE flag ("hg" in its VmFlags)."""
    return "hg" in _mapping_field(tensor, "VmFlags").split()


@needs_thp
def test_large_cpu_buffers_are_advised_huge_pages(monkeypatch):
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
    buffers.populate_pages(storage)
    flat.fill_(2.0)
    assert torch.equal(view, torch.full((10,), 2.0))


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or tuple(map(int, os.uname().release.split(".")[:2])) < (5, 14),
    reason="MADV_POPULATE_WRITE needs Linux >= 5.14",
)
def test_large_cpu_buffers_are_populated_before_first_write(monkeypatch):
    monkeypatch.delenv("LIGHTNING_SHARD_HUGE_PAGES", raising=False)
    buffers._madvise.cache_clear()
    nbytes = 40 << 20  # a fresh mapping (above glibc's largest mmap threshold), never written
    populated = buffers.empty(nbytes // 4, torch.float32, torch.device("cpu"))
    plain = torch.empty(nbytes // 4)
    rss_kb = lambda t: int(_mapping_field(t, "Rss").split()[0])  # noqa: E731
    assert rss_kb(populated) * 1024 >= nbytes - (4 << 20)  # resident already (up to its unaligned ends)
    assert rss_kb(plain) * 1024 < nbytes // 2  # torch.empty alone leaves the pages to first touch
