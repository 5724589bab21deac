"""Plain tensors that torch's derivative formulas mix with DTensors during a backward pass.

Many formulas build a tensor from an input's sizes with ``at::zeros(self.sizes(), grad.options())`` (or
``ones``, ``arange``) rather than ``zeros_like(self)``: from a DTensor input they get a *plain* tensor of the
global shape, the same on every rank, and combine it with DTensors (the backwards of ``x[idx] = v``
(``index_put``), ``cummax``, ``cumprod``, ``prod``, ``trace``, ``select_scatter``, ``slice_scatter``,
``diagonal_scatter``, ``put``, ``mvlgamma`` ...). Dispatch refuses a plain tensor of several elements mixed with
DTensors, because in forward code it is usually a rank-local tensor (a bug to report, not to guess at). Inside
a backward pass it accepts one as ``Replicate`` once a collective has confirmed that it is bitwise the same on
every rank of the mesh. Every rank runs the same backward graph, so all of them reach the check and all of them
reach the same answer: when the tensors differ, every rank raises the usual error.

Example (inside ``dispatch.make_call``)::

    if in_backward() and same_on_every_rank(plain, mesh):
        ...  # take it as Replicate
"""

from __future__ import annotations

import torch

from lightning_shard import comm

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def in_backward() -> bool:
    """Whether autograd is running a backward node on this thread (torch's formulas, not user forward code)."""
    return torch._C._current_autograd_node() is not None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as int64 bit patterns (exact: ``0.0`` and ``-0.0`` differ, equal NaNs are equal)."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    x = x.contiguous().reshape(-1)
    return x.view(_INT_OF_SIZE[x.element_size()]).to(torch.int64)


def same_on_every_rank(t: torch.Tensor, mesh) -> bool:
    """Whether ``t`` holds the same bits on every rank of ``mesh`` (one max all-reduce per mesh dim of the
    bits and their complement: max == min elementwise, which every rank reads off the same reduced values)."""
    bits = _bits(t)
    both = torch.cat([bits, ~bits])  # max(~b) = ~min(b), without the overflow of -b
    for dim in range(mesh.ndim):
        comm.all_reduce(both, mesh.get_group(dim), op="max")
    n = bits.numel()
    return torch.equal(both[:n], ~both[n:])
