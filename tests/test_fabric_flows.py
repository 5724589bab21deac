"""Fabric flows and user-called collectives through ``Fabric(strategy="shard_fsdp_tp")`` (2 gloo ranks: FSDP 2 on
TinyGPT, and TP 2 on a Llama), each compared with one process on the same global data:

* ``fabric.all_gather`` / ``all_reduce`` / ``broadcast`` / ``barrier`` / ``reduce_boolean_decision`` under TP: the
  default group counts each data-parallel replica once (a sum over the world counted it twice under TP 2, a gather
  held each sample twice); an NT-Xent loss over ``all_gather(sync_grads=True)`` (Fabric, and
  ``LightningModule.all_gather`` through the Trainer) equals one process in loss and parameters;
* torchmetrics in a Fabric loop under TP (a metric inside the set-up module, and the user's own);
* ``setup_dataloaders`` under TP (with and without the distributed sampler; 2 x 2 is ``slow``);
* two models: a frozen teacher and a student, a GAN with two optimizers, two models under one
  ``init_module(empty_init=True)`` (they were initialised identically);
* ``fabric.save`` / ``fabric.load`` with plain objects, a tensor and a user object, ``strict=False`` partial loads and
  the returned entries, and the clear error for two models in one checkpoint;
* ``no_backward_sync`` accumulation with ``fabric.autocast()`` (bf16-mixed) and ``clip_gradients(clip_val=...)``.
"""

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


def _nt_xent(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """SimCLR's NT-Xent loss: each of the 2N embeddings against the other 2N - 1, its pair the positive. A copy of
    an embedding among the others is a false negative as similar as the positive: the loss and its gradient change
    (CLIP's image-text loss only shifts by log(copies) when every sample is repeated equally)."""
    z = F.normalize(torch.cat([img, txt]), dim=-1)
    sim = (z @ z.T / 0.1).masked_fill(torch.eye(len(z), dtype=torch.bool), float("-inf"))
    n = len(img)
    pairs = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, pairs)


def _embed(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).float().mean(dim=1)


def _contrastive_reference(tp: int, data) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _model(tp)
    opt = torch.optim.SGD(model.parameters(), lr=LR * 10)
    losses = []
    for img, txt in data:
        opt.zero_grad()
        loss = _nt_xent(_embed(model, img), _embed(model, txt))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return full_state(model), losses


def _contrastive_data():
    return [(_tokens(4, 2 * s), _tokens(4, 2 * s + 1)) for s in range(2)]


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_contrastive_loss_over_all_gather_with_sync_grads_equals_one_process(tp):
    """Each replica embeds its part of the global batch; ``all_gather(sync_grads=True)`` gives the global batch's
    embeddings. Under TP 2 a gather over the world held every sample twice: another loss and gradient."""
    fabric = _fabric(tp)
    dp_rank, dp = _dp(fabric)
    model = fabric.setup_module(_model(tp))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR * 10))
    losses = []
    for img, txt in _contrastive_data():
        opt.zero_grad()
        local = [_embed(model, t.chunk(dp)[dp_rank]) for t in (img, txt)]
        loss = _nt_xent(*(fabric.all_gather(e, sync_grads=True).flatten(0, 1) for e in local))
        fabric.backward(loss)
        opt.step()
        losses.append(loss.item())
    ref, ref_losses = _contrastive_reference(tp, _contrastive_data())
    tol = 1e-5 if tp == 1 else 5e-5
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < tol, (losses, ref_losses)
    assert max_diff(full_state(model.module), ref) < tol


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


# ----------------------------------------------------------------------------- two models


def _distill_loss(student_logits, teacher_logits, y):
    kl = F.kl_div(F.log_softmax(student_logits, -1), F.softmax(teacher_logits, -1), reduction="batchmean")
    return kl + F.cross_entropy(student_logits.reshape(-1, VOCAB), y.reshape(-1))


def _distill_data(steps: int):
    return [(_tokens(4, 10 + 2 * s), _tokens(4, 11 + 2 * s)) for s in range(steps)]


