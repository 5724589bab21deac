"""``requires_grad`` changed after sharding: a parameter frozen mid-training gets no gradient and stays put, one
unfrozen trains again, as torch's ``fully_shard`` and one process do (2 gloo ranks).

Lightning's ``BackboneFinetuning`` callback does exactly this: it freezes the backbone before setup and
unfreezes it (adding it to the optimizer) at a later epoch, long after the strategy sharded the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BackboneFinetuning

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from tests.fsdp_models import batches, loss_fn, make_model
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset, sampler_batches
from tests.test_strategy import _trainer

STEPS, LR = 4, 0.1


def _toggle(model, step: int) -> None:
    """Step 1: unfreeze the block frozen at wrap time and freeze the other; step 3: freeze the norm too."""
    if step == 1:
        model.blocks[0].requires_grad_(True)
        model.blocks[1].requires_grad_(False)
    if step == 3:
        model.norm.requires_grad_(False)


def _train(model, data, rank_rows: slice | None = None) -> None:
    opt = torch.optim.SGD([p for p in model.parameters()], lr=LR, momentum=0.9)
    for step, (x, y) in enumerate(data):
        _toggle(model, step)
        rows = slice(None) if rank_rows is None else rank_rows
        loss_fn(model, x[rows], y[rows]).backward()
        opt.step()
        opt.zero_grad()


@distributed(world_size=2)
def test_freezing_and_unfreezing_after_fully_shard_equals_one_process():
    data = batches(STEPS, batch=4)
    reference = make_model()
    reference.blocks[0].requires_grad_(False)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    _train(reference, data)

    model = make_model()
    model.blocks[0].requires_grad_(False)  # frozen when wrapped, unfrozen at step 1
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank = dist.get_rank()
    _train(model, data, slice(2 * rank, 2 * rank + 2))

    ours = {n: p.full_tensor() for n, p in model.named_parameters()}
    for name, ref in reference.named_parameters():
        assert torch.allclose(ours[name], ref.detach(), atol=1e-5), name
    # the frozen ones really stayed: blocks.1 from step 1 on, the norm from step 3 on (so they did move before)
    assert not torch.equal(ours["blocks.1.up.weight"], start["blocks.1.up.weight"])
    assert model.blocks[1].up.weight.grad is None and model.norm.weight.grad is None


class LitBackbone(LitGPT):
    """The blocks are the backbone: frozen by ``BackboneFinetuning`` until epoch 1, then trained at lr / 10."""

    @property
    def backbone(self):
        return self.model.blocks

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, momentum=0.9)


def _backbone_reference(world: int, per_rank_batch: int, epochs: int) -> dict[str, torch.Tensor]:
    model = _seeded_model("gpt")
    model.blocks.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    data = dataset()
    for epoch in range(epochs):
        if epoch == 1:  # BackboneFinetuning(unfreeze_backbone_at_epoch=1): lr x backbone_initial_ratio_lr (0.1)
            model.blocks.requires_grad_(True)
            opt.add_param_group({"params": list(model.blocks.parameters()), "lr": LR * 0.1})
        for idx in sampler_batches(world, per_rank_batch, seed=epoch):  # the sampler reshuffles per epoch
            x, y = data[idx]
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@distributed(world_size=2)
def test_backbone_finetuning_callback_trains_the_unfrozen_backbone():
    module = LitBackbone()
    trainer = _trainer(max_steps=-1, max_epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    trainer.fit(module)
    reference = _backbone_reference(world=2, per_rank_batch=module.per_rank_batch, epochs=2)
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    for name, ref in reference.items():
        assert torch.allclose(ours[name], ref, atol=1e-5), (name, (ours[name] - ref).abs().max().item())


class LitToggled(LitGPT):
    """A GAN-style manual step: each optimizer in turn, with Lightning's ``toggle_optimizer`` (every parameter
    of the other optimizer frozen for that round) and ``zero_grad`` after the step, as Lightning's docs write it.
    A frozen parameter that still got a gradient would carry it into its own optimizer's next step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        half = x.shape[0] // 2
        for opt, rows in zip(self.optimizers(), (slice(0, half), slice(half, None))):
            self.toggle_optimizer(opt)
            self.manual_backward(loss_fn(self.model, x[rows], y[rows]))
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        blocks, rest = _blocks_and_rest(self.model)
        return torch.optim.SGD(blocks, lr=LR, momentum=0.9), torch.optim.AdamW(rest, lr=1e-2)


def _blocks_and_rest(model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [p for n, p in named if n.startswith("blocks.")], [p for n, p in named if not n.startswith("blocks.")]


def _toggled_reference(world: int, per_rank_batch: int, steps: int) -> dict[str, torch.Tensor]:
    model = _seeded_model("gpt")
    blocks, rest = _blocks_and_rest(model)
    opts = (torch.optim.SGD(blocks, lr=LR, momentum=0.9), torch.optim.AdamW(rest, lr=1e-2))
    data = dataset()
    for idx in sampler_batches(world, per_rank_batch)[:steps]:
        x, y = data[idx]
        ranks, half = torch.arange(x.shape[0]).reshape(world, per_rank_batch), per_rank_batch // 2
        for opt, other, rows in ((opts[0], rest, ranks[:, :half]), (opts[1], blocks, ranks[:, half:])):
            for p in other:
                p.requires_grad_(False)
            loss_fn(model, x[rows.flatten()], y[rows.flatten()]).backward()
            opt.step()
            opt.zero_grad()
            for p in other:
                p.requires_grad_(True)
    return {n: p.detach() for n, p in model.named_parameters()}


@distributed(world_size=2)
def test_toggle_optimizer_in_manual_optimization_equals_one_process():
    module = LitToggled()
    trainer = _trainer(max_steps=-1, max_epochs=1, limit_train_batches=3)
    trainer.fit(module)
    reference = _toggled_reference(world=2, per_rank_batch=module.per_rank_batch, steps=3)
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    for name, ref in reference.items():
        assert torch.allclose(ours[name], ref, atol=1e-5), (name, (ours[name] - ref).abs().max().item())
