"""Checkpoints through the Trainer: sharded and full, resume (also on another device count),
load_from_checkpoint, consolidation (ours and Lightning's tool), bad checkpoints."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import strategies
from lightning_shard.checkpoint._consolidate import main as consolidate_cli
from tests.harness import distributed, run_distributed
from tests.lightning_models import LitGPT
from tests.test_strategy import _trainer


def _full_params(module):
    return {n: p.full_tensor().clone() for n, p in module.named_parameters()}


def _equal(a, b):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst == 0, worst


def _shared_path(tmp_path, name):
    box = [str(tmp_path / name) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)  # every rank must use the same path (tmp_path differs per worker call)
    return box[0]


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@distributed(world_size=2)
def test_save_and_resume_equals_uninterrupted_training(tmp_path, state_dict_type):
    def strategy():
        return strategies.ShardFSDPTPStrategy(state_dict_type=state_dict_type)

    straight = LitGPT()
    _trainer(max_epochs=2, max_steps=-1, strategy=strategy()).fit(straight)
    expected = _full_params(straight)

    ckpt = _shared_path(tmp_path, "ckpt" if state_dict_type == "sharded" else "ckpt.pt")
    first = LitGPT()
    trainer = _trainer(max_epochs=1, max_steps=-1, strategy=strategy())
    trainer.fit(first)
    trainer.save_checkpoint(ckpt)
    assert os.path.isdir(ckpt) == (state_dict_type == "sharded")
    if state_dict_type == "sharded":
        assert os.path.isfile(os.path.join(ckpt, "meta.pt"))
    else:
        full = torch.load(ckpt, weights_only=True)
        assert full["state_dict"]["model.embed.weight"].shape == (101, 16)

    resumed = LitGPT(lr=0.5)  # the optimizer state (incl. lr) and weights come from the checkpoint
    trainer = _trainer(max_epochs=2, max_steps=-1, strategy=strategy())
    trainer.fit(resumed, ckpt_path=ckpt)
    assert trainer.global_step == 16
    _equal(_full_params(resumed), expected)


def _write_sharded_checkpoint(path):
    module = LitGPT()
    trainer = _trainer(max_steps=3)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    params = _full_params(module)  # collective: every rank
    if dist.get_rank() == 0:
        torch.save(params, path + ".expected.pt")


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("two_rank") / "ckpt")
    run_distributed(_write_sharded_checkpoint, 2, path)
    return path


def test_load_from_checkpoint_and_consolidation(two_rank_checkpoint, tmp_path):
    expected = torch.load(two_rank_checkpoint + ".expected.pt", weights_only=True)
    # LightningModule.load_from_checkpoint on the sharded directory (one process, no process group)
    plain = LitGPT.load_from_checkpoint(two_rank_checkpoint)
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), expected[name]), name
    # our consolidation CLI: one file, weights_only-readable, with Lightning's loop state merged in
    out = str(tmp_path / "consolidated.ckpt")
    assert consolidate_cli([two_rank_checkpoint, out]) == 0  # in-process (tests/test_checkpoint_consolidate.py
    # runs `python -m lightning_shard.checkpoint.consolidate`)
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["global_step"] == 3 and "optimizer_0" in ckpt
    assert set(expected) <= set(ckpt["state_dict"]) and "model.scale" in ckpt["state_dict"]  # buffers too
    for name, value in expected.items():
        assert torch.equal(ckpt["state_dict"][name], value), name
    # the consolidated file loads like a full checkpoint
    again = LitGPT.load_from_checkpoint(out)
    assert torch.equal(again.model.head.weight, expected["model.embed.weight"])  # tied
    # Lightning's own consolidation tool reads our directory
    theirs = str(tmp_path / "lightning.ckpt")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning.fabric.utilities.consolidate_checkpoint",
            two_rank_checkpoint,
            "--output_file",
            theirs,
        ],
        check=True,
        capture_output=True,
    )
    lightning_ckpt = torch.load(theirs, weights_only=False)
    # DCP stores a tied weight once; Lightning's tool does not restore the alias name (ours does, above)
    assert set(expected) - set(lightning_ckpt["state_dict"]) <= {"model.head.weight"}
    for name, value in lightning_ckpt["state_dict"].items():
        if name in expected:
            assert torch.equal(value, expected[name]), name


@distributed(world_size=4)
def test_resume_on_another_device_count(two_rank_checkpoint):
    expected = torch.load(two_rank_checkpoint + ".expected.pt", weights_only=True)
    module = LitGPT(lr=0.5)
    trainer = _trainer(max_steps=3)  # already reached: only restores
    trainer.fit(module, ckpt_path=two_rank_checkpoint)
    assert trainer.global_step == 3
    _equal(_full_params(module), expected)
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == 0.1
    assert all(len(s) > 0 for s in opt.state.values())  # momentum buffers restored on 4 ranks


@distributed(world_size=2)
def test_checkpoint_of_another_model_is_refused_and_nothing_changes(two_rank_checkpoint):
    from tests.lightning_models import LitGPT as Lit

    module = Lit(arch="llama")
    trainer = _trainer(max_steps=1)
    with pytest.raises(ValueError, match="missing|unexpected|shape"):
        trainer.fit(module, ckpt_path=two_rank_checkpoint)
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*ckpt-missing"):
        _trainer(max_steps=1).fit(Lit(), ckpt_path=two_rank_checkpoint + "-missing")


@distributed(world_size=2)
def test_weights_only_checkpoint_loads_for_validate(tmp_path):
    path = _shared_path(tmp_path, "weights")
    module = LitGPT()
    trainer = _trainer(max_steps=2)
    trainer.fit(module)
    trainer.save_checkpoint(path, weights_only=True)
    expected = _full_params(module)
    fresh = LitGPT(lr=0.0)  # lr 0: fit must not move the loaded weights
    _trainer(max_steps=3, limit_val_batches=1).validate(fresh, ckpt_path=path, verbose=False)
    _equal(_full_params(fresh), expected)
    # resuming training needs optimizer state: Lightning refuses a weights-only checkpoint, as for every strategy
    with pytest.raises(KeyError, match="contains only the model"):
        _trainer(max_steps=3).fit(LitGPT(), ckpt_path=path)


def test_full_checkpoint_files_are_memory_mapped_on_load(tmp_path):
    """Every rank reads a full checkpoint whole: mapped, the ranks of a node share the file's pages instead of
    holding one private copy each. A legacy (non-zip) file, which cannot be mapped, still loads."""
    from strategies.loading import load_full_file

    state = {"state_dict": {"w": torch.arange(6.0)}, "epoch": 3}
    path = tmp_path / "full.ckpt"
    torch.save(state, path)
    loaded = load_full_file(path)
    with open("/proc/self/maps") as maps:  # the file is mapped into this process while its tensors live
        assert str(path) in maps.read()
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"]) and loaded["epoch"] == 3
    legacy = tmp_path / "legacy.ckpt"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(load_full_file(legacy)["state_dict"]["w"], state["state_dict"]["w"])
