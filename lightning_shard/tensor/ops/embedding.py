"""Embedding lookup (``embedding``) and its gradient (``embedding_dense_backward``).

Forward, per mesh dim, the cheapest of (``weight``, ``indices`` -> output):

===========================  ==============================================================================
``Replicate``, ``Shard(d)``   batch split: output ``Shard(d)`` like the indices
``Shard(1)``, ``Replicate``   column split: output ``Shard(-1)`` (each rank holds some embedding features)
``Shard(0)``, ``Replicate``   vocab (row) split: each rank looks up the rows it holds; indices outside its
                              range look up row 0 and are zeroed; output ``Partial("sum")``
``Partial``, ``Replicate``    the lookup is linear in the table: output the same ``Partial``
``Replicate``, ``Replicate``  output ``Replicate``
===========================  ==============================================================================

Backward (``grad_output``, ``indices`` -> ``grad_weight``): batch-split ``Shard(d), Shard(d)`` gives
``Partial("sum")`` (each rank scattered its own rows); ``Shard(-1), Replicate`` gives ``Shard(1)``;
a ``Partial`` gradient gives the same ``Partial``; replicated inputs give ``Replicate``, except for a
vocab-split table: ``grad_weight`` then comes back ``Shard(0)`` like the table, each rank scattering only the
indices in its own row range (the forward leaves a note on the indices tensor, which autograd saves for
the backward; ``embedding_dense_backward`` has no ``weight`` argument to look at). With
``scale_grad_by_freq`` the indices are replicated so that counts are global.

Uneven vocabularies (101 rows on 2 or 4 ranks) follow ``torch.chunk``; a rank that holds no rows returns
zeros. Example::

    table = distribute_tensor(torch.randn(101, 8), mesh, [Shard(0)])
    ids = distribute_tensor(torch.randint(0, 101, (4, 5)), mesh, [Replicate()])
    F.embedding(ids, table).placements      # (Partial('sum'),)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lightning_shard.tensor._layout import local_shape_and_offset
from lightning_shard.tensor.dispatch import make_call, register_custom, wrap_outputs
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.ops.matmul import cheapest
from lightning_shard.tensor.placements import Partial, Placement, Shard
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten

# indices DTensor -> (mesh, mesh dims on which the table was vocab-split, num_weights); see module docstring
_VOCAB_SPLIT: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(frozen=True)
class _Cand:
    inputs: tuple[Placement, Placement]
    output: Placement
    rank: int
    masked: bool = False


def _keep_or_shard(cur: Placement, dim: int) -> Placement:
    return cur if cur.is_shard(dim) else Shard(dim)


def _forward_candidates(w: Placement, x: Placement, idx_ndim: int) -> list[_Cand]:
    out = [_Cand((REPLICATE, _keep_or_shard(x, d)), _keep_or_shard(x, d), 0) for d in range(idx_ndim)]
    out.append(_Cand((Shard(1), REPLICATE), Shard(idx_ndim), 0))
    out.append(_Cand((Shard(0), REPLICATE), Partial("sum"), 1, masked=True))
    if w.is_partial() and w.reduce_op in ("sum", "avg"):
        out.append(_Cand((w, REPLICATE), w, 1))
    out.append(_Cand((REPLICATE, REPLICATE), REPLICATE, 2))
    return out


def _backward_candidates(g: Placement, x: Placement, idx_ndim: int, freq: bool, vocab: bool) -> list[_Cand]:
    if vocab:  # the table is vocab-split on this mesh dim: give its gradient the same layout
        return [_Cand((REPLICATE, REPLICATE), Shard(0), 0, masked=True)]
    out = []
    if not freq:  # counts for scale_grad_by_freq must see every index
        out += [_Cand((_keep_or_shard(x, d), _keep_or_shard(x, d)), Partial("sum"), 0) for d in range(idx_ndim)]
    out.append(_Cand((Shard(idx_ndim), REPLICATE), Shard(1), 0))
    if g.is_partial() and g.reduce_op in ("sum", "avg"):
        out.append(_Cand((g, REPLICATE), g, 1))
    out.append(_Cand((REPLICATE, REPLICATE), REPLICATE, 2))
    return out


def _row_range(weight_shape, placements, mesh) -> tuple[int, int]:
    shape, offset = local_shape_and_offset(weight_shape, placements, mesh.shape, mesh.get_coordinate())
    return offset[0], shape[0]


def _to_meta(a):
    if isinstance(a, DTensor):
        s = a._spec
        return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
    return a


def _localize(t: DTensor, want: tuple[Placement, ...]) -> torch.Tensor:
    return redistribute_local(t._local_tensor, t._spec, want)


@register_custom(aten.embedding.default)
def embedding_handler(func, args, kwargs):
    """``embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)`` on DTensors."""
    call = make_call(func, args, kwargs)
    args = call.args  # DTensors on a sub-mesh come back aligned onto the op's mesh (tensor/_submesh.py)
    weight, indices = args[0], args[1]
    wspec: DTensorSpec = weight._spec
    ispec: DTensorSpec = indices._spec
    w_want, i_want, out_p, vocab_dims = [], [], [], []
    for m in range(call.mesh.ndim):
        c = cheapest([wspec, ispec], m, _forward_candidates(wspec.placements[m], ispec.placements[m], ispec.ndim))
        w_want.append(c.inputs[0])
        i_want.append(c.inputs[1])
        out_p.append(c.output)
        if c.masked:
            vocab_dims.append(m)
    w_local = _localize(weight, tuple(w_want))
    i_local = _localize(indices, tuple(i_want))
    rest = args[2:]
    if vocab_dims:
        start, n = _row_range(wspec.shape, w_want, call.mesh)
        inside = (i_local >= start) & (i_local < start + n)
        if n == 0:
            out = w_local.new_zeros((*i_local.shape, w_local.shape[1]))
        else:
            out = func(w_local, torch.where(inside, i_local - start, 0), *rest, **kwargs)
            out = out.masked_fill(~inside.unsqueeze(-1), 0)
        _VOCAB_SPLIT[indices] = (call.mesh, tuple(vocab_dims), wspec.shape[0])
    else:
        out = func(w_local, i_local, *rest, **kwargs)
        _VOCAB_SPLIT.pop(indices, None)
    meta = func(_to_meta(weight), _to_meta(indices), *rest, **kwargs)
    return wrap_outputs(out, meta, [tuple(out_p)], call.mesh)


@register_custom(aten.embedding_dense_backward.default)
def embedding_backward_handler(func, args, kwargs):
    """``embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)``."""
    call = make_call(func, args, kwargs)
    args = call.args  # aligned onto one mesh, as above
    grad, indices = args[0], args[1]
    num_weights, padding_idx, freq = args[2], args[3], args[4]
    gspec: DTensorSpec = grad._spec
    ispec: DTensorSpec = indices._spec
    hint = _VOCAB_SPLIT.get(indices)
    vocab_dims = hint[1] if hint is not None and hint[0] == call.mesh and hint[2] == num_weights else ()
    g_want, i_want, out_p = [], [], []
    for m in range(call.mesh.ndim):
        cands = _backward_candidates(gspec.placements[m], ispec.placements[m], ispec.ndim, freq, m in vocab_dims)
        c = cheapest([gspec, ispec], m, cands)
        g_want.append(c.inputs[0])
        i_want.append(c.inputs[1])
        out_p.append(c.output)
    g_local = _localize(grad, tuple(g_want))
    i_local = _localize(indices, tuple(i_want))
    if vocab_dims:
        weight_p = tuple(out_p)  # Shard(0) on the vocab dims, Replicate elsewhere (grad and indices replicated)
        start, n = _row_range((num_weights, gspec.shape[-1]), weight_p, call.mesh)
        inside = (i_local >= start) & (i_local < start + n)
        # indices outside this rank's rows go to an extra row n that is dropped: they must neither add to
        # row 0 nor count towards its frequency
        local_idx = torch.where(inside, i_local - start, n)
        pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + n else -1
        out = func(g_local, local_idx, n + 1, pad, freq)[:n]
    else:
        out = func(g_local, i_local, *args[2:], **kwargs)
    meta = func(_to_meta(grad), _to_meta(indices), *args[2:], **kwargs)
    return wrap_outputs(out, meta, [tuple(out_p)], call.mesh)


__all__ = ["embedding_handler", "embedding_backward_handler"]
