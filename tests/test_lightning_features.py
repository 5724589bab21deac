"""Lightning features through ``strategy="shard_fsdp_tp"`` not covered by the other flow modules (2 gloo ranks:
FSDP 2 on TinyGPT, TP 2 on a Llama), each compared with one process running the same LightningModule on the same
global batches, or checked to raise a clear error on every rank:

* ``ModelPruning`` is refused at setup with the fix (it pruned after sharding: the lottery-ticket reset assigned
  full tensors to the shards' ``.data``, and without it the next forward no longer found the renamed parameter,
  both after an epoch of training); ``torch.nn.utils.prune`` applied in ``__init__`` (before sharding) trains like
  one process with the mask applied; pruning after sharding raises at the unit's forward naming it;
* ``torch.export.export`` of the sharded module is refused by name (it stopped at the replaced-parameter check,
  naming ``functional_call``); ``save_hyperparameters`` and ``load_from_checkpoint`` of a sharded directory and of
  the file the consolidation tool makes of it: the hyperparameters and the trained model's outputs;
* profilers (``"simple"``, ``"advanced"``, ``"pytorch"``), ``fast_dev_run``, ``num_sanity_val_steps=-1``,
  ``barebones``, ``trainer.validate`` before ``fit`` and ``inference_mode=False``; ``test(ckpt_path="last")`` and
  ``"best"`` after ``fit`` with ``ModelCheckpoint(save_last=True)``, both checkpoint formats;
* ``LearningRateMonitor``; ``freeze()`` / ``unfreeze()`` between two ``fit`` calls;
* ``LightningCLI``: ``--trainer.strategy=shard_fsdp_tp``, a YAML ``class_path: strategies.ShardFSDPTPStrategy``
  with ``init_args``, ``fit`` then ``test`` (skipped without ``jsonargparse``).
"""

from __future__ import annotations

import contextlib
import io
import os
from importlib.util import find_spec

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ModelPruning
from torch.nn.utils import prune

import strategies
from lightning_shard.checkpoint import consolidate
from tests.fsdp_models import loss_fn
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset, reference_params
from tests.test_callback_flows import _Recorder
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path
from tests.test_trainer_features import _full, _single_trainer, _worst
from tests.test_trainer_flows import CASES, ONE_PROCESS, Flow, _fit_both, _strategy

FSDP_ONLY = [CASES[0], pytest.param(*CASES[1], marks=pytest.mark.slow)]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _pruned_linears(model) -> list[torch.nn.Linear]:
    """Each block's up-projection: TinyGPT's ``blocks[i].up``, the Llama's ``layers[i].feed_forward.up_proj``."""
    if hasattr(model, "blocks"):
        return [block.up for block in model.blocks]
    return [layer.feed_forward.up_proj for layer in model.layers]


class PrunedEarly(Flow):
    """Half of each up-projection's weight pruned by magnitude in ``__init__``, before the strategy shards it."""

    def __init__(self, arch: str = "gpt", mirrors: int | None = None) -> None:
        super().__init__(arch, mirrors)
        for linear in _pruned_linears(self.model):
            prune.l1_unstructured(linear, "weight", amount=0.5)


def _masked(module) -> dict[str, torch.Tensor]:
    """The weights the forward uses: ``weight_orig * weight_mask`` of each pruned Linear, whole."""
    return {
        f"{i}": _whole(linear.weight_orig) * _whole(linear.weight_mask)
        for i, linear in enumerate(_pruned_linears(module.model))
    }


