"""Encoders, encoder-decoders, speech, vision and task heads from Hugging Face (``tests/hf_models_more.py``)
under the engine, 2 ranks, against one process on the same data:

* FSDP through the real ``Trainer(strategy="shard_fsdp_tp")`` (data parallel 2): 2 optimizer steps of 2
  accumulated micro-batches each, then the validation loop; every parameter and the logged validation loss
  compared with one process on the same global batches (Lightning's DistributedSampler order).
* TP 2 with ``auto_tp_plan`` (the strategy's ``apply_parallelism``, FSDP over a data-parallel dim of 1 on
  top): 3 SGD steps on the same batches on both ranks, every parameter compared, no op without a rule.

By default a representative subset runs (ALBERT: one layer shared by every block; BART: encoder-decoder with
learned positions; ViT: vision; DeBERTa-v2: relative position buckets; BERT sequence classification); the
``slow`` tests run the rest. CLIP (a 0-dim ``logit_scale``, kept whole on every rank) runs by default.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import strategies  # noqa: F401 - registers "shard_fsdp_tp"
from lightning_shard.tensor import DTensor, fallback_counts, reset_fallback_counts
from tests import hf_models_more as M
from tests.harness import distributed

pytest.importorskip("transformers")

DEFAULT = ["albert", "bart", "vit", "deberta_v2", "bert_seqcls"]
MORE = [f for f in M.FAMILIES if f not in DEFAULT and f != "clip"]  # CLIP: its own default test below
ROWS, VAL_ROWS, PER_RANK, ACCUMULATE, LR = 8, 8, 2, 2, 0.5
TP_STEPS = 3


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rank_chunks(model, batch: dict, world: int) -> torch.Tensor:
    """What data parallelism computes: the mean of the ranks' losses on their slices of the global batch (CLIP's
    contrastive loss is not a mean over rows, so this is the reference for every family)."""
    rows = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0] // world
    return sum(M.loss_of(model, M.select(batch, slice(r * rows, (r + 1) * rows))) for r in range(world)) / world


# ------------------------------------------------------------------------------------------ FSDP via Trainer
def _lit(family: str):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    train, val = M.inputs(family, ROWS, seed=1), M.inputs(family, VAL_ROWS, seed=2)
    keys = [k for k, v in train.items() if isinstance(v, torch.Tensor)]
    extra = {k: v for k, v in train.items() if k not in keys}

    class LitEncoder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = M.build(family)

        def _loss(self, batch):
            return M.loss_of(self.model, dict(zip(keys, batch), **extra))

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(TensorDataset(*(train[k] for k in keys)), batch_size=PER_RANK)

        def val_dataloader(self):
            return DataLoader(TensorDataset(*(val[k] for k in keys)), batch_size=PER_RANK)

    return LitEncoder()


def _fsdp_reference(family: str, world: int):
    """One process: the same global batches, ``ACCUMULATE`` micro-batches per SGD step (losses averaged), then
    the validation loss averaged like Lightning's ``sync_dist`` (mean over ranks of each rank's mean)."""
    from tests.lightning_models import sampler_batches

    model = M.build(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = M.inputs(family, ROWS, seed=1)
    for k, idx in enumerate(sampler_batches(world, PER_RANK, n=ROWS)):
        (_rank_chunks(model, M.select(data, idx), world) / ACCUMULATE).backward()
        if k % ACCUMULATE == ACCUMULATE - 1:
            opt.step()
            opt.zero_grad()
    model.eval()
    val = M.inputs(family, VAL_ROWS, seed=2)
    with torch.no_grad():  # validation: DistributedSampler without shuffling deals rows round-robin
        per_rank = [
            torch.stack(
                [
                    M.loss_of(model, M.select(val, torch.arange(r, VAL_ROWS, world)[b : b + PER_RANK]))
                    for b in range(0, VAL_ROWS // world, PER_RANK)
                ]  # fmt: skip
            ).mean()
            for r in range(world)
        ]
    return {n: p.detach() for n, p in model.named_parameters()}, torch.stack(per_rank).mean()


def _fit_and_compare(family: str) -> tuple[float, float]:
    import lightning as L

    module = _lit(family)
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="shard_fsdp_tp",
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    ref, ref_val = _fsdp_reference(family, dist.get_world_size())
    ours = dict(module.model.named_parameters())
    assert list(ours) == list(ref), family  # nothing untied or lost
    assert all(isinstance(p, DTensor) for p in ours.values()), family
    moved = max((ref[n] - initial[n]).abs().max().item() for n in ref)
    assert moved > 1e-3, (family, moved)  # the steps changed the weights, so the comparison means something
    worst = max(((_full(ours[n].detach()) - ref[n]).abs().max().item(), n) for n in ref)
    assert worst[0] < 1e-5, (family, worst)
    val_diff = abs(trainer.callback_metrics["val_loss"].item() - ref_val.item())
    assert val_diff < 1e-5, (family, val_diff)
    return worst[0], val_diff


def _fsdp_families(families) -> None:
    for family in families:
        _fit_and_compare(family)


@distributed(world_size=2)
def test_fsdp_trainer_accumulation_and_validation_match_one_process():
    _fsdp_families(DEFAULT)


@pytest.mark.slow
@distributed(world_size=2)
def test_fsdp_trainer_more_families_match_one_process():
    _fsdp_families(MORE)


# ------------------------------------------------------------------------------------------- TP (auto plan)
def _parallelize(model, dp: int, tp: int, fsdp_unit="auto") -> dict:
    from lightning_shard import init_device_mesh
    from lightning_shard.fsdp import MixedPrecisionPolicy
    from strategies.parallelize import apply_parallelism

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    return apply_parallelism(
        model, mesh, fsdp_unit=fsdp_unit, tp_plan="auto", reshard_after_forward=True,
        mp_policy=MixedPrecisionPolicy(), cpu_offload=False, fsdp_mesh=mesh["data_parallel"],
    )  # fmt: skip


def _train(model, batches) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for batch in batches:
        M.loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()


def _tp_check(family: str, dropout: float = 0.0) -> float:
    model = M.build(family, dropout=dropout)
    ref = copy.deepcopy(model)
    batches = [M.inputs(family, rows=2, seed=10 + i) for i in range(TP_STEPS)]
    torch.manual_seed(5)
    _train(ref, batches)
    summary = _parallelize(model, 1, 2)
    assert summary["tp_coverage"].sharded_fraction >= 0.9, (family, summary["tp_coverage"].describe())
    reset_fallback_counts()
    torch.manual_seed(5)
    _train(model, batches)
    assert fallback_counts() == {}, (family, fallback_counts())  # every op had a sharding rule
    ref_params = dict(ref.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(ref_params), family
    return max((_full(p.detach()) - ref_params[n].detach()).abs().max().item() for n, p in model.named_parameters())


def _tp_families(families) -> None:
    for family in families:
        worst = _tp_check(family)
        assert worst < 1e-5, (family, worst)


@distributed(world_size=2)
def test_tp_auto_plan_matches_one_process():
    _tp_families(DEFAULT)


@pytest.mark.slow
@distributed(world_size=2)
def test_tp_auto_plan_more_families_match_one_process():
    _tp_families(MORE)


@pytest.mark.slow
@distributed(world_size=4)
def test_fsdp2_x_tp2_matches_one_process():
    # Every data-parallel rank sees the same batches, so the averaged gradients equal one process's.
    for family in ("deberta_v2", "bart", "albert", "whisper"):
        model = M.build(family)
        ref = copy.deepcopy(model)
        batches = [M.inputs(family, rows=2, seed=10 + i) for i in range(2)]
        _train(ref, batches)
        _parallelize(model, 2, 2)
        _train(model, batches)
        ref_params = dict(ref.named_parameters())
        worst = max(
            (_full(p.detach()) - ref_params[n].detach()).abs().max().item() for n, p in model.named_parameters()
        )
        assert worst < 1e-5, (family, worst)


# ----------------------------------------------------------------------------- dropout, shared layers, errors
def _fsdp_check(family: str, dropout: float, fsdp_unit="auto") -> float:
    """FSDP over 2 ranks (each its half of every batch) against one process that replays, for each rank's half,
    the random state every rank starts the step from (ranks are seeded alike): the same dropout masks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = M.build(family, dropout=dropout)
    ref = copy.deepcopy(model)
    batches = [M.inputs(family, rows=2 * world, seed=20 + i) for i in range(2)]
    torch.manual_seed(7)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for batch in batches:
        state = torch.get_rng_state()
        for r in range(world):
            torch.set_rng_state(state)
            (M.loss_of(ref, M.select(batch, slice(2 * r, 2 * r + 2))) / world).backward()
        opt.step()
        opt.zero_grad()
    _parallelize(model, world, 1, fsdp_unit)
    torch.manual_seed(7)
    _train(model, [M.select(b, slice(2 * rank, 2 * rank + 2)) for b in batches])
    ref_params = dict(ref.named_parameters())
    return max((_full(p.detach()) - ref_params[n].detach()).abs().max().item() for n, p in model.named_parameters())


