"""Random ops on DTensors give exactly the values one device gives for the same seed.

How: every rank runs the same op on a full-size tensor of the global shape, strides and dtype, on its own
device with its own generator (all ranks are seeded alike, as with ``torch.manual_seed`` in SPMD code), and
keeps its local part. So every rank consumes the same amount of random state and stays in sync, and ranks
holding the same shard agree. The cost is generating the full tensor on every rank (memory of one full
tensor, transiently); a counter-based per-shard generator could avoid it later.

- In-place ops (``normal_``, ``uniform_``, ``bernoulli_``, ``exponential_``, ``random_``, ...): fill a full
  tensor, keep the local part; ``self`` keeps its placements (a ``Partial`` self gets the value as one term).
- Out-of-place ops (``rand_like``, ``randn_like``, ``randint_like``, ``bernoulli``, ``normal(mean, std)``,
  ...): DTensor arguments are made whole, the op runs on full tensors, and the result is laid out like the
  first argument (``Partial`` -> ``Replicate``), or ``Replicate`` if its shape differs.
- ``native_dropout``: the mask comes from ``native_dropout`` on a full-size dummy of the same dtype (same
  random stream as a single device); the output is ``x * (mask * scale)`` on the local shard, which is how
  the CPU kernel computes it (bit-exact for float16/bfloat16/float32/float64 on CPU).

Example::

    torch.manual_seed(0)
    x = distribute_tensor(torch.empty(7, 5), mesh, [Shard(0)]).normal_()
    torch.manual_seed(0)
    assert torch.equal(x.full_tensor(), torch.empty(7, 5).normal_())
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from lightning_shard.tensor.dispatch import register_custom
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops._common import REPLICATE
from lightning_shard.tensor.placements import Placement, Shard
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

aten = torch.ops.aten


def _replicated(spec: DTensorSpec) -> DTensorSpec:
    return spec.with_placements(tuple([REPLICATE] * spec.mesh.ndim))


def _full(t: DTensor) -> torch.Tensor:
    """The whole value of ``t`` on this rank (collectives on every rank alike)."""
    return redistribute_local(t._local_tensor, t._spec, _replicated(t._spec).placements)


def _full_like_spec(spec: DTensorSpec, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)


def _local_part(
    full: torch.Tensor, spec: DTensorSpec, placements: tuple[Placement, ...], *, compact: bool = True
) -> torch.Tensor:
    """This rank's part of ``full`` laid out as ``placements`` (a partial keeps the value as one term);
    ``compact=False``: possibly a view into a buffer the redistribution made (for a part copied right away)."""
    src = DTensorSpec(spec.mesh, _replicated(spec).placements, full.shape, tuple(full.stride()), full.dtype)
    return redistribute_local(full, src, placements, compact=compact)


def _local_view(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor | None:
    """This rank's part of ``full`` as a view (no copy) when every placement is ``Shard`` (``torch.chunk``
    semantics, mesh dims left to right) or ``Replicate``; ``None`` for other layouts (strided shards, partials,
    a rank past the last chunk)."""
    out = full
    for mesh_dim, placement in enumerate(spec.placements):
        if type(placement) is Shard:
            chunks = out.chunk(spec.mesh.size(mesh_dim), placement.dim)
            coord = spec.mesh.get_local_rank(mesh_dim)
            if coord >= len(chunks):
                return None
            out = chunks[coord]
        elif not placement.is_replicate():
            return None
    return out


def random_inplace_handler(func, args: tuple, kwargs: dict):
    """``self.op_(...)``: fill a full-size tensor with the op, keep this rank's part in ``self``. The part is
    read through a view where the layout allows, so initialising a parameter holds one full-size tensor, not
    two (the largest parameter's draw is the peak of materialising a sharded model)."""
    self: DTensor = args[0]
    spec = self._spec
    rest_args, rest_kwargs = pytree.tree_map(lambda a: _full(a) if isinstance(a, DTensor) else a, (args[1:], kwargs))
    full = _full_like_spec(spec, self._local_tensor.device)
    func(full, *rest_args, **rest_kwargs)
    part = _local_view(full, spec)
    if part is None or part.shape != self._local_tensor.shape:
        part = _local_part(full, spec, spec.placements, compact=False)  # copied into self just below
    self._local_tensor.copy_(part)
    return self


def random_outofplace_handler(func, args: tuple, kwargs: dict):
    """``op(x, ...)``: run the op on whole tensors, lay the result out like the first DTensor argument."""
    dts = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    first: DTensor = dts[0]
    full_args, full_kwargs = pytree.tree_map(lambda a: _full(a) if isinstance(a, DTensor) else a, (args, kwargs))
    out = func(*full_args, **full_kwargs)
    mesh = first.device_mesh
    if tuple(out.shape) == tuple(first.shape):
        placements = tuple(REPLICATE if p.is_partial() else p for p in first.placements)
    else:
        placements = tuple([REPLICATE] * mesh.ndim)
    spec = DTensorSpec(mesh, placements, out.shape, tuple(out.stride()), out.dtype)
    local = _local_part(out, spec, placements)
    return DTensor(local, spec, requires_grad=False)


@register_custom(aten.native_dropout.default)
def native_dropout_handler(func, args: tuple, kwargs: dict):
    """Dropout: the full-size mask from the same op (same random stream), the output on the local shard."""
    x: DTensor = args[0]
    p = float(args[1] if len(args) > 1 else kwargs["p"])
    train = args[2] if len(args) > 2 else kwargs.get("train")
    spec = x._spec
    local_x = x._local_tensor
    dummy = torch.ones(spec.shape, dtype=spec.dtype, device=local_x.device)
    _, full_mask = func(dummy, p, train)
    # Dropout is linear in a partial input (each term is masked alike), so only the mask is made whole.
    mask_placements = tuple(REPLICATE if q.is_partial() else q for q in spec.placements)
    mask = _local_part(full_mask, spec, mask_placements)
    if train is False or spec.shape.numel() == 0:
        out = local_x.clone()
    else:
        p1m = 1.0 - p
        scale = 0.0 if p1m == 0 else 1.0 / p1m
        out = local_x * (mask.to(local_x.dtype) * scale)  # the CPU kernel's formula, bit for bit
    meta_out, meta_mask = func(torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta"), p, train)
    out_spec = DTensorSpec(spec.mesh, spec.placements, spec.shape, tuple(meta_out.stride()), out.dtype)
    mask_spec = DTensorSpec(spec.mesh, mask_placements, spec.shape, tuple(meta_mask.stride()), mask.dtype)
    return DTensor(out, out_spec, requires_grad=False), DTensor(mask, mask_spec, requires_grad=False)


def _register_all() -> None:
    for s in torch._C._jit_get_all_schemas():
        if not s.name.startswith("aten::") or "out" in s.overload_name:
            continue
        name = s.name.split("::")[1]
        packet = getattr(aten, name, None)
        if packet is None or name == "native_dropout":
            continue
        op = getattr(packet, s.overload_name or "default", None)
        if op is None or torch.Tag.nondeterministic_seeded not in op.tags:
            continue
        args = op._schema.arguments
        if not args or str(args[0].type) != "Tensor":
            continue  # factories like rand(size) never see a DTensor
        mutable = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
        if name.endswith("_") and len(mutable) == 1 and mutable[0] is args[0]:
            register_custom(op)(random_inplace_handler)
        elif not mutable and len(op._schema.returns) == 1:
            register_custom(op)(random_outofplace_handler)


_register_all()
