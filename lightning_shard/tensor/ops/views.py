"""Views and shape ops: view/reshape, transpose/permute, expand, (un)squeeze, split/cat/stack, slice/select.

A shard survives a shape op only where the local op on the local shard gives exactly the local shard of the
global result, with ``torch.chunk`` semantics on uneven sizes. Rules rewrite size arguments for the local
call (``Plan.local_args``); a ``Partial`` passes through every op here because they only move elements.

Merging or splitting dims (``view``) keeps a shard only when it sits on the leading non-unit dim of the merged
group and every rank's flat range of the group is the same before and after (checked numerically for every
mesh coordinate, so even/uneven and nested shards are all handled by one test)::

    (8, 6) -> (8, 2, 3), Shard(0)            -> Shard(0)
    (B, S, H*D) -> (B, S, H, D), Shard(2)    -> Shard(2) when H splits evenly over the mesh dim
    (7, 5) -> (35,), Shard(0) over 2 ranks   -> replicate first (rows 0..3 are 20 elements, chunk is 18)

Example::

    x = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])
    x.view(8, 2, 3).placements      # (Shard(dim=0),)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

from lightning_shard.tensor._layout import local_range, local_shape_and_offset
from lightning_shard.tensor.dispatch import dispatch, make_call, register_custom, run_plan
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops._common import REPLICATE, normalize_dim
from lightning_shard.tensor.ops._registry import OpCall, Plan, register
from lightning_shard.tensor.placements import Placement, Shard, StridedShard
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten

Placements = tuple[Placement, ...]


# ----------------------------------------------------------------------------------------------- helpers
def same_kind(p: Placement, dim: int) -> Placement:
    """``p`` (a shard) moved to tensor dim ``dim``, keeping whether it is strided."""
    if isinstance(p, StridedShard):
        return StridedShard(dim, p.split_factor)
    return Shard(dim)


def map_shards(
    placements: Sequence[Placement], dim_map: Callable[[int], int | None], partial_ok: bool = True
) -> tuple[Placements, Placements]:
    """(input, output) placements when shard dim ``d`` moves to ``dim_map(d)`` (``None``: replicate it).

    Example: ``map_shards((Shard(1),), lambda d: {0: 1, 1: 0}[d])`` is the transpose rule.
    """
    ins, outs = [], []
    for p in placements:
        if p.is_shard():
            nd = dim_map(p.dim)
            if nd is None:
                ins.append(REPLICATE)
                outs.append(REPLICATE)
            else:
                ins.append(p)
                outs.append(same_kind(p, nd))
        elif p.is_partial() and not partial_ok:
            ins.append(REPLICATE)
            outs.append(REPLICATE)
        else:
            ins.append(p)
            outs.append(p)
    return tuple(ins), tuple(outs)


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh) -> list[int]:
    """This rank's shard shape of a tensor of global ``shape`` laid out as ``placements``."""
    return list(local_shape_and_offset(tuple(shape), tuple(placements), mesh.shape, mesh.get_coordinate())[0])


def _replace_arg(call: OpCall, index: int, value) -> tuple[tuple, dict]:
    args = list(call.args)
    args[index] = value
    return tuple(args), call.kwargs


def _arg(call: OpCall, index: int, name: str, default=None):
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


# ----------------------------------------------------------------------------------------------- view
def resolve_size(size: Sequence[int], numel: int) -> list[int]:
    """``size`` with a ``-1`` entry replaced by the inferred length."""
    size = [int(s) for s in size]
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = numel // known if known else 0
    return size


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of ``src`` dims and ``dst`` dims with equal products (the dims a view merges/splits).

    Example: ``view_groups((6, 4), (6, 2, 2))`` is ``[([0], [0]), ([1], [1, 2])]``.
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, go, pi, po = [], [], 1, 1
        if i < len(src):
            gi.append(i)
            pi *= src[i]
            i += 1
        if j < len(dst):
            go.append(j)
            po *= dst[j]
            j += 1
        while pi != po:
            if pi < po and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                go.append(j)
                po *= dst[j]
                j += 1
            else:
                raise ValueError(f"view: shapes {tuple(src)} and {tuple(dst)} have different sizes")
        # Trailing unit dims join the group they follow, so a group never starts with a dangling 1.
        groups.append((gi, go))
    return groups


