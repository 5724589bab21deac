"""Reductions: sum, mean, amax/amin, max/min, norms, var/std, argmax, all/any, prod, scans.

Per mesh dim, a shard of a dim that is *not* reduced stays (moved to its output dim). A shard of a reduced dim:

- ``sum``/``nansum``/``count_nonzero``: local sums are ``Partial("sum")`` terms.
- ``mean``: on even shards the local means are ``Partial("avg")`` terms (what torch's DTensor gives); on
  uneven shards the average of local means is wrong, so the op becomes ``sum(x) / global_count`` and the
  result is ``Partial("sum")`` (deliberately different from torch, which is wrong there).
- ``amax``/``amin``/``max()``/``min()``: ``Partial("max")``/``Partial("min")``, unless some rank holds an
  empty shard of the reduced dim (a max over nothing is an error): then replicate first.
- ``linalg_vector_norm``: local norms are combined right away (p-th powers summed, or max/min for +-inf)
  with one all-reduce; the result is ``Replicate`` on that mesh dim (torch returns a private "norm"
  partial placement we do not have).
- ``max.dim``/``min.dim`` (indices must be global), ``argmax``/``argmin``, ``var``/``std``, ``all``/``any``,
  ``prod``, ``logsumexp`` and scans along a dim: that dim is replicated first.

A ``Partial`` input passes through linear reductions (sum/mean of sum/avg partials, amax of max partials);
``count_nonzero`` reduces it first.

Example::

    x = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    x.sum(0).placements        # (Partial('sum'),)
    x.sum(1).placements        # (Shard(dim=0),)
"""

from __future__ import annotations

import itertools
import math

import torch

from lightning_shard import comm
from lightning_shard.tensor._layout import local_range
from lightning_shard.tensor.dispatch import dispatch, make_call, register_custom, run_plan, wrap_outputs
from lightning_shard.tensor.ops._common import REPLICATE, normalize_dim
from lightning_shard.tensor.ops._registry import RULES, OpCall, Plan, register
from lightning_shard.tensor.ops.views import same_kind
from lightning_shard.tensor.placements import Partial, Placement
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten

Placements = tuple[Placement, ...]

# op -> how a reduced, sharded dim is combined: "sum", "max", "min", or None (replicate it first)
_KIND = {
    aten.sum.default: "sum",
    aten.sum.dim_IntList: "sum",
    aten.nansum.default: "sum",
    aten.count_nonzero.default: "sum",
    aten.count_nonzero.dim_IntList: "sum",
    aten.amax.default: "max",
    aten.max.default: "max",
    aten.amin.default: "min",
    aten.min.default: "min",
    aten.max.dim: None,
    aten.min.dim: None,
    aten.argmax.default: None,
    aten.argmin.default: None,
    aten.all.default: None,
    aten.all.dim: None,
    aten.all.dims: None,
    aten.any.default: None,
    aten.any.dim: None,
    aten.any.dims: None,
    aten.prod.default: None,
    aten.prod.dim_int: None,
    aten.var.default: None,
    aten.var.dim: None,
    aten.var.correction: None,
    aten.std.default: None,
    aten.std.dim: None,
    aten.std.correction: None,
    aten.var_mean.correction: None,
    aten.std_mean.correction: None,
}
_SCANS = {aten.cumsum.default: "sum", aten.cumprod.default: None, aten.logcumsumexp.default: None}
_NO_DIM_ARG = {"default"}  # overloads that reduce everything (sum(), max(), all() ...)


