"""Lightning Trainer features through ``strategy="shard_fsdp_tp"`` (2 gloo ranks), each compared with a reference:
one process running the same LightningModule on the same global batches (Lightning's single-device strategy), or
torch's FSDP2 through Lightning's ModelParallelStrategy.

* one run per mesh (FSDP 2; TP 2 on a GPT-2 whose LM head is tied to its embedding) combines: sanity validation,
  ``val_check_interval`` mid-epoch, AdamW with two param groups (different lr / weight decay, frozen parameters
  in a group), a per-step ``StepLR`` and a ``ReduceLROnPlateau`` on a ``sync_dist`` metric,
  ``configure_gradient_clipping`` alternating value and norm clipping, gradient norms logged in
  ``on_before_optimizer_step`` (``lightning_shard.utils.grad_norm`` against Lightning's ``grad_norm``), and a
  ``reduce_fx="sum"`` metric, which under TP counted every sample once per TP rank;
* ``Trainer.init_module(empty_init=True)``: buffers kept their ``__init__`` values (they held leftover memory,
  different on every rank), and tensors built on meta that nothing initialises raise before the first step;
* precision ``"bf16-mixed"`` and ``"bf16-true"`` against torch's FSDP2;
* ``EarlyStopping`` and ``ModelCheckpoint(monitor=...)`` on a ``sync_dist`` metric, ``test(ckpt_path="best")``
  and ``load_from_checkpoint`` of the best checkpoint in one plain process.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch.utils.data import DataLoader

import strategies
from lightning_shard.utils import grad_norm
from tests.fsdp_models import loss_fn
from tests.harness import distributed
from tests.lightning_models import LitGPT, _build, dataset, reference_params, sampler_batches
from tests.test_strategy import _max_diff, _trainer
from tests.test_strategy_checkpoint import _shared_path
from tests.tp_models import GPT2, RMSNorm

LIMIT_TRAIN, VAL_EVERY, EPOCHS = 4, 2, 2


def _full(module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in module.model.named_parameters()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _single_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


class _EpochBatches:
    """The global batches Lightning's DistributedSampler deals to ``world`` ranks in each epoch (its seed is
    0 + epoch), as one process's batch sampler."""

    def __init__(self, world: int) -> None:
        self.world, self.epoch = world, 0

    def __iter__(self):
        return iter([b.tolist() for b in sampler_batches(self.world, 4, seed=self.epoch)])

    def __len__(self) -> int:
        return len(sampler_batches(self.world, 4))


class Features(LitGPT):
    """``mirrors=None``: the distributed run; ``mirrors=world``: one process on the global batches of that run."""

    def __init__(self, arch: str, mirrors: int | None = None) -> None:
        super().__init__(arch=arch)
        if arch == "gpt2":
            torch.manual_seed(0)
            self.model = GPT2()  # lm_head.weight is transformer.wte.weight
        self.mirrors = mirrors
        self.batches = _EpochBatches(mirrors) if mirrors else None
        self.lrs: list[list[float]] = []
        self.norms: list[dict[str, float]] = []

    def train_dataloader(self):
        return DataLoader(dataset(), batch_sampler=self.batches) if self.mirrors else super().train_dataloader()

    def val_dataloader(self):
        if self.mirrors:
            return DataLoader(dataset(16, seed=2), batch_size=4 * self.mirrors)
        return super().val_dataloader()

    def on_train_epoch_start(self):
        if self.batches is not None:
            self.batches.epoch = self.current_epoch

    def training_step(self, batch, batch_idx):
        self.log("samples", float(batch[0].shape[0]), reduce_fx="sum", sync_dist=True, on_step=False, on_epoch=True)
        self.lrs.append([group["lr"] for group in self.trainer.optimizers[0].param_groups])
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        norms = (lightning_grad_norm if self.mirrors else grad_norm)(self.model, norm_type=2)
        self.norms.append({k: float(v) for k, v in norms.items()})

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.global_step % 2:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        else:
            self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")

    def configure_optimizers(self):
        named = dict(self.model.named_parameters())  # TinyGPT: the frozen layer's weight is in the first group
        matrices = [p for p in named.values() if p.ndim >= 2]
        vectors = [p for p in named.values() if p.ndim < 2]
        # eps=1e-4: GPT-2's key bias has a gradient that is zero in exact arithmetic (softmax ignores a shift of
        # every key); Adam's default eps would turn its rounding noise, which differs between any two summation
        # orders, into full lr-sized steps
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "lr": 3e-2, "weight_decay": 0.0}],
            lr=1e-2,
            eps=1e-4,
        )
        step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        # mode="max" on a falling loss: no improvement, so the lr is halved at every epoch's end
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
        return [optimizer], [{"scheduler": step, "interval": "step"}, {"scheduler": plateau, "monitor": "val_loss"}]


