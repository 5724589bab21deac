"""View results that are copies: refuse writes through them, and reads once their base has changed.

A view op (its schema returns an alias of an input: ``diagonal``, ``slice``, ``unfold``, ``as_strided`` ...)
whose DTensor input had to be redistributed first (a slice of a sharded dim, the replicate fallback) runs on
a gathered copy of the input: its result holds the right values but shares no memory with its base. On
plain tensors a view and its base see each other's writes, so two silent wrong results would follow:

- writing into the result (``x[0:2] = 1`` is ``x.slice(...).fill_(1)``, ``x.diagonal().zero_()``) would
  not change ``x``;
- after an in-place op on the base, the result would still hold the old values.

So every such result is recorded here as a *view copy* of its base's storage. An op that writes into a view
copy raises a ``RuntimeError`` naming the view op and the writing op; an in-place op on the base (or on
anything sharing its local storage) marks its live view copies stale, and any later op reading a stale copy
raises. In-place *view* ops (``squeeze_``, ``t_``) change metadata only and are allowed. A view of a view
copy is a view copy of the same base.

Not seen here: writes through ``to_local()`` (plain tensors bypass DTensor dispatch).

Example::

    x = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
    x.diagonal().zero_()      # RuntimeError: ... aten.diagonal.default returned a copy, not a view ...
    x[0:2] = 1.0              # RuntimeError (the slice of the sharded dim is a copy)
    d = x.diagonal(); x.add_(1)
    d.sum()                   # RuntimeError: ... changed in place by aten.add_.Tensor after ...
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from lightning_shard.tensor.dtensor import DTensor


@dataclass
class _CopyInfo:
    view_op: str  # the view op that returned the copy
    storage: torch.UntypedStorage  # the base's local storage, held so its key cannot be reused
    stale_by: str | None = None  # the in-place op that changed the base after the copy was made


_INFO: dict[int, _CopyInfo] = {}  # id(view copy) -> info
_REFS: dict[int, weakref.ref] = {}
LIVE: dict[int, set[int]] = {}  # storage key of a base -> ids of its live view copies (empty: nothing to check)


def _key(local: torch.Tensor) -> int:
    return local.untyped_storage()._cdata


@functools.cache
def is_view_op(func) -> bool:
    """Whether ``func``'s outputs alias an input (not in-place: those return their written argument)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@functools.cache
def _writes(func) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(positions, names) of the arguments ``func`` writes into; none for in-place view ops (metadata only)."""
    if torch.Tag.inplace_view in func.tags:
        return (), ()
    args = enumerate(func._schema.arguments)
    written = [(i, a) for i, a in args if a.alias_info is not None and a.alias_info.is_write]
    return tuple(i for i, a in written if not a.kwarg_only), tuple(a.name for _, a in written)


def _forget(ident: int, key: int) -> None:
    _INFO.pop(ident, None)
    _REFS.pop(ident, None)
    ids = LIVE.get(key)
    if ids is not None:
        ids.discard(ident)
        if not ids:
            del LIVE[key]


def _record(t: DTensor, view_op: str, storage: torch.UntypedStorage) -> None:
    ident, key = id(t), storage._cdata
    if ident in _INFO:
        return
    _INFO[ident] = _CopyInfo(view_op, storage)
    _REFS[ident] = weakref.ref(t, lambda _, ident=ident, key=key: _forget(ident, key))
    LIVE.setdefault(key, set()).add(ident)


def note_view(func, args: tuple, out) -> None:
    """After the view op ``func`` returned ``out``: record each output that does not alias its base's local
    shard (or that is a view of a view copy) as a view copy of the base."""
    base = next((a for a in pytree.tree_leaves(args) if isinstance(a, DTensor)), None)
    if base is None:
        return
    inherited = _INFO.get(id(base))
    for o in pytree.tree_leaves(out):
        if not isinstance(o, DTensor) or o is base:
            continue
        if inherited is not None:
            _record(o, inherited.view_op, inherited.storage)
        elif not torch._C._is_alias_of(o._local_tensor, base._local_tensor):
            _record(o, str(func), base._local_tensor.untyped_storage())


def check(func, args: tuple, kwargs: dict) -> None:
    """Before ``func`` runs (only while view copies are alive): refuse reading a stale view copy or writing
    into any view copy; mark the view copies of every base ``func`` writes into as stale."""
    for t in pytree.tree_leaves((args, kwargs)):
        info = _INFO.get(id(t)) if isinstance(t, DTensor) else None
        if info is not None and info.stale_by is not None:
            raise RuntimeError(
                f"{func}: reads a DTensor that {info.view_op} returned as a copy of its base, not a view (the "
                f"base had to be redistributed), and the base was changed in place by {info.stale_by} since: "
                f"the copy holds the old values. Call {info.view_op} again after the in-place op"
            )
    positions, names = _writes(func)
    if not names:
        return
    written = [args[i] for i in positions if i < len(args)] + [kwargs[n] for n in names if n in kwargs]
    for t in pytree.tree_leaves(written):
        if not isinstance(t, DTensor):
            continue
        info = _INFO.get(id(t))
        if info is not None:
            raise RuntimeError(
                f"{func}: writes into a DTensor that {info.view_op} returned as a copy, not a view: its base "
                f"had to be redistributed to compute it, so the write would not reach the base. Redistribute "
                f"the base first so that {info.view_op} runs on local shards (e.g. to Replicate(), or shard "
                f"another dim), or write into the base directly (index_put_, masked_fill_, torch.where)"
            )
        for ident in LIVE.get(_key(t._local_tensor), ()):
            _INFO[ident].stale_by = _INFO[ident].stale_by or str(func)
