"""Checkpoints through the real Trainer: a ModelCheckpoint callback's state (tensors) survives
``load_from_checkpoint`` and consolidation with ``weights_only=True``; resuming ``shard_fsdp_tp`` from checkpoints
written by Lightning's DDP strategy (index-keyed optimizer state) and ModelParallelStrategy (DCP, no marker)."""

import glob
import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import strategies
from tests.harness import distributed
from tests.lightning_models import LitGPT, reference_params
from tests.test_checkpoint_interop_fsdp import epochs, reference
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _full_params, _shared_path


def _close(ours: dict, ref: dict, atol: float = 1e-5) -> None:
    assert ours.keys() == ref.keys()
    worst = max((ours[k] - ref[k]).abs().max().item() for k in ours)
    assert worst <= atol, worst


def _has_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


@distributed(world_size=2)
def test_load_from_checkpoint_with_a_model_checkpoint_callback(tmp_path):
    root = _shared_path(tmp_path, "run")
    module = LitGPT()
    callback = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), monitor="train_loss", save_top_k=1)
    trainer = _trainer(max_steps=3, enable_checkpointing=True, callbacks=[callback])
    trainer.fit(module)
    expected = _full_params(module)
    path = callback.best_model_path
    if dist.get_rank() == 0:
        assert os.path.isdir(path), path
        meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
        assert _has_tensor(meta["callbacks"]), meta["callbacks"]  # what made consolidation unreadable before
        plain = LitGPT.load_from_checkpoint(path)
        for name, p in plain.named_parameters():
            assert torch.equal(p.detach(), expected[name]), name
        out = os.path.join(root, "consolidated.ckpt")
        from lightning_shard.checkpoint._consolidate import main  # the CLI, in-process

        assert main([path, out]) == 0
        ckpt = torch.load(out, weights_only=True)
        assert ckpt["global_step"] == 3 and _has_tensor(ckpt["callbacks"])
        state = [v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint")][0]
        assert torch.equal(state["best_model_score"], callback.best_model_score.cpu())
    dist.barrier()


@distributed(world_size=2)
def test_resume_from_a_lightning_ddp_checkpoint(tmp_path):
    path = _shared_path(tmp_path, "ddp.ckpt")
    ddp = LitGPT()
    trainer = _trainer(strategy="ddp", max_epochs=1, max_steps=-1)
    trainer.fit(ddp)
    trainer.save_checkpoint(path)
    osd = torch.load(path, weights_only=True)["optimizer_states"][0]
    assert all(isinstance(k, int) for k in osd["state"])  # index-keyed, torch's optimizer.state_dict()

    # restore only (the checkpoint is at the end of epoch 0): weights equal the single-process reference
    restored = LitGPT(lr=0.5)
    trainer = _trainer(max_epochs=1, max_steps=-1)
    trainer.fit(restored, ckpt_path=path)
    _close(_full_params(restored), {f"model.{k}": v for k, v in reference_params(8).items()})
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == 0.1
    params = opt.param_groups[0]["params"]
    assert len(osd["state"]) >= 5  # the frozen layer has no state
    for index, saved in osd["state"].items():  # the DDP run's optimizer state, matched by parameter order
        assert torch.equal(opt.state[params[index]]["momentum_buffer"].full_tensor(), saved["momentum_buffer"])

    # continue one epoch: equals an uninterrupted two-epoch run
    resumed = LitGPT(lr=0.5)
    _trainer(max_epochs=2, max_steps=-1).fit(resumed, ckpt_path=path)
    straight = LitGPT()
    _trainer(max_epochs=2, max_steps=-1).fit(straight)
    _close(_full_params(resumed), _full_params(straight))


class _TorchFSDPGPT(LitGPT):
    """LitGPT sharded by torch's fully_shard inside configure_model, as ModelParallelStrategy expects."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _momentum(trainer) -> dict[int, torch.Tensor]:
    opt = trainer.optimizers[0]
    params = opt.param_groups[0]["params"]
    return {i: opt.state[p]["momentum_buffer"].full_tensor() for i, p in enumerate(params) if p in opt.state}


@pytest.mark.slow  # tests/test_faults_resume.py resumes a ModelParallelStrategy checkpoint by default
@distributed(world_size=2)
def test_resume_from_a_model_parallel_strategy_checkpoint(tmp_path):
    from lightning.pytorch.strategies import ModelParallelStrategy

    path = _shared_path(tmp_path, "mp")
    theirs = _TorchFSDPGPT()
    # data_parallel_size=2: torch's fully_shard shards over both ranks (the default, "auto", would make a 1 x 2
    # mesh: every rank training the whole model on all the data)
    mp = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = _trainer(strategy=mp, max_epochs=1, max_steps=-1)
    trainer.fit(theirs)
    trainer.save_checkpoint(path)
    assert os.path.isfile(os.path.join(path, ".metadata")) and not glob.glob(os.path.join(path, ".lightning*"))
    their_params = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    their_momentum = _momentum(trainer)
    assert trainer.global_step == 8  # Lightning's DistributedSampler over the 2 data-parallel ranks
    # the file holds what the FSDP2 run trained: single-process SGD on the same global batches
    _close(their_params, reference(epochs(1), optimizer=_sgd), atol=1e-6)

    # restore only: parameters and optimizer state exactly those torch's FSDP2 run wrote
    restored = LitGPT(lr=0.5)
    ours = _trainer(max_epochs=1, max_steps=-1)
    ours.fit(restored, ckpt_path=path)
    _close(_full_params(restored), their_params, atol=0.0)
    momentum = _momentum(ours)
    assert momentum.keys() == their_momentum.keys() and len(momentum) >= 5
    for i in momentum:
        assert torch.equal(momentum[i], their_momentum[i]), i
    assert ours.optimizers[0].param_groups[0]["lr"] == 0.1

    # restore on another layout: every parameter replicated on both ranks instead of FSDP2's dim-0 halves
    replicated = LitGPT(lr=0.5)
    ours = _trainer(strategy=strategies.ShardFSDPTPStrategy(sharding_strategy="NO_SHARD"), max_epochs=1, max_steps=-1)
    ours.fit(replicated, ckpt_path=path)
    embed = replicated.model.embed.weight
    assert embed.to_local().shape == embed.shape  # the whole tensor on each rank
    _close(_full_params(replicated), their_params, atol=0.0)
    momentum = _momentum(ours)
    assert momentum.keys() == their_momentum.keys()
    for i in momentum:
        assert torch.equal(momentum[i], their_momentum[i]), i

    # continue one epoch from it: equals the single-process reference over both epochs
    resumed = LitGPT(lr=0.5)
    trainer = _trainer(max_epochs=2, max_steps=-1)
    trainer.fit(resumed, ckpt_path=path)
    assert trainer.global_step == 16
    _close(_full_params(resumed), reference(epochs(2), optimizer=_sgd), atol=1e-6)


def _sgd(model: torch.nn.Module, lr: float) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
