"""Resuming ``shard_fsdp_tp`` from a directory written by Lightning's ``FSDPStrategy(state_dict_type="sharded")``
(torch's FSDP1 with ``SHARDED_STATE_DICT``): a DCP directory without our completion marker, the LightningModule's
state dict under "model" (not "state_dict"), FSDP's sharded optimizer state keyed by parameter name under
"optimizer_0", and Lightning's loop state in ``meta.pt``.

Each test trains with Lightning's FSDPStrategy on 2 gloo ranks (AdamW, two param groups not in model order),
then resumes with ours and compares every parameter with single-process AdamW on the same global batches; the
directory itself is checked through ``consolidate`` against the same reference (parameters and optimizer state).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist

import strategies
from lightning_shard.checkpoint import CheckpointCorruptError, consolidate
from lightning_shard.tensor import DTensor
from tests.fsdp_models import Block, loss_fn
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset, sampler_batches
from tests.test_checkpoint_interop_fsdp import _lightning_fsdp_on_cpu, epochs
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path
from tests.tp_models import LlamaBlock

LR = 0.01


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.blocks if hasattr(model, "blocks") else model.layers


def _adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """The blocks first (lr), then the other parameters, frozen ones included (lr / 2): not the model's order."""
    blocks = list(_blocks(model).parameters())
    rest = [p for p in model.parameters() if all(p is not b for b in blocks)]
    return torch.optim.AdamW([{"params": blocks}, {"params": rest, "lr": lr / 2}], lr=lr, weight_decay=0.01)


class AdamGPT(LitGPT):
    def configure_optimizers(self):
        return _adamw(self.model, self.lr)


def reference(schedule: list[torch.Tensor], arch: str = "gpt") -> tuple[dict, dict]:
    """Single-process AdamW from LitGPT's initial weights, one step per global batch of ``schedule``: (parameters,
    optimizer state by parameter name), named as in the LightningModule."""
    model = _seeded_model(arch)
    opt = _adamw(model, LR)
    data = dataset()
    for idx in schedule:
        x, y = data[idx]
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    names = {p: f"model.{n}" for n, p in model.named_parameters()}
    state = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return {name: p.detach().clone() for p, name in names.items()}, state


def _max_diff(ours: dict, ref: dict) -> float:
    assert ours.keys() == ref.keys(), (sorted(ours), sorted(ref))
    return max((ours[k].float() - ref[k].float()).abs().max().item() for k in ours)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _params(module) -> dict[str, torch.Tensor]:
    return {n: _full(p).clone() for n, p in module.named_parameters()}


def _optim_state(module, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: {k: _full(v).clone() for k, v in s.items()} for p, s in optimizer.state.items()}


def _fsdp_run(path: str, arch: str = "gpt", max_steps: int = -1) -> None:
    """Lightning's FSDPStrategy(state_dict_type="sharded") on the 2 ranks: one epoch (or ``max_steps``), saved."""
    unit = LlamaBlock if arch == "llama" else Block
    trainer = _trainer(strategy=_lightning_fsdp_on_cpu("sharded", unit), max_epochs=1, max_steps=max_steps)
    trainer.fit(AdamGPT(lr=LR, arch=arch))
    trainer.save_checkpoint(path)
    dist.barrier()


def _check_consolidated(path: str, out: str, params: dict, state: dict) -> dict:
    """``consolidate`` reads the FSDP1 directory; its model and optimizer state are the reference's."""
    consolidate(path, out)
    ckpt = torch.load(out, weights_only=True)
    saved = ckpt["model"]
    assert _max_diff({k: saved[k] for k in params}, params) < 1e-6
    osd = ckpt["optimizer_0"]
    assert osd["state"].keys() == state.keys() and len(state) >= 5  # the frozen layer has no state
    for fqn, entry in state.items():
        assert osd["state"][fqn].keys() == entry.keys(), fqn
        assert _max_diff(osd["state"][fqn], entry) < 1e-6, fqn
    assert [g["lr"] for g in osd["param_groups"]] == [LR, LR / 2]
    return ckpt