@pytest.mark.parametrize(("arch", "tp"), [("gpt", 1), ("gpt2", 2)])
@distributed(world_size=2)
def test_trainer_features_equal_one_process(arch, tp):
    loops = dict(
        max_steps=-1,
        max_epochs=EPOCHS,
        limit_train_batches=LIMIT_TRAIN,
        val_check_interval=VAL_EVERY,
        limit_val_batches=2,
        num_sanity_val_steps=2,
    )
    ours = Features(arch)
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), **loops)
    trainer.fit(ours)
    world = dist.get_world_size() // tp
    if tp > 1:
        assert ours.model.lm_head.weight is ours.model.transformer.wte.weight
    ref = Features(arch, mirrors=world)
    reference = _single_trainer(**loops)
    reference.fit(ref)

    assert len(ours.lrs) == EPOCHS * LIMIT_TRAIN and ours.lrs == ref.lrs  # both schedulers, both groups
    final = [group["lr"] for group in trainer.optimizers[0].param_groups]
    assert final == [group["lr"] for group in reference.optimizers[0].param_groups]
    assert final[1] == pytest.approx(ref.lrs[-1][1] * 0.9 * 0.5)  # the last step's StepLR, then the plateau's
    moved = _worst(_full(ref), {n: p.detach() for n, p in Features(arch).model.named_parameters()})
    assert moved > 1e-2
    assert _worst(_full(ours), _full(ref)) < (1e-5 if tp == 1 else 5e-5)
    assert len(ours.norms) == len(ref.norms) == EPOCHS * LIMIT_TRAIN
    for mine, theirs in zip(ours.norms, ref.norms):
        assert mine.keys() == theirs.keys()
        assert max(abs(mine[k] - theirs[k]) for k in mine) < 1e-4 * max(1.0, theirs["grad_2.0_norm_total"])
    # reduce_fx="sum": the samples of the global batches, as one process counts them (TP 2 counted them twice)
    assert trainer.callback_metrics["samples"].item() == reference.callback_metrics["samples"].item() == 16 * world
    val = trainer.callback_metrics["val_loss"].item()
    assert val == pytest.approx(reference.callback_metrics["val_loss"].item(), rel=1e-5)


class _Initial(LitGPT):
    """Records the materialized parameters when training starts. ``arch="llama"``: its RMSNorms get a
    ``reset_parameters`` (they hold ``torch.ones`` and have none; see the test below)."""

    def __init__(self, arch: str) -> None:
        super().__init__(arch=arch)
        for m in self.model.modules():
            if type(m) is RMSNorm:
                m.__class__ = _ResettableRMSNorm

    def on_fit_start(self):
        self.initial = {n: p.full_tensor().clone() for n, p in self.model.named_parameters()}


class _ResettableRMSNorm(RMSNorm):
    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)


