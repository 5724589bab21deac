"""Apply TP and FSDP to a user's model with no parallelization code from the user.

Order: tensor parallelism on ``mesh["tensor_parallel"]`` (the auto plan or a given one), then
``fully_shard`` bottom-up on every FSDP unit (the repeated block class by default) and the root, then
materialize meta-device parameters shard by shard, then check that nothing can drift: every parameter is
a DTensor, and replicated copies agree across ranks.

Example::

    apply_parallelism(model, mesh, fsdp_unit="auto", tp_plan="auto", mp_policy=MixedPrecisionPolicy())
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import comm
from lightning_shard.device import handle_for, has_data
from lightning_shard.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from lightning_shard.fsdp.units import find_repeated_blocks
from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import DTensor


def is_parallelized(model: nn.Module) -> bool:
    """True if the user already applied parallelism (our FSDP/DTensor or torch's) in ``configure_model``."""
    for m in model.modules():
        if isinstance(m, FSDPModule) or type(m).__name__.startswith("FSDP"):
            return True
    return any(isinstance(p, DTensor) or type(p).__name__ == "DTensor" for p in model.parameters())


def find_fsdp_units(model: nn.Module, fsdp_unit: str | set[type] | Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The modules to wrap with ``fully_shard`` (before the root), innermost first.

    ``"auto"``: ``lightning_shard.fsdp.units.find_repeated_blocks`` (e.g. the transformer layers).
    """
    if callable(fsdp_unit) and not isinstance(fsdp_unit, (set, frozenset, str)):
        chosen = [m for m in model.modules() if m is not model and fsdp_unit(m)]
    elif isinstance(fsdp_unit, (set, frozenset)):
        chosen = [m for m in model.modules() if m is not model and isinstance(m, tuple(fsdp_unit))]
    elif fsdp_unit == "auto":
        chosen = find_repeated_blocks(model)
    else:
        raise ValueError(f"fsdp_unit={fsdp_unit!r}: use 'auto', a set of module classes, or a callable module -> bool")
    # innermost first, so fully_shard runs bottom-up
    depth = {id(m): name.count(".") + 1 for name, m in model.named_modules() if name}
    return sorted(chosen, key=lambda m: -depth.get(id(m), 0))


def apply_parallelism(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    fsdp_unit,
    tp_plan,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    cpu_offload: bool,
    fsdp_mesh: DeviceMesh,
    activation_checkpointing_policy: set[type] | None = None,
) -> dict:
    """TP (if the TP dim is larger than 1), activation checkpointing, FSDP; returns a summary dict."""
    summary: dict = {"tp_plan": None, "fsdp_units": []}
    tp_size = mesh.size("tensor_parallel")
    if tp_size > 1 and tp_plan is not None:
        from lightning_shard.tp import auto_tp_plan, parallelize_module

        plan = auto_tp_plan(model, mesh["tensor_parallel"]) if tp_plan == "auto" else tp_plan
        parallelize_module(model, mesh["tensor_parallel"], plan)
        summary["tp_plan"] = plan
    if activation_checkpointing_policy:
        _apply_activation_checkpointing(model, activation_checkpointing_policy)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for unit in find_fsdp_units(model, fsdp_unit):
        fully_shard(
            unit,
            mesh=fsdp_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
        )
        summary["fsdp_units"].append(type(unit).__name__)
    fully_shard(
        model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload
    )
    return summary


def _apply_activation_checkpointing(model: nn.Module, classes: set[type]) -> None:
    """Recompute the forward of every instance of ``classes`` in backward (non-reentrant checkpointing)."""
    from torch.utils.checkpoint import checkpoint

    for m in model.modules():
        if isinstance(m, tuple(classes)) and not getattr(m, "_ls_checkpointed", False):
            forward = m.forward

            def checkpointed(*args, _forward=forward, **kwargs):
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            m.forward = checkpointed
            m._ls_checkpointed = True


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give meta-device parameters and buffers real storage on ``device`` and initialise them.

    Each module's ``reset_parameters()`` runs on its (sharded) parameters; our DTensor random ops produce
    exactly the values one device would, so every rank allocates only its shards. All ranks start from rank
    0's RNG states, of the CPU generator and of ``device``'s (``reset_parameters`` of parameters on the
    accelerator draws from its generator), so replicated values agree; each rank's own states are restored
    afterwards.
    """
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    model.to_empty(device=device)
    handle = handle_for(device)
    states = [torch.get_rng_state(), handle.get_rng_state()]
    synced = list(states)
    comm.broadcast_object_list(synced, src=0)
    torch.set_rng_state(synced[0])
    if synced[1] is not None:
        handle.set_rng_state(synced[1])
    try:
        with torch.no_grad():
            for m in model.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
    finally:
        torch.set_rng_state(states[0])
        if states[1] is not None:
            handle.set_rng_state(states[1])


def broadcast_plain_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make every rank hold the values of the mesh's first rank (coordinate 0 on every dim) of every plain
    parameter and buffer, before sharding: one broadcast per mesh dimension, over the mesh's groups, which
    carry host tensors too (so an unsharded model stays on the host until it is sharded).

    Example: ``broadcast_plain_model(model, mesh)`` on a (2, 4) mesh: along dim 0, then along dim 1.
    """
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if not isinstance(t, DTensor) and not t.is_meta:
                for dim in range(mesh.ndim):
                    if mesh.size(dim) > 1:
                        comm.broadcast(t.data, 0, mesh.get_group(dim))


def check_no_drift(model: nn.Module) -> None:
    """Raise if a parameter is not a DTensor, or if replicated copies of a DTensor differ across ranks.

    One all-gather of a checksum vector per mesh dimension that replicates something.
    """
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(
            f"shard_fsdp_tp: parameters {plain[:5]} are neither sharded nor replicated DTensors after setup; they "
            "could drift apart across ranks. Remove them from ignored parameters or shard them."
        )
    by_group: dict[int, tuple[dist.ProcessGroup, list[tuple[str, torch.Tensor]]]] = {}
    for name, p in model.named_parameters():
        for i, placement in enumerate(p.placements):
            if placement.is_replicate() and p.device_mesh.size(i) > 1:
                group = p.device_mesh.get_group(i)
                by_group.setdefault(id(group), (group, []))[1].append((name, p.to_local().detach().double().sum()))
    for group, items in by_group.values():
        sums = torch.stack([s for _, s in items])  # on the parameters' device: the device the group serves
        gathered = comm.all_gather_list(sums, group)
        if not has_data(sums):
            continue  # fake tensors (the simulator): the collective ran, there are no values to compare
        gathered = [g.cpu() for g in gathered]
        for k, (name, _) in enumerate(items):
            values = [g[k].item() for g in gathered]
            if max(values) - min(values) > 1e-6 * max(1.0, abs(values[0])):
                raise RuntimeError(
                    f"shard_fsdp_tp: replicated parameter {name!r} differs across ranks (checksums {values}); "
                    "initialise the model identically on every rank (seed_everything) or build it on meta"
                )
