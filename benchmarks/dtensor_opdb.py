"""DTensor coverage on torch's operator database: our DTensor and torch's, one harness, 2 gloo ranks.

For every OpInfo in ``torch.testing._internal.common_methods_invocations.op_db`` (the data behind torch's
own ``test_dtensor_ops``): float32 forward samples (the first ``--samples``), each run twice per library,
once with every tensor argument ``Replicate()`` and once with every tensor argument of 1 dim or more
``Shard(0)``. Each result (every output, and every tensor argument, so in-place changes count) is gathered
and compared with the plain op on the same sample. Per library an op is

- ``clean``: every run matches and none went through a fallback (ours: ``fallback_counts()``);
- ``fallback``: every run matches, some through our replicate fallback (torch's DTensor has none);
- ``wrong``: some run returned a result that differs (values, shape or dtype) -- the worst outcome;
- ``error``: some run raised (and none was wrong);
- ``skipped``: no sample could be compared (the plain op raises, or the op is random: two plain runs with
  different seeds differ), with the reason.

Run (about 10 minutes on 2 busy CPU cores)::

    python benchmarks/dtensor_opdb.py --out runs/dtensor_opdb.jsonl
    python benchmarks/dtensor_opdb.py --ops squeeze matmul stft     # a few ops, printed per op

or in three parts side by side (each a third of the sorted op names), then one table over the three::

    python benchmarks/dtensor_opdb.py --part 1/3 --out runs/opdb1.jsonl   # and 2/3, 3/3
    python benchmarks/dtensor_opdb.py --report runs/opdb1.jsonl runs/opdb2.jsonl runs/opdb3.jsonl

The table printed at the end is the one in docs/dtensor.md.

``--placements`` picks other placement runs, the layouts of tensor parallelism (see ``PLACEMENTS``): each
sample runs once, with every tensor argument of 2+ dims ``Shard(1)`` (``shard1``), every one of 1+ dims on its
last dim (``shard_last``), only the first on its last dim (``mixed``), the arguments in turn on their last dim
and on dim 0 (``alternate``), or floating arguments as pending sums (``partial``, ``partial_all``,
``partial_avg``); the other arguments ``Replicate()``. With ``--libs ours`` only our DTensor runs::

    python benchmarks/dtensor_opdb.py --libs ours --placements shard1 --part 1/3 --out shard1_1.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lightning_shard

LIBS = ("ours", "torch")
STATUSES = ("clean", "fallback", "wrong", "error", "skipped")
RTOL = ATOL = 1e-4  # float32 sums over shards add in another order than the plain op


# --placements: the placement runs of each sample. "default" is Replicate, then Shard(0) for every tensor
# argument of 1+ dims. The others model tensor parallelism: weights sharded on dim 1 (shard1), activations on
# their last dim (shard_last), one sharded input among replicated weights (mixed: the first tensor argument on
# its last dim, the others Replicate) and different shards meeting in one op (alternate: the tensor arguments
# in turn on their last dim and on dim 0). Odd sizes give uneven shards (torch.chunk's split) on 2 ranks.
# A row-wise layer's output is a pending sum: partial gives the first tensor argument, if floating, as
# Partial("sum") (the others Replicate), partial_all every floating one; partial_avg the first as Partial("avg")
# (a mean over an even shard).
PLACEMENTS = {
    "default": ("replicate", "shard0"),
    "shard1": ("shard1",),
    "shard_last": ("shard_last",),
    "mixed": ("mixed",),
    "alternate": ("alternate",),
    "partial": ("partial",),
    "partial_all": ("partial_all",),
    "partial_avg": ("partial_avg",),
}
_LABELS = {
    "replicate": "Replicate",
    "shard0": "Shard(0)",
    "shard1": "Shard(1)",
    "shard_last": "Shard(last)",
    "mixed": "first Shard(last)",
    "alternate": "Shard(last)/Shard(0) in turn",
    "partial": "first Partial",
    "partial_all": "Partial",
    "partial_avg": "first Partial(avg)",
}


class Wrong(Exception):
    """A DTensor result differs from the plain op's."""


