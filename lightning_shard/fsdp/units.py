"""Which modules to wrap with ``fully_shard``: the repeated blocks of a model (e.g. transformer layers), and
which shared (tied) parameters each of them must leave to an enclosing unit.

Shared by the Lightning strategy (``fsdp_unit="auto"``) and the memory planner, so both group parameters
the same way.

A parameter registered under several names (a tied embedding and LM head, T5's embedding used by
``shared``, ``encoder.embed_tokens``, ``decoder.embed_tokens`` and ``lm_head``) must live in exactly one
FSDP group: two groups would each shard and train their own copy. ``split_shared_params`` finds, for a list
of units, every shared parameter that a unit holds only some of the names of; such a unit must leave the
parameter to the innermost enclosing unit that holds all of them (the root at the latest).

Example::

    units = find_repeated_blocks(model)              # e.g. every LlamaBlock
    leave = split_shared_params(model, units)        # {} for most models; T5: the embedding, per T5Stack
    for block in units:                              # innermost first
        fully_shard(block, ignored_params=leave.get(block, SharedSplit.none()).params)
    fully_shard(model)                               # the root takes what the blocks left
"""

from __future__ import annotations

import functools
import inspect
import re
from collections import Counter
from dataclasses import dataclass

from torch import nn

_LEAF_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Dropout, nn.Conv1d, nn.Conv2d)
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Instances of the repeated block class: among non-leaf, non-container classes with at least two
    instances, the one with the most parameters per instance (the outer block when blocks nest). A class that
    a Hugging Face model names in ``_no_split_modules`` (its transformer layer) wins over that size rule, so
    that a model built of two stacks of layers (T5's encoder and decoder are two ``T5Stack`` instances) is
    wrapped per layer, not per stack. A class some instance of which its parent calls as ``child.forward(...)``
    (``called_without_hooks``) is no candidate: a unit there would never gather its parameters.

    Example: ``find_repeated_blocks(llama)`` -> the ``LlamaBlock`` modules, in module order;
    ``find_repeated_blocks(t5)`` -> the ``T5Block`` modules of both stacks.
    """
    counts: Counter = Counter()
    sizes: dict[type, int] = {}
    for m in model.modules():
        if m is model or isinstance(m, _LEAF_TYPES + _CONTAINERS) or not list(m.children()):
            continue
        counts[type(m)] += 1
        sizes[type(m)] = sum(p.numel() for p in m.parameters())
    skipped = {type(m) for m in called_without_hooks(model)}
    candidates = [cls for cls, n in counts.items() if n >= 2 and sizes[cls] > 0 and cls not in skipped]
    declared = _declared_layer_names(model)
    named = [cls for cls in candidates if cls.__name__ in declared]
    block = max(named or candidates, key=lambda cls: sizes[cls], default=None)
    return [m for m in model.modules() if block is not None and type(m) is block and m is not model]


# ``self.layer.forward(x)`` names the child; ``layer.forward(x)`` (a loop variable) one of a container's elements.
_ATTR_FORWARD = re.compile(r"self\.(\w+)\.forward\(")
_NAME_FORWARD = re.compile(r"(?<![.\w])(?!self\b|super\b)(\w+)\.forward\(")


def called_without_hooks(model: nn.Module) -> list[nn.Module]:
    """Modules their parent's code calls as ``child.forward(...)`` rather than ``child(...)``: no module hook runs,
    so an FSDP unit there would never gather its parameters (SqueezeBERT's encoder runs
    ``layer.forward(hidden_states, ...)`` over its layers). Found in the source of the parent's ``forward``: the
    child named by ``self.<name>.forward(``, or, for a plain name (a loop variable), every element of the parent's
    containers. Only ``forward`` is read: a class's other methods (a LightningModule's export helpers call
    ``model.forward``) do not run in its forward, and reading them made every element of a LightningModule's
    ``nn.Sequential`` children a module "called without hooks".

    Example: ``called_without_hooks(squeezebert)`` -> the ``SqueezeBertModule`` layers of its encoder.
    """
    found: list[nn.Module] = []
    for parent in model.modules():
        source = _forward_source(type(parent).forward)
        if ".forward(" not in source:
            continue
        children = dict(parent.named_children())
        for name in _ATTR_FORWARD.findall(source):
            child = children.get(name)
            if child is not None:
                found.extend(child.children() if isinstance(child, _CONTAINERS) else [child])
        if _NAME_FORWARD.search(source):
            found.extend(m for c in children.values() if isinstance(c, _CONTAINERS) for m in c.children())
    return found


@functools.cache
def _forward_source(forward) -> str:
    try:
        return inspect.getsource(forward)
    except (OSError, TypeError):
        return ""


def _declared_layer_names(model: nn.Module) -> set[str]:
    """Class names that Hugging Face models (the root or any sub-module, e.g. the model inside a
    LightningModule) declare in ``_no_split_modules``: their layers, which must not be split across devices."""
    names: set[str] = set()
    for m in model.modules():
        declared = getattr(m, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set, frozenset)):
            names.update(n for n in declared if isinstance(n, str))
    return names


def shared_parameters(model: nn.Module) -> dict[int, tuple[nn.Parameter, list[str]]]:
    """Every parameter registered under more than one name: ``{id(param): (param, [fqn, ...])}``, names in
    ``model.named_modules(remove_duplicate=False)`` order (the first is the name ``named_parameters`` reports).

    Example: ``shared_parameters(gpt2)`` -> ``{id: (wte.weight, ["transformer.wte.weight", "lm_head.weight"])}``.
    """
    names: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for mod_name, sub in model.named_modules(remove_duplicate=False):
        for name, p in sub.named_parameters(recurse=False):
            if p is not None:
                names.setdefault(id(p), (p, []))[1].append(f"{mod_name}.{name}" if mod_name else name)
    return {k: v for k, v in names.items() if len(v[1]) > 1}


@dataclass(frozen=True)
class SharedSplit:
    """The shared parameters one unit holds only some names of: ``params`` (to leave to an enclosing unit),
    and for each, one name inside the unit and one outside it (for error messages).

    Example: for T5's encoder ``SharedSplit(params=(shared,), pairs=(("encoder.embed_tokens.weight",
    "shared.weight"),))``.
    """

    params: tuple[nn.Parameter, ...]
    pairs: tuple[tuple[str, str], ...]

    @staticmethod
    def none() -> SharedSplit:
        return SharedSplit((), ())


def split_shared_params(model: nn.Module, units: list[nn.Module]) -> dict[nn.Module, SharedSplit]:
    """For each unit of ``units`` (modules inside ``model``) that holds some but not all names of a shared
    parameter: that parameter and a name inside / outside. Units that split nothing are absent.

    Example::

        split_shared_params(t5, [t5.encoder, t5.decoder])
        # {t5.encoder: SharedSplit((shared,), (("encoder.embed_tokens.weight", "shared.weight"),)), t5.decoder: ...}
    """
    shared = shared_parameters(model)
    if not shared:
        return {}
    prefixes: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if name:
            prefixes.setdefault(id(m), []).append(name + ".")
    out: dict[nn.Module, SharedSplit] = {}
    for unit in units:
        params, pairs = [], []
        for p, fqns in shared.values():
            inside = [n for n in fqns if any(n.startswith(pre) for pre in prefixes.get(id(unit), ()))]
            outside = [n for n in fqns if n not in inside]
            if inside and outside:
                params.append(p)
                pairs.append((inside[0], outside[0]))
        if params:
            out[unit] = SharedSplit(tuple(params), tuple(pairs))
    return out