def _distill_reference(tp: int, steps: int) -> dict[str, torch.Tensor]:
    teacher, student = _model(tp, seed=5).eval(), _model(tp, seed=0)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    for x, y in _distill_data(steps):
        with torch.no_grad():
            t = teacher(x)
        opt.zero_grad()
        _distill_loss(student(x).float(), t.float(), y).backward()
        opt.step()
    return full_state(student)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_distillation_frozen_teacher_and_student_equal_one_process(tp):
    """A teacher set up without an optimizer, in eval mode under no_grad, next to a trained student."""
    fabric = _fabric(tp)
    dp_rank, dp = _dp(fabric)
    teacher = fabric.setup_module(_model(tp, seed=5))
    teacher.eval()
    student = fabric.setup_module(_model(tp, seed=0))
    opt = fabric.setup_optimizers(torch.optim.SGD(student.parameters(), lr=0.1))
    for x, y in _distill_data(2):
        x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
        with torch.no_grad():
            t = teacher(x)
        opt.zero_grad()
        fabric.backward(_distill_loss(student(x).float(), t.float(), y))
        opt.step()
    assert max_diff(full_state(student.module), _distill_reference(tp, 2)) < (1e-5 if tp == 1 else 5e-5)
    assert max_diff(full_state(teacher.module), full_state(_model(tp, seed=5))) == 0


class _Generator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, z):
        return self.down(torch.tanh(self.up(z)))


class _Discriminator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.down(F.leaky_relu(self.up(x), 0.2))


def _gan_data(steps: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(steps)]


def _gan_step(gen, disc, opt_g, opt_d, real, z, backward) -> None:
    """One alternating step: the discriminator on real and detached fakes, then the generator through it."""
    bce = F.binary_cross_entropy_with_logits
    opt_d.zero_grad()
    fake = gen(z)
    d_real, d_fake = disc(real), disc(fake.detach())
    backward(bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake)))
    opt_d.step()
    opt_g.zero_grad()
    d_fake = disc(fake)
    backward(bce(d_fake, torch.ones_like(d_fake)))
    opt_g.step()


def _gan_models():
    torch.manual_seed(0)
    return _Generator(), _Discriminator()


@pytest.mark.slow
@distributed(world_size=2)
def test_gan_two_models_two_optimizers_alternating_backward_equals_one_process():
    gen, disc = _gan_models()
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=LR, betas=(0.5, 0.999)) for m in (gen, disc))
    for real, z in _gan_data(3):
        _gan_step(gen, disc, opt_g, opt_d, real, z, lambda loss: loss.backward())

    fabric = _fabric()
    rank, world = dist.get_rank(), dist.get_world_size()
    g, d = _gan_models()
    g, fopt_g = fabric.setup(g, torch.optim.Adam(g.parameters(), lr=LR, betas=(0.5, 0.999)))
    d, fopt_d = fabric.setup(d, torch.optim.Adam(d.parameters(), lr=LR, betas=(0.5, 0.999)))
    for real, z in _gan_data(3):
        _gan_step(g, d, fopt_g, fopt_d, real.chunk(world)[rank], z.chunk(world)[rank], fabric.backward)
    assert max_diff(full_state(g.module), full_state(gen)) < 1e-5
    assert max_diff(full_state(d.module), full_state(disc)) < 1e-5


# ----------------------------------------------------------------------------- checkpoints with extra state


