"""Activation checkpointing as users write it, under our FSDP, TP and through the Trainer, against one process
running the same code on the same data (every parameter after several optimizer steps).

* Engine, TP 2 (``tests/tp_models.Llama``, automatic plan): selective checkpointing
  (``create_selective_checkpoint_contexts``) with a policy saving matmuls, one also saving communication (as
  torchtitan's does) and one saving everything but pointwise ops, with and without sequence parallel; plain
  reentrant and non-reentrant checkpointing with dropout after each block (the recompute must draw the same
  mask: compared with one process that does not checkpoint at all).
* Engine, FSDP 2: reentrant checkpoints around units, a region spanning two units, a unit called twice inside
  one region, ``checkpoint_sequential`` over plain submodules of the root, a reentrant region whose input needs
  no gradient (its parameters then get none, as in one process), selective checkpointing saving every op around
  units, gradient accumulation without sync with ``reshard_after_forward=False``, and dropout inside reentrant
  and non-reentrant regions (against one process without checkpointing that runs each rank's half under the
  rank's seed); plus the all-gathers each form costs.
* Trainer: Hugging Face ``gradient_checkpointing_enable()`` (the installed transformers defaults to
  ``use_reentrant=False``; both are run) on Llama, GPT-2 and BERT under FSDP 2 and TP 2, called in
  ``__init__`` or ``configure_model`` (slow: also FSDP 2 x TP 2 on 4 ranks); each run checks that the layers
  were recomputed.
"""

from __future__ import annotations

import functools
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, checkpoint_sequential
from torch.utils.checkpoint import create_selective_checkpoint_contexts as sac_contexts

import strategies
from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from lightning_shard.tp import auto_tp_plan, parallelize_module
from tests.fsdp_models import DIM, VOCAB, Block, batches, full_state, max_diff, rank_slice
from tests.harness import distributed
from tests.tp_models import Llama

aten = torch.ops.aten
_POINTWISE = (aten.silu.default, aten.mul.Tensor, aten.add.Tensor)

# Selective-checkpointing policies: which op outputs the forward keeps for the recompute.
POLICIES = {
    "matmuls": lambda op: op in (aten.mm.default, aten.addmm.default),
    # torchtitan keeps collective outputs so that the recompute does not communicate again
    "matmuls+comm": lambda op: (
        op in (aten.mm.default, aten.addmm.default) or op.namespace in ("c10d", "_c10d_functional")
    ),
    "all_but_pointwise": lambda op: op not in _POINTWISE,
    "all": lambda op: True,
}


