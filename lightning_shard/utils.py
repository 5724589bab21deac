"""Training utilities that must see through DTensors: ``clip_grad_norm_`` and ``grad_norm``.

Example::

    from lightning_shard.utils import clip_grad_norm_
    loss.backward()
    total = clip_grad_norm_(model.parameters(), max_norm=1.0)   # same value on every rank
    optimizer.step()
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from lightning_shard import comm
from lightning_shard.mesh import DeviceMesh, group_backend, world_timeout
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.placements import Replicate

__all__ = ["clip_grad_norm_", "grad_norm"]

# Process groups spanning several mesh dims at once, by their ranks (created once, reused).
_FLAT_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their global norm is at most ``max_norm``.

    Same signature and result as ``torch.nn.utils.clip_grad_norm_``, but the norm is the norm of the *global*
    gradients, over any mix of plain tensors (taken as identical on every rank, as DDP keeps them) and
    DTensors on one or several meshes with any placements: a sharded gradient counts every shard once, a
    replicated one counts once (not once per rank), and a ``Partial`` gradient is reduced first (one all-reduce
    each). The local sums of ``|g|^p`` are grouped by the set of ranks they must be summed over (a mesh and
    its sharded mesh dims) and each group costs one all-reduce (``max``/``min`` for the inf-norms), whatever
    the number of parameters. Returns the total norm as a plain 0-dim tensor, equal on every rank.

    Example::

        total = clip_grad_norm_(model.parameters(), 1.0)               # 2-norm
        clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))

    >>> from torch import nn
    >>> from lightning_shard.fsdp import fully_shard
    >>> model = fully_shard(nn.Linear(4, 2))
    >>> model(torch.ones(1, 4)).sum().backward()         # every gradient element is 1: the norm is sqrt(10)
    >>> round(clip_grad_norm_(model.parameters(), 1.0).item(), 4), round(model.bias.grad.full_tensor()[0].item(), 4)
    (3.1623, 0.3162)
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if math.isnan(norm_type) or (norm_type < 0 and norm_type != -math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type} is not supported; use p >= 0, inf or -inf")
    if not grads:
        return torch.tensor(0.0)
    total = _total_norm(grads, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {total.item()}, so "
            "they cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    locals_ = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    _scale_(locals_, clip_coef, foreach)
    return total


def _norm_op(p: float) -> str:
    return "max" if p == math.inf else "min" if p == -math.inf else "sum"


def _grouped_local_terms(grads: list[torch.Tensor], p: float) -> dict:
    """Each gradient's local term of the p-norm (``_local_term``), grouped by the ranks it must be reduced over:
    ``{ranks or None: (process group or None, [index into grads], [local term])}``. A ``Partial`` gradient is
    reduced first (one all-reduce each); a sharded one is grouped by its mesh and sharded mesh dims; a replicated
    or plain one needs no reduction (key None)."""
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    terms: dict[tuple | None, tuple[dist.ProcessGroup | None, list[int], list[torch.Tensor]]] = {}
    for i, g in enumerate(grads):
        key, group, local = None, None, g
        if isinstance(g, DTensor):
            if g._spec.has_partial():
                # Reduce Partial terms first; |sum of terms|^p is not the sum of |term|^p.
                target = tuple(Replicate() if pl.is_partial() else pl for pl in g.placements)
                g = g.redistribute(g.device_mesh, target)
            local = g._local_tensor
            dims = tuple(d for d, pl in enumerate(g.placements) if pl.is_shard())
            if dims:
                key, group = _group_over(g.device_mesh, dims)
        entry = terms.setdefault(key, (group, [], []))
        entry[1].append(i)
        entry[2].append(_local_term(local.to(dtype), p))
    return terms


def _total_norm(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    """The global p-norm of ``grads``: per-tensor local terms, one all-reduce per group of ranks to sum over."""
    op = _norm_op(p)
    device = (grads[0]._local_tensor if isinstance(grads[0], DTensor) else grads[0]).device
    partials = []
    for group, _, values in _grouped_local_terms(grads, p).values():
        value = _combine(torch.stack(values).to(device), op)
        if group is not None:
            with comm.host_collectives_for(grads[0]):  # CPU-offloaded gradients: their norm is reduced on the host
                comm.all_reduce(value, group, op)
        partials.append(value)
    total = _combine(torch.stack(partials), op)
    return _root(total, p)


def _root(term: torch.Tensor, p: float) -> torch.Tensor:
    """A norm from its term: the p-th root of a sum of p-th powers (the 0- and inf-norms' terms are the norm)."""
    return term if _norm_op(p) != "sum" or p == 0 else term.pow(1.0 / p)


def _local_term(x: torch.Tensor, p: float) -> torch.Tensor:
    """What this shard adds to the global norm: sum |x|^p (max / min |x| for the inf-norms; empty is neutral)."""
    if p == math.inf:
        return x.abs().amax() if x.numel() else x.new_zeros(())
    if p == -math.inf:
        return x.abs().amin() if x.numel() else x.new_full((), math.inf)
    if p == 0:
        return (x != 0).sum().to(x.dtype)
    if p == 1:
        return x.abs().sum()
    if p == 2:
        return x.pow(2).sum()  # avoids a sqrt then a square
    return torch.linalg.vector_norm(x, p).pow(p)


def _combine(values: torch.Tensor, op: str) -> torch.Tensor:
    return {"sum": values.sum, "max": values.amax, "min": values.amin}[op]()


def _group_over(mesh: DeviceMesh, dims: tuple[int, ...]) -> tuple[tuple, dist.ProcessGroup]:
    """(ranks, process group) of the ranks sharing this rank's coordinates outside mesh ``dims``."""
    if len(dims) == 1:
        group = mesh.get_group(dims[0])
        return tuple(dist.get_process_group_ranks(group)), group
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if d in dims else coord[d] for d in range(mesh.ndim))
    with _disable_current_modes():  # the rank grid is a real tensor, also under the simulator's fake mode
        ranks = tuple(mesh.mesh[index].flatten().tolist())
    if ranks not in _FLAT_GROUPS:
        # Like the mesh's own groups, these carry host tensors too (CPU-offloaded gradients).
        backend = group_backend(mesh.device_type)
        if list(ranks) == list(range(dist.get_world_size())) and backend is None:
            _FLAT_GROUPS[ranks] = dist.group.WORLD
        else:
            # Only the members call this (every rank of the group does, in the same order of first use), so
            # sub-meshes whose other groups this rank cannot see work too.
            _FLAT_GROUPS[ranks] = dist.new_group(
                list(ranks), backend=backend, timeout=world_timeout(), use_local_synchronization=True
            )
    return ranks, _FLAT_GROUPS[ranks]


