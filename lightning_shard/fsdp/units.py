"""Which modules to wrap with ``fully_shard``: the repeated blocks of a model (e.g. transformer layers).

Shared by the Lightning strategy (``fsdp_unit="auto"``) and the memory planner, so both group parameters
the same way.

Example::

    for block in find_repeated_blocks(model):   # e.g. every LlamaBlock
        fully_shard(block)
    fully_shard(model)
"""

from __future__ import annotations

from collections import Counter

from torch import nn

_LEAF_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Dropout, nn.Conv1d, nn.Conv2d)
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Instances of the repeated block class: the non-leaf, non-container class with at least two instances
    and the most parameters per instance (the outer block when blocks nest).

    Example: ``find_repeated_blocks(llama)`` -> the ``LlamaBlock`` modules, in module order.
    """
    counts: Counter = Counter()
    sizes: dict[type, int] = {}
    for m in model.modules():
        if m is model or isinstance(m, _LEAF_TYPES + _CONTAINERS) or not list(m.children()):
            continue
        counts[type(m)] += 1
        sizes[type(m)] = sum(p.numel() for p in m.parameters())
    candidates = [cls for cls, n in counts.items() if n >= 2 and sizes[cls] > 0]
    block = max(candidates, key=lambda cls: sizes[cls], default=None)
    return [m for m in model.modules() if block is not None and type(m) is block and m is not model]
