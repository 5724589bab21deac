"""``parallelize_module``: apply a plan of parallel styles to a module's submodules.

Example::

    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))["tensor_parallel"]
    parallelize_module(model, tp_mesh, {"layers.*.mlp.up": ColwiseParallel(), "layers.*.mlp.down": RowwiseParallel()})
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tp._torch_styles import from_torch
from lightning_shard.tp.nested_encoder import keep_encoders_padded
from lightning_shard.tp.plan_check import watch_plan
from lightning_shard.tp.style import ParallelStyle

__all__ = ["parallelize_module"]

PlanValue = ParallelStyle | Sequence[ParallelStyle]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: PlanValue | dict[str, PlanValue],
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Apply ``parallelize_plan`` to ``module`` over the 1-D tensor-parallel mesh ``device_mesh``.

    ``parallelize_plan`` is a style (applied to ``module`` itself) or a dict from module FQNs to styles. A
    key's dot-separated segments are matched with ``fnmatch`` (``*`` wildcards, e.g. ``"layers.*.attn.q_proj"``);
    ``""`` is the module itself. A value may also be a list/tuple of styles applied in order (an extension
    of torch's API, used by ``auto_tp_plan`` for ``DivideAttributes`` next to ``PrepareModuleInput``).
    Parameters are distributed with ``distribute_tensor(..., src_data_rank=src_data_rank)``: by default
    rank 0's values, so every rank starts from the same model. Parameters tied between modules (a tied LM
    head and embedding) stay one parameter.

    Every check runs before any collective and raises ``ValueError``: a mesh that is not 1-D, a key that
    matches no module (with near matches), a style on an unsupported module type, a sharded size not
    divisible by the TP size, a tied parameter planned with two different placements. A plan whose
    column-parallel outputs reach no row-parallel module (or the reverse) fails in forward with the model's
    own shape error plus a note naming the modules, their styles and the fix (``plan_check.py``).
    An ``nn.TransformerEncoder`` whose layers a style hooks runs its eval forward on padded tensors, never
    nested ones, with the nested path's results (``nested_encoder.py``).

    Example: ``parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})``; on one rank:

    >>> from lightning_shard import init_device_mesh
    >>> from lightning_shard.tp import ColwiseParallel, RowwiseParallel
    >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> mlp = parallelize_module(mlp, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    >>> mlp[0].weight.placements, mlp[2].weight.placements, mlp(torch.ones(3, 4)).shape
    ((Shard(dim=0),), (Shard(dim=1),), torch.Size([3, 4]))
    """
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
        shape = getattr(device_mesh, "shape", None)
        raise ValueError(
            f"parallelize_module: the tensor-parallel mesh must be a 1-D DeviceMesh, got {type(device_mesh).__name__} "
            f"of shape {shape}; pass the TP sub-mesh, e.g. mesh['tensor_parallel']"
        )
    tp_size = device_mesh.size()
    items = _resolve(module, parallelize_plan)
    for fqn, sub, style in items:  # validate everything first: nothing below may raise on one rank only
        style._check(fqn, sub, tp_size)
    _check_ties(module, items)
    ties = _tied_owners(module)
    for _, sub, style in items:
        style.src_data_rank = src_data_rank
        style._apply(sub, device_mesh)
    _retie(ties)
    # The styles' hooks cannot take the nested tensors nn.TransformerEncoder makes in eval (nested_encoder.py).
    keep_encoders_padded(module, [sub for _, sub, _ in items])
    watch_plan(module, items)  # a half-complete plan's shape error in forward gets a note naming it (plan_check.py)
    return module


def _styles(value: PlanValue, key: str) -> list[ParallelStyle]:
    styles = list(value) if isinstance(value, (list, tuple)) else [value]
    styles = [ours for s in styles for ours in from_torch(s, key)]  # torch's own styles -> ours (_torch_styles.py)
    for s in styles:
        if not isinstance(s, ParallelStyle):
            raise TypeError(
                f"parallelize_module: plan entry {key!r} is {type(s).__name__}, not a ParallelStyle "
                "(ColwiseParallel(), RowwiseParallel(), ...)"
            )
    return styles


def _resolve(module: nn.Module, plan) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(fqn, submodule, style) for every plan entry, in plan order, wildcards expanded."""
    if not isinstance(plan, dict):
        return [("", module, s) for s in _styles(plan, "")]
    modules = dict(module.named_modules())
    items = []
    for key, value in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"parallelize_module: plan keys must be module FQN strings, got {key!r}")
        pattern = key.split(".") if key else []
        hits = [fqn for fqn in modules if _matches(pattern, fqn.split(".") if fqn else [])]
        if not hits:
            near = difflib.get_close_matches(key, [f for f in modules if f], n=5, cutoff=0.5)
            raise ValueError(
                f"parallelize_module: plan key {key!r} matches no submodule of {type(module).__name__}; "
                f"near matches: {near or 'none'} (keys are FQNs from named_modules(), '*' matches one segment)"
            )
        for fqn in hits:
            items.extend((fqn, modules[fqn], s) for s in _styles(value, key))
    return items


def _matches(pattern: list[str], parts: list[str]) -> bool:
    return len(pattern) == len(parts) and all(fnmatchcase(p, q) for q, p in zip(pattern, parts))


def _tied_owners(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((sub, name))
    return [o for o in owners.values() if len(o) > 1]


def _check_ties(module: nn.Module, items) -> None:
    planned: dict[int, tuple[str, tuple]] = {}
    for fqn, sub, style in items:
        for name, placements in style.planned_placements(sub).items():
            p = sub._parameters.get(name)
            if p is None:
                continue
            where = f"{fqn}.{name}" if fqn else name
            seen = planned.setdefault(id(p), (where, placements))
            if seen[1] != placements:
                raise ValueError(
                    f"parallelize_module: parameter '{where}' is tied to '{seen[0]}' but the plan places it "
                    f"{list(placements)} there and {list(seen[1])} at '{seen[0]}'; a tied LM head (ColwiseParallel, "
                    "Shard(0)) needs a vocab-parallel embedding (RowwiseParallel, Shard(0))"
                )


def _retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every owner of a tied parameter at the one DTensor parameter the plan made for it."""
    from lightning_shard.tensor import DTensor

    for owners in ties:
        made = [m._parameters[n] for m, n in owners if isinstance(m._parameters[n], DTensor)]
        if made:
            for m, n in owners:
                m._parameters[n] = made[0]
