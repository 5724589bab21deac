"""Optimizers whose update is not element-wise, and optimization loops that meet the sharding, through
``Trainer(strategy="shard_fsdp_tp")`` on 2 gloo ranks (FSDP 2 on TinyGPT, TP 2 on a Llama; ``slow``: FSDP 2 x TP 2
on 4), each compared with one process on the same global batches, or checked to raise a clear error:

* ``torch.optim.Muon`` + AdamW, ``torch.optim.Adafactor``, ``torch.optim.LBFGS`` with Lightning's closure, a user
  LAMB (``p.norm()``), LARS in ``on_before_optimizer_step``; Adafactor and Muon resumed from a checkpoint;
* transformers' ``Adafactor`` (plain full-shape state) raised an error about fully_shard units, and now names
  the optimizer and the fix; LBFGS checkpoints: a full save raised "DTensor cannot be pickled" and a resume a
  ``TypeError`` from inside the checkpoint code, now both save and the resume names LBFGS;
* a GAN in manual optimization (``toggle_optimizer``, ``clip_gradients``): with the discriminator accumulating
  over 2 batches its head (a root-unit parameter) picked up the generator phase's gradient, and with phases that
  freeze by ``requires_grad_()`` it got none: the root unshards before ``training_step``'s code runs;
* no-decay param groups by name (Hugging Face's recipe on BERT), per-step schedulers (also one reading Adam's
  state), ``zero_grad(set_to_none=False)`` with gradient accumulation.
"""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
import torch.distributed as dist

import strategies
from tests.fsdp_models import loss_fn
from tests.harness import distributed
from tests.test_strategy import _trainer
from tests.test_trainer_features import _EpochBatches, _full, _single_trainer, _worst
from tests.test_trainer_flows import ONE_PROCESS, Flow

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
    if recipe == "lars_hook":  # the trust ratio is applied in on_before_optimizer_step (Recipe)
        return [torch.optim.SGD(trainable, lr=0.05, momentum=0.9)]
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

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        if self.recipe == "lars_hook":  # LARS written in a hook: each gradient scaled by ||p|| / ||grad||
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(torch.linalg.vector_norm(p.detach()) / (p.grad.norm() + 1e-6))

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


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("recipe", "arch", "tp"),
    [
        *[(recipe, "gpt", 1) for recipe in ("muon", "adafactor", "lbfgs", "lamb", "lars_hook")],
        ("muon", "llama", 2),  # column- and row-parallel weights
        ("adafactor", "llama", 2),
        *[pytest.param(recipe, "llama", 2, marks=SLOW) for recipe in ("lbfgs", "lamb", "lars_hook")],
    ],
)
@distributed(world_size=2)
def test_recipe_equals_one_process(recipe, arch, tp):
    from unittest import mock

    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", _newton_schulz_fp32):
        worst = _fit_both(arch, tp, recipe)
    assert worst < TOL[tp], worst


@SLOW
@distributed(world_size=4)
def test_recipes_on_fsdp_2_x_tp_2():
    from unittest import mock

    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", _newton_schulz_fp32):
        for recipe in ("muon", "adafactor", "lamb", "lbfgs"):
            worst = _fit_both("llama", 2, recipe)
            assert worst < TOL[2], (recipe, worst)


@pytest.mark.parametrize(("arch", "tp"), [("gpt", 1), pytest.param("llama", 2, marks=SLOW)])
@distributed(world_size=2)
def test_transformers_adafactor_raises_naming_the_optimizer(arch, tp):
    # Its factored state is torch.zeros(grad.shape[:-1]).to(grad): a plain tensor of the full shape, which no
    # rank could combine with its shard of the gradient.
    for recipe in ("hf_adafactor", "hf_adafactor_lr"):
        trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=1)
        with pytest.raises(RuntimeError, match=r"inside transformers\.optimization\.Adafactor\.step\(\).*"
                           r"torch\.zeros_like\(p\).*torch\.optim\.Adafactor"):  # fmt: skip
            trainer.fit(Recipe(arch, recipe=recipe))


