"""Random numbers under tensor parallelism and FSDP through the Trainer (2 gloo ranks) and Fabric, against one
process on the same data and seed: dropout on replicated activations draws one device's masks on every rank of
a TP group, also when something drew random numbers on one rank only after setup; dropout on the
sequence-sharded stream under sequence parallel draws one device's masks; dropout on each rank's heads and MLP
columns draws as torch's ``parallelize_module``; activation checkpointing recomputes the forward's masks; a model
built on meta materializes as one process would, and what no ``reset_parameters()`` writes is an error, never
uninitialised memory.

``DropLlama`` is ``tests/tp_models.Llama`` with dropout on the embedding output and on each residual branch
(activations TP replicates, or shards by sequence under sequence parallel); ``sharded=True`` adds dropout on the
attention probabilities and the MLP hidden units (each rank's heads / columns, plain local tensors).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import strategies
from tests import tp_models
from tests.harness import distributed
from tests.lightning_models import VOCAB, dataset, sampler_batches
from tests.test_strategy import _trainer as shared_trainer

P = 0.2


class DropAttention(tp_models.LlamaAttention):
    def __init__(self, *args, p: float = 0.0) -> None:
        super().__init__(*args)
        self.attn_drop = nn.Dropout(p)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, 1) for t in (k, v))
        probs = self.attn_drop((q @ k.transpose(-2, -1) / self.head_dim**0.5).softmax(-1))
        return self.o_proj((probs @ v).transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class DropMLP(tp_models.SwiGLU):
    def __init__(self, *args, p: float = 0.0) -> None:
        super().__init__(*args)
        self.hidden_drop = nn.Dropout(p)

    def forward(self, x):
        return self.down_proj(self.hidden_drop(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class DropBlock(nn.Module):
    def __init__(self, dim: int, sharded: bool) -> None:
        super().__init__()
        inner = P if sharded else 0.0
        self.attention_norm = tp_models.RMSNorm(dim)
        self.attention = DropAttention(dim, 4, 2, 16, p=inner)
        self.ffn_norm = tp_models.RMSNorm(dim)
        self.feed_forward = DropMLP(dim, 48, p=inner)
        self.resid_drop = nn.Dropout(P)

    def forward(self, x):
        h = x + self.resid_drop(self.attention(self.attention_norm(x)))
        return h + self.resid_drop(self.feed_forward(self.ffn_norm(h)))


class DropLlama(nn.Module):
    def __init__(self, sharded: bool = False, dim: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.emb_drop = nn.Dropout(P)
        self.layers = nn.ModuleList(DropBlock(dim, sharded) for _ in range(2))
        self.norm = tp_models.RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb_drop(self.tok_embeddings(idx))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


@contextlib.contextmanager
def _global_seed(seed: int | None):
    """``seed_everything(seed)`` (``None``: no global seed, as in a fresh process); the environment variables it
    sets, which the strategy's ``reset_seed()`` reads, are restored afterwards (the test workers are reused)."""
    saved = {k: os.environ.pop(k, None) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    try:
        if seed is not None:
            L.seed_everything(seed, verbose=False)
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class LitDrop(L.LightningModule):
    """``rank0_draws``: rank 0 alone draws from the global generator after every step (a rank-zero-only callback
    sampling something to log), so the TP ranks' generators part ways after setup."""

    def __init__(self, sharded: bool = False, rank0_draws: bool = False) -> None:
        super().__init__()
        self.model = DropLlama(sharded)
        self.rank0_draws = rank0_draws
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = _loss(self.model, *batch)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, *args) -> None:
        if self.rank0_draws and self.global_rank == 0:
            torch.rand(3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=4)


def _trainer(steps: int = 3, tp: int = 2, **strategy_kwargs) -> L.Trainer:
    strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp, **strategy_kwargs)
    return shared_trainer(strategy=strategy, max_steps=steps)