def _libs(mesh_ours, mesh_torch) -> dict:
    import torch.distributed.tensor as tdt

    import lightning_shard.tensor as ls

    return {
        "ours": (mesh_ours, ls.distribute_tensor, ls.Shard, ls.Replicate, ls.DTensor, ls.Partial),
        "torch": (mesh_torch, tdt.distribute_tensor, tdt.Shard, tdt.Replicate, tdt.DTensor, tdt.Partial),
    }


def _shard_dim(mode: str, ndim: int, index: int) -> int | None:
    """The dim a tensor argument of ``ndim`` dims is sharded on in run ``mode`` (None: Replicate). ``index``:
    its position among the tensor arguments (0: the input, where the op has one)."""
    if mode == "shard0":
        return 0 if ndim >= 1 else None
    if mode == "shard1":
        return 1 if ndim >= 2 else None
    if mode == "shard_last":
        return ndim - 1 if ndim >= 1 else None
    if mode == "mixed":
        return ndim - 1 if index == 0 and ndim >= 1 else None
    if mode == "alternate":  # x on its last dim, w on dim 0 ...: a row-wise matmul's operands, a Partial result
        return (ndim - 1 if index % 2 == 0 else 0) if ndim >= 1 else None
    return None  # "replicate"


def _is_partial(mode: str, x: torch.Tensor, index: int) -> bool:
    """Whether run ``mode`` gives the tensor argument at ``index`` as ``Partial("sum")``: floating and complex
    ones only (activations; an integer index tensor is never a pending sum in a real model)."""
    if not (x.is_floating_point() or x.is_complex()):
        return False
    return mode == "partial_all" or (mode in ("partial", "partial_avg") and index == 0)


def _partial_local(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank 0 holds ``2 x``, rank 1 ``-x``, any other zeros: their sum is exactly ``x`` (Sterbenz), and a rule
    that wrongly applies a non-linear op to each addend gives ``f(2x) + f(-x)``, which differs from ``f(x)``
    unless ``f`` is linear (equal addends would hide ``abs``, ``relu``, ``max`` ...)."""
    x = x.detach().clone()
    split = torch.isfinite(2 * x)  # inf - inf is nan: rank 0 holds a non-finite (or overflowing) entry whole
    if rank == 0:
        return torch.where(split, 2 * x, x)
    return torch.where(split, -x, 0) if rank == 1 else torch.zeros_like(x)


def _avg_local(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``Partial("avg")`` terms of ``x``: ``world`` times the sum terms above (exact: a power of two on 2 and 4
    ranks), non-finite entries on every rank."""
    x = x.detach().clone()
    split = torch.isfinite(2 * world * x)
    return torch.where(split, world * _partial_local(x, rank, world), x)


def _distribute(lib, tree, mode: str):
    """Every strided tensor of ``tree`` as a DTensor placed as run ``mode`` says (see ``PLACEMENTS``)."""
    mesh, distribute, Shard, Replicate, dtensor_type, Partial = lib
    seen = [0]

    def conv(x):
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            return x
        index = seen[0]
        seen[0] += 1
        if _is_partial(mode, x, index):
            op, terms = ("avg", _avg_local) if mode == "partial_avg" else ("sum", _partial_local)
            local = terms(x, dist.get_rank(), dist.get_world_size())
            return dtensor_type.from_local(local, mesh, [Partial(op)], run_check=False)
        dim = _shard_dim(mode, x.ndim, index)
        return distribute(x.detach().clone(), mesh, [Replicate() if dim is None else Shard(dim)])

    return pytree.tree_map(conv, tree)


def _gather(lib, tree):
    dtensor_type = lib[4]
    return pytree.tree_map(lambda x: x.full_tensor() if isinstance(x, dtensor_type) else x, tree)


def _compare(got, want, what: str) -> None:
    want = pytree.tree_map(lambda x: x, want)  # the same container types as a mapped result (torch.Size -> tuple)
    gl, gt = pytree.tree_flatten(got)
    wl, wt = pytree.tree_flatten(want)
    if gt != wt:
        raise Wrong(f"{what}: structure {gt} != {wt}")
    for g, w in zip(gl, wl):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                raise Wrong(f"{what}: got {type(g).__name__}, expected a tensor")
            if g.shape != w.shape or g.dtype != w.dtype:
                raise Wrong(f"{what}: shape/dtype {tuple(g.shape)} {g.dtype} != {tuple(w.shape)} {w.dtype}")
            if w.is_complex():
                g, w = torch.view_as_real(g.resolve_conj()), torch.view_as_real(w.resolve_conj())
            if not torch.allclose(g.resolve_neg().double(), w.resolve_neg().double(), RTOL, ATOL, equal_nan=True):
                raise Wrong(f"{what}: values differ (max abs diff {(g.double() - w.double()).abs().max():.3g})")
        elif isinstance(w, float) and isinstance(g, float):
            if not (g == w or abs(g - w) <= ATOL + RTOL * abs(w) or (g != g and w != w)):
                raise Wrong(f"{what}: {g} != {w}")
        elif g != w:
            raise Wrong(f"{what}: {g!r} != {w!r}")


def _plain(op, sample, seed: int):
    """The plain op's outputs and (possibly mutated) arguments, on copies of the sample."""
    torch.manual_seed(seed)
    args = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (sample.input, sample.args))
    kwargs = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, sample.kwargs)
    out = op(args[0], *args[1], **kwargs)
    return out, (args, kwargs)


