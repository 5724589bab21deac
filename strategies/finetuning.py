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

Example: ``restore_param_groups(trainer, checkpoint.get("callbacks", {}))`` before the optimizer state loads.
"""

from __future__ import annotations

import copy
from typing import Any


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
        # The groups the callback added hold what it unfroze; its setup froze them again (freeze_before_training)
        # and nothing unfreezes them after the epoch it did so: trainable again, as in the uninterrupted run.
        for optimizer, count in zip(trainer.optimizers, built):
            for group in optimizer.param_groups[count:]:
                for param in group["params"]:
                    param.requires_grad_(True)


def clear_restarting(trainer: Any) -> None:
    """After Lightning restored the callbacks: the param groups are rebuilt already (``restore_param_groups``)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, BaseFinetuning):
            callback._restarting = False