def _scale_(tensors: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        c = coef.to(device)
        if foreach is not False:
            torch._foreach_mul_(group, c)
        else:
            for t in group:
                t.mul_(c)


@torch.no_grad()
def grad_norm(
    module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, torch.Tensor]:
    """``lightning.pytorch.utilities.grad_norm`` for sharded models: the norm of each parameter's *full* gradient
    and their overall norm, as plain 0-dim tensors, equal on every rank; same keys
    (``grad_{norm_type}_norm/{name}``, ``grad_{norm_type}_norm_total``) and values as Lightning's on one process.

    Lightning's own ``grad_norm`` cannot read DTensor gradients (nor torch's): it builds the total with
    ``torch.tensor(list of norms)``, which copies each element's storage, and a DTensor has none ("The tensor
    has a non-zero number of elements, but its data is not allocated yet"). The sharded gradients' local terms
    are reduced as ``clip_grad_norm_``'s: one all-reduce per group of ranks (a mesh and its sharded dims), whatever
    the number of parameters; replicated and plain gradients need none.

    Example::

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(grad_norm(self, norm_type=2))
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"grad_norm: norm_type must be a positive number or 'inf' (infinity norm); got {norm_type}")
    named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    if not named:
        return {}
    grads = [g for _, g in named]
    device = (grads[0]._local_tensor if isinstance(grads[0], DTensor) else grads[0]).device
    terms = [None] * len(grads)
    for group, indices, values in _grouped_local_terms(grads, norm_type).values():
        reduced = torch.stack(values).to(device)
        if group is not None:
            comm.all_reduce(reduced, group, _norm_op(norm_type))
        for i, value in zip(indices, reduced.unbind(0)):
            terms[i] = value
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": _root(term, norm_type).to(g.dtype)
        for (name, g), term in zip(named, terms)
    }
    norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms
