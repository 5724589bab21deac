"""Data pipelines and loops through ``Trainer(strategy="shard_fsdp_tp")`` (FSDP 2 on TinyGPT, TP 2 on a Llama),
each compared with one process on the same global batches: every rank records the batches its
``training_step`` received, the ranks exchange them, and one process replays them step by step (the mean over
the data-parallel ranks of each rank's loss, as FSDP averages their gradients). The replay is the oracle for
what the distributed run should have done with the data it was given, whatever sampler, dataset or loader
produced it; the TP ranks of a group must have recorded the same batches, and the step counts are asserted.

* iterable datasets split by the data-parallel rank (``strategy.distributed_sampler_kwargs``); split by the
  global rank under TP they raise ``TPInputMismatchError`` (as do a user ``DistributedSampler`` and a DataModule
  splitting by ``trainer.global_rank``); a length-bucketing batch sampler with per-rank padding;
* unequal per-rank batch counts raise on every rank, one batch ahead, in training (sized and length-less data)
  and in evaluation/predict with length-less dataloaders (before: a hang), and train as usual when
  ``limit_train_batches`` or ``max_steps`` stop the ranks together;
* uneven dataset lengths (DistributedSampler padding, a smaller last batch, ``drop_last``), fractional
  ``limit_train_batches``, ``reload_dataloaders_every_n_epochs`` with a new dataset per epoch, and an int
  ``val_check_interval`` with ``check_val_every_n_epoch=None`` (validation losses compared too);
* ``CombinedLoader`` (``max_size_cycle`` as a plain dict, ``min_size``, ``max_size``; ``sequential`` is refused
  by Lightning in training), several validation loaders with ``dataloader_idx`` and ``add_dataloader_idx``;
* dict, dataclass, namedtuple and ``BatchEncoding`` batches through the three transfer hooks; a
  ``training_step(self, dataloader_iter)`` (before: under TP its batches were never checked);
* torchmetrics metrics count each sample once under TP (before: over the world, each TP copy counted) and stay
  deep-copyable (``MetricTracker``) and picklable.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import NamedTuple

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

import strategies
from lightning_shard import comm
from lightning_shard.tp.input_check import TPInputMismatchError
from tests.fsdp_models import VOCAB
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset
from tests.test_strategy import _trainer
from tests.test_trainer_features import _full, _single_trainer, _worst

CASES = [("gpt", 1), ("llama", 2)]  # FSDP 2; TP 2 (one data-parallel rank)
FSDP_DEFAULT = [("gpt", 1), pytest.param("llama", 2, marks=pytest.mark.slow)]  # the TP case of a long test: slow
TP_DEFAULT = [pytest.param("gpt", 1, marks=pytest.mark.slow), ("llama", 2)]  # the FSDP case of a long test: slow
ALL_SLOW = [pytest.param(*case, marks=pytest.mark.slow) for case in CASES]  # loop features other tests cover too
LR = 0.1


def _strategy(tp: int):
    return strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp)


def _loss(model, x, y):
    """Mean token cross-entropy; ``-100`` targets (padding) are ignored."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1), ignore_index=-100)


class Recorder(LitGPT):
    """Trains on the ``(x, y)`` pairs :meth:`pairs` finds in each batch (the sum of their losses) and records
    them, for :func:`_replay`."""

    def __init__(self, arch: str = "gpt") -> None:
        super().__init__(arch=arch, lr=LR)
        self.seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def pairs(self, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(batch)]

    def training_step(self, batch, batch_idx):
        pairs = self.pairs(batch)
        self.seen.append([(x.clone(), y.clone()) for x, y in pairs])
        loss = sum(_loss(self.model, x, y) for x, y in pairs)
        self.log("train_loss", loss, sync_dist=True)
        return loss