@pytest.mark.parametrize(("arch", "tp"), FSDP_ONLY)
@distributed(world_size=2)
def test_model_pruning_is_refused_and_pruning_before_sharding_equals_one_process(arch, tp):
    refused = r"ModelPruning callback does not support sharded models.*Prune before sharding instead: "
    with pytest.raises(ValueError, match=refused + r"torch\.nn\.utils\.prune in your LightningModule's __init__"):
        _trainer(strategy=_strategy(tp), callbacks=[ModelPruning("l1_unstructured", amount=0.5)]).fit(Flow(arch))
    ours, ref = _fit_both(arch, tp, module=PrunedEarly, max_steps=3)  # weight_orig among the compared parameters
    masked = _masked(ours)
    assert _worst(masked, _masked(ref)) < 1e-5
    assert all((w == 0).float().mean().item() == 0.5 for w in masked.values())  # the masks still apply
    first = ours.model.blocks[0].down if arch == "gpt" else ours.model.layers[0].feed_forward.down_proj
    prune.identity(first, "weight")  # after sharding: "weight" becomes a plain attribute, "weight_orig" the parameter
    with pytest.raises(RuntimeError, match=r"parameter '\S*down\S*\.weight' was replaced or removed.*"
                       r"torch\.nn\.utils\.prune applied after fully_shard"):  # fmt: skip
        ours(dataset(2).tensors[0])


class Hyper(LitGPT):
    def __init__(self, arch: str = "gpt", lr: float = 0.1, tag: str = "a") -> None:
        super().__init__(lr=lr, arch=arch)
        self.save_hyperparameters()


@pytest.mark.parametrize(("arch", "tp"), FSDP_ONLY)
@distributed(world_size=2)
def test_hyperparameters_load_from_a_sharded_and_a_consolidated_checkpoint_and_torch_export_is_refused(
    arch, tp, tmp_path
):
    path = _shared_path(tmp_path, "hyper.ckpt")
    module = Hyper(arch, lr=0.05, tag="b")
    trainer = _trainer(strategy=_strategy(tp), max_steps=2)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    x = dataset(4, seed=5).tensors[0]
    with pytest.raises(RuntimeError, match=r"torch\.export\.export of a fully_shard-ed module is not supported.*"
                       r"load_from_checkpoint\(path\)"):  # fmt: skip
        torch.export.export(module, (x,))
    with torch.no_grad():
        expected = _whole(module(x))  # every rank: the root unit's forward all-gathers
    if dist.get_rank() == 0:  # one plain process, no strategy
        consolidate(path, path + ".pt")
        for source in (path, path + ".pt"):
            loaded = Hyper.load_from_checkpoint(source).eval()
            assert dict(loaded.hparams) == {"arch": arch, "lr": 0.05, "tag": "b"}
            with torch.no_grad():
                assert (loaded(x) - expected).abs().max() < 1e-5
    dist.barrier()


# profiler="pytorch" runs without validation: torch's profiler crashed its process (SIGSEGV) on the 4th of 4
# profiled fits with validation in one worker, with Lightning's single-device strategy too (no sharding involved)
LOOP_FLAGS = {
    "simple_profiler_all_sanity_batches": dict(profiler="simple", num_sanity_val_steps=-1, limit_val_batches=None),
    "pytorch_profiler": dict(profiler="pytorch"),
    "advanced_profiler_fast_dev_run": dict(profiler="advanced", fast_dev_run=True),
    "barebones": dict(barebones=True),  # Lightning refuses a profiler with it
}
LOOP_CASES = [
    pytest.param(arch, tp, flags, marks=[] if (arch, tp, flags) == ("gpt", 1, "simple_profiler_all_sanity_batches")
                 else [pytest.mark.slow])
    for arch, tp in CASES
    for flags in LOOP_FLAGS
]  # fmt: skip


