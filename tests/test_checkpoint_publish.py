"""Publishing a sharded checkpoint over an existing one: ``path`` always names a complete checkpoint.

``save`` writes into ``<path>.tmp-<id>`` and then publishes it. Over an existing checkpoint it swaps the two
directories in one atomic step (Linux ``renameat2`` with ``RENAME_EXCHANGE``), so no crash can leave ``path``
missing; it used to rename ``path`` away first and the temp dir in second, and a crash between the two left no
checkpoint at ``path`` (Lightning's ``last.ckpt`` is overwritten at every save). Where the filesystem cannot swap,
the two renames remain, and ``load`` names the intact previous checkpoint (tests/test_faults_save.py).
One process, no process group: ``save`` and ``load`` work without one.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import pytest
import torch

from lightning_shard.checkpoint import load, save, save_load


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3, 2), value)}, "step": int(value)}


def _loaded(path: str) -> dict:
    state = _state(0.0)
    load(state, path)
    return state


def _can_swap(tmp_path) -> bool:
    """Whether this system and filesystem swap two directories atomically (asked of libc, not of the code under
    test)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir()
    b.mkdir()
    return renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0  # AT_FDCWD, RENAME_EXCHANGE


def test_overwriting_a_checkpoint_never_renames_it_away(tmp_path, monkeypatch):
    if not _can_swap(tmp_path):
        pytest.skip("this filesystem has no atomic exchange of two paths (renameat2 RENAME_EXCHANGE)")
    path = str(tmp_path / "last")
    save(_state(1.0), path)
    moved_away = []
    replace = os.replace

    def spy(src, dst, *args, **kwargs):
        if os.fspath(src) == path:
            moved_away.append(os.fspath(dst))
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    save(_state(2.0), path)
    assert moved_away == [], f"{path} was renamed to {moved_away}: it did not exist for a moment"
    assert _loaded(path)["step"] == 2
    assert torch.equal(_loaded(path)["model"]["w"], torch.full((3, 2), 2.0))
    assert glob.glob(path + ".*") == []  # neither the temp dir nor the previous checkpoint is left


def test_an_exit_right_after_the_swap_leaves_the_new_checkpoint(tmp_path, monkeypatch):
    if not _can_swap(tmp_path):
        pytest.skip("this filesystem has no atomic exchange of two paths (renameat2 RENAME_EXCHANGE)")
    path = str(tmp_path / "last")
    save(_state(1.0), path)
    exchange = save_load._exchange

    def swap_then_die(a, b):
        exchange(a, b)
        raise SystemExit("killed after the swap")

    monkeypatch.setattr(save_load, "_exchange", swap_then_die)
    with pytest.raises(SystemExit):
        save(_state(2.0), path)
    monkeypatch.setattr(save_load, "_exchange", exchange)
    assert _loaded(path)["step"] == 2
    save(_state(3.0), path)  # a stale temp dir (the previous checkpoint, had the process been killed) goes
    assert _loaded(path)["step"] == 3
    assert glob.glob(path + ".*") == []


def test_without_the_swap_two_renames_publish_it(tmp_path, monkeypatch):
    monkeypatch.setattr(save_load, "_exchange", lambda a, b: False)
    path = str(tmp_path / "last")
    save(_state(1.0), path)
    save(_state(2.0), path)
    assert _loaded(path)["step"] == 2
    assert glob.glob(path + ".*") == []