def _flat_ranges_agree(
    mesh, in_size: int, in_rest: int, in_pl: Placements, in_dim: int, out_size: int, out_rest: int, out_pl, out_dim
) -> bool:
    """Whether every rank's flat element range of the group is the same before and after the view."""
    for coord in itertools.product(*[range(n) for n in mesh.shape]):
        a_off, a_len = local_range(in_size, in_pl, in_dim, mesh.shape, coord)
        b_off, b_len = local_range(out_size, out_pl, out_dim, mesh.shape, coord)
        if a_len == 0 and b_len == 0:
            continue
        if (a_off * in_rest, a_len * in_rest) != (b_off * out_rest, b_len * out_rest):
            return False
    return True


def view_placements(spec: DTensorSpec, out_shape: Sequence[int]) -> tuple[Placements, Placements]:
    """(input, output) placements for viewing ``spec``'s tensor as ``out_shape``."""
    src = list(spec.shape)
    placements = spec.placements
    mesh = spec.mesh
    if math.prod(src) == 0:
        return map_shards(placements, lambda d: None)
    dim_to: dict[int, int | None] = {}
    for gi, go in view_groups(src, out_shape):
        lead_in = next((d for d in gi if src[d] != 1), None)
        lead_out = next((d for d in go if out_shape[d] != 1), None)
        for d in gi:
            dim_to[d] = None
        if lead_in is None or lead_out is None:
            continue
        if len([d for d in gi if src[d] != 1]) == 1 and len([d for d in go if out_shape[d] != 1]) == 1:
            dim_to[lead_in] = lead_out  # same length on both sides (unit dims around it only)
            continue
        in_pl = tuple(p if p.is_shard(lead_in) else REPLICATE for p in placements)
        if not any(p.is_shard() for p in in_pl):
            continue
        out_pl = tuple(same_kind(p, lead_out) if p.is_shard() else p for p in in_pl)
        in_rest = math.prod(src[d] for d in gi if d > lead_in)
        out_rest = math.prod(out_shape[d] for d in go if d > lead_out)
        if _flat_ranges_agree(
            mesh, src[lead_in], in_rest, in_pl, lead_in, out_shape[lead_out], out_rest, out_pl, lead_out
        ):
            dim_to[lead_in] = lead_out
    return map_shards(placements, lambda d: dim_to.get(d))


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    out_shape = resolve_size(call.args[1], math.prod(spec.shape))
    ins, outs = view_placements(spec, out_shape)
    return Plan([ins], [outs], _replace_arg(call, 1, local_shape(out_shape, outs, call.mesh)))


@register(aten.view.dtype)
def view_dtype_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    same_size = torch.empty((), dtype=call.args[1]).element_size() == torch.empty((), dtype=spec.dtype).element_size()
    last = spec.ndim - 1
    ins, outs = map_shards(spec.placements, lambda d: d if same_size or d != last else None, partial_ok=same_size)
    return Plan([ins], [outs])


# ----------------------------------------------------------------------------------------------- dim moves
@register(aten.t.default, aten.transpose.int)
def transpose_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    n = spec.ndim
    if call.func.overloadpacket in (aten.t, aten.t_copy):
        d0, d1 = (0, 1) if n == 2 else (0, 0)
    else:
        d0, d1 = normalize_dim(call.args[1], n), normalize_dim(call.args[2], n)
    swap = {d0: d1, d1: d0}
    ins, outs = map_shards(spec.placements, lambda d: swap.get(d, d))
    return Plan([ins], [outs])


