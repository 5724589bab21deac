"""The replicate fallback: ops without a sharding rule run on replicated inputs, counted, warned or refused.

An op whose rule has no sharded strategy (or that has no rule) is computed on every rank on the whole
(replicated) inputs; its outputs are ``Replicate()``. That is exact for most ops and slow for all of them,
so every use is counted (``fallback_counts()``) and, by the policy, warned about once per op (``"warn"``,
the default) or refused (``"error"``, for CI: a model must run on sharding rules only).

Some ops cannot be made exact this way; they raise a ``RuntimeError`` naming the op whatever the policy:

- an op that changes the shape or strides of an argument in place (``resize_``; in-place *view* ops such
  as ``squeeze_`` or ``transpose_`` are not fallbacks, they follow their out-of-place view's rule);
- an op that writes into a plain tensor argument mixed with DTensors (an ``out=`` tensor);
- ``as_strided``-like ops on a DTensor whose strides do not describe a dense tensor (they address storage,
  which only a dense DTensor has in a form every rank can rebuild).

A view op (``unfold``, ``as_strided`` ...) computed here on inputs that had to be gathered returns a copy,
not a view: the dispatcher records it (``ops/_view_copies.py``), so writing into it, or reading it after
its base changed in place, raises instead of silently differing from plain torch.

Example::

    from lightning_shard.tensor import fallback_policy, fallback_counts, reset_fallback_counts

    with fallback_policy("error"):          # raise on the first op without a sharding rule
        loss = model(x).sum()
    reset_fallback_counts()
    model(x)
    print(fallback_counts())                # {"aten.foo.default": 2, ...}: what fell back, how often
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import torch
import torch.utils._pytree as pytree

from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.placements import Replicate
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

__all__ = ["fallback_policy", "get_fallback_policy", "fallback_counts", "reset_fallback_counts"]

POLICIES = ("warn", "error")
_ENV = "LIGHTNING_SHARD_DTENSOR_FALLBACK"

_FALLBACKS: Counter = Counter()
_WARNED: set[str] = set()


def _initial_policy() -> str:
    policy = os.environ.get(_ENV, "warn")
    if policy not in POLICIES:
        raise ValueError(f"{_ENV}={policy!r} is not a DTensor fallback policy; use one of {POLICIES}")
    return policy


_POLICY = [_initial_policy()]


class fallback_policy:  # noqa: N801 -- used like torch.set_grad_enabled: a setter that is also a context manager
    """Set what happens when an op has no sharding rule: ``"warn"`` (default: compute it on replicated
    inputs, warn once per op) or ``"error"`` (raise a ``RuntimeError`` naming the op, on every rank, before
    any collective). Takes effect at once; used as a context manager it restores the previous policy on exit.
    The initial policy comes from the ``LIGHTNING_SHARD_DTENSOR_FALLBACK`` environment variable (default
    ``"warn"``).

    Example::

        fallback_policy("error")                 # from now on (e.g. in a CI conftest)
        with fallback_policy("error"):           # only inside the block
            model(x).sum().backward()
    """

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fallback_policy: got {policy!r}; use one of {POLICIES}")
        self._previous = _POLICY[0]
        _POLICY[0] = policy

    def __enter__(self) -> fallback_policy:
        return self

    def __exit__(self, *exc) -> None:
        _POLICY[0] = self._previous


def get_fallback_policy() -> str:
    """The current fallback policy (``"warn"`` or ``"error"``).

    Example: ``assert get_fallback_policy() == "warn"``.
    """
    return _POLICY[0]


def fallback_counts() -> dict[str, int]:
    """How many times each op ran through the Replicate-and-compute fallback (op name -> count), also
    under the ``"error"`` policy (an op refused there is counted once per attempt).

    Example: ``assert fallback_counts() == {}`` after a training step means every op had a sharding rule.
    """
    return dict(_FALLBACKS)


def reset_fallback_counts() -> None:
    """Forget the fallback counts (warnings already given stay given).

    Example: ``reset_fallback_counts(); model(x); print(fallback_counts())``.
    """
    _FALLBACKS.clear()


def not_exact(func, why: str) -> RuntimeError:
    return RuntimeError(
        f"lightning_shard DTensor: {func} has no sharding rule for these inputs and the replicate fallback "
        f"cannot compute it exactly ({why}); call it on plain tensors (x.full_tensor() / x.to_local()) instead"
    )


def record(func) -> None:
    """Count one fallback of ``func`` and apply the policy (warn once, or raise)."""
    name = str(func)
    _FALLBACKS[name] += 1
    if _POLICY[0] == "error":
        raise RuntimeError(
            f"lightning_shard DTensor: {name} has no sharding rule for these inputs and the fallback policy is "
            "'error' (lightning_shard.tensor.fallback_policy / LIGHTNING_SHARD_DTENSOR_FALLBACK); compute it on "
            "plain tensors, or use fallback_policy('warn') to run it on replicated inputs"
        )
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"lightning_shard DTensor: no sharding rule for {name}; computing it on replicated inputs "
            "(correct but slow). See lightning_shard.tensor.fallback_counts().",
            stacklevel=4,
        )


_STORAGE_OPS = {"as_strided", "as_strided_", "as_strided_scatter", "as_strided_copy"}


# Ops that write into arguments their schema does not mark as written (``Tensor?`` instead of ``Tensor(a!)``):
# batch norm updates its running statistics in place when training.
_UNDECLARED_WRITES = {
    "aten::native_batch_norm": ("running_mean", "running_var"),
    "aten::cudnn_batch_norm": ("running_mean", "running_var"),
    "aten::miopen_batch_norm": ("running_mean", "running_var"),
    "aten::batch_norm_gather_stats": ("running_mean", "running_var"),
    "aten::batch_norm_gather_stats_with_counts": ("running_mean", "running_var"),
}


def _mutated_args(func, args: tuple, kwargs: dict) -> list:
    """The tensors ``func`` writes into: those its schema marks, and the undeclared ones above."""
    out = []
    undeclared = _UNDECLARED_WRITES.get(func._schema.name, ())
    for i, a in enumerate(func._schema.arguments):
        written = a.alias_info is not None and a.alias_info.is_write
        if not written and a.name not in undeclared:
            continue
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if v is not None:
            out.extend(x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor))
    return out


def _replicated_local(t: DTensor, *, dense: bool) -> torch.Tensor:
    """``t``'s whole value as a plain tensor on this rank (a fresh copy laid out by ``t``'s strides if
    ``dense``: what storage-addressing ops need)."""
    rep = tuple([Replicate()] * t._spec.mesh.ndim)
    local = redistribute_local(t._local_tensor, t._spec, rep)
    if dense:
        out = torch.empty_strided(t._spec.shape, t._spec.stride, dtype=local.dtype, device=local.device)
        return out.copy_(local)
    return local


def run_fallback(func, args: tuple, kwargs: dict):
    """Compute ``func`` on replicated inputs; write mutated DTensor arguments back; wrap outputs as Replicate.
    Counted in ``fallback_counts()`` and subject to the fallback policy."""
    return run_replicated(func, args, kwargs, count=True)


def run_replicated(func, args: tuple, kwargs: dict, *, count: bool = False):
    """The fallback's computation without its bookkeeping, for *replicate rules*: ops whose rule decides to
    compute on replicated inputs (``ops/batch_norm.py``), with the same write-back of mutated arguments.

    Example: ``run_replicated(aten.native_batch_norm.default, args, kwargs)``.
    """
    flat, tree = pytree.tree_flatten((args, kwargs))
    dtensors = [a for a in flat if isinstance(a, DTensor)]
    mesh = dtensors[0]._spec.mesh
    mutated = _mutated_args(func, args, kwargs)
    for m in mutated:
        if not isinstance(m, DTensor):
            raise not_exact(func, "it writes into a plain tensor argument mixed with DTensors")
    storage_op = func._schema.name.split("::")[-1] in _STORAGE_OPS
    if storage_op and not all(t._spec.is_dense for t in dtensors):
        raise not_exact(func, "it addresses storage and a DTensor argument is not dense")
    if count:
        record(func)
    mutated_ids = {id(m) for m in mutated}
    local_flat = []
    for a in flat:
        if isinstance(a, DTensor):
            local = _replicated_local(a, dense=storage_op)
            if id(a) in mutated_ids and local is a._local_tensor:
                local = local.clone()  # the op writes into it; the argument is updated below, in its own layout
            local_flat.append(local)
        else:
            local_flat.append(a)
    local_args, local_kwargs = pytree.tree_unflatten(local_flat, tree)
    out = func(*local_args, **local_kwargs)
    for a, loc in zip(flat, local_flat):
        if isinstance(a, DTensor) and id(a) in mutated_ids:
            _write_back(func, a, loc)
    return _wrap(func, out, flat, local_flat, mesh)


def _write_back(func, t: DTensor, full: torch.Tensor) -> None:
    """Copy the replicated result ``full`` of an in-place op into ``t``'s own shard."""
    if tuple(full.shape) != tuple(t._spec.shape):
        raise not_exact(
            func, f"it changes the shape of its argument in place, {tuple(t._spec.shape)} -> {tuple(full.shape)}"
        )
    rep = DTensorSpec(t._spec.mesh, tuple([Replicate()] * t._spec.mesh.ndim), t._spec.shape, t._spec.stride, t.dtype)
    t._local_tensor.copy_(redistribute_local(full, rep, t.placements))


def _wrap(func, out, flat, local_flat, mesh):
    """Replicate DTensors around the local outputs; an output that is an argument's local is that argument."""
    by_local = {id(loc): a for a, loc in zip(flat, local_flat) if isinstance(a, DTensor)}
    rep = tuple([Replicate()] * mesh.ndim)

    def wrap(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in by_local:  # an in-place op returns its (now written back) argument
            return by_local[id(x)]
        spec = DTensorSpec(mesh, rep, x.shape, tuple(x.stride()), x.dtype)
        return DTensor(x, spec, requires_grad=False)

    return pytree.tree_map(wrap, out)