def _sac(policy: str):
    def decide(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if POLICIES[policy](op) else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(sac_contexts, decide)


def _step_all(model, data, *, halves=None, accumulate=1, no_sync=False):
    """SGD with momentum; the same seed before each micro-batch in every run (dropout draws the same masks).

    ``halves``: None trains on whole batches; ``"rank"`` on this rank's half (2 data-parallel ranks);
    ``"both"`` is one process doing what those 2 ranks do: each half under the same seed, gradients averaged.
    """
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    batches_ = iter(data)
    ranks = [None] if halves is None else [dist.get_rank()] if halves == "rank" else [0, 1]
    for step in range(len(data) // accumulate):
        opt.zero_grad()
        for k in range(accumulate):
            x, y = next(batches_)
            if no_sync:
                model.set_requires_gradient_sync(k == accumulate - 1)
            for r in ranks:
                xr, yr = (x, y) if r is None else (rank_slice(x, r, 2), rank_slice(y, r, 2))
                torch.manual_seed(100 + step * accumulate + k)
                loss = F.cross_entropy(model(xr).reshape(-1, VOCAB), yr.reshape(-1))
                (loss / (accumulate * len(ranks))).backward()
        opt.step()
    return model


# ---------------------------------------------------------------------------------------------------- TP 2
class _CheckpointedLlama(Llama):
    """``Llama`` whose layers run under ``checkpoint`` (``how``: None, "reentrant", "non_reentrant" or a
    selective policy name), with dropout ``p`` on each layer's output."""

    def __init__(self, how: str | None, p: float = 0.0) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.how, self.p = how, p

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers:

            def block(h, layer=layer):
                return F.dropout(layer(h), self.p, self.training)

            if self.how is None:
                x = block(x)
            elif self.how in ("reentrant", "non_reentrant"):
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
            else:
                x = checkpoint(block, x, use_reentrant=False, context_fn=_sac(self.how))
        return self.output(self.norm(x))


@distributed(world_size=2)
def test_checkpointing_under_tp_matches_one_process():
    """Before the engine's collectives and redistribution buffers were hidden from selective checkpointing
    (``lightning_shard/sac.py``), the policy saving communication trained wrong with no error (max parameter
    difference 2.4e-3 after 4 steps: the recompute skipped the in-place all-reduce but read its buffer), and
    the one saving all but pointwise ops raised under sequence parallel ("cached ... has been mutated")."""
    data = batches(4, 4)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    cases = [
        ("matmuls", 0.0, False),
        ("matmuls+comm", 0.0, False),
        ("all_but_pointwise", 0.0, True),
        ("reentrant", 0.2, False),
        ("non_reentrant", 0.2, False),
    ]
    refs = {p: full_state(_step_all(_CheckpointedLlama(None, p), data)) for p in {c[1] for c in cases}}
    for how, p, sp in cases:
        model = _CheckpointedLlama(how, p)
        parallelize_module(model, mesh, auto_tp_plan(model, mesh, sequence_parallel=sp))
        _step_all(model, data)
        assert max_diff(full_state(model), refs[p]) < 1e-5, (how, p, sp, max_diff(full_state(model), refs[p]))


# ---------------------------------------------------------------------------------------------------- FSDP 2
class _EmbedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block()

    def forward(self, idx):
        return self.block(self.embed(idx))


class _CheckpointedStack(nn.Module):
    """Units ``first`` (embedding + block) and ``blocks[0..3]``; the root keeps ``mixer`` (plain Sequential)
    and ``head``. ``how`` picks the checkpoint form written in forward."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.first = _EmbedBlock()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.mixer = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        how, b = self.how, self.blocks
        x = self.first(idx)
        if how == "reentrant_no_grad_input":  # reentrant: no input requires grad -> mixer gets no gradient
            x = x + checkpoint(self.mixer, x.detach(), use_reentrant=True)
        if how == "reentrant_units":
            for blk in b:
                x = checkpoint(blk, x, use_reentrant=True)
        elif how == "spanning_two_units":
            x = checkpoint(lambda h: b[1](b[0](h)), x, use_reentrant=False)
            x = checkpoint(lambda h: b[3](b[2](h)), x, use_reentrant=True)
        elif how == "unit_twice":
            x = checkpoint(lambda h: b[0](b[0](h)), x, use_reentrant=True)
            x = b[3](b[2](b[1](x)))
        elif how in ("reentrant_dropout", "non_reentrant_dropout", "dropout"):
            for blk in b:

                def dropped(h, blk=blk):
                    return F.dropout(blk(h), 0.2, self.training)

                x = dropped(x) if how == "dropout" else checkpoint(dropped, x, use_reentrant=how == "reentrant_dropout")
        elif how in POLICIES:
            for blk in b:
                x = checkpoint(blk, x, use_reentrant=False, context_fn=_sac(how))
        else:
            for blk in b:
                x = blk(x)
        if how == "sequential":
            x = checkpoint_sequential(self.mixer, 2, x, use_reentrant=True)
        elif how != "reentrant_no_grad_input":
            x = self.mixer(x)
        return self.head(x)


# (form, micro-batches per step, reshard_after_forward, the one-process reference's form if not the same)
_FORMS = [
    ("reentrant_units", 1, True, None),
    ("all", 1, True, None),
]
_MORE_FORMS = [
    ("spanning_two_units", 1, True, None),
    # the recompute draws the dropout masks of the forward: equal to one process that does not checkpoint
    ("reentrant_dropout", 1, True, "dropout"),
    ("sequential", 1, True, None),  # checkpoint_sequential: reentrant checkpoints, as reentrant_units
    ("unit_twice", 1, True, None),
    ("reentrant_no_grad_input", 1, True, None),
    ("matmuls", 2, False, None),  # accumulation without sync, parameters kept from forward to backward
    ("reentrant_units", 2, False, None),
    ("non_reentrant_dropout", 2, True, "dropout"),
]


@distributed(world_size=2)
def test_checkpoint_forms_around_fsdp_units_match_one_process():
    """Selective checkpointing saving every op around a unit crashed before the FSDP forward hooks were hidden
    from it (their all-gather runs in forward, not in the recompute, so every later saved view shifted by one;
    torch's own fully_shard crashes the same way)."""
    _check_forms(_FORMS)


@pytest.mark.slow
@distributed(world_size=2)
def test_more_checkpoint_forms_around_fsdp_units_match_one_process():
    _check_forms(_MORE_FORMS)


def _check_forms(cases: list[tuple]) -> None:
    data = batches(4, 4)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    for how, accumulate, reshard, ref_how in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reentrant checkpoint: "None of the inputs have requires_grad=True"
            ref = _step_all(_CheckpointedStack(ref_how or how), data, halves="both", accumulate=accumulate)
            model = _CheckpointedStack(how)
            for unit in [model.first, *model.blocks, model]:
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
            _step_all(model, data, halves="rank", accumulate=accumulate, no_sync=accumulate > 1)
        ours, want = full_state(model), full_state(ref)
        assert max_diff(ours, want) < 1e-5, (how, accumulate, reshard, max_diff(ours, want))
        if how == "reentrant_no_grad_input":  # as in one process: untrained, so the comparison means something
            assert all(p.grad is None for p in model.mixer.parameters())
            assert torch.equal(ours["mixer.0.weight"], full_state(_CheckpointedStack(None))["mixer.0.weight"])


@distributed(world_size=2)
def test_recomputed_units_gather_once_per_backward():
    """A recompute inside backward (reentrant, or a region spanning units) used to prefetch the next unit in
    forward order, whose backward was over (gathered for nothing, held to the end of backward), and to reshard
    right before its own backward gathered it again: 18 all-gathers per step here with reentrant checkpoints,
    14 with two spanning regions, instead of 11. Now every form costs what training without checkpointing
    costs."""
    from lightning_shard import comm

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    (x, y), counts = batches(1, 2)[0], {}
    for how in (None, "reentrant_units", "spanning_two_units", "unit_twice"):
        model = _CheckpointedStack(how)
        for unit in [model.first, *model.blocks, model]:
            fully_shard(unit, mesh=mesh)
        for _ in range(2):  # the second step prefetches along the recorded forward order
            with comm.count_collectives() as c:
                F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        counts[how] = c.calls["all_gather"]
    plain = 2 * (6 - 1) + 1  # 6 groups; the root keeps its parameters for backward (docs/fsdp.md)
    # a unit called twice is gathered once more in forward and once more in backward, checkpointed or not
    assert counts == {None: plain, "reentrant_units": plain, "spanning_two_units": plain, "unit_twice": plain + 2}


@distributed(world_size=2)
def test_checkpoint_sequential_over_a_sharded_sequential_names_the_cause():
    """``checkpoint_sequential`` calls the children of the ``nn.Sequential`` directly, so when the Sequential is
    the FSDP unit its hooks never gather the parameters (torch's fully_shard fails the same way); the error
    says so, on every rank, before any collective."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    fully_shard(seq, mesh=mesh)
    x = torch.randn(2, DIM, requires_grad=True)
    with pytest.raises(RuntimeError, match="outside the forward of its fully_shard unit.*checkpoint_sequential"):
        checkpoint_sequential(seq, 2, x, use_reentrant=False)


# ---------------------------------------------------------------------------------------------------- Trainer
STEPS = 3
_FIRST_LEAF = {"llama": "layers.0.self_attn.q_proj", "gpt2": "h.0.attn.c_attn", "bert": "layer.0.attention.self.query"}


def _hf_model(family: str, dropout: float, peft: bool) -> nn.Module:
    from tests import hf_models

    model = hf_models.build(family)
    if dropout:  # GPT-2's embedding, attention and residual dropout
        model.config.update(dict(embd_pdrop=dropout, attn_pdrop=dropout, resid_pdrop=dropout))
        torch.manual_seed(0)
        model = type(model)(model.config).float()
    if peft:  # LoRA adapters on a frozen base: the case transformers makes the embedding output require grad for
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02, generator=g)  # peft starts B at zero: give every adapter a gradient
    return model


def _enable(model: nn.Module, gc_kwargs: dict | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)


def _loss(model, ids, batch_idx):
    from tests import hf_models

    torch.manual_seed(1000 + batch_idx)  # the same dropout masks here and in the reference
    return hf_models.lm_loss(model, ids)


class _LitHFCheckpointed(L.LightningModule):
    """A Hugging Face model with ``gradient_checkpointing_enable`` called in ``__init__`` or ``configure_model``;
    counts the calls of the first Linear of layer 0 (twice per step when the layer is recomputed)."""

    def __init__(self, family, gc_kwargs, where, dropout=0.0, peft=False):
        super().__init__()
        self.args = (family, gc_kwargs, dropout, peft)
        self.calls = 0
        self.model = self._build() if where == "init" else None

    def _build(self):
        family, gc_kwargs, dropout, peft = self.args
        model = _hf_model(family, dropout, peft)
        _enable(model, gc_kwargs)
        leaf = next(m for n, m in model.named_modules() if n.endswith(_FIRST_LEAF[family]))
        leaf.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))
        return model

    def configure_model(self):
        if self.model is None:
            self.model = self._build()

    def training_step(self, batch, batch_idx):
        return _loss(self.model, batch[0], batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)

    def train_dataloader(self):
        from tests.hf_models import token_dataset

        return torch.utils.data.DataLoader(token_dataset(), batch_size=2, shuffle=False)


def _hf_reference(family, dp, dropout, peft, accumulate):
    """One process without checkpointing, on the global batches the ``dp`` data-parallel ranks see."""
    from tests.hf_models import token_dataset
    from tests.lightning_models import sampler_batches

    model = _hf_model(family, dropout, peft)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    data = token_dataset()
    order = iter(sampler_batches(dp, 2, n=len(data)))
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(accumulate):
            (_loss(model, data[next(order)][0], step * accumulate + k) / accumulate).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _fit_hf(family, gc_kwargs, tp, where, dropout=0.0, peft=False, accumulate=1):
    module = _LitHFCheckpointed(family, gc_kwargs, where, dropout, peft)
    world = dist.get_world_size()
    L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp),
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module)
    case = (family, gc_kwargs, f"tp={tp}", where, dropout, peft, accumulate)
    assert module.calls == 2 * STEPS * accumulate, (case, module.calls)  # each layer ran again in backward
    ref = _hf_reference(family, world // tp, dropout, peft, accumulate)
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    assert ours.keys() == ref.keys(), case
    worst = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < 1e-5, (case, worst)


REENTRANT = {"use_reentrant": True}


@distributed(world_size=2)
def test_hf_gradient_checkpointing_through_the_trainer_matches_one_process():
    _fit_hf("llama", REENTRANT, 1, "configure_model")
    _fit_hf("gpt2", None, 2, "init", dropout=0.1)  # transformers' default: use_reentrant=False
    _fit_hf("bert", REENTRANT, 2, "configure_model")


@pytest.mark.slow
@distributed(world_size=2)
def test_more_hf_gradient_checkpointing_through_the_trainer():
    _fit_hf("llama", None, 2, "init")
    _fit_hf("llama", REENTRANT, 2, "init", accumulate=2)
    _fit_hf("gpt2", REENTRANT, 2, "configure_model", dropout=0.1)
    _fit_hf("gpt2", REENTRANT, 1, "init")
    _fit_hf("bert", None, 1, "init")
    _fit_hf("llama", REENTRANT, 1, "configure_model", peft=True)
    _fit_hf("llama", REENTRANT, 2, "configure_model", peft=True)


@pytest.mark.slow
@distributed(world_size=4)
def test_hf_gradient_checkpointing_on_fsdp2_x_tp2():
    _fit_hf("llama", REENTRANT, 2, "configure_model")
    _fit_hf("gpt2", None, 2, "init")
