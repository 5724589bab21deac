"""Where the FSDP all-gather and reduce-scatter happen: staging kernels around one collective each.

All-gather: this rank's flat shard -> (copy-in with cast, skipped when no cast is needed: the shard buffer
itself is the input) -> one all-gather -> (copy-out) -> the unsharded flat buffer.
Reduce-scatter: the unsharded gradients -> (copy-in: pad, pre-divide, cast) -> one reduce-scatter [-> all-reduce
across replicas for HSDP] -> (post-reduce: divide, upcast, accumulate) -> the sharded gradient buffer.

Collectives are issued with ``async_op=True``; the returned handle's ``wait()`` finishes the step. On CUDA,
NCCL runs them on its own stream, so compute overlaps with communication until ``wait()``; on gloo they are
pairwise sends that gloo's transport thread carries meanwhile (``comm._pairwise_all_gather``).

Example::

    handle = start_all_gather(layout, shard_flat, rank, group, torch.bfloat16, device)
    finish_all_gather(handle, unsharded_flat)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_shard import comm
from lightning_shard.device import DeviceHandle, handle_for, has_data
from lightning_shard.fsdp import buffers
from numba_kernels import GroupLayout, all_gather_copy_in, all_gather_copy_out, post_reduce, reduce_scatter_copy_in


@dataclass
class CollectiveHandle:
    """An in-flight collective, the buffers it uses (kept alive until ``wait()``) and, for an all-gather, the
    layout of what it gathers."""

    work: object | None
    output: torch.Tensor
    input: torch.Tensor | None = None
    layout: GroupLayout | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.input = None
        return self.output


def start_all_gather(
    layout: GroupLayout,
    shard_flat: torch.Tensor,
    rank: int,
    group: dist.ProcessGroup,
    compute_dtype: torch.dtype,
    device: torch.device,
) -> CollectiveHandle:
    """Issue the all-gather of one group's flat shard; returns the (world_size, shard_numel) output handle."""
    output = buffers.empty((layout.world_size, layout.shard_numel), compute_dtype, device)
    if shard_flat.dtype == compute_dtype and shard_flat.device == device:
        inp = shard_flat  # no copy-in at all: the shard buffer is the all-gather input
    else:
        src = shard_flat
        if shard_flat.device != device:  # CPU offload: bring the (pinned) shard to the device
            src = torch.empty_like(shard_flat, device=device)
            handle_for(device).copy_(src, shard_flat, non_blocking=True)
        all_gather_copy_in(layout, src, output, rank, impl=_impl(output))  # cast fused into the copy into our slot
        inp = output[rank]
    work = comm.all_gather_into(output.view(-1), inp, group, async_op=True)
    return CollectiveHandle(work, output, inp, layout)


def finish_all_gather(handle: CollectiveHandle, unsharded_flat: torch.Tensor) -> None:
    """Wait for the all-gather and copy the gathered shards into the unsharded flat buffer (one kernel)."""
    gathered = handle.wait()
    # Autograd saved views of unsharded_flat in the last forward; refilling it is not a modification it must
    # see (the numba kernels write raw memory; the reference path needs this, as torch's FSDP2 copy-out does).
    with torch.autograd._unsafe_preserve_version_counter(unsharded_flat):
        all_gather_copy_out(handle.layout, gathered, unsharded_flat, impl=_impl(gathered))


def start_reduce_scatter(
    layout: GroupLayout,
    grads: list[torch.Tensor | None],
    group: dist.ProcessGroup,
    reduce_dtype: torch.dtype,
    device: torch.device,
    predivide: float | None,
    output: torch.Tensor | None = None,
) -> CollectiveHandle:
    """Stage the unsharded gradients (pad, pre-divide, cast in one kernel) and issue the reduce-scatter.

    ``output``: where the reduced shard goes (e.g. the sharded gradient buffer itself; default a new buffer).
    """
    staged = buffers.empty((layout.world_size, layout.shard_numel), reduce_dtype, device)
    reduce_scatter_copy_in(layout, grads, staged, predivide=predivide, impl=_impl(staged))
    if output is None:
        output = buffers.empty(layout.shard_numel, reduce_dtype, device)
    work = comm.reduce_scatter_into(output, staged.view(-1), group, async_op=True)
    return CollectiveHandle(work, output, staged)


def reduce_stream(device_handle: DeviceHandle) -> object | None:
    """The side stream every group's post-reduce work runs on (one per device handle, as torch's FSDP2 shares
    its reduce-scatter and all-reduce streams across groups); None on CPU."""
    key = id(device_handle)
    if key not in _REDUCE_STREAMS or _REDUCE_STREAMS[key][0] is not device_handle:
        _REDUCE_STREAMS[key] = (device_handle, device_handle.new_stream())
    return _REDUCE_STREAMS[key][1]


