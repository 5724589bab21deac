"""DTensor gradients on torch's operator database: the backward ops through our DTensor (and torch's), 2 ranks.

Training runs the backward of every op through the DTensor too: autograd calls the ``*_backward`` aten ops
(and the ops of composite backwards) on DTensors, so a sharding rule or the replicate fallback must give the
right gradient. For every OpInfo of ``op_db`` with ``supports_autograd`` and float32 samples (the first
``--samples``), each sample is run twice per library, once with every differentiable floating tensor argument a
``Replicate()`` leaf DTensor that requires grad and once with every such argument of 1 dim or more ``Shard(0)``
(the other tensor arguments, indices and masks, distributed the same way without grad). A fixed upstream
gradient (``torch.randn`` with a fixed seed, the same on every rank) per floating output that requires grad,
distributed like the output (``Partial`` as ``Replicate``), is backpropagated; every input's ``.grad`` is
gathered (``full_tensor()``) and compared with the plain op's (rtol = atol = 1e-4). It must be a DTensor of the
input's shape on its mesh whose local shard matches its own placements (autograd keeps whatever placements the
backward produced, as torch's DTensor does: a replicated input's gradient may be ``Partial``). Per library an
op is

- ``clean``: every gradient matches and no op of forward or backward went through our replicate fallback;
- ``fallback``: every gradient matches, some op through the fallback (named in the detail);
- ``zeros``: every gradient matches, but an all-zero one is a plain tensor: torch's derivative formula builds it
  with ``at::zeros(self.sizes(), ...)``, below any tensor subclass (torch's DTensor gets the same);
- ``wrong``: a gradient differs, is missing, is not a DTensor, or its shape or local shard does not fit -- the
  worst outcome;
- ``error``: some run raised (the detail is the last error);
- ``skipped``: no autograd, no differentiable output, the plain op raises, or the gradients are random.

Run (ours only; torch's comparison doubles the time)::

    python benchmarks/dtensor_opdb_grad.py --part 1/3 --libs ours --out grad1.jsonl   # then 2/3, 3/3
    python benchmarks/dtensor_opdb_grad.py --report grad1.jsonl grad2.jsonl grad3.jsonl --libs ours
    python benchmarks/dtensor_opdb_grad.py --ops matmul nn.functional.embedding --out a.jsonl   # per op

The table printed at the end is the one in docs/dtensor.md ("Gradients on torch's operator database").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dtensor_opdb, the forward harness

import dtensor_opdb as fwd  # noqa: E402

LIBS = fwd.LIBS
STATUSES = ("clean", "fallback", "zeros", "wrong", "error", "skipped")
Wrong = fwd.Wrong


class PlainZeros(Exception):
    """A DTensor input's gradient is right (all zeros) but a plain tensor: torch's derivative formula builds it
    with ``at::zeros(self.sizes(), ...)``, below any tensor subclass (torch's DTensor gets the same)."""


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.layout == torch.strided and (x.is_floating_point() or x.is_complex())


def _leaves(sample) -> tuple:
    """(input, args, kwargs) with fresh copies of every tensor; the ones the sample marks differentiable (and
    floating) are leaves that require grad. Returns (tree, leaves in tree order)."""
    leaves = []

    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach().clone()
        if _is_float(x) and x.requires_grad:
            y.requires_grad_()
            leaves.append(y)
        return y

    tree = pytree.tree_map(copy, (sample.input, sample.args, sample.kwargs))
    return tree, leaves


def _differentiable(out) -> list:
    return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]


def _upstream(shapes_dtypes, seed: int = 3) -> list:
    """The fixed upstream gradients, one per differentiable output (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, dtype=dtype, generator=gen) for shape, dtype in shapes_dtypes]


def _plain_grads(op, sample, seed: int):
    """The plain op's input gradients for the fixed upstream gradients (None for an unused input)."""
    torch.manual_seed(seed)
    (inp, args, kwargs), leaves = _leaves(sample)
    outs = _differentiable(op(inp, *args, **kwargs))
    if not outs:
        raise LookupError("no differentiable output")
    grads = _upstream([(o.shape, o.dtype) for o in outs])
    torch.autograd.backward(outs, grads)
    return [leaf.grad for leaf in leaves], [(o.shape, o.dtype) for o in outs]


