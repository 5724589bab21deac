"""Higher-order autograd and several backward passes per step through the sharded engine, each compared with one
process on the same data (FSDP 2 and TP 2 on 2 gloo ranks, FSDP 2 x TP 2 on 4; directly on the engine and
through ``Trainer(strategy="shard_fsdp_tp")``):

* a gradient penalty (WGAN-GP / R1: ``torch.autograd.grad(d_out.sum(), x, create_graph=True)``, then
  ``(grad.norm() - 1) ** 2`` in the loss): under FSDP its backward failed on a freed unsharded parameter ("storage
  of size 0", as torch's FSDP2 fails), and under TP the second derivative silently missed every term that crosses
  a collective (gradients off by up to 1.9); ``backward(create_graph=True)`` at every step;
* Hessian-vector products w.r.t. the parameters under TP, ``torch.autograd.functional.hvp``/``vhp``/``jvp`` w.r.t.
  the inputs under FSDP and TP;
* two backwards before one step, ``retain_graph=True`` then a second backward of the same graph, two forwards
  of the same model (siamese) and a forward whose output is unused, a ``no_grad`` / ``inference_mode`` forward of
  the same model (a teacher or targets) inside the step; two ``manual_backward`` calls in one manual step and the
  siamese step under activation checkpointing through the Trainer.

docs/fsdp.md "Higher-order autograd and several backwards per step" describes what works and what does not
(``torch.autograd.grad`` / ``backward(inputs=...)`` w.r.t. FSDP-sharded parameters).
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import strategies
from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from lightning_shard.tensor import DTensor, distribute_tensor
from lightning_shard.tp import ColwiseParallel, RowwiseParallel, parallelize_module
from tests.harness import distributed
from tests.lightning_models import sampler_batches
from tests.test_strategy import _trainer
from tests.test_trainer_features import _single_trainer

PLAN = {
    "inp": ColwiseParallel(),
    "blocks.0.0": RowwiseParallel(),
    "blocks.1.0": ColwiseParallel(),
    "out": RowwiseParallel(),
}
TOL = {"fsdp": 1e-5, "tp": 5e-5, "fsdp_tp": 5e-5}


class Critic(nn.Module):
    """A small discriminator: an input layer, two blocks (FSDP units) and a scalar head. A smooth activation (tanh)
    makes a penalty's gradient pass through the forward's graph as well as the graph of the input gradient;
    LeakyReLU (piecewise linear) only through the latter."""

    def __init__(self, act: type[nn.Module] = nn.Tanh) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), act()) for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _shard(model: Critic, kind: str) -> Critic:
    """``kind``: "fsdp" (FSDP over all ranks), "tp" (TP over all ranks) or "fsdp_tp" (2 x 2)."""
    world = dist.get_world_size()
    if kind == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        parallelize_module(model, mesh["tensor_parallel"], PLAN)
        dp_mesh = mesh["data_parallel"]
    elif kind == "tp":
        return parallelize_module(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tensor_parallel",)), PLAN)
    else:
        dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def _both(kind: str, act: type[nn.Module] = nn.Tanh) -> tuple[Critic, Critic]:
    ref = Critic(act)
    return ref, _shard(copy.deepcopy(ref), kind)


def _data(n: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(seed))


def _local(x: torch.Tensor, kind: str) -> torch.Tensor:
    """This rank's part of the global batch ``x`` (every TP rank of a data-parallel rank gets the same)."""
    dp = {"fsdp": dist.get_world_size(), "tp": 1, "fsdp_tp": dist.get_world_size() // 2}[kind]
    dp_rank = dist.get_rank() // (dist.get_world_size() // dp)
    return x.chunk(dp)[dp_rank]


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_close(ours: dict, ref: dict, tol: float) -> None:
    assert ours.keys() == ref.keys()
    for name in ref:
        assert (ours[name] is None) == (ref[name] is None), (name, ours[name], ref[name])
        if ref[name] is not None:
            assert (_full(ours[name]) - ref[name]).abs().max() < tol, (name, _full(ours[name]), ref[name])


def _grads(model: nn.Module) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def _params(model: nn.Module) -> dict:
    return {n: p.detach() for n, p in model.named_parameters()}


def _penalty(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """WGAN-GP's penalty: the critic's input gradient, per sample, pushed towards norm 1."""
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    return 10 * ((grad.norm(dim=1) - 1) ** 2).mean()


def _gp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).mean() + _penalty(model, x)


def _gradient_penalty_grads(kind: str, with_critic_loss: bool = True, act: type[nn.Module] = nn.Tanh) -> None:
    ref, model = _both(kind, act)
    x = _data()
    loss = _gp_loss if with_critic_loss else _penalty
    loss(ref, x).backward()
    loss(model, _local(x, kind)).backward()
    _assert_close(_grads(model), _grads(ref), TOL[kind])


def _gradient_penalty_steps(kind: str) -> None:
    """Three WGAN-GP critic steps, the penalty's graph built before two more forwards of the same critic."""
    ref, model = _both(kind)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(3):
        real, fake = _data(seed=step), _data(seed=10 + step)
        for m, opt, r, f in ((ref, opts[0], real, fake), (model, opts[1], _local(real, kind), _local(fake, kind))):
            opt.zero_grad()
            penalty = _penalty(m, r)
            (m(f).mean() - m(r).mean() + penalty).backward()
            opt.step()
    _assert_close(_params(model), _params(ref), TOL[kind])


@distributed(world_size=2)
def test_gradient_penalty_fsdp_trains_like_one_process():
    _gradient_penalty_steps("fsdp")


@distributed(world_size=2)
def test_gradient_penalty_tp_gives_one_process_gradients():
    _gradient_penalty_grads("tp")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@pytest.mark.parametrize(("with_critic_loss", "act"), [(False, nn.Tanh), (True, nn.LeakyReLU)])
@distributed(world_size=2)
def test_gradient_penalty_variants(kind, with_critic_loss, act):
    # the penalty alone reaches the parameters only through the graph of the gradient (no output hook fires)
    _gradient_penalty_grads(kind, with_critic_loss, act)


@pytest.mark.slow
@distributed(world_size=2)
def test_gradient_penalty_steps_tp():
    _gradient_penalty_steps("tp")


@pytest.mark.slow
@distributed(world_size=4)
def test_gradient_penalty_fsdp2_x_tp2():
    _gradient_penalty_steps("fsdp_tp")
    _gradient_penalty_grads("fsdp_tp", with_critic_loss=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@distributed(world_size=2)
def test_create_graph_backward_at_every_step(kind):
    """``loss.backward(create_graph=True)`` then ``step()``: the unsharded parameters kept for the recorded graph
    are released at the step, so the next forward gathers the updated ones."""
    ref, model = _both(kind)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(3):
        x = _data(seed=step)
        for m, opt, xs in ((ref, opts[0], x), (model, opts[1], _local(x, kind))):
            m(xs).pow(2).mean().backward(create_graph=True)
            opt.step()
            for p in m.parameters():
                p.grad = None  # torch's advice after backward(create_graph=True): breaks the grad <-> graph cycle
    _assert_close(_params(model), _params(ref), TOL[kind])


def _hvp_wrt_params(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    params = list(model.parameters())
    grads = torch.autograd.grad(model(x).pow(2).mean(), params, create_graph=True)
    torch.manual_seed(5)
    vs = [torch.randn(p.shape) for p in params]
    vs = [distribute_tensor(v, g.device_mesh, g.placements) if isinstance(g, DTensor) else v for g, v in zip(grads, vs)]
    return torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vs)), params)