@register(aten.permute.default)
def permute_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    perm = [normalize_dim(d, spec.ndim) for d in call.args[1]]
    where = {src: dst for dst, src in enumerate(perm)}
    ins, outs = map_shards(spec.placements, lambda d: where[d])
    return Plan([ins], [outs])


@register(aten.unsqueeze.default)
def unsqueeze_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    dim = normalize_dim(call.args[1], spec.ndim + 1)
    ins, outs = map_shards(spec.placements, lambda d: d + 1 if d >= dim else d)
    return Plan([ins], [outs], _replace_arg(call, 1, dim))


@register(aten.squeeze.dims)
def squeeze_rule(call: OpCall) -> Plan:
    """Squeeze only the dims of global length 1: a local shard may have length 1 (or 0) where the global
    tensor does not, so the local call names exactly those dims."""
    (spec,) = call.specs
    dims = squeezable_dims(spec, call.args[1])
    gone = set(dims)
    ins, outs = map_shards(spec.placements, lambda d: None if d in gone else d - sum(g < d for g in gone))
    return Plan([ins], [outs], _replace_arg(call, 1, dims))


def squeezable_dims(spec: DTensorSpec, dims: Sequence[int] | None) -> list[int]:
    """The dims among ``dims`` (all when ``None``) whose global length is 1."""
    n = spec.ndim
    if n == 0:
        return []
    dims = range(n) if dims is None else dims
    return sorted({normalize_dim(d, n) for d in dims if spec.shape[normalize_dim(d, n)] == 1})


@register_custom(aten.squeeze.default, aten.squeeze.dim)
def squeeze_handler(func, args, kwargs):
    """``squeeze()`` / ``squeeze(dim)`` become ``squeeze.dims`` with the globally squeezable dims."""
    x = args[0]
    dims = None if func == aten.squeeze.default else [args[1] if len(args) > 1 else kwargs["dim"]]
    return dispatch(aten.squeeze.dims, (x, squeezable_dims(x._spec, dims)), {})


@register_custom(aten.squeeze_copy.default, aten.squeeze_copy.dim)
def squeeze_copy_handler(func, args, kwargs):
    """``squeeze_copy()`` / ``squeeze_copy(dim)`` become ``squeeze_copy.dims`` as ``squeeze`` does."""
    x = args[0]
    dims = None if func == aten.squeeze_copy.default else [args[1] if len(args) > 1 else kwargs["dim"]]
    return dispatch(aten.squeeze_copy.dims, (x, squeezable_dims(x._spec, dims)), {})


# ----------------------------------------------------------------------------------------------- broadcast
@register(aten.expand.default)
def expand_rule(call: OpCall) -> Plan:
    """New leading dims and broadcast unit dims are replicated; other dims keep their shard (local size -1)."""
    (spec,) = call.specs
    size = list(call.args[1])
    lead = len(size) - spec.ndim

    def broadcast(d: int) -> bool:
        return spec.shape[d] == 1 and size[d + lead] not in (1, -1)

    ins, outs = map_shards(spec.placements, lambda d: None if broadcast(d) else d + lead)
    local = [s if i < lead or broadcast(i - lead) else -1 for i, s in enumerate(size)]
    return Plan([ins], [outs], _replace_arg(call, 1, local))


@register(aten.repeat.default)
def repeat_rule(call: OpCall) -> Plan:
    """Dims repeated once keep their shard; a repeated dim is replicated (its copies would interleave)."""
    (spec,) = call.specs
    reps = list(call.args[1])
    lead = len(reps) - spec.ndim
    ins, outs = map_shards(spec.placements, lambda d: d + lead if reps[d + lead] == 1 else None)
    return Plan([ins], [outs])