@distributed(world_size=2)
def test_resume_from_a_lightning_fsdp_sharded_checkpoint(tmp_path):
    path = _shared_path(tmp_path, "fsdp-sharded")
    _fsdp_run(path)
    files = sorted(os.listdir(path))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], files  # Lightning's layout, no marker
    out = _shared_path(tmp_path, "consolidated.pt")
    if dist.get_rank() == 0:
        after_one = reference(epochs(1))
        ckpt = _check_consolidated(path, out, *after_one)
        assert ckpt["global_step"] == 8 and "loops" in ckpt  # meta.pt merged in
        plain = AdamGPT.load_from_checkpoint(path)  # Lightning's own call, weights under "model"
        assert _max_diff(_params(plain), after_one[0]) < 1e-6
    dist.barrier()

    # the consolidated file (weights under "model", optimizer under "optimizer_0") restores exactly what it holds
    restored = AdamGPT(lr=0.5)
    trainer = _trainer(max_epochs=1, max_steps=-1)
    trainer.fit(restored, ckpt_path=out)
    saved = torch.load(out, weights_only=True)
    ours = _params(restored)
    assert _max_diff(ours, {k: saved["model"][k] for k in ours}) == 0.0
    mine = _optim_state(restored, trainer.optimizers[0])
    assert mine.keys() == saved["optimizer_0"]["state"].keys()
    for fqn, entry in mine.items():
        assert _max_diff(entry, saved["optimizer_0"]["state"][fqn]) == 0.0, fqn

    # resume with ours, one more epoch: equals single-process AdamW over both epochs
    resumed = AdamGPT(lr=0.5)  # the checkpoint's learning rates (LR, LR / 2) must win
    ours = _trainer(max_epochs=2, max_steps=-1)
    ours.fit(resumed, ckpt_path=path)
    assert ours.global_step == 16
    assert [g["lr"] for g in ours.optimizers[0].param_groups] == [LR, LR / 2]
    params, state = reference(epochs(2))
    diff = _max_diff(_params(resumed), params)
    assert diff < 1e-6, diff
    mine = _optim_state(resumed, ours.optimizers[0])
    assert mine.keys() == state.keys()
    for fqn in state:
        assert _max_diff(mine[fqn], state[fqn]) < 1e-6, fqn


@pytest.mark.slow
@distributed(world_size=2)
def test_resume_an_fsdp_sharded_checkpoint_on_another_mesh(tmp_path):
    """Saved by FSDP1 over 2 data-parallel ranks (dim-0 chunks), resumed with tensor parallelism over the same 2
    ranks (column- and row-wise shards, one data-parallel replica): restored bitwise, then one more epoch."""
    path = _shared_path(tmp_path, "fsdp-sharded")
    _fsdp_run(path, arch="llama")
    out = _shared_path(tmp_path, "consolidated.pt")
    if dist.get_rank() == 0:
        consolidate(path, out)
    dist.barrier()
    saved = torch.load(out, weights_only=True)

    def tp_trainer(max_epochs: int):
        strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=2)
        return _trainer(strategy=strategy, max_epochs=max_epochs, max_steps=-1)

    # restore only (the checkpoint is at the end of epoch 0): exactly what the FSDP1 run wrote
    restored = AdamGPT(lr=0.5, arch="llama", per_rank_batch=8)
    trainer = tp_trainer(1)
    trainer.fit(restored, ckpt_path=path)
    assert trainer.global_step == 8
    q = restored.model.layers[0].attention.q_proj.weight
    assert q.to_local().shape[0] == q.shape[0] // 2  # tensor-parallel shards, not FSDP1's
    ours = _params(restored)
    assert _max_diff(ours, {k: saved["model"][k] for k in ours}) == 0.0
    mine = _optim_state(restored, trainer.optimizers[0])
    assert mine.keys() == saved["optimizer_0"]["state"].keys()
    for fqn, entry in mine.items():
        assert _max_diff(entry, saved["optimizer_0"]["state"][fqn]) == 0.0, fqn

    # one more epoch on the TP mesh (one data-parallel replica: batches of 8 from a 1-replica sampler)
    resumed = AdamGPT(lr=0.5, arch="llama", per_rank_batch=8)
    trainer = tp_trainer(2)
    trainer.fit(resumed, ckpt_path=path)
    assert trainer.global_step == 16
    params, _ = reference(epochs(1) + sampler_batches(1, 8, seed=1), arch="llama")
    # Adam on TP shards reduces in another order than one process: measured 5e-6 here, 8e-5 for 8 TP steps from
    # the initial weights; an Adam step count off by one at the resume gives 7e-4, a fresh optimizer 9e-2
    diff = _max_diff(_params(resumed), params)
    assert diff < 5e-5, diff


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(module, optimizers) -> dict:
    """Every parameter, buffer and optimizer value of this rank, local shards, bit for bit."""
    local = {n: _local(t) for n, t in module.state_dict().items()}
    for i, opt in enumerate(optimizers):
        for j, state in enumerate(opt.state.values()):
            for k, v in state.items():
                local[f"optimizer_{i}.{j}.{k}"] = _local(v)
        local[f"optimizer_{i}.lrs"] = torch.tensor([g["lr"] for g in opt.param_groups])
    return local


