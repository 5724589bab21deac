"""Lightning's finetuning callbacks (``BaseFinetuning``, ``BackboneFinetuning``) resuming under a strategy that
restores the checkpoint after setup.

Such a callback adds param groups during training (the unfrozen backbone) and saves them by parameter name; on
resume its ``on_fit_start`` rebuilds them from the state Lightning restored, before the optimizer state is loaded.
With DDP Lightning restores callbacks before ``on_fit_start``. A strategy that shards the model first
(``restore_checkpoint_after_setup``, as ours and Lightning's FSDP and ModelParallel strategies) loads the
checkpoint after ``on_fit_start``: the optimizer still had only the groups ``configure_optimizers`` built, the
saved state of the added group did not fit it, and had it loaded, the backbone would have stayed out of the
optimizer for the rest of training. ``restore_param_groups`` does the callback's rebuild at load time instead,
and makes the parameters of the groups it added trainable again: the callback froze them in its ``setup`` and
unfreezes only at its epoch, so Lightning's own resume (one process, DDP) keeps them in the optimizer but frozen,
and the resumed run leaves the backbone where the checkpoint had it (measured: one process, unfrozen at epoch 1,
resumed at epoch 2, the backbone did not move and the parameters ended 0.13 from the uninterrupted run's).

A load that fails after the rebuild (an optimizer state that does not fit) must leave the run as it was:
``param_groups_restored`` undoes the rebuild (the optimizers' groups, the parameters' ``requires_grad``, the
callbacks' state) when the rest of the load raises.

Example: ``with param_groups_restored(trainer, checkpoint.get("callbacks", {})): load_the_optimizer_state()``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def param_groups_restored(trainer: Any, callback_states: dict[str, Any]) -> Iterator[None]:
    """``restore_param_groups`` for the duration of a load: undone if the block raises, so a failed load changes
    neither the optimizers, nor which parameters train, nor the callbacks."""
    snapshot = _Snapshot.take(trainer)
    try:
        restore_param_groups(trainer, callback_states)
        yield
    except BaseException:
        snapshot.put_back()
        raise


class _Snapshot:
    """What ``restore_param_groups`` changes: each optimizer's param groups, the module's ``requires_grad`` flags
    and the finetuning callbacks' attributes."""

    def __init__(self, groups: list, flags: list, callbacks: list) -> None:
        self.groups, self.flags, self.callbacks = groups, flags, callbacks

    @classmethod
    def take(cls, trainer: Any) -> _Snapshot:
        from lightning.pytorch.callbacks import BaseFinetuning

        if trainer is None or not trainer.optimizers:
            return cls([], [], [])
        # the callback's rebuild assigns a new list of new groups (``optimizer.param_groups = ...``)
        groups = [(o, o.param_groups, list(o.param_groups)) for o in trainer.optimizers]
        flags = [(p, p.requires_grad) for p in trainer.lightning_module.parameters()]
        callbacks = [(c, copy.copy(vars(c))) for c in trainer.callbacks if isinstance(c, BaseFinetuning)]
        return cls(groups, flags, callbacks)

    def put_back(self) -> None:
        for optimizer, groups, items in self.groups:
            groups[:] = items
            optimizer.param_groups = groups
        for param, flag in self.flags:
            param.requires_grad_(flag)
        for callback, attributes in self.callbacks:
            vars(callback).clear()
            vars(callback).update(attributes)


def restore_param_groups(trainer: Any, callback_states: dict[str, Any]) -> None:
    """For each ``BaseFinetuning`` callback of ``trainer`` with a saved state: load that state and run the
    callback's own restore (its ``on_fit_start``), which replaces the optimizers' param groups by the saved ones
    (the sharded parameters, looked up by name). Lightning loads the callback state again afterwards; the flag
    that would make a later ``on_fit_start`` rebuild the groups once more is cleared by ``clear_restarting``."""
    from lightning.pytorch.callbacks import BaseFinetuning

    if trainer is None or not trainer.optimizers:
        return
    for callback in trainer.callbacks:
        if not isinstance(callback, BaseFinetuning):
            continue
        state = callback_states.get(callback.state_key, callback_states.get(callback._legacy_state_key))
        if not state:
            continue
        built = [len(optimizer.param_groups) for optimizer in trainer.optimizers]
        callback.load_state_dict(copy.deepcopy(state))
        callback.on_fit_start(trainer, trainer.lightning_module)
        _check_rebuilt_groups(trainer.optimizers, callback)
        # The groups the callback added hold what it unfroze; its setup froze them again (freeze_before_training)
        # and nothing unfreezes them after the epoch it did so: trainable again, as in the uninterrupted run.
        for optimizer, count in zip(trainer.optimizers, built):
            for group in optimizer.param_groups[count:]:
                for param in group["params"]:
                    param.requires_grad_(True)


def _check_rebuilt_groups(optimizers: list, callback: Any) -> None:
    """The groups the callback rebuilt carry the saved hyperparameters; another optimizer class than the one that
    saved them lacks its own (Adam resuming an SGD run: a ``KeyError: 'betas'`` at its first step)."""
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            missing = sorted(set(optimizer.defaults) - set(group))
            if missing:
                raise ValueError(
                    f"shard_fsdp_tp: {type(callback).__name__} restored param groups of optimizer {index} "
                    f"({type(optimizer).__name__}) from the checkpoint, and they lack its hyperparameters {missing}: "
                    "the checkpoint was saved with another optimizer. Resume with the optimizer that saved it, or "
                    "start from its weights only (load the model state, without ckpt_path)."
                )


def clear_restarting(trainer: Any) -> None:
    """After Lightning restored the callbacks: the param groups are rebuilt already (``restore_param_groups``)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, BaseFinetuning):
            callback._restarting = False