@distributed(world_size=2)
def test_fsdp_keeps_each_ranks_dropout_stream_and_shares_albert_layer_across_units():
    from transformers.models.albert.modeling_albert import AlbertLayer

    # Dropout 0.1 in train mode: FSDP draws nothing from the random stream, so each rank's masks are those one
    # process draws for that rank's rows from the same seed.
    worst = _fsdp_check("bert_seqcls", 0.1)
    assert worst < 1e-5, worst
    # ALBERT applies its one AlbertLayer at every depth: as an FSDP unit it is gathered, used and reduced twice
    # per step (the gradient is the sum of both uses), with dropout on.
    worst = _fsdp_check("albert", 0.1, fsdp_unit={AlbertLayer})
    assert worst < 1e-5, worst


@distributed(world_size=2)
def test_tp_with_dropout_warns_and_is_exact_in_eval_mode():
    # Training mode: dropout inside sharded attention acts on each rank's heads with the same random stream,
    # not the masks one device draws: the plan says so (summary and warning) instead of staying silent.
    model = M.build("bert_seqcls", dropout=0.1)
    with pytest.warns(UserWarning, match=r"dropout in training mode inside tensor-parallel modules: bert\.encoder"):
        summary = _parallelize(model, 1, 2)
    assert any(line.startswith("dropout: ") for line in summary["tp_summary"])
    # Eval mode (validation, or dropout switched off): exact, with the same configured model.
    model = M.build("bert_seqcls", dropout=0.1).eval()
    ref = copy.deepcopy(model)
    _parallelize(model, 1, 2)
    batches = [M.inputs("bert_seqcls", rows=2, seed=30 + i) for i in range(2)]
    _train(ref, batches)
    _train(model, batches)
    ref_params = dict(ref.named_parameters())
    worst = max((_full(p.detach()) - ref_params[n].detach()).abs().max().item() for n, p in model.named_parameters())
    assert worst < 1e-5, worst


