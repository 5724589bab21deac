"""LoRA adapters from Hugging Face's ``peft`` on a tiny Llama through ``Trainer(strategy="shard_fsdp_tp")``: frozen
base weights and trainable adapters in the same FSDP units (FSDP 2) and under the automatic TP plan (TP 2),
compared with one process on the same global batches (2 gloo ranks)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import strategies
from tests import hf_models
from tests.harness import distributed
from tests.lightning_models import sampler_batches

STEPS, LR = 3, 0.1


def _lora_llama() -> torch.nn.Module:
    """A seeded tiny Llama with LoRA on q, v and the MLP's down projection; the adapters' B matrices get random
    values (peft starts them at zero) so that every adapter weight gets a gradient from the first step."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    torch.manual_seed(5)
    model = get_peft_model(hf_models.build("llama"), config)
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_(std=0.02, generator=g)
    return model


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class LitLoRA(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _lora_llama()

    def training_step(self, batch, batch_idx):
        return hf_models.lm_loss(self.model, batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(_trainable(self), lr=LR, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(hf_models.token_dataset(), batch_size=2, shuffle=False)


def _reference(world: int) -> dict[str, torch.Tensor]:
    model = _lora_llama()
    opt = torch.optim.SGD(_trainable(model), lr=LR, momentum=0.9)
    data = hf_models.token_dataset()
    for idx in sampler_batches(world, 2, n=len(data))[:STEPS]:
        opt.zero_grad()
        hf_models.lm_loss(model, data[idx][0]).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_peft_lora_matches_one_process(tp):
    pytest.importorskip("peft")
    lit = LitLoRA()
    L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(lit)
    ref = _reference(world=2 // tp)
    ours = {name: p.full_tensor() for name, p in lit.model.named_parameters()}
    assert ours.keys() == ref.keys()
    start = _lora_llama().state_dict()
    adapters = [n for n in ref if "lora_" in n]
    moved = [(ref[n] - start[n]).abs().max().item() for n in adapters]
    assert adapters and min(moved) > 0 and max(moved) > 1e-3, moved  # every adapter trained
    frozen = [n for n in ref if "lora_" not in n]
    assert all(torch.equal(ours[n], start[n]) for n in frozen)  # the base stayed as it was
    worst = max((ours[n] - ref[n]).abs().max().item() for n in ref)
    assert worst < 1e-5, worst
