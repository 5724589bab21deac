"""Known weak spots, each compared with one process (or checked to raise a clear error) on 2 gloo ranks:

* optimizers under TP: a fused step (``fused=True``) over a model whose TP plan leaves some parameters plain
  tensors (norm weights) raised ``IndexError`` in the fallback; it now takes one local fused call. The Adam
  family's distance from one process (up to ~2e-4 on a tiny Hugging Face Llama at lr 1e-2) is float noise:
  torch's own ``parallelize_module`` is as far or farther, it does not grow with the steps, and SGD is within
  1e-7 (``slow``: the optimizer matrix against torch's TP).
* a half-complete TP plan (q/k/v column-parallel without ``o_proj``, a lone ``RowwiseParallel`` ``down_proj``)
  failed with a bare shape error in forward; the error now carries a note naming the modules, styles and fix
  (``slow``: more plans, a Hugging Face Llama, the Trainer with a user's ``tp_plan``).
* ``torch.nn.utils.prune`` and ``nn.init.sparse_``/``dirac_`` on sharded parameters raised generic
  ``aten.index_put_``/``aten.copy_`` errors; they now name the function and the supported order, and the
  error's recipe for ``sparse_`` (initialise the full value, copy it back) gives one process's values.
* the TP same-batch check looked at batch 0 of each epoch only: data whose first batch agrees across a TP group
  and later batches do not trained wrong with no error; every training batch is now checked by a sampled
  checksum carried in the all-reduce the strategy makes before each batch anyway.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_shard import init_device_mesh
from lightning_shard.tensor import DTensor
from lightning_shard.tp import auto_tp_plan, parallelize_module
from lightning_shard.tp.input_check import TPInputMismatchError
from tests import hf_models, tp_models
from tests.harness import distributed
from tests.lightning_models import dataset
from tests.test_tp_input_check import LitPerRankData
from tests.test_tp_input_check import _trainer as tp_trainer

VOCAB = 101


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tp_mesh():
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))


def _batches(steps: int, vocab: int = VOCAB) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, vocab, (2, 8), generator=g), torch.randint(0, vocab, (2, 8), generator=g))
        for _ in range(steps)
    ]


def _loss(model, idx, tgt) -> torch.Tensor:
    if isinstance(model, tp_models.Llama):
        return F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten(0, 1))
    return model(input_ids=idx, labels=tgt).loss


def _train(model, make_opt, batches) -> dict[str, torch.Tensor]:
    opt = make_opt(model.parameters())
    for idx, tgt in batches:
        _loss(model, idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    return {n: _full(p.detach()) for n, p in model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------------------------------ 1. optimizers under TP
@distributed(world_size=2)
def test_fused_step_with_parameters_the_plan_leaves_plain():
    mesh = _tp_mesh()
    for make_opt in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    ):
        torch.manual_seed(0)
        model = tp_models.Llama()
        ref = copy.deepcopy(model)
        batches = _batches(3)
        expected = _train(ref, make_opt, batches)
        parallelize_module(model, mesh, auto_tp_plan(model, mesh, sequence_parallel=False, loss_parallel=False))
        assert not isinstance(model.norm.weight, DTensor)  # the case: plain and sharded parameters in one step
        assert _worst(_train(model, make_opt, batches), expected) < 1e-5


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_loop_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False, amsgrad=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
}


def _torch_tp(model, mesh) -> None:
    """torch's own ``parallelize_module`` with the plan ``auto_tp_plan`` makes for a Hugging Face Llama
    (Hugging Face's attention reshapes with -1 heads, so no attribute changes are needed)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh.to_torch(), plan)


@pytest.mark.slow
@distributed(world_size=2)
def test_optimizers_under_tp_as_close_to_one_process_as_torch_tp():
    """Each optimizer, 5 steps on a tiny Hugging Face Llama under TP 2: ours is within float noise of one
    process, where the noise is what torch's own TP gives on the same model, plan and batches (Adam-style
    normalisers turn 1e-7 gradient rounding on near-zero gradients into steps of a good part of ``lr``)."""
    mesh = _tp_mesh()
    batches = _batches(5, hf_models.VOCAB)
    for name, make_opt in OPTIMIZERS.items():
        base = hf_models.build("llama")
        ref, ours, theirs = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        expected = _train(ref, make_opt, batches)
        parallelize_module(ours, mesh, auto_tp_plan(ours, mesh, sequence_parallel=False, loss_parallel=False))
        _torch_tp(theirs, mesh)
        ours_off = _worst(_train(ours, make_opt, batches), expected)
        torch_off = _worst(_train(theirs, make_opt, batches), expected)
        assert ours_off <= max(2 * torch_off, 1e-6), (name, ours_off, torch_off)


# ------------------------------------------------------------------------------- 2. half-complete TP plans
def _plan_error(model, plan, *args) -> str:
    """The error (message and notes) a forward under ``plan`` raises on this rank."""
    from lightning_shard.tp import parallelize_module as ours

    ours(model, _tp_mesh(), plan)
    with pytest.raises(RuntimeError) as info:
        model(*args)
    return "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])


@distributed(world_size=2)
def test_half_complete_plan_error_names_the_modules_and_the_fix():
    from lightning_shard.tp import ColwiseParallel, RowwiseParallel

    idx = torch.randint(0, VOCAB, (2, 8))
    qkv = {f"layers.*.attention.{n}_proj": ColwiseParallel() for n in "qkv"}  # o_proj left out
    text = _plan_error(tp_models.Llama(), qkv, idx)
    assert "ColwiseParallel on 'layers.0.attention.q_proj'" in text and "RowwiseParallel" in text, text
    assert "o_proj" in text, text
    text = _plan_error(tp_models.Llama(), {"layers.*.feed_forward.down_proj": RowwiseParallel()}, idx)
    assert "RowwiseParallel on 'layers.0.feed_forward.down_proj'" in text and "input_layouts=Replicate()" in text


@pytest.mark.slow
@distributed(world_size=2)
def test_half_complete_plans_through_the_trainer_and_on_hugging_face():
    import strategies
    from lightning_shard.tp import ColwiseParallel, RowwiseParallel
    from tests.lightning_models import LitGPT
    from tests.test_strategy import _trainer

    up_gate = {f"model.layers.*.mlp.{n}": ColwiseParallel() for n in ("up_proj", "gate_proj")}  # no down_proj
    text = _plan_error(hf_models.build("llama"), up_gate, torch.randint(0, hf_models.VOCAB, (2, 8)))
    assert "'model.layers.0.mlp.gate_proj', 'model.layers.0.mlp.up_proj'" in text, text
    wrong = {f"layers.*.feed_forward.{n}": ColwiseParallel() for n in ("up_proj", "gate_proj", "down_proj")}
    text = _plan_error(tp_models.Llama(), wrong, torch.randint(0, VOCAB, (2, 8)))
    assert "'layers.0.feed_forward.down_proj' consumes a column shard, so it is RowwiseParallel" in text, text
    plan = {"model.layers.*.attention.q_proj": ColwiseParallel(), "model.layers.*.attention.o_proj": RowwiseParallel()}
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2, tp_plan=plan), max_steps=1)
    with pytest.raises(RuntimeError) as info:
        trainer.fit(LitGPT(arch="llama"))
    assert any("'model.layers.0.attention.q_proj'" in n for n in getattr(info.value, "__notes__", [])), info.value


