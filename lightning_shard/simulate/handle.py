"""``RecordingHandle``: the simulator's stand-in accelerator, CUDA's semantics with every call recorded.

Fake tensors of a CPU-only torch cannot run autograd on ``device="cuda"`` (no CUDA device guard), but they
can on ``device="lazy"``, a device type torch always builds with and the engine never uses otherwise. The
simulator therefore plays the accelerator with fake ``lazy`` tensors, and this handle stands in for
``torch.cuda``: streams and events are small named objects, pinning marks a host storage as pinned, and
every call is appended to ``calls`` so tests can assert what the accelerator branches did (a non-blocking
copy into pinned memory, an all-reduce on a side stream, an event waited for before the optimizer step).

Example::

    handle = RecordingHandle()
    with register_handle(handle):
        ...
    [c for c in handle.calls if c[0] == "copy_"]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lightning_shard.device import DeviceHandle

__all__ = ["RecordingHandle", "SimStream", "SimEvent", "SimDeviceModule", "STAND_IN_DEVICE"]

# The device type the simulator's fake accelerator tensors use (see the module docstring for why not "cuda").
STAND_IN_DEVICE = "lazy"


class NullStream:
    """A stream of the stand-in device's module: orders nothing (fake tensors run no kernels)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        pass


class SimStream(NullStream):
    """A named stream; ``with handle.stream(s)`` makes it current. Its ordering methods (torch's
    ``torch.cuda.Stream`` API, which torch's FSDP2 calls under ``--reference torch``) order nothing: fake
    tensors run no kernels."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


class SimEvent:
    """An event recorded on ``stream``; ``waited`` once the host (or a stream) waited for it."""

    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        self.waited = False

    def __repr__(self) -> str:
        return f"SimEvent({self.stream.name}, waited={self.waited})"


class RecordingHandle(DeviceHandle):
    """The stand-in accelerator's handle (see the module docstring); ``calls`` lists ``(name, *details)``.

    >>> handle = RecordingHandle(device_count=2)
    >>> handle.device_type, handle.device_count(), handle.backend
    ('lazy', 2, 'lazy:fake')
    """

    def __init__(self, device_type: str = STAND_IN_DEVICE, device_count: int = 8, device_set: bool = False) -> None:
        self.device_type = device_type
        # The default group of a simulated world serves the accelerator only (Lightning's NCCL group); groups
        # made CPU-capable carry CPU tensors too (torch's "cpu:gloo,cuda:nccl").
        self.backend = f"{device_type}:fake"
        self.cpu_capable_backend = f"cpu:fake,{device_type}:fake"
        self.calls: list[tuple] = []
        self._count = device_count
        self._device: torch.device | None = torch.device(device_type, 0) if device_set else None
        self._default = SimStream("default")
        self._current = self._default
        self._pinned: dict[int, object] = {}  # id(storage) -> storage, kept alive with the tensor
        self._rng = ("rng", 0)
        self.memory = None  # the simulation's MemoryTracker: told of record_stream and wait_stream

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._count

    def current_device(self) -> torch.device:
        return self._device or torch.device(self.device_type, 0)

    def device_is_set(self) -> bool:
        return self._device is not None

    def set_device(self, device: torch.device | int) -> None:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        self.calls.append(("set_device", index))
        self._device = torch.device(self.device_type, index)

    def new_stream(self) -> SimStream:
        stream = SimStream(f"side{sum(c[0] == 'new_stream' for c in self.calls)}")
        self.calls.append(("new_stream", stream.name))
        return stream

    def current_stream(self) -> SimStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        previous, self._current = self._current, stream
        self.calls.append(("enter_stream", stream.name))
        try:
            yield
        finally:
            self._current = previous

    def wait_stream(self, waiter: SimStream, waitee: SimStream) -> None:
        self.calls.append(("wait_stream", waiter.name, waitee.name))
        if self.memory is not None:
            self.memory.wait_stream(waiter.name, waitee.name)

    def record_event(self, stream: SimStream | None = None) -> SimEvent:
        event = SimEvent(stream or self._current)
        self.calls.append(("record_event", event.stream.name))
        return event

    def record_stream(self, tensor: torch.Tensor, stream: SimStream | None) -> None:
        if stream is not None:
            self.calls.append(("record_stream", stream.name, tensor.device.type))
            if self.memory is not None:
                self.memory.record_stream(tensor, stream.name)

    def wait_event(self, event: SimEvent | None) -> None:
        if event is not None:
            event.waited = True
            self.calls.append(("wait_event", event.stream.name))

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            raise RuntimeError(f"RecordingHandle.pin: only host tensors can be pinned, got one on {tensor.device}")
        storage = tensor.untyped_storage()
        self._pinned[id(storage)] = storage
        self.calls.append(("pin", tensor.numel() * tensor.element_size()))
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        return self._pinned.get(id(storage)) is storage

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        host = dst if dst.device.type == "cpu" else src if src.device.type == "cpu" else None
        pinned = host is not None and self.is_pinned(host)
        self.calls.append(("copy_", src.device.type, dst.device.type, non_blocking, pinned, self._current.name))
        return dst.copy_(src)

    def get_rng_state(self) -> tuple:
        self.calls.append(("get_rng_state",))
        return self._rng

    def set_rng_state(self, state: tuple) -> None:
        self.calls.append(("set_rng_state", state))
        self._rng = state

    def count(self, name: str) -> int:
        """How many calls named ``name`` were recorded."""
        return sum(c[0] == name for c in self.calls)


class NullEvent:
    """An event of the stand-in device's module: always complete."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> NullEvent:
        return self

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class SimDeviceModule:
    """The stand-in device's ``torch.<device type>`` module (what ``torch.cuda`` is to CUDA), backed by a
    ``RecordingHandle``: the few names torch's own device-generic code looks up (``torch.get_device_module``),
    e.g. ``torch.utils.checkpoint`` stashing and restoring the device's RNG state around a recomputed forward.
    ``simulated_world`` registers it as ``torch.lazy`` for the duration of the simulation.

    Example::

        module = SimDeviceModule(RecordingHandle())
        with module.device(0):
            state = module.get_rng_state()
    """

    _initialized = True  # torch.utils.checkpoint stashes the device RNG state only for an initialised device
    # torch's FSDP2 (the simulator's --reference torch) creates streams and events; on fake tensors they order
    # nothing, but the handle's current stream is the one the memory tracker's allocator trace records, so
    # torch's all-gather and reduce-scatter buffers land in their streams' pools as on a GPU.
    Event = NullEvent

    def __init__(self, handle: RecordingHandle) -> None:
        self.handle = handle
        self._streams = 0

    def Stream(self, *args, **kwargs) -> SimStream:  # noqa: N802 (torch.cuda.Stream's name)
        self._streams += 1
        return SimStream(f"torch{self._streams}")

    def current_stream(self, device=None) -> SimStream:
        return self.handle.current_stream()

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return self.handle.stream(stream) if isinstance(stream, SimStream) else contextlib.nullcontext()

    def synchronize(self, device=None) -> None:
        pass

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.handle.device_count()

    def current_device(self) -> int:
        return self.handle.current_device().index or 0

    def set_device(self, device: torch.device | int) -> None:
        self.handle.set_device(device)

    @contextlib.contextmanager
    def device(self, device: torch.device | int | None) -> Iterator[None]:
        """Make ``device`` current inside the block, as ``torch.cuda.device`` does (``None``: no change)."""
        previous = self.handle._device
        if device is not None:
            index = device if isinstance(device, int) else torch.device(device).index or 0
            self.handle._device = torch.device(self.handle.device_type, index)
        try:
            yield
        finally:
            self.handle._device = previous

    def get_rng_state(self, device: torch.device | int | str = "lazy") -> tuple:
        return self.handle.get_rng_state()

    def set_rng_state(self, state: tuple, device: torch.device | int | str = "lazy") -> None:
        self.handle.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        self.handle.set_rng_state(("rng", seed))
