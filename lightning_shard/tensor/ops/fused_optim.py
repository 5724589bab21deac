"""Fused optimizer steps on DTensor parameters: ``torch.optim.Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` with
``fused=True`` (the ``aten::_fused_*_`` ops).

A fused step updates every parameter from its own gradient and state, element by element. So for a parameter
whose gradient and state tensors have the parameter's layout (same mesh, shape and placements, no ``Partial``:
the FSDP case, every tensor ``Shard(0)``, and the TP case, each parameter's own placements) the update of its
local shard is the fused kernel on the local shards. Every such parameter goes into one local fused call, and
so does a plain-tensor parameter whose gradient and state are plain too (one a TP plan left unsharded).
The other arguments pass through: the 0-dim ``state_steps`` (plain tensors, or the local value of a
replicated DTensor), a tensor ``lr``, and ``grad_scale``/``found_inf`` (plain tensors the gradient scaler made
equal on every rank: ``ShardedGradScaler`` all-reduces its flag).

A parameter whose tensors do not share a layout goes alone through the replicate fallback (correct; it
gathers that parameter's tensors, and is counted in ``fallback_counts()``). Without this module every fused
step went through the fallback, which gathered the whole model and its optimizer state on every rank.

Example::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)   # FSDP/TP parameters: one local call
    opt.step()
"""

from __future__ import annotations

import torch

from lightning_shard.tensor.dispatch import register_custom
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.fallback import run_fallback

aten = torch.ops.aten

# The per-parameter tensor lists of each fused op, in schema order (the first is the parameters).
_LISTS = {
    "_fused_adam_": ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"),
    "_fused_adamw_": ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"),
    "_fused_sgd_": ("self", "grads", "momentum_buffer_list"),
    "_fused_adagrad_": ("self", "grads", "state_sums", "state_steps"),
}
_SCALAR_LISTS = frozenset(["state_steps"])  # 0-dim per parameter, not laid out like it


def _same_layout(param: DTensor, others: list) -> bool:
    token = param._spec.layout_token
    return all(isinstance(t, DTensor) and t._spec.layout_token == token for t in others)


def _local_step(t):
    """A 0-dim step counter as the local kernel takes it; ``None`` if it is not one (then: fallback)."""
    if isinstance(t, DTensor):
        return t._local_tensor if t.ndim == 0 and not t._spec.has_partial() else None
    return t


def _plain(lists: list[list], i: int) -> list | None:
    """Element ``i``'s tensors as they are when none of them is a DTensor (a parameter a TP plan left plain,
    e.g. a norm weight, next to sharded ones in the same optimizer), else ``None``."""
    own = [lst[i] if lst else None for lst in lists]
    return None if any(isinstance(t, DTensor) for t in own) else own


def _split(names: tuple, lists: list[list], i: int):
    """Element ``i``'s local tensors, one per list, or ``None`` when it must take the fallback."""
    param = lists[0][i]
    if not isinstance(param, DTensor):
        return _plain(lists, i)
    if param._spec.has_partial():
        return None
    laid_out = [lst[i] for name, lst in zip(names, lists) if name not in _SCALAR_LISTS and lst]
    if not _same_layout(param, laid_out[1:]):
        return None
    local = []
    for name, lst in zip(names, lists):
        if not lst:
            local.append(None)
        elif name in _SCALAR_LISTS:
            step = _local_step(lst[i])
            if step is None:
                return None
            local.append(step)
        else:
            local.append(lst[i]._local_tensor)
    return local


def fused_optimizer_handler(func, args: tuple, kwargs: dict):
    """Run a fused optimizer op as one local fused call over the parameters that allow it (module docstring)
    and the fallback, one parameter at a time, over the others."""
    names = _LISTS[func._schema.name.split("::")[1]]
    lists = [list(a) for a in args[: len(names)]]
    if any(isinstance(v, DTensor) for v in kwargs.values()):
        return run_fallback(func, args, kwargs)  # a DTensor lr / grad_scale: not a case torch's optimizers make
    local_lists: list[list] = [[] for _ in names]
    slow: list[int] = []
    for i in range(len(lists[0])):
        local = _split(names, lists, i)
        if local is None:
            slow.append(i)
            continue
        for column, t in zip(local_lists, local):
            if t is not None:
                column.append(t)
    if local_lists[0]:
        func(*local_lists, *args[len(names) :], **kwargs)
    for i in slow:
        run_fallback(func, tuple([lst[i]] if lst else [] for lst in lists) + tuple(args[len(names) :]), kwargs)


def _register_all() -> None:
    for name in _LISTS:
        packet = getattr(aten, name)
        register_custom(*(getattr(packet, overload) for overload in packet.overloads() if "out" not in overload))(
            fused_optimizer_handler
        )


_register_all()
