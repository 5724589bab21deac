"""``plan``: every valid ``(dp, tp)`` mesh for a world size, its estimate, and the choice.

Valid meshes: ``tp`` divides the world size and the devices of one node (TP traffic stays on the node's
fast links), every attention head count found on the model divides by ``tp``, and every dimension the
auto TP plan shards divides by ``tp``. The choice is the smallest ``tp`` whose per-rank device total fits in
``device_memory_bytes * (1 - safety_margin)``: more TP costs communication in every layer, so it is only
worth it when memory forces it.

Example::

    result = plan(model, 8, 8, 80 * 2**30, precision="bf16-mixed", batch=8, seq_len=2048)
    print(result.table)
    result.choice.mesh       # e.g. (4, 2)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lightning_shard.planner.estimate import (
    Estimate,
    dims_divisible,
    estimate,
    format_bytes,
    heads_of,
    profile_activations,
    tp_plan_for,
)

__all__ = ["plan", "PlanResult", "MeshOption", "choose_tensor_parallel_size", "parse_bytes"]


@dataclass(frozen=True)
class MeshOption:
    """One candidate mesh: its estimate (``None`` when invalid), whether it fits, and why not when invalid."""

    mesh: tuple[int, int]
    estimate: Estimate | None
    fits: bool
    reason: str = ""

    def as_dict(self) -> dict:
        e = self.estimate
        return {
            "dp": self.mesh[0],
            "tp": self.mesh[1],
            "valid": e is not None,
            "reason": self.reason,
            "model_states_bytes": e.model_states if e else None,
            "activations_bytes": e.activations if e else None,
            "device_bytes": e.device_total if e else None,
            "comm_bytes_per_step": e.comm_total if e else None,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class PlanResult:
    """All candidate meshes, the chosen one, the usable memory per device and the table as a string."""

    options: list[MeshOption]
    choice: MeshOption | None
    budget_bytes: int
    table: str

    @property
    def rows(self) -> list[dict]:
        return [o.as_dict() for o in self.options]


def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` / ``"80GiB"`` / ``"512MB"`` / ``12e9`` -> bytes (GB and GiB both mean 2**30: device memory
    is sold in GiB under the name GB)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"planner: cannot read a memory size from {text!r}; use e.g. '80GB' or '24GiB'")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def _mesh_problem(model: nn.Module, world_size: int, devices_per_node: int, tp: int, heads: set[int]):
    """(plan, reason): the TP plan of a mesh, or the reason the mesh is invalid."""
    if tp > devices_per_node or devices_per_node % tp:
        return None, f"TP {tp} does not fit within a node of {devices_per_node} devices"
    bad_heads = sorted(h for h in heads if h % tp)
    if bad_heads:
        return None, f"head counts {bad_heads} do not divide by TP {tp}"
    if tp == 1:
        return {}, ""
    try:
        tp_plan = tp_plan_for(model, tp)
    except Exception as e:  # noqa: BLE001 - an unplannable TP size is an invalid mesh, not a crash
        return None, f"no TP plan for TP {tp}: {e}"
    bad = dims_divisible(model, tp_plan, tp)
    if bad:
        return None, f"TP {tp} does not divide {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
    return tp_plan, ""


def plan(
    model: nn.Module,
    world_size: int,
    devices_per_node: int,
    device_memory_bytes: int | str,
    *,
    precision: str = "32-true",
    batch: int,
    seq_len: int,
    safety_margin: float = 0.1,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    optimizer: str = "adamw",
    example_input: Callable | None = None,
    loss_fn: Callable | None = None,
    raise_if_none_fits: bool = True,
) -> PlanResult:
    """Estimate every valid ``(dp, tp)`` mesh of ``world_size`` devices and choose the smallest TP that fits.

    ``batch`` is the micro-batch per data-parallel rank. Raises ``ValueError`` when no mesh fits (unless
    ``raise_if_none_fits=False``), naming the smallest requirement and the ways out.

    Example::

        result = plan(model, 16, 8, "80GB", precision="bf16-mixed", batch=4, seq_len=4096)
        print(result.table); dp, tp = result.choice.mesh
    """
    if world_size < 1 or devices_per_node < 1:
        raise ValueError(f"planner: world_size={world_size} and devices_per_node={devices_per_node} must be >= 1")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"planner: safety_margin={safety_margin} must be in [0, 1)")
    memory = parse_bytes(device_memory_bytes)
    budget = int(memory * (1 - safety_margin))
    heads = heads_of(model)
    profile = profile_activations(
        model, precision=precision, batch=batch, seq_len=seq_len, example_input=example_input, loss_fn=loss_fn
    )
    options: list[MeshOption] = []
    for tp in [t for t in range(1, world_size + 1) if world_size % t == 0]:
        tp_plan, reason = _mesh_problem(model, world_size, devices_per_node, tp, heads)
        mesh = (world_size // tp, tp)
        if tp_plan is None:
            options.append(MeshOption(mesh, None, False, reason))
            continue
        est = estimate(
            model,
            mesh,
            precision=precision,
            batch=batch,
            seq_len=seq_len,
            cpu_offload=cpu_offload,
            reshard_after_forward=reshard_after_forward,
            optimizer=optimizer,
            activations=profile,
            tp_plan=tp_plan,
        )
        options.append(MeshOption(mesh, est, est.device_total <= budget))
    choice = next((o for o in options if o.fits), None)
    table = _table(options, choice, memory, budget, precision, batch, seq_len)
    result = PlanResult(options, choice, budget, table)
    if choice is None and raise_if_none_fits:
        raise ValueError(_no_fit_message(result, model, world_size, devices_per_node, memory, safety_margin,
                                         precision, batch, seq_len, cpu_offload, reshard_after_forward, optimizer,
                                         example_input, loss_fn))  # fmt: skip
    return result


def _table(options, choice, memory, budget, precision, batch, seq_len) -> str:
    head = (
        f"planner: {precision}, micro-batch {batch} x seq {seq_len}, device memory {format_bytes(memory)} "
        f"(budget {format_bytes(budget)} after the safety margin)"
    )
    cols = ("mesh (dp x tp)", "model states", "activations", "memory/rank", "comm/step", "fits?")
    lines = [head, "  " + " | ".join(f"{c:>14}" for c in cols)]
    for o in options:
        e = o.estimate
        name = f"{o.mesh[0]} x {o.mesh[1]}"
        if e is None:
            lines.append(f"  {name:>14} | invalid: {o.reason}")
            continue
        cells = (
            name,
            format_bytes(e.model_states),
            format_bytes(e.activations),
            format_bytes(e.device_total),
            format_bytes(e.comm_total),
            ("yes" if o.fits else "no") + (" <- chosen" if o is choice else ""),
        )
        lines.append("  " + " | ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def _no_fit_message(result, model, world_size, devices_per_node, memory, margin, precision, batch, seq_len,
                    cpu_offload, reshard, optimizer, example_input, loss_fn) -> str:  # fmt: skip
    valid = [o for o in result.options if o.estimate is not None]
    if not valid:
        reasons = "; ".join(f"{o.mesh[0]}x{o.mesh[1]}: {o.reason}" for o in result.options)
        return f"planner: no valid mesh for {world_size} devices ({reasons})"
    best = min(valid, key=lambda o: o.estimate.device_total)
    e = best.estimate
    options = []
    if not cpu_offload:
        off = estimate(model, best.mesh, precision=precision, batch=batch, seq_len=seq_len, cpu_offload=True,
                       reshard_after_forward=reshard, optimizer=optimizer, example_input=example_input,
                       loss_fn=loss_fn)  # fmt: skip
        verdict = "fits" if off.device_total <= result.budget_bytes else "still does not fit"
        options.append(
            f"CPU offload (cpu_offload=True): {format_bytes(off.device_total)} per device on "
            f"{best.mesh[0]}x{best.mesh[1]}, {verdict}; needs {format_bytes(off.cpu_bytes)} of host memory per rank"
        )
    states_at_1 = e.model_states * best.mesh[0]  # model states scale with 1 / dp
    rest = e.device_total - (0 if e.cpu_offload else e.model_states)
    room = result.budget_bytes - rest
    if not e.cpu_offload and room > 0:
        need = -(-states_at_1 // room) * best.mesh[1]
        options.append(f"more devices: about {need} (model states shrink with data-parallel size; activations do not)")
    else:
        options.append("more devices alone will not help: activations and unsharded groups exceed the budget")
    if e.activations > 0 and batch > 1:
        per_sample = e.activations / batch
        fit_batch = int((result.budget_bytes - (e.device_total - e.activations)) // per_sample)
        options.append(
            f"smaller micro-batch: {fit_batch} would fit on {best.mesh[0]}x{best.mesh[1]}"
            if fit_batch >= 1
            else "smaller micro-batch: even batch 1 does not fit"
        )
    options.append(f"activation checkpointing or a shorter sequence (activations: {format_bytes(e.activations)})")
    return (
        f"planner: the model does not fit on any mesh of {world_size} devices with "
        f"{format_bytes(memory)} each (budget {format_bytes(result.budget_bytes)} after a {margin:.0%} margin). "
        f"Smallest requirement: {format_bytes(e.device_total)} per device on dp={best.mesh[0]} x tp={best.mesh[1]} "
        f"(model states {format_bytes(e.model_states)}, activations {format_bytes(e.activations)}). Options:\n  - "
        + "\n  - ".join(options)
        + "\n"
        + result.table
    )


def choose_tensor_parallel_size(
    model: nn.Module,
    world_size: int,
    devices_per_node: int,
    device_memory_bytes: int | str,
    precision: str,
    *,
    batch: int = 1,
    seq_len: int = 2048,
    **kwargs,
) -> tuple[int, str]:
    """The TP size for ``tensor_parallel_size="auto"`` and the table explaining it (for the strategy's log).

    Raises the planner's ``ValueError`` when nothing fits. Example::

        tp, table = choose_tensor_parallel_size(model, 8, 8, torch.cuda.get_device_properties(0).total_memory,
                                                "bf16-mixed", batch=4, seq_len=2048)
    """
    result = plan(
        model, world_size, devices_per_node, device_memory_bytes, precision=precision, batch=batch,
        seq_len=seq_len, **kwargs,
    )  # fmt: skip
    return result.choice.mesh[1], result.table
