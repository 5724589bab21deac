"""``plan``: every valid configuration for a world size, its memory and time estimates, and the choice.

A configuration is a ``(dp, tp)`` mesh plus activation checkpointing, ``reshard_after_forward`` and CPU
offload (each fixed by the caller or searched with ``"auto"``). Valid meshes: ``tp`` divides the world size
and the devices of one node (TP traffic stays on the node's fast links), every attention head count found on
the model divides by ``tp``, every dimension the auto TP plan shards divides by ``tp``, and with hybrid
sharding (HSDP) ``tp == 1`` (the strategy rejects HSDP with TP). The choice: among the configurations whose
per-device total fits in ``device_memory_bytes * (1 - safety_margin)``, the one with the highest predicted
tokens/s per device (``timing.step_time`` on ``device``); ties go to the smaller TP size, then to no activation
checkpointing, no CPU offload and ``reshard_after_forward=True``.

The planner does not model a pipeline-parallel axis: the engine has none.

Example::

    result = plan(model, 8, 8, "80GB", precision="bf16-mixed", batch=8, seq_len=2048,
                  activation_checkpointing="auto", device="h100")
    print(result.table)
    result.choice.mesh       # e.g. (8, 1)
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lightning_shard.planner.estimate import (
    Estimate,
    dims_divisible,
    estimate,
    find_blocks,
    format_bytes,
    heads_of,
    profile_activations,
    tp_plan_for,
)
from lightning_shard.planner.timing import Device, StepTime, device_named, step_time

__all__ = [
    "plan",
    "PlanResult",
    "MeshOption",
    "NoFitError",
    "choose_tensor_parallel_size",
    "parse_bytes",
    "hsdp_replicas",
]

PIPELINE_NOTE = "not modelled: a pipeline-parallel axis (the engine has none)"


class NoFitError(ValueError):
    """No configuration fits the memory budget; the message says by how much and which knob helps most.

    A ``ValueError`` (bad input for this budget), distinct from errors of the model's own forward on meta.

    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000))
    >>> plan(model, 2, 2, "10KB", batch=2, seq_len=16)
    Traceback (most recent call last):
    ...
    lightning_shard.planner.plan.NoFitError: planner: the model does not fit on any configuration of 2 devices ...
    """


@dataclass(frozen=True)
class MeshOption:
    """One candidate: its estimate and predicted step time (``None`` when the mesh is invalid), whether it
    fits, and why not when invalid.

    Example: ``[(o.config, o.fits) for o in plan(model, 2, 2, "1GB", batch=2, seq_len=16).options]`` ->
    ``[('2x1 ac=none', True), ('1x2 ac=none', True)]`` (see :class:`PlanResult`).
    """

    mesh: tuple[int, int]
    estimate: Estimate | None
    fits: bool
    reason: str = ""
    time: StepTime | None = None

    @property
    def config(self) -> str:
        return self.estimate.config if self.estimate else f"{self.mesh[0]}x{self.mesh[1]}"

    def as_dict(self) -> dict:
        e, t = self.estimate, self.time
        return {
            "dp": self.mesh[0],
            "tp": self.mesh[1],
            "config": self.config,
            "valid": e is not None,
            "reason": self.reason,
            "model_states_bytes": e.model_states if e else None,
            "activations_bytes": e.activations if e else None,
            "device_bytes": e.device_total if e else None,
            "comm_bytes_per_step": e.comm_total if e else None,
            "step_seconds": t.step if t else None,
            "tokens_per_second_per_device": t.tokens_per_second_per_device if t else None,
            "mfu": t.mfu if t else None,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class PlanResult:
    """All candidates, the chosen one, the usable memory per device and the table as a string.

    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000))
    >>> result = plan(model, 2, 2, "1GB", batch=2, seq_len=16)
    >>> [(o.mesh, o.fits) for o in result.options], result.choice.mesh
    ([((2, 1), True), ((1, 2), True)], (2, 1))
    """

    options: list[MeshOption]
    choice: MeshOption | None
    budget_bytes: int
    table: str

    @property
    def rows(self) -> list[dict]:
        return [o.as_dict() for o in self.options]


def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` / ``"80GiB"`` / ``"512MB"`` / ``12e9`` -> bytes (GB and GiB both mean 2**30: device memory
    is sold in GiB under the name GB).

    >>> parse_bytes("80GB") == parse_bytes("80GiB") == 80 * 2**30, parse_bytes("512MB"), parse_bytes(12e9)
    (True, 536870912, 12000000000)
    """
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"planner: cannot read a memory size from {text!r}; use e.g. '80GB' or '24GiB'")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def hsdp_replicas(dp: int, devices_per_node: int) -> int:
    """Replica groups of hybrid sharding, as the strategy builds them: shard within a node, replicate across.

    >>> hsdp_replicas(128, 8), hsdp_replicas(8, 8)
    (16, 1)
    """
    return dp // devices_per_node if dp % devices_per_node == 0 and dp > devices_per_node else 1