def _replay(ours: Recorder, tol: float, after_step=None) -> int:
    """Train one process on the batches every data-parallel rank recorded (the TP ranks of a group must have
    recorded the same); assert its parameters equal ``ours``'. Returns the number of steps. ``after_step(k,
    model)`` is called after the ``k``-th step (from 1)."""
    kw = ours.trainer.strategy.distributed_sampler_kwargs
    everyone = comm.all_gather_objects((kw["rank"], ours.seen))
    by_dp: dict[int, list] = {}
    for dp_rank, seen in everyone:
        if dp_rank in by_dp:  # a TP copy: the same batches as its group's first rank
            assert _flat(seen) == _flat(by_dp[dp_rank])
        by_dp.setdefault(dp_rank, seen)
    assert len(by_dp) == kw["num_replicas"] and len({len(s) for s in by_dp.values()}) == 1
    model = _seeded_model(ours.arch)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    steps = len(by_dp[0])
    for k in range(steps):
        opt.zero_grad()
        loss = sum(sum(_loss(model, x, y) for x, y in by_dp[r][k]) for r in by_dp) / len(by_dp)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(k + 1, model)
    assert _worst(_full(ours), {n: p.detach() for n, p in model.named_parameters()}) < tol
    return steps


def _flat(seen: list) -> list[list[int]]:
    return [t.flatten().tolist() for step in seen for pair in step for t in pair]


def _tol(tp: int) -> float:
    return 1e-5 if tp == 1 else 5e-5


# ---------------------------------------------------------------------------------------------- iterable datasets
class Stream(IterableDataset):
    """``n`` samples of ``dataset(n)``, every ``num_replicas``-th from ``rank`` (a user's own split)."""

    def __init__(self, n: int, rank: int, num_replicas: int) -> None:
        self.data, self.rank, self.num_replicas = dataset(n), rank, num_replicas

    def __iter__(self):
        for i in range(self.rank, len(self.data), self.num_replicas):
            yield self.data[i]


class StreamByDataParallelRank(Recorder):
    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        return DataLoader(Stream(32, kw["rank"], kw["num_replicas"]), batch_size=4)


class StreamByGlobalRank(Recorder):
    def train_dataloader(self):
        return DataLoader(Stream(32, self.trainer.global_rank, self.trainer.world_size), batch_size=4)


# slow: test_dataloader_iter_step_under_tp streams the same dataset split by the data-parallel rank under TP, and
# raises on the split by the global rank
@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp"), TP_DEFAULT)
@distributed(world_size=2)
def test_iterable_dataset_split_by_the_data_parallel_rank(arch, tp):
    ours = StreamByDataParallelRank(arch)
    _trainer(strategy=_strategy(tp), max_steps=-1, max_epochs=2).fit(ours)
    assert _replay(ours, _tol(tp)) == 2 * 32 // (4 * (2 // tp))
    if tp > 1:  # split by the global rank, the two ranks of the TP group would train on different samples
        with pytest.raises(TPInputMismatchError, match="different training batches"):
            _trainer(strategy=_strategy(tp), max_steps=2).fit(StreamByGlobalRank(arch))


class StreamFetchedInTheStep(StreamByDataParallelRank):
    """``training_step(self, dataloader_iter)``: the step fetches its batch itself."""

    def __init__(self, arch: str, by_global_rank: bool = False) -> None:
        super().__init__(arch)
        self.by_global_rank = by_global_rank

    def train_dataloader(self):
        if self.by_global_rank:
            return DataLoader(Stream(32, self.trainer.global_rank, self.trainer.world_size), batch_size=4)
        return super().train_dataloader()

    def training_step(self, dataloader_iter):
        x, y = next(dataloader_iter)[0]
        self.seen.append([(x.clone(), y.clone())])
        return _loss(self.model, x, y)


@distributed(world_size=2)
def test_dataloader_iter_step_under_tp():
    ours = StreamFetchedInTheStep("llama")
    _trainer(strategy=_strategy(2), max_steps=-1, max_epochs=1).fit(ours)
    assert _replay(ours, 5e-5) == 8
    # before: the strategy saw only the iterator, checked no tensor, and the TP ranks trained on different samples
    with pytest.raises(
        TPInputMismatchError, match=r"different training batches \(batch_idx 0, fetched from dataloader_iter"
    ):
        _trainer(strategy=_strategy(2), max_steps=3).fit(StreamFetchedInTheStep("llama", by_global_rank=True))


class Unequal(Recorder):
    """Rank 0 gets 18 samples (5 batches of 4), rank 1 14 (4 batches): streamed (no length) or as a sized
    dataset with ``use_distributed_sampler=False``."""

    def __init__(self, sized: bool) -> None:
        super().__init__()
        self.sized = sized

    def train_dataloader(self):
        n = 18 - 4 * self.trainer.global_rank
        return DataLoader(dataset(n) if self.sized else Stream(n, 0, 1), batch_size=4)