# ----------------------------------------------------------------------------------------------- split / join
def _n_outputs(call: OpCall) -> int:
    from lightning_shard.tensor.dispatch import _run_on_meta

    return len(_run_on_meta(call.func, call))


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def split_rule(call: OpCall) -> Plan:
    """The split dim is replicated (pieces are global ranges); other dims keep their shard."""
    (spec,) = call.specs
    # unbind_copy shares this rule (_register_copy_variants): its dim is its second argument too.
    unbind = call.func in (aten.unbind.int, aten.unbind_copy.int)
    dim = normalize_dim(_arg(call, 1 if unbind else 2, "dim", 0), spec.ndim)
    if unbind:
        ins, outs = map_shards(spec.placements, lambda d: None if d == dim else d - (d > dim))
    else:
        ins, outs = map_shards(spec.placements, lambda d: None if d == dim else d)
    return Plan([ins], [outs] * _n_outputs(call))


def _join_placements(specs: list[DTensorSpec], dim: int, shift: int, mesh_ndim: int) -> tuple[list, Placements]:
    """Per mesh dim: all partial alike -> partial; else the first shard on a dim other than ``dim``; else R."""
    ins: list[list[Placement]] = [[] for _ in specs]
    outs: list[Placement] = []
    for i in range(mesh_ndim):
        here = [s.placements[i] for s in specs]
        if all(p.is_partial() for p in here) and len(set(here)) == 1:
            choice, per_input = here[0], here
        else:
            shard = next((p for p in here if p.is_shard() and p.dim != dim), None)
            if shard is not None:
                choice = same_kind(shard, shard.dim + (shift if shard.dim >= dim else 0))
                per_input = [shard] * len(specs)
            else:
                choice, per_input = REPLICATE, [REPLICATE] * len(specs)
        outs.append(choice)
        for k, p in enumerate(per_input):
            ins[k].append(p)
    return [tuple(p) for p in ins], tuple(outs)


@register(aten.cat.default)
def cat_rule(call: OpCall) -> Plan | None:
    tensors = call.args[0]
    specs = call.specs
    if len(specs) != len(tensors) or len({s.ndim for s in specs}) != 1:
        return None  # legacy 1-D empty tensors or plain tensors mixed in: use the fallback
    dim = normalize_dim(_arg(call, 1, "dim", 0), specs[0].ndim)
    ins, outs = _join_placements(specs, dim, 0, call.mesh.ndim)
    return Plan(ins, [outs])


@register(aten.stack.default)
def stack_rule(call: OpCall) -> Plan | None:
    tensors = call.args[0]
    specs = call.specs
    if len(specs) != len(tensors):
        return None
    dim = normalize_dim(_arg(call, 1, "dim", 0), specs[0].ndim + 1)
    # No input dim is "the stacked dim": pass an impossible dim so every shard may survive (shifted).
    ins, outs = _join_placements(specs, -1, 0, call.mesh.ndim)
    outs = tuple(same_kind(p, p.dim + 1) if p.is_shard() and p.dim >= dim else p for p in outs)
    return Plan(ins, [outs])


# ----------------------------------------------------------------------------------------------- slicing
@register(aten.slice.Tensor)
def slice_rule(call: OpCall) -> Plan:
    """Slicing a sharded dim replicates it first (the slice is a global range); other dims keep shards."""
    (spec,) = call.specs
    dim = normalize_dim(_arg(call, 1, "dim", 0), spec.ndim)
    ins, outs = map_shards(spec.placements, lambda d: None if d == dim else d)
    return Plan([ins], [outs])


@register(aten.select.int)
def select_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    dim = normalize_dim(call.args[1], spec.ndim)
    ins, outs = map_shards(spec.placements, lambda d: None if d == dim else d - (d > dim))
    return Plan([ins], [outs])