# ----------------------------------------------------------------------------------- manual optimization: a GAN
class Block(torch.nn.Module):
    """A residual MLP block (the strategy's FSDP unit; ``up``/``down`` are column/row parallel under TP)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _tower(out: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(16, out))


def _bce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, target)


def _gan_data(n: int = 64):
    g = torch.Generator().manual_seed(3)
    from torch.utils.data import TensorDataset

    return TensorDataset(torch.randn(n, 16, generator=g) * 0.5 + 1.0, torch.randn(n, 16, generator=g))


class Gan(L.LightningModule):
    """Lightning's GAN recipe: generator and discriminator optimizers stepped in one ``training_step`` with
    ``toggle_optimizer`` (the other model's parameters stop requiring grad), ``manual_backward`` and
    ``clip_gradients``; the discriminator scores the same fake batch twice, once per phase. ``accumulate=2``:
    the discriminator steps every 2 batches on the accumulated gradients, without zeroing in between.
    ``d_first``: the discriminator's phase first, each phase freezing the other model with ``requires_grad_``
    (so each step starts with the discriminator frozen, as the previous one left it)."""

    def __init__(self, mirrors: int | None = None, accumulate: int = 1, d_first: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.mirrors, self.accumulate, self.d_first = mirrors, accumulate, d_first
        torch.manual_seed(0)
        self.generator, self.discriminator = _tower(16), _tower(1)

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        if self.d_first:
            self._train(self.discriminator, self.generator, lambda: self._d_phase(d_opt, batch, batch_idx))
            self._train(self.generator, self.discriminator, lambda: self._g_phase(g_opt, batch))
            return
        self.toggle_optimizer(g_opt)
        self._g_phase(g_opt, batch)
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        self._d_phase(d_opt, batch, batch_idx)
        self.untoggle_optimizer(d_opt)

    @staticmethod
    def _train(trained: torch.nn.Module, frozen: torch.nn.Module, phase) -> None:
        trained.requires_grad_(True)
        frozen.requires_grad_(False)
        phase()

    def _g_phase(self, g_opt, batch) -> None:
        real, noise = batch
        fake = self.generator(noise)
        self.manual_backward(_bce(self.discriminator(fake), torch.ones(len(real), 1)))
        self.clip_gradients(g_opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        g_opt.step()
        g_opt.zero_grad()

    def _d_phase(self, d_opt, batch, batch_idx) -> None:
        real, noise = batch
        fake = self.generator(noise).detach()
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        d_loss = (_bce(self.discriminator(real), ones) + _bce(self.discriminator(fake), zeros)) / 2
        self.manual_backward(d_loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            self.clip_gradients(d_opt, gradient_clip_val=0.01, gradient_clip_algorithm="value")
            d_opt.step()
            d_opt.zero_grad()

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
        )

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        if self.mirrors:
            return DataLoader(_gan_data(), batch_sampler=_EpochBatches(self.mirrors))
        return DataLoader(_gan_data(), batch_size=4)


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_gan_manual_optimization_equals_one_process(tp):
    for variant in (dict(accumulate=1), dict(accumulate=2), dict(d_first=True)):
        ours = Gan(**variant)
        _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=8).fit(ours)
        ref = Gan(mirrors=dist.get_world_size() // tp, **variant)
        _single_trainer(max_steps=8, **ONE_PROCESS).fit(ref)
        ours_p, ref_p, start = _params(ours), _params(ref), _params(Gan())
        assert _worst(start, ref_p) > 1e-3
        assert _worst(ours_p, ref_p) < TOL[tp], (variant, _worst(ours_p, ref_p))


def _no_inner_unit(module: torch.nn.Module) -> bool:
    return False


@distributed(world_size=2)
def test_gan_as_one_fsdp_unit_equals_one_process():
    """The whole model one FSDP unit (``fsdp_unit`` matching no module): each phase's ``manual_backward`` runs
    inside ``training_step``, the root's forward, and reaches no inner unit whose hooks would end the backward.
    The generator's gradients were never reduced, so it did not train, with no error."""
    ours = Gan()
    with pytest.warns(UserWarning, match="matched no module") if dist.get_rank() == 0 else contextlib.nullcontext():
        _trainer(strategy=strategies.ShardFSDPTPStrategy(fsdp_unit=_no_inner_unit), max_steps=8).fit(ours)
    ref = Gan(mirrors=dist.get_world_size())
    _single_trainer(max_steps=8, **ONE_PROCESS).fit(ref)
    assert _worst(_params(ours), _params(ref)) < TOL[1]


def _params(module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in module.named_parameters()}


# ------------------------------------------------------------- param groups by name; schedulers; zero_grad(False)
NO_DECAY = ("bias", "LayerNorm.weight")  # Hugging Face's recipe


class NoDecayBert(L.LightningModule):
    """A BERT masked LM with AdamW in two groups built from ``named_parameters()`` in ``configure_optimizers``
    (after the strategy sharded the model): weight decay except on biases and LayerNorm weights."""

    def __init__(self, mirrors: int | None = None) -> None:
        super().__init__()
        from tests import hf_models as H

        self.model, self.mirrors, self.loss = H.build("bert"), mirrors, H.lm_loss

    def training_step(self, batch, batch_idx):
        return self.loss(self.model, batch[0])

    def configure_optimizers(self):
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        skip = [any(key in n for key in NO_DECAY) for n, _ in named]
        self.group_names = [[n for (n, _), s in zip(named, skip) if s is flag] for flag in (False, True)]
        groups = [
            {"params": [p for (_, p), s in zip(named, skip) if not s], "weight_decay": 0.5},
            {"params": [p for (_, p), s in zip(named, skip) if s], "weight_decay": 0.0},
        ]
        # SGD rather than the recipe's AdamW: Adam scales the rounding noise of gradients that are zero in exact
        # arithmetic (attention key biases: softmax ignores a score added to every key) up to steps of ~lr.
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        from tests import hf_models as H
        from tests.lightning_models import sampler_batches

        if self.mirrors:
            batches = [b.tolist() for b in sampler_batches(self.mirrors, 2, n=32)]
            return DataLoader(H.token_dataset(), batch_sampler=batches)
        return DataLoader(H.token_dataset(), batch_size=2)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=SLOW)])
