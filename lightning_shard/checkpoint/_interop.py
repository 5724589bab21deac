"""Our DTensor <-> torch's DTensor at the checkpoint boundary (zero-copy, same process groups).

Uses ``lightning_shard.tensor.interop`` when it exists; until then a minimal private converter. Both share the
local tensor's storage, so DCP reading into the torch DTensor writes straight into our shard.

Example::

    tdt = to_torch(p)            # torch.distributed.tensor.DTensor viewing p's local shard
    ours = from_torch(tdt, mesh) # back, for values that arrive as torch DTensors
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import DTensor, Partial, Placement, Replicate, Shard, StridedShard

# Building torch's DeviceMesh over our groups is cheap but not free; keep one per mesh object.
_TORCH_MESHES: dict[int, tuple[DeviceMesh, object]] = {}


def torch_mesh(mesh: DeviceMesh):
    """torch's DeviceMesh over ``mesh``'s groups, cached per mesh object."""
    hit = _TORCH_MESHES.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        hit = (mesh, mesh.to_torch())
        _TORCH_MESHES[id(mesh)] = hit
    return hit[1]


def _torch_placement(p: Placement):
    if isinstance(p, StridedShard):
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return TorchShard(p.dim)
    if isinstance(p, Replicate):
        return TorchReplicate()
    if isinstance(p, Partial):
        return TorchPartial(p.reduce_op)
    raise TypeError(f"lightning_shard.checkpoint: cannot convert placement {p!r} to torch's")


def _our_placement(p) -> Placement:
    split = getattr(p, "split_factor", None)
    if split is not None and p.is_shard():
        return StridedShard(p.dim, split)
    if p.is_shard():
        return Shard(p.dim)
    if p.is_replicate():
        return Replicate()
    if p.is_partial():
        return Partial(p.reduce_op)
    raise TypeError(f"lightning_shard.checkpoint: cannot convert torch placement {p!r}")


def to_torch(x: DTensor) -> TorchDTensor:
    """torch's DTensor viewing ``x``'s local shard (no copy, no communication)."""
    local = x._local_tensor
    if local.device.type != x.device_mesh.device_type and not local.is_meta:
        return _wrap_host_shard(x)
    try:  # prefer the shared converter once it exists
        from lightning_shard.tensor.interop import to_torch_dtensor  # type: ignore[import-not-found]

        return to_torch_dtensor(x)
    except ImportError:
        pass
    spec = x._spec
    with torch.no_grad():
        return TorchDTensor.from_local(
            x._local_tensor,
            torch_mesh(spec.mesh),
            [_torch_placement(p) for p in spec.placements],
            shape=spec.shape,
            stride=spec.stride,
            run_check=False,
        )


def _wrap_host_shard(x: DTensor) -> TorchDTensor:
    """torch's DTensor around a shard that lives off the mesh's device (a CPU-offloaded shard on an accelerator
    mesh). torch's ``from_local`` would copy it to the accelerator: a save would then hold the offloaded state
    in device memory, and a load would write into that copy instead of the shard. The constructor wraps it."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = x._spec
    meta = TensorMeta(torch.Size(spec.shape), tuple(spec.stride), x._local_tensor.dtype)
    placements = tuple(_torch_placement(p) for p in spec.placements)
    torch_spec = DTensorSpec(torch_mesh(spec.mesh), placements, meta)
    return TorchDTensor(x._local_tensor, torch_spec, requires_grad=x.requires_grad)


def from_torch(x: TorchDTensor, mesh: DeviceMesh | None = None) -> DTensor:
    """Our DTensor viewing torch DTensor ``x``'s local shard (over ``mesh`` if given, else its groups)."""
    try:
        from lightning_shard.tensor.interop import from_torch_dtensor  # type: ignore[import-not-found]

        return from_torch_dtensor(x)
    except ImportError:
        pass
    mesh = mesh if mesh is not None else DeviceMesh.from_torch(x.device_mesh)
    with torch.no_grad():
        return DTensor.from_local(
            x._local_tensor,
            mesh,
            [_our_placement(p) for p in x.placements],
            shape=x.shape,
            stride=x.stride(),
        )
