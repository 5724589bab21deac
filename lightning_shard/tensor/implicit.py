"""``implicit_replication()``: plain tensors mixed with DTensors count as replicated, as in torch's
``torch.distributed.tensor.experimental.implicit_replication``.

Outside the context, an op mixing a DTensor with a plain tensor of more than one element raises (the plain tensor
could be one rank's shard, or differ between ranks). Inside it, such a tensor is taken as the same whole value on
every rank (``Replicate()`` on every mesh dim): the caller promises that it is. Code written for plain tensors that
builds a mask or a table from Python numbers every rank computed alike (peft's AdaLoRA masks its ranks from a list
of booleans) then runs on DTensor parameters unchanged.

Example::

    with implicit_replication():
        param.masked_fill_(~torch.tensor([[True], [False]]), 0.0)   # param: a (2, 1) DTensor, any placements
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["implicit_replication", "implicit_replication_enabled"]

_STATE = threading.local()


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside the ``with`` block, plain tensors mixed with DTensors are replicated DTensors (see the module).

    >>> from lightning_shard import init_device_mesh
    >>> from lightning_shard.tensor import Shard, distribute_tensor
    >>> x = distribute_tensor(torch.zeros(2, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
    >>> with implicit_replication():
    ...     y = x + torch.ones(2, 3)
    >>> y.placements, y.full_tensor().sum().item()
    ((Shard(dim=0),), 6.0)
    """
    before = implicit_replication_enabled()
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = before


def implicit_replication_enabled() -> bool:
    """True inside :func:`implicit_replication`."""
    return getattr(_STATE, "on", False)
