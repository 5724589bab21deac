"""torch's parallel styles in a plan: converted to ours with the same arguments, or refused naming ours.

A ``tp_plan`` written for torch (``torch.distributed.tensor.parallel.ColwiseParallel()`` etc., e.g. copied from
torchtitan) names styles that our ``parallelize_module`` cannot apply: they rewrite modules into torch's
DTensor. Each of torch's public styles has an equivalent here with the same keyword arguments, so
``from_torch`` rebuilds it from the attributes torch's constructor stored: ``input_layouts``,
``output_layouts``, ``desired_*_layouts``, ``input_kwarg_layouts``, ``sequence_dim``, ``use_local_output``,
with torch's ``Shard``/``Replicate``/``Partial`` placements mapped to ours. Only the exact public classes are
converted: a subclass (say a float8 style) changes what ``_apply`` does, and a private placement
(``_StridedShard``, ``_MaskPartial``) has no exact meaning in a layout; both raise a ``TypeError`` naming our
equivalent. ``src_data_rank`` is not copied: ``parallelize_module`` sets it on every style, as torch's does.
Detection is by class module and name, so torch's parallel package is never imported here.

Example::

    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from_torch(TorchColwise(use_local_output=False), "w1")   # -> [ColwiseParallel(use_local_output=False)]
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_shard.tensor.placements import Partial, Placement, Replicate, Shard
from lightning_shard.tp.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["from_torch"]

_TORCH_STYLE_MODULE = "torch.distributed.tensor.parallel.style"
_TORCH_PLACEMENT_MODULE = "torch.distributed.tensor.placement_types"


def _placement(p, where: str) -> Placement | None:
    """torch's ``Shard(d)``/``Replicate()``/``Partial(op)`` -> ours; ours and ``None`` pass through."""
    if p is None or isinstance(p, Placement):
        return p
    kind = type(p).__name__
    if type(p).__module__ == _TORCH_PLACEMENT_MODULE:
        if kind == "Shard":
            return Shard(int(p.dim))
        if kind == "Replicate":
            return Replicate()
        if kind == "Partial":
            return Partial(str(p.reduce_op))
    raise TypeError(
        f"parallelize_module: {where} has placement {p!r} ({type(p).__module__}.{kind}), which has no exact "
        "lightning_shard equivalent in a layout; use lightning_shard.tensor.Shard / Replicate / Partial"
    )


def _layouts(value, where: str):
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return tuple(_placement(p, where) for p in value)
    return _placement(value, where)


def _kwarg_layouts(value: dict, where: str) -> dict | None:
    return {k: _placement(p, where) for k, p in value.items()} or None


def _linear(ours: type[ColwiseParallel] | type[RowwiseParallel]) -> Callable[[object, str], list[ParallelStyle]]:
    """Converter for torch's Colwise/RowwiseParallel: both store one input and one output layout."""

    def convert(s, where: str) -> list[ParallelStyle]:
        return [
            ours(
                input_layouts=_placement(s.input_layouts[0], where),
                output_layouts=_placement(s.output_layouts[0], where),
                use_local_output=s.use_local_output,
            )
        ]

    return convert


def _sequence(s, where: str) -> list[ParallelStyle]:
    return [SequenceParallel(sequence_dim=int(s.sequence_sharding[0].dim), use_local_output=s.use_local_output)]


def _prepare_input(s, where: str) -> list[ParallelStyle]:
    return [
        PrepareModuleInput(
            input_layouts=_layouts(s.input_layouts, where),
            desired_input_layouts=_layouts(s.desired_input_layouts, where),
            input_kwarg_layouts=_kwarg_layouts(s.input_kwarg_layouts, where) if s.with_kwargs else None,
            desired_input_kwarg_layouts=_kwarg_layouts(s.desired_input_kwarg_layouts, where) if s.with_kwargs else None,
            use_local_output=s.use_local_output,
        )
    ]


def _prepare_output(s, where: str) -> list[ParallelStyle]:
    return [
        PrepareModuleOutput(
            output_layouts=_layouts(s.output_layouts, where),
            desired_output_layouts=_layouts(s.desired_output_layouts, where),
            use_local_output=s.use_local_output,
        )
    ]


def _prepare_input_output(s, where: str) -> list[ParallelStyle]:
    # Our plans take a list of styles per key, applied in order: the input half, then the output half.
    return _prepare_input(s.prepare_module_input, where) + _prepare_output(s.prepare_module_output, where)


# torch's class name -> converter; each converter reads the attributes torch's __init__ stores.
_CONVERTERS: dict[str, Callable[[object, str], list[ParallelStyle]]] = {
    "ColwiseParallel": _linear(ColwiseParallel),
    "RowwiseParallel": _linear(RowwiseParallel),
    "SequenceParallel": _sequence,
    "PrepareModuleInput": _prepare_input,
    "PrepareModuleOutput": _prepare_output,
    "PrepareModuleInputOutput": _prepare_input_output,
}


def from_torch(style, key: str) -> list:
    """``[style]`` unless ``style`` is one of torch's parallel styles; then its lightning_shard equivalent(s).

    Raises ``TypeError`` for a torch style without an exact equivalent (a subclass, or an unknown class),
    naming the plan key and our closest style.

    Example: ``from_torch(torch_tp.RowwiseParallel(), "w2")`` -> ``[RowwiseParallel()]``.
    """
    cls = type(style)
    if not any(c.__module__.startswith("torch.distributed.tensor.parallel") for c in cls.__mro__):
        return [style]
    where = f"plan entry {key!r} ({cls.__module__}.{cls.__name__})"
    convert = _CONVERTERS.get(cls.__name__) if cls.__module__ == _TORCH_STYLE_MODULE else None
    if convert is None:
        base = next((c.__name__ for c in cls.__mro__ if c.__name__ in _CONVERTERS), None)
        ours = f"lightning_shard.tp.{base}" if base else "a lightning_shard.tp style"
        raise TypeError(
            f"parallelize_module: {where} is a torch parallel style without an exact lightning_shard equivalent "
            f"(a subclass changes what the style does); write the plan with {ours} (same arguments), or a "
            "ParallelStyle subclass of ours"
        )
    return convert(style, where)
