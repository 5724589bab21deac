"""Shared (tied) parameters under FSDP: kept in one group by the automatic wrapping, refused when an explicit
wrapping would split them, exact against one process (engine and real Trainer)."""

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import MixedPrecisionPolicy, fully_shard
from lightning_shard.fsdp.units import find_repeated_blocks, split_shared_params
from lightning_shard.tensor import DTensor
from strategies.parallelize import apply_parallelism
from tests.harness import distributed
from tests.hf_models import build, lit_hf, reference_params

VOCAB, DIM = 37, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.proj(self.norm(x)))


class SharedAcrossBlocks(nn.Module):
    """``blocks[0].proj.weight is blocks[1].proj.weight`` (siblings); with ``with_root=True`` the root's ``out``
    uses it too."""

    def __init__(self, with_root: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.blocks[1].proj.weight = self.blocks[0].proj.weight
        self.out = nn.Linear(DIM, DIM, bias=False) if with_root else None
        if with_root:
            self.out.weight = self.blocks[0].proj.weight
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        if self.out is not None:
            x = self.out(x)
        return self.head(x)


def _data(steps: int = 4, batch: int = 4, seq: int = 5):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=g) for _ in range(steps)]


def _loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _train(model, data, sliced: bool):
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for ids in data:
        if sliced:
            ids = ids.chunk(dist.get_world_size())[dist.get_rank()]
        opt.zero_grad()
        _loss(model, ids).backward()
        opt.step()
    return model


def _check_exact(model, with_root: bool):
    ref = _train(SharedAcrossBlocks(with_root), _data(), sliced=False)
    _train(model, _data(), sliced=True)
    ours = dict(model.named_parameters())
    assert ours.keys() == dict(ref.named_parameters()).keys()  # still one parameter under the first name
    for name, p in ref.named_parameters():
        assert isinstance(ours[name], DTensor)
        assert (ours[name].full_tensor() - p.detach()).abs().max().item() < 1e-6, name
    assert model.blocks[0].proj.weight is model.blocks[1].proj.weight
    if with_root:
        assert model.out.weight is model.blocks[0].proj.weight


def _meshes():
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    return mesh, mesh["data_parallel"]


def _apply(model, fsdp_unit):
    mesh, dp = _meshes()
    return apply_parallelism(
        model,
        mesh,
        fsdp_unit=fsdp_unit,
        tp_plan=None,
        reshard_after_forward=True,
        mp_policy=MixedPrecisionPolicy(),
        cpu_offload=False,
        fsdp_mesh=dp,
    )


# ---------------------------------------------------------------------------------------------- no ranks
def test_split_shared_params_finds_t5_embedding():
    t5 = build("t5")
    split = split_shared_params(t5, [t5.encoder, t5.decoder])
    assert set(split) == {t5.encoder, t5.decoder}
    assert split[t5.encoder].params == (t5.shared.weight,)
    assert split[t5.encoder].pairs == (("encoder.embed_tokens.weight", "shared.weight"),)
    assert split[t5.decoder].pairs == (("decoder.embed_tokens.weight", "shared.weight"),)
    blocks = [m for m in t5.modules() if type(m).__name__ == "T5Block"]
    assert split_shared_params(t5, blocks) == {}  # the blocks share nothing


def test_automatic_units_are_hugging_face_layers():
    # T5: the declared layer class (_no_split_modules) wins over the two larger T5Stack instances, so no unit
    # holds the embedding the stacks share.
    t5 = build("t5")
    assert {type(m).__name__ for m in find_repeated_blocks(t5)} == {"T5Block"}
    assert len(find_repeated_blocks(t5)) == 4


def test_automatic_units_without_declaration_are_the_largest_repeated_class():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class Block(nn.Module):  # plain attributes of the model, each with a list of small heads
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([Head(), Head()])
            self.mlp = nn.Linear(8, 8)

    class TwoBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Block(), Block()

    model = TwoBlocks()
    assert find_repeated_blocks(model) == [model.first, model.second]


