"""Fabric flows and user-called collectives through ``Fabric(strategy="shard_fsdp_tp")`` (2 gloo ranks: FSDP 2,
and TP 2 on a Llama), each compared with one process on the same global data."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import strategies
from tests.fsdp_models import VOCAB, full_state, make_model, max_diff
from tests.harness import distributed
from tests.tp_models import Llama

LR = 1e-2


def _fabric(tp: int = 1, **kwargs) -> L.Fabric:
    strategy = strategies.ShardFSDPTPFabricStrategy(tensor_parallel_size=tp, **kwargs.pop("strategy_kwargs", {}))
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, **kwargs)
    fabric.launch()
    return fabric


def _model(tp: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Llama(vocab=VOCAB) if tp > 1 else make_model(seed)


def _dp(fabric) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size)."""
    kw = fabric.strategy.distributed_sampler_kwargs
    return kw["rank"], kw["num_replicas"]


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, 6), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- collectives under TP


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_collectives_count_each_data_parallel_replica_once(tp):
    """Each rank contributes its data-parallel rank + 1 (what its batch would give): the TP ranks of a replica
    contribute the same value, so the default-group results are those of ``dp`` processes, one per replica."""
    fabric = _fabric(tp)
    dp_rank, dp = _dp(fabric)
    assert dp == 2 // tp
    value = float(dp_rank + 1)
    expected = torch.arange(1, dp + 1, dtype=torch.float32)  # replica i's value, in data-parallel order
    gathered = fabric.all_gather({"v": torch.tensor([value]), "n": dp_rank})
    assert torch.equal(gathered["v"].reshape(-1), expected) and gathered["n"].reshape(-1).tolist() == list(range(dp))
    assert torch.equal(fabric.all_reduce(torch.tensor([value]), reduce_op="sum"), expected.sum().reshape(1))
    assert fabric.all_reduce(torch.tensor(dp_rank + 1), reduce_op="sum").item() == dp * (dp + 1) // 2  # integers
    assert torch.equal(fabric.all_reduce(torch.tensor([value]), reduce_op="mean"), expected.mean().reshape(1))
    assert fabric.all_reduce(torch.tensor([value]), reduce_op="max").item() == dp
    # An explicit group is used as given: the data-parallel group's sum counts each of its ranks (its gloo group
    # is the world object itself under FSDP 2, where the two meanings agree).
    dp_group = fabric.strategy.device_mesh.get_group("data_parallel")
    assert fabric.all_reduce(torch.tensor([1.0]), group=dp_group, reduce_op="sum").item() == dp
    assert fabric.all_gather(torch.tensor([1.0]), group=dp_group).numel() == dp
    # Decisions are over every rank (Fabric's own reduce_boolean_decision compared a sum with the world size).
    assert fabric.strategy.reduce_boolean_decision(True) is True
    assert fabric.strategy.reduce_boolean_decision(dist.get_rank() == 0) is False
    assert fabric.strategy.reduce_boolean_decision(dist.get_rank() == 0, all=False) is True
    assert fabric.broadcast({"rank": dist.get_rank()}, src=1) == {"rank": 1}
    fabric.barrier()


# ----------------------------------------------------------------------------- contrastive loss over all_gather


def _clip_loss(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric loss: every text of the batch is a negative for every other image."""
    img, txt = F.normalize(img, dim=-1), F.normalize(txt, dim=-1)
    logits = img @ txt.T / 0.1
    labels = torch.arange(len(img))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _embed(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).float().mean(dim=1)


def _clip_reference(tp: int, data, steps: int) -> dict[str, torch.Tensor]:
    model = _model(tp)
    opt = torch.optim.SGD(model.parameters(), lr=LR * 10)
    for img, txt in data[:steps]:
        opt.zero_grad()
        _clip_loss(_embed(model, img), _embed(model, txt)).backward()
        opt.step()
    return full_state(model)


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_contrastive_loss_over_all_gather_with_sync_grads_equals_one_process(tp):
    """Each replica embeds its part of the global batch; ``all_gather(sync_grads=True)`` builds the global
    similarity matrix. Under TP 2 a gather over the world held every sample twice (duplicated negatives)."""
    fabric = _fabric(tp)
    dp_rank, dp = _dp(fabric)
    data = [(_tokens(4, 2 * s), _tokens(4, 2 * s + 1)) for s in range(2)]
    model = fabric.setup_module(_model(tp))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR * 10))
    for img, txt in data:
        opt.zero_grad()
        local = [_embed(model, t.chunk(dp)[dp_rank]) for t in (img, txt)]
        img_all, txt_all = (fabric.all_gather(e, sync_grads=True).flatten(0, 1) for e in local)
        assert img_all.shape[0] == len(img)
        fabric.backward(_clip_loss(img_all, txt_all))
        opt.step()
    assert max_diff(full_state(model.module), _clip_reference(tp, data, 2)) < (1e-5 if tp == 1 else 5e-5)


# ----------------------------------------------------------------------------- torchmetrics in a Fabric loop


class _Counting(torch.nn.Module):
    """A model holding a metric, as users keep one next to the layers it measures."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        import torchmetrics

        self.net = _model(tp)
        self.rows = torchmetrics.SumMetric()

    def forward(self, x):
        self.rows.update(torch.tensor(float(len(x))))
        return self.net(x)


@distributed(world_size=2)
def test_torchmetrics_in_a_fabric_loop_under_tp_count_each_sample_once():
    """TP 2: both ranks see the same batches; a metric over the world counted each of them twice."""
    import torchmetrics

    fabric = _fabric(tp=2)
    model = fabric.setup_module(_Counting(tp=2))
    own = torchmetrics.CatMetric()  # the user's own metric, outside any module
    assert strategies.metrics.sync_metrics_over_data_parallel(own) == [""]
    fed = torchmetrics.SumMetric(dist_sync_fn=strategies.metrics.gather_over_data_parallel)
    batches = [_tokens(3, seed=s) for s in range(2)]  # one data-parallel replica: these are the global batches
    with torch.no_grad():
        for x in batches:
            model(x)
            own.update(x[:, 0].float())
            fed.update(torch.tensor(float(len(x))))
    expected_rows = sum(len(x) for x in batches)
    assert model.rows.compute().item() == expected_rows
    assert fed.compute().item() == expected_rows
    assert torch.equal(own.compute(), torch.cat([x[:, 0] for x in batches]).float())
