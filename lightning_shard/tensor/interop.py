"""Zero-copy conversions between our ``DTensor`` and torch's ``torch.distributed.tensor.DTensor``.

Both sides share the local shard (same storage, same ``data_ptr``) and the process groups (``mesh.to_torch()``
/ ``DeviceMesh.from_torch``); placements map one to one (``Shard``, ``Replicate``, ``Partial(op)``,
``StridedShard`` <-> torch's private ``_StridedShard``), and the global shape and stride are kept, uneven
shards included. The conversions are autograd-transparent: gradients flow back across them.

Use them at the boundaries that need torch's type (torch.distributed.checkpoint, third-party code); the engine
itself never uses torch's DTensor.

Torch version notes: needs ``torch.distributed.tensor`` (public since torch 2.4; tested on 2.11 and 2.13).
``_StridedShard`` is private in torch and its layout for *uneven* sizes is not ours in general (torch chunks
the tensor into ``split_factor`` pieces first and deals chunks of every piece to each rank; ours applies
``torch.chunk`` step by step); both agree on even sizes and on every size when the mesh dims are of size 2.
A conversion whose layouts would differ raises a ``ValueError`` instead of silently moving data.

Example::

    t = to_torch_dtensor(x)                      # torch's DTensor over mesh.to_torch()
    y = from_torch_dtensor(t)                    # ours again; y.to_local().data_ptr() == x.to_local().data_ptr()
"""

from __future__ import annotations

import torch

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor._layout import local_range
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.placements import Partial, Placement, Replicate, Shard, StridedShard

__all__ = ["to_torch_dtensor", "from_torch_dtensor"]

# Our mesh -> torch's mesh over the same groups (building one is cheap, but keep one per mesh: torch caches
# per-mesh state such as its sharding propagation), and back (so a round trip returns the very same mesh).
_TORCH_MESHES: dict[DeviceMesh, object] = {}
_OUR_MESHES: dict[int, tuple[object, DeviceMesh]] = {}


def _torch_tensor_module():
    try:
        import torch.distributed.tensor as tdt
    except ImportError as e:  # torch < 2.4 named it torch.distributed._tensor
        raise ImportError(
            f"lightning_shard interop needs torch.distributed.tensor (torch >= 2.4); this is torch {torch.__version__}"
        ) from e
    return tdt


def _strided_shard_cls():
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError as e:
        raise RuntimeError(
            f"to_torch_dtensor/from_torch_dtensor: torch {torch.__version__} has no _StridedShard placement, so a "
            "StridedShard cannot be converted; redistribute the DTensor to Shard/Replicate placements first"
        ) from e
    return _StridedShard


def to_torch_dtensor(x: DTensor) -> torch.distributed.tensor.DTensor:
    """The same distributed tensor as torch's ``DTensor`` (shares ``x``'s local shard and process groups).

    >>> from lightning_shard import init_device_mesh
    >>> from lightning_shard.tensor import distribute_tensor
    >>> x = distribute_tensor(torch.randn(7, 5), init_device_mesh("cpu", (1,)), [Shard(0)])
    >>> t = to_torch_dtensor(x)
    >>> isinstance(t, torch.distributed.tensor.DTensor), t.placements
    (True, (Shard(dim=0),))
    >>> t.to_local().data_ptr() == x.to_local().data_ptr()
    True
    """
    if not isinstance(x, DTensor):
        raise TypeError(f"to_torch_dtensor: expected a lightning_shard DTensor, got {type(x).__name__}")
    tdt = _torch_tensor_module()
    mesh = x.device_mesh
    _check_strided_layout(x.shape, x.placements, mesh.shape, "to_torch_dtensor")
    if mesh not in _TORCH_MESHES:
        torch_mesh = mesh.to_torch()
        _TORCH_MESHES[mesh] = torch_mesh
        _OUR_MESHES[id(torch_mesh)] = (torch_mesh, mesh)
    placements = [_to_torch_placement(p, tdt) for p in x.placements]
    # to_local() and torch's from_local are both views under autograd: no copy, gradients flow through.
    return tdt.DTensor.from_local(
        x.to_local(), _TORCH_MESHES[mesh], placements, shape=x.shape, stride=x.stride(), run_check=False
    )


