"""Ops that mix some dims of their input and treat every other dim as an independent batch: pooling,
upsampling, padding, group norm, matrix decompositions (last two dims), and ``dim``-wise ops (sort, topk,
cummax, kthvalue, median, mode, glu, cross, index_fill/index_copy/index_reduce, diagonal).

Rule: the mixed dims must be whole, so a shard on one of them is gathered (and every ``Partial`` reduced);
shards on the other dims stay, and each output keeps them at the dim they move to (a ``keepdim=False``
reduction shifts the later dims down by one). Other tensor inputs of the same shape (``max_unpool``'s indices,
``cross``'s other, ``index_copy``'s source) follow the first input's layout; the rest (weights, index
vectors) are replicated.

Example: ``F.max_pool2d(x, 2)`` on ``x`` of shape ``(N, C, H, W)`` with ``(Shard(0),)`` runs locally and
returns ``(Shard(0),)`` values and indices; with ``(Shard(2),)`` the rows are gathered first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_shard.tensor.ops._common import REPLICATE, normalize_dim
from lightning_shard.tensor.ops._registry import OpCall, Plan, register
from lightning_shard.tensor.ops.views import _n_outputs, local_shape, same_kind
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten

MixedDims = Callable[[OpCall, DTensorSpec], "tuple[set[int], Callable[[int], int | None]]"]


def _arg(call: OpCall, name: str, default=None):
    for i, a in enumerate(call.func._schema.arguments):
        if a.name == name:
            if i < len(call.args) and not a.kwarg_only:
                return call.args[i]
            if name in call.kwargs:
                return call.kwargs[name]
            return a.default_value if a.has_default_value() else default
    return default


def dimwise(mixed: MixedDims, side_inputs: bool = False, replicated: tuple[int, ...] = (), vectors: bool = False):
    """A rule from ``mixed(call, spec) -> (dims that must be whole, output dim of each kept dim)``.

    Another tensor input with the first's ndim and sizes on its sharded dims follows its layout; a 0-dim one
    is replicated; any other (one that could broadcast against the kept dims) makes every input replicated,
    unless ``side_inputs`` says the op applies such inputs along the mixed dims only (group norm's weight,
    an index vector). The DTensor inputs at ``replicated`` positions (bucketize's boundaries, prelu's weight)
    are always replicated, whatever their shape. With ``vectors``, an input of one dim less is a vector per
    matrix of the first input (pivots, ``tau``): it has the same batch dims and follows their shards."""

    def rule(call: OpCall) -> Plan | None:
        first = call.specs[0]
        dims, out_dim = mixed(call, first)
        # Several ops refuse an empty input (group norm of an empty batch) and would raise on the ranks holding
        # nothing only: keep a shard only where every rank holds a piece.
        ways = {}
        for i, p in enumerate(first.placements):
            if p.is_shard():
                ways[p.dim] = ways.get(p.dim, 1) * call.mesh.size(i)
        ins, outs = [], []
        for p in first.placements:
            keep = p.is_shard() and p.dim not in dims and first.shape[p.dim] >= ways[p.dim]
            if keep and out_dim(p.dim) is not None:
                ins.append(p)
                outs.append(same_kind(p, out_dim(p.dim)))
            else:
                ins.append(REPLICATE)
                outs.append(REPLICATE)
        ins, rep = tuple(ins), tuple([REPLICATE] * call.mesh.ndim)
        sharded = [p.dim for p in ins if p.is_shard()]
        inputs = [ins]
        for k, s in enumerate(call.specs[1:], 1):
            if k in replicated:
                inputs.append(rep)
            elif (s.ndim == first.ndim or vectors and s.ndim == first.ndim - 1) and all(
                d < s.ndim and s.shape[d] == first.shape[d] for d in sharded
            ):
                inputs.append(ins)
            elif s.ndim == 0 or side_inputs or not sharded:
                inputs.append(rep)
            else:
                return Plan([rep] * len(call.specs), [rep] * _n_outputs_of(call))
        return Plan(inputs, [tuple(outs)] * _n_outputs_of(call))

    return rule


def _n_outputs_of(call: OpCall) -> int:
    returns = call.func._schema.returns
    if all(str(r.type) == "Tensor" for r in returns):
        return len(returns)  # from the schema: some ops (geqrf) have no meta kernel to count them
    return _n_outputs(call)


def _same(d: int) -> int:
    return d


def last_dims(k: int | Callable[[OpCall, DTensorSpec], int]) -> MixedDims:
    """The last ``k`` dims are mixed; the leading dims are batch dims of every output."""

    def mixed(call: OpCall, spec: DTensorSpec):
        n = k(call, spec) if callable(k) else k
        return set(range(spec.ndim - n, spec.ndim)), _same

    return mixed


def along_dim(default: int = -1, keepdim_arg: bool = False, reduces: bool = True) -> MixedDims:
    """The op's ``dim`` argument is mixed; with ``keepdim=False`` it disappears from the outputs."""

    def mixed(call: OpCall, spec: DTensorSpec):
        dim = normalize_dim(_arg(call, "dim", default), spec.ndim)
        drop = keepdim_arg and reduces and not _arg(call, "keepdim", False) and spec.ndim > 0
        return {dim}, (lambda d: d - 1 if drop and d > dim else d)

    return mixed


