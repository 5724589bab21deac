"""Crash safety: a rank SIGKILLed during save leaves the previous checkpoint loadable and the partial one refused.

Runs its own process groups (not the shared harness pool): one rank really dies, so the group is unusable after.
"""

import glob
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import traceback
from datetime import timedelta

import pytest
import torch

_CTX = mp.get_context("spawn")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(value: float):
    from lightning_shard import init_device_mesh
    from lightning_shard.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    w = distribute_tensor(torch.full((7, 3), value), mesh, [Shard(0)], src_data_rank=None)
    return {"model": {"w": w, "b": torch.full((2,), value)}, "step": int(value)}


def _worker(rank: int, port: int, path: str, mode: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_shard.checkpoint import load, save

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=15))
    try:
        if mode == "crash":
            save(_state(1.0), path)  # the previous, good checkpoint
            if rank == 1:
                original = FileSystemWriter.write_data

                def write_then_die(self, plan, planner):
                    original(self, plan, planner).wait()  # our shard is on disk, the metadata never will be
                    os.kill(os.getpid(), signal.SIGKILL)

                FileSystemWriter.write_data = write_then_die
            try:
                save(_state(2.0), path)
            except Exception as e:  # rank 0: the peer died mid-save
                with open(out, "w") as f:
                    f.write(f"save failed: {type(e).__name__}")
                os._exit(0)
        else:
            state = _state(0.0)
            load(state, path)
            assert state["step"] == 1
            assert torch.equal(state["model"]["w"].full_tensor(), torch.full((7, 3), 1.0))
            assert torch.equal(state["model"]["b"], torch.full((2,), 1.0))
            # the surviving rank removed the failed save's temp dir
            assert glob.glob(path + ".tmp-*") == [], glob.glob(path + ".tmp-*")
            # a temp dir left by a save where every rank died (complete data, no marker) is refused by name
            partial = path + ".tmp-0123456789abcd"
            dist.barrier()
            if rank == 0:
                shutil.copytree(path, partial)
                os.remove(os.path.join(partial, ".lightning_shard_complete"))
            dist.barrier()
            try:
                load(_state(0.0), partial)
                raise AssertionError("a partial checkpoint was loaded")
            except ValueError as e:
                assert "save that did not finish" in str(e), e
            # Every rank has looked at the stale dir before the next save's rank 0 clears it.
            dist.barrier()
            save(_state(3.0), path)  # a later good save replaces it and removes the stale temp dir
            state = _state(0.0)
            load(state, path)
            assert state["step"] == 3 and not glob.glob(path + ".tmp-*") and not glob.glob(path + ".old-*")
            if rank == 0:
                with open(out, "w") as f:
                    f.write("ok")
        dist.barrier()
    except BaseException:
        with open(out + f".err{rank}", "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    # Skip gloo's teardown: with a peer already gone it can abort() ("terminate called without an active
    # exception"), which would hide the result this process already wrote.
    os._exit(0)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _group(path: str, mode: str, out: str) -> list[int]:
    port = _port()
    procs = [_CTX.Process(target=_worker, args=(r, port, path, mode, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


@pytest.mark.skipif(sys.platform != "linux", reason="uses SIGKILL and fork-free spawn on Linux")
def test_rank_killed_during_save(tmp_path):
    path = str(tmp_path / "ckpt")
    out = str(tmp_path / "result")
    codes = _group(path, "crash", out)
    errs = "".join(_read(f) for f in glob.glob(out + ".err*"))
    assert codes[1] == -signal.SIGKILL, (codes, errs)
    assert _read(out).startswith("save failed"), (codes, errs)
    assert os.path.exists(os.path.join(path, ".lightning_shard_complete"))
    codes = _group(path, "load", out)
    errs = "".join(_read(f) for f in glob.glob(out + ".err*"))
    assert codes == [0, 0] and _read(out) == "ok", (codes, errs)
