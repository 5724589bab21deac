"""Sharding rules, one module per op family. ``load_rules()`` imports them all (once, lazily, because the
rule modules import the DTensor type that in turn dispatches to them)."""

import importlib
import pkgutil

_LOADED = False


def load_rules() -> None:
    """Import every rule module in this package so its ``@register`` calls run."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