class _Counter:
    """A user object with ``state_dict`` / ``load_state_dict`` (Fabric's ``_Stateful``)."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


@pytest.mark.parametrize("state_dict_type", ["sharded", pytest.param("full", marks=pytest.mark.slow)])
@distributed(world_size=2)
def test_save_load_extra_objects_partial_load_and_two_models(tmp_path, state_dict_type):
    from tests.test_strategy_checkpoint import _shared_path

    fabric = _fabric(strategy_kwargs={"state_dict_type": state_dict_type})
    path = _shared_path(tmp_path, "ckpt")
    model = fabric.setup_module(make_model(0))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    fabric.backward(model(_tokens(2, 0)).float().pow(2).mean())
    opt.step()
    extra = {"step": 3, "cfg": {"lr": LR, "names": ["a", "b"]}, "t": torch.arange(4.0), "counter": _Counter(7)}
    fabric.save(path, {"model": model, "optimizer": opt, **extra})

    # strict=False partial load: the model only; everything else comes back, the user object as its state dict.
    fresh = fabric.setup_module(make_model(1))
    rest = fabric.load(path, {"model": fresh}, strict=False)
    assert max_diff(full_state(fresh.module), full_state(model.module)) == 0
    # A full file returns the optimizer state not asked for; a directory returns meta.pt's entries (as Lightning's
    # FSDPStrategy: the optimizer's tensors stay in the DCP files).
    unasked = {"step", "cfg", "t", "counter"} | ({"optimizer"} if state_dict_type == "full" else set())
    assert set(rest) == unasked
    assert rest["step"] == 3 and rest["cfg"] == extra["cfg"] and torch.equal(rest["t"], extra["t"])
    assert rest["counter"] == {"n": 7}

    # Requested plain entries are filled in place, a user object through load_state_dict.
    counter, state = _Counter(), {"model": fresh, "step": 0, "t": None, "counter": None}
    state["counter"] = counter
    rest = fabric.load(path, state, strict=False)
    assert state["step"] == 3 and torch.equal(state["t"], extra["t"]) and counter.n == 7
    assert "cfg" in rest and "step" not in rest

    # A key the checkpoint lacks: strict raises naming it, strict=False leaves it as it was.
    with pytest.raises(KeyError, match="missing"):
        fabric.load(path, {"model": fresh, "missing": 1})
    state = {"model": fresh, "missing": 1}
    fabric.load(path, state, strict=False)
    assert state["missing"] == 1

    # Two set-up models in one checkpoint: refused on every rank, naming both keys (one model per checkpoint).
    other = fabric.setup_module(make_model(2))
    with pytest.raises(ValueError, match="exactly one model.*'a', 'b'"):
        fabric.save(_shared_path(tmp_path, "two"), {"a": model, "b": other})


# ----------------------------------------------------------------------------- dataloaders


def _indices_seen(fabric, use_distributed_sampler: bool) -> list[list[int]]:
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(16)), batch_size=2, shuffle=True)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=use_distributed_sampler)
    return [batch.tolist() for batch in loader]


def _check_split(fabric, use_distributed_sampler: bool) -> None:
    """The ranks of a TP group see the same batches; the data-parallel replicas disjoint parts covering the data."""
    mesh = fabric.strategy.device_mesh
    seen = _indices_seen(fabric, use_distributed_sampler)
    tp_peers = [None] * mesh.size("tensor_parallel")
    dist.all_gather_object(tp_peers, seen, group=mesh.get_group("tensor_parallel"))
    assert all(peer == seen for peer in tp_peers)
    replicas = [None] * mesh.size("data_parallel")
    dist.all_gather_object(replicas, seen, group=mesh.get_group("data_parallel"))
    flat = [sorted(i for batch in r for i in batch) for r in replicas]
    if use_distributed_sampler:
        assert sorted(i for r in flat for i in r) == list(range(16))  # disjoint, all covered
    else:
        assert all(f == list(range(16)) for f in flat)  # the loader as given, on every rank


@pytest.mark.parametrize("use_distributed_sampler", [True, pytest.param(False, marks=pytest.mark.slow)])
@distributed(world_size=2)
def test_setup_dataloaders_under_tp_same_batches_on_the_tp_group(use_distributed_sampler):
    L.seed_everything(3)  # the shuffle of a user's own loader (no distributed sampler) is seeded the same on every rank
    _check_split(_fabric(tp=2), use_distributed_sampler)


@pytest.mark.slow
@distributed(world_size=4)
def test_setup_dataloaders_on_dp2_x_tp2():
    L.seed_everything(3)
    for use_distributed_sampler in (True, False):
        _check_split(_fabric(tp=2), use_distributed_sampler)


# ----------------------------------------------------------------------------- precision, clipping, accumulation


def _accumulation_reference(tp: int, data, bf16: bool, clip_val: float | None) -> dict[str, torch.Tensor]:
    model = _model(tp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(0, len(data), 2):
        opt.zero_grad()
        for x, y in data[step : step + 2]:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / 2
            loss.backward()
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_val)
        opt.step()
    return full_state(model)


ACCUMULATION_CASES = [
    (2, "32-true"),
    (1, "bf16-mixed"),
    pytest.param(1, "32-true", marks=pytest.mark.slow),
    pytest.param(2, "bf16-mixed", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("tp", "precision"), ACCUMULATION_CASES)
@distributed(world_size=2)
def test_no_backward_sync_accumulation_with_autocast_and_clip_val(tp, precision):
    """2 micro-batches per step under no_backward_sync, the loss under fabric.autocast(); fp32 also with
    clip_gradients(clip_val=...) (binding on the largest gradients only). One process with torch.autocast."""
    bf16 = precision == "bf16-mixed"
    clip_val = None if bf16 else 0.05
    fabric = _fabric(tp, precision=precision)
    dp_rank, dp = _dp(fabric)
    data = [(_tokens(4, 20 + 2 * s), _tokens(4, 21 + 2 * s)) for s in range(4)]
    model = fabric.setup_module(_model(tp))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(0, len(data), 2):
        opt.zero_grad()
        for k, (x, y) in enumerate(data[step : step + 2]):
            x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
            with fabric.no_backward_sync(model, enabled=k == 0):
                logits = model(x)
                with fabric.autocast():
                    loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / 2
                fabric.backward(loss)
        if clip_val is not None:
            fabric.clip_gradients(model, opt, clip_val=clip_val)
        opt.step()
    ref = _accumulation_reference(tp, data, bf16, clip_val)
    diff, change = max_diff(full_state(model.module), ref), max_diff(ref, full_state(_model(tp)))
    if bf16:  # bf16 matmuls, and FSDP's bf16 parameters against autocast's fp32 ones: bf16 rounding (~0.4%)
        assert diff < 0.01 * change, (diff, change)
    else:
        assert diff < (1e-5 if tp == 1 else 5e-5), (diff, change)


# ----------------------------------------------------------------------------- LightningModule.all_gather


class _LitContrastive(L.LightningModule):
    """NT-Xent over ``self.all_gather(..., sync_grads=True)`` of each rank's embeddings."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.model = _model(tp)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = _nt_xent(*(self.all_gather(_embed(self.model, t), sync_grads=True).flatten(0, 1) for t in batch))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR * 10)


