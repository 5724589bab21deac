"""Fabric and Trainer flows with a Hugging Face model that stop and resume, each compared with one process on
the same global batches (2 gloo ranks):

* Fabric: ``init_module(empty_init=True)`` + ``from_pretrained`` of a saved tiny model, ``fabric.setup(model,
  optimizer)`` with FSDP 2 or TP 2, ``clip_gradients``, and a ``fabric.save`` / ``fabric.load`` round trip in the
  middle of training: the resumed run equals uninterrupted one-process training; a TP 2 checkpoint of a model
  with tied embeddings (gpt2) and two optimizer param groups continues under FSDP 2, full and sharded.
* Trainer: 2 steps with TP 2, a sharded ``save_checkpoint``, ``fit(ckpt_path=...)`` with FSDP 2 for 2 more steps
  (AdamW, a StepLR scheduler): equals 4 one-process steps, with the optimizer and scheduler state carried. The
  rows each step trained on are recorded, not predicted: the resumed run is handed the first batches of epoch 1's
  shuffle (DistributedSampler seed 0, epoch 1), not the rest of epoch 0 (Lightning's loop decides this).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import strategies
from tests import hf_models as H
from tests.harness import distributed
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path

pytest.importorskip("transformers")

LR, CLIP, ROWS, GLOBAL = 1e-2, 0.05, 32, 4


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _save_llama(tmp_path) -> str:
    path = _shared_path(tmp_path, "llama")
    if dist.get_rank() == 0:
        H.build("llama", seed=3).save_pretrained(path)
    dist.barrier()
    return path


def _global_batches(steps: int) -> list[torch.Tensor]:
    ids = H.token_batch(steps * GLOBAL, 8, seed=1)
    return list(ids.split(GLOBAL))


def _reference_fabric(path: str, steps: int, clip: float | None) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for ids in _global_batches(steps):
        opt.zero_grad()
        H.lm_loss(model, ids).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _fabric_train(fabric, model, opt, batches, dp_rank: int, dp: int, clip: float | None) -> None:
    for ids in batches:
        opt.zero_grad()
        fabric.backward(H.lm_loss(model, ids.chunk(dp)[dp_rank]))
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()


def _worst(model, ref) -> float:
    ours = {n: _full(p) for n, p in model.named_parameters()}
    assert ours.keys() == ref.keys()
    return max((ours[n] - ref[n]).abs().max().item() for n in ref)


# slow: tests/test_hf_empty_init.py loads from_pretrained under empty init through the strategy by default
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_fabric_from_pretrained_under_empty_init_save_load_resume_equals_one_process(tmp_path, tp):
    from transformers import AutoModelForCausalLM

    path = _save_llama(tmp_path)
    ckpt = _shared_path(tmp_path, "fabric.ckpt")
    strategy = strategies.ShardFSDPTPFabricStrategy(tensor_parallel_size=tp)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    dp, dp_rank = 2 // tp, (dist.get_rank() if tp == 1 else 0)
    batches = _global_batches(4)

    def setup():
        with fabric.init_module(empty_init=True):
            model = AutoModelForCausalLM.from_pretrained(path)
        return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01))

    model, opt = setup()
    _fabric_train(fabric, model, opt, batches[:2], dp_rank, dp, CLIP)
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": 2})

    # A new model and optimizer (as in a new process) load the checkpoint and continue.
    resumed, resumed_opt = setup()
    state = {"model": resumed, "optimizer": resumed_opt, "step": 0}
    fabric.load(ckpt, state)
    assert state["step"] == 2
    _fabric_train(fabric, resumed, resumed_opt, batches[2:], dp_rank, dp, CLIP)
    _fabric_train(fabric, model, opt, batches[2:], dp_rank, dp, CLIP)  # uninterrupted

    ref = _reference_fabric(path, 4, CLIP)
    straight, again = _worst(model.module, ref), _worst(resumed.module, ref)
    tol = 1e-5 if tp == 1 else 1e-4  # Adam on TP shards reduces in another order than one process
    assert straight < tol and again < tol, (straight, again)


class _IndexedLlama(L.LightningModule):
    """AdamW + StepLR over llama; records the dataset rows of every step (gathered over the ranks)."""

    def __init__(self, per_rank_batch: int) -> None:
        super().__init__()
        self.model = H.build("llama", seed=3)
        self.per_rank_batch = per_rank_batch
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        rows, ids = batch
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows.tolist())
        self.seen.append(sorted({r for part in gathered for r in part}))
        return H.lm_loss(self.model, ids)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        data = TensorDataset(torch.arange(ROWS), H.token_batch(ROWS, 8, seed=1))
        return DataLoader(data, batch_size=self.per_rank_batch, shuffle=False)


def _reference_trainer(seen: list[list[int]]) -> tuple[dict[str, torch.Tensor], float]:
    model = H.build("llama", seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ids = H.token_batch(ROWS, 8, seed=1)
    for rows in seen:
        opt.zero_grad()
        H.lm_loss(model, ids[rows]).backward()
        opt.step()
        scheduler.step()
    return {n: p.detach() for n, p in model.named_parameters()}, opt.param_groups[0]["lr"]


@pytest.mark.slow  # a TP checkpoint resumed under FSDP runs by default below (Fabric, tied weights)
@distributed(world_size=2)
def test_trainer_tp_checkpoint_resumes_under_fsdp_with_adamw_and_steplr(tmp_path):
    ckpt = _shared_path(tmp_path, "tp.ckpt")
    first = _IndexedLlama(per_rank_batch=GLOBAL)  # TP 2: one data-parallel rank sees the global batch
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2), max_steps=2)
    trainer.fit(first)
    trainer.save_checkpoint(ckpt)

    second = _IndexedLlama(per_rank_batch=GLOBAL // 2)  # FSDP 2: two data-parallel ranks
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=1), max_steps=4)
    trainer.fit(second, ckpt_path=ckpt)
    assert trainer.global_step == 4
    seen = first.seen + second.seen
    assert len(seen) == 4 and all(len(rows) == GLOBAL for rows in seen), seen

    ref, lr = _reference_trainer(seen)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4
    worst = _worst(second.model, ref)
    assert worst < 1e-4, worst


def _two_groups(model) -> list[dict]:  # the usual fine-tuning split: matrices and vectors at other settings
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "lr": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "lr": 0.3},
    ]


@pytest.mark.parametrize("state_dict_type", ["sharded", pytest.param("full", marks=pytest.mark.slow)])
@distributed(world_size=2)
def test_fabric_tp_checkpoint_of_a_tied_model_resumes_under_fsdp(tmp_path, state_dict_type):
    from transformers import AutoModelForCausalLM

    path = _shared_path(tmp_path, "gpt2")  # tied input and output embeddings
    if dist.get_rank() == 0:
        H.build("gpt2", seed=3).save_pretrained(path)
    dist.barrier()
    ckpt = _shared_path(tmp_path, "gpt2.ckpt")
    batches = _global_batches(4)

    def run(tp: int, rows: list[torch.Tensor], load: bool):
        strategy = strategies.ShardFSDPTPFabricStrategy(tensor_parallel_size=tp, state_dict_type=state_dict_type)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = AutoModelForCausalLM.from_pretrained(path)
        model, opt = fabric.setup(model, torch.optim.SGD(_two_groups(model), momentum=0.9))
        if load:
            fabric.load(ckpt, {"model": model, "optimizer": opt})
        _fabric_train(fabric, model, opt, rows, dist.get_rank() if tp == 1 else 0, 2 // tp, 0.5)
        if not load:
            fabric.save(ckpt, {"model": model, "optimizer": opt})
        return model.module

    run(2, batches[:2], load=False)
    model = run(1, batches[2:], load=True)
    assert model.lm_head.weight is model.transformer.wte.weight

    ref = AutoModelForCausalLM.from_pretrained(path)
    opt = torch.optim.SGD(_two_groups(ref), momentum=0.9)
    for ids in batches:
        opt.zero_grad()
        H.lm_loss(ref, ids).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    worst = _worst(model, {n: p.detach() for n, p in ref.named_parameters()})
    assert worst < 1e-6, worst  # SGD: no Adam amplification of reduction-order noise
