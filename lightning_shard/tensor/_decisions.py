"""The dispatch cache: one sharding decision per (op, argument specs, non-tensor arguments).

What the dispatcher decides for an op call (which placements each DTensor argument needs, the arguments of
the local call, the global shape, stride and dtype of every output) depends only on the op, the specs of its
DTensor arguments (mesh, placements, global shape, stride, dtype) and its other, non-tensor arguments. The
first call with a given key runs the sharding rule and the meta-tensor shape inference and stores a
``Decision``; later calls with an equal key skip both (torch's ``ShardingPropagator`` caches its output
sharding per ``OpSchema`` the same way).

The key (``decision_key``) holds, in argument order:

- for a DTensor, its ``DTensorSpec`` (equal specs: same mesh, placements, shape, stride and dtype);
- for a Python scalar, its type and value (``1``, ``1.0`` and ``True`` differ; floats by their exact bits,
  so ``0.0`` and ``-0.0`` differ and ``nan`` equals ``nan``);
- for a list or tuple, its type, then its items; for keyword arguments, the name then the value;
- dtypes, devices, layouts, memory formats and strings by value;
- the identity of the mesh (two equal meshes over different process groups get different decisions: an
  output must carry the mesh its inputs came on).

A call with anything else among its arguments (a plain tensor, a symbolic size, an unknown object) has no
key and is decided afresh every time. So is a decision whose local call would need objects other than the
call's own arguments (a rule that makes a tensor for the local call).

Example::

    clear_dispatch_cache()
    y = x.view(4, -1)            # decided: a miss
    y = x.view(4, -1)            # the same spec and sizes: a hit
    dispatch_cache_info()        # CacheInfo(hits=1, misses=1, size=1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.fallback import run_fallback
from lightning_shard.tensor.ops._registry import OpCall, Plan, is_inplace
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

__all__ = ["CacheInfo", "Decision", "clear_dispatch_cache", "decision_key", "dispatch_cache_info"]

MAX_DECISIONS = 8192  # a model uses a few hundred; a bound keeps shape-varying workloads from growing it forever

_DECISIONS: dict[tuple, Decision] = {}
_STATS = [0, 0]  # hits, misses

# Values that are their own key (compared by ==, hashed by value, no aliasing between types).
_BY_VALUE = frozenset({str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


class _NoKey(Exception):
    """Raised inside ``decision_key`` for an argument that cannot be part of a key."""


class CacheInfo(NamedTuple):
    """Hits and misses of the dispatch cache since the last ``clear_dispatch_cache()``, and its size."""

    hits: int
    misses: int
    size: int


def dispatch_cache_info() -> CacheInfo:
    """Hits, misses and size of the dispatch cache. Example: ``dispatch_cache_info().hits``."""
    return CacheInfo(_STATS[0], _STATS[1], len(_DECISIONS))


def clear_dispatch_cache() -> None:
    """Forget every cached decision and reset the counters. Example: ``clear_dispatch_cache()``."""
    _DECISIONS.clear()
    _STATS[0] = _STATS[1] = 0


def _remember(key: tuple, decision: Decision) -> None:
    if len(_DECISIONS) >= MAX_DECISIONS:
        # The oldest (insertion order). Another thread (autograd's device threads) may change the dict meanwhile:
        # then one is dropped next time.
        with contextlib.suppress(RuntimeError, StopIteration, KeyError):
            del _DECISIONS[next(iter(_DECISIONS))]
    _DECISIONS[key] = decision


def _key_into(out: list, dtensors: list, a: Any) -> None:
    t = type(a)
    if t is int:
        out.append(a)
    elif t is DTensor or isinstance(a, DTensor):
        out.append(a._spec)
        dtensors.append(a)
    elif t in _BY_VALUE:
        out.append(a)
    elif t is float:
        out.append((float, a.hex()))  # exact bits: 0.0 != -0.0, nan == nan
    elif t is bool:
        out.append((bool, a))  # True == 1 in Python; a key must tell them apart (the result dtype may differ)
    elif t is tuple or t is list or t is torch.Size:
        out.append(t)
        out.append(len(a))
        for x in a:
            _key_into(out, dtensors, x)
    else:
        raise _NoKey  # plain tensors (their values may matter), SymInts, anything unknown


def decision_key(func, args: tuple, kwargs: dict) -> tuple[tuple | None, list[DTensor]]:
    """The cache key of one op call (``None`` when the call cannot be cached) and its DTensor arguments in
    pytree order. Example: ``key, dtensors = decision_key(aten.mm.default, (a, b), {})``."""
    out: list = [func]
    dtensors: list[DTensor] = []
    try:
        for a in args:
            _key_into(out, dtensors, a)
        for name, a in kwargs.items():
            out.append(name)
            _key_into(out, dtensors, a)
    except _NoKey:
        return None, dtensors
    if not dtensors:
        return None, dtensors
    mesh = dtensors[0]._spec.mesh
    for d in dtensors:
        if not _same_mesh(d._spec.mesh, mesh):
            return None, dtensors  # equal meshes that are different objects (or different meshes): decide afresh
    out.append(id(mesh))  # the cached output specs hold this mesh, so its id stays unique while cached
    key = tuple(out)
    try:
        hash(key)
    except TypeError:  # e.g. a spec with symbolic sizes (torch.compile with dynamic shapes)
        return None, dtensors
    return key, dtensors


def _same_mesh(a, b) -> bool:
    return a is b


class _Slot:
    """Where the ``j``-th redistributed local tensor goes in a decision's local-call template."""

    __slots__ = ("j",)

    def __init__(self, j: int) -> None:
        self.j = j