def _reference(steps: int, sharded: bool = False, rank0_draws: bool = False, loader_draw: bool = True):
    """One process, the Trainer's random stream: seeded, the model built, re-seeded by the strategy's
    ``reset_seed()``, one draw for the data loader's base seed, then per step the forward's dropout (and rank 0's
    extra draw). The data: the sampler's order for one data-parallel replica."""
    torch.manual_seed(0)
    model = DropLlama(sharded)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(0)
    if loader_draw:
        torch.empty((), dtype=torch.int64).random_()
    data, losses = dataset(), []
    for idx in sampler_batches(1, 4)[:steps]:
        opt.zero_grad()
        loss = _loss(model, *data[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank0_draws:
            torch.rand(3)
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def _max_diff(lit, ref) -> float:
    ours = {n: p.full_tensor() for n, p in lit.model.named_parameters()}
    return max((ours[k] - ref[k]).abs().max().item() for k in ref)


def _tp_drift(lit) -> float:
    """The largest difference between the TP ranks' copies of the parameters TP replicates."""

    def replicated(p) -> bool:  # data-parallel size 1: the local tensor of an FSDP shard is whole
        names = p.device_mesh.mesh_dim_names
        return "tensor_parallel" not in names or p.placements[names.index("tensor_parallel")].is_replicate()

    mine = {n: p.to_local().detach().clone() for n, p in lit.model.named_parameters() if replicated(p)}
    assert "norm.weight" in mine
    theirs = [None, None]
    dist.all_gather_object(theirs, mine)
    return max((theirs[0][k] - theirs[1][k]).abs().max().item() for k in mine)


@distributed(world_size=2)
def test_rank_zero_draws_after_setup_do_not_split_the_tp_groups_dropout_masks():
    """Rank 0 draws after every step (the generators of the TP group part ways after setup, where they were
    synced): the replicated activations' dropout masks must still be the same on both ranks, one device's.
    Without the per-step sync rank 1 drew other masks for the same replicated activations and the collectives
    mixed the two: parameters off one device's by 0.062, the ranks' copies of the replicated weights 0.026 apart,
    no error."""
    with _global_seed(0):
        lit = LitDrop(rank0_draws=True)
        _trainer(sequence_parallel=False).fit(lit)
    ref, ref_losses = _reference(3, rank0_draws=True)
    assert lit.losses == pytest.approx(ref_losses, abs=1e-5)
    assert _max_diff(lit, ref) < 1e-5
    assert _tp_drift(lit) == 0


@distributed(world_size=2)
def test_fabric_rank_zero_draws_between_steps_do_not_split_the_tp_groups_dropout_masks():
    """Fabric has no training step: the TP group's generators are synced before every training-mode forward."""
    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy=strategies.ShardFSDPTPFabricStrategy(tensor_parallel_size=2),
    )
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(DropLlama())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    torch.manual_seed(0)
    data, losses = dataset(), []
    for idx in sampler_batches(1, 4)[:3]:
        loss = _loss(model, *data[idx])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            torch.rand(3)
    ref, ref_losses = _reference(3, rank0_draws=True, loader_draw=False)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    ours = {n: p.full_tensor() for n, p in model.module.named_parameters()}
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


@distributed(world_size=2)
def test_dropout_on_the_sequence_sharded_stream_draws_one_devices_masks():
    """Under sequence parallel the embedding and residual dropout act on each rank's part of the sequence. As plain
    tensors both ranks drew the same mask for their halves (positions t and t + T/2 dropped alike), off one
    device's training; the plan runs them as DTensors (SequenceParallel), which draw one device's mask."""
    with _global_seed(0):
        lit = LitDrop()
        trainer = _trainer(sequence_parallel=True)
        trainer.fit(lit)
    assert "sequence_parallel: on" in "\n".join(trainer.strategy.parallel_summary["tp_summary"])
    ref, ref_losses = _reference(3)
    assert lit.losses == pytest.approx(ref_losses, abs=1e-5)
    assert _max_diff(lit, ref) < 1e-5


def _block_init(block: tp_models.LlamaBlock, norms: bool = True) -> None:
    """What ``tests/tp_models.Llama.__init__`` computes and no ``reset_parameters()`` of its modules re-creates:
    the attention's rotary tables (non-persistent buffers) and the RMSNorm weights (ones)."""
    attention = block.attention
    cos, sin = tp_models.rotary_tables(attention.head_dim, attention.cos.shape[0])
    attention.cos.copy_(cos)
    attention.sin.copy_(sin)
    if norms:
        nn.init.ones_(block.attention_norm.weight)
        nn.init.ones_(block.ffn_norm.weight)


def _meta_llama(init: str) -> tp_models.Llama:
    """``init="all"``: the blocks and the final norm get a ``reset_parameters()`` writing what ``__init__``
    computed; ``"buffers"``: the blocks' writes the rotary tables only; ``"none"``: nothing."""
    with torch.device("meta"):
        model = tp_models.Llama(vocab=VOCAB)
    if init != "none":
        for block in model.layers:
            block.reset_parameters = functools.partial(_block_init, block, norms=init == "all")
    if init == "all":
        model.norm.reset_parameters = lambda: nn.init.ones_(model.norm.weight)  # the sharded one, when called
    return model


class LitMeta(L.LightningModule):
    """``tests/tp_models.Llama`` built on the meta device in ``configure_model``."""

    def __init__(self, init: str) -> None:
        super().__init__()
        self.init = init
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = _meta_llama(self.init)

    def training_step(self, batch, batch_idx):
        return _loss(self.model, *batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=4)


def _meta_reference(seed: int) -> tuple[tp_models.Llama, dict[str, torch.Tensor]]:
    """One process, the same procedure: on meta, ``to_empty``, every module's ``reset_parameters()`` in order."""
    torch.manual_seed(seed)
    model = _meta_llama("all")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for m in model.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
    return model, {n: p.detach() for n, p in model.named_parameters()}


@distributed(world_size=2)
def test_meta_init_under_tp_equals_one_process_and_never_trains_on_uninitialised_memory():
    """TP 2, ranks seeded differently: the materialized parameters and buffers are one process's (from rank 0's
    seed), replicated ones equal on both ranks. Then FSDP 2 without the blocks' reset_parameters(): the norms'
    weights and the rotary tables were uninitialised memory (up to ~1e32 and different on each rank) and
    training went on with them; now the first step raises on every rank, naming them."""
    torch.manual_seed(10 + dist.get_rank())
    lit = LitMeta("all")
    with _global_seed(None):
        _trainer(steps=0, sequence_parallel=False).fit(lit)
    model, ref = _meta_reference(10)
    assert _max_diff(lit, ref) == 0
    assert _tp_drift(lit) == 0
    assert all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in lit.model.named_buffers())

    lit = LitMeta("none")
    with pytest.raises(RuntimeError, match=r"(?s)layers\.0\.attention_norm\.weight.*cos.*no reset_parameters\(\)"):
        _trainer(tp=1).fit(lit)