def _group_norm(call: OpCall, spec: DTensorSpec):
    return set(range(1, spec.ndim)), _same


_group_norm_dims = dimwise(_group_norm, side_inputs=True)


def _group_norm_rule(call: OpCall) -> Plan | None:
    """``native_group_norm(input, weight, bias, N, C, HxW, group, eps)`` names the batch size: the local call
    gets the local one."""
    plan = _group_norm_dims(call)
    n_local = local_shape(call.specs[0].shape, plan.inputs[0], call.mesh)[0]
    plan.local_args = ((*call.args[:3], n_local, *call.args[4:]), call.kwargs)
    return plan


def _diagonal(call: OpCall, spec: DTensorSpec):
    d1 = normalize_dim(_arg(call, "dim1", 0), spec.ndim)
    d2 = normalize_dim(_arg(call, "dim2", 1), spec.ndim)
    return {d1, d2}, (lambda d: d - (d > d1) - (d > d2))


def _diag_embed(call: OpCall, spec: DTensorSpec):
    # the output inserts two dims at dim1/dim2 (of the output); the input's leading dims stay in front only for
    # the default placement at the end
    d1, d2 = _arg(call, "dim1", -2), _arg(call, "dim2", -1)
    out_nd = spec.ndim + 1
    if {normalize_dim(d1, out_nd), normalize_dim(d2, out_nd)} != {out_nd - 2, out_nd - 1}:
        return set(range(spec.ndim)), _same
    return {spec.ndim - 1}, _same


def _pad(call: OpCall, spec: DTensorSpec):
    """Dims padded (or cropped) by a nonzero amount; ``pad`` lists (before, after) pairs from the last dim back
    (the FFTs pad every dim, most by zero)."""
    pad = list(call.args[1])
    return {spec.ndim - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}, _same


def _rot90(call: OpCall, spec: DTensorSpec):
    return {normalize_dim(d, spec.ndim) for d in _arg(call, "dims", [0, 1])}, _same


def _whole(call: OpCall, spec: DTensorSpec):
    """Every dim is mixed: a global reduction (median, trace, histc, dist) runs on the replicated input."""
    return set(range(spec.ndim)), _same


def _aminmax(call: OpCall, spec: DTensorSpec):
    if _arg(call, "dim") is None:
        return _whole(call, spec)
    return along_dim(0, keepdim_arg=True)(call, spec)


def _no_dims(call: OpCall, spec: DTensorSpec):
    return set(), _same


def _channel(call: OpCall, spec: DTensorSpec):
    """prelu's weight applies along dim 1 (dim 0 of a 1-dim input)."""
    return {1 if spec.ndim >= 2 else 0}, _same


def _check_errors_rule(call: OpCall) -> Plan:
    """The matrix functions' ``info`` check: on the whole (small) ``info``, so every rank raises alike."""
    return Plan([tuple([REPLICATE] * call.mesh.ndim)], [])


