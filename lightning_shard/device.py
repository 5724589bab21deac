"""The engine's accelerator-specific operations, behind one small handle per device type.

Everything the engine does that only makes sense on an accelerator (choosing the current device, side
streams and events, pinned host buffers, non-blocking device-to-host copies, the device's random generator)
goes through ``handle_for(device)``. The CPU handle makes each of these a no-op; the CUDA handle calls
``torch.cuda``; the simulator (``lightning_shard.simulate``) registers a recording handle for its stand-in
accelerator, so these branches run, and are checked, on machines without a GPU.

Each handle also names the process-group backends of its device type: ``backend`` for the accelerator alone
(NCCL), ``cpu_capable_backend`` for groups that must also carry CPU tensors (torchtitan's
``"cuda:nccl,cpu:gloo"``: gradient clipping and full state dicts of CPU-offloaded shards).

Example::

    handle = handle_for(torch.device("cuda", 0))
    stream = handle.new_stream()
    with handle.stream(stream):
        ...                                   # work on the side stream
    event = handle.record_event(stream)
    handle.wait_event(event)                  # the host waits for it (a no-op on CPU)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "DeviceHandle",
    "CudaHandle",
    "handle_for",
    "register_handle",
    "accelerator_types",
    "has_data",
    "same_storage",
]


def has_data(tensor: torch.Tensor) -> bool:
    """False for tensors without memory (meta, and the simulator's fake tensors): no kernel may read them and
    no check may look at their values.

    >>> has_data(torch.zeros(2)), has_data(torch.empty(2, device="meta"))
    (True, False)
    """
    from torch._subclasses.fake_tensor import is_fake

    return tensor.device.type != "meta" and not is_fake(tensor)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view one storage (by identity, so it also holds for fake tensors, whose data
    pointers are all null).

    >>> x = torch.zeros(4); same_storage(x[1:], x), same_storage(x, x.clone())
    (True, False)
    """
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


class DeviceHandle:
    """The CPU handle, and the interface of every other one: no streams, no events, nothing to pin.

    Example: ``handle_for("cpu").new_stream() is None``.
    """

    device_type = "cpu"
    backend = "gloo"
    cpu_capable_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> torch.device:
        return torch.device(self.device_type)

    def device_is_set(self) -> bool:
        """Whether this process already chose its device (then the engine never changes it)."""
        return True

    def set_device(self, device: torch.device | int) -> None:
        pass

    # streams and events: None stands for "the one implicit stream" on CPU
    def new_stream(self) -> object | None:
        return None

    def current_stream(self) -> object | None:
        return None

    def stream(self, stream: object | None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def wait_stream(self, waiter: object | None, waitee: object | None) -> None:
        pass

    def record_event(self, stream: object | None = None) -> object | None:
        return None

    def record_stream(self, tensor: torch.Tensor, stream: object | None) -> None:
        """Tell the allocator ``stream`` uses ``tensor``, so its memory is not reused before that work ran."""

    def wait_event(self, event: object | None) -> None:
        """Block the host until ``event`` happened (before the optimizer reads offloaded gradients)."""

    # host memory
    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in page-locked host memory (what makes device<->host copies asynchronous)."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """``dst.copy_(src)``; every copy between host and device the engine makes goes through here."""
        return dst.copy_(src, non_blocking=non_blocking)

    # random generator of the device
    def get_rng_state(self) -> torch.Tensor | None:
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        pass


class CudaHandle(DeviceHandle):
    """``torch.cuda`` behind the handle interface (streams, events, pinned memory, the CUDA generator)."""

    device_type = "cuda"
    backend = "nccl"
    cpu_capable_backend = "cpu:gloo,cuda:nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def device_is_set(self) -> bool:
        # As torch's DeviceMesh: a process that initialised CUDA (e.g. Lightning's set_device) chose its device.
        return torch.cuda.is_initialized()

    def set_device(self, device: torch.device | int) -> None:
        torch.cuda.set_device(device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter, waitee) -> None:
        waiter.wait_stream(waitee)

    def record_event(self, stream=None) -> torch.cuda.Event:
        return (stream or torch.cuda.current_stream()).record_event()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if stream is not None:
            tensor.record_stream(stream)

    def wait_event(self, event) -> None:
        if event is not None:
            event.synchronize()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state)


_HANDLES: dict[str, DeviceHandle] = {"cpu": DeviceHandle(), "cuda": CudaHandle()}


def handle_for(device: torch.device | str) -> DeviceHandle:
    """The handle of ``device``'s type (the CPU handle for ``meta``: deferred init has no accelerator work).

    Example: ``handle_for(param.device).pin(host_buffer)``.
    """
    device_type = torch.device(device).type if not isinstance(device, torch.device) else device.type
    handle = _HANDLES.get(device_type)
    if handle is None:
        if device_type == "meta":
            return _HANDLES["cpu"]
        raise ValueError(
            f"lightning_shard: no device handle for device type {device_type!r}; supported: {sorted(_HANDLES)}"
        )
    return handle


def accelerator_types() -> list[str]:
    """The registered accelerator device types (``"cuda"``, plus the simulator's while it runs)."""
    return [t for t in _HANDLES if t != "cpu"]


@contextlib.contextmanager
def register_handle(handle: DeviceHandle) -> Iterator[DeviceHandle]:
    """Use ``handle`` for its device type inside the block (the simulator's stand-in accelerator).

    Example::

        with register_handle(RecordingHandle("lazy")):
            mesh = init_device_mesh("lazy", (8,))
    """
    previous = _HANDLES.get(handle.device_type)
    _HANDLES[handle.device_type] = handle
    try:
        yield handle
    finally:
        if previous is None:
            del _HANDLES[handle.device_type]
        else:
            _HANDLES[handle.device_type] = previous
