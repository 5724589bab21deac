"""SLURM auto-requeue: the resume path Lightning derives from ``default_root_dir`` after a save the requeue cut short.

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
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["published_hpc_path"]

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
