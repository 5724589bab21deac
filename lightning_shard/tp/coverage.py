"""``tp_coverage``: how much of a model's weight matrices a tensor-parallel plan shards, and what it leaves.

A plan that shards only the embeddings runs, trains right, and saves no memory: the number users need is
the fraction of weight-matrix elements (parameters with two or more dims: Linear/Conv1D weights,
embeddings) that the plan places ``Shard`` on the TP mesh, and which modules stay replicated and why.

Example::

    plan, summary = auto_tp_plan(model, 2, return_summary=True)
    cov = tp_coverage(model, plan, summary)
    print(cov.describe())            # "TP shards 97.1% of weight-matrix elements (...); replicated: ..."
    assert cov.sharded_fraction > 0.9
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_shard.tp.api import _resolve

__all__ = ["TPCoverage", "tp_coverage", "REPLICATED_WARN_FRACTION"]

#: more than this fraction of weight-matrix elements replicated makes the strategy warn at startup.
REPLICATED_WARN_FRACTION = 0.10

_NO_RULE = "no plan entry (not recognised as attention, MLP, embedding or LM head)"


@dataclass(frozen=True)
class TPCoverage:
    """Weight-matrix elements a plan shards; ``replicated`` lists ``(module fqn, elements, reason)``.

    Example: ``tp_coverage(model, plan).sharded_fraction`` -> ``0.97``.
    """

    sharded_elements: int
    total_elements: int
    replicated: tuple[tuple[str, int, str], ...]

    @property
    def sharded_fraction(self) -> float:
        return self.sharded_elements / self.total_elements if self.total_elements else 1.0

    @property
    def replicated_fraction(self) -> float:
        return 1.0 - self.sharded_fraction

    def describe(self, limit: int = 8) -> str:
        """One line: the sharded fraction and the largest replicated modules with their reasons."""
        head = (
            f"TP shards {100 * self.sharded_fraction:.1f}% of weight-matrix elements "
            f"({self.sharded_elements:,} of {self.total_elements:,})"
        )
        if not self.replicated:
            return head
        biggest = sorted(self.replicated, key=lambda r: -r[1])
        items = [f"{fqn} ({n:,}: {why})" for fqn, n, why in biggest[:limit]]
        more = f", and {len(biggest) - limit} more" if len(biggest) > limit else ""
        return f"{head}; replicated: {'; '.join(items)}{more}"


def tp_coverage(model: nn.Module, plan, summary: list[str] | None = None) -> TPCoverage:
    """Measure ``plan`` (a ``parallelize_module`` plan) on ``model`` before it is applied.

    A parameter with two or more dims counts as sharded when a style of the plan places it with a ``Shard``
    placement; a parameter tied between modules counts once. Reasons for replicated modules come from
    ``summary`` (``auto_tp_plan(..., return_summary=True)``) lines of the module or its nearest ancestor
    that say ``left replicated``; otherwise "no plan entry".

    Example: ``tp_coverage(model, *auto_tp_plan(model, 2, return_summary=True))``.

    >>> from lightning_shard.tp import ColwiseParallel
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    >>> cov = tp_coverage(model, {"0": ColwiseParallel()})   # the weights' elements, biases aside
    >>> cov.sharded_elements, cov.total_elements, cov.replicated[0][:2], cov.replicated[0][2].startswith("no plan")
    (128, 256, ('1', 128), True)
    """
    planned: dict[int, bool] = {}
    for _, sub, style in _resolve(model, plan):
        for name, placements in style.planned_placements(sub).items():
            p = sub._parameters.get(name)
            if p is not None:
                sharded = any(pl.is_shard() for pl in placements)
                planned[id(p)] = planned.get(id(p), False) or sharded
    reasons = _reasons(summary or [])
    seen: set[int] = set()
    total = sharded = 0
    replicated: dict[str, list] = {}
    for module_fqn, module in model.named_modules():
        for p in module._parameters.values():
            if p is None or p.ndim < 2 or id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if planned.get(id(p), False):
                sharded += p.numel()
                continue
            owner, why = _reason(module_fqn, reasons)  # grouped by the module the reason is about
            entry = replicated.setdefault(owner, [owner, 0, why])
            entry[1] += p.numel()
    return TPCoverage(sharded, total, tuple(tuple(v) for v in replicated.values()))


def _reasons(summary: list[str]) -> dict[str, str]:
    out = {}
    for line in summary:
        fqn, sep, why = line.partition(": ")
        if sep and "left replicated" in why:
            out[fqn] = why.replace(", left replicated", "").replace(" left replicated", "")
    return out


def _reason(fqn: str, reasons: dict[str, str]) -> tuple[str, str]:
    parts = fqn.split(".") if fqn else []
    for k in range(len(parts), -1, -1):
        key = ".".join(parts[:k])
        if key in reasons:
            return key, reasons[key]
    return fqn, _NO_RULE