def _fill(obj, locals_: list):
    t = type(obj)
    if t is _Slot:
        return locals_[obj.j]
    if t is tuple or t is list:
        return t(_fill(x, locals_) for x in obj)
    if t is dict:
        return {k: _fill(v, locals_) for k, v in obj.items()}
    return obj


@dataclass(frozen=True, eq=False)
class Decision:
    """A cached dispatch outcome for one key.

    ``fallback``: run the replicate fallback (counted and warned about on every call, as uncached).
    Otherwise: the ``j``-th DTensor of the local call is the call's DTensor ``sources[j]`` redistributed to
    ``inputs[j]``; ``args``/``kwargs`` are the local call with ``_Slot(j)`` where those go (``top_slots``
    lists ``(position, j)`` when every slot is a top-level positional argument, the common case, filled
    without recursion); ``out_specs`` gives, per pytree leaf of the output, the spec to wrap it with
    (``None``: return the leaf as is); ``inplace`` ops return their first argument.
    """

    fallback: bool
    inplace: bool = False
    sources: tuple[int, ...] = ()
    inputs: tuple[tuple, ...] = ()
    args: tuple = ()
    kwargs: dict | None = None
    top_slots: tuple[tuple[int, int], ...] | None = None
    out_specs: tuple[DTensorSpec | None, ...] = ()

    @staticmethod
    def build(call: OpCall, plan: Plan | None, meta_out) -> Decision | None:
        """The decision for ``call`` given its rule's ``plan`` (``None``: fallback) and meta outputs; ``None``
        when it cannot be reused (the dispatcher then runs this call uncached, which raises any error)."""
        if plan is None:
            return Decision(fallback=True)
        call_dtensors = [call.flat[i] for i in call.dtensor_positions]
        src_args, src_kwargs = plan.local_args if plan.local_args is not None else (call.args, call.kwargs)
        sources: list[int] = []

        own = plan.local_args is None
        if not own and len({id(d) for d in call_dtensors}) != len(call_dtensors):
            return None  # one DTensor passed twice: which argument the rule's local call means is ambiguous

        def slot(a):
            if isinstance(a, DTensor):
                if own:  # the call's own arguments: the k-th DTensor met is the k-th one of any equal-keyed call
                    k = len(sources)
                else:  # the rule's local call: by identity (mul(x, x) and mul(x, y) share a key)
                    k = next((k for k, d in enumerate(call_dtensors) if d is a), None)
                if k is None:
                    raise _NoKey  # a DTensor the rule made: not a function of the key
                sources.append(k)
                return _Slot(len(sources) - 1)
            if isinstance(a, torch.Tensor):
                raise _NoKey  # a plain tensor the rule made (e.g. zeros for one rank's shift)
            return a

        try:
            args = pytree.tree_map(slot, tuple(src_args))
            kwargs = pytree.tree_map(slot, dict(src_kwargs))
        except _NoKey:
            return None
        inplace = is_inplace(call.func)
        if len(plan.inputs) != len(sources):
            return None
        inputs = tuple(tuple(p) for p in plan.inputs)
        if inplace and sources and inputs[0] != call_dtensors[sources[0]].placements:
            return None  # run_plan raises the in-place redistribution error
        out_specs: tuple = ()
        if not inplace:
            specs, k = [], 0
            for meta in pytree.tree_leaves(meta_out):
                if isinstance(meta, torch.Tensor):
                    if k >= len(plan.outputs):
                        return None
                    pl = plan.outputs[k]
                    k += 1
                    specs.append(
                        None
                        if pl is None
                        else DTensorSpec(call.mesh, tuple(pl), meta.shape, tuple(meta.stride()), meta.dtype)
                    )
                else:
                    specs.append(None)
            out_specs = tuple(specs)
        top = [(i, a.j) for i, a in enumerate(args) if type(a) is _Slot]
        nested = len(top) != len(sources)
        return Decision(
            fallback=False,
            inplace=inplace,
            sources=tuple(sources),
            inputs=inputs,
            args=args,
            kwargs=kwargs,
            top_slots=None if nested else tuple(top),
            out_specs=out_specs,
        )

    def run(self, func, args: tuple, kwargs: dict, dtensors: Sequence[DTensor]):
        """Run the call ``func(*args, **kwargs)`` (whose DTensor arguments are ``dtensors``) as decided."""
        if self.fallback:
            return run_fallback(func, args, kwargs)
        locals_ = []
        for k, want in zip(self.sources, self.inputs):
            d = dtensors[k]
            locals_.append(redistribute_local(d._local_tensor, d._spec, want))
        if self.top_slots is not None:
            local_args = list(self.args)
            for i, j in self.top_slots:
                local_args[i] = locals_[j]
            local_kwargs = self.kwargs
        else:
            local_args, local_kwargs = _fill(self.args, locals_), _fill(self.kwargs, locals_)
        out = func(*local_args, **local_kwargs)
        if self.inplace:
            return args[0]
        specs = self.out_specs
        if len(specs) == 1 and isinstance(out, torch.Tensor):
            spec = specs[0]
            return out if spec is None else DTensor(out, spec, requires_grad=False)
        flat, tree = pytree.tree_flatten(out)
        wrapped = [
            x if spec is None or not isinstance(x, torch.Tensor) else DTensor(x, spec, requires_grad=False)
            for x, spec in zip(flat, specs)
        ]
        return pytree.tree_unflatten(wrapped, tree)
