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
from lightning_shard.fsdp.units import SharedSplit, find_repeated_blocks, split_shared_params
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


def shared_params_to_leave(model: nn.Module, units: list[nn.Module], fsdp_unit) -> dict[nn.Module, SharedSplit]:
    """Per unit, the shared (tied) parameters it must leave to an enclosing unit (the root at the latest).

    With ``fsdp_unit="auto"`` a unit that holds only some names of a shared parameter leaves it to the
    innermost enclosing unit that holds them all (T5: the embedding used by both ``T5Stack`` units goes to the
    root), so the tie is kept. A unit the user chose is not changed behind their back: a split raises, on
    every rank alike (before fully_shard runs, so no rank waits in a collective), naming both names and the fix.

    Example: ``shared_params_to_leave(t5, [t5.encoder, t5.decoder], "auto")`` -> ``{t5.encoder: ..., t5.decoder: ...}``.
    """
    leave = split_shared_params(model, units)
    if leave and fsdp_unit != "auto":
        unit, split = next(iter(leave.items()))
        inside, outside = split.pairs[0]
        raise ValueError(
            f"shard_fsdp_tp: fsdp_unit={fsdp_unit!r} makes {type(unit).__name__} an FSDP unit that holds parameter "
            f"{inside!r} but not {outside!r}, which is the same (tied) parameter; the two FSDP groups would each "
            "train their own copy. Use fsdp_unit='auto' (shared parameters stay in the enclosing unit), or choose "
            "units that each hold every use of a shared parameter or none of them."
        )
    return leave


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
    sequence_parallel: bool | str = False,
    loss_parallel: bool = False,
) -> dict:
    """TP (if the TP dim is larger than 1), activation checkpointing, FSDP; returns a summary dict.

    The summary's TP entries: ``tp_plan`` (the plan applied), ``tp_summary`` (``auto_tp_plan``'s lines, empty
    for a user's plan) and ``tp_coverage`` (a ``lightning_shard.tp.coverage.TPCoverage``: the fraction of
    weight-matrix elements the plan shards and the modules it leaves replicated, with the reason).
    """
    summary: dict = {"tp_plan": None, "tp_summary": [], "tp_coverage": None, "fsdp_units": []}
    tp_size = mesh.size("tensor_parallel")
    if tp_size > 1 and tp_plan is not None:
        from lightning_shard.tp import auto_tp_plan, parallelize_module
        from lightning_shard.tp.coverage import tp_coverage

        tp_mesh = mesh["tensor_parallel"]
        if tp_plan == "auto":
            plan, lines = auto_tp_plan(
                model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, return_summary=True
            )
        else:
            plan, lines = tp_plan, []
        summary["tp_coverage"] = tp_coverage(model, plan, lines)  # before the parameters become DTensors
        parallelize_module(model, tp_mesh, plan)
        summary["tp_plan"], summary["tp_summary"] = plan, lines
    if activation_checkpointing_policy:
        _apply_activation_checkpointing(model, activation_checkpointing_policy)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    units = find_fsdp_units(model, fsdp_unit)
    leave = shared_params_to_leave(model, units, fsdp_unit)
    for unit in units:
        fully_shard(
            unit,
            mesh=fsdp_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
            ignored_params=leave.get(unit, SharedSplit.none()).params,
        )
        summary["fsdp_units"].append(type(unit).__name__)
    summary["shared_left_to_parent"] = sorted({pair[0] for split in leave.values() for pair in split.pairs})
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


