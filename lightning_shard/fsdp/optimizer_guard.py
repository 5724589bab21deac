"""Refuse an optimizer that holds an FSDP unit's *unsharded* parameters instead of its sharded ones.

Between a forward with grad and its backward the root unit keeps its parameters unsharded (its backward
would all-gather them again right away; torch's FSDP2 does the same), so ``model.parameters()`` then yields
temporary unsharded tensors. An optimizer built at that moment updates those temporaries; after backward the
modules point at the sharded parameters again, which never change: the model silently does not train (for
the root's parameters: embeddings, final norm, LM head). torch's FSDP2 has the same hazard and no guard.

``check_optimizer_params(optimizer)`` raises a ``ValueError`` naming the parameter and the fix;
``fully_shard`` installs it once as a global optimizer step pre-hook, so an optimizer's first ``step()`` (and
the first after ``add_param_group``) checks before it updates anything (plain scripts, Fabric and the Trainer
alike), and the strategies also call it when they set an optimizer up.

Example::

    fully_shard(model)
    loss = model(x).sum()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # too late: the root's parameters are unsharded
    loss.backward()
    opt.step()                                          # ValueError: ... holds the unsharded parameter 'weight' ...
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_MARK = "_lightning_shard_unsharded_fqn"
_installed = False


def mark_unsharded(param: torch.Tensor, fqn: str) -> None:
    """Tag ``param`` as the temporary unsharded form of the FSDP parameter ``fqn``."""
    setattr(param, _MARK, fqn)


def unsharded_fqn(param: torch.Tensor) -> str | None:
    """The FSDP parameter name if ``param`` is an unsharded temporary, else None."""
    return getattr(param, _MARK, None)


# Set by ``fully_shard`` on each parameter it replaced by a sharded one (``fsdp.api._mark_taken``).
REPLACED_MARK = "_ls_fsdp_taken_by"


def check_optimizer_params(optimizer: torch.optim.Optimizer) -> None:
    """Raise if ``optimizer`` holds an unsharded FSDP parameter (see the module docstring), or a parameter
    ``fully_shard`` replaced (the optimizer was built before it).

    Example: ``check_optimizer_params(torch.optim.AdamW(model.parameters()))`` -> None when built in time.

    >>> from torch import nn
    >>> from lightning_shard.fsdp import fully_shard
    >>> model = nn.Linear(4, 2)
    >>> too_early = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> model = fully_shard(model)
    >>> check_optimizer_params(torch.optim.SGD(model.parameters(), lr=0.1))   # None: built after fully_shard
    >>> check_optimizer_params(too_early)
    Traceback (most recent call last):
    ...
    ValueError: SGD param group 0 holds the parameter 'weight' (shape (2, 4)) that fully_shard(Linear) replaced ...
    """
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            replaced = getattr(p, REPLACED_MARK, None)
            if replaced is not None:
                raise ValueError(
                    f"{type(optimizer).__name__} param group {i} holds the parameter {replaced.fqn!r} (shape "
                    f"{tuple(p.shape)}) that {replaced.what} replaced by its sharded parameter: the optimizer was "
                    "built before fully_shard, so it would step a tensor that gets no gradient and the model would "
                    "not train. Build the optimizer after fully_shard, from model.parameters()."
                )
            fqn = unsharded_fqn(p)
            if fqn is not None:
                raise ValueError(
                    f"{type(optimizer).__name__} param group {i} holds the unsharded parameter {fqn!r} of an FSDP "
                    f"unit (shape {tuple(p.shape)}), not its sharded parameter: the optimizer was built from "
                    "model.parameters() between a forward with grad and its backward, while the root unit keeps its "
                    "parameters unsharded. It would update a temporary copy and the model would not train. Build "
                    "the optimizer before the first forward (or after backward, or after model.reshard())."
                )


# optimizer -> number of parameters it held when last checked: an optimizer's parameters change only through
# add_param_group, so each is checked at its first step and after a group is added, not at every step.
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# Engine work that must happen before any optimizer updates sharded parameters (``register_before_step``).
_before_step: list[Callable[[], None]] = []


def register_before_step(fn: Callable[[], None]) -> None:
    """Run ``fn()`` before every optimizer step (the same global pre-hook as the check; ``install_step_guard``).

    Example: ``register_before_step(lambda: None)``."""
    _before_step.append(fn)


def _step_pre_hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for fn in _before_step:
        fn()
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) != count:
        check_optimizer_params(optimizer)
        _checked[optimizer] = count


def install_step_guard() -> None:
    """Register ``check_optimizer_params`` as a global optimizer step pre-hook (once per process)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_step_pre_hook)
        _installed = True
