"""User-called collectives under tensor parallelism: each data-parallel replica counted once.

The ranks of one tensor-parallel group train on the same batch, so a value computed from it (a loss, a count, a
batch of embeddings) is the same on each of them. Over the world, a sum counts it ``tensor_parallel_size`` times
and a gather holds it ``tensor_parallel_size`` times: a CLIP-style contrastive loss over ``all_gather``-ed
embeddings then sees every negative twice under TP 2, a silently different loss and gradient from one process on
the same global batch. The strategies' default-group collectives (``fabric.all_reduce``, ``fabric.all_gather``,
``LightningModule.all_gather``, ``self.log(..., sync_dist=True)``) therefore run over the data-parallel replicas:

* a sum over the world is divided by the TP size (exactly the data-parallel sum when the TP ranks agree, their
  mean otherwise; the same value on every rank either way); means, max and min need no change;
* a gather keeps, from a gather over the world, the entries of the ranks with this rank's TP coordinate, in
  data-parallel rank order (the sampler's order): shape ``(data_parallel_size, ...)``; with ``sync_grads=True``
  its backward sends each entry's gradient to its own rank only, as a gather over those ranks would.

An explicit process group (anything but ``None`` / ``torch.distributed.group.WORLD``) is used as given. Without
TP both are Lightning's own collectives over the world.

Example::

    out = reduce_over_data_parallel(torch.tensor([4.0]), mesh, reduce_op="sum")   # 4 * data_parallel_size
    emb = all_gather_over_data_parallel(local_emb, mesh, sync_grads=True)        # (data_parallel_size, b, d)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _sync_ddp_if_available,
)

from lightning_shard import comm
from lightning_shard.mesh import DeviceMesh

__all__ = [
    "all_gather_over_data_parallel",
    "decided_on_ranks",
    "is_default_group",
    "is_sum",
    "reduce_over_data_parallel",
]

TP_DIM = "tensor_parallel"


def is_sum(reduce_op: Any) -> bool:
    """Whether a Lightning ``reduce_op`` (a string such as ``"sum"``, or a ``ReduceOp``) is a sum."""
    if isinstance(reduce_op, str):
        return reduce_op.lower() == "sum"
    return reduce_op == dist.ReduceOp.SUM


def is_default_group(group: Any) -> bool:
    """``None`` or the world group: what Fabric and ``LightningModule.all_gather`` pass when the user names none
    (they turn ``None`` into ``torch.distributed.group.WORLD`` before calling the strategy)."""
    return group is None or (_distributed_is_initialized() and group is dist.group.WORLD)


def _check_devices(what: str, group: Any, tensor: torch.Tensor) -> None:
    """Lightning's collectives run on torch.distributed directly: the same device check as the engine's own
    (``lightning_shard.comm.check_devices``), so a host tensor sent over an NCCL group raises naming the caller."""
    if _distributed_is_initialized() and isinstance(tensor, torch.Tensor):
        comm.check_devices(what, group, tensor)


def _tp_size(mesh: DeviceMesh | None) -> int:
    if mesh is None or mesh.mesh_dim_names is None or TP_DIM not in mesh.mesh_dim_names:
        return 1
    return mesh.size(TP_DIM)


def reduce_over_data_parallel(
    tensor: torch.Tensor, mesh: DeviceMesh | None, group: Any = None, reduce_op: Any = "mean"
) -> torch.Tensor:
    """Lightning's all-reduce (in place, as Lightning's); a sum over the default group under TP is divided by the
    TP size so that each data-parallel replica counts once (an integer sum with floor division)."""
    _check_devices("reduce", group, tensor)
    out = _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    tp = _tp_size(mesh)
    if tp > 1 and is_default_group(group) and is_sum(reduce_op) and _distributed_is_initialized():
        if out.is_floating_point() or out.is_complex():
            out.div_(tp)
        else:
            out.copy_(torch.div(out, tp, rounding_mode="floor"))
    return out


def all_gather_over_data_parallel(
    tensor: torch.Tensor, mesh: DeviceMesh | None, group: Any = None, sync_grads: bool = False
) -> torch.Tensor:
    """Lightning's all-gather (``(world_size, ...)``); over the default group under TP, the data-parallel
    replicas' tensors only (``(data_parallel_size, ...)``, in data-parallel rank order)."""
    _check_devices("all_gather", group, tensor)
    gathered = _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)
    if _tp_size(mesh) == 1 or not is_default_group(group) or not _distributed_is_initialized():
        return gathered
    return gathered[_same_tp_coordinate_ranks(mesh, gathered.device)]


def _same_tp_coordinate_ranks(mesh: DeviceMesh, device: torch.device) -> torch.Tensor:
    """The global ranks whose TP coordinate is this rank's, in data-parallel rank order (outer mesh dims first,
    as ``distributed_sampler_kwargs`` numbers them)."""
    tp_dim = mesh.mesh_dim_names.index(TP_DIM)
    ranks = mesh.mesh.movedim(tp_dim, -1)[..., mesh.get_local_rank(TP_DIM)].flatten()
    return ranks.to(device)


def decided_on_ranks(decision: bool, device: torch.device, all: bool = True) -> bool:
    """True on every rank when all (``all=True``) or any ranks decided True: a count over every rank (the
    strategies' ``reduce_boolean_decision``), not the data-parallel sum of ``reduce_over_data_parallel``.

    Example: ``stop = decided_on_ranks(should_stop, torch.device("cpu"))``
    """
    if not _distributed_is_initialized():
        return decision
    flag = torch.tensor(int(decision), device=device)
    _check_devices("reduce_boolean_decision", None, flag)
    count = _sync_ddp_if_available(flag, None, reduce_op="sum")
    return bool(count == dist.get_world_size()) if all else bool(count)
