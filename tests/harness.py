"""Run a test body on N ranks of a real gloo process group, reusing worker processes across tests.

Usage::

    from tests.harness import distributed

    @distributed(world_size=2)
    def test_all_reduce():
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        assert t.item() == 1

The decorated test, when pytest calls it, sends (module, name, arguments) to a pool of ``world_size``
worker processes that already joined one gloo process group, and each worker runs the undecorated body.
Pools are kept between tests (starting processes and a process group costs seconds) and torn down when a
test fails or times out, because a rank that raised may leave the others blocked in a collective.

Failures re-raise in pytest with the failing rank's traceback. A test that does not finish within
``timeout`` seconds fails with a message naming the ranks that did not answer, instead of hanging.
``fresh=True`` runs the body in new processes with the torchrun environment variables set but no process
group yet (for code that must initialise it itself, such as ``init_device_mesh`` or the Trainer).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT = float(os.environ.get("LIGHTNING_SHARD_TEST_TIMEOUT", "240"))
_CTX = mp.get_context("spawn")


@dataclass
class _Result:
    rank: int
    ok: bool
    error: str = ""
    output: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",  # with the above, Lightning sees a torchelastic-launched job and spawns nothing
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # Ranks share 2 cores: one intra-op thread each keeps them from thrashing.
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }


def _import_with_assert_rewriting(module: str):
    """Import a test module the way pytest does, so a failing ``assert`` in a worker shows its values."""
    if module in sys.modules or not module.rpartition(".")[2].startswith("test_"):
        return importlib.import_module(module)
    from _pytest.assertion.rewrite import rewrite_asserts

    spec = importlib.util.find_spec(module)
    source = Path(spec.origin).read_bytes()
    tree = ast.parse(source)
    rewrite_asserts(tree, source, Path(spec.origin), None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    exec(compile(tree, spec.origin, "exec"), mod.__dict__)
    return mod


def _resolve(module: str, name: str) -> Callable:
    obj = _import_with_assert_rewriting(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)


@contextlib.contextmanager
def _environment_restored():
    """Undo a test body's changes to ``os.environ`` when it ends, as its own process would: e.g.
    ``seed_everything(3)`` sets ``PL_GLOBAL_SEED``, which seeds the shuffle of every later Trainer's distributed
    sampler in the same worker."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if os.environ != saved:
            os.environ.clear()
            os.environ.update(saved)


def _run_task(rank: int, task: tuple) -> _Result:
    module, name, args, kwargs = task
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), _environment_restored():
            _resolve(module, name)(*args, **kwargs)
        return _Result(rank, True, output=out.getvalue())
    except BaseException:  # noqa: BLE001 - every failure, including pytest's, goes back to the parent
        return _Result(rank, False, traceback.format_exc(), out.getvalue())


def _worker_main(rank: int, world_size: int, port: int, init_pg: bool, tasks, results) -> None:
    os.environ.update(_worker_env(rank, world_size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if init_pg:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        results.put(_run_task(rank, task))
    if init_pg and dist.is_initialized():
        dist.destroy_process_group()


class _Pool:
    """``world_size`` worker processes, each with its own task queue and one shared result queue."""

    def __init__(self, world_size: int, init_pg: bool = True) -> None:
        self.world_size = world_size
        port = _free_port()
        self.results = _CTX.Queue()
        self.tasks = [_CTX.Queue() for _ in range(world_size)]
        self.procs = [
            _CTX.Process(
                target=_worker_main,
                args=(r, world_size, port, init_pg, self.tasks[r], self.results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, task: tuple, timeout: float) -> list[_Result]:
        for q in self.tasks:
            q.put(task)
        results: dict[int, _Result] = {}
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        while len(results) < self.world_size:
            # Once a rank failed, give the others a short grace period: they may be stuck in a collective.
            limit = deadline if first_failure is None else min(deadline, first_failure + 10)
            try:
                r = self.results.get(timeout=max(0.05, min(1.0, limit - time.monotonic())))
                results[r.rank] = r
                if not r.ok and first_failure is None:
                    first_failure = time.monotonic()
            except queue.Empty:
                if time.monotonic() >= limit:
                    break
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive() and i not in results]
                if dead:
                    for i in dead:
                        code = self.procs[i].exitcode
                        results[i] = _Result(i, False, f"rank {i} died with exit code {code}")
                    first_failure = first_failure or time.monotonic()
        return [results.get(r) for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[int, _Pool] = {}


def _pool(world_size: int) -> _Pool:
    if world_size not in _POOLS:
        # Pools of every size stay alive until pytest exits: an idle rank waits on its queue and costs only
        # memory, while restarting a pool (spawn, import torch and Lightning, join a group) costs seconds, and
        # modules mixing 1, 2 and 4 ranks would otherwise restart one at every switch.
        _POOLS[world_size] = _Pool(world_size)
    return _POOLS[world_size]


def shutdown_pools() -> None:
    """Stop every worker pool (called at the end of the pytest session)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_distributed(
    fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, fresh: bool = False, **kwargs
) -> None:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; raise with the failing rank's traceback.

    ``fn`` must be importable by module and qualified name (a module-level function).
    """
    target = getattr(fn, "__wrapped__", fn)
    task = (target.__module__, target.__qualname__, args, kwargs)
    pool = _Pool(world_size, init_pg=False) if fresh else _pool(world_size)
    try:
        results = pool.run(task, timeout)
    except BaseException:
        pool.close(kill=True)
        _POOLS.pop(world_size, None)
        raise
    missing = [r for r, res in enumerate(results) if res is None]
    failed = [res for res in results if res is not None and not res.ok]
    if fresh:
        pool.close(kill=bool(missing or failed))
    elif missing or failed:
        pool.close(kill=True)  # ranks may be blocked in a collective: never reuse them
        _POOLS.pop(world_size, None)
    if failed:
        first = failed[0]
        others = f" (ranks {[f.rank for f in failed]} failed)" if len(failed) > 1 else ""
        output = f"\n--- rank {first.rank} output ---\n{first.output}" if first.output.strip() else ""
        raise AssertionError(f"rank {first.rank} of {world_size} failed{others}:\n{first.error}{output}")
    if missing:
        raise TimeoutError(
            f"{target.__qualname__} did not finish within {timeout:.0f}s on ranks {missing} of {world_size} "
            "(a collective probably waits for a rank that never calls it)"
        )


def distributed(world_size: int = 2, *, timeout: float = DEFAULT_TIMEOUT, fresh: bool = False) -> Callable:
    """Decorator: run the test body on ``world_size`` gloo ranks (see the module docstring)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            run_distributed(fn, world_size, *args, timeout=timeout, fresh=fresh, **kwargs)

        return wrapper

    return decorate