@distributed(world_size=2)
def test_clip_with_its_scalar_parameter_trains_as_one_process_under_fsdp():
    # CLIP's logit_scale is 0-dim: fully_shard refused it (as torch's does), so CLIP could not train through the
    # strategy. It is kept whole on every rank now (Replicate), its gradient reduced with its group's.
    _fit_and_compare("clip")


@distributed(world_size=2)
def test_clip_with_its_scalar_parameter_trains_as_one_process_under_tp():
    worst = _tp_check("clip")
    assert worst < 1e-5, worst


def _contrastive(family: str):
    """A tiny random-init contrastive model with a 0-dim ``logit_scale`` (besides CLIP), and a batch for it."""
    import transformers as T

    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    text = dict(layers, vocab_size=99, max_position_embeddings=16)
    if family == "groupvit":
        vision = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, depths=[2, 2],
                      num_group_tokens=[4, 0], num_output_groups=[4, 4], image_size=32, patch_size=8)  # fmt: skip
        config = T.GroupViTConfig(text_config=text, vision_config=vision, projection_dim=16,
                                  projection_intermediate_dim=32)  # fmt: skip
    else:
        config_class = {"owlvit": T.OwlViTConfig, "blip": T.BlipConfig}[family]
        config = config_class(
            text_config=text, vision_config=dict(layers, image_size=32, patch_size=8), projection_dim=16
        )
    model_class = {"owlvit": T.OwlViTModel, "groupvit": T.GroupViTModel, "blip": T.BlipModel}[family]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(3, 99, (4, 8), generator=g),
        "pixel_values": torch.randn(4, 3, 32, 32, generator=g),
    }
    return model_class(config), dict(batch, return_loss=True)