# ------------------------------------------------------ 3, 4. prune and nn.init.sparse_/dirac_ after sharding
@distributed(world_size=2)
def test_prune_and_indexing_inits_after_sharding_name_the_function_and_the_fix():
    from torch import nn
    from torch.nn.utils import prune

    from lightning_shard.tensor import Replicate, distribute_tensor
    from tests.test_user_param_ops import _net

    net = _net("fsdp")
    with pytest.raises(RuntimeError, match=r"prune\.l1_unstructured on a sharded .* Prune before sharding"):
        prune.l1_unstructured(net.a, "weight", amount=0.5)
    sparse_error = pytest.raises(RuntimeError, match=r"init\.sparse_ on a sharded .* Initialise before sharding")
    with sparse_error, torch.no_grad():
        nn.init.sparse_(net.b.weight, 0.5)
    # The error's recipe (initialise the full value, copy it back) gives one process's values.
    ref = _net(None)
    for model in (ref, net):
        torch.manual_seed(5)
        p = model.b.weight
        with torch.no_grad():
            if isinstance(p, DTensor):
                full = p.full_tensor()
                nn.init.sparse_(full, 0.5)
                p.copy_(distribute_tensor(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim))
            else:
                nn.init.sparse_(p, 0.5)
    assert torch.equal(net.b.weight.full_tensor(), ref.b.weight)
    rows, cols = ref.b.weight.shape
    assert (ref.b.weight == 0).sum() == math.ceil(0.5 * rows) * cols  # the recipe did initialise sparsely


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@distributed(world_size=2)
def test_every_prune_method_and_dirac_after_sharding_raise_clearly(kind):
    from torch import nn
    from torch.nn.utils import prune

    from tests.test_user_param_ops import _net

    calls = {
        "l1_unstructured": lambda net: prune.l1_unstructured(net.a, "weight", amount=0.5),
        "random_unstructured": lambda net: prune.random_unstructured(net.a, "weight", amount=0.5),
        "ln_structured": lambda net: prune.ln_structured(net.a, "weight", amount=0.5, n=2, dim=0),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"prune\.{name} on a sharded"):
            call(_net(kind))
    with pytest.raises(RuntimeError, match=r"init\.dirac_ on a sharded"), torch.no_grad():
        nn.init.dirac_(_net(kind).conv.weight)


