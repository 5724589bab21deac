"""Data pipelines and loops through ``Trainer(strategy="shard_fsdp_tp")`` (FSDP 2 on TinyGPT, TP 2 on a Llama),
each compared with one process on the same global batches: every rank records the batches its
``training_step`` received, the ranks exchange them, and one process replays them step by step (the mean over
the data-parallel ranks of each rank's loss, as FSDP averages their gradients). The replay is the oracle for
what the distributed run should have done with the data it was given, whatever sampler, dataset or loader
produced it.
"""

from __future__ import annotations

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


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_iterable_dataset_split_by_the_data_parallel_rank(arch, tp):
    ours = StreamByDataParallelRank(arch)
    _trainer(strategy=_strategy(tp), max_steps=-1, max_epochs=2).fit(ours)
    assert _replay(ours, _tol(tp)) == 2 * 32 // (4 * (2 // tp))
    if tp > 1:  # split by the global rank, the two ranks of the TP group would train on different samples
        with pytest.raises(TPInputMismatchError, match="different training batches"):
            _trainer(strategy=_strategy(tp), max_steps=2).fit(StreamByGlobalRank(arch))


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
        data = dataset(40)
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=3, **kw))


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_own_distributed_sampler(arch, tp):
    ours = OwnSampler(arch, "dp")
    _trainer(strategy=_strategy(tp), use_distributed_sampler=False, max_steps=-1, max_epochs=2).fit(ours)
    _replay(ours, _tol(tp))
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


@pytest.mark.parametrize(("arch", "tp"), CASES)
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


@pytest.mark.parametrize(("arch", "tp"), CASES)
@distributed(world_size=2)
def test_uneven_lengths_and_loop_intervals(arch, tp):
    dp = 2 // tp
    for flags, drop_last, reload, steps in [
        # 30 samples -> 15 per rank (padded) -> 4 batches, the last of 3 (dp 2); 30 -> 8 batches, the last of 2 (dp 1)
        (dict(max_epochs=2), False, False, 2 * (4 if dp == 2 else 8)),
        (dict(max_epochs=2, limit_train_batches=0.5), True, False, 2 * (1 if dp == 2 else 3)),
        (dict(max_epochs=3, reload_dataloaders_every_n_epochs=1), False, True, None),
        (dict(max_steps=7, val_check_interval=3, check_val_every_n_epoch=None, limit_val_batches=None), 0, 0, 7),
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

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        per_sample = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
        self.seen.update(torch.ones(len(x)))
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
