"""Damaged checkpoints: checksums catch a flipped byte, a truncated file is named, a failed load (on any rank)
modifies nothing, every error is an ``Exception``; dtype casts and missing entries say what is wrong; the
checkpoint code hands collectives only tensors on the device their group serves."""

import inspect
import os

import pytest
import torch
import torch.distributed as dist

from lightning_shard.checkpoint import (
    consolidate,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
)
from lightning_shard.checkpoint._safe_io import SafeFileSystemReader
from tests.fsdp_models import batches, full_state, loss_fn, make_model, make_optimizer, rank_slice
from tests.harness import distributed
from tests.test_checkpoint import _fsdp, _mesh, _snapshot

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group


def _entry(path: str, fqn: str | None = None, file_prefix: str = ""):
    """(file, offset, length) of the saved entry ``fqn`` (or the largest tensor entry in files ``file_prefix*``)."""
    md = SafeFileSystemReader(path).read_metadata()
    items = [
        (idx, info)
        for idx, info in md.storage_data.items()
        if (fqn is None or idx.fqn == fqn) and info.relative_path.startswith(file_prefix) and idx.offset is not None
    ]
    idx, info = max(items, key=lambda it: it[1].length)
    return os.path.join(path, info.relative_path), info.offset, info.length, idx.fqn


def _flip_byte(file: str, pos: int) -> None:
    with open(file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))


def _truncate(file: str, drop: int) -> None:
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - drop)


def _plain_state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "optimizer": {"state": {"w": {"exp_avg": torch.randn(64, 32, generator=g)}}},
        "step": seed,
    }


def _clone(state):
    return {
        k: (_clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v)
        for k, v in state.items()
    }


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{k} changed by a failed load"
        else:
            assert a[k] == b[k], k


def test_flipped_byte_is_detected_by_load_and_consolidation(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    save(_plain_state(1), path)
    file, offset, length, fqn = _entry(path, "model.w")
    _flip_byte(file, offset + length // 2)  # inside the tensor's data record

    target = _plain_state(2)
    before = _clone(target)
    with pytest.raises(Exception, match=r"__0_0\.distcp.*'model\.w'.*corrupt") as err:
        load(target, path)
    assert type(err.value).__name__ == "CheckpointCorruptError" and isinstance(err.value, RuntimeError)
    _assert_same(before, target)

    out = str(tmp_path / "out.pt")
    with pytest.raises(Exception, match=r"__0_0\.distcp.*'model\.w'.*corrupt"):
        consolidate(path, out)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")
    from lightning_shard.checkpoint._consolidate import main  # the CLI, in-process

    assert main([path, out]) == 1
    err = capsys.readouterr().err
    assert "__0_0.distcp" in err and "model.w" in err, err
    assert not os.path.exists(out)


def test_corrupt_metadata_and_meta_file_are_detected(tmp_path):
    path = str(tmp_path / "ckpt")
    save(_plain_state(1), path, extra_files={"meta.pt": b"x" * 100})
    meta = os.path.join(path, ".metadata")
    size = os.path.getsize(meta)
    _flip_byte(meta, size - 5)
    with pytest.raises(Exception, match=r"\.metadata is corrupt"):
        load(_plain_state(2), path)


def test_truncated_shard_is_named_and_nothing_changes(tmp_path):
    path = str(tmp_path / "ckpt")
    save(_plain_state(1), path)
    file, _, _, _ = _entry(path, "model.w")
    _truncate(file, 200)
    target = _plain_state(2)
    before = _clone(target)
    with pytest.raises(Exception, match=r"__0_0\.distcp is truncated") as err:
        load(target, path)
    assert isinstance(err.value, Exception)
    _assert_same(before, target)
    with pytest.raises(Exception, match="truncated"):
        consolidate(path, str(tmp_path / "out.pt"))


def test_dtype_casts_and_missing_entries_say_what_is_wrong(tmp_path):
    path = str(tmp_path / "bf16")
    saved = {k: v.to(torch.bfloat16) for k, v in _plain_state(1)["model"].items()}
    save({"model": saved}, path)
    # bf16 -> fp32 is exact: loaded (as torch's DCP does), values equal to the saved ones
    target = {"model": {k: torch.zeros(v.shape) for k, v in saved.items()}}
    load(target, path)
    for k, v in saved.items():
        assert target["model"][k].dtype == torch.float32 and torch.equal(target["model"][k], v.float()), k
    # fp32 -> bf16 would round: refused, naming both dtypes, not "another model"
    path32 = str(tmp_path / "fp32")
    save({"model": _plain_state(1)["model"]}, path32)
    narrow = {"model": {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in saved.items()}}
    with pytest.raises(ValueError, match="float32 cannot be loaded into bfloat16") as err:
        load(narrow, path32)
    assert "another model" not in str(err.value)
    # a model-only checkpoint loaded with an optimizer: says the entry is absent
    full = _plain_state(3)
    with pytest.raises(ValueError, match="has no 'optimizer' entry") as err:
        load(full, path32)
    assert "another model" not in str(err.value)


def test_consolidate_checks_its_output_first(tmp_path, capsys):
    from lightning_shard.checkpoint._consolidate import main  # the CLI in-process (test_checkpoint_consolidate.py
    # runs it as `python -m`)

    path = str(tmp_path / "ckpt")
    save(_plain_state(1), path)
    out = tmp_path / "out.pt"
    out.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="overwrite"):
        consolidate(path, str(out))
    assert out.read_bytes() == b"precious"
    assert main([path, str(out)]) == 1
    assert "--overwrite" in capsys.readouterr().err and out.read_bytes() == b"precious"
    assert main([path, str(out), "--overwrite"]) == 0
    assert torch.equal(torch.load(out, weights_only=True)["model"]["w"], _plain_state(1)["model"]["w"])
    os.makedirs(tmp_path / "adir")
    assert main([path, str(tmp_path / "adir")]) == 1
    assert "is a directory" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- 2 ranks
def _trained(mesh):
    model = _fsdp(make_model(), mesh)
    opt = make_optimizer(model, 0.1, "adamw")
    for x, y in batches(2, 4):
        r, w = dist.get_rank(), dist.get_world_size()
        loss = loss_fn(model, rank_slice(x, r, w), rank_slice(y, r, w))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def _shared(tmp_path, name):
    box = [str(tmp_path / name) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


@distributed(world_size=2)
def test_failure_on_one_rank_modifies_nothing_on_any_rank(tmp_path):
    mesh = _mesh()
    model, opt = _trained(mesh)
    target = _fsdp(make_model(seed=9), mesh)
    topt = make_optimizer(target, 0.1, "adamw")
    before = _snapshot(target, topt)

    def state():
        return {"model": get_model_state_dict(target), "optimizer": get_optimizer_state_dict(target, topt)}

    for damage in ("flip", "truncate"):
        path = _shared(tmp_path, damage)
        save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}, path)
        dist.barrier()
        if dist.get_rank() == 0:  # damage rank 1's file only: rank 0 reads its own shards fine
            file, offset, length, _ = _entry(path, file_prefix="__1_")
            _flip_byte(file, offset + length // 2) if damage == "flip" else _truncate(file, 100)
        dist.barrier()
        with pytest.raises(Exception, match=r"__1_0\.distcp") as err:
            load(state(), path)
        assert isinstance(err.value, Exception), type(err.value).__mro__
        expected = "corrupt" if damage == "flip" else "truncated"
        assert expected in str(err.value), str(err.value)
        _assert_params_and_state_unchanged(before, target, topt)


def _assert_params_and_state_unchanged(before, model, opt):
    after = _snapshot(model, opt)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed by a failed load"


_COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "reduce",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
)