def materialize(model: nn.Module, device: torch.device) -> Unset:
    """Give meta-device parameters and buffers real storage on ``device`` and initialise them.

    Each module's ``reset_parameters()`` runs on its (sharded) parameters; our DTensor random ops produce
    exactly the values one device would, so every rank allocates only its shards. All ranks start from rank
    0's RNG states, of the CPU generator and of ``device``'s (``reset_parameters`` of parameters on the
    accelerator draws from its generator), so replicated values agree; each rank's own states are restored
    afterwards.

    What no ``reset_parameters()`` writes (a norm weight set in ``__init__``, a rotary table computed there as a
    non-persistent buffer) would be uninitialised memory, different on every rank: it is filled with NaN
    (integers: their lowest value, or highest if unsigned; booleans: False) before the resets, and returned as
    an :class:`Unset` (the same on every rank: one all-reduce of flags), which the strategies report at once and
    check again, before the first step, after a checkpoint may have loaded them.
    """
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return Unset()
    model.to_empty(device=device)
    handle = handle_for(device)
    states = [torch.get_rng_state(), handle.get_rng_state()]
    synced = comm.broadcast_object(states, src=0)
    torch.set_rng_state(synced[0])
    if synced[1] is not None:
        handle.set_rng_state(synced[1])
    try:
        with torch.no_grad():
            unset = Unset(tuple(_named_tensors(model)))
            unset.fill(model)
            for m in model.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
    finally:
        torch.set_rng_state(states[0])
        if states[1] is not None:
            handle.set_rng_state(states[1])
    return unset.still_unset(model, device)


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*model.named_parameters(), *model.named_buffers()])


class Unset:
    """Parameters and buffers of a materialized model that nothing has written yet, by name. ``fill`` marks
    them (NaN, an integer's extreme, or for booleans the version counter after writing False); ``still_unset``
    keeps those still marked on some rank (one max all-reduce of flags over all ranks, so every rank agrees);
    ``check`` raises on every rank if any is.

    Example: ``unset = materialize(model, device); ...load a checkpoint...; unset.check(model, device, "step")``.
    """

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.names = names
        self._versions: dict[str, int] = {}  # booleans: no value marks them, their version counter does

    def __bool__(self) -> bool:
        return bool(self.names)

    def fill(self, model: nn.Module) -> None:
        tensors = _named_tensors(model)
        for name in self.names:
            t = tensors[name]
            if t.dtype == torch.bool:
                t.fill_(False)
                self._versions[name] = _local(t)._version
            else:
                t.fill_(_mark(t.dtype))

    def _flags(self, model: nn.Module, device: torch.device) -> torch.Tensor | None:
        tensors = _named_tensors(model)
        flags = []
        for name in self.names:
            t = tensors.get(name)
            local = _local(t) if t is not None else None
            if local is None or not has_data(local) or local.numel() == 0:
                flags.append(0)
            elif t.dtype == torch.bool:
                flags.append(int(self._versions.get(name) == local._version))
            elif t.dtype.is_floating_point or t.dtype.is_complex:
                flags.append(int(torch.isnan(local).all()))
            else:
                flags.append(int((local == _mark(t.dtype)).all()))
        if not flags:
            return None
        on = device if "cpu" not in comm.served_device_types() else torch.device("cpu")
        out = torch.tensor(flags, dtype=torch.int32, device=on)
        comm.all_reduce_flags(out, dist.group.WORLD)
        return out

    def still_unset(self, model: nn.Module, device: torch.device) -> Unset:
        flags = self._flags(model, device)
        if flags is None or not comm.carries_data():
            return Unset()
        kept = Unset(tuple(n for n, f in zip(self.names, flags.tolist()) if f))
        kept._versions = {n: v for n, v in self._versions.items() if n in kept.names}
        return kept

    def describe(self, limit: int = 8) -> str:
        more = f" and {len(self.names) - limit} more" if len(self.names) > limit else ""
        return ", ".join(repr(n) for n in self.names[:limit]) + more

    def check(self, model: nn.Module, device: torch.device, before: str) -> None:
        """Raise on every rank if a parameter or buffer is still unwritten (one all-reduce; call on every rank)."""
        if not self.names:
            return
        left = self.still_unset(model, device)
        if left:
            raise RuntimeError(
                f"shard_fsdp_tp: before {before}: the model was built on the meta device and no reset_parameters() "
                f"of its modules, and no checkpoint, wrote {left.describe()}; they hold NaN (integers their extreme "
                "value) instead of what the module's __init__ computed, which the meta device does not keep. Give "
                "the module that owns them a reset_parameters() that writes them (buffers computed in __init__ "
                "too), load a checkpoint, or build the model without empty_init / torch.device('meta')"
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _mark(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    info = torch.iinfo(dtype)
    return info.max if info.min == 0 else info.min


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
