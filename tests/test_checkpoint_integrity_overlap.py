"""Checksums computed on a background thread while the writer writes: large entries (over
``BackgroundHasher.INLINE_BYTES``) are hashed there, and a flipped byte in one is still caught at load and in
consolidation; the digests equal the synchronous ones; an error on the thread fails the save cleanly, on every
rank; torch's zip CRC-32 setting is switched off only while a save writes."""

import glob
import threading

import pytest
import torch
import torch.distributed as dist
from torch.utils.serialization import config as serialization_config

from lightning_shard.checkpoint import _integrity, consolidate, load, save
from lightning_shard.checkpoint._integrity import BackgroundHasher, digest
from tests.harness import distributed
from tests.test_checkpoint_integrity import _entry, _flip_byte
from tests.test_strategy_checkpoint import _shared_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group


def _big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    big = BackgroundHasher.INLINE_BYTES // 4 + 1000  # fp32 elements: just over the inline threshold
    return {
        "model": {"big": torch.randn(big, generator=g), "big2": torch.randn(big, generator=g)},
        "small": torch.randn(8, generator=g),
        "step": seed,
    }


def test_large_entries_are_hashed_on_a_thread_and_a_flip_is_caught(tmp_path, monkeypatch):
    where: dict[str, set] = {}
    fn = _integrity.ALGORITHMS[_integrity.DEFAULT_ALGORITHM]

    def recording(buf):
        where.setdefault(threading.current_thread().name, set()).add(buf.nbytes)
        return fn(buf)

    monkeypatch.setitem(_integrity.ALGORITHMS, _integrity.DEFAULT_ALGORITHM, recording)
    path = str(tmp_path / "ckpt")
    state = _big_state(1)
    save(state, path)
    on_thread = {n for name, sizes in where.items() if name.startswith("checkpoint-hash") for n in sizes}
    assert state["model"]["big"].nbytes in on_thread, where  # hashed beside the writer, not before it

    target = _big_state(2)
    load(target, path)
    assert torch.equal(target["model"]["big"], state["model"]["big"]) and target["step"] == 1

    file, offset, length, fqn = _entry(path, "model.big2")
    with open(file, "rb") as f:
        raw = f.read()
    last = raw.find(state["model"]["big2"][-2:].numpy().tobytes(), offset, offset + length)
    assert last > offset + length // 2
    _flip_byte(file, last + 5)  # the last element: the end of the buffer the thread hashed
    target = _big_state(3)
    before = target["model"]["big2"].clone()
    with pytest.raises(Exception, match=r"'model\.big2'.*corrupt"):
        load(target, path)
    assert torch.equal(target["model"]["big2"], before)
    with pytest.raises(Exception, match=r"'model\.big2'.*corrupt"):
        consolidate(path, str(tmp_path / "out.pt"))


def test_background_digests_equal_synchronous_ones():
    g = torch.Generator().manual_seed(0)
    values = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([10, 300_000, 1, 70_000, 500_000])}
    values["bytes"] = b"x" * 3_000_000
    # a tiny pending budget: submit has to wait for the thread, and the results must not mix up
    hasher = BackgroundHasher(_integrity.DEFAULT_ALGORITHM, inline_bytes=1000, max_pending_bytes=2_000_000)
    try:
        for key, value in values.items():
            hasher.submit(key, value)
        assert hasher.digests() == {k: digest(v) for k, v in values.items()}
    finally:
        hasher.close()
    assert len(set(hasher.digests().values())) == len(values)


def test_an_error_on_the_hashing_thread_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    save(_big_state(1), path)

    def failing(buf):
        if buf.nbytes >= BackgroundHasher.INLINE_BYTES:
            raise MemoryError("hashing failed")
        return "0"

    monkeypatch.setitem(_integrity.ALGORITHMS, _integrity.DEFAULT_ALGORITHM, failing)
    with pytest.raises(OSError, match="hashing failed"):
        save(_big_state(2), path)
    assert not glob.glob(path + ".tmp-*") and serialization_config.save.compute_crc32
    monkeypatch.undo()
    target = _big_state(3)
    load(target, path)  # the previous checkpoint is intact
    assert target["step"] == 1


def test_zip_crc_is_skipped_only_while_saving(tmp_path, monkeypatch):
    seen = []
    real_save = torch.save

    def spy(obj, f, *args, **kwargs):
        seen.append(serialization_config.save.compute_crc32)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    assert serialization_config.save.compute_crc32
    save(_big_state(1), str(tmp_path / "ckpt"))
    assert seen and not any(seen)  # every torch.save of the checkpoint ran without the zip CRC
    assert serialization_config.save.compute_crc32  # restored
    # torch's reader never checks the zip CRC (so skipping it loses nothing): a flipped byte loads silently
    file = str(tmp_path / "t.pt")
    real_save(torch.arange(1000, dtype=torch.float32), file)
    with open(file, "rb") as f:
        pos = f.read().find(torch.tensor([500.0]).numpy().tobytes())
    _flip_byte(file, pos + 3)
    assert torch.load(file, weights_only=True)[500].item() != 500.0


@distributed(world_size=2, timeout=120)
def test_a_hashing_error_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    path = _shared_path(tmp_path, "ckpt")
    save(_big_state(1), path)
    original = dict(_integrity.ALGORITHMS)

    def failing(buf):  # rank 0 writes the plain tensors; its thread fails on the large ones
        if buf.nbytes >= BackgroundHasher.INLINE_BYTES:
            raise MemoryError("hashing failed on rank 0")
        return original[_integrity.DEFAULT_ALGORITHM](buf)

    if dist.get_rank() == 0:
        _integrity.ALGORITHMS[_integrity.DEFAULT_ALGORITHM] = failing
    try:
        with pytest.raises(OSError, match="hashing failed on rank 0"):  # on both ranks, no rank left waiting
            save(_big_state(2), path)
    finally:
        _integrity.ALGORITHMS.update(original)
    dist.barrier()
    assert not glob.glob(path + ".tmp-*")
    target = _big_state(3)
    load(target, path)
    assert target["step"] == 1 and torch.equal(target["model"]["big"], _big_state(1)["model"]["big"])