def _samples(opinfo, n: int):
    torch.manual_seed(0)  # every rank draws the same samples
    out = []
    for s in opinfo.sample_inputs("cpu", torch.float32, requires_grad=False):
        out.append(s)
        if len(out) == n:
            break
    return out


# Ops whose outputs are uninitialised memory: nothing to compare.
_UNINITIALISED = ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided")


def _prepare(opinfo, n_samples: int):
    """(usable samples with the plain results, or the reason there are none)."""
    if opinfo.name in _UNINITIALISED:
        return [], "uninitialised memory"
    op = opinfo.op
    try:
        samples = _samples(opinfo, n_samples)
    except Exception as e:  # noqa: BLE001 -- an OpInfo that cannot build samples here
        return [], f"samples: {type(e).__name__}"
    usable, reason = [], "no samples"
    for s in samples:
        try:
            want, want_args = _plain(op, s, seed=1)
            other, _ = _plain(op, s, seed=2)
            _compare(other, want, "")
        except Wrong:
            reason = "random"
            continue
        except Exception as e:  # noqa: BLE001
            reason = f"plain op raises {type(e).__name__}"
            continue
        usable.append((s, want, want_args))
    return usable, reason


_BROKEN_GROUP = ("Timed out", "timeout", "pair closure", "Connection closed", "Connection reset")


class Desync(Exception):
    """The ranks disagreed on how a run ended (one raised, the other did not, or one hangs)."""


def run_op(opinfo, name: str, lib, n_samples: int, sync=None, placements: str = "default") -> tuple[str, str]:
    """(status, detail) of one OpInfo through one library, each sample run once per placement run of
    ``PLACEMENTS[placements]``. ``sync(status)`` compares how each run ended across ranks and raises ``Desync``
    when they differ (the process group may then hold stray messages)."""
    from lightning_shard.tensor import fallback_counts, reset_fallback_counts

    usable, reason = _prepare(opinfo, n_samples)
    if not usable:
        return "skipped", reason
    op = opinfo.op
    status, detail = "clean", ""
    reset_fallback_counts()
    for k, (s, want, want_args) in enumerate(usable):
        for mode in PLACEMENTS[placements]:
            where = f"sample {k} {_LABELS[mode]}"
            ended = "ok"
            try:
                torch.manual_seed(1)
                args, kwargs = _distribute(lib, ((s.input, s.args), s.kwargs), mode)
                out = op(args[0], *args[1], **kwargs)
                _compare(_gather(lib, out), want, f"{where} output")
                _compare(_gather(lib, (args, kwargs)), want_args, f"{where} arguments")
            except Wrong as e:
                status, detail, ended = "wrong", str(e), "wrong"
            except Exception as e:  # noqa: BLE001
                if any(w in str(e) for w in _BROKEN_GROUP):
                    raise Desync(f"{where}: a collective timed out ({str(e).splitlines()[0][:120]})") from None
                ended = f"error {type(e).__name__}"
                if status != "wrong":
                    status, detail = "error", f"{where}: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if sync is not None:
                sync(f"{where} {ended}")
            if status == "wrong":
                return status, detail
    if status == "clean" and name == "ours" and fallback_counts():
        status, detail = "fallback", ", ".join(sorted(fallback_counts()))
    return status, detail


