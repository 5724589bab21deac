"""Full disks and I/O errors during save: the error names the OS error, the path and the bytes needed; the
temp dir is removed on every failure path; the previous checkpoint stays loadable; the next save that fits
succeeds. On a real 20 MB tmpfs (skipped where mounting is not allowed) and with injected errors on 2 ranks."""

import errno
import glob
import os
import subprocess

import pytest
import torch
import torch.distributed as dist

from lightning_shard.checkpoint import CheckpointError, CheckpointWriteError, load, save
from tests.harness import distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group


def _state(mib: float, value: float):
    n = int(mib * 2**20 / 4)
    return {"model": {"w": torch.full((n,), value)}, "step": int(value)}


def _loaded(path: str, like):
    state = {"model": {"w": torch.zeros_like(like["model"]["w"])}, "step": 0}
    load(state, path)
    return state


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command")
    if run.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not allowed here: {run.stderr.decode().strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_on_a_small_tmpfs(small_disk):
    path = os.path.join(small_disk, "ckpt")
    save(_state(6, 1.0), path)  # the previous checkpoint: 6 MiB
    with pytest.raises(CheckpointWriteError) as err:
        save(_state(16, 2.0), path)  # 6 + 16 MiB > 20 MiB: the disk fills up
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC, message
    assert "ENOSPC" in message and path in message and "needs about 16777216 bytes" in message, message
    assert glob.glob(path + ".tmp-*") == [], "the failed save's temp dir was left behind"
    assert _loaded(path, _state(6, 0.0))["step"] == 1  # the previous checkpoint is intact
    save(_state(8, 3.0), path)  # fits next to the previous one: succeeds
    state = _loaded(path, _state(8, 0.0))
    assert state["step"] == 3 and torch.equal(state["model"]["w"], _state(8, 3.0)["model"]["w"])


def test_stale_temp_dirs_of_a_crashed_save_do_not_fill_the_disk(small_disk):
    path = os.path.join(small_disk, "ckpt")
    save(_state(6, 1.0), path)
    os.makedirs(path + ".tmp-00000000000001")  # a save killed mid-write left 9 MiB behind
    with open(os.path.join(path + ".tmp-00000000000001", "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * (9 * 2**20))
    save(_state(8, 2.0), path)  # 6 + 9 + 8 > 20 MiB unless the stale temp dir is removed first
    assert _loaded(path, _state(8, 0.0))["step"] == 2 and not glob.glob(path + ".tmp-*")


def _shared(tmp_path, name):
    box = [str(tmp_path / name) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


@distributed(world_size=2)
def test_injected_write_errors_on_one_rank(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_shard.checkpoint import save_load

    path = _shared(tmp_path, "ckpt")
    save(_state(0.1, 1.0), path)
    original = FileSystemWriter.write_data

    # 1. rank 1's writer fails with EIO while writing its shard: both ranks raise, naming the OS error
    def failing_write(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(errno.EIO, "Input/output error", os.path.join(self.path, "__1_0.distcp"))
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", failing_write)
    with pytest.raises(CheckpointWriteError) as err:
        save(_state(0.1, 2.0), path)
    assert err.value.errno == errno.EIO and "EIO" in str(err.value) and "__1_0.distcp" in str(err.value)
    assert path in str(err.value) and "needs about" in str(err.value)
    monkeypatch.setattr(FileSystemWriter, "write_data", original)
    dist.barrier()
    assert glob.glob(path + ".tmp-*") == []
    assert _loaded(path, _state(0.1, 0.0))["step"] == 1

    # 2. rank 0 runs out of space writing the marker: rank 0 raises ENOSPC, rank 1 hears of it
    real_marker = save_load._write_marker

    def full_disk_marker(tmp, *args):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(tmp, save_load.MARKER))

    monkeypatch.setattr(save_load, "_write_marker", full_disk_marker)
    with pytest.raises((CheckpointWriteError, CheckpointError)) as err:
        save(_state(0.1, 3.0), path)
    assert "ENOSPC" in str(err.value) or "No space left" in str(err.value), str(err.value)
    if dist.get_rank() == 0:
        assert isinstance(err.value, CheckpointWriteError) and err.value.errno == errno.ENOSPC
    monkeypatch.setattr(save_load, "_write_marker", real_marker)
    dist.barrier()
    assert glob.glob(path + ".tmp-*") == []
    assert _loaded(path, _state(0.1, 0.0))["step"] == 1

    # 3. the next save succeeds
    save(_state(0.1, 4.0), path)
    assert _loaded(path, _state(0.1, 0.0))["step"] == 4
