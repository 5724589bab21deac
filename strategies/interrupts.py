"""The sharded model after an exception inside a step: resharded before Lightning's exception hooks run.

An exception (or ``KeyboardInterrupt``) raised in the middle of ``training_step`` or ``backward`` leaves the FSDP
units that had started their forward unsharded: the modules then hold the gathered, plain parameters instead of
the sharded DTensors the optimizer updates. Lightning next calls the callbacks' ``on_exception``, where
``OnExceptionCheckpoint`` saves a checkpoint; its state dict met the gathered parameters and the save raised
"parameter 0 of param group 0 ... is not a parameter of ..." in place of the interrupt, writing nothing. DDP has no
such state and saves. ``resharded_on_exception`` points every unit back at its shards (local: no collective but
the wait for an all-gather that every rank started already), drops the gradients not yet reduced into the sharded
``.grad`` (the interrupted backward's partial sums and a no-sync accumulation: ``zero_grad`` at the next step clears
only the sharded ``.grad``, so a module resumed in the same process trained on them, wrong with no error) and
re-raises; the units' training states are reset by the next forward, as after any interrupted step.

Example::

    with resharded_on_exception(model):
        out = model.training_step(batch, 0)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from lightning_shard.fsdp import FSDPModule

__all__ = ["resharded_on_exception"]


@contextmanager
def resharded_on_exception(model: nn.Module | None) -> Iterator[None]:
    """Run the block; if it raises anything (``KeyboardInterrupt`` included), reshard every FSDP unit of ``model``,
    drop its unreduced gradients and re-raise the original exception."""
    try:
        yield
    except BaseException as error:
        if model is not None:
            _reshard(model, error)
        raise


def _reshard(model: nn.Module, error: BaseException) -> None:
    try:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
                module.drop_unreduced_gradients()
    except Exception as failed:  # noqa: BLE001 - e.g. a prefetch's wait on a broken process group
        # the original error is the one to see; the one of the clean-up only adds to it
        error.add_note(f"shard_fsdp_tp: resharding the model after this error failed too: {failed!r}")
