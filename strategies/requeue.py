"""SLURM auto-requeue: the save deferred to a point every rank reaches together, and the resume path Lightning derives
from ``default_root_dir`` after a save the requeue cut short.

Lightning's ``SIGUSR1`` handler saves the checkpoint inside the signal handler, wherever each rank's Python happens
to be. A sharded save is a sequence of collectives, so ranks interrupted at different points (one inside an FSDP
forward, one after its step: the usual case, the signal reaches the ranks microseconds apart) paired the save's
collectives with training's: the save timed out on every rank, no checkpoint was written and the job was not
requeued. ``DeferredRequeue`` makes the handler only note the signal; at the start of the next training batch that
begins an optimizer step (no gradients accumulated yet), every rank agrees with one all-reduce whether any rank got
it, and then all of them run Lightning's handler together (the save, and ``scontrol requeue`` on rank 0).

On ``SIGUSR1`` Lightning saves ``hpc_ckpt_<n+1>.ckpt`` and requeues the job; the requeued job resumes from
``hpc_ckpt_<n>.ckpt`` where ``n`` is the largest number Lightning reads from any name containing ``hpc_ckpt_`` (it
keeps every digit after that prefix). A save killed before it was published leaves its temporary directory,
``hpc_ckpt_2.ckpt.tmp-0a1b2c3d4e5f60`` (a sharded save, ``lightning_shard.checkpoint.save``) or
``.hpc_ckpt_2.ckpt.tmp-<pid>`` (a full one), which Lightning reads as version 20123456 (or 2<pid>): the requeued job
asked for a checkpoint that never existed and stopped with ``FileNotFoundError``, while ``hpc_ckpt_1.ckpt`` was
intact. ``published_hpc_path`` maps exactly that case to the latest published HPC checkpoint and removes the
leftovers.

Example::

    path = published_hpc_path("/runs/hpc_ckpt_201234560.ckpt")  # -> "/runs/hpc_ckpt_1.ckpt", with a warning
"""

from __future__ import annotations

import re
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["DeferredRequeue", "published_hpc_path"]

_PREFIX = "hpc_ckpt_"
_PUBLISHED = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")
# a sharded save's temp dir or swapped-out old dir (<path>.tmp-<id>, <path>.old-<id>), a full save's temp file
_LEFTOVER = re.compile(r"^\.?hpc_ckpt_\d+\.ckpt\.(tmp|old)-[0-9a-f]+$")


def _lightning_version(name: str) -> int | None:
    """The number Lightning's ``__max_ckpt_version_in_folder`` reads from ``name`` (every digit after the prefix)."""
    digits = re.sub("[^0-9]", "", name.split(_PREFIX)[-1])
    return int(digits) if digits else None


def published_hpc_path(path: str) -> str:
    """``path``, or the latest published ``hpc_ckpt_<n>.ckpt`` beside it when ``path`` is missing and is the name
    Lightning read from an interrupted save's leftover (which are then removed). Call it on one rank (rank 0) and
    broadcast the result: the ranks must load the same checkpoint."""
    missing = Path(path)
    match = _PUBLISHED.match(missing.name)
    if missing.exists() or match is None or not missing.parent.is_dir():
        return path
    asked = int(match.group(1))
    names = [child.name for child in missing.parent.iterdir()]
    leftovers = [n for n in names if _LEFTOVER.match(n) and _lightning_version(n) == asked]
    published = sorted((int(m.group(1)), n) for n in names if (m := _PUBLISHED.match(n)))
    if not leftovers or not published:
        return path
    latest = str(missing.parent / published[-1][1])
    for name in leftovers:  # the next requeue would read them again; a published checkpoint is never among them
        target = missing.parent / name
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    rank_zero_warn(
        f"shard_fsdp_tp: Lightning's SLURM auto-requeue asked for {path}, a name it read from {', '.join(leftovers)}, "
        f"left by a checkpoint save the requeue interrupted; resuming from the latest complete one, {latest}, and "
        "removing the leftovers"
    )
    return latest


class DeferredRequeue:
    """Lightning's SLURM auto-requeue handler (save ``hpc_ckpt_<n>.ckpt``, ``scontrol requeue``), run at the start of
    a training batch on every rank at once instead of inside the signal handler.

    Install it before Lightning registers its signal handlers (the strategy's ``setup``); call ``at_batch_start``
    from the strategy's ``on_train_batch_start``. It costs one scalar all-reduce at the start of each optimizer
    step, and only under ``SLURMEnvironment(auto_requeue=True)``, where Lightning installs the handler.

    Example::

        self._requeue = DeferredRequeue.install(trainer)  # None unless SLURM auto-requeue is on
        ...
        if self._requeue is not None:
            self._requeue.at_batch_start(trainer, batch_idx, self.reduce_boolean_decision)
    """

    def __init__(self, connector: _SignalConnector) -> None:
        self.connector = connector
        self.signum: int | None = None
        # Lightning builds its handler list from this attribute when it registers the signals (after setup)
        connector._slurm_sigusr_handler_fn = self._note

    @classmethod
    def install(cls, trainer: Any) -> DeferredRequeue | None:
        """Defer ``trainer``'s requeue handler; None (nothing changed) unless SLURM auto-requeue is on."""
        environment = trainer._accelerator_connector.cluster_environment
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
            return None
        return cls(trainer._signal_connector)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # no collective, no I/O: the rank may be anywhere, even between two all-gathers of an FSDP forward
        self.signum = signum

    def at_batch_start(self, trainer: Any, batch_idx: int, any_rank: Callable[..., bool]) -> None:
        """Run the requeue on every rank if any rank got the signal, at a batch that starts an optimizer step
        (a checkpoint holds no accumulated gradients: saved mid-accumulation, the resumed run lost them)."""
        if batch_idx % max(1, trainer.accumulate_grad_batches) != 0:
            return
        if not any_rank(self.signum is not None, all=False):
            return
        signum, self.signum = self.signum or signal.SIGUSR1, None
        _SignalConnector._slurm_sigusr_handler_fn(self.connector, signum, None)