def from_torch_dtensor(t: torch.distributed.tensor.DTensor) -> DTensor:
    """Our ``DTensor`` for torch's DTensor ``t`` (shares its local shard and process groups).

    Example::

        t = torch.distributed.tensor.distribute_tensor(w, mesh.to_torch(), [Shard(1)])
        x = from_torch_dtensor(t)      # lightning_shard DTensor, placements (Shard(dim=1),)
    """
    tdt = _torch_tensor_module()
    if not isinstance(t, tdt.DTensor):
        raise TypeError(f"from_torch_dtensor: expected torch.distributed.tensor.DTensor, got {type(t).__name__}")
    known = _OUR_MESHES.get(id(t.device_mesh))
    mesh = known[1] if known is not None and known[0] is t.device_mesh else DeviceMesh.from_torch(t.device_mesh)
    placements = tuple(_from_torch_placement(p, tdt) for p in t.placements)
    _check_strided_layout(t.shape, placements, mesh.shape, "from_torch_dtensor")
    return DTensor.from_local(t.to_local(), mesh, placements, shape=t.shape, stride=t.stride())


def _to_torch_placement(p: Placement, tdt):
    if isinstance(p, StridedShard):
        return _strided_shard_cls()(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return tdt.Shard(p.dim)
    if isinstance(p, Partial):
        return tdt.Partial(p.reduce_op)
    return tdt.Replicate()


def _from_torch_placement(p, tdt) -> Placement:
    if type(p).__name__ == "_StridedShard":  # checked by name: the class is private and may move
        return StridedShard(p.dim, split_factor=int(p.split_factor))
    if p.is_shard():
        return Shard(p.dim)
    if p.is_partial():
        op = str(p.reduce_op)
        if op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"from_torch_dtensor: Partial({op!r}) has no lightning_shard equivalent")
        return Partial(op)
    if p.is_replicate():
        return Replicate()
    raise ValueError(f"from_torch_dtensor: torch placement {p!r} has no lightning_shard equivalent")


def _check_strided_layout(shape, placements, mesh_shape, what: str) -> None:
    """Raise if, on a tensor dim with a StridedShard, torch's layout differs from ours on any rank."""
    dims = {p.dim for p in placements if isinstance(p, StridedShard)}
    if not dims:
        return
    for coord in _all_coords(mesh_shape):
        for d in dims:
            offset, length = local_range(shape[d], placements, d, mesh_shape, coord)
            if _torch_indices(shape[d], placements, d, mesh_shape, coord) != list(range(offset, offset + length)):
                raise ValueError(
                    f"{what}: placements {list(placements)} on a tensor of shape {tuple(shape)} over a mesh of "
                    f"shape {tuple(mesh_shape)} have a different layout in torch's _StridedShard (uneven "
                    "shards); redistribute to Shard/Replicate placements first"
                )


def _all_coords(mesh_shape):
    n = 1
    for s in mesh_shape:
        n *= s
    for flat in range(n):
        coord = []
        for s in reversed(mesh_shape):
            coord.append(flat % s)
            flat //= s
        yield tuple(reversed(coord))


def _torch_indices(size: int, placements, dim: int, mesh_shape, coord) -> list[int]:
    """Global indices along ``dim`` held at ``coord`` under torch's rules (mesh dims left to right)."""
    idx = torch.arange(size)
    for i in range(len(placements)):
        p = placements[i]
        if not p.is_shard(dim):
            continue
        n, k = mesh_shape[i], coord[i]
        if isinstance(p, StridedShard):
            pieces = _chunks(idx, p.split_factor)
            idx = torch.cat([_chunks(piece, n)[k] for piece in pieces])
        else:
            idx = _chunks(idx, n)[k]
    return idx.tolist()


def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    out = list(torch.chunk(t, n))
    return out + [t[:0]] * (n - len(out))