def select_ops(names: list[str] | None):
    from torch.testing._internal import common_utils

    # Every sample input looks for a unittest.TestCase up the stack with inspect.stack(), which reads source
    # files and scans sys.modules per frame: most of this harness's time, and growing with the modules loaded
    # (4x in a process that imported torch.compile's). There is never a TestCase here, so it finds none.
    common_utils.extract_test_fn = lambda: None
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [o for o in op_db if torch.float32 in o.supported_dtypes("cpu")]
    if names:
        ops = [o for o in ops if o.name in names or op_key(o) in names]
    return ops


def part_names(part: str) -> list[str]:
    """The op names of part ``k/n``: the k-th of n contiguous chunks of the sorted names (``"2/3"``)."""
    k, n = (int(v) for v in part.split("/"))
    if not 1 <= k <= n:
        raise ValueError(f"--part {part}: expected k/n with 1 <= k <= n")
    names = sorted({o.name for o in select_ops(None)})
    size = -(-len(names) // n)
    return names[(k - 1) * size : k * size]


def op_key(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def _store_sync(rank: int, world: int):
    """A status comparison through the TCP store, which still works when a collective went astray."""
    store = dist.distributed_c10d._get_default_store()
    counter = [0]

    def sync(status: str) -> None:
        counter[0] += 1
        store.set(f"opdb/{counter[0]}/{rank}", status)
        keys = [f"opdb/{counter[0]}/{r}" for r in range(world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=90))
        except Exception as e:  # noqa: BLE001
            raise Desync(f"a rank did not report: {e}") from None
        seen = [store.get(k).decode() for k in keys]
        if len(set(seen)) > 1:
            raise Desync("ranks disagree: " + " / ".join(seen))

    return sync


def _worker(rank: int, world: int, port: int, argv: dict, run_one) -> None:
    """One rank: ``run_one(opinfo, library name, library, argv, sync)`` -> (status, detail) for every OpInfo and
    library not yet in ``argv["out"]``, each line written by rank 0 as it ends."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import lightning_shard
    from lightning_shard.tensor import fallback_policy

    libs = _libs(lightning_shard.init_device_mesh("cpu", (world,)), torch_mesh("cpu", (world,)))
    sync = _store_sync(rank, world)
    done = _done(argv["out"])
    warnings.simplefilter("ignore")
    with fallback_policy("warn"), open(argv["out"], "a") as log:
        for opinfo in select_ops(argv["ops"]):
            for name in argv["libs"]:
                if (op_key(opinfo), name) in done:
                    continue
                if rank == 0:  # lets the parent name the unit if a rank dies (gloo aborts on some mismatches)
                    log.write(json.dumps(["__start__", op_key(opinfo), name, ""]) + "\n")
                    log.flush()
                try:
                    status, detail = run_one(opinfo, name, libs[name], argv, sync)
                    desync = False
                except Desync as e:
                    status, detail, desync = "error", f"{e}"[:300], True
                except Exception:  # noqa: BLE001 -- the harness itself must keep going
                    status, detail, desync = "error", traceback.format_exc(limit=1)[-300:], False
                if rank == 0:
                    log.write(json.dumps([op_key(opinfo), name, status, detail]) + "\n")
                    log.flush()
                    if argv["verbose"]:
                        print(op_key(opinfo), name, status, detail, flush=True)
                if desync:
                    os._exit(0)  # the process group may hold stray messages: the parent starts fresh ranks
    if rank == 0:
        with open(argv["out"], "a") as log:
            log.write(json.dumps(["__finished__", "", "", ""]) + "\n")
    dist.destroy_process_group()


def _lines(path: str) -> list:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _done(path: str) -> set:
    return {tuple(r[:2]) for r in _lines(path) if r[0] != "__start__"}


def _record_crash(path: str) -> None:
    """After a rank died: the unit it was running counts as an error, so the next ranks skip it."""
    started = [r for r in _lines(path) if r[0] == "__start__"]
    if started and (started[-1][1], started[-1][2]) not in _done(path):
        with open(path, "a") as log:
            log.write(json.dumps([started[-1][1], started[-1][2], "error", "a rank died (collective mismatch)"]))
            log.write("\n")


def _results(path: str) -> dict:
    out: dict = {}
    for key, lib, status, detail in _lines(path):
        if key not in ("__finished__", "__start__"):
            out.setdefault(key, {})[lib] = (status, detail)
    return out


def table(results: dict, libs, statuses=STATUSES) -> str:
    lines = ["| | " + " | ".join(libs) + " |", "| --- |" + " --- |" * len(libs)]
    for st in statuses:
        counts = [sum(1 for r in results.values() if r[lib][0] == st) for lib in libs]
        lines.append(f"| {st} | " + " | ".join(map(str, counts)) + " |")
    lines.append("| total | " + " | ".join(str(len(results)) for _ in libs) + " |")
    return "\n".join(lines)


def report(results: dict, libs) -> None:
    """The table, the ops clean in torch's DTensor but not in ours, and every op that is not clean."""
    print(table(results, libs))
    if set(LIBS) <= set(libs):
        clean = {lib: {k for k, r in results.items() if r[lib][0] == "clean"} for lib in LIBS}
        print(
            f"\nclean in both: {len(clean['ours'] & clean['torch'])}, only ours: "
            f"{len(clean['ours'] - clean['torch'])}, only torch's: {len(clean['torch'] - clean['ours'])}"
        )
        for k in sorted(clean["torch"] - clean["ours"]):
            print(f"  {k}: ours {results[k]['ours'][0]} {results[k]['ours'][1]}")
    for lib in libs:
        for st in ("fallback", "wrong", "error"):
            names = sorted(k for k, r in results.items() if r[lib][0] == st)
            if names or st != "fallback":
                print(f"\n{lib} {st} ({len(names)}):")
            for k in names:
                print(f"  {k}: {results[k][lib][1]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="*", default=None, help="OpInfo names (default: all of op_db)")
    p.add_argument("--part", default=None, help="k/n: only the k-th of n chunks of the sorted op names")
    p.add_argument("--report", nargs="+", default=None, help="print one table over these output files, no run")
    p.add_argument("--libs", nargs="*", default=list(LIBS), choices=LIBS)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument(
        "--placements",
        default="default",
        choices=sorted(PLACEMENTS),
        help="the placement runs of each sample (default: Replicate, then Shard(0)); see PLACEMENTS",
    )
    p.add_argument("--out", default="dtensor_opdb.jsonl", help="one line per (op, library); a rerun resumes")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    if a.report:
        results: dict = {}
        for path in a.report:
            results.update(_results(path))
        report(results, a.libs)
        return
    if a.part:
        a.ops = (a.ops or []) + part_names(a.part)
    argv = {
        "ops": a.ops,
        "libs": a.libs,
        "samples": a.samples,
        "out": a.out,
        "verbose": a.verbose or bool(a.ops),
        "placements": a.placements,
    }
    run_until_finished(argv, _run_forward)
    report(_results(a.out), a.libs)


def _run_forward(opinfo, name: str, lib, argv: dict, sync) -> tuple[str, str]:
    return run_op(opinfo, name, lib, argv["samples"], sync, argv["placements"])


def run_until_finished(argv: dict, run_one) -> None:
    """Run ``_worker`` on 2 fresh ranks until every OpInfo has a line in ``argv["out"]``: ranks that died (gloo
    aborts on some collective mismatches) or left after a desync are replaced, and the unit they were running
    counts as an error."""
    while ("__finished__", "") not in _done(argv["out"]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            mp.spawn(_worker, args=(2, port, argv, run_one), nprocs=2, join=True)
        except mp.ProcessExitedException:
            _record_crash(argv["out"])


if __name__ == "__main__":
    main()