@pytest.mark.slow
@distributed(world_size=2)
def test_hessian_vector_products():
    # w.r.t. the parameters under TP (DTensor parameters are the graph's leaves)
    ref, model = _both("tp")
    x = _data()
    for got, want in zip(_hvp_wrt_params(model, x), _hvp_wrt_params(ref, x)):
        assert isinstance(got, DTensor) and (got.full_tensor() - want).abs().max() < TOL["tp"]
    # torch.autograd.functional w.r.t. the inputs, FSDP and TP
    for kind in ("fsdp", "tp"):
        ref, model = _both(kind)
        x = _local(_data(), kind)
        v = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
        for fn in (torch.autograd.functional.hvp, torch.autograd.functional.vhp):
            _, want = fn(lambda inp, m=ref: m(inp).pow(2).sum(), x, v)
            _, got = fn(lambda inp, m=model: m(inp).pow(2).sum(), x, v)
            assert (got - want).abs().max() < TOL[kind], (kind, fn.__name__)
        _, want = torch.autograd.functional.jvp(ref, x, v)
        _, got = torch.autograd.functional.jvp(model, x, v)
        assert (got - want).abs().max() < TOL[kind], (kind, "jvp")


def _several_backwards(m: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> None:
    if mode == "two backwards":  # e.g. an auxiliary loss: gradients accumulate before one step
        m(x).pow(2).mean().backward()
        m(y).abs().mean().backward()
    elif mode == "retain_graph":
        out = m(x)
        out.pow(2).mean().backward(retain_graph=True)
        out.abs().mean().backward()
    elif mode == "siamese":
        (m(x) - m(y)).pow(2).mean().backward()
    elif mode == "unused output":
        out, _ = m(x), m(y)
        out.pow(2).mean().backward()
    elif mode == "no_grad teacher":
        with torch.no_grad():
            target = m(y)
        (m(x) - target).pow(2).mean().backward()
    elif mode == "inference_mode teacher":
        with torch.inference_mode():
            target = m(y)
        (m(x) - target.clone()).pow(2).mean().backward()


MODES = ["two backwards", "retain_graph", "siamese", "unused output", "no_grad teacher", "inference_mode teacher"]


def _several_backwards_match(kind: str) -> None:
    for mode in MODES:
        ref, model = _both(kind)
        x, y = _data(), _data(seed=2)
        _several_backwards(ref, x, y, mode)
        _several_backwards(model, _local(x, kind), _local(y, kind), mode)
        _assert_close(_grads(model), _grads(ref), TOL[kind])


@distributed(world_size=2)
def test_several_backwards_and_forwards_per_step_fsdp():
    _several_backwards_match("fsdp")


@pytest.mark.slow
@distributed(world_size=2)
def test_several_backwards_and_forwards_per_step_tp():
    _several_backwards_match("tp")


class LitCritic(L.LightningModule):
    """The critic trained through the Trainer: "gp" (the WGAN-GP loss in ``training_step``), "two manual
    backwards" (manual optimization, two ``manual_backward`` before one step) or "siamese" (two forwards)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.model = Critic()
        self.mode = mode
        self.automatic_optimization = mode != "two manual backwards"

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if self.mode == "gp":
            return _gp_loss(self.model, x)
        if self.mode == "siamese":
            return (self.model(x) - self.model(x * 0.5 + 0.1)).pow(2).mean()
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.model(x).pow(2).mean())
        self.manual_backward(self.model(x * 0.5).abs().mean())
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


def _fit_like_one_process(mode: str, tp: int = 1, **strategy_kwargs) -> None:
    data = TensorDataset(_data(32, seed=3))
    ours = LitCritic(mode)
    plan = {f"model.{k}": v for k, v in PLAN.items()} if tp > 1 else "auto"
    strategy = strategies.ShardFSDPTPStrategy(
        tensor_parallel_size=tp, tp_plan=plan, fsdp_unit={nn.Sequential}, **strategy_kwargs
    )
    _trainer(strategy=strategy, max_steps=3).fit(ours, DataLoader(data, batch_size=4))
    ref = LitCritic(mode)
    batches = [b.tolist() for b in sampler_batches(dist.get_world_size() // tp, 4, n=32)][:3]
    _single_trainer(max_steps=3, limit_val_batches=0, num_sanity_val_steps=0).fit(
        ref, DataLoader(data, batch_sampler=batches)
    )
    _assert_close(_params(ours.model), _params(ref.model), 5e-5)


@distributed(world_size=2)
def test_gradient_penalty_through_the_trainer_fsdp():
    _fit_like_one_process("gp")


@pytest.mark.slow
@distributed(world_size=2)
def test_gradient_penalty_through_the_trainer_tp():
    _fit_like_one_process("gp", tp=2)


@pytest.mark.slow
@distributed(world_size=2)
def test_two_manual_backwards_and_checkpointed_siamese_through_the_trainer():
    _fit_like_one_process("two manual backwards")
    _fit_like_one_process("siamese", activation_checkpointing_policy={nn.Sequential})


@distributed(world_size=2)
def test_unsharded_after_backward_then_optimizer_steps_train_like_one_process():
    # set_reshard_after_backward(False) keeps the gathered parameters for the next forward; an optimizer step in
    # between updates the shards, so that forward must gather again, not reuse the values from before the step
    ref, model = _both("fsdp")
    model.set_reshard_after_backward(False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for step in range(3):
        x = _data(seed=step)
        for m, opt, batch in ((ref, opts[0], x), (model, opts[1], _local(x, "fsdp"))):
            opt.zero_grad()
            (m(batch) ** 2).mean().backward()
            opt.step()
    _assert_close(_params(model), _params(ref), TOL["fsdp"])