@distributed(world_size=2)
def test_lightning_module_all_gather_with_sync_grads_under_tp_equals_one_process():
    """TP 2 (one data-parallel replica, which sees the global batch): the gathered batch is the global batch once."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_strategy import _trainer

    data = _contrastive_data()
    rows = TensorDataset(torch.cat([img for img, _ in data]), torch.cat([txt for _, txt in data]))
    module = _LitContrastive(tp=2)
    # Lightning's distributed sampler shuffles training data; the loader as given keeps the reference's order.
    strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=2)
    trainer = _trainer(strategy=strategy, max_steps=2, use_distributed_sampler=False)
    trainer.fit(module, DataLoader(rows, batch_size=4, shuffle=False))
    ref, ref_losses = _contrastive_reference(2, data)
    assert max(abs(a - b) for a, b in zip(module.losses, ref_losses)) < 5e-5, (module.losses, ref_losses)
    assert max_diff(full_state(module.model), ref) < 5e-5


# ----------------------------------------------------------------------------- init_module with two models


def _one_device_meta_init(n_models: int) -> list[dict[str, torch.Tensor]]:
    """One device, the materialization's procedure: each model's reset_parameters() in turn, one generator."""
    from tests.fsdp_models import TinyGPT

    torch.manual_seed(3)
    with torch.device("meta"):
        models = [TinyGPT() for _ in range(n_models)]
    for model in models:
        model.to_empty(device="cpu")
        model.head.weight = model.embed.weight  # to_empty unties on one device; the sharded model keeps it
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    return [full_state(m) for m in models]


@distributed(world_size=2)
def test_two_models_under_empty_init_are_initialised_like_one_device():
    """Two models of one class built under init_module(empty_init=True), e.g. twin critics: each is set up with
    the generator where the previous one left it, as on one device (both had the same values)."""
    from tests.fsdp_models import TinyGPT

    fabric = _fabric()
    torch.manual_seed(3)
    with fabric.init_module(empty_init=True):
        first, second = TinyGPT(), TinyGPT()
    first, second = fabric.setup_module(first), fabric.setup_module(second)
    ref_first, ref_second = _one_device_meta_init(2)
    assert max_diff(full_state(first.module), ref_first) == 0
    assert max_diff(full_state(second.module), ref_second) == 0