def _train_from(initial: dict[str, torch.Tensor], arch: str, steps: int, world: int) -> dict[str, torch.Tensor]:
    model = _build(arch)  # buffers as __init__ computes them
    model.load_state_dict(initial, strict=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, batches = dataset(), iter(sampler_batches(world, 4))
    for _ in range(steps):
        optimizer.zero_grad()
        x, y = data[next(batches)]
        loss_fn(model, x, y).backward()
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("arch", "tp"), [("gpt", 1), ("llama", 2)])
@distributed(world_size=2)
def test_empty_init_keeps_buffers_and_trains_like_one_process(arch, tp):
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=3)
    with trainer.init_module(empty_init=True):
        module = _Initial(arch)
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module)
    fresh = dict(_build(arch).named_buffers())  # TinyGPT: scale; Llama: the rotary cos/sin tables
    buffers = dict(module.model.named_buffers())
    assert buffers.keys() == fresh.keys() and fresh
    for name, value in buffers.items():  # on every rank (they held each rank's leftover memory)
        assert torch.equal(value.to_local() if hasattr(value, "to_local") else value, fresh[name]), name
    expected = _train_from(module.initial, arch, 3, dist.get_world_size() // tp)
    assert _max_diff(module, expected) < 1e-5


class _MetaBuilt(LitGPT):
    """``configure_model`` builds TinyGPT under ``torch.device("meta")``: its ``scale`` buffer (0.5) is lost."""

    def __init__(self) -> None:
        super().__init__(meta_init=True)

    def configure_model(self):
        if self.model is None:
            with torch.device("meta"):
                self.model = _build(self.arch)


@distributed(world_size=2)
def test_tensors_built_on_meta_that_nothing_initialises_raise_unless_a_checkpoint_fills_them(tmp_path):
    with pytest.raises(RuntimeError, match="buffers 'model.scale' were built on the meta device"):
        _trainer(max_steps=1).fit(_MetaBuilt())
    # a parameter whose module has no reset_parameters (tests/tp_models.RMSNorm: nn.Parameter(torch.ones(d)))
    trainer = _trainer(max_steps=1)
    with trainer.init_module(empty_init=True):
        llama = LitGPT(arch="llama")
    with pytest.raises(RuntimeError, match=r"parameters 'model\.layers\.0\.attention_norm\.weight'.*reset_parameters"):
        trainer.fit(llama)
    # a checkpoint loaded before the first step fills them (scale is a persistent buffer): no error
    path = _shared_path(tmp_path, "ckpt")
    saved = _trainer(max_steps=2)
    saved.fit(LitGPT())
    saved.save_checkpoint(path)
    resumed, built = _MetaBuilt(), LitGPT(lr=0.5)  # the loaded values, not their initial ones, train on
    _trainer(max_steps=3).fit(resumed, ckpt_path=path)
    _trainer(max_steps=3).fit(built, ckpt_path=path)
    assert resumed.model.scale.item() == 0.5
    assert _worst(_full(resumed), _full(built)) == 0
    assert _worst(_full(built), reference_params(2)) > 1e-3  # the resumed step trained


class _TorchFSDP(LitGPT):
    """LitGPT sharded by torch's fully_shard (blocks, then the root) in configure_model, for ModelParallelStrategy,
    with FSDP2's mixed precision policy for ``param_dtype``."""

    def __init__(self, param_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.param_dtype = param_dtype

    def configure_model(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)


@pytest.mark.parametrize(("precision", "param_dtype"), [("bf16-mixed", torch.bfloat16), ("bf16-true", None)])
@distributed(world_size=2)
def test_low_precision_equals_torch_fsdp2(precision, param_dtype):
    from lightning.pytorch.strategies import ModelParallelStrategy

    theirs = _TorchFSDP(param_dtype)
    _trainer(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), max_steps=3, precision=precision
    ).fit(theirs)
    ours = LitGPT()
    _trainer(max_steps=3, precision=precision).fit(ours)
    expected = {n: p.full_tensor() for n, p in theirs.model.named_parameters()}
    assert {p.dtype for p in ours.parameters()} == {p.dtype for p in theirs.parameters()}
    assert _worst(_full(ours), {n: p.detach() for n, p in _build("gpt").named_parameters()}) > 1e-2  # it trained
    # 3 steps of rounding in bf16 (one ulp at 1.0 is 7.8e-3), yet the same values as torch's FSDP2
    assert _worst(_full(ours), expected) < 1e-6


@distributed(world_size=2)
def test_early_stopping_and_best_checkpoint_on_a_synced_metric(tmp_path):
    root = _shared_path(tmp_path, "run")
    best = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=1, save_last=True)
    stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)  # stops after the 2nd validation
    module = LitGPT(lr=0.5)
    trainer = _trainer(
        max_steps=-1, max_epochs=5, limit_train_batches=2, limit_val_batches=2, enable_checkpointing=True,
        callbacks=[best, stop],
    )  # fmt: skip
    trainer.fit(module)
    assert stop.stopped_epoch == 1 and trainer.current_epoch == 2
    tested = trainer.test(module, ckpt_path="best", verbose=False)[0]["test_loss"]  # test data = val data
    assert tested == pytest.approx(best.best_model_score.item(), rel=1e-6)
    if dist.get_rank() == 0:  # one plain process, no strategy
        plain = LitGPT.load_from_checkpoint(best.best_model_path).eval()
        with torch.no_grad():
            losses = [loss_fn(plain.model, x, y) for x, y in DataLoader(dataset(16, seed=2), batch_size=4)]
        assert torch.stack(losses).mean().item() == pytest.approx(tested, rel=1e-5)
    assert os.path.basename(best.best_model_path).startswith("epoch=0")
