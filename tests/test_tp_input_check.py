"""The ranks of a tensor-parallel group must see the same batch; different batches raise instead of training
wrong (Trainer and Fabric, 2 gloo ranks, TP 2)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import strategies
from lightning_shard.tp.input_check import TPInputMismatchError, input_fingerprint
from tests import tp_models
from tests.harness import distributed
from tests.lightning_models import VOCAB, LitGPT, dataset


def _trainer(max_steps: int = 2, use_distributed_sampler: bool = False) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=use_distributed_sampler,
    )


class LitPerRankData(LitGPT):
    """Each process loads its own slice of the data by global rank (a common hand-written split): with TP 2 the
    two ranks of the one TP group then hold different batches."""

    def __init__(self, split_by_rank: bool) -> None:
        super().__init__(arch="llama")
        self.split_by_rank = split_by_rank

    def train_dataloader(self):
        data = dataset()
        if self.split_by_rank:
            data = torch.utils.data.Subset(data, range(dist.get_rank(), len(data), dist.get_world_size()))
        return torch.utils.data.DataLoader(data, batch_size=4)


@distributed(world_size=2)
def test_trainer_refuses_different_batches_on_the_ranks_of_a_tp_group():
    with pytest.raises(TPInputMismatchError, match=r"ranks \[0, 1\] of one tensor-parallel group.*batch\[0\]"):
        _trainer().fit(LitPerRankData(split_by_rank=True))


@distributed(world_size=2)
def test_trainer_same_batches_on_the_tp_group_train():
    module = LitPerRankData(split_by_rank=False)
    _trainer().fit(module)
    assert module.trainer.global_step == 2


@distributed(world_size=2)
def test_fabric_refuses_different_inputs_on_the_ranks_of_a_tp_group():
    strategy = strategies.ShardFSDPTPFabricStrategy(tensor_parallel_size=2)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(tp_models.Llama(vocab=VOCAB))
    same = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    fabric.backward(F.cross_entropy(model(same).flatten(0, 1), same.flatten()))  # the first forward: same inputs pass
    model.eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    with torch.no_grad(), pytest.raises(TPInputMismatchError, match="first forward in eval mode"):
        model(ids)


def test_fingerprint_tells_values_shapes_and_dtypes_apart_and_ignores_non_tensors():
    ids = torch.arange(6).reshape(2, 3)
    base = input_fingerprint({"ids": ids, "name": "rank 0"})
    assert base == input_fingerprint({"ids": ids.clone(), "name": "rank 1"})
    assert base != input_fingerprint({"ids": ids + 1, "name": "rank 0"})
    assert base != input_fingerprint({"ids": ids.reshape(3, 2), "name": "rank 0"})
    assert base != input_fingerprint({"ids": ids.int(), "name": "rank 0"})
    bf16 = torch.ones(2, dtype=torch.bfloat16)
    assert input_fingerprint([bf16]) != input_fingerprint([bf16 * 2])


@distributed(world_size=2)
def test_generators_seeded_per_rank_are_synced_so_replicated_weights_stay_equal():
    """GPT-2 with dropout on its (TP-replicated) embeddings and residuals, each rank seeded differently in
    ``setup``: unless the TP group's generators agree, the replicated activations, hence the replicated weights'
    gradients, part ways across the ranks."""
    from torch import nn

    from lightning_shard.tensor import Replicate
    from tests import hf_models

    lit = hf_models.lit_hf("gpt2")
    for module in lit.model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.2
    lit.setup = lambda stage: torch.manual_seed(100 + dist.get_rank())
    _trainer(max_steps=3, use_distributed_sampler=True).fit(lit)

    def tp_replicated(p) -> bool:  # data-parallel size 1: the local tensor of the FSDP shard is whole
        names = p.device_mesh.mesh_dim_names
        return "tensor_parallel" not in names or isinstance(p.placements[names.index("tensor_parallel")], Replicate)

    replicated = {name: p.to_local() for name, p in lit.model.named_parameters() if tp_replicated(p)}
    assert "transformer.ln_f.weight" in replicated
    moved = (replicated["transformer.ln_f.weight"] - 1).abs().max().item()
    assert moved > 0  # trained, so equal copies mean something
    theirs = [None, None]
    dist.all_gather_object(theirs, {k: v.clone() for k, v in replicated.items()})
    worst = {k: (theirs[0][k] - theirs[1][k]).abs().max().item() for k in replicated}
    assert max(worst.values()) == 0, {k: v for k, v in worst.items() if v}