def _damage(path: str, how: str) -> str:
    """Damage a copy of the checkpoint at ``path``; return the damaged file's name.

    ``truncate``: rank 1's data file cut in half. ``tensor``: the zip header of a tensor entry only rank 1 reads
    (a row block of the embedding) overwritten, same size. ``value``: the head of rank 1's file (a param-group value
    both ranks read) overwritten. ``meta``: Lightning's ``meta.pt`` cut in half. ``metadata``: DCP's ``.metadata``
    cut in half."""
    from lightning_shard.checkpoint._safe_io import SafeFileSystemReader

    name = os.path.join(path, {"meta": "meta.pt", "metadata": ".metadata"}.get(how, "__1_0.distcp"))
    if how in ("truncate", "meta", "metadata"):
        os.truncate(name, os.path.getsize(name) // 2)
        return name
    offset = 0
    if how == "tensor":
        storage = SafeFileSystemReader(path).read_metadata().storage_data
        offset = next(
            info.offset
            for index, info in storage.items()
            if index.fqn == "model.model.embed.weight" and index.offset[0] > 0  # rows 51..100: rank 1's shard
        )
    with open(name, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * 64)
    return name


@pytest.mark.slow
@distributed(world_size=2)
def test_a_damaged_foreign_checkpoint_is_named_and_changes_nothing(tmp_path):
    """Directories of other tools have no checksums: damage that makes an entry unreadable (and truncation) must
    still be named, on every rank, with the model and optimizer left bit-identical."""
    path = _shared_path(tmp_path, "fsdp-sharded")
    _fsdp_run(path, max_steps=2)
    # a run of ours mid-training (optimizer state present) tries to load damaged copies of it
    module = AdamGPT(lr=LR)
    trainer = _trainer(max_steps=2)
    trainer.fit(module)
    before = _snapshot(module, trainer.optimizers)
    for how in ("truncate", "tensor", "value", "meta", "metadata"):
        copy = f"{path}-{how}"
        damaged = [shutil.copytree(path, copy) and _damage(copy, how) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(damaged)
        with pytest.raises(CheckpointCorruptError, match=re.escape(damaged[0])):
            trainer.strategy.load_checkpoint(copy)
        after = _snapshot(module, trainer.optimizers)
        assert after.keys() == before.keys()
        for k in before:
            assert torch.equal(after[k], before[k]), (how, k)

    # through the Trainer: the same error on every rank, no rank left waiting
    with pytest.raises(CheckpointCorruptError, match=re.escape(damaged[0])):
        _trainer(max_steps=4).fit(AdamGPT(lr=LR), ckpt_path=copy)


def test_the_model_entry_is_found_or_the_entries_are_named():
    from strategies.loading import model_entry

    assert model_entry({"state_dict", "model", "optimizer_0"}, "ckpt") == "state_dict"  # ours, ModelParallelStrategy
    assert model_entry({"model", "optimizer_0"}, "ckpt") == "model"  # FSDPStrategy(state_dict_type="sharded")
    with pytest.raises(ValueError, match=r"ckpt holds no model weights.*\['optimizer_0', 'step'\]"):
        model_entry({"optimizer_0", "step"}, "ckpt")