@register(aten.slice_backward.default)
def slice_backward_rule(call: OpCall) -> Plan:
    """Zero-padded gradient of a slice: shards off the slice dim stay, with local ``input_sizes``."""
    (spec,) = call.specs
    sizes = list(call.args[1])
    dim = normalize_dim(call.args[2], len(sizes))
    ins, outs = map_shards(spec.placements, lambda d: None if d == dim else d)
    return Plan([ins], [outs], _replace_arg(call, 1, local_shape(sizes, outs, call.mesh)))


@register(aten.select_backward.default)
def select_backward_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    sizes = list(call.args[1])
    dim = normalize_dim(call.args[2], len(sizes))
    ins, outs = map_shards(spec.placements, lambda d: d + 1 if d >= dim else d)
    return Plan([ins], [outs], _replace_arg(call, 1, local_shape(sizes, outs, call.mesh)))


@register(aten.flip.default)
def flip_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    dims = {normalize_dim(d, spec.ndim) for d in call.args[1]}
    ins, outs = map_shards(spec.placements, lambda d: None if d in dims else d)
    return Plan([ins], [outs])


@register(aten.roll.default)
def roll_rule(call: OpCall) -> Plan:
    (spec,) = call.specs
    dims = _arg(call, 2, "dims", [])
    rolled = {normalize_dim(d, spec.ndim) for d in dims} if len(dims) else set(range(spec.ndim))
    ins, outs = map_shards(spec.placements, lambda d: None if d in rolled else d)
    return Plan([ins], [outs])


# ----------------------------------------------------------------------------------------------- indexing
def _all_replicated(call: OpCall, k: int) -> Placements:
    return tuple([REPLICATE] * call.mesh.ndim)


@register(aten.index_select.default)
def index_select_rule(call: OpCall) -> Plan:
    """``self`` keeps shards off ``dim``; a Shard(0) index with ``self`` whole on ``dim`` shards the output."""
    self_spec, idx_spec = call.specs
    if self_spec.ndim == 0:  # a 0-dim self takes exactly one index on every rank: nothing to shard
        return Plan([_all_replicated(call, 0), _all_replicated(call, 1)], [_all_replicated(call, 0)])
    dim = normalize_dim(call.args[1], self_spec.ndim)
    s_in, i_in, outs = [], [], []
    for p, q in zip(self_spec.placements, idx_spec.placements):
        if p.is_shard() and p.dim != dim:
            s_in.append(p), i_in.append(REPLICATE), outs.append(p)
        elif q.is_shard() and not (p.is_shard() or p.is_partial()):
            s_in.append(REPLICATE), i_in.append(q), outs.append(same_kind(q, dim))
        elif p.is_partial():
            s_in.append(p), i_in.append(REPLICATE), outs.append(p)
        else:
            s_in.append(REPLICATE), i_in.append(REPLICATE), outs.append(REPLICATE)
    return Plan([tuple(s_in), tuple(i_in)], [tuple(outs)])


def _advanced_index_layout(self_ndim: int, indices: Sequence) -> tuple[set[int], Callable[[int], int], int]:
    """(self dims consumed by index tensors, map from a kept self dim to its output dim, #index-result dims).

    Index tensors are broadcast together; a bool mask of k dims consumes k self dims and yields one dim. The
    result dims go where the indexed dims were when those are adjacent, else in front (numpy rules).
    """
    consumed: list[int] = []
    result_shapes = []
    pos = 0
    for idx in indices:
        if idx is None:
            pos += 1
            continue
        if idx.dtype in (torch.bool, torch.uint8):
            consumed.extend(range(pos, pos + idx.ndim))
            result_shapes.append((1,))
            pos += idx.ndim
        else:
            consumed.append(pos)
            result_shapes.append(tuple(idx.shape))
            pos += 1
    r = len(torch.broadcast_shapes(*result_shapes)) if result_shapes else 0
    cset = set(consumed)
    adjacent = bool(consumed) and consumed == list(range(consumed[0], consumed[0] + len(consumed)))
    first = consumed[0] if consumed else 0

    def out_dim(d: int) -> int:
        if adjacent:
            return d if d < first else d - len(consumed) + r
        return r + d - sum(c < d for c in cset)

    return cset, out_dim, r