_REDUCE_STREAMS: dict[int, tuple[DeviceHandle, object | None]] = {}


def finish_reduce_scatter(
    layout: GroupLayout,
    handle: CollectiveHandle,
    grad_flat: torch.Tensor,
    postdivide: float | None,
    accumulate: bool,
    replicate_group: dist.ProcessGroup | None = None,
    device_handle: DeviceHandle | None = None,
) -> object | None:
    """Wait for the reduce-scatter [all-reduce across replicas], then divide/upcast/accumulate in one kernel.

    On an accelerator all of it runs on the side ``reduce_stream`` (the compute stream goes on with the next
    group's backward; the root joins the streams at the end of backward), as torch's FSDP2 runs its
    reduce-scatter and HSDP all-reduce off the compute stream. When the reduce-scatter wrote into
    ``grad_flat`` itself, only the post-divide is left (in place).

    CPU offload (``grad_flat`` on the host): without accumulation the post-reduce writes a device buffer that
    is copied into ``grad_flat`` non-blocking when ``grad_flat`` is pinned, and the returned event marks the
    copy's end: wait for it (``DeviceHandle.wait_event``) before anything reads the gradients on the host. With
    accumulation the copy is blocking (the host adds it), as in torch's FSDP2.
    """
    dh = device_handle or handle_for(handle.output.device)
    stream = reduce_stream(dh)
    dh.wait_stream(stream, dh.current_stream())  # the side stream starts after the staged gradients exist
    with dh.stream(stream):
        reduced = handle.wait()
        for t in (reduced, grad_flat):  # used on the side stream: not reused before that work ran
            if t.device.type != "cpu":
                dh.record_stream(t, stream)
        if replicate_group is not None:
            comm.all_reduce(reduced, replicate_group, "sum")
        if reduced is grad_flat:
            if postdivide is not None:  # element-wise: safe in place
                post_reduce(layout, grad_flat, grad_flat, postdivide=postdivide, impl=_impl(grad_flat))
            return None
        if reduced.device == grad_flat.device:
            post_reduce(layout, reduced, grad_flat, postdivide=postdivide, accumulate=accumulate, impl=_impl(grad_flat))
            return None
        return _offload_gradients(layout, reduced, grad_flat, postdivide, accumulate, dh, stream)


def _offload_gradients(
    layout: GroupLayout,
    reduced: torch.Tensor,
    grad_flat: torch.Tensor,
    postdivide: float | None,
    accumulate: bool,
    dh: DeviceHandle,
    stream: object | None,
) -> object | None:
    """CPU offload: bring the reduced shard to the host gradient buffer (see ``finish_reduce_scatter``)."""
    if accumulate:
        host = torch.empty_like(reduced, device=grad_flat.device)
        dh.copy_(host, reduced)  # blocking: the host adds it right away
        post_reduce(layout, host, grad_flat, postdivide=postdivide, accumulate=True, impl=_impl(grad_flat))
        return None
    on_device = buffers.empty(grad_flat.shape, grad_flat.dtype, reduced.device)
    dh.record_stream(on_device, stream)
    post_reduce(layout, reduced, on_device, postdivide=postdivide, impl=_impl(on_device))
    dh.copy_(grad_flat, on_device, non_blocking=dh.is_pinned(grad_flat))
    return dh.record_event(stream)


def _impl(tensor: torch.Tensor) -> str:
    """The staging kernels' implementation: numba's for real memory, torch's reference for fake tensors
    (the simulator), which numba cannot address."""
    return "auto" if has_data(tensor) else "reference"


def divide_factors(world_size: int, reduce_dtype: torch.dtype) -> tuple[float | None, float | None]:
    """(predivide, postdivide) whose product is ``world_size`` (gradients are averaged over ranks).

    fp32 divides once: over a power-of-two world before the sum, inside the copy-in kernel that stages the
    gradients anyway, which saves a pass over the reduced shard after it. Dividing by a power of two only
    shifts exponents, so each partial sum is the exact scaled partial sum and the result is bitwise that of
    dividing after (barring gradients below 1e-38, subnormals). Over other worlds fp32 divides after the sum.
    Low precision splits the division around the sum (as FSDP1 does) so neither the terms nor the sum
    overflow or underflow.

    >>> divide_factors(2, torch.float32), divide_factors(3, torch.float32), divide_factors(8, torch.bfloat16)
    ((2.0, None), (None, 3.0), (2.0, 4.0))
    """
    if world_size == 1:
        return None, None
    if reduce_dtype == torch.float32:
        if world_size & (world_size - 1) == 0:
            return float(world_size), None
        return None, float(world_size)
    pre = 1
    while world_size % (pre * 2) == 0 and world_size / (pre * 2) >= pre * 2:
        pre *= 2
    return (float(pre) if pre > 1 else None), float(world_size) / pre
