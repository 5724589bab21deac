"""Tensor parallelism on 2 gloo ranks (and DP x TP on 4): reference models trained with auto plans and
hand-written plans, compared with a single-process run of the same model; bad input errors."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_shard import init_device_mesh
from lightning_shard.tensor import DTensor, Replicate, Shard, fallback_counts, reset_fallback_counts
from lightning_shard.tp import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    auto_tp_plan,
    loss_parallel,
    parallelize_module,
)
from tests import tp_models
from tests.harness import distributed

VOCAB, B, T = 101, 2, 8


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _lm_loss(model, idx, tgt):
    logits = model(idx)
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(0, 1))


def _demo_loss(model, idx, tgt):
    return F.nll_loss(model(idx, tgt), tgt.reshape(-1))


def _cls_loss(model, idx, tgt):
    return F.cross_entropy(model(idx), tgt[:, 0] % 3)


MODELS = {
    "llama": (tp_models.Llama, _lm_loss),
    "gpt2": (tp_models.GPT2, _lm_loss),
    "demo": (tp_models.demo_transformer, _demo_loss),
    "bert": (tp_models.Bert, _cls_loss),
    "compact": (tp_models.compact_gpt, _lm_loss),
}


def _batches(steps=3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (B, T), generator=g)
        tgt = torch.randint(0, VOCAB, (B, T), generator=g)
        tgt[0, :2] = -100  # ignored targets (cross_entropy's default ignore_index)
        out.append((idx, tgt))
    return out


def _train(model, loss_fn, batches, lp=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for idx, tgt in batches:
        if loss_fn is _demo_loss or loss_fn is _cls_loss:
            tgt = tgt.clamp(min=0)
        with loss_parallel() if lp else contextlib.nullcontext():
            loss = loss_fn(model, idx, tgt)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_full(loss).detach())
    return torch.stack(losses)


def _assert_same(model, ref, losses, ref_losses, what):
    assert (losses - ref_losses).abs().max() < 1e-5, (what, losses, ref_losses)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        diff = (_full(p.detach()) - ref_params[name].detach()).abs().max().item()
        assert diff < 1e-5, (what, name, diff)


def _check_model(name, sp, lp, tp_mesh):
    build, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    batches = _batches()
    ref_losses = _train(ref, loss_fn, batches)
    plan = auto_tp_plan(model, tp_mesh, sequence_parallel=sp, loss_parallel=lp)
    parallelize_module(model, tp_mesh, plan)
    reset_fallback_counts()
    losses = _train(model, loss_fn, batches, lp=lp)
    _assert_same(model, ref, losses, ref_losses, (name, sp, lp))
    return fallback_counts()


@distributed(world_size=2)
def test_auto_plan_llama_gpt2_match_single_process():
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    for name in ("llama", "gpt2"):
        for sp, lp in ((False, False), (True, True), (False, True), (True, False)):
            counts = _check_model(name, sp, lp, tp_mesh)
            assert counts == {}, (name, sp, lp, counts)


@distributed(world_size=2)
def test_auto_plan_compact_block_matches_single_process():
    """A block written as one module: its input cannot be prepared once (the norms and residuals take it
    plainly), so each column-parallel Linear converts its own input, and the MLP beside the attention is
    still sharded; sequence parallel stays off (it needs the attention's input prepared)."""
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    plan, summary = auto_tp_plan(tp_models.compact_gpt(), tp_mesh, sequence_parallel="auto", return_summary=True)
    assert "blocks.0.up" in plan and "blocks.0.down" in plan and "blocks.0" not in plan, sorted(plan)
    assert summary[0].startswith("sequence_parallel: off (attention blocks.0 shares its module"), summary[0]
    for sp in (False, "auto"):
        assert _check_model("compact", sp, False, tp_mesh) == {}


@distributed(world_size=2)
def test_auto_plan_demo_transformer_and_bert_match_single_process():
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    for sp, lp in ((False, False), (True, True)):
        counts = _check_model("demo", sp, lp, tp_mesh)
        assert counts == {}, ("demo", sp, lp, counts)
    for sp in (False, True):  # a classifier: no LM head, so no loss_parallel
        counts = _check_model("bert", sp, False, tp_mesh)
        assert counts == {}, ("bert", sp, counts)


class _Toy(nn.Module):
    """Embedding -> norm -> SwiGLU MLP (residual) -> head: one module for each style."""

    def __init__(self, vocab=VOCAB, dim=16, hidden=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = tp_models.SwiGLU(dim, hidden)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.mlp(self.norm(x))
        return self.head(x)


def _toy_plan(ours: bool):
    if ours:
        from lightning_shard.tensor import Replicate as R
        from lightning_shard.tensor import Shard as S
        from lightning_shard.tp import style as st
    else:
        from torch.distributed.tensor import Replicate as R
        from torch.distributed.tensor import Shard as S
        from torch.distributed.tensor.parallel import style as st
    return {
        "emb": st.RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
        "norm": st.SequenceParallel(),
        "mlp": st.PrepareModuleInput(input_layouts=(S(1),), desired_input_layouts=(R(),)),
        "mlp.[gu]*_proj": st.ColwiseParallel(),  # wildcard: gate_proj and up_proj
        "m*.down_proj": st.RowwiseParallel(),
        "head": st.ColwiseParallel(input_layouts=S(1), output_layouts=S(-1), use_local_output=False),
    }


@distributed(world_size=2)
def test_hand_written_plan_matches_torch_parallelize_module():
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    torch.manual_seed(0)
    model = _Toy()
    ref, theirs = copy.deepcopy(model), copy.deepcopy(model)
    idx = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    ref_out = ref(idx)
    ref_out.square().mean().backward()

    ours_plan = {k: v for k, v in _toy_plan(True).items() if v is not None}
    # The MLP's output goes back to the sequence shard through PrepareModuleOutput (Replicate -> Shard(1)).
    to_seq = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    ours_plan["mlp"] = (ours_plan["mlp"], to_seq)
    parallelize_module(model, tp_mesh, ours_plan)
    torch_plan = {k: v for k, v in _toy_plan(False).items() if v is not None}
    torch_parallelize(theirs, tp_mesh.to_torch(), torch_plan)
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor.parallel import PrepareModuleOutput as TorchPMO

    torch_parallelize(theirs, tp_mesh.to_torch(), {"mlp": TorchPMO(output_layouts=TR(), desired_output_layouts=TS(1))})

    reset_fallback_counts()
    out = model(idx)
    out.square().mean().backward()
    assert fallback_counts() == {}
    t_out = theirs(idx)
    t_out.square().mean().backward()
    # Output placements: ours vs torch's (kind and dim).
    assert isinstance(out, DTensor) and out.placements == (Shard(2),)
    assert [(type(p).__name__, p.dim) for p in t_out.placements] == [("Shard", 2)]
    assert (out.full_tensor() - ref_out).abs().max() < 1e-5
    assert (out.full_tensor() - t_out.full_tensor()).abs().max() < 1e-5
    # Parameter placements and gradients equal torch's and the single process's.
    t_params = dict(theirs.named_parameters())
    for name, p in model.named_parameters():
        tp_ = t_params[name]
        assert [(type(q).__name__, getattr(q, "dim", None)) for q in p.placements] == [
            (type(q).__name__, getattr(q, "dim", None)) for q in tp_.placements
        ], name
        ref_grad = dict(ref.named_parameters())[name].grad
        assert (p.grad.full_tensor() - ref_grad).abs().max() < 1e-5, name
        assert (p.grad.full_tensor() - tp_.grad.full_tensor()).abs().max() < 1e-5, name


@distributed(world_size=2)
def test_loss_parallel_matches_torch_uneven_vocab_ignore_index():
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor as torch_distribute
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    from lightning_shard import comm
    from lightning_shard.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    g = torch.Generator().manual_seed(5)
    cases = [((7, VOCAB), (7,)), ((3, VOCAB, 4), (3, 4))]  # nll_loss and nll_loss2d
    for shape, tshape in cases:
        logits = torch.randn(shape, generator=g)
        target = torch.randint(0, VOCAB, tshape, generator=g)
        target.view(-1)[1] = -100
        target.view(-1)[2] = VOCAB - 1  # the last class, on the second (shorter) shard
        weight = torch.rand(VOCAB, generator=g)
        for reduction in ("mean", "sum", "none"):
            for w in (None, weight):
                ref_x = logits.clone().requires_grad_()
                ref = F.cross_entropy(ref_x, target, weight=w, reduction=reduction)
                ref.sum().backward()
                x = distribute_tensor(logits.clone().requires_grad_(), mesh, [Shard(1)])
                reset_fallback_counts()
                with loss_parallel(), comm.count_collectives() as counts:
                    loss = F.cross_entropy(x, target, weight=w, reduction=reduction)
                    loss.sum().backward()
                assert fallback_counts() == {}
                # No all-gather of the logits: only all-reduces of per-row values.
                assert counts.calls.get("all_gather_into", 0) == 0, dict(counts.calls)
                what = (shape, reduction, w is not None)
                assert (loss.full_tensor() - ref).abs().max() < 1e-5, what
                assert (x.grad.full_tensor() - ref_x.grad).abs().max() < 1e-5, what
                assert x.grad.placements == (Shard(1),)
                if w is not None:
                    continue  # torch's loss_parallel backward gathers class weights at ignore_index: IndexError
                # torch's loss_parallel: same value and gradient.
                tx = torch_distribute(logits.clone().requires_grad_(), mesh.to_torch(), [TS(1)])
                with torch_loss_parallel():
                    tl = F.cross_entropy(tx, target, weight=w, reduction=reduction)
                    tl.sum().backward()
                assert (loss.full_tensor() - tl.full_tensor()).abs().max() < 1e-6, what
                assert (x.grad.full_tensor() - tx.grad.full_tensor()).abs().max() < 1e-6, what
    # log_softmax + nll_loss (what the demo Transformer does), and a class dim that is not sharded.
    logits = torch.randn(5, VOCAB, generator=g)
    target = torch.randint(0, VOCAB, (5,), generator=g)
    ref_x = logits.clone().requires_grad_()
    F.nll_loss(F.log_softmax(ref_x, -1), target).backward()
    x = distribute_tensor(logits.clone().requires_grad_(), mesh, [Shard(1)])
    with loss_parallel():
        loss = F.nll_loss(F.log_softmax(x, -1), target)
        loss.backward()
    assert (x.grad.full_tensor() - ref_x.grad).abs().max() < 1e-6
    x = distribute_tensor(logits.clone().requires_grad_(), mesh, [Shard(0)])
    with loss_parallel():
        loss = F.cross_entropy(x, distribute_tensor(target, mesh, [Shard(0)]))
        loss.backward()
    assert (x.grad.full_tensor() - ref_x.grad).abs().max() < 1e-6


@distributed(world_size=2)
def test_loss_parallel_label_smoothing_with_ignored_targets():
    # The smoothing term's ignored rows are zeroed with a plain mask (target == ignore_index): it raised on mixing
    # a plain tensor with DTensors. The smoothing term is a partial sum over the vocabulary shards; the loss is
    # replicated, as without smoothing.
    from lightning_shard.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(6, VOCAB, generator=g)
    target = torch.randint(0, VOCAB, (6,), generator=g)
    target[[1, 4]] = -100
    for reduction in ("mean", "sum", "none"):
        ref_x = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_x, target, label_smoothing=0.1, reduction=reduction)
        ref.sum().backward()
        x = distribute_tensor(logits.clone().requires_grad_(), mesh, [Shard(1)])
        with loss_parallel():
            loss = F.cross_entropy(x, target, label_smoothing=0.1, reduction=reduction)
            loss.sum().backward()
        assert loss.placements == (Replicate(),), reduction  # a partial loss escaped into logging: a hang
        assert (loss.full_tensor() - ref).abs().max() < 1e-5, reduction
        assert (x.grad.full_tensor() - ref_x.grad).abs().max() < 1e-6, reduction


@distributed(world_size=2)
def test_loss_parallel_applies_inside_its_block_only_whatever_ran_before():
    # Dispatch caches each op's handler: entering and leaving loss_parallel must reach ops dispatched before.
    from lightning_shard import comm
    from lightning_shard.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    g = torch.Generator().manual_seed(11)
    logits, target = torch.randn(6, VOCAB, generator=g), torch.randint(0, VOCAB, (6,), generator=g)
    ref = F.cross_entropy(logits, target)
    x = distribute_tensor(logits, mesh, [Shard(1)])
    outside = F.cross_entropy(x, distribute_tensor(target, mesh, [Replicate()]))  # the ordinary path
    assert (outside.full_tensor() - ref).abs() < 1e-6
    with loss_parallel(), comm.count_collectives() as counts:
        inside = F.cross_entropy(x, target)  # a plain target: loss parallel's handler, no logits gathered
    assert (inside.full_tensor() - ref).abs() < 1e-6
    assert counts.calls.get("all_gather_into", 0) == 0, dict(counts.calls)
    with pytest.raises(RuntimeError, match="plain torch.Tensor"):  # the ordinary path again after the block
        F.cross_entropy(x, target)


@distributed(world_size=2)
def test_bad_input_raises_before_any_collective():
    from lightning_shard import comm
    from lightning_shard.tp import DivideAttributes

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    mesh_2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))

    def raises(model, plan, *needles, mesh=tp_mesh):
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        with comm.count_collectives() as counts, pytest.raises(ValueError) as info:
            parallelize_module(model, mesh, plan)
        assert sum(counts.calls.values()) == 0, dict(counts.calls)
        for needle in needles:
            assert needle in str(info.value), (needle, str(info.value))
        for k, p in model.named_parameters():  # nothing was changed
            assert not isinstance(p, DTensor) and torch.equal(p, before[k])

    llama = tp_models.Llama()
    key = "layers.*.attention.q_prj"
    raises(llama, {key: ColwiseParallel()}, f"'{key}'", "layers.0.attention.q_proj")
    raises(llama, {"layers.0.attention_norm": ColwiseParallel()}, "'layers.0.attention_norm'", "RMSNorm")
    raises(llama, {"layers.0.feed_forward": RowwiseParallel()}, "'layers.0.feed_forward'", "SwiGLU")
    raises(llama, {"layers.0.attention": SequenceParallel()}, "'layers.0.attention'", "LlamaAttention")
    odd = nn.Sequential(nn.Linear(8, 7), nn.Linear(7, 8))
    raises(odd, {"0": ColwiseParallel()}, "'0'", "out_features 7", "size 2")
    raises(odd, {"1": RowwiseParallel()}, "'1'", "in_features 7", "size 2")
    raises(tp_models.Llama(n_heads=3, n_kv_heads=1, dim=24), {"layers.0.attention": DivideAttributes(["n_heads"])},
           "n_heads 3", "size 2")  # fmt: skip
    raises(llama, {"layers.0.feed_forward.up_proj": ColwiseParallel()}, "1-D", "(1, 2)", mesh=mesh_2d)
    gpt = tp_models.GPT2()  # tied: a column-split embedding conflicts with the column-parallel head
    head = ColwiseParallel(use_local_output=False)  # (101 classes: uneven, fine for a DTensor output)
    raises(gpt, {"transformer.wte": ColwiseParallel(), "lm_head": head}, "tied", "lm_head.weight")
    with pytest.raises(ValueError, match="1-D"):
        auto_tp_plan(llama, mesh_2d)


@distributed(world_size=4)
def test_fsdp_over_tp_llama_2x2_matches_single_process():
    from lightning_shard.fsdp import fully_shard

    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tp_mesh, dp_mesh = root["tensor_parallel"], root["data_parallel"]
    for sp, lp in ((False, False), (True, True)):
        torch.manual_seed(0)
        model = tp_models.Llama()
        ref = copy.deepcopy(model)
        batches = _batches()  # every data-parallel rank sees the same batch: averaged gradients equal ref's
        ref_losses = _train(ref, _lm_loss, batches)
        parallelize_module(model, tp_mesh, auto_tp_plan(model, tp_mesh, sequence_parallel=sp, loss_parallel=lp))
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        reset_fallback_counts()
        losses = _train(model, _lm_loss, batches, lp=lp)
        _assert_same(model, ref, losses, ref_losses, ("fsdp x tp", sp, lp))
        assert fallback_counts() == {}, (sp, lp, fallback_counts())