@register(aten.index.Tensor)
def index_rule(call: OpCall) -> Plan:
    """``x[idx]``: indexed dims and the index tensors are replicated; the other dims keep their shards."""
    specs = call.specs
    self_spec = specs[0]
    consumed, out_dim, _ = _advanced_index_layout(self_spec.ndim, call.args[1])
    ins, outs = map_shards(self_spec.placements, lambda d: None if d in consumed else out_dim(d))
    return Plan([ins] + [_all_replicated(call, k) for k in range(1, len(specs))], [outs])


def _masked_fill_plan(call: OpCall) -> Plan | None:
    """``x[mask] = v`` (or ``+= v``) with one bool ``mask`` of ``x``'s shape and a single value ``v`` is
    elementwise, a ``masked_fill``: ``x`` keeps its shards and the mask is laid out like it, so a sharded
    ``x`` is written in place (``torch.optim.Rprop``: ``sign[sign.gt(0)] = etaplus`` on FSDP shards). ``None``
    for any other indexing, and for a partial ``x`` (setting is not linear)."""
    self_spec = call.specs[0]
    indices, values = call.args[1], call.args[2]
    if len(indices) != 1 or not isinstance(indices[0], DTensor) or indices[0].dtype != torch.bool:
        return None
    if tuple(indices[0].shape) != tuple(self_spec.shape) or values.numel() != 1 or values.ndim != 0:
        return None
    if self_spec.has_partial():
        return None
    ins = [tuple(self_spec.placements), tuple(self_spec.placements)]
    if isinstance(values, DTensor):
        ins.append(_all_replicated(call, 2))
    return Plan(ins, [] if call.func == aten.index_put_.default else [tuple(self_spec.placements)])


@register(aten.index_put.default, aten.index_put_.default)
def index_put_rule(call: OpCall) -> Plan:
    """``self[idx] = values`` (``accumulate`` adds). Per mesh dim: a shard of a non-indexed ``self`` dim stays
    (``values`` sharded alike, or replicated where it broadcasts); a sharded ``values`` dim shards the output
    (out of place); partial terms stay partial since the op is linear in (self, values) when ``self`` is a
    partial term too; indexed dims and index tensors are replicated."""
    masked = _masked_fill_plan(call)
    if masked is not None:
        return masked
    specs = call.specs
    self_spec = specs[0]
    values = call.args[2]
    val_spec = values._spec if isinstance(values, DTensor) else None
    n_idx = len(specs) - 1 - (val_spec is not None)
    consumed, out_dim, r = _advanced_index_layout(self_spec.ndim, call.args[1])
    lead = self_spec.ndim - len(consumed) + r - (val_spec.ndim if val_spec is not None else 0)
    inplace = call.func == aten.index_put_.default

    def val_dim(d: int) -> int | None:
        vd = out_dim(d) - lead
        ok = val_spec is not None and vd >= 0 and val_spec.shape[vd] == self_spec.shape[d] != 1
        return vd if ok else None

    s_in, v_in = [], []
    for i, p in enumerate(self_spec.placements):
        q = val_spec.placements[i] if val_spec is not None else REPLICATE
        src = None
        if q.is_shard() and not inplace:
            src = next((d for d in range(self_spec.ndim) if d not in consumed and val_dim(d) == q.dim), None)
        if p.is_shard() and p.dim not in consumed:
            vd = val_dim(p.dim)
            s, v = p, (same_kind(p, vd) if vd is not None else REPLICATE)
        elif src is not None and not p.is_partial():
            s, v = same_kind(q, src), q
        elif p.is_partial() and p.reduce_op == "sum" and (not q.is_partial() or q == p):
            s, v = p, p  # replicated values become a partial term (kept on one rank)
        elif q.is_partial() and q.reduce_op == "sum" and not inplace and not p.is_shard():
            s, v = q, q
        else:
            s, v = REPLICATE, REPLICATE  # for an in-place op on a sharded indexed dim: run_plan's clear error
        s_in.append(s)
        v_in.append(v)
    ins = [tuple(s_in)] + [_all_replicated(call, k) for k in range(n_idx)]
    if val_spec is not None:
        ins.append(tuple(v_in))
    return Plan(ins, [] if inplace else [tuple(s_in)])