@distributed(world_size=2, timeout=120)
def test_unequal_training_batch_counts_raise_on_every_rank():
    for sized in (False, True):  # before the check: a hang in rank 0's fifth forward (its all-gather)
        trainer = _trainer(use_distributed_sampler=False, max_steps=-1, max_epochs=2)
        with pytest.raises(RuntimeError, match=r"batch 3 of epoch 0 is the last for ranks \[1\] but ranks \[0\]"):
            trainer.fit(Unequal(sized))
    # the same data stopped early by a limit or by max_steps trains as usual
    for limits in (dict(limit_train_batches=4, max_epochs=2, max_steps=-1), dict(max_steps=3)):
        ours = Unequal(sized=False)
        _trainer(use_distributed_sampler=False, **limits).fit(ours)
        assert _replay(ours, 1e-5) == (8 if "max_epochs" in limits else 3)


class StreamedEval(LitGPT):
    """Length-less validation and predict streams: 12 samples on rank 0 (3 batches), 8 on rank 1 (2), or 8 on
    both; then a second validation stream of 8 on both."""

    def __init__(self, equal: bool, second: bool = False) -> None:
        super().__init__()
        self.equal, self.second = equal, second

    def val_dataloader(self):
        n = 8 if self.equal else 12 - 4 * self.trainer.global_rank
        first = DataLoader(Stream(n, 0, 1), batch_size=4)
        return [first, DataLoader(Stream(8, 0, 1), batch_size=4)] if self.second else first

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", _loss(self.model, *batch), sync_dist=True)

    def predict_dataloader(self):
        return self.val_dataloader()


@distributed(world_size=2, timeout=120)
def test_unequal_lengthless_evaluation_raises_on_every_rank():
    # before: Lightning counts no batches in a length-less loader, so the ranks started; rank 0's third forward hung
    for second in (False, True):  # alone; first of two dataloaders (rank 1 moves on to the second, rank 0 does not)
        match = r"validation dataloader\(s\) give the ranks different numbers of batches \(rank 0: dataloader 0 batch 1"
        with pytest.raises(RuntimeError, match=match + r", rank 1: dataloader 0 batch 1 \(its last\)\)"):
            _trainer(limit_val_batches=None).validate(StreamedEval(equal=False, second=second))
    with pytest.raises(RuntimeError, match=r"predict dataloader\(s\) give the ranks different numbers of batches"):
        _trainer().predict(StreamedEval(equal=False))
    logged = _trainer(limit_val_batches=None).validate(StreamedEval(equal=True, second=True))
    model = _seeded_model()
    with torch.no_grad():
        expected = _loss(model, *dataset(8).tensors).item()  # both ranks stream the same 8 samples
    assert all(abs(m[f"val_loss/dataloader_idx_{i}"] - expected) < 1e-5 for i, m in enumerate(logged))


# ---------------------------------------------------------------------------------------------- samplers
class OwnSampler(Recorder):
    """``use_distributed_sampler=False`` and a ``DistributedSampler`` of the user's: by the data-parallel rank
    (``by="dp"``) or by the global rank (``by="global"``)."""

    def __init__(self, arch: str, by: str) -> None:
        super().__init__(arch)
        self.by = by

    def train_dataloader(self):
        if self.by == "dp":
            kw = self.trainer.strategy.distributed_sampler_kwargs
        else:
            kw = dict(num_replicas=self.trainer.world_size, rank=self.trainer.global_rank)
        data = dataset(24)
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=3, **kw))


@pytest.mark.parametrize(("arch", "tp"), FSDP_DEFAULT)
@distributed(world_size=2)
def test_own_distributed_sampler(arch, tp):
    ours = OwnSampler(arch, "dp")
    _trainer(strategy=_strategy(tp), use_distributed_sampler=False, max_steps=-1, max_epochs=1).fit(ours)
    assert _replay(ours, _tol(tp)) == 24 // (4 * (2 // tp))
    if tp > 1:
        with pytest.raises(TPInputMismatchError, match="different training batches"):
            _trainer(strategy=_strategy(tp), use_distributed_sampler=False, max_steps=2).fit(OwnSampler(arch, "global"))