def arg(call_func, args: tuple, kwargs: dict, name: str, default=None):
    """Argument ``name`` of an op call, positional or keyword, else the schema default (else ``default``).

    Example: ``arg(aten.sum.dim_IntList, (x, [0]), {}, "keepdim")`` is ``False``.
    """
    for i, a in enumerate(call_func._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            if name in kwargs:
                return kwargs[name]
            return a.default_value if a.has_default_value() else default
    return default


def reduced_dims(func, args: tuple, kwargs: dict, ndim: int) -> tuple[set[int], bool]:
    """(dims reduced, keepdim) of a reduction call; no dim / ``None`` / ``[]`` means all dims."""
    if func._overloadname in _NO_DIM_ARG and not any(a.name == "dim" for a in func._schema.arguments):
        return set(range(ndim)), False
    dim = arg(func, args, kwargs, "dim")
    keepdim = bool(arg(func, args, kwargs, "keepdim", False))
    if dim is None:
        return set(range(ndim)), keepdim
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return set(range(ndim)), keepdim
    return {normalize_dim(d, ndim) for d in dims}, keepdim


def _every_rank_holds_some(spec: DTensorSpec, mesh_dim: int) -> bool:
    """Whether no rank holds an empty shard of the dim that mesh dim ``mesh_dim`` shards."""
    d = spec.placements[mesh_dim].dim
    mesh = spec.mesh
    return all(
        local_range(spec.shape[d], spec.placements, d, mesh.shape, coord)[1] > 0
        for coord in itertools.product(*[range(n) for n in mesh.shape])
    )


def reduction_placements(
    spec: DTensorSpec, dims: set[int], keepdim: bool, kind: str | None
) -> tuple[Placements, Placements]:
    """(input, output) placements of a reduction of ``dims`` combining sharded terms with ``kind``."""
    ins, outs = [], []
    for i, p in enumerate(spec.placements):
        if p.is_shard() and p.dim in dims:
            if kind == "sum" or (kind in ("max", "min") and _every_rank_holds_some(spec, i)):
                ins.append(p)
                outs.append(Partial(kind))
                continue
            ins.append(REPLICATE)
            outs.append(REPLICATE)
        elif p.is_shard():
            ins.append(p)
            outs.append(same_kind(p, p.dim if keepdim else p.dim - sum(r < p.dim for r in dims)))
        elif p.is_partial() and (
            (kind == "sum" and p.reduce_op in ("sum", "avg")) or (kind in ("max", "min") and p.reduce_op == kind)
        ):
            ins.append(p)
            outs.append(p)
        else:
            ins.append(REPLICATE)
            outs.append(REPLICATE)
    return tuple(ins), tuple(outs)


# Local counts of a shard add up, but counting is not linear in the values: a Partial input is reduced first.
_COUNTS = {aten.count_nonzero.default, aten.count_nonzero.dim_IntList}


def reduction_rule(call: OpCall) -> Plan:
    spec = call.specs[0]
    dims, keepdim = reduced_dims(call.func, call.args, call.kwargs, spec.ndim)
    ins, outs = reduction_placements(spec, dims, keepdim, _KIND[call.func])
    if call.func in _COUNTS:
        keep = [not p.is_partial() for p in spec.placements]
        ins = tuple(p if k else REPLICATE for p, k in zip(ins, keep))
        outs = tuple(p if k else REPLICATE for p, k in zip(outs, keep))
    n_out = 2 if call.func in (aten.max.dim, aten.min.dim, aten.var_mean.correction, aten.std_mean.correction) else 1
    return Plan([ins], [outs] * n_out)


def scan_rule(call: OpCall) -> Plan:
    """cumsum/cumprod along ``dim``: that dim is replicated (a partial sum passes through cumsum)."""
    spec = call.specs[0]
    dim = normalize_dim(call.args[1], spec.ndim)
    ins, outs = reduction_placements(spec, {dim}, True, None)
    if _SCANS[call.func] == "sum":
        linear = [p.is_partial() and p.reduce_op in ("sum", "avg") for p in spec.placements]
        ins = tuple(p if keep else q for p, q, keep in zip(spec.placements, ins, linear))
        outs = tuple(p if keep else q for p, q, keep in zip(spec.placements, outs, linear))
    return Plan([ins], [outs])


for _op in _KIND:
    RULES[_op] = reduction_rule
for _op in _SCANS:
    RULES[_op] = scan_rule
if aten.logsumexp.default not in RULES:

    @register(aten.logsumexp.default)
    def logsumexp_rule(call: OpCall) -> Plan:
        spec = call.specs[0]
        dims, keepdim = reduced_dims(call.func, call.args, call.kwargs, spec.ndim)
        ins, outs = reduction_placements(spec, dims, keepdim, None)
        return Plan([ins], [outs])


# ----------------------------------------------------------------------------------------------- mean
def _even_over(spec: DTensorSpec, mesh_dims: list[int], dims: set[int]) -> bool:
    """Whether every rank holds the same number of elements of the reduced ``dims``."""
    mesh = spec.mesh
    counts = {
        math.prod(local_range(spec.shape[d], spec.placements, d, mesh.shape, coord)[1] for d in dims)
        for coord in itertools.product(*[range(n) for n in mesh.shape])
    }
    return len(counts) == 1


@register_custom(aten.mean.default, aten.mean.dim)
def mean_handler(func, args: tuple, kwargs: dict):
    """Mean: local means are ``Partial("avg")`` terms on even shards; otherwise ``sum / global count``."""
    x = args[0]
    spec: DTensorSpec = x._spec
    dims, keepdim = reduced_dims(func, args, kwargs, spec.ndim)
    ins, outs = reduction_placements(spec, dims, keepdim, "sum")
    sharded = [i for i, p in enumerate(spec.placements) if p.is_shard() and p.dim in dims]
    if not sharded or _even_over(spec, sharded, dims):
        outs = tuple(Partial("avg") if i in sharded else p for i, p in enumerate(outs))
        return run_plan(make_call(func, args, kwargs), Plan([ins], [outs]))
    dtype = arg(func, args, kwargs, "dtype")
    total = dispatch(aten.sum.dim_IntList, (x, sorted(dims), keepdim), {"dtype": dtype} if dtype else {})
    return dispatch(aten.div.Scalar, (total, math.prod(spec.shape[d] for d in dims)), {})


# ----------------------------------------------------------------------------------------------- norms
@register_custom(aten.linalg_vector_norm.default)
def vector_norm_handler(func, args: tuple, kwargs: dict):
    """Vector p-norm: shards of reduced dims give local norms combined by one all-reduce per mesh dim."""
    x = args[0]
    spec: DTensorSpec = x._spec
    ord_ = float(arg(func, args, kwargs, "ord", 2))
    dims, keepdim = reduced_dims(func, args, kwargs, spec.ndim)
    kind = "max" if ord_ == math.inf else "min" if ord_ == -math.inf else "sum"
    ins, outs = reduction_placements(spec, dims, keepdim, kind)
    ins = tuple(REPLICATE if p.is_partial() else p for p in ins)  # a norm is not linear in partial terms
    combine = [i for i, p in enumerate(ins) if p.is_shard() and p.dim in dims]
    outs = tuple(REPLICATE if p.is_partial() else p for p in outs)
    call = make_call(func, args, kwargs)
    if not combine:
        return run_plan(call, Plan([ins], [outs]))
    local = redistribute_local(x._local_tensor, spec, ins)
    local_args = (local, *args[1:])
    norm = func(*local_args, **kwargs)
    if kind == "sum" and ord_ != 0:
        terms = norm.double().pow(ord_)  # double: p-th powers of large norms stay finite and exact enough
    else:
        terms = norm.clone()
    with comm.host_collectives_for(terms):  # the shards' device: the host for offloaded ones
        for i in combine:
            comm.all_reduce(terms, spec.mesh.get_group(i), kind)
    if kind == "sum" and ord_ != 0:
        terms = terms.pow(1.0 / ord_)
    norm = terms.to(norm.dtype)
    meta = _meta_call(func, args, kwargs)
    return wrap_outputs(norm, meta, [outs], spec.mesh)


@register_custom(aten.norm.ScalarOpt_dim)
def norm_dim_handler(func, args: tuple, kwargs: dict):
    """``norm(x, p, dim, keepdim)`` (``pairwise_distance``, the triplet losses) is ``linalg_vector_norm``."""
    p = arg(func, args, kwargs, "p")
    dim, keepdim = arg(func, args, kwargs, "dim"), arg(func, args, kwargs, "keepdim", False)
    return dispatch(aten.linalg_vector_norm.default, (args[0], 2 if p is None else p, dim, keepdim), {})


def _meta_call(func, args: tuple, kwargs: dict):
    from lightning_shard.tensor.dispatch import _run_on_meta

    return _run_on_meta(func, make_call(func, args, kwargs))