@register(aten.gather.default)
def gather_rule(call: OpCall) -> Plan:
    """``out[i][j] = self[index[i][j]][j]`` (dim 0): an index shard along ``dim`` shards the output while
    ``self`` is whole on ``dim``; other dims stay sharded when ``self`` and ``index`` agree in length."""
    self_spec, idx_spec = call.specs
    if self_spec.ndim == 0:  # a 0-dim self takes exactly one index on every rank: nothing to shard
        return Plan([_all_replicated(call, 0), _all_replicated(call, 1)], [_all_replicated(call, 0)])
    dim = normalize_dim(call.args[1], self_spec.ndim)
    s_in, i_in, outs = [], [], []
    for p, q in zip(self_spec.placements, idx_spec.placements):
        same_len = (lambda d: self_spec.shape[d] == idx_spec.shape[d]) if self_spec.ndim else (lambda d: False)
        if q.is_shard() and q.dim == dim and not p.is_partial():
            s_in.append(REPLICATE), i_in.append(q), outs.append(q)
        elif p.is_shard() and p.dim != dim and same_len(p.dim):
            s_in.append(p), i_in.append(same_kind(p, p.dim)), outs.append(same_kind(p, p.dim))
        elif q.is_shard() and q.dim != dim and same_len(q.dim):
            s_in.append(same_kind(q, q.dim)), i_in.append(q), outs.append(q)
        elif p.is_partial():
            s_in.append(p), i_in.append(REPLICATE), outs.append(p)
        else:
            s_in.append(REPLICATE), i_in.append(REPLICATE), outs.append(REPLICATE)
    return Plan([tuple(s_in), tuple(i_in)], [tuple(outs)])


@register(aten.scatter_add.default, aten.scatter.src, aten.scatter_add_.default, aten.scatter_.src)
def scatter_rule(call: OpCall) -> Plan:
    """``self`` with ``src`` scattered along ``dim`` at ``index`` (the backward of gather / max.dim): dims
    other than ``dim`` stay sharded where all three agree in length; a partial ``src`` makes the result
    partial (``self`` becomes a partial term) since scattering is linear in (self, src)."""
    if len(call.specs) != 3:
        # A plain 0-dim argument (cummax's backward of a 0-dim input builds its zeros with at::zeros, not
        # from a DTensor): the fallback handles it, 0-dim tensors being the same on every rank.
        return None
    self_spec, idx_spec, src_spec = call.specs
    dim = normalize_dim(call.args[1], self_spec.ndim)
    inplace = call.is_inplace()
    ins: list[list[Placement]] = [[], [], []]
    outs = []
    for p, q, r in zip(self_spec.placements, idx_spec.placements, src_spec.placements):
        shard = next((x for x in (p, q, r) if x.is_shard() and x.dim != dim), None)
        if inplace:
            shard = p if p.is_shard() and p.dim != dim else None
        ok = shard is not None and all(
            s.ndim > shard.dim and s.shape[shard.dim] == self_spec.shape[shard.dim] for s in call.specs
        )
        if ok:
            per = [shard, shard, shard]
        elif r.is_partial() and r.reduce_op == "sum" and (p == r or (not inplace and p.is_replicate())):
            per = [r, REPLICATE, r]
        else:
            per = [REPLICATE] * 3
        if inplace and per[0] != p:
            per = [p, REPLICATE, REPLICATE]  # run_plan raises the in-place error with a clear message
        for k in range(3):
            ins[k].append(per[k])
        outs.append(per[0])
    return Plan([tuple(x) for x in ins], [] if inplace else [tuple(outs)])


