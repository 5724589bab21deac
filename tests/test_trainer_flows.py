"""Lightning Trainer flows through ``strategy="shard_fsdp_tp"`` (2 gloo ranks: FSDP 2, and TP 2 on a Llama), each
compared with one process running the same LightningModule on the same global batches (Lightning's single-device
strategy), or checked to raise a clear error on every rank:

* ``accumulate_grad_batches=3`` over epochs whose batch count is not a multiple of 3 (Lightning steps on the last,
  partial accumulation, its loss still divided by 3);
* ``limit_train_batches`` as a fraction, ``reload_dataloaders_every_n_epochs``, ``deterministic=True``,
  ``detect_anomaly=True``, ``overfit_batches``, ``max_time`` (every rank stops at the same step);
* ``trainer.predict``: each rank's predictions, by the sample indices Lightning reports, equal one process's,
  with a last batch smaller than the others; a dataset that gives the data-parallel ranks different numbers of
  batches (Lightning's predict sampler does not pad) raised a gloo collective mismatch in the extra batch's
  FSDP all-gather (a hang under NCCL), and now raises a ``RuntimeError`` on every rank before the first batch;
  the same for validation with a user's unequal per-rank data;
* ``Tuner.lr_find`` (the model restored afterwards, the suggestion equal to one process's under TP) and
  ``Tuner.scale_batch_size`` / ``BatchSizeFinder`` (Lightning refuses distributed strategies);
* an EMA kept by ``torch.optim.swa_utils.AveragedModel`` built in ``__init__`` (sharded like the model), and the
  clear error for one built from the sharded model;
* user forward and full backward hooks on the FSDP units (registered before and after sharding) and
  ``parametrizations.weight_norm`` on a Linear inside a unit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import strategies
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path
from tests.test_trainer_features import _EpochBatches, _full, _single_trainer, _worst

CASES = [("gpt", 1), ("llama", 2)]  # FSDP 2; TP 2 (one data-parallel rank)
ONE_PROCESS = dict(limit_val_batches=0, num_sanity_val_steps=0)


def _strategy(tp: int):
    return strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp)


class Flow(LitGPT):
    """``mirrors=None``: the distributed run; ``mirrors=world``: one process on that run's global batches.
    Records (epoch, batch) at each optimizer step; optimizes ``self.model`` only (an EMA copy is no parameter)."""

    def __init__(self, arch: str = "gpt", mirrors: int | None = None) -> None:
        super().__init__(arch=arch)
        self.mirrors = mirrors
        self.batches = _EpochBatches(mirrors) if mirrors else None
        self.steps_seen: list[tuple[int, int]] = []

    def train_dataloader(self):
        return DataLoader(dataset(), batch_sampler=self.batches) if self.mirrors else super().train_dataloader()

    def on_train_epoch_start(self):
        if self.batches is not None:
            self.batches.epoch = self.current_epoch

    def on_before_optimizer_step(self, optimizer):
        self.steps_seen.append((self.current_epoch, self.trainer.fit_loop.epoch_loop.batch_progress.current.ready))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)


def _fit_both(arch: str, tp: int, module=Flow, **loops) -> tuple[Flow, Flow]:
    ours = module(arch)
    _trainer(strategy=_strategy(tp), **loops).fit(ours)
    ref = module(arch, mirrors=dist.get_world_size() // tp)
    _single_trainer(**ONE_PROCESS, **loops).fit(ref)
    assert ours.steps_seen == ref.steps_seen and ours.steps_seen
    assert _worst(_full(ours), _full(ref)) < 1e-5
    return ours, ref


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_accumulation_with_a_partial_last_accumulation(arch, tp):
    ours, _ = _fit_both(arch, tp, max_steps=-1, max_epochs=2, limit_train_batches=5, accumulate_grad_batches=3)
    assert ours.steps_seen == [(0, 3), (0, 5), (1, 3), (1, 5)]  # the 5th batch steps on a partial accumulation


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_loop_flags_train_like_one_process(arch, tp):
    for flags in [
        dict(limit_train_batches=0.25, reload_dataloaders_every_n_epochs=1),
        dict(limit_train_batches=0.125, deterministic=True, detect_anomaly=True),
    ]:
        try:
            _fit_both(arch, tp, max_steps=-1, max_epochs=2, **flags)
        finally:
            torch.use_deterministic_algorithms(False)  # the worker process runs other tests next


class _Unshuffled:
    """The global batches of ``overfit_batches=k``: Lightning turns shuffling off, DistributedSampler deals the
    samples round-robin, each rank takes its first ``k`` batches of 4."""

    def __init__(self, world: int, k: int) -> None:
        self.world, self.k = world, k

    def __iter__(self):
        per_rank = [list(range(64))[r :: self.world] for r in range(self.world)]
        return iter([[i for r in range(self.world) for i in per_rank[r][4 * b : 4 * b + 4]] for b in range(self.k)])

    def __len__(self) -> int:
        return self.k


@distributed(world_size=2)
def test_overfit_batches_and_max_time():
    ours = Flow()
    _trainer(max_steps=-1, max_epochs=3, overfit_batches=2).fit(ours)
    ref = Flow()
    ref.train_dataloader = lambda: DataLoader(dataset(), batch_sampler=_Unshuffled(2, 2))
    _single_trainer(max_steps=-1, max_epochs=3, **ONE_PROCESS).fit(ref)
    assert len(ours.steps_seen) == len(ref.steps_seen) == 6
    assert _worst(_full(ours), _full(ref)) < 1e-5
    # max_time: rank 0's clock decides for all (Timer broadcasts it), so every rank stops after the same step
    trainer = _trainer(max_steps=-1, max_epochs=1000, max_time={"seconds": 2})
    trainer.fit(Flow())
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, trainer.global_step)
    assert len(set(steps)) == 1 and 0 < steps[0] < 1000 * 8


class Predicting(LitGPT):
    """Predicts the logits of ``n`` samples in batches of 4; records the sample indices of each batch."""

    def __init__(self, arch: str, n: int) -> None:
        super().__init__(arch=arch)
        self.n = n

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def predict_dataloader(self):
        return DataLoader(dataset(self.n, seed=2), batch_size=4)


def _indices_writer():
    from lightning.pytorch.callbacks import BasePredictionWriter

    class Indices(BasePredictionWriter):
        def __init__(self) -> None:
            super().__init__("batch")
            self.indices: list[list[int]] = []

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, *args):
            self.indices.append(list(batch_indices))

    return Indices()


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_predict_equals_one_process(arch, tp):
    writer = _indices_writer()
    predictions = _trainer(strategy=_strategy(tp), callbacks=[writer]).predict(Predicting(arch, n=18))
    dp, dp_rank = dist.get_world_size() // tp, dist.get_rank() // tp
    # Lightning's unpadded predict sampler: 18 samples -> 9 per data-parallel rank -> batches of 4, 4, 1
    assert [i for batch in writer.indices for i in batch] == list(range(18))[dp_rank::dp]
    assert [len(p) for p in predictions] == [len(b) for b in writer.indices] and len(writer.indices[-1]) < 4
    ref, x = _seeded_model(arch), dataset(18, seed=2).tensors[0]
    with torch.no_grad():
        for prediction, indices in zip(predictions, writer.indices):
            assert type(prediction) is torch.Tensor  # not a DTensor
            assert (prediction - ref(x[indices])).abs().max() < 1e-5


@distributed(world_size=2)
def test_unequal_batch_counts_per_rank_raise_on_every_rank():
    # 17 samples: 9 and 8 per rank -> 3 and 2 batches; the third batch's all-gather would have no partner
    with pytest.raises(RuntimeError, match=r"predict dataloader\(s\) \[0\] give the ranks different numbers of "
                       r"batches \(rank 0: \[3\], rank 1: \[2\]\).*multiple of 2 x the batch size"):  # fmt: skip
        _trainer().predict(Predicting("gpt", n=17))

    class OwnData(LitGPT):  # per-rank validation data of the user's own, one rank with a batch more
        def val_dataloader(self):
            return DataLoader(dataset(12 - 4 * dist.get_rank(), seed=2), batch_size=4)

    trainer = _trainer(use_distributed_sampler=False, max_steps=1, limit_val_batches=None, num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match=r"validation dataloader\(s\) \[0\].*rank 0: \[3\], rank 1: \[2\]"):
        trainer.validate(OwnData())


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_lr_find_restores_the_model_and_batch_size_scaling_is_refused(arch, tp, tmp_path):
    from lightning.pytorch.callbacks import BatchSizeFinder
    from lightning.pytorch.tuner import Tuner

    root = _shared_path(tmp_path, "tune")
    with pytest.raises(ValueError, match="Tuning the batch size is currently not supported with distributed"):
        Tuner(_trainer(strategy=_strategy(tp), default_root_dir=root)).scale_batch_size(Flow(arch), max_trials=2)
    with pytest.raises(Exception, match="Batch size finder is not supported with distributed strategies"):
        _trainer(strategy=_strategy(tp), callbacks=[BatchSizeFinder()], default_root_dir=root).fit(Flow(arch))

    find = dict(num_training=20, min_lr=1e-4, max_lr=1.0)
    ours, trainer = Flow(arch), _trainer(strategy=_strategy(tp), max_steps=3, default_root_dir=root)
    found = Tuner(trainer).lr_find(ours, **find)
    assert ours.lr != 0.1  # the suggestion was applied
    trainer.fit(ours)
    world = dist.get_world_size() // tp
    if tp > 1:  # one data-parallel rank: the same losses, the same suggestion as one process
        expected = Tuner(_single_trainer(**ONE_PROCESS)).lr_find(Flow(arch, mirrors=world), **find)
        assert found.results["loss"] == pytest.approx(expected.results["loss"], rel=1e-5)
        assert ours.lr == expected.suggestion()
    # (under FSDP the suggestion follows rank 0's own loss, as under DDP.) The fit starts from the restored model:
    ref = Flow(arch, mirrors=world)
    ref.lr = ours.lr
    _single_trainer(max_steps=3, **ONE_PROCESS).fit(ref)
    assert _worst(_full(ours), _full(ref)) < 1e-5


class Averaged(Flow):
    """An exponential moving average of the weights, ``AveragedModel`` built in ``__init__``: a submodule the
    strategy shards like the model, updated shard by shard."""

    def __init__(self, arch: str = "gpt", mirrors: int | None = None) -> None:
        super().__init__(arch, mirrors)
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.5))

    def on_train_batch_end(self, *args):
        self.ema.update_parameters(self.model)


class _Holder:
    def __init__(self, model) -> None:
        self.model = model


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_ema_with_averaged_model_equals_one_process(arch, tp):
    ours, ref = _fit_both(arch, tp, module=Averaged, max_steps=3)
    assert int(ours.ema.n_averaged) == 3
    assert _worst(_full(_Holder(ours.ema.module)), _full(_Holder(ref.ema.module))) < 1e-5
    assert _worst(_full(_Holder(ours.ema.module)), _full(ours)) > 1e-4  # an average, not a copy

    class LateCopy(Flow):
        def on_fit_start(self):
            from torch.optim.swa_utils import AveragedModel

            AveragedModel(self.model)  # deep-copies the sharded model

    with pytest.raises(TypeError, match="is sharded by fully_shard and cannot be deep-copied"):
        _trainer(strategy=_strategy(tp), max_steps=1).fit(LateCopy(arch))


def _blocks(model):
    return list(model.blocks) if hasattr(model, "blocks") else list(model.layers)


def _up(block):
    return block.up if hasattr(block, "up") else block.feed_forward.up_proj


class Hooked(Flow):
    """On each block (an FSDP unit): a forward hook scaling its output, a full backward hook halving its input
    gradient, a forward hook reading a weight's sum; ``weight_norm`` on a Linear inside the block. ``late``: the
    hooks are registered after sharding."""

    def __init__(self, arch: str = "gpt", mirrors: int | None = None, late: bool = False) -> None:
        super().__init__(arch, mirrors)
        from torch.nn.utils import parametrizations

        for block in _blocks(self.model):
            parametrizations.weight_norm(_up(block))
        self.late = late
        self.sums: list[float] = []
        if not late:
            self._hook()

    def _hook(self) -> None:
        for block in _blocks(self.model):
            block.register_forward_hook(lambda m, args, out: out * 0.9)
            block.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
            block.register_forward_hook(self._read)

    def _read(self, module, args, out) -> None:
        w = _up(module).weight.detach()
        self.sums.append(float((w.full_tensor() if hasattr(w, "full_tensor") else w).sum()))

    def on_fit_start(self):
        if self.late:
            self._hook()


@pytest.mark.parametrize(("arch", "tp", "late"), [("gpt", 1, False), ("gpt", 1, True), ("llama", 2, False)])
@distributed(world_size=2)
def test_hooks_on_fsdp_units_and_weight_norm(arch, tp, late):
    ours = Hooked(arch, late=late)
    _trainer(strategy=_strategy(tp), max_steps=3).fit(ours)
    ref = Hooked(arch, mirrors=dist.get_world_size() // tp, late=late)
    _single_trainer(max_steps=3, **ONE_PROCESS).fit(ref)
    assert ours.sums == pytest.approx(ref.sums, abs=1e-5) and len(ours.sums) == 3 * len(_blocks(ref.model))
    assert _worst(_full(ours), _full(ref)) < 1e-5