@pytest.mark.parametrize(("arch", "tp", "flags"), LOOP_CASES)
@distributed(world_size=2)
def test_profilers_and_loop_flags_train_like_one_process(arch, tp, flags, tmp_path):
    loops = dict(max_steps=3, default_root_dir=_shared_path(tmp_path, "profiled"), **LOOP_FLAGS[flags])
    ours, ref = Flow(arch), Flow(arch, mirrors=dist.get_world_size() // tp)
    _trainer(strategy=_strategy(tp), **loops).fit(ours)
    _single_trainer(**{**ONE_PROCESS, **loops, "profiler": None}).fit(ref)  # the reference: no profiler
    steps = [(0, 1)] if "fast_dev_run" in flags else [(0, 1), (0, 2), (0, 3)]
    assert ours.steps_seen == ref.steps_seen == steps
    assert _worst(_full(ours), _full(ref)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_validate_before_fit_and_inference_mode_off_equal_one_process(arch, tp):
    losses = []
    for inference_mode in (True, False):
        trainer = _trainer(strategy=_strategy(tp), inference_mode=inference_mode, limit_val_batches=None)
        losses.append(trainer.validate(Flow(arch), verbose=False)[0]["val_loss"])
    one = _single_trainer(limit_val_batches=None).validate(Flow(arch), verbose=False)[0]["val_loss"]
    assert losses == pytest.approx([one, one], rel=1e-6)
    ours, ref = Flow(arch), Flow(arch, mirrors=dist.get_world_size() // tp)
    trainer, single = _trainer(strategy=_strategy(tp), max_steps=3), _single_trainer(max_steps=3, **ONE_PROCESS)
    trainer.validate(ours, verbose=False)
    single.validate(ref, verbose=False)
    trainer.fit(ours)
    single.fit(ref)
    assert ours.steps_seen == ref.steps_seen and _worst(_full(ours), _full(ref)) < 1e-5


class _History(_Recorder):
    """Every logged value of every key, in order (on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[float]] = {}

    def log_metrics(self, metrics, step=None) -> None:
        for key, value in metrics.items():
            self.history.setdefault(key, []).append(float(value))


class Scheduled(Flow):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "interval": "step"}]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_learning_rate_monitor_and_freeze_unfreeze_between_fits_equal_one_process(arch, tp):
    logged = []
    for logger, trainer in ((_History(), _trainer), (_History(), _single_trainer)):
        monitor = LearningRateMonitor(logging_interval="step", log_momentum=True)
        trainer(max_steps=3, logger=logger, log_every_n_steps=1, callbacks=[monitor]).fit(Scheduled(arch))
        logged.append({k: v for k, v in logger.history.items() if k.startswith("lr-")})
    assert logged[0] == logged[1] == {"lr-SGD": [0.1, 0.05, 0.025], "lr-SGD-momentum": [0.9, 0.9, 0.9]}
    ours, ref = Flow(arch), Flow(arch, mirrors=dist.get_world_size() // tp)
    for module, trainer in ((ours, lambda: _trainer(strategy=_strategy(tp), max_steps=2)),
                            (ref, lambda: _single_trainer(max_steps=2, **ONE_PROCESS))):  # fmt: skip
        trainer().fit(module)
        module.freeze()
        assert not any(p.requires_grad for p in module.parameters()) and not module.training
        module.unfreeze()
        trainer().fit(module)  # a second fit on a new Trainer, every parameter trainable again
    assert ours.steps_seen == ref.steps_seen == [(0, 1), (0, 2)] * 2
    assert _worst(_full(ours), _full(ref)) < 1e-5


def _tested_from_checkpoints(module, trainer) -> tuple[float, float]:
    """``fit``, then ``test`` from ``"last"`` and from ``"best"`` (test data = validation data), the module's own
    weights scrambled first so that only a load can give the trained loss."""
    trainer.fit(module)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)
    return tuple(trainer.test(module, ckpt_path=c, verbose=False)[0]["test_loss"] for c in ("last", "best"))


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_test_from_last_and_best_checkpoints_equals_one_process(arch, tp, tmp_path):
    # the Llama's validation loss rises in epoch 1, so "best" is epoch 0; Lightning then leaves last.ckpt at epoch 0
    # too (one process the same): the comparison with one process checks what each one loads
    loops = dict(max_steps=-1, max_epochs=2, limit_train_batches=2, limit_val_batches=None, enable_checkpointing=True)
    saving = ModelCheckpoint(dirpath=str(tmp_path / "one"), monitor="val_loss", save_last=True)
    one = _single_trainer(**{**ONE_PROCESS, **loops}, callbacks=[saving])
    expected = _tested_from_checkpoints(Flow(arch, mirrors=dist.get_world_size() // tp), one)
    for state_dict_type in ("sharded", "full"):
        saving = ModelCheckpoint(dirpath=_shared_path(tmp_path, state_dict_type), monitor="val_loss", save_last=True)
        strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp, state_dict_type=state_dict_type)
        trainer = _trainer(strategy=strategy, callbacks=[saving], **loops)
        assert _tested_from_checkpoints(Flow(arch), trainer) == pytest.approx(expected, rel=1e-5)


def _cli_runs(arch: str, root: str):
    """``LightningCLI(Hyper, args=...)`` with the Trainer flags every run here shares."""
    from lightning.pytorch.cli import LightningCLI

    common = [
        "--trainer.accelerator=cpu", f"--trainer.devices={dist.get_world_size()}", "--trainer.max_steps=2",
        "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={root}", f"--model.arch={arch}", "--model.lr=0.1",
    ]  # fmt: skip

    def run(*args: str, run: bool = True):
        return LightningCLI(Hyper, args=[*args, *common], run=run, save_config_callback=None)

    return run


def _reference_test_loss(arch: str, world: int) -> float:
    """One process: SGD on the global batches of ``world`` data-parallel ranks, then the loss on the test data."""
    model = _seeded_model(arch)
    model.load_state_dict(reference_params(2, world=world, arch=arch), strict=False)
    x, y = dataset(16, seed=2).tensors
    with torch.no_grad():
        return loss_fn(model, x, y).item()


@pytest.mark.skipif(find_spec("jsonargparse") is None, reason="LightningCLI needs jsonargparse[signatures]")
@pytest.mark.parametrize(("arch", "tp"), FSDP_ONLY)
@distributed(world_size=2)
def test_lightning_cli_fits_and_tests_with_the_strategy(arch, tp, tmp_path):
    root = _shared_path(tmp_path, "cli")
    cli = _cli_runs(arch, root)
    by_name = cli("fit", "--trainer.strategy=shard_fsdp_tp")
    assert isinstance(by_name.trainer.strategy, strategies.ShardFSDPTPStrategy) and by_name.trainer.global_step == 2
    config = os.path.join(root, "config.yaml")
    if dist.get_rank() == 0:
        with open(config, "w") as f:
            f.write(
                "trainer:\n  strategy:\n    class_path: strategies.ShardFSDPTPStrategy\n    init_args:\n"
                f"      tensor_parallel_size: {tp}\n      sharding_strategy: SHARD_GRAD_OP\n"
                "      state_dict_type: full\n      activation_checkpointing_policy: auto\n"
            )
    dist.barrier()
    fitted = cli("fit", f"--config={config}")
    strategy = fitted.trainer.strategy
    assert strategy._device_mesh.size("tensor_parallel") == tp and strategy.sharding_strategy == "SHARD_GRAD_OP"
    path = os.path.join(root, "fitted.ckpt")
    fitted.trainer.save_checkpoint(path)
    assert os.path.isfile(path)  # state_dict_type: full
    tested = cli("test", f"--config={config}", f"--ckpt_path={path}").trainer.callback_metrics["test_loss"]
    assert tested.item() == pytest.approx(_reference_test_loss(arch, dist.get_world_size() // tp), rel=1e-5)
    with pytest.raises(ValueError, match=r"sharding_strategy='FULL' is not one of"):
        cli("--trainer.strategy=strategies.ShardFSDPTPStrategy", "--trainer.strategy.sharding_strategy=FULL", run=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the 2 devices"):
        cli("--trainer.strategy=strategies.ShardFSDPTPStrategy", "--trainer.strategy.tensor_parallel_size=3", run=False)
    said = io.StringIO()
    with contextlib.redirect_stderr(said), pytest.raises(SystemExit):
        cli("--trainer.strategy=strategies.ShardFSDPTPStrategy", "--trainer.strategy.tensor_paralel_size=2", run=False)
    assert "Option 'tensor_paralel_size' is not accepted" in said.getvalue()
