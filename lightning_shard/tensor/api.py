"""Entry points that make DTensors from plain tensors and modules: ``distribute_tensor``, ``distribute_module``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_shard import comm
from lightning_shard.device import same_storage
from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor._layout import check_placements
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.grad_hooks import carry_over_grad_hooks
from lightning_shard.tensor.placements import Placement, Replicate
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

__all__ = ["distribute_tensor", "distribute_module"]


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Split ``tensor`` over ``device_mesh`` as ``placements`` (default: all ``Replicate``).

    The value is taken from the rank with index ``src_data_rank`` along each mesh dim (one broadcast per mesh
    dim), so every rank ends up with a shard of the same tensor; ``src_data_rank=None`` skips the broadcast
    and trusts each rank's own copy. The result is a leaf that requires grad like ``tensor``.

    Example: ``distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])`` (4 and 3 rows on 2 ranks); on one rank:

    >>> from lightning_shard import init_device_mesh
    >>> from lightning_shard.tensor import Shard
    >>> distribute_tensor(torch.randn(7, 5), init_device_mesh("cpu", (1,)), [Shard(0)]).to_local().shape
    torch.Size([7, 5])
    """
    if isinstance(tensor, DTensor):
        raise ValueError("distribute_tensor: the tensor is already a DTensor; use .redistribute(mesh, placements)")
    placements = placements if placements is not None else [Replicate()] * device_mesh.ndim
    placements = check_placements(placements, tensor.ndim, device_mesh.ndim, "distribute_tensor")
    full = tensor.detach()
    if src_data_rank is not None:
        full = full.contiguous().clone()
        with comm.host_collectives_for(full):  # a host tensor is split on the host (a model built there)
            for i in range(device_mesh.ndim):
                comm.broadcast(full, src_data_rank, device_mesh.get_group(i))
    stride = torch.empty(tensor.shape, device="meta").stride()
    spec = DTensorSpec(device_mesh, placements, tensor.shape, stride, tensor.dtype)
    replicated = spec.with_placements(tuple([Replicate()] * device_mesh.ndim))
    local = redistribute_local(full.contiguous(), replicated, placements)
    if same_storage(local, tensor) or local.untyped_storage().nbytes() > local.numel() * local.element_size():
        # Never alias the caller's tensor (a chunk of it is a view too), and never keep the whole broadcast
        # buffer alive behind a chunk of it: a Shard(0) parameter would hold the full parameter's bytes.
        local = local.clone()
    return DTensor(local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad)


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable | None = None,
    output_fn: Callable | None = None,
) -> nn.Module:
    """Turn ``module``'s parameters and buffers into DTensors and install input/output conversion hooks.

    ``partition_fn(name, submodule, mesh)`` is called for every submodule and may replace its parameters
    with DTensors; any parameter or buffer still plain afterwards is replicated. ``input_fn(module, inputs,
    mesh)`` runs before forward (its return value, if not None, replaces the inputs) and ``output_fn(module,
    outputs, mesh)`` after it.

    Example::

        distribute_module(model, mesh, input_fn=lambda m, inputs, mesh: tuple(
            distribute_tensor(x, mesh, [Shard(0)]) for x in inputs))
    """
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, device_mesh)
        _replicate_plain_tensors(sub, device_mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda m, inputs: input_fn(m, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda m, inputs, outputs: output_fn(m, outputs, device_mesh))
    return module


def _replicate_plain_tensors(module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            dt = distribute_tensor(param.data, mesh, src_data_rank=None)
            new = nn.Parameter(dt, requires_grad=param.requires_grad)
            carry_over_grad_hooks(param, new)  # the user's register_hook / post-accumulate-grad hooks
            module.register_parameter(key, new)
    for key, buf in list(module._buffers.items()):
        if buf is not None and not isinstance(buf, DTensor):
            module._buffers[key] = distribute_tensor(buf, mesh, src_data_rank=None)
