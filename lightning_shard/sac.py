"""Keep the engine's own work out of torch's selective activation checkpointing (SAC).

``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=partial(
create_selective_checkpoint_contexts, policy))`` runs a dispatch mode over ``fn``. In forward it asks
``policy`` about every op and keeps the outputs it should save; in the recompute a second mode returns
those outputs instead of running the op again, matched by the op and its count in the region. Two kinds of
engine work inside such a region break that bookkeeping:

* **Buffers written in place.** A redistribution makes a buffer (a clone, an empty tensor) and a collective
  writes it in place (``c10d.allreduce_``, an all-gather into it). Saved by a policy, the buffer comes back in
  the recompute already holding the forward's result, and the collective, run again, reduces it twice; or the
  collective is saved and skipped, and its freshly recomputed buffer keeps the unreduced values. Either way
  the row-parallel output of every recomputed block is wrong with no error (a policy saving matmuls and
  collectives, as torchtitan's does: parameters 1.4e-3 to 2.4e-3 off one process after 4 steps; a policy
  saving all but pointwise ops under sequence parallel raised "cached ... has been mutated"). torch's
  DTensor uses out-of-place functional collectives, whose outputs a policy may save.
* **Work that runs in forward only.** An FSDP unit called inside the region all-gathers its parameters in
  forward (buffer views, an allocation, the all-gather); in the recompute the unit is still unsharded from
  its pre-backward and does none of it. A policy that saves views or allocations then hands every later
  saved op of that kind the output of the one before it: a crash, or wrong values if the shapes agree
  (torch's ``fully_shard`` crashes the same way).

``outside_sac`` (a decorator) runs a function with torch's two SAC modes taken off the dispatch-mode stack,
any other mode staying where it was (fake tensors, a ``FlopCounterMode``). Ops inside are neither saved nor
replayed: they run again in the recompute, as ops the policy recomputes do, buffer and collective together.
It wraps ``redistribute_local`` (every redistribution's buffers and collectives), ``DTensor.from_local``'s
forward (a clone and a broadcast into it) and the FSDP forward hooks, so a policy sees the model's ops (on
DTensors under TP) and never the engine's plumbing. The cost: a policy cannot save our collectives, so the
recompute of a checkpointed block repeats its TP collectives (torch's would reuse saved ones). Ops a DTensor
runs inside its own dispatch were never visible: a mode is off while it handles an op.

Example::

    @outside_sac
    def redistribute_local(local, spec, target): ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

_SAC_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
_len_stack = torch._C._len_torch_dispatch_stack

F = TypeVar("F", bound=Callable)


def _sac_active() -> bool:
    """Whether a selective-checkpointing mode is on the dispatch-mode stack (forward or recompute)."""
    return bool(_len_stack()) and any(isinstance(m, _SAC_MODES) for m in _get_current_dispatch_mode_stack())


def outside_sac(fn: F) -> F:
    """``fn`` run with torch's selective-checkpointing modes off the dispatch-mode stack (module docstring).

    Example: ``redistribute_local = outside_sac(redistribute_local)``.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _len_stack() or torch.compiler.is_compiling() or not _sac_active():
            return fn(*args, **kwargs)
        popped = []  # top first; the user stack pops before any infra mode (fake tensors), so none is touched
        while _sac_active():
            popped.append(_pop_mode())
        kept = [m for m in reversed(popped) if not isinstance(m, _SAC_MODES)]
        for mode in kept:
            _push_mode(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            for _ in kept:
                _pop_mode()
            for mode in reversed(popped):
                _push_mode(mode)

    return run  # type: ignore[return-value]
