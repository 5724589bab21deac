"""Optimizers whose update is not element-wise, through ``Trainer(strategy="shard_fsdp_tp")`` on 2 gloo ranks
(FSDP 2 on TinyGPT, TP 2 on a Llama), each compared with one process on the same global batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import strategies
from tests.fsdp_models import loss_fn
from tests.harness import distributed
from tests.test_strategy import _trainer
from tests.test_trainer_features import _full, _single_trainer, _worst
from tests.test_trainer_flows import ONE_PROCESS, Flow

CASES = [("gpt", 1), ("llama", 2)]  # FSDP 2; TP 2 (one data-parallel rank)
TOL = {1: 1e-5, 2: 5e-5}


def _matrices(model) -> tuple[list, list]:
    """Muon's usual split: hidden 2-D weights, and everything else (embeddings, head, norms, biases)."""
    hidden, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        embedding = "embed" in name or name.startswith(("head", "output"))
        (hidden if p.ndim == 2 and not embedding else rest).append(p)
    return hidden, rest


def make_optimizers(recipe: str, model):
    """The optimizers ``recipe`` names over ``model``'s trainable parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if recipe == "muon":
        hidden, rest = _matrices(model)
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]
    if recipe == "muon_groups_sgd":
        hidden, rest = _matrices(model)
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.SGD(rest, lr=0.1)]
    if recipe == "adafactor":
        return [torch.optim.Adafactor(trainable, lr=1e-2)]
    if recipe == "hf_adafactor":
        from transformers.optimization import Adafactor

        return [Adafactor(trainable, lr=None, scale_parameter=True, relative_step=True, warmup_init=False)]
    if recipe == "hf_adafactor_lr":
        from transformers.optimization import Adafactor

        return [Adafactor(trainable, lr=1e-2, scale_parameter=False, relative_step=False)]
    if recipe == "lbfgs":
        return [torch.optim.LBFGS(trainable, lr=0.5, max_iter=3, history_size=4)]
    if recipe == "lamb":
        return [Lamb(trainable, lr=1e-2)]
    raise ValueError(recipe)


class Lamb(torch.optim.Optimizer):
    """A user's LAMB: Adam's direction scaled per parameter by ``||p|| / ||update||`` (the norms of whole
    parameters: on a shard, a local norm would give each rank its own trust ratio)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["m"], state["v"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])
        return loss


class Recipe(Flow):
    """``Flow`` (tests/test_trainer_flows.py) with the optimizers of ``recipe``; with several optimizers,
    automatic optimization steps each in turn (Lightning's loop runs ``training_step`` once per optimizer only
    in manual mode, so the module steps them all from one backward by hand)."""

    def __init__(self, arch: str = "gpt", mirrors: int | None = None, recipe: str = "muon") -> None:
        super().__init__(arch, mirrors)
        self.recipe = recipe
        self.automatic_optimization = recipe not in ("muon", "muon_groups_sgd")

    def training_step(self, batch, batch_idx):
        if self.recipe == "lbfgs" and self.mirrors and self.mirrors > 1:
            # L-BFGS's first curvature pair is the difference of two nearly equal gradients, which amplifies
            # rounding ~1000x: the reference sums the data-parallel ranks' gradients as they are reduced (the
            # mean of each rank's mean loss; x 1/2 is exact), so only a wrong update could tell them apart.
            x, y = batch
            chunks = zip(x.chunk(self.mirrors), y.chunk(self.mirrors))
            return sum(loss_fn(self.model, xc, yc) for xc, yc in chunks) / self.mirrors
        loss = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()
        return loss

    def configure_optimizers(self):
        return make_optimizers(self.recipe, self.model)


def _fit_both(arch: str, tp: int, recipe: str, steps: int = 3) -> float:
    ours = Recipe(arch, recipe=recipe)
    _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=steps).fit(ours)
    ref = Recipe(arch, mirrors=dist.get_world_size() // tp, recipe=recipe)
    _single_trainer(max_steps=steps, **ONE_PROCESS).fit(ref)
    start = Recipe(arch, recipe=recipe)
    moved = _worst(_full(start), _full(ref))
    assert moved > 1e-3, moved  # the steps changed the parameters, so equality says something
    return _worst(_full(ours), _full(ref))


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch's Muon orthogonalisation in fp32 instead of bf16, so that one process and the sharded run can be
    compared at fp32 tolerance (in bf16 the sharded matmuls' other summation order moves results by ulps that
    five Newton-Schulz iterations amplify)."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@pytest.mark.parametrize(("arch", "tp"), CASES)
@pytest.mark.parametrize("recipe", ["muon", "adafactor", "lbfgs", "lamb"])
@distributed(world_size=2)
def test_recipe_equals_one_process(arch, tp, recipe):
    from unittest import mock

    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", _newton_schulz_fp32):
        worst = _fit_both(arch, tp, recipe)
    assert worst < TOL[tp], worst


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_transformers_adafactor_raises_naming_the_optimizer(arch, tp):
    # Its factored state is torch.zeros(grad.shape[:-1]).to(grad): a plain tensor of the full shape, which no
    # rank could combine with its shard of the gradient.
    for recipe in ("hf_adafactor", "hf_adafactor_lr"):
        trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=1)
        with pytest.raises(RuntimeError, match=r"inside transformers\.optimization\.Adafactor\.step\(\).*"
                           r"torch\.zeros_like\(p\).*torch\.optim\.Adafactor"):  # fmt: skip
            trainer.fit(Recipe(arch, recipe=recipe))