@register(aten.index_add.default, aten.index_add_.default)
def index_add_rule(call: OpCall) -> Plan:
    """``self.index_add(dim, index, source)`` (the backward of index_select): dims other than ``dim`` stay
    sharded when ``self`` and ``source`` agree; a partial ``source`` makes the result partial."""
    self_spec, idx_spec, src_spec = call.specs
    dim = normalize_dim(call.args[1], self_spec.ndim)
    inplace = call.is_inplace()
    ins: list[list[Placement]] = [[], [], []]
    outs = []
    for p, r in zip(self_spec.placements, src_spec.placements):
        shard = p if p.is_shard() and p.dim != dim else None
        if shard is None and not inplace and r.is_shard() and r.dim != dim:
            shard = r
        if shard is not None and src_spec.shape[shard.dim] == self_spec.shape[shard.dim]:
            per = [shard, REPLICATE, shard]
        elif r.is_partial() and r.reduce_op == "sum" and (p == r or (not inplace and p.is_replicate())):
            per = [r, REPLICATE, r]
        else:
            per = [p if inplace else REPLICATE, REPLICATE, REPLICATE]
        for k in range(3):
            ins[k].append(per[k])
        outs.append(per[0])
    return Plan([tuple(x) for x in ins], [] if inplace else [tuple(outs)])


@register_custom(aten.index.Tensor)
def index_handler(func, args: tuple, kwargs: dict):
    """``x[idx]``; with a boolean mask the result's length is data-dependent (no meta run can tell it), so
    the op runs on the planned local inputs and the global shape is read off the local result."""
    call = make_call(func, args, kwargs)
    args = call.args  # DTensors on a sub-mesh come back aligned onto the op's mesh (tensor/_submesh.py)
    plan = index_rule(call)
    indices = args[1]
    if not any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return run_plan(call, plan)
    x: DTensor = args[0]
    wanted = iter(plan.inputs[1:])
    local_indices = [
        redistribute_local(i._local_tensor, i._spec, next(wanted)) if isinstance(i, DTensor) else i for i in indices
    ]
    out = func(redistribute_local(x._local_tensor, x._spec, plan.inputs[0]), local_indices)
    consumed, out_dim, _ = _advanced_index_layout(x.ndim, indices)
    shape = list(out.shape)
    for d in range(x.ndim):
        if d not in consumed:
            shape[out_dim(d)] = x.shape[d]  # kept dims have their global length
    stride = tuple(torch.empty(shape, device="meta").stride())
    spec = DTensorSpec(call.mesh, plan.outputs[0], torch.Size(shape), stride, out.dtype)
    return DTensor(out, spec, requires_grad=False)


def _register_copy_variants() -> None:
    """``view_copy``, ``permute_copy``, ``unsafe_split`` ...: the same layout as their view, without aliasing."""
    from lightning_shard.tensor.ops._registry import RULES

    pairs = [
        (name, name + "_copy")
        for name in (
            "view",
            "permute",
            "expand",
            "alias",
            "t",
            "transpose",
            "unsqueeze",
            "squeeze",
            "slice",
            "select",
            "split",
            "split_with_sizes",
            "unbind",
            "detach",
            "diagonal",
        )
    ]
    pairs += [("split", "unsafe_split"), ("split_with_sizes", "unsafe_split_with_sizes")]
    for view_name, copy_name in pairs:
        view, copy = getattr(aten, view_name, None), getattr(aten, copy_name, None)
        if view is None or copy is None:
            continue
        for overload in copy.overloads():
            rule = RULES.get(getattr(view, overload, None)) if overload in view.overloads() else None
            if rule is not None and "out" not in overload:
                RULES[getattr(copy, overload)] = rule


_register_copy_variants()
