"""The FSDP units of a root agree across the ranks of its shard group: checked once, at the root's first forward.

Every all-gather and reduce-scatter of a unit pairs the ranks' flat buffers by position. Ranks that sharded another
model (an extra parameter, another shape or dtype, the same parameters registered in another order, a parameter
frozen on one rank only, other units) would hang, crash in the backend, or gather one parameter's shards into
another's. ``lightning_shard.agreement`` compares the units' parameters with one small all-gather of a digest on
the shard group, where the forward's own all-gathers are about to run anyway (so no rank can be left waiting).

Example: called by ``FSDPState._lazy_init``; the Lightning strategy, which compares the whole model before
sharding, turns it off with ``root_state.agreement_checked = True``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_shard.agreement import check_ranks_agree

if TYPE_CHECKING:
    from lightning_shard.fsdp.state import FSDPState

FIX = (
    "shard the same model on every rank: build it without branching on the rank, the node or an environment "
    "variable, register parameters in the same order, freeze (requires_grad_) and cast them alike on every rank, "
    "and call fully_shard on the same modules with the same arguments"
)


def unit_entries(states: list[FSDPState]) -> dict[str, str]:
    """Per unit (by its path under the root): its parameters' names, global shapes, dtypes and ``requires_grad``
    in the group's order, and its resharding and mixed-precision settings."""
    out: dict[str, str] = {}
    for state in states:
        params = state.group.params if state.group is not None else []
        described = [
            f"{fp.fqn} {tuple(fp.sharded.shape)} {str(fp.sharded.dtype).removeprefix('torch.')} "
            f"requires_grad={fp.sharded.requires_grad}"
            for fp in params
        ]
        out[state.unit.unit] = f"{described} reshard_after_forward={state.reshard_after_forward} {state.mp_policy}"
    return out


def check_units_agree(root: FSDPState) -> None:
    """Raise ``RanksDisagreeError`` on every rank of the root's shard group unless they sharded the same units."""
    grouped = [s for s in root.all_states if s.group is not None]
    if not grouped or grouped[0].group.mesh_info.shard_size == 1:
        return  # no all-gather in the forward: nothing to pair up, and no collective to add
    check_ranks_agree(
        {"FSDP units": unit_entries(root.all_states)},
        when="about the FSDP units (at the root's first forward)",
        fixes={"FSDP units": FIX},
        who="fully_shard",
        group=grouped[0].group.mesh_info.shard_group,
    )