@distributed(world_size=2)
def test_checkpoint_collectives_use_the_groups_device(tmp_path, monkeypatch):
    """Every tensor that reaches a torch.distributed collective during save/load is on the device torch's
    object collectives choose for the group (CPU for gloo, the current CUDA device for NCCL), and the
    checkpoint package never builds such a tensor itself (it sends control values as objects, which torch
    places): the code that broadcast CPU tensors on an NCCL group fails the second check."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.distributed_c10d import _get_object_coll_device

    import lightning_shard.checkpoint as ckpt_pkg

    pkg_dir = os.path.dirname(ckpt_pkg.__file__)
    calls = []
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def spy(*args, __original=original, __name=name, **kwargs):
            caller = inspect.stack()[1].filename
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            for a in (*args, *kwargs.values()):
                if isinstance(a, (list, tuple)):
                    tensors += [t for t in a if isinstance(t, torch.Tensor)]
            group = kwargs.get("group")
            calls.append((__name, caller, [t.device for t in tensors], torch.device(_get_object_coll_device(group))))
            return __original(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
        if getattr(c10d, name, None) is original:  # torch's object collectives call the module's own names
            monkeypatch.setattr(c10d, name, spy)
    mesh = _mesh()
    model, opt = _trained(mesh)
    path = _shared(tmp_path, "ckpt")
    save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}, path)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    load(state, path)
    assert any(devices for _, _, devices, _ in calls), f"no tensor reached a collective: {calls}"
    direct = [(n, c) for n, c, _, _ in calls if os.path.dirname(c) == pkg_dir]
    assert direct == [], f"the checkpoint package calls tensor collectives itself: {direct}"
    wrong = [(n, c, d, want) for n, c, devs, want in calls for d in devs if d != want]
    assert wrong == [], wrong
    assert full_state(model)  # the model is still usable


class _Planted:
    """A value whose unpickling would create a directory: the stand-in for code in a crafted checkpoint."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self):
        return (os.makedirs, (self.where,))


def test_a_pickled_object_in_another_tools_checkpoint_is_refused_by_name(tmp_path):
    """torch's own ``dcp.save`` pickles any object; reading it back never unpickles code (``weights_only``), and
    the error says that the entry asks for a Python object (not that the file is damaged), naming the file."""
    import torch.distributed.checkpoint as dcp

    from lightning_shard.checkpoint import CheckpointSecurityError

    path, planted = str(tmp_path / "ckpt"), str(tmp_path / "ran")
    dcp.save({"w": torch.ones(3), "extra": _Planted(planted)}, checkpoint_id=path, no_dist=True)
    target = {"w": torch.zeros(3), "extra": None}
    with pytest.raises(CheckpointSecurityError, match=r"__0_0\.distcp.*'extra'.*Python object"):
        load(target, path)
    assert not os.path.exists(planted)
    assert torch.equal(target["w"], torch.zeros(3)) and target["extra"] is None
    with pytest.raises(CheckpointSecurityError, match=r"__0_0\.distcp.*'extra'"):
        consolidate(path, str(tmp_path / "out.pt"))
    assert not os.path.exists(planted)
