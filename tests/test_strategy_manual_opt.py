"""Manual optimization (``automatic_optimization=False``) through the strategy: two optimizers over disjoint
parameter subsets, ``manual_backward``, ``clip_gradients`` per optimizer, compared with one process on the same
global batches (2 gloo ranks; FSDP 2, and TP 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import strategies
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset, loss_fn, sampler_batches
from tests.test_strategy import _trainer

STEPS, CLIP, LR = 3, 0.05, 0.1


def _is_block(name: str) -> bool:
    return name.startswith(("blocks.", "layers."))


def _split(named):
    named = list(named)
    return [p for n, p in named if _is_block(n)], [p for n, p in named if not _is_block(n)]


class LitManual(LitGPT):
    """Blocks with SGD + momentum, everything else with AdamW; the blocks' gradients clipped to ``CLIP``.

    ``two_phases``: as a GAN's step, two forward-backward-step rounds in one ``training_step``: the blocks'
    optimizer steps on the first half of the batch, then the second forward (which must see the updated
    parameters) steps the rest on the second half.
    """

    def __init__(self, arch: str, two_phases: bool) -> None:
        super().__init__(arch=arch)
        self.automatic_optimization = False
        self.two_phases = two_phases

    def training_step(self, batch, batch_idx):
        blocks_opt, rest_opt = self.optimizers()
        x, y = batch
        if self.two_phases:
            half = x.shape[0] // 2
            for opt, rows in ((blocks_opt, slice(0, half)), (rest_opt, slice(half, None))):
                opt.zero_grad()
                self.manual_backward(loss_fn(self.model, x[rows], y[rows]))
                opt.step()
            return
        loss = loss_fn(self.model, x, y)
        blocks_opt.zero_grad()
        rest_opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(blocks_opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        blocks_opt.step()
        rest_opt.step()

    def configure_optimizers(self):
        blocks, rest = _split(self.model.named_parameters())
        return torch.optim.SGD(blocks, lr=LR, momentum=0.9), torch.optim.AdamW(rest, lr=1e-2)


def _reference(arch: str, two_phases: bool, world: int = 2, per_rank_batch: int = 4) -> dict[str, torch.Tensor]:
    model = _seeded_model(arch)
    blocks, rest = _split(model.named_parameters())
    blocks_opt, rest_opt = torch.optim.SGD(blocks, lr=LR, momentum=0.9), torch.optim.AdamW(rest, lr=1e-2)
    data, batches = dataset(), iter(sampler_batches(world, per_rank_batch))
    for _ in range(STEPS):
        x, y = data[next(batches)]
        if two_phases:  # each rank's first half, then each rank's second half (the global batch is rank-major)
            ranks, half = torch.arange(x.shape[0]).reshape(world, per_rank_batch), per_rank_batch // 2
            for opt, rows in ((blocks_opt, ranks[:, :half]), (rest_opt, ranks[:, half:])):
                opt.zero_grad()
                loss_fn(model, x[rows.flatten()], y[rows.flatten()]).backward()
                opt.step()
            continue
        blocks_opt.zero_grad()
        rest_opt.zero_grad()
        loss_fn(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(blocks, CLIP)
        blocks_opt.step()
        rest_opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("arch", "tp", "two_phases"), [("gpt", 1, False), ("llama", 2, False), ("gpt", 1, True)])
@distributed(world_size=2)
def test_manual_optimization_two_optimizers_and_clipping_match_one_process(arch, tp, two_phases):
    module = LitManual(arch, two_phases)
    strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp)
    trainer = _trainer(strategy=strategy, max_steps=-1, max_epochs=1, limit_train_batches=STEPS)
    trainer.fit(module)
    ref = _reference(arch, two_phases, world=dist.get_world_size() // tp)
    plain = [n for n, p in module.model.named_parameters() if not hasattr(p, "full_tensor")]
    assert not plain, f"parameters left unsharded after fit: {plain}"
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    assert ours.keys() == ref.keys()
    worst = max((ours[k] - ref[k]).abs().max().item() for k in ours)
    moved = max((ref[k] - _seeded_model(arch).state_dict()[k]).abs().max().item() for k in ref)
    assert moved > 1e-3  # the steps changed the parameters, so equality says something
    assert worst < 1e-5, worst
