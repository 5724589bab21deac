"""Check that the ranks agree on what must be the same everywhere before a collective pairs their tensors.

Collectives pair tensors by call order and size, never by name: ranks that built another model (a stale checkout
on one node, code that branches on the rank) hang, crash in the backend with a message naming nothing, or (same
sizes, another layout) mix up shards silently. A check describes what must agree as sections of ``{key: value}``
strings, gathers one short digest per section (one small all-gather), and only when a digest differs gathers the
sections whole, to name the keys that differ, the ranks holding each value and the fix; every rank raises the same
``RanksDisagreeError``.

Example::

    check_ranks_agree({"parameters": {"w": "(4, 4) float32"}}, when="before sharding", fixes={"parameters": "..."})
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from lightning_shard import comm

__all__ = ["RanksDisagreeError", "check_ranks_agree"]

Sections = dict[str, dict[str, str]]


class RanksDisagreeError(RuntimeError):
    """The ranks disagree about something that must be the same on every rank; raised on every rank alike."""


def check_ranks_agree(
    sections: Sections,
    *,
    when: str,
    fixes: dict[str, str],
    who: str = "shard_fsdp_tp",
    group: dist.ProcessGroup | None = None,
) -> None:
    """Raise ``RanksDisagreeError`` on every rank of ``group`` (default: all) unless they hold the same
    ``sections``; ``fixes`` says per section what to do about a difference.

    One all-gather of a 16-character digest per section; a second one, of the sections themselves, only when a
    digest differs. A no-op on one rank and on the simulator's fake process group. Ranks are named by their
    global rank.

    Example: ``check_ranks_agree({"settings": {"accumulate_grad_batches": "2"}}, when="at setup", fixes={})``.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if not comm.carries_data(group):
        return
    digests = {name: _digest(entries) for name, entries in sections.items()}
    every = comm.all_gather_objects(digests, group)
    if all(d == every[0] for d in every):
        return
    differing = [name for name in sections if len({d.get(name) for d in every}) > 1]
    gathered = comm.all_gather_objects({name: sections[name] for name in differing}, group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    lines = [f"{name}: {_differences([g[name] for g in gathered], ranks)}; fix: {fixes.get(name, 'make them equal')}"
             for name in differing]  # fmt: skip
    raise RanksDisagreeError(
        f"{who}: the ranks disagree {when}, so their collectives would pair up tensors of different layouts (a "
        "hang, a crash in the backend, or training silently wrong).\n" + "\n".join(lines)
    )


def _digest(entries: dict[str, str]) -> str:
    return hashlib.sha256(repr(list(entries.items())).encode()).hexdigest()[:16]


def _differences(per_rank: list[dict[str, str]], ranks: list[int], shown: int = 4) -> str:
    """The keys whose values differ (a missing key counts as ``<absent>``), each with the ranks per value; or,
    when every key agrees, the first position where the order differs."""
    keys = list(dict.fromkeys(k for entries in per_rank for k in entries))
    unequal = [k for k in keys if len({entries.get(k, "<absent>") for entries in per_rank}) > 1]
    if not unequal:
        orders = [list(entries) for entries in per_rank]
        i = next(i for i in range(len(keys)) if len({tuple(o[i : i + 1]) for o in orders}) > 1)
        return f"the same entries in another order; at position {i}: " + _by_value(
            [repr(o[i]) if i < len(o) else "<end>" for o in orders], ranks
        )
    described = [f"{k!r}: " + _by_value([entries.get(k, "<absent>") for entries in per_rank], ranks) for k in unequal]
    more = f" and {len(unequal) - shown} more" if len(unequal) > shown else ""
    return "; ".join(described[:shown]) + more


def _by_value(values: list[str], ranks: list[int]) -> str:
    holders: dict[str, list[int]] = {}
    for rank, value in zip(ranks, values):
        holders.setdefault(value, []).append(rank)
    return ", ".join(f"{value} on {_ranks(r)}" for value, r in holders.items())


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 6:
        return f"ranks {ranks[:3]}... ({len(ranks)} ranks)"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
