"""Matrix products: ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``dot`` (what ``linear``/``matmul`` become).

Each op is described by dim labels, einsum style (``mm``: ``mk,kn->mn``), and planned per mesh dim by
picking the cheapest of these strategies (cost = bytes the inputs must move to reach it):

=========================  =====================================================================
free dim ``m`` or ``n``      the operand holding it stays sharded there, the other is replicated;
                             the output is sharded on that dim
batch dim ``b``              both operands sharded on ``b`` (same layout); output sharded on ``b``
contraction dim ``k``        both operands sharded on ``k`` (same layout); output ``Partial("sum")``
one ``Partial`` operand      ``Partial(sum|avg)`` times replicated values; output the same ``Partial``
all replicated               output replicated
=========================  =====================================================================

A bias (``addmm``/``baddbmm`` ``self``) follows the output: sharded like it (replicated on broadcast dims),
or, when the output is ``Partial``, turned into a partial term itself (the redistribution keeps it on one
rank for ``sum``, so it is added once; on every rank for ``avg``). Ties between strategies prefer a
sharded output over a partial one and keep the operands' current placements.

Example: ``x (Shard(0)) @ w (Replicate())`` runs locally and returns ``Shard(0)``;
``x (Shard(1)) @ w (Shard(0))`` returns ``Partial("sum")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops._registry import OpCall, Plan, register
from lightning_shard.tensor.placements import Partial, Placement, Shard, StridedShard
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten

__all__ = ["redistribute_cost", "cheapest", "einsum_plan"]


def redistribute_cost(spec: DTensorSpec, mesh_dim: int, want: Placement) -> float:
    """Rough bytes-moved cost of turning ``spec``'s placement on ``mesh_dim`` into ``want``.

    Used to choose between strategies; only the order matters. Example: gathering a shard costs about the
    tensor's size, chunking a replicated tensor is free.
    """
    cur = spec.placements[mesh_dim]
    if cur == want:
        return 0.0
    n = max(1, spec.mesh.shape[mesh_dim])
    size = float(spec.shape.numel()) * spec.dtype.itemsize if spec.ndim else float(spec.dtype.itemsize)
    if cur.is_replicate():
        return 0.0  # local chunk or local partial term
    if cur.is_partial():
        return size if want.is_shard() else 2.0 * size  # reduce-scatter / all-reduce
    # cur is a shard
    if want.is_shard() and not isinstance(cur, StridedShard) and not isinstance(want, StridedShard):
        return size / n  # all-to-all
    return size  # all-gather (then maybe chunk or zero)


@dataclass(frozen=True)
class _Strategy:
    inputs: tuple[Placement, ...]  # one per operand (bias excluded)
    output: Placement
    rank: int  # tie-break: lower is preferred


def cheapest(specs: Sequence[DTensorSpec], mesh_dim: int, candidates, extra_cost=None):
    """The candidate (with ``.inputs``, one placement per spec, and ``.rank``) cheapest to reach on ``mesh_dim``.

    Ties go to the candidate that changes fewest inputs (so ``(R, R)`` stays ``R`` rather than being chunked
    for free), then to the lowest ``rank``. ``extra_cost(candidate)`` adds e.g. a bias's cost.
    Example: ``cheapest([a, b], 0, strategies)``.
    """
    best, best_key = None, None
    for c in candidates:
        cost = sum(redistribute_cost(s, mesh_dim, p) for s, p in zip(specs, c.inputs))
        if extra_cost is not None:
            cost += extra_cost(c)
        changes = sum(s.placements[mesh_dim] != p for s, p in zip(specs, c.inputs))
        key = (cost, changes, c.rank)
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best


def _shard_like(cur: Placement, dim: int) -> Placement:
    """``cur`` when it already shards ``dim`` (keeping a strided layout), else ``Shard(dim)``."""
    return cur if cur.is_shard(dim) else Shard(dim)


def _strategies(
    here: Sequence[Placement], labels: Sequence[str], out_labels: str, contracted: set[str]
) -> list[_Strategy]:
    out: list[_Strategy] = []
    all_labels = sorted(set("".join(labels)))
    for lab in all_labels:
        holders = [j for j, lb in enumerate(labels) if lab in lb]
        if lab in contracted:
            if len(holders) != len(labels):
                continue
            ins = tuple(_shard_like(here[j], labels[j].index(lab)) for j in range(len(labels)))
            out.append(_Strategy(ins, Partial("sum"), 2))
        else:
            ins = tuple(
                _shard_like(here[j], labels[j].index(lab)) if j in holders else REPLICATE for j in range(len(labels))
            )
            src = here[holders[0]]
            od = out_labels.index(lab)
            op = _retarget(src, od) if src.is_shard(labels[holders[0]].index(lab)) else Shard(od)
            out.append(_Strategy(ins, op, 0))
    for j, p in enumerate(here):
        if p.is_partial() and p.reduce_op in ("sum", "avg"):
            ins = tuple(p if k == j else REPLICATE for k in range(len(labels)))
            out.append(_Strategy(ins, p, 1))
    out.append(_Strategy(tuple(REPLICATE for _ in labels), REPLICATE, 3))
    return out


def _retarget(p: Placement, dim: int) -> Placement:
    if isinstance(p, StridedShard):
        return StridedShard(dim, p.split_factor)
    return Shard(dim)


def _bias_placement(out: Placement, bias: DTensorSpec, out_ndim: int, out_shape: Sequence[int]) -> Placement:
    if out.is_partial():
        return out
    if out.is_shard():
        d = out.dim - (out_ndim - bias.ndim)
        if d >= 0 and bias.shape[d] == out_shape[out.dim]:
            return _retarget(out, d)
    return REPLICATE


def einsum_plan(
    call: OpCall,
    operands: Sequence[int],
    labels: Sequence[str],
    out_labels: str,
    bias: int | None = None,
) -> Plan:
    """Plan a product whose DTensor operands ``operands`` (indices into ``call.specs``) carry ``labels``.

    ``bias`` (an index into ``call.specs``) is added to the result and broadcasts to ``out_labels``.
    Example: ``einsum_plan(call, [1, 2], ["mk", "kn"], "mn", bias=0)`` plans ``addmm``.
    """
    specs = [call.specs[j] for j in operands]
    contracted = set("".join(labels)) - set(out_labels)
    out_shape = [0] * len(out_labels)
    for s, lb in zip(specs, labels):
        for d, lab in enumerate(lb):
            if lab in out_labels:
                out_shape[out_labels.index(lab)] = s.shape[d]
    n_in = len(call.specs)
    inputs: list[list[Placement]] = [[] for _ in range(n_in)]
    outputs: list[Placement] = []
    for i in range(call.mesh.ndim):
        here = [s.placements[i] for s in specs]
        extra = None
        if bias is not None:
            bspec = call.specs[bias]

            def extra(st, bspec=bspec, i=i):
                return redistribute_cost(bspec, i, _bias_placement(st.output, bspec, len(out_labels), out_shape))

        best = cheapest(specs, i, _strategies(here, labels, out_labels, contracted), extra)
        for j, p in zip(operands, best.inputs):
            inputs[j].append(p)
        if bias is not None:
            inputs[bias].append(_bias_placement(best.output, call.specs[bias], len(out_labels), out_shape))
        outputs.append(best.output)
    _align_shared_dims(inputs, operands, labels)
    return Plan([tuple(p) for p in inputs], [tuple(outputs)])


def _align_shared_dims(inputs: list[list[Placement]], operands: Sequence[int], labels: Sequence[str]) -> None:
    """Operands sharing a dim (batch or contraction) must split it identically; use plain shards if not."""
    for lab in set("".join(labels)):
        holders = [(operands[j], labels[j].index(lab)) for j in range(len(labels)) if lab in labels[j]]
        if len(holders) < 2:
            continue
        layouts = {
            tuple(inputs[j][i] if inputs[j][i].is_shard(d) else None for i in range(len(inputs[j]))) for j, d in holders
        }
        # same mesh dims must shard it, with the same (strided or plain) kind
        kinds = {tuple(type(p) if p is not None else None for p in lay) for lay in layouts}
        factors = {tuple(getattr(p, "split_factor", None) for p in lay) for lay in layouts}
        if len(kinds) > 1 or len(factors) > 1:
            for j, d in holders:
                inputs[j] = [Shard(d) if p.is_shard(d) else p for p in inputs[j]]


def _dtensor_index(call: OpCall, arg_index: int) -> int | None:
    """Index into ``call.specs`` of positional argument ``arg_index`` (None if it is not a DTensor)."""
    from lightning_shard.tensor.dtensor import DTensor

    if not isinstance(call.args[arg_index], DTensor):
        return None
    return sum(isinstance(a, DTensor) for a in call.args[:arg_index])


def _product_rule(labels: Sequence[str], out_labels: str, with_bias: bool):
    first = 1 if with_bias else 0

    def rule(call: OpCall) -> Plan | None:
        idx = [_dtensor_index(call, first + j) for j in range(len(labels))]
        if any(k is None for k in idx):
            return None
        bias = _dtensor_index(call, 0) if with_bias else None
        if with_bias and bias is None and isinstance(call.args[0], torch.Tensor):
            return None  # a plain 0-dim bias would be added on every rank of a Partial output
        return einsum_plan(call, idx, labels, out_labels, bias)

    return rule


register(aten.mm.default)(_product_rule(["mk", "kn"], "mn", False))
register(aten.addmm.default)(_product_rule(["mk", "kn"], "mn", True))
register(aten.bmm.default)(_product_rule(["bmk", "bkn"], "bmn", False))
register(aten.baddbmm.default)(_product_rule(["bmk", "bkn"], "bmn", True))
register(aten.mv.default)(_product_rule(["mk", "k"], "m", False))
register(aten.addmv.default)(_product_rule(["mk", "k"], "m", True))
register(aten.dot.default, aten.vdot.default)(_product_rule(["k", "k"], "", False))
register(aten.addr.default)(_product_rule(["m", "n"], "mn", True))
