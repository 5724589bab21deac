"""pytest plugin: test your own LightningModule under ``shard_fsdp_tp`` on CPU ranks, in CI, without GPUs.

Enable it with ``pytest -p strategies.testing`` (or the ``pytest11`` entry point, which loads it
automatically once the package is installed). The hooks, ``RunIf`` and the fixture live in the top-level
module ``shard_pytest`` (the entry point's target, which imports nothing heavy) and are re-exported here;
this module holds the parity runner. It gives you:

- ``RunIf(...)``: a marker factory built on Lightning's own ``_runif_reasons``, so GPU tests follow
  Lightning's conventions: ``@RunIf(min_cuda_gpus=2, standalone=True)`` skips with Lightning's reason
  text (``Requires: [GPUs>=2 + Standalone execution]``) unless the GPUs are there and
  ``PL_RUN_STANDALONE_TESTS=1``. With ``PL_RUN_STANDALONE_TESTS=1`` only standalone tests are collected
  (each must then run in its own process: ``python -m strategies.testing standalone tests/`` does that),
  and with ``PL_RUN_CUDA_TESTS=1`` only tests marked ``min_cuda_gpus`` are, exactly as Lightning's conftest.
- the ``shard_parity`` fixture: train a module on ``world_size`` CPU ranks (gloo) with the strategy and on
  one device, on the same global batches, and compare every parameter.

Example::

    # test_my_model.py -- run with: pytest -p strategies.testing
    from my_project import MyModule

    def make_module():                     # module level: child processes import it by name
        return MyModule(dropout=0.0)

    def test_sharding_is_exact(shard_parity):
        result = shard_parity(make_module, world_size=2, max_steps=3)
        assert result.max_diff < 1e-5      # already asserted (atol) unless check=False

How the two runs see the same data (see ``run_parity``): Lightning's automatic sampler is turned off
(``use_distributed_sampler=False``; it would shuffle) and every rank gets the module's training dataset
through a rank-interleaved sampler (rank r: indices r, r+N, r+2N, ...). The reference is one process with
``accumulate_grad_batches = N`` (times yours) that sees the same micro-batches in the order (step k,
rank 0), (step k, rank 1), ... With a mean-reduced loss both compute the gradient
``(1/N) * sum_r grad L_r``: data parallelism averages the ranks' gradients, and Lightning divides each
accumulated loss by ``accumulate_grad_batches``. So parameters agree up to float rounding.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Registered as a plugin itself (``-p strategies.testing`` without the entry point, or ``pytest_plugins``),
# this module must carry the hooks too: pytest finds them by name.
from shard_pytest import RunIf, pytest_collection_modifyitems, pytest_configure, shard_parity  # noqa: F401

__all__ = ["RunIf", "ParityResult", "RankInterleavedSampler", "run_parity", "shard_parity"]

_TIMEOUT = float(os.environ.get("SHARD_PARITY_TIMEOUT", "300"))
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------------------------- data
class RankInterleavedSampler:
    """Deterministic, no shuffling: rank ``r`` of ``world_size`` gets indices r, r+N, r+2N, ...

    Every rank gets ``len(dataset) // world_size`` indices (the tail is dropped) so all ranks see equal counts.

    Example: ``DataLoader(ds, batch_size=4, sampler=RankInterleavedSampler(len(ds), rank, 2), drop_last=True)``.
    """

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, (length // world_size) * world_size, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class _DataParallelSampler:
    """``RankInterleavedSampler`` over the data-parallel ranks only (the TP ranks of one group share data).

    The strategy knows the data-parallel rank only once its mesh exists, which is before Lightning first
    asks the loader for its length or an iterator.
    """

    def __init__(self, length: int, strategy, expected_replicas: int) -> None:
        self.length, self.strategy, self.expected = length, strategy, expected_replicas
        self._inner: RankInterleavedSampler | None = None

    def _sampler(self) -> RankInterleavedSampler:
        if self._inner is None:
            kw = self.strategy.distributed_sampler_kwargs
            if kw["num_replicas"] != self.expected:
                raise RuntimeError(
                    f"shard_parity: the strategy has {kw['num_replicas']} data-parallel ranks but the reference was "
                    f"built for {self.expected}; pass integer data_parallel_size/tensor_parallel_size"
                )
            self._inner = RankInterleavedSampler(self.length, kw["rank"], kw["num_replicas"])
        return self._inner

    def __iter__(self) -> Iterator[int]:
        return iter(self._sampler())

    def __len__(self) -> int:
        return len(self._sampler())


def _dp_size(world_size: int, strategy_kwargs: dict) -> int:
    from strategies.strategy import _check_size  # the strategy's reading of "2" / "auto" / 2

    dp = _check_size("data_parallel_size", strategy_kwargs.get("data_parallel_size", "auto"))
    if isinstance(dp, int):
        return dp
    tp = _check_size("tensor_parallel_size", strategy_kwargs.get("tensor_parallel_size", 1))
    return world_size // tp if isinstance(tp, int) and tp >= 1 else world_size  # "auto": FSDP only for now


class _ReferenceOrderSampler:
    """The single-device order: micro-batch j of rank 0, of rank 1, ..., then micro-batch j+1 of rank 0, ..."""

    def __init__(self, length: int, world_size: int, batch_size: int) -> None:
        per_rank = [RankInterleavedSampler(length, r, world_size).indices for r in range(world_size)]
        n_batches = len(per_rank[0]) // batch_size
        self.indices = [
            i
            for j in range(n_batches)
            for r in range(world_size)
            for i in per_rank[r][j * batch_size : (j + 1) * batch_size]
        ]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _rebuild_loader(loader, sampler):
    from torch.utils.data import DataLoader

    if loader.batch_size is None:
        raise ValueError(
            "shard_parity: train_dataloader() must use batch_size=... (a batch_sampler cannot be re-split per rank)"
        )
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=loader.collate_fn,
        num_workers=0,
    )


# --------------------------------------------------------------------------------------------- child side
@dataclass
class _Job:
    factory: Callable
    role: str  # "shard" or "reference"
    rank: int
    world_size: int
    dp_size: int  # data-parallel ranks: the reference accumulates this many micro-batches per step
    port: int
    max_steps: int
    strategy_kwargs: dict
    trainer_kwargs: dict
    seed: int
    out_dir: str


def _full_params(module) -> dict:
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p  # ours and torch's DTensor both have it
        out[name] = t.detach().float().cpu().clone()
    return out


def _child(job: _Job) -> None:
    log = Path(job.out_dir, f"{job.role}{job.rank}.log")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)  # C-level output too, so a crash leaves its trace in the log
    for k in _DIST_ENV:
        os.environ.pop(k, None)
    if job.role == "shard":
        # With these, Lightning sees a torchelastic-style job and starts no processes of its own.
        os.environ.update(
            RANK=str(job.rank), LOCAL_RANK=str(job.rank), WORLD_SIZE=str(job.world_size),
            LOCAL_WORLD_SIZE=str(job.world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port),
        )  # fmt: skip
    try:
        result = _train(job)
        if job.role == "shard":
            _dump(result.pop("losses"), Path(job.out_dir, f"shard_losses{job.rank}.pkl"))
        if job.rank == 0:  # every rank holds the same full parameters
            _dump(result, Path(job.out_dir, f"{job.role}.pt"))
        Path(job.out_dir, f"{job.role}{job.rank}.ok").touch()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        Path(job.out_dir, f"{job.role}{job.rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)


def _dump(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


class _LossRecorder:
    def __init__(self) -> None:
        from lightning.pytorch.callbacks import Callback

        recorder = self

        class _CB(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                if loss is not None:
                    # Lightning hands back the loss divided by accumulate_grad_batches; undo it.
                    recorder.losses.append(float(loss) * trainer.accumulate_grad_batches)

        self.losses: list[float] = []
        self.callback = _CB()


def _train(job: _Job):
    import lightning as L
    import torch

    import strategies

    torch.set_num_threads(1)
    torch.manual_seed(job.seed)
    module = job.factory()
    loader = module.train_dataloader()
    n = len(loader.dataset)
    accumulate = job.trainer_kwargs.get("accumulate_grad_batches", 1)
    kwargs = dict(
        accelerator="cpu",
        max_steps=job.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        deterministic=True,
    )
    kwargs.update(job.trainer_kwargs)
    recorder = _LossRecorder()
    kwargs["callbacks"] = [*list(kwargs.get("callbacks") or []), recorder.callback]
    if job.role == "shard":
        kwargs.update(devices=job.world_size, strategy=strategies.ShardFSDPTPStrategy(**job.strategy_kwargs))
        data = _rebuild_loader(loader, _DataParallelSampler(n, kwargs["strategy"], job.dp_size))
    else:
        kwargs.update(devices=1, strategy="auto", accumulate_grad_batches=accumulate * job.dp_size)
        data = _rebuild_loader(loader, _ReferenceOrderSampler(n, job.dp_size, loader.batch_size))
    trainer = L.Trainer(**kwargs)
    trainer.fit(module, train_dataloaders=data)
    params = _full_params(module)  # a collective for sharded parameters: every rank calls it
    return {"params": params, "losses": recorder.losses, "rank": job.rank, "global_step": trainer.global_step}


# --------------------------------------------------------------------------------------------- parent side
@dataclass
class ParityResult:
    """What ``shard_parity`` measured.

    ``param_diff``: max |sharded - reference| per parameter name (full tensors).
    ``losses`` / ``reference_losses``: the loss of each optimizer step (mean over ranks and micro-batches).
    """

    param_diff: dict[str, float]
    losses: list[float]
    reference_losses: list[float]
    atol: float
    steps: int
    missing: list[str] = field(default_factory=list)

    @property
    def max_diff(self) -> float:
        return max(self.param_diff.values(), default=0.0)

    @property
    def max_loss_diff(self) -> float:
        return max((abs(a - b) for a, b in zip(self.losses, self.reference_losses)), default=0.0)

    def worst(self, k: int = 5) -> list[tuple[str, float]]:
        return sorted(self.param_diff.items(), key=lambda kv: -kv[1])[:k]

    @property
    def ok(self) -> bool:
        return not self.missing and self.max_diff <= self.atol

    def assert_close(self) -> None:
        """Raise an ``AssertionError`` naming the worst parameters if the runs differ by more than ``atol``."""
        if self.missing:
            raise AssertionError(f"shard_parity: parameters present in only one run: {self.missing}")
        if self.max_diff > self.atol:
            bad = sum(d > self.atol for d in self.param_diff.values())
            lines = "\n".join(f"  {name}: {d:.3e}" for name, d in self.worst(8))
            losses = "\n".join(
                f"  step {i}: sharded {a:.6f}  reference {b:.6f}"
                for i, (a, b) in enumerate(zip(self.losses, self.reference_losses))
            )
            raise AssertionError(
                f"shard_parity: {bad} of {len(self.param_diff)} parameters differ from the single-device run by more "
                f"than atol={self.atol:g} after {self.steps} steps (max {self.max_diff:.3e}). Worst:\n{lines}\n"
                f"Losses per step:\n{losses}"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_importable(factory: Callable) -> None:
    qualname = getattr(factory, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"shard_parity: module_factory {qualname!r} must be defined at module level (child processes import it "
            "by name); move it out of the test function"
        )
    try:
        pickle.dumps(factory)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"shard_parity: module_factory {factory!r} cannot be pickled for child processes: {e}") from e


def _tail(path: Path, n: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return text[-n:]


def _step_losses(per_micro: list[float], micro_per_step: int) -> list[float]:
    steps = len(per_micro) // micro_per_step
    return [sum(per_micro[i * micro_per_step : (i + 1) * micro_per_step]) / micro_per_step for i in range(steps)]


def run_parity(
    module_factory: Callable,
    world_size: int = 2,
    max_steps: int = 3,
    strategy_kwargs: dict | None = None,
    trainer_kwargs: dict | None = None,
    atol: float = 1e-5,
    *,
    seed: int = 0,
    timeout: float = _TIMEOUT,
    check: bool = True,
    out_dir: str | None = None,
) -> ParityResult:
    """Train ``module_factory()`` on ``world_size`` gloo ranks under ``ShardFSDPTPStrategy(**strategy_kwargs)``
    and on one device, on the same global batches; compare every parameter (and the losses).

    ``module_factory`` is called after ``torch.manual_seed(seed)`` in every process, and must be a
    module-level function (children import it by name). The module's ``train_dataloader()`` supplies the
    dataset, ``batch_size`` (per rank) and ``collate_fn``; the sampler is replaced (see the module docstring).
    ``trainer_kwargs`` go to both Trainers (e.g. ``precision``, ``gradient_clip_val``,
    ``accumulate_grad_batches``). Raises ``AssertionError`` listing the worst parameters when ``check`` and
    the difference exceeds ``atol``; a failing rank's traceback and output are shown; a run longer than
    ``timeout`` seconds is stopped with a ``TimeoutError``.

    Example: ``run_parity(make_module, world_size=2, max_steps=3, strategy_kwargs={"tensor_parallel_size": 2})``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"shard_parity: world_size={world_size!r} must be a positive int")
    _check_importable(module_factory)
    strategy_kwargs = dict(strategy_kwargs or {})
    trainer_kwargs = dict(trainer_kwargs or {})
    for forbidden in ("devices", "strategy", "max_steps", "use_distributed_sampler", "accelerator"):
        if forbidden in trainer_kwargs:
            raise ValueError(f"shard_parity: trainer_kwargs may not set {forbidden!r}; shard_parity chooses it")
    dp_size = _dp_size(world_size, strategy_kwargs)
    with contextlib.ExitStack() as stack:
        if out_dir is None:
            out_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="shard_parity_"))
        port = _free_port()
        ctx = mp.get_context("spawn")
        common = dict(
            factory=module_factory, world_size=world_size, dp_size=dp_size, max_steps=max_steps,
            strategy_kwargs=strategy_kwargs, trainer_kwargs=trainer_kwargs, seed=seed, out_dir=out_dir,
        )  # fmt: skip
        jobs = [_Job(role="shard", rank=r, port=port, **common) for r in range(world_size)]
        jobs.append(_Job(role="reference", rank=0, port=0, **common))
        procs = [ctx.Process(target=_child, args=(job,), daemon=True) for job in jobs]
        env_backup = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
        os.environ.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")  # N+1 processes share the cores
        try:
            for p in procs:
                p.start()
        finally:
            for k, v in env_backup.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            _wait(procs, jobs, Path(out_dir), timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
        with open(Path(out_dir, "shard.pt"), "rb") as f:
            shard = pickle.load(f)
        with open(Path(out_dir, "reference.pt"), "rb") as f:
            ref = pickle.load(f)
        rank_losses = []
        for r in range(world_size):
            with open(Path(out_dir, f"shard_losses{r}.pkl"), "rb") as f:
                rank_losses.append(pickle.load(f))
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    per_rank_steps = [_step_losses(lo, accumulate) for lo in rank_losses]
    losses = [sum(s[i] for s in per_rank_steps) / world_size for i in range(min(map(len, per_rank_steps)))]
    reference_losses = _step_losses(ref["losses"], accumulate * dp_size)
    names = sorted(set(shard["params"]) | set(ref["params"]))
    missing = [n for n in names if n not in shard["params"] or n not in ref["params"]]
    diff = {}
    for n in names:
        if n in missing:
            continue
        a, b = shard["params"][n], ref["params"][n]
        diff[n] = math.inf if a.shape != b.shape else (a - b).abs().max().item() if a.numel() else 0.0
    result = ParityResult(diff, losses, reference_losses, atol, shard["global_step"], missing)
    if check:
        result.assert_close()
    return result


def _wait(procs, jobs, out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    first_failure = None
    while True:
        done = [Path(out, f"{j.role}{j.rank}.ok").exists() for j in jobs]
        errs = [Path(out, f"{j.role}{j.rank}.err") for j in jobs]
        failed = [i for i, e in enumerate(errs) if e.exists()]
        dead = [i for i, p in enumerate(procs) if not p.is_alive() and not done[i] and i not in failed]
        if all(done):
            return
        if (failed or dead) and first_failure is None:
            first_failure = time.monotonic()
        # Once one process failed, the others may be stuck in a collective: a short grace period, then report.
        if first_failure is not None and (
            time.monotonic() - first_failure > 10
            or not any(p.is_alive() for p, j in zip(procs, jobs) if j.role == "shard")
            or any(jobs[k].role == "reference" for k in failed + dead)
        ):
            # The earliest error is the cause; the other ranks typically fail after it (connection reset by peer).
            failed = [i for i, e in enumerate(errs) if e.exists()]
            i = min(failed, key=lambda k: errs[k].stat().st_mtime_ns) if failed else dead[0]
            job = jobs[i]
            also = [f"{jobs[k].role} rank {jobs[k].rank}" for k in failed if k != i]
            who = f"rank {job.rank} of {job.world_size}" if job.role == "shard" else "the single-device reference"
            error = errs[i].read_text() if errs[i].exists() else f"process died with exit code {procs[i].exitcode}"
            then = f" (then also: {also})" if also else ""
            log = _tail(out / f"{job.role}{job.rank}.log")
            raise AssertionError(f"shard_parity: {who} failed{then}:\n{error}\n--- its output (tail) ---\n{log}")
        if time.monotonic() > deadline:
            waiting = [
                f"{j.role} rank {j.rank}" if j.role == "shard" else "reference" for j, d in zip(jobs, done) if not d
            ]
            logs = "\n".join(
                f"--- {j.role}{j.rank} output (tail) ---\n{_tail(out / f'{j.role}{j.rank}.log', 1500)}"
                for j, d in zip(jobs, done)
                if not d
            )
            raise TimeoutError(
                f"shard_parity: no result after {timeout:.0f}s from {waiting} (a collective probably waits for a rank "
                f"that never calls it; raise SHARD_PARITY_TIMEOUT if the machine is just slow)\n{logs}"
            )
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------- standalone runner
def _run_standalone(paths: list[str], extra: list[str]) -> int:
    """Collect the ``standalone=True`` tests and run each in its own pytest process, as Lightning's CI does."""
    env = dict(os.environ, PL_RUN_STANDALONE_TESTS="1")
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "strategies.testing", "--collect-only", "-q", *paths],
        env=env,
        capture_output=True,
        text=True,
    )
    if collect.returncode not in (0, 5):  # 5: nothing collected
        print(collect.stdout[-4000:] + collect.stderr[-4000:])
        return collect.returncode
    ids = [line for line in collect.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    failures = []
    for test_id in ids:
        print(f"=== standalone: {test_id}", flush=True)
        rc = subprocess.run([sys.executable, "-m", "pytest", "-p", "strategies.testing", test_id, *extra], env=env)
        if rc.returncode not in (0, 5):
            failures.append(test_id)
    print(
        f"standalone: {len(ids) - len(failures)} of {len(ids)} passed" + (f"; failed: {failures}" if failures else "")
    )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m strategies.testing standalone [paths] [-- pytest args]``."""
    p = argparse.ArgumentParser(prog="python -m strategies.testing")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("standalone", help="run each RunIf(standalone=True) test in its own process")
    s.add_argument("paths", nargs="*", default=["tests"])
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    return _run_standalone(args.paths, extra)


if __name__ == "__main__":
    sys.exit(main())