def _register() -> None:
    spatial = {
        1: [
            "upsample_nearest1d",
            "_upsample_nearest_exact1d",
            "upsample_linear1d",
            "reflection_pad1d",
            "replication_pad1d",
            # backwards: grad_output first; self (and indices) share its batch and channel dims
            "reflection_pad1d_backward",
            "replication_pad1d_backward",
        ],
        2: [
            "max_pool2d_with_indices_backward",  # grad_output first; self and indices have its shape
            "avg_pool2d_backward",
            "_adaptive_avg_pool2d_backward",
            "adaptive_max_pool2d_backward",
            "reflection_pad2d_backward",
            "replication_pad2d_backward",
            "tril",
            "triu",
            "avg_pool2d",
            "max_pool2d_with_indices",
            "_adaptive_avg_pool2d",
            "adaptive_max_pool2d",
            "upsample_nearest2d",
            "_upsample_nearest_exact2d",
            "upsample_bilinear2d",
            "upsample_bicubic2d",
            "_upsample_bilinear2d_aa",
            "max_unpool2d",
            "reflection_pad2d",
            "replication_pad2d",
            "grid_sampler_2d",  # input (N, C, H, W), grid (N, H', W', 2): only N is a batch dim of both
            # matrix functions act on the last two dims
            "cholesky",
            "cholesky_inverse",
            "linalg_matrix_exp",
            "linalg_qr",
            "_linalg_svd",
            "linalg_lu_factor_ex",
            "geqrf",
            "linalg_inv_ex",
            "linalg_cholesky_ex",
            "_linalg_det",
            "_linalg_slogdet",
            "_linalg_eigh",
            "linalg_eig",
            "linalg_lu",
            "linalg_ldl_factor_ex",
            "linalg_pinv",
            # solves: the other matrices follow the first one's batch shards when they have its batch shape
            "_linalg_solve_ex",
            "linalg_solve_triangular",
            "cholesky_solve",
            "triangular_solve",
        ],
        3: [
            "avg_pool3d",
            "max_pool3d_with_indices",
            "_adaptive_avg_pool3d",
            "adaptive_max_pool3d",
            "upsample_nearest3d",
            "_upsample_nearest_exact3d",
            "upsample_trilinear3d",
            "max_unpool3d",
            "reflection_pad3d",
            "replication_pad3d",
            "avg_pool3d_backward",
            "_adaptive_avg_pool3d_backward",
            "adaptive_max_pool3d_backward",
            "max_pool3d_with_indices_backward",
            "reflection_pad3d_backward",
            "replication_pad3d_backward",
            "pixel_shuffle",  # (*, C, H, W): channels move into the spatial dims
            "pixel_unshuffle",
            "channel_shuffle",
        ],
        4: ["grid_sampler_3d"],
    }
    for k, names in spatial.items():
        for name in names:
            packet = getattr(aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                if "out" not in overload and "backward" not in overload:
                    register(getattr(packet, overload))(dimwise(last_dims(k)))
    register(aten.view_as_complex.default)(dimwise(last_dims(1)))
    # matrices with a vector per matrix (pivots, tau: one dim less, the same batch dims)
    register(
        aten.linalg_lu_solve.default,
        aten.linalg_ldl_solve.default,
        aten.lu_unpack.default,
        aten.ormqr.default,
        aten.linalg_householder_product.default,
    )(dimwise(last_dims(2), vectors=True))
    register(aten.view_as_real.default)(dimwise(_no_dims))  # a new last dim (real, imag): every shard stays
    register(aten.rot90.default)(dimwise(_rot90))
    register(aten.median.default, aten.nanmedian.default, aten.trace.default)(dimwise(_whole))
    register(aten.histc.default, aten.dist.default)(dimwise(_whole))
    register(aten.aminmax.default)(dimwise(_aminmax))
    register(aten.bucketize.Tensor)(dimwise(_no_dims, replicated=(1,)))
    register(aten._prelu_kernel.default)(dimwise(_channel, replicated=(1,)))
    register(aten.narrow_copy.default, aten.slice_scatter.default)(dimwise(along_dim(0, reduces=False)))
    register(aten._linalg_check_errors.default)(_check_errors_rule)
    register(aten.constant_pad_nd.default)(dimwise(_pad))
    register(aten.native_group_norm.default)(_group_norm_rule)
    register(aten.diagonal.default, aten.diagonal_copy.default)(dimwise(_diagonal))
    register(aten.diag_embed.default)(dimwise(_diag_embed))
    register(aten.sort.default, aten.sort.stable, aten.cummax.default, aten.cummin.default)(
        dimwise(along_dim(-1, reduces=False))
    )
    register(aten.topk.default)(dimwise(along_dim(-1, reduces=False)))
    register(aten.kthvalue.default, aten.mode.default)(dimwise(along_dim(-1, keepdim_arg=True)))
    register(aten.median.dim, aten.nanmedian.dim)(dimwise(along_dim(-1, keepdim_arg=True)))
    register(aten.glu.default)(dimwise(along_dim(-1, reduces=False)))
    # grad_output has half of self's length on dim; every other dim keeps the shards both share
    register(aten.glu_backward.default)(dimwise(along_dim(-1, reduces=False)))
    register(aten.linalg_cross.default)(dimwise(along_dim(-1, reduces=False)))
    register(
        aten.index_fill.int_Scalar,
        aten.index_fill.int_Tensor,
        aten.index_copy.default,
        aten.index_reduce.default,
    )(dimwise(along_dim(0, reduces=False), side_inputs=True))


_register()
