"""Standard ``torch.nn`` architectures other than transformers' models through
``Trainer(strategy="shard_fsdp_tp")`` on 2 gloo ranks (FSDP 2, and TP 2 where the automatic plan has something
to do or must leave modules replicated), compared with one process on the same global batches: parameters
after a few SGD-with-momentum or AdamW steps, each rank's buffers, and the validation loss in eval mode under
``no_grad``. Models: ``tests/arch_models.py``. What is checked and the choices made: docs/fsdp.md
("Architectures beyond transformers")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import strategies
from lightning_shard.tensor import DTensor
from tests.arch_models import LitArch, reference_run, reference_val_loss
from tests.harness import distributed
from tests.test_strategy import _trainer

STEPS = 3
TOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _worst(ours: dict, ref: dict, k: int = 3) -> list[tuple[float, str]]:
    assert ours.keys() == ref.keys(), sorted(ours.keys() ^ ref.keys())
    diffs = [((_full(ours[n]).double() - ref[n].detach().double()).abs().max().item(), n) for n in ours]
    return sorted(diffs, reverse=True)[:k]


def fit_and_compare(name: str, tp: int = 1, opt: str = "sgd", per_rank_buffers: bool = False, trainer_kwargs=None):
    """Train ``name`` for ``STEPS`` steps on this pool's 2 ranks, compare with one process; returns the module,
    the trainer and the reference (model, per-rank buffers)."""
    module = LitArch(name, opt=opt)
    strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp, **(trainer_kwargs or {}))
    trainer = _trainer(strategy=strategy, max_steps=STEPS, limit_val_batches=1.0)
    trainer.fit(module)
    dp = dist.get_world_size() // tp
    ref, ref_buffers = reference_run(name, STEPS, dp, opt=opt, per_rank_buffers=per_rank_buffers)
    worst = _worst(dict(module.model.named_parameters()), dict(ref.named_parameters()))
    assert worst[0][0] < TOL, f"{name}, tp={tp}: parameters differ from one process: {worst}"
    dp_rank = dist.get_rank() // tp
    worst = _worst(dict(module.model.named_buffers()), ref_buffers[dp_rank])
    assert not worst or worst[0][0] < TOL, f"{name}, tp={tp}: buffers differ from one process: {worst}"
    val = trainer.validate(module, verbose=False)[0]["val_loss"]
    expected = reference_val_loss(ref, name, dp, ref_buffers)
    assert val == pytest.approx(expected, abs=TOL, rel=TOL), f"{name}, tp={tp}: validation loss"
    return module, trainer, (ref, ref_buffers)


# ---------------------------------------------------------------------------------------------- 1. RNNs
@distributed(world_size=2)
def test_rnn_family_fsdp():
    # nn.LSTM/GRU/RNN keep _flat_weights, refreshed at each forward when the registered parameter objects
    # changed (torch >= 2.1): the FSDP swap between sharded and unsharded parameters is seen.
    _, trainer, _ = fit_and_compare("rnn", opt="adamw")
    assert trainer.strategy.parallel_summary["fsdp_units"] == ["FSDPRNNBlock", "FSDPRNNBlock"]


@distributed(world_size=2)
def test_rnn_family_tp():
    _, trainer, _ = fit_and_compare("rnn", tp=2)
    lines = "\n".join(trainer.strategy.parallel_summary["tp_summary"])
    assert "model.lstm" not in lines  # the RNNs are not recognised: replicated


# ---------------------------------------------------------------------------------------------- 2. BatchNorm
@distributed(world_size=2)
def test_batchnorm_per_rank_statistics(tmp_path):
    # Batch statistics over each rank's own rows and running statistics of its own batches, as torch's FSDP2
    # and DDP (without broadcast_buffers) keep them; eval mode uses this rank's running statistics.
    module, trainer, _ = fit_and_compare("bn_cnn", per_rank_buffers=True)
    stats = [None, None]
    dist.all_gather_object(stats, {n: b.clone() for n, b in module.model.named_buffers()})
    assert not torch.equal(stats[0]["blocks.0.bn.running_mean"], stats[1]["blocks.0.bn.running_mean"])
    # Checkpoints hold rank 0's buffers (a buffer is a plain replicated tensor: rank 0 writes it), in both forms;
    # loading gives every rank those, so a resumed run starts from one set of statistics.
    sharded = str(tmp_path / "bn_sharded")
    trainer.save_checkpoint(sharded)
    loaded = LitArch("bn_cnn")
    _trainer(strategy=strategies.ShardFSDPTPStrategy(), limit_val_batches=1.0).validate(
        loaded, ckpt_path=sharded, verbose=False
    )
    for n, b in loaded.model.named_buffers():
        assert torch.equal(b, stats[0][n]), n
    full = str(tmp_path / "bn_full.ckpt")
    full_trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(state_dict_type="full"), max_steps=1)
    full_trainer.fit(LitArch("bn_cnn"))
    rank0 = {n: b.clone() for n, b in full_trainer.lightning_module.model.named_buffers()}
    full_trainer.save_checkpoint(full)
    if dist.get_rank() == 0:
        saved = torch.load(full, weights_only=True)["state_dict"]
        for n, b in rank0.items():
            assert torch.equal(saved[f"model.{n}"], b), n


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_sync_batchnorm_flag(tp):
    # Trainer(sync_batchnorm=True) was ignored (per-rank statistics, no error); now the BatchNorm layers become
    # nn.SyncBatchNorm over the data-parallel ranks, which torch runs on accelerators only: on CPU its forward
    # raises on every rank (torch's ValueError), before any collective.
    from torch.nn.modules.batchnorm import _BatchNorm

    module = LitArch("bn_cnn")
    strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp)
    trainer = _trainer(strategy=strategy, max_steps=1, sync_batchnorm=True)
    with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        trainer.fit(module)
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    assert len(norms) == 2 and all(isinstance(m, torch.nn.SyncBatchNorm) for m in norms)
    for m in norms:  # all ranks see different data with TP 1; with TP 2 both ranks see the same batch
        assert (m.process_group is None) if tp == 1 else dist.get_world_size(m.process_group) == 1


# ---------------------------------------------------------------------------------------------- 3. parametrizations
@distributed(world_size=2)
def test_parametrizations_fsdp():
    fit_and_compare("param")


@distributed(world_size=2)
def test_parametrizations_tp():
    fit_and_compare("param", tp=2)


# ---------------------------------------------------------------------------------------------- 4. nn.Transformer
@distributed(world_size=2)
def test_transformer_fsdp_and_fused_eval_path(monkeypatch):
    calls = []
    fused = torch._transformer_encoder_layer_fwd

    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    # SGD: the key bias of an attention has a zero gradient in exact arithmetic (softmax ignores it), and
    # AdamW would turn its rounding noise (1e-9, different in any other summation order) into full-size steps.
    _, trainer, _ = fit_and_compare("transformer")
    assert calls, "validation did not take nn.TransformerEncoderLayer's fused eval path"
    units = trainer.strategy.parallel_summary["fsdp_units"]
    assert units == ["FSDPTransformerDecoderLayer"] * 2, units


@distributed(world_size=2)
def test_transformer_tp():
    fit_and_compare("transformer", tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_transformer_sequence_first(tp):
    fit_and_compare("transformer_seq_first", tp=tp)


# ---------------------------------------------------------------------------------------------- 5. embeddings
@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_embedding_bag_and_padding_idx(tp):
    fit_and_compare("embedding", tp=tp)


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_embedding_max_norm_renormalises_the_sharded_weight(tp):
    # The lookup renormalises rows of the weight in place. Before lightning_shard.fsdp.max_norm the
    # renormalisation landed in the gathered copy only: embed.weight differed from one process by 9.5 after 3
    # steps with no error.
    _, trainer, _ = fit_and_compare("max_norm", tp=tp)
    if tp > 1:
        assert any("max_norm" in line for line in trainer.strategy.parallel_summary["tp_summary"])


# ---------------------------------------------------------------------------------------------- 6. odd uses
@distributed(world_size=2)
def test_frozen_shared_twice_unused_groupnorm_prelu_conv():
    # AdamW's weight decay moves a parameter with a zero .grad and skips one with None: 'unused' must keep None.
    module, _, _ = fit_and_compare("misc", opt="adamw")
    model = module.model
    assert model.unused.weight.grad is None and model.frozen.weight.grad is None


@pytest.mark.slow
@distributed(world_size=2)
def test_frozen_shared_twice_unused_groupnorm_prelu_conv_tp():
    fit_and_compare("misc", tp=2)


class _Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.always = torch.nn.Linear(4, 4)
        self.sometimes = torch.nn.Linear(4, 4)
        self.never = torch.nn.Linear(4, 4)

    def forward(self, x, use_sometimes: bool):
        h = self.always(x)
        return h + self.sometimes(x) if use_sometimes else h


@distributed(world_size=2)
def test_gradient_only_where_some_rank_computed_one():
    # One device leaves .grad None for a parameter no sample used, and AdamW (weight decay) then skips it; a
    # parameter used by any sample has a gradient. Before GradientPresence every parameter of a group that
    # reduced got a .grad (zeros where no rank had one): 'never' decayed (1e-4 off after 3 AdamW steps).
    from lightning_shard.fsdp import fully_shard

    torch.manual_seed(0)
    ref = _Branches()
    model = _Branches()
    model.load_state_dict(ref.state_dict())
    fully_shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in (ref, model)]
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2, 4, 4, generator=g)
        for opt in opts:
            opt.zero_grad()
        # rank 0 uses 'sometimes', rank 1 does not: one device sees both halves of the global batch
        sum(ref(x[r], use_sometimes=r == 0).square().mean() / 2 for r in range(2)).backward()
        model(x[rank], use_sometimes=rank == 0).square().mean().backward()
        assert model.never.weight.grad is None and model.never.bias.grad is None
        assert model.sometimes.weight.grad is not None  # also on rank 1, which did not use it
        for opt in opts:
            opt.step()
    worst = _worst(dict(model.named_parameters()), dict(ref.named_parameters()))
    assert worst[0][0] < TOL, worst


@distributed(world_size=2, timeout=120)
def test_max_norm_forward_on_rank_zero_inside_summon_full_params():
    # FSDP hooks are off inside summon_full_params, so a forward on rank 0 only must not wait for rank 1: the
    # max_norm hook's all-reduce is skipped there (the module renormalises its full parameter itself).
    from lightning_shard.fsdp import fully_shard, summon_full_params
    from tests.arch_models import MaxNormEmbedding

    torch.manual_seed(0)
    model = fully_shard(MaxNormEmbedding())
    with summon_full_params(model, writeback=False, rank0_only=True):
        if dist.get_rank() == 0:
            model(torch.randint(0, 16, (2, 6)))
    dist.barrier()