def test_automatic_units_of_a_lightning_module_holding_sequential_towers():
    """Only a parent's ``forward`` tells whether it runs a child as ``child.forward(...)`` (no hooks, no unit there):
    LightningModule's other methods call ``model.forward``, and reading them once made every element of a
    LightningModule's ``nn.Sequential`` children unfit to be a unit, so a GAN became one unit."""
    from tests.test_optimizer_flows import Gan

    gan = Gan()
    assert find_repeated_blocks(gan) == [*gan.generator[:2], *gan.discriminator[:2]]


# ---------------------------------------------------------------------------------------------- engine
@distributed(world_size=2)
def test_fully_shard_refuses_a_weight_split_between_sibling_blocks():
    model = SharedAcrossBlocks()
    fully_shard(model.blocks[0])
    with pytest.raises(ValueError, match=r"'proj\.weight' is the same Parameter as 'proj\.weight' of fully_shard"):
        fully_shard(model.blocks[1])


@distributed(world_size=2)
def test_fully_shard_refuses_a_weight_split_between_a_block_and_the_root():
    model = SharedAcrossBlocks(with_root=True)
    fully_shard(model.blocks[0])
    # the root meets the original weight under another name: the full name of the earlier group's copy is known
    with pytest.raises(
        ValueError, match=r"'blocks\.1\.proj\.weight' is the same Parameter as 'blocks\.0\.proj\.weight'"
    ):
        fully_shard(model)


@distributed(world_size=2)
def test_shared_weight_left_to_the_root_is_exact():
    model = SharedAcrossBlocks(with_root=True)
    for block in model.blocks:
        fully_shard(block, ignored_params=[model.blocks[0].proj.weight])
    fully_shard(model)
    _check_exact(model, with_root=True)


@distributed(world_size=2)
def test_one_group_for_both_blocks_is_exact():
    model = SharedAcrossBlocks()
    fully_shard(list(model.blocks))
    fully_shard(model)
    _check_exact(model, with_root=False)


# ---------------------------------------------------------------------------------------------- strategy
@distributed(world_size=2)
def test_auto_wrapping_keeps_shared_weights_tied_and_exact():
    for with_root in (False, True):
        model = SharedAcrossBlocks(with_root)
        n = len(list(model.parameters()))
        summary = _apply(model, "auto")
        assert summary["fsdp_units"] == ["FSDPBlock", "FSDPBlock"]
        assert len(list(model.parameters())) == n
        assert "blocks.0.proj.weight" in summary["shared_left_to_parent"]
        _check_exact(model, with_root)


@distributed(world_size=2)
def test_explicit_fsdp_unit_that_splits_a_shared_weight_raises():
    with pytest.raises(
        ValueError, match=r"holds parameter 'blocks\.0\.proj\.weight' but not 'blocks\.1\.proj\.weight'"
    ):
        _apply(SharedAcrossBlocks(), {Block})
    with pytest.raises(ValueError, match=r"fsdp_unit='auto'"):
        _apply(SharedAcrossBlocks(), lambda m: isinstance(m, Block))


@distributed(world_size=2)
def test_t5_through_the_trainer_is_exact_and_stays_tied():
    import strategies

    module = lit_hf("t5")
    n = len(list(module.model.parameters()))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategies.ShardFSDPTPStrategy(),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    # The automatic units are the layers of both stacks (in a ModuleList), not the two stacks.
    assert set(trainer.strategy.parallel_summary["fsdp_units"]) == {"FSDPT5Block"}
    t5 = module.model
    assert t5.lm_head.weight is t5.shared.weight
    assert t5.encoder.embed_tokens.weight is t5.shared.weight and t5.decoder.embed_tokens.weight is t5.shared.weight
    assert len(list(t5.parameters())) == n == 47
    ref = reference_params("t5", steps=4)
    ours = {name: p.full_tensor() for name, p in t5.named_parameters()}
    assert ours.keys() == ref.keys()
    worst = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < 1e-6