@distributed(world_size=2)
def test_no_decay_groups_by_name_equal_one_process(tp):
    ours = NoDecayBert()
    _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=3).fit(ours)
    ref = NoDecayBert(mirrors=dist.get_world_size() // tp)
    _single_trainer(max_steps=3, **ONE_PROCESS).fit(ref)
    assert ours.group_names == ref.group_names  # the names configure_optimizers sees are the model's own
    assert any("LayerNorm.weight" in n for n in ref.group_names[1]) and ref.group_names[0]
    ours_p, ref_p = _full(ours), _full(ref)
    assert _worst(_full(NoDecayBert()), ref_p) > 1e-3
    assert _worst(ours_p, ref_p) < TOL[tp], _worst(ours_p, ref_p)


class MeanSecondMoment(torch.optim.lr_scheduler.LRScheduler):
    """A user's scheduler that reads the optimizer's state: lr scaled by 1 / (1 + 1e3 * mean of Adam's
    ``exp_avg_sq`` over all parameters), a value each rank can only know from the whole state."""

    def get_lr(self):
        states = [s["exp_avg_sq"] for s in self.optimizer.state.values() if "exp_avg_sq" in s]
        mean = float(sum(s.sum() for s in states) / max(1, sum(s.numel() for s in states))) if states else 0.0
        return [base / (1 + 1e3 * mean) for base in self.base_lrs]


class Scheduled(Flow):
    """``Flow`` with a per-step scheduler: ``"onecycle"`` (AdamW, cycling its betas), ``"warm_restarts"`` (SGD
    with momentum, ``zero_grad(set_to_none=False)``), ``"state"`` (``MeanSecondMoment`` on AdamW)."""

    def __init__(self, arch: str = "gpt", mirrors: int | None = None, schedule: str = "onecycle") -> None:
        super().__init__(arch, mirrors)
        self.schedule = schedule
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=self.schedule != "warm_restarts")

    def configure_optimizers(self):
        params = self.model.parameters()
        if self.schedule == "warm_restarts":
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2, eta_min=0.01)
        else:
            opt = torch.optim.AdamW(params, lr=1e-2)
            if self.schedule == "onecycle":
                sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=8)
            else:
                sched = MeanSecondMoment(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize(("arch", "tp"), [("gpt", 1), pytest.param("llama", 2, marks=SLOW)])
@distributed(world_size=2)
def test_step_schedulers_and_zero_grad_without_none_equal_one_process(arch, tp):
    for schedule in ("onecycle", "warm_restarts", "state"):
        # zeroed (not None) gradients accumulated over 2 batches, the reduce-scatters adding into them
        loops = dict(max_steps=5, accumulate_grad_batches=2 if schedule == "warm_restarts" else 1)
        ours = Scheduled(arch, schedule=schedule)
        _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), **loops).fit(ours)
        ref = Scheduled(arch, mirrors=dist.get_world_size() // tp, schedule=schedule)
        _single_trainer(**loops, **ONE_PROCESS).fit(ref)
        assert ours.lrs == pytest.approx(ref.lrs, rel=1e-5) and len(set(ref.lrs)) > 1, schedule
        assert _worst(_full(ours), _full(ref)) < TOL[tp], (schedule, _worst(_full(ours), _full(ref)))


# ------------------------------------------------------------------ resuming the state of non-element-wise optimizers
@pytest.mark.parametrize(
    ("recipe", "state_dict_type"),
    [("adafactor", "sharded"), ("muon", "full"), pytest.param("adafactor", "full", marks=SLOW)],
)
@distributed(world_size=2)
def test_resume_equals_uninterrupted(tmp_path, recipe, state_dict_type):
    """Adafactor's factored state (a row and a column vector per matrix) and Muon's momentum through a checkpoint
    and ``fit(ckpt_path=...)``: the resumed run equals one process trained straight through."""
    from unittest import mock

    from tests.test_strategy_checkpoint import _shared_path

    path = _shared_path(tmp_path, f"{recipe}.ckpt")

    def trainer(epochs: int):
        strategy = strategies.ShardFSDPTPStrategy(state_dict_type=state_dict_type)
        return _trainer(strategy=strategy, max_steps=-1, max_epochs=epochs, limit_train_batches=2)

    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", _newton_schulz_fp32):
        first = trainer(1)
        first.fit(Recipe(recipe=recipe))
        first.save_checkpoint(path)
        resumed = Recipe(recipe=recipe)
        trainer(2).fit(resumed, ckpt_path=path)
        ref = Recipe(mirrors=dist.get_world_size(), recipe=recipe)
        _single_trainer(max_steps=-1, max_epochs=2, limit_train_batches=2, **ONE_PROCESS).fit(ref)
    assert ref.trainer.global_step == resumed.trainer.global_step
    assert _worst(_full(resumed), _full(ref)) < TOL[1], _worst(_full(resumed), _full(ref))


@pytest.mark.parametrize("state_dict_type", ["sharded", pytest.param("full", marks=SLOW)])
@distributed(world_size=2)
def test_lbfgs_saves_and_its_resume_raises_naming_the_optimizer(tmp_path, state_dict_type):
    # Its state is a history of flat vectors over all parameters, in lists: a full save could not pickle the
    # DTensors in them, and a resume (whose fresh LBFGS has no state: a step needs a closure) raised a TypeError
    # from inside the checkpoint code.
    from tests.test_strategy_checkpoint import _shared_path

    path = _shared_path(tmp_path, "lbfgs.ckpt")
    strategy = strategies.ShardFSDPTPStrategy(state_dict_type=state_dict_type)
    trainer = _trainer(strategy=strategy, max_steps=2)
    trainer.fit(Recipe(recipe="lbfgs"))
    trainer.save_checkpoint(path)
    strategy = strategies.ShardFSDPTPStrategy(state_dict_type=state_dict_type)
    match = r"cannot load the state of torch\.optim\.lbfgs\.LBFGS into its sharded parameters: its step\(\) "
    with pytest.raises(ValueError, match=match + r"requires a closure.*load_from_checkpoint"):
        _trainer(strategy=strategy, max_steps=3).fit(Recipe(recipe="lbfgs"), ckpt_path=path)
    if state_dict_type == "full":  # the weights in it load in a plain process
        weights, trained = torch.load(path, weights_only=True)["state_dict"], _full(trainer.lightning_module)
        assert _worst({n: weights[f"model.{n}"] for n in trained}, trained) == 0