def _variable_lengths(n: int = 24, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return [(torch.randint(0, VOCAB, (t,), generator=g), torch.randint(0, VOCAB, (t,), generator=g)) for t in lengths]


def _pad(samples):
    """Pads to the batch's longest sample rounded up to an even length (sequence parallelism under TP 2 splits
    the sequence in two): ids with 0, targets with -100 (ignored by the loss)."""
    longest = -(-max(len(x) for x, _ in samples) // 2) * 2
    x = torch.zeros(len(samples), longest, dtype=torch.long)
    y = torch.full((len(samples), longest), -100, dtype=torch.long)
    for i, (a, b) in enumerate(samples):
        x[i, : len(a)], y[i, : len(b)] = a, b
    return x, y


class Buckets:
    """A batch sampler grouping samples of similar length: sorted by length, cut into batches of 4, the batches
    dealt round-robin over ``num_replicas`` ranks (shuffled by ``seed + epoch``)."""

    def __init__(self, lengths: list[int], rank: int, num_replicas: int, seed: int = 0) -> None:
        self.lengths, self.rank, self.num_replicas, self.seed, self.epoch = lengths, rank, num_replicas, seed, 0

    def _batches(self) -> list[list[int]]:
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))
        batches = [order[i : i + 4] for i in range(0, len(order), 4)]
        perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return [batches[p] for p in perm][self.rank :: self.num_replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


class Bucketed(Recorder):
    def train_dataloader(self):
        data = _variable_lengths()
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = Buckets([len(x) for x, _ in data], kw["rank"], kw["num_replicas"])
        return DataLoader(data, batch_sampler=sampler, collate_fn=_pad)


@pytest.mark.parametrize(("arch", "tp"), FSDP_DEFAULT)
@distributed(world_size=2)
def test_length_bucketing_batch_sampler(arch, tp):
    ours = Bucketed(arch)
    _trainer(strategy=_strategy(tp), use_distributed_sampler=False, max_steps=-1, max_epochs=1).fit(ours)
    shapes = comm.all_gather_objects([s[0][0].shape for s in ours.seen])
    if tp == 1:
        assert any(a != b for a, b in zip(*shapes))  # the ranks padded to different lengths in some step
    _replay(ours, _tol(tp))


# ---------------------------------------------------------------------------------------------- loop lengths
class Uneven(Recorder):
    """30 samples (Lightning's DistributedSampler pads them to 32 over 2 data-parallel ranks), batches of 4 with
    a smaller last batch, or without it (``drop_last``); with ``reload``, another dataset at every epoch.
    Records the validation losses it logs, with the global step at which validation ran."""

    def __init__(self, arch: str, drop_last: bool = False, reload: bool = False) -> None:
        super().__init__(arch)
        self.drop_last, self.reload = drop_last, reload
        self.val_losses: list[tuple[int, float]] = []

    def train_dataloader(self):
        epoch = self.current_epoch if self.reload else 0
        return DataLoader(dataset(30 - 4 * epoch, seed=1 + epoch), batch_size=4, shuffle=True, drop_last=self.drop_last)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", _loss(self.model, x, y), sync_dist=True)

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.val_losses.append((self.global_step, self.trainer.callback_metrics["val_loss"].item()))


def _val_loss_at(steps: list[int], out: list[tuple[int, float]]):
    """An ``after_step`` for :func:`_replay`: appends ``(step, validation loss)`` after each step in ``steps``."""
    x, y = dataset(16, seed=2).tensors

    def after_step(k: int, model) -> None:
        if k in steps:
            with torch.no_grad():
                out.append((k, _loss(model, x, y).item()))

    return after_step


@pytest.mark.parametrize(("arch", "tp"), ALL_SLOW)
@distributed(world_size=2)
def test_uneven_lengths_and_loop_intervals(arch, tp):
    dp = 2 // tp
    for flags, drop_last, reload, steps in [
        # 30 samples -> 15 per rank (padded) -> 4 batches, the last of 3 (dp 2); 30 -> 8 batches, the last of 2 (dp 1)
        (dict(max_epochs=2), False, False, 2 * (4 if dp == 2 else 8)),
        (dict(max_epochs=2, limit_train_batches=0.5), True, False, 2 * (1 if dp == 2 else 3)),
        (dict(max_epochs=3, reload_dataloaders_every_n_epochs=1), False, True, None),
        (
            dict(max_steps=7, val_check_interval=3, check_val_every_n_epoch=None, limit_val_batches=None),
            False,
            False,
            7,
        ),
    ]:
        ours = Uneven(arch, drop_last, reload)
        _trainer(strategy=_strategy(tp), max_steps=flags.pop("max_steps", -1), **flags).fit(ours)
        ref_val: list[tuple[int, float]] = []
        done = _replay(ours, _tol(tp), _val_loss_at([3, 6], ref_val))
        assert steps is None or done == steps
        if "val_check_interval" in flags:  # every 3 batches, across the epoch boundary at step 4 (dp 2)
            assert [s for s, _ in ours.val_losses] == [s for s, _ in ref_val] == [3, 6]
            assert max(abs(a[1] - b[1]) for a, b in zip(ours.val_losses, ref_val)) < _tol(tp)


# ---------------------------------------------------------------------------------------------- torchmetrics
class Metrics(LitGPT):
    """Validation metrics of every kind as attributes: a sum (samples seen), a mean, a concatenation, a ratio,
    and a ``MetricCollection``; ``sync=False`` for the one-process reference (whose worker is one rank of a
    process group: a metric would otherwise gather from the other rank's reference)."""

    def __init__(self, arch: str, sync: bool = True) -> None:
        super().__init__(arch=arch)
        import torchmetrics

        kw = dict(sync_on_compute=sync)
        self.seen = torchmetrics.SumMetric(**kw)
        self.mean_loss = torchmetrics.MeanMetric(**kw)
        self.first_targets = torchmetrics.CatMetric(**kw)
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB, average="micro", **kw)
        members = {"max_loss": torchmetrics.MaxMetric(**kw), "loss_sum": torchmetrics.SumMetric(**kw)}
        self.collection = torchmetrics.MetricCollection(members)
        self.own_group = torchmetrics.SumMetric(process_group=dist.group.WORLD, **kw)  # the user's choice: kept
        self.tracker = torchmetrics.wrappers.MetricTracker(
            torchmetrics.SumMetric(**kw), maximize=True
        )  # deep-copies its metric

    def on_validation_epoch_start(self):
        self.tracker.increment()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        per_sample = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
        self.seen.update(torch.ones(len(x)))
        self.tracker.update(torch.ones(len(x)))
        self.own_group.update(torch.ones(len(x)))
        self.mean_loss.update(per_sample)
        self.first_targets.update(y[:, 0].float())
        self.acc.update(logits.argmax(-1), y)
        self.collection.update(per_sample)  # both members take the per-sample losses
        self.log_dict({"seen": self.seen, "mean_loss": self.mean_loss, "acc": self.acc})


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_torchmetrics_count_each_sample_once(arch, tp):
    ours = Metrics(arch)
    logged = _trainer(strategy=_strategy(tp), limit_val_batches=None).validate(ours)[0]
    ref = Metrics(arch, sync=False)
    expected = _single_trainer().validate(ref)[0]
    # before: under TP 2 "seen" logged 32 of 16 samples and first_targets held each value twice
    assert logged["seen"] == expected["seen"] == 16
    assert abs(logged["mean_loss"] - expected["mean_loss"]) < _tol(tp) and abs(logged["acc"] - expected["acc"]) < 1e-6
    assert sorted(ours.first_targets.compute().tolist()) == sorted(ref.first_targets.compute().tolist())
    collection, reference = ours.collection.compute(), ref.collection.compute()
    assert all(abs(collection[k] - reference[k]) < 16 * _tol(tp) for k in ("max_loss", "loss_sum"))
    assert ours.own_group.process_group is dist.group.WORLD and ours.own_group.compute() == 2 * 16 // (2 // tp)
    # a metric stays picklable and deep-copyable (a process group is neither; MetricTracker.increment deep-copies)
    copied = pickle.loads(pickle.dumps(ours.first_targets))  # with its states: each of the 16 values once
    assert ours.tracker.compute() == 16 and len(copied.compute()) == 16