@pytest.mark.slow
@distributed(world_size=2)
def test_contrastive_models_with_a_scalar_parameter_reduce_as_one_process():
    # OWL-ViT, GroupViT and BLIP hold a 0-dim logit_scale as CLIP does. Eval mode: GroupViT's training-mode
    # Gumbel sampling draws per rank. One backward of each rank's half against one process's mean of the halves.
    rank = dist.get_rank()
    for family in ("owlvit", "groupvit", "blip"):
        model, batch = _contrastive(family)
        model.eval()
        ref = copy.deepcopy(model)
        halves = [M.select(batch, slice(2 * r, 2 * r + 2)) for r in range(2)]
        (sum(ref(**half).loss for half in halves) / 2).backward()
        _parallelize(model, 2, 1)
        assert model.logit_scale.shape == () and model.logit_scale.placements[0].is_replicate()
        model(**halves[rank]).loss.backward()
        for name, p in model.named_parameters():
            expected = ref.get_parameter(name).grad
            if expected is None:  # not reached (a pooler the loss does not use): None here too
                assert p.grad is None, (family, name)
                continue
            scale = max(expected.abs().max().item(), 1.0)  # BLIP's tiny random model has gradients of 1e7
            assert (_full(p.grad) - expected).abs().max().item() < 1e-5 * scale, (family, name)


if __name__ == "__main__":
    # The measurements in docs/huggingface.md:
    #   torchrun --nproc_per_node 2 -m tests.test_hf_encoders
    import warnings

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for name in [*DEFAULT, *MORE]:
        fsdp, val = _fit_and_compare(name)
        tp = _tp_check(name)
        tp_drop = _tp_check(name, dropout=0.1)
        fsdp_drop = _fsdp_check(name, 0.1)
        if dist.get_rank() == 0:
            print(f"| {name} | {fsdp:.1e} | {val:.1e} | {tp:.1e} | {fsdp_drop:.1e} | {tp_drop:.1e} |", flush=True)
    dist.destroy_process_group()


class _ComputedPositions(torch.nn.Embedding):
    def forward(self, ids):  # looks up indices it computes itself
        return super().forward(torch.arange(ids.shape[-1]))


def test_plan_leaves_embeddings_it_cannot_serve_replicated_with_whatever_shares_their_weight():
    from lightning_shard.tp import auto_tp_plan

    tied = torch.nn.ModuleDict({"pos": _ComputedPositions(16, 8), "tok": torch.nn.Embedding(16, 8)})
    tied["head"] = torch.nn.Linear(8, 16, bias=False)
    tied["head"].weight = tied["tok"].weight = tied["pos"].weight
    plan, summary = auto_tp_plan(tied, 2, return_summary=True)
    assert not {"pos", "tok", "head"} & set(plan), plan  # one placement for the one weight: replicated
    assert "tok: embedding left replicated (its weight is shared with pos, which stays replicated)" in summary
    plan, summary = auto_tp_plan(M.build("bart"), 2, return_summary=True)
    assert "model.encoder.embed_positions" not in plan and "model.shared" in plan and "lm_head" in plan
    plan, summary = auto_tp_plan(M.build("deberta_v2"), 2, return_summary=True)
    assert "deberta.encoder.rel_embeddings: embedding left replicated (DebertaV2Encoder reads " \
        "self.rel_embeddings.weight directly)" in summary  # fmt: skip