def _prepare(opinfo, n_samples: int):
    """(usable samples with the plain gradients, or the reason there are none)."""
    if not opinfo.supports_autograd:
        return [], "no autograd"
    if opinfo.name in fwd._UNINITIALISED:
        return [], "uninitialised memory"
    try:
        torch.manual_seed(0)  # every rank draws the same samples
        samples = []
        for s in opinfo.sample_inputs("cpu", torch.float32, requires_grad=True):
            samples.append(s)
            if len(samples) == n_samples:
                break
    except Exception as e:  # noqa: BLE001 -- an OpInfo that cannot build samples here
        return [], f"samples: {type(e).__name__}"
    usable, reason = [], "no samples"
    for s in samples:
        try:
            want, outs = _plain_grads(opinfo.op, s, seed=1)
            other, _ = _plain_grads(opinfo.op, s, seed=2)
            fwd._compare(other, want, "")
        except Wrong:
            reason = "random"
            continue
        except LookupError as e:
            reason = str(e)
            continue
        except Exception as e:  # noqa: BLE001
            reason = f"plain op raises {type(e).__name__}"
            continue
        usable.append((s, want, outs))
    return usable, reason


def _distributed_leaves(lib, sample, shard: bool):
    """The sample as DTensors: differentiable floating tensors become leaves that require grad."""
    mesh, distribute, Shard, Replicate = lib[:4]
    leaves = []

    def conv(x):
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            return x
        placement = Shard(0) if shard and x.ndim >= 1 else Replicate()
        y = distribute(x.detach().clone(), mesh, [placement])
        if _is_float(x) and x.requires_grad:
            y.requires_grad_()
            leaves.append(y)
        return y

    return pytree.tree_map(conv, (sample.input, sample.args, sample.kwargs)), leaves


def _distributed_upstream(lib, outs, grads) -> list:
    """Each upstream gradient distributed like its output (a ``Partial`` output takes a ``Replicate`` one)."""
    mesh, distribute, _, Replicate, dtensor_type = lib[:5]
    placed = []
    for o, g in zip(outs, grads):
        if isinstance(o, dtensor_type):
            placements = [Replicate() if p.is_partial() else p for p in o.placements]
            placed.append(distribute(g, o.device_mesh, placements))
        else:
            placed.append(g)
    return placed


def _local_shape(shape, placements, mesh) -> tuple:
    """The local shape this rank must hold for a global ``shape`` under ``placements`` (torch.chunk
    semantics). Autograd accumulates whatever placements the backward produced (torch's DTensor does the same:
    a replicated input's gradient may be ``Partial``, a sharded one's ``Replicate``), so the gradient's own
    placements are checked for consistency, not equality with the input's."""
    local = list(shape)
    for i, p in enumerate(placements):
        if p.is_shard():
            coord = mesh.get_coordinate()[i]
            chunks = torch.empty(local[p.dim], device="meta").chunk(mesh.size(i))
            local[p.dim] = chunks[coord].numel() if coord < len(chunks) else 0
    return tuple(local)