# ---------------------------------------------------------------------------------------------- combined loaders
class Combined(Recorder):
    """Two training loaders of 16 and 24 samples (batches of 4 and 2) in a ``CombinedLoader`` of ``mode``, or
    returned as a plain dict (``mode=None``: Lightning's ``max_size_cycle``)."""

    def __init__(self, arch: str, mode: str | None) -> None:
        super().__init__(arch)
        self.mode = mode

    def train_dataloader(self):
        from lightning.pytorch.utilities import CombinedLoader

        loaders = {"a": DataLoader(dataset(16), batch_size=4), "b": DataLoader(dataset(24, seed=3), batch_size=2)}
        return loaders if self.mode is None else CombinedLoader(loaders, self.mode)

    def pairs(self, batch):
        return [tuple(batch[k]) for k in sorted(batch) if batch[k] is not None]  # max_size: None once one ends


@pytest.mark.parametrize(("arch", "tp"), ALL_SLOW)
@distributed(world_size=2)
def test_combined_loaders_in_training(arch, tp):
    dp = 2 // tp
    for mode, steps in [(None, 12 // dp), ("min_size", 4 // dp), ("max_size", 12 // dp)]:
        ours = Combined(arch, mode)
        _trainer(strategy=_strategy(tp), max_steps=-1, max_epochs=1).fit(ours)
        assert _replay(ours, _tol(tp)) == steps
    with pytest.raises(ValueError, match='does not support the `CombinedLoader\\(mode="sequential"\\)` mode'):
        _trainer(strategy=_strategy(tp), max_steps=2).fit(Combined(arch, "sequential"))


class TwoValSets(LitGPT):
    """Two validation loaders (16 and 8 samples), each loss logged with and without the dataloader index."""

    def val_dataloader(self):
        return [DataLoader(dataset(16, seed=2), batch_size=4), DataLoader(dataset(8, seed=4), batch_size=4)]

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = _loss(self.model, x, y)
        self.log("val_loss", loss, sync_dist=True)
        self.log(f"loss_of_{dataloader_idx}", loss, sync_dist=True, add_dataloader_idx=False)
        self.log("samples", float(len(x)), sync_dist=True, reduce_fx="sum")


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_several_validation_loaders(arch, tp):
    logged = _trainer(strategy=_strategy(tp), limit_val_batches=None).validate(TwoValSets(arch=arch))
    model = _seeded_model(arch)
    with torch.no_grad():
        expected = [_loss(model, *dataset(16, seed=2).tensors).item(), _loss(model, *dataset(8, seed=4).tensors).item()]
    for i, metrics in enumerate(logged):
        assert abs(metrics[f"val_loss/dataloader_idx_{i}"] - expected[i]) < _tol(tp)
        assert abs(metrics[f"loss_of_{i}"] - expected[i]) < _tol(tp)
    # summed over the batches of each loader, each sample once (also under TP: the strategy's reduce)
    assert [logged[i][f"samples/dataloader_idx_{i}"] for i in (0, 1)] == [16, 8]


# ---------------------------------------------------------------------------------------------- batch types and hooks
@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


class PairTuple(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def _collate_as(kind: str):
    """A collate function giving the batch as a dict, a dataclass, a namedtuple or a Hugging Face BatchEncoding."""

    def collate(samples):
        x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
        if kind == "dict":
            return {"input_ids": x, "labels": y}
        if kind == "dataclass":
            return Pair(x, y)
        if kind == "namedtuple":
            return PairTuple(x, y)
        from transformers import BatchEncoding

        return BatchEncoding({"input_ids": x, "labels": y})

    return collate


def _x_y(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, (Pair, PairTuple)):
        return batch.x, batch.y
    return batch["input_ids"], batch["labels"]


class Typed(Recorder):
    """Batches of ``kind`` through all three transfer hooks: ``on_before_batch_transfer`` reverses each sequence,
    ``transfer_batch_to_device`` moves the two tensors itself, ``on_after_batch_transfer`` shifts the targets by
    one token id; ``split`` deals the samples by the global rank instead of the data-parallel rank."""

    def __init__(self, arch: str, kind: str, split: str = "dp") -> None:
        super().__init__(arch)
        self.kind, self.split, self.moved = kind, split, 0

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        if self.split == "global":
            kw = dict(num_replicas=self.trainer.world_size, rank=self.trainer.global_rank)
        data = dataset(32)
        sampler = DistributedSampler(data, shuffle=False, **kw)
        return DataLoader(data, batch_size=4, sampler=sampler, collate_fn=_collate_as(self.kind))

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return _rebuild(batch, *(t.flip(1) for t in _x_y(batch)))

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.moved += 1
        return _rebuild(batch, *(t.to(device) for t in _x_y(batch)))

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = _x_y(batch)
        return _rebuild(batch, x, (y + 1) % VOCAB)

    def pairs(self, batch):
        assert isinstance(batch, (Pair, PairTuple, dict)) or type(batch).__name__ == "BatchEncoding"
        return [_x_y(batch)]


def _rebuild(batch, x: torch.Tensor, y: torch.Tensor):
    """``batch``'s type holding ``x`` and ``y``."""
    if isinstance(batch, (Pair, PairTuple)):
        return type(batch)(x, y)
    return batch.__class__({"input_ids": x, "labels": y})


KINDS = ("dict", "dataclass", "namedtuple", "batch_encoding")


@pytest.mark.parametrize(
    ("arch", "tp", "kinds"),
    [  # every kind under FSDP by default, under TP in the slow run
        ("gpt", 1, KINDS),
        pytest.param("llama", 2, KINDS, marks=pytest.mark.slow),
    ],
)
@distributed(world_size=2)
def test_batch_types_and_transfer_hooks(arch, tp, kinds):
    for kind in kinds:
        ours = Typed(arch, kind)
        _trainer(strategy=_strategy(tp), use_distributed_sampler=False, max_steps=2).fit(ours)
        assert ours.moved == 2
        _replay(ours, _tol(tp))
        kw = ours.trainer.strategy.distributed_sampler_kwargs
        x, y = dataset(32)[list(range(kw["rank"], 32, kw["num_replicas"]))[:4]]
        ((seen_x, seen_y),) = ours.seen[0]  # the first batch went through the three hooks in order
        assert torch.equal(seen_x, x.flip(1)) and torch.equal(seen_y, (y.flip(1) + 1) % VOCAB)
        if tp > 1 and kind in ("dataclass", "batch_encoding"):  # containers searched for the tensors to compare
            with pytest.raises(TPInputMismatchError, match="different training batches"):
                _trainer(strategy=_strategy(tp), use_distributed_sampler=False, max_steps=2).fit(
                    Typed(arch, kind, "global")
                )


# ---------------------------------------------------------------------------------------------- data modules
class ShardingData(L.LightningDataModule):
    """A LightningDataModule whose ``setup(stage)`` keeps its rank's part of the data, chosen by the strategy's
    data-parallel rank (``by="dp"``) or by ``trainer.global_rank`` (``by="global"``)."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.by, self.stages = by, []

    def setup(self, stage: str) -> None:
        kw = self.trainer.strategy.distributed_sampler_kwargs
        if self.by == "global":
            kw = dict(rank=self.trainer.global_rank, num_replicas=self.trainer.world_size)
        self.part = torch.utils.data.Subset(dataset(32), list(range(kw["rank"], 32, kw["num_replicas"])))
        self.stages.append(stage)

    def train_dataloader(self):
        return DataLoader(self.part, batch_size=4)


@pytest.mark.parametrize(("arch", "tp"), FSDP_DEFAULT)
@distributed(world_size=2)
def test_datamodule_setup_shards_by_rank(arch, tp):
    data, ours = ShardingData("dp"), Recorder(arch)
    _trainer(strategy=_strategy(tp), use_distributed_sampler=False, max_steps=-1, max_epochs=1).fit(ours, data)
    assert data.stages == ["fit"] and _replay(ours, _tol(tp)) == 8 // (2 // tp)
    if tp > 1:
        with pytest.raises(TPInputMismatchError, match="different training batches"):
            _trainer(strategy=_strategy(tp), use_distributed_sampler=False, max_steps=2).fit(
                Recorder(arch), ShardingData("global")
            )


# ---------------------------------------------------------------------------------------------- 2 x 2 mesh
@pytest.mark.slow
@distributed(world_size=4)
def test_data_parallel_2_x_tensor_parallel_2():
    """On a (data_parallel 2, tensor_parallel 2) mesh the data-parallel group is neither the world nor one rank:
    an iterable dataset split by the data-parallel rank trains like one process, one split by the global rank
    raises, and torchmetrics count each sample once."""
    ours = StreamByDataParallelRank("llama")
    _trainer(strategy=_strategy(2), max_steps=-1, max_epochs=1).fit(ours)
    assert ours.trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": dist.get_rank() // 2}
    assert _replay(ours, 5e-5) == 4
    with pytest.raises(TPInputMismatchError, match="different training batches"):
        _trainer(strategy=_strategy(2), max_steps=2).fit(StreamByGlobalRank("llama"))
    test_torchmetrics_count_each_sample_once.__wrapped__("llama", 2)