@distributed(world_size=2)
def test_meta_init_with_a_checkpoint_loading_what_no_reset_parameters_wrote_trains(tmp_path):
    """Lightning's pattern for big models: build on meta, ``fit(ckpt_path=...)``. The norms (no
    reset_parameters) are NaN after setup; the checkpoint writes them before the first step: no error."""
    path = str(tmp_path / "meta.ckpt")
    trainer = _trainer(steps=1, tp=1)
    trainer.fit(LitMeta("all"))
    trainer.save_checkpoint(path)
    lit = LitMeta("buffers")
    trainer = _trainer(steps=2, tp=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lit, ckpt_path=path)  # one step after the restore
    assert trainer.global_step == 2
    if dist.get_rank() == 0:  # said at setup (rank zero): the norms were unwritten then
        assert any("attention_norm.weight'" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert all(torch.isfinite(p.full_tensor()).all() for p in lit.parameters())


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_dropout_inside_activation_checkpointing_recomputes_the_same_masks(tp):
    """The strategy's activation checkpointing recomputes each block in backward: its dropout (replicated,
    sequence-sharded DTensor under TP's sequence parallel, each rank's heads and MLP columns) must draw the
    forward's masks again, or the gradients belong to another network. FSDP 2 and TP 2 (sequence parallel on):
    parameters and losses equal to the run without checkpointing."""
    runs = []
    for policy in (None, {DropBlock}):
        with _global_seed(0):
            lit = LitDrop(sharded=True)
            _trainer(tp=tp, activation_checkpointing_policy=policy).fit(lit)
        runs.append(({n: p.full_tensor() for n, p in lit.model.named_parameters()}, lit.losses))
    (plain, plain_losses), (ckpt, ckpt_losses) = runs
    assert ckpt_losses == plain_losses
    assert max((ckpt[k] - plain[k]).abs().max().item() for k in plain) == 0


@distributed(world_size=2)
def test_dropout_on_each_ranks_heads_and_columns_draws_as_torch_parallelize_module():
    """Dropout inside the sharded attention and MLP acts on plain local tensors (each rank's heads / MLP
    columns). torch's TP draws those masks from the default generator at the same stream position on every rank,
    so each rank's part gets the same mask (not one device's; docs/tp.md). Ours does exactly what torch's
    ``parallelize_module`` does with torchtitan's plan on the same model, seed and batch."""
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor.parallel import ColwiseParallel as TC
    from torch.distributed.tensor.parallel import RowwiseParallel as TRow
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from lightning_shard import init_device_mesh
    from lightning_shard.tp import auto_tp_plan, parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    torch.manual_seed(0)
    ours = DropLlama(sharded=True)
    theirs = DropLlama(sharded=True)
    theirs.load_state_dict(ours.state_dict())
    with pytest.warns(UserWarning, match="dropout in training mode inside tensor-parallel modules"):
        plan = auto_tp_plan(ours, mesh, sequence_parallel=False)
    parallelize_module(ours, mesh, plan)
    torch_plan = {"tok_embeddings": TRow(input_layouts=TR()), "output": TC(output_layouts=TR())}
    for name in ("q_proj", "k_proj", "v_proj"):
        torch_plan[f"layers.*.attention.{name}"] = TC()
    torch_plan["layers.*.attention.o_proj"] = TRow()
    torch_plan.update({"layers.*.feed_forward.gate_proj": TC(), "layers.*.feed_forward.up_proj": TC()})
    torch_plan["layers.*.feed_forward.down_proj"] = TRow()
    torch_parallelize(theirs, mesh.to_torch(), torch_plan)
    for layer in theirs.layers:
        layer.attention.n_heads //= 2
        layer.attention.n_kv_heads //= 2
    x, y = dataset()[:4]
    outs = []
    for model in (ours, theirs):
        torch.manual_seed(5)
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}  # torch's plan leaves the norms plain tensors
        outs.append((logits, {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}))
    (ours_logits, ours_grads), (their_logits, their_grads) = outs
    assert torch.equal(ours_logits, their_logits)
    assert max((ours_grads[k] - their_grads[k]).abs().max().item() for k in ours_grads) < 1e-6
