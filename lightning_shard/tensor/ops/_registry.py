"""The sharding-rule registry: what a rule receives (``OpCall``) and returns (``Plan``).

A rule looks at the placements of an op's DTensor arguments and decides (1) the placements each argument
must be redistributed to before the op runs on local shards, (2) the placements of each tensor output, and,
for ops whose arguments hold sizes or indices (views, slices, factories), (3) the arguments to use for the
local call. Output global shapes come from running the op on meta tensors, so rules never compute shapes.

Example::

    @register(aten.mm.default)
    def mm_rule(call: OpCall) -> Plan:
        a, b = call.specs
        ...
        return Plan([a_placements, b_placements], [out_placements])

A rule returns ``None`` when it has no sharded strategy for the given input; the dispatcher then uses the
Replicate-and-compute fallback (counted in ``fallback_counts()``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor.placements import Placement
from lightning_shard.tensor.spec import DTensorSpec

Placements = tuple[Placement, ...]


@dataclass
class OpCall:
    """One op call as a rule sees it.

    ``flat`` is the pytree-flattened ``(args, kwargs)``; ``dtensor_positions[k]`` is where the k-th DTensor
    argument sits in ``flat`` and ``specs[k]`` is its spec.
    """

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    flat: list
    dtensor_positions: list[int]
    specs: list[DTensorSpec]
    mesh: DeviceMesh

    @property
    def name(self) -> str:
        return str(self.func)

    def is_inplace(self) -> bool:
        return is_inplace(self.func)


@dataclass
class Plan:
    """A rule's decision: input placements (one per DTensor arg), output placements (one per tensor output,
    in pytree order), and optionally the ``(args, kwargs)`` to pass to the local op (DTensors still inside;
    the dispatcher swaps in the redistributed local tensors)."""

    inputs: list[Placements]
    outputs: list[Placements | None]
    local_args: tuple[tuple, dict] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


Rule = Callable[[OpCall], "Plan | None"]
RULES: dict[Any, Rule] = {}


def register(*ops) -> Callable[[Rule], Rule]:
    """Register ``rule`` for each op (an OpOverload, or an OpOverloadPacket meaning all its overloads)."""

    def deco(rule: Rule) -> Rule:
        for op in ops:
            RULES[op] = rule
        return rule

    return deco


def find_rule(func: torch._ops.OpOverload) -> Rule | None:
    return RULES.get(func) or RULES.get(func.overloadpacket)


def is_inplace(func: torch._ops.OpOverload) -> bool:
    return torch.Tag.inplace_view in func.tags or (
        func._schema.is_mutable and func._schema.name.endswith("_") and not func._schema.name.endswith("__")
    )