# ------------------------------------------------------------------- 5. the TP same-batch check, every batch
class _SameFirstBatch(LitPerRankData):
    """Rows 0-3 on every rank (batch 0), then rows split by global rank: the first-batch check passes."""

    def __init__(self) -> None:
        super().__init__(split_by_rank=False)

    def train_dataloader(self):
        rows = [*range(4), *range(4 + dist.get_rank(), 20, dist.get_world_size())]
        return torch.utils.data.DataLoader(torch.utils.data.Subset(dataset(), rows), batch_size=4)


@distributed(world_size=2)
def test_tp_batches_differing_after_the_first_raise_at_that_batch():
    with pytest.raises(TPInputMismatchError, match=r"batch_idx 1, the per-batch check.*batch\[0\]"):
        tp_trainer(max_steps=3).fit(_SameFirstBatch())


def test_sampled_checksum_tells_values_shapes_and_dtypes_apart():
    from lightning_shard.tp.input_check import sampled_checksum

    cpu = torch.device("cpu")
    ids = torch.randint(0, 1000, (8, 2048), generator=torch.Generator().manual_seed(0))
    base = sampled_checksum({"ids": ids, "name": "x"}, cpu)
    assert base.dtype == torch.int64 and base.ndim == 0
    assert torch.equal(base, sampled_checksum({"ids": ids.clone(), "name": "y"}, cpu))  # non-tensors ignored
    other = ids.clone()
    other[0, 0] += 1  # a sampled element (the first)
    changed = [other, ids.float(), ids.reshape(16, 1024), ids.flip(0), ids.t()]
    assert all(not torch.equal(base, sampled_checksum({"ids": t}, cpu)) for t in changed)
    assert not torch.equal(sampled_checksum([ids, ids], cpu), sampled_checksum([ids, ids + 1], cpu))


@pytest.mark.slow
@distributed(world_size=4)
def test_optimizers_under_fsdp2_x_tp2_match_one_process():
    from lightning_shard.fsdp import fully_shard

    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tp, dp = root["tensor_parallel"], root["data_parallel"]
    for make_opt in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.NAdam(ps, lr=1e-2),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    ):
        torch.manual_seed(0)
        model = tp_models.Llama()
        ref = copy.deepcopy(model)
        batches = _batches(5)  # the same on every data-parallel rank: averaged gradients equal one process's
        expected = _train(ref, make_opt, batches)
        parallelize_module(model, tp, auto_tp_plan(model, tp, sequence_parallel=False, loss_parallel=False))
        for layer in model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        assert _worst(_train(model, make_opt, batches), expected) < 5e-5