def _mesh_problem(model, world_size, devices_per_node, tp, heads, hybrid_shard):
    """(plan, reason): the TP plan of a mesh, or the reason the mesh is invalid."""
    if hybrid_shard and tp > 1:
        return None, "hybrid sharding (HSDP) does not combine with TP in the strategy"
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


def _tp_sizes(tensor_parallel_size: int | str, world_size: int) -> list[int]:
    """The TP sizes to consider: every divisor of the world size for ``"auto"``, else the one given."""
    if tensor_parallel_size == "auto":
        return [t for t in range(1, world_size + 1) if world_size % t == 0]
    tp = tensor_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or world_size % tp:
        raise ValueError(
            f"planner: tensor_parallel_size={tp!r} must be 'auto' or a positive divisor of world_size={world_size}"
        )
    return [tp]


def _choices(value, auto: list) -> list:
    return auto if isinstance(value, str) and value == "auto" else [value]


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
    cpu_offload: bool | str = False,
    reshard_after_forward: bool | int | str = True,
    optimizer: str = "adamw",
    example_input: Callable | None = None,
    loss_fn: Callable | None = None,
    raise_if_none_fits: bool = True,
    activation_checkpointing: str | set | None = None,
    sequence_parallel: bool | str = False,
    loss_parallel: bool = False,
    hybrid_shard: bool = False,
    device: str | Device = "h100",
    step: Callable | None = None,
    tensor_parallel_size: int | str = "auto",
) -> PlanResult:
    """Estimate every valid configuration of ``world_size`` devices and choose the fastest that fits.

    ``batch`` is the micro-batch per data-parallel rank. ``activation_checkpointing``, ``reshard_after_forward``
    and ``cpu_offload`` accept ``"auto"`` (search: no checkpointing or every block checkpointed -- only ``None``
    for a model without repeated blocks, where there is nothing to checkpoint; True/False; False/True).
    ``tensor_parallel_size``: ``"auto"`` (every divisor of ``world_size``) or the one TP size to consider (a
    user's fixed choice while other knobs are searched). ``hybrid_shard``: HSDP as the strategy builds it (see
    :func:`hsdp_replicas`). ``device``: ``"h100"``, ``"a100"``, ``"cpu"`` or a
    :class:`~lightning_shard.planner.timing.Device`, for the time model. ``sequence_parallel``: True, False, or
    ``"auto"`` (the strategy's default: per TP size, on where ``auto_tp_plan`` applies it,
    :func:`sequence_parallel_applies`).
    Raises :class:`NoFitError` (a ``ValueError``) when nothing fits (unless ``raise_if_none_fits=False``),
    saying by how much and which knob helps most.

    Example::

        result = plan(model, 16, 8, "80GB", precision="bf16-mixed", batch=4, seq_len=4096,
                      activation_checkpointing="auto")
        print(result.table); dp, tp = result.choice.mesh
    """
    if world_size < 1 or devices_per_node < 1:
        raise ValueError(f"planner: world_size={world_size} and devices_per_node={devices_per_node} must be >= 1")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"planner: safety_margin={safety_margin} must be in [0, 1)")
    dev = device_named(device)
    memory = parse_bytes(device_memory_bytes)
    budget = int(memory * (1 - safety_margin))
    heads = heads_of(model)
    profile = profile_activations(
        model, precision=precision, batch=batch, seq_len=seq_len, example_input=example_input, loss_fn=loss_fn,
        step=step,
    )  # fmt: skip
    # "full" checkpoints every repeated block: without blocks it is the same estimate as None under another name
    acs = _choices(activation_checkpointing, [None, "full"] if find_blocks(model) else [None])
    reshards = _choices(reshard_after_forward, [True, False])
    offloads = _choices(cpu_offload, [False, True])
    common = dict(precision=precision, batch=batch, seq_len=seq_len, optimizer=optimizer, activations=profile,
                  sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, example_input=example_input,
                  loss_fn=loss_fn, step=step)  # fmt: skip
    options: list[MeshOption] = []
    for tp in _tp_sizes(tensor_parallel_size, world_size):
        tp_plan, reason = _mesh_problem(model, world_size, devices_per_node, tp, heads, hybrid_shard)
        mesh = (world_size // tp, tp)
        if tp_plan is None:
            options.append(MeshOption(mesh, None, False, reason))
            continue
        replicas = hsdp_replicas(mesh[0], devices_per_node) if hybrid_shard else 1
        sp = sequence_parallel if isinstance(sequence_parallel, bool) else sequence_parallel_applies(model, tp)
        for ac, reshard, offload in itertools.product(acs, reshards, offloads):
            est = estimate(model, mesh, tp_plan=tp_plan, activation_checkpointing=ac, reshard_after_forward=reshard,
                           cpu_offload=offload, replicas=replicas, **{**common, "sequence_parallel": sp})  # fmt: skip
            t = step_time(est, dev, devices_per_node, precision)
            options.append(MeshOption(mesh, est, est.device_total <= budget, time=t))
    fitting = [o for o in options if o.fits]
    choice = max(fitting, key=_preference, default=None)
    table = _table(options, choice, memory, budget, precision, batch, seq_len, dev)
    result = PlanResult(options, choice, budget, table)
    if choice is None and raise_if_none_fits:
        raise NoFitError(_no_fit_message(result, model, world_size, devices_per_node, memory, safety_margin, common,
                                         hybrid_shard, dev))  # fmt: skip
    return result


def sequence_parallel_applies(model: nn.Module, tp: int) -> bool:
    """Whether ``auto_tp_plan(model, tp, sequence_parallel="auto")`` turns sequence parallelism on: what the
    strategy's default ``sequence_parallel="auto"`` gives at that TP size (off for Hugging Face models,
    recurrences, position tables outside the blocks, and blocks the TP size does not split).

    Example: ``sequence_parallel_applies(llama, 2)`` -> ``True``; ``plan(..., sequence_parallel="auto")`` asks it
    per TP size.
    """
    if tp == 1:
        return False
    from lightning_shard.tp import auto_tp_plan

    try:
        _, summary = auto_tp_plan(model, tp, sequence_parallel="auto", return_summary=True)
    except Exception:  # noqa: BLE001 - a model the plan cannot read: planned without (the larger footprint)
        return False
    return any(line.startswith("sequence_parallel: on") for line in summary)


def _preference(option: MeshOption) -> tuple:
    """The choice's order: the highest predicted tokens/s; on a tie (e.g. a step bound by communication, which
    hides the recomputation) the smaller TP size, then no checkpointing, no offload, resharding after forward --
    the simpler configuration, not whichever the search happened to list first."""
    e = option.estimate
    return (option.time.tokens_per_second_per_device, -option.mesh[1], e.options.checkpointing is None,
            not e.cpu_offload, e.reshard_after_forward is True)  # fmt: skip


def _table(options, choice, memory, budget, precision, batch, seq_len, device) -> str:
    head = (
        f"planner: {precision}, micro-batch {batch} x seq {seq_len}, device {device.name} with "
        f"{format_bytes(memory)} (budget {format_bytes(budget)} after the safety margin); {PIPELINE_NOTE}"
    )
    cols = ("configuration", "model states", "activations", "memory/rank", "comm/step", "step", "tok/s/dev", "MFU",
            "fits?")  # fmt: skip
    widths = (30, 12, 12, 12, 11, 8, 10, 5, 16)
    lines = [head, "  " + " | ".join(f"{c:>{w}}" for c, w in zip(cols, widths))]
    for o in options:
        e, t = o.estimate, o.time
        if e is None:
            lines.append(f"  {o.config:>30} | invalid: {o.reason}")
            continue
        cells = (
            o.config,
            format_bytes(e.model_states),
            format_bytes(e.activations),
            format_bytes(e.device_total),
            format_bytes(e.comm_total),
            f"{t.step:.3g} s",
            f"{t.tokens_per_second_per_device:,.0f}",
            f"{t.mfu:.0%}",
            ("yes" if o.fits else "no") + (" <- chosen" if o is choice else ""),
        )
        lines.append("  " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    if choice is not None:
        lines.append(
            f"  chosen: {choice.config}, the highest predicted tokens/s per device among the configurations that fit"
        )
    return "\n".join(lines)


def _no_fit_message(result, model, world_size, devices_per_node, memory, margin, common, hybrid, device) -> str:
    valid = [o for o in result.options if o.estimate is not None]
    if not valid:
        reasons = "; ".join(f"{o.mesh[0]}x{o.mesh[1]}: {o.reason}" for o in result.options)
        return f"planner: no valid mesh for {world_size} devices ({reasons})"
    best = min(valid, key=lambda o: o.estimate.device_total)
    e = best.estimate
    over = e.device_total - result.budget_bytes
    knobs = _knobs(model, best, result.budget_bytes, common, devices_per_node)
    knobs += _tensor_parallel_knobs(model, valid, result.budget_bytes, common)
    knobs.sort(key=lambda k: k[1])
    lines = [f"{name}: {format_bytes(after)} per device ({verdict})" for name, after, verdict in knobs]
    return (
        f"planner: the model does not fit on any configuration of {world_size} devices with {format_bytes(memory)} "
        f"each (budget {format_bytes(result.budget_bytes)} after a {margin:.0%} margin). Smallest requirement: "
        f"{format_bytes(e.device_total)} per device on {e.config}, {format_bytes(over)} over the budget "
        f"(model states {format_bytes(e.model_states)}, activations {format_bytes(e.activations)}, backward "
        f"transient {format_bytes(e.backward_transient)}). Knobs, the most helpful first:\n  - "
        + "\n  - ".join(lines)
        + "\n"
        + result.table
    )


def _knobs(model, best: MeshOption, budget: int, common: dict, devices_per_node: int) -> list[tuple[str, int, str]]:
    """What each single change would need per device on the smallest configuration, the most helpful first."""
    e = best.estimate
    base = dict(common, tp_plan=tp_plan_for(model, best.mesh[1]), replicas=e.replicas,
                activation_checkpointing=e.options.checkpointing, reshard_after_forward=e.reshard_after_forward,
                cpu_offload=e.cpu_offload, sequence_parallel=e.options.sequence_parallel)  # fmt: skip
    trials: list[tuple[str, dict]] = []
    if e.options.checkpointing != "full" and find_blocks(model):
        trials.append(("activation checkpointing of every block (activation_checkpointing='full')",
                       {"activation_checkpointing": "full"}))  # fmt: skip
    if not e.cpu_offload:
        trials.append(("CPU offload (cpu_offload=True)", {"cpu_offload": True}))
    if e.reshard_after_forward is not True:
        trials.append(("reshard_after_forward=True", {"reshard_after_forward": True}))
    if common["batch"] > 1:
        half = max(1, common["batch"] // 2)
        trials.append((f"micro-batch {half}", {"batch": half, "activations": None}))
    out = []
    for name, change in trials:
        kwargs = dict(base, **change)
        if kwargs.get("activations") is None:
            kwargs.pop("activations")
        after = estimate(model, best.mesh, **kwargs).device_total
        out.append((name, after, "fits" if after <= budget else f"still {format_bytes(after - budget)} over"))
    # more devices: model states shrink with the data-parallel size, the rest does not
    rest = e.device_total - (0 if e.cpu_offload else e.model_states)
    room = budget - rest
    if not e.cpu_offload and room > 0:
        need = -(-e.model_states * best.mesh[0] // room) * best.mesh[1]
        after = rest + e.model_states * best.mesh[0] // max(1, need // best.mesh[1])
        out.append((f"more devices (about {need})", after, "fits"))
    else:
        out.append(("more devices", rest, "does not help: activations and working set alone exceed the budget"))
    out.sort(key=lambda k: k[1])
    return out


def _tensor_parallel_knobs(model, valid: list[MeshOption], budget: int, common: dict) -> list[tuple[str, int, str]]:
    """Sequence and loss parallelism, where they are off: each (and both) on the tensor-parallel configuration
    where it needs the least per device; sequence parallelism only at TP sizes where ``auto_tp_plan`` would apply
    it. They shrink the activations between blocks and the logits by the TP size, often the largest saving of a
    long sequence or a large vocabulary."""
    changes = [
        ("sequence parallelism (sequence_parallel=True)", {"sequence_parallel": True}),
        ("loss parallelism (loss_parallel=True)", {"loss_parallel": True}),
        ("sequence and loss parallelism (sequence_parallel=True, loss_parallel=True)",
         {"sequence_parallel": True, "loss_parallel": True}),
    ]  # fmt: skip
    # sequence parallelism only where auto_tp_plan would apply it (elsewhere True raises or trains wrong)
    sp_ok = {o.mesh[1]: sequence_parallel_applies(model, o.mesh[1]) for o in valid if o.mesh[1] > 1}
    out = []
    for name, change in changes:
        trials = []
        for option in valid:
            e = option.estimate
            if option.mesh[1] == 1 or any(getattr(e.options, k) for k in change):
                continue  # no TP, or already on
            if change.get("sequence_parallel") and not sp_ok[option.mesh[1]]:
                continue
            kwargs = {**common, "tp_plan": tp_plan_for(model, option.mesh[1]), "replicas": e.replicas,
                      "activation_checkpointing": e.options.checkpointing, "cpu_offload": e.cpu_offload,
                      "reshard_after_forward": e.reshard_after_forward,
                      "sequence_parallel": e.options.sequence_parallel, **change}  # fmt: skip
            trials.append((estimate(model, option.mesh, **kwargs).device_total, option.estimate.config))
        if not trials:
            continue
        after, config = min(trials)
        verdict = "fits" if after <= budget else f"still {format_bytes(after - budget)} over"
        out.append((f"{name} on {config}", after, verdict))
    return out


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

    Raises :class:`NoFitError` when nothing fits. Example::

        tp, table = choose_tensor_parallel_size(model, 8, 8, torch.cuda.get_device_properties(0).total_memory,
                                                "bf16-mixed", batch=4, seq_len=2048)
    """
    result = plan(
        model, world_size, devices_per_node, device_memory_bytes, precision=precision, batch=batch,
        seq_len=seq_len, **kwargs,
    )  # fmt: skip
    return result.choice.mesh[1], result.table


@dataclass(frozen=True)
class Configuration:
    """What ``"auto"`` settings resolve to: the TP size, activation checkpointing (``None`` or ``"full"``),
    ``reshard_after_forward``, CPU offload, and the table explaining the choice.

    Example: ``Configuration(2, "full", True, False, table)``.
    """

    tensor_parallel_size: int
    activation_checkpointing: str | frozenset | None
    reshard_after_forward: bool | int
    cpu_offload: bool
    table: str


def choose_configuration(
    model: nn.Module,
    world_size: int,
    devices_per_node: int,
    device_memory_bytes: int | str,
    precision: str,
    *,
    batch: int = 1,
    seq_len: int = 2048,
    **kwargs,
) -> Configuration:
    """The fastest predicted configuration that fits, for a strategy whose TP size, activation checkpointing,
    ``reshard_after_forward`` and CPU offload may each be ``"auto"`` (pass ``"auto"`` for the ones to search,
    the user's value for the others; see :func:`plan`). Raises :class:`NoFitError` when nothing fits.

    Example::

        c = choose_configuration(model, 64, 8, "80GB", "bf16-mixed", batch=2, seq_len=8192,
                                 activation_checkpointing="auto", reshard_after_forward="auto", cpu_offload="auto")
        c.tensor_parallel_size, c.activation_checkpointing, c.reshard_after_forward, c.cpu_offload
    """
    result = plan(
        model, world_size, devices_per_node, device_memory_bytes, precision=precision, batch=batch,
        seq_len=seq_len, **kwargs,
    )  # fmt: skip
    e = result.choice.estimate
    return Configuration(result.choice.mesh[1], e.options.checkpointing, e.reshard_after_forward, e.cpu_offload,
                         result.table)  # fmt: skip
