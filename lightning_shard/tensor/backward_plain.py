"""Plain tensors that torch's derivative formulas mix with DTensors during a backward pass.

Many formulas build a tensor from an input's sizes with ``at::zeros(self.sizes(), grad.options())`` (or
``ones``, ``arange``) rather than ``zeros_like(self)``: from a DTensor input they get a *plain* tensor of the
global shape, the same on every rank, and combine it with DTensors (the backwards of ``x[idx] = v``
(``index_put``), ``cummax``, ``cumprod``, ``prod``, ``trace``, ``select_scatter``, ``slice_scatter``,
``diagonal_scatter``, ``put``, ``mvlgamma`` ...). Dispatch refuses a plain tensor of several elements mixed with
DTensors, because in forward code it is usually a rank-local tensor (a bug to report, not to guess at). Inside
a backward pass it accepts one as ``Replicate`` once collectives have confirmed that it has the same shape and
bits on every rank of the mesh. Every rank runs the same backward graph, so all of them reach the check and all
of them reach the same answer: when the tensors differ, every rank raises the usual error.

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


def _max_equals_min(values: torch.Tensor, mesh) -> bool:
    """Whether the int64 ``values`` are the same on every rank of ``mesh``: one max all-reduce per mesh dim of
    the values and their complement gives max and min elementwise, which every rank then reads alike."""
    both = torch.cat([values, ~values])  # max(~v) = ~min(v), without the overflow of -v
    with comm.host_collectives_for(both):  # the values' device: the host for offloaded state
        for dim in range(mesh.ndim):
            comm.all_reduce(both, mesh.get_group(dim), op="max")
    n = values.numel()
    return torch.equal(both[:n], ~both[n:])


def same_on_every_rank(t: torch.Tensor, mesh) -> bool:
    """Whether ``t`` has the same shape and bits on every rank of ``mesh``. The shape is compared first, in a
    fixed-size collective, so that ranks holding tensors of different sizes never enter a collective of
    different sizes (which would hang)."""
    shape = torch.tensor([t.numel(), hash(tuple(t.shape))], dtype=torch.int64, device=t.device)
    return _max_equals_min(shape, mesh) and _max_equals_min(_bits(t), mesh)
