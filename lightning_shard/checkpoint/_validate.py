"""Checks shared by the ``set_*`` functions and ``load``: everything is validated before anything is copied.

Example::

    problems = Problems("set_model_state_dict")
    problems.missing(["head.weight"]); problems.raise_if_any(n_expected=10)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_SHOW = 5  # offending keys named per kind; the count says how many more


class Problems:
    """Collects missing / unexpected / mismatched keys, then raises one ``ValueError`` naming the first ones."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.missing_keys: list[str] = []
        self.unexpected_keys: list[str] = []
        self.mismatches: list[str] = []
        self.dtypes: list[str] = []  # same shape, a dtype that cannot be cast exactly: not "another model"
        self.other: list[str] = []

    def missing(self, keys: Iterable[str]) -> None:
        self.missing_keys.extend(keys)

    def unexpected(self, keys: Iterable[str]) -> None:
        self.unexpected_keys.extend(keys)

    def mismatch(self, key: str, expected: str, got: str) -> None:
        self.mismatches.append(f"{key!r}: expected {expected}, got {got}")

    def dtype(self, key: str, expected: torch.dtype, got: torch.dtype) -> None:
        self.dtypes.append(f"{key!r}: {_name(got)} cannot be loaded into {_name(expected)} exactly")

    def add(self, message: str) -> None:
        self.other.append(message)

    def __bool__(self) -> bool:
        return bool(self.missing_keys or self.unexpected_keys or self.mismatches or self.dtypes or self.other)

    def raise_if_any(self, n_expected: int, n_matched: int | None = None) -> None:
        """Raise if anything was recorded. ``n_matched`` (keys present on both sides) detects another model."""
        if not self:
            return
        lines = [f"{self.what}: the state does not fit; nothing was loaded (every key is checked before any copy)."]
        if (
            n_matched is not None
            and n_expected
            and (n_matched < n_expected / 2 or len(self.mismatches) > n_matched / 2)
        ):
            lines.append(
                f"  This looks like a checkpoint of another model: only {n_matched} of {n_expected} expected keys "
                "are present with matching shapes."
            )
        for title, items in (
            ("missing keys", self.missing_keys),
            ("unexpected keys", self.unexpected_keys),
            ("shape/type mismatches", self.mismatches),
            ("dtype mismatches", self.dtypes),
            ("other problems", self.other),
        ):
            if items:
                more = f" (and {len(items) - _SHOW} more)" if len(items) > _SHOW else ""
                lines.append(f"  {len(items)} {title}: " + "; ".join(map(str, items[:_SHOW])) + more)
        if self.dtypes:
            lines.append(
                "  Widening casts (bfloat16/float16 -> float32/float64, float32 -> float64) are done on load; "
                "narrowing ones would change values, so cast the model to the checkpoint's dtype first (e.g. "
                "model.to(torch.float32)) or convert the checkpoint."
            )
        if self.missing_keys or self.unexpected_keys:
            lines.append("  Pass strict=False to load only the keys present on both sides.")
        raise ValueError("\n".join(lines))


def describe(shape: Iterable[int], dtype: torch.dtype) -> str:
    return f"shape {tuple(shape)} {_name(dtype)}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# saved dtype -> dtypes it is cast to on load, exactly (every value of the saved dtype is representable)
EXACT_CASTS: dict[torch.dtype, frozenset[torch.dtype]] = {
    torch.bfloat16: frozenset({torch.float32, torch.float64}),
    torch.float16: frozenset({torch.float32, torch.float64}),
    torch.float32: frozenset({torch.float64}),
}


def castable(saved: torch.dtype, target: torch.dtype) -> bool:
    """Whether a ``saved`` value loads into a ``target`` tensor: same dtype or an exact widening cast.

    Example: ``castable(torch.bfloat16, torch.float32)`` -> True; ``castable(torch.float32, torch.bfloat16)`` ->
    False (rounding would change the values).
    """
    return saved == target or target in EXACT_CASTS.get(saved, frozenset())