def _check_grads(lib, leaves, want, where: str) -> None:
    """Each leaf's gradient: a DTensor of the leaf's shape on its mesh, a local shard consistent with its
    placements, and equal to the plain gradient once gathered."""
    dtensor_type = lib[4]
    plain_zeros = []
    for i, (leaf, w) in enumerate(zip(leaves, want)):
        g = leaf.grad
        what = f"{where} grad of input {i}"
        if g is None or w is None:
            # An unused input: no gradient, or zeros, on either side.
            other = w if g is None else g
            if other is not None and bool((fwd._gather(lib, other) != 0).any()):
                raise Wrong(f"{what}: {'missing' if g is None else 'unexpected'} gradient")
            continue
        if not isinstance(g, dtensor_type):
            if g.shape == leaf.shape and not g.any() and not w.any():
                plain_zeros.append(what)
                continue
            raise Wrong(f"{what}: a {type(g).__name__}, not a DTensor")
        if g.shape != leaf.shape or g.device_mesh != leaf.device_mesh:
            raise Wrong(f"{what}: shape {tuple(g.shape)} != the input's {tuple(leaf.shape)} (or another mesh)")
        local = tuple(g.to_local().shape)
        if local != _local_shape(g.shape, g.placements, g.device_mesh):
            raise Wrong(f"{what}: local shape {local} does not match {g.placements} of {tuple(g.shape)}")
        fwd._compare(g.full_tensor(), w, what)
    if plain_zeros:
        raise PlainZeros(f"{plain_zeros[0]}: a plain tensor of zeros")


def _run_sample(op, lib, sample, want, shard: bool, where: str) -> None:
    torch.manual_seed(1)
    (inp, args, kwargs), leaves = _distributed_leaves(lib, sample, shard)
    outs = _differentiable(op(inp, *args, **kwargs))
    grads = _upstream([(tuple(o.shape), o.dtype) for o in outs])
    torch.autograd.backward(outs, _distributed_upstream(lib, outs, grads))
    _check_grads(lib, leaves, want, where)


def run_op(opinfo, name: str, lib, n_samples: int, sync=None) -> tuple[str, str]:
    """(status, detail) of one OpInfo's gradients through one library (``sync`` as in ``dtensor_opdb``)."""
    from lightning_shard.tensor import fallback_counts, reset_fallback_counts

    usable, reason = _prepare(opinfo, n_samples)
    if not usable:
        return "skipped", reason
    status, detail = "clean", ""
    reset_fallback_counts()
    for k, (s, want, _) in enumerate(usable):
        for shard in (False, True):
            where = f"sample {k} {'Shard(0)' if shard else 'Replicate'}"
            ended = "ok"
            try:
                _run_sample(opinfo.op, lib, s, want, shard, where)
            except Wrong as e:
                status, detail, ended = "wrong", str(e), "wrong"
            except PlainZeros as e:
                ended = "zeros"
                if status in ("clean", "zeros"):
                    status, detail = "zeros", str(e)
            except Exception as e:  # noqa: BLE001
                if any(w in str(e) for w in fwd._BROKEN_GROUP):
                    raise fwd.Desync(f"{where}: a collective timed out ({str(e).splitlines()[0][:120]})") from None
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


def _run_gradients(opinfo, name: str, lib, argv: dict, sync) -> tuple[str, str]:
    return run_op(opinfo, name, lib, argv["samples"], sync)


def report(results: dict, libs) -> None:
    """The table, then every op that is not clean with its detail (the fallback ones with the ops that fell back)."""
    print(fwd.table(results, libs, STATUSES))
    for lib in libs:
        for st in ("fallback", "zeros", "wrong", "error"):
            names = sorted(k for k, r in results.items() if r[lib][0] == st)
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
    p.add_argument("--out", default="dtensor_opdb_grad.jsonl", help="one line per (op, library); a rerun resumes")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    if a.report:
        results: dict = {}
        for path in a.report:
            results.update(fwd._results(path))
        report(results, a.libs)
        return
    if a.part:
        a.ops = (a.ops or []) + fwd.part_names(a.part)
    argv = {"ops": a.ops, "libs": a.libs, "samples": a.samples, "out": a.out, "verbose": a.verbose or bool(a.ops)}
    fwd.run_until_finished(argv, _run_gradients)
    report(fwd._results(a.out), a.libs)


if __name__ == "__main__":
    main()
