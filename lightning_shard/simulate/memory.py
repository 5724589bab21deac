"""``MemoryTracker``: live and peak bytes per device type of the fake tensors a simulation allocates.

Fake tensors own no memory, but each has a storage of a known size. The tracker counts a storage when an op
first returns it, uncounts it when the storage
dies, and follows ``UntypedStorage.resize_`` (how FSDP frees and re-allocates unsharded parameters). Peaks
are kept overall and per named phase (``tracker.phase = "forward"``).

For one device type (``trace_device``, the simulated accelerator) the tracker also records the ordered trace of
allocations (with the stream current at the time, from ``stream_of``; without it every allocation is on the
default stream), frees and phase changes that ``lightning_shard.simulate.allocator.replay`` turns into the CUDA
caching allocator's reserved bytes. A storage
used on another stream (``record_stream``) is freed in the trace only when its allocation stream next waits
for that stream (``wait_stream``): the caching allocator holds such a block until an event recorded at the
free has completed, and without timing that is the first point the engine orders the two streams.

Inside a ``FakeTensorMode`` (the simulator's case) the tracker observes the fake mode's own dispatch, which every
op on a fake tensor reaches, including the ops a tensor subclass (a DTensor) runs on its local tensors inside its
``__torch_dispatch__``: their temporaries and collectives count too. (A dispatch mode pushed above the fake mode
would be switched off while a subclass handles an op, and would see only the op's outputs.) Without a fake mode
the tracker is an ordinary dispatch mode.

The tracker sees every op, so it also counts the collective ops (``c10d`` and functional collectives) inside
``count_collectives()``: the same accounting for any engine, whether or not it calls ``lightning_shard.comm``.

Example::

    with FakeTensorMode(), MemoryTracker() as mem:
        x = torch.empty(1024, device="lazy")
    mem.peak["lazy"]   # 4096
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_shard.simulate.allocator import Alloc, Free, Phase

__all__ = ["MemoryTracker"]

# Each op the fake mode dispatches counts its outputs only, as its kernel allocates them on a device. Many fake
# implementations are Python decompositions whose steps dispatch again and allocate: ``log_softmax`` computes
# ``x - max`` and ``exp`` (two more tensors of the fp32 logits' size), ``_to_copy`` to another device converts on
# the source device first, ``uniform_`` draws a new full-size tensor and copies it in. A device kernel allocates
# none of these. Counting them also made results depend on the fake mode's op cache (shared by every fake mode of
# the process): a cache hit skips the decomposition, so the first simulation in a process peaked higher than the
# next (6 GiB on a 4-block model at Llama-3-8B widths with a cross-entropy loss).


class MemoryTracker(TorchDispatchMode):
    """Live bytes, peak bytes and peak bytes per phase, by device type (see the module docstring).

    >>> with MemoryTracker() as mem:
    ...     x = torch.empty(256)   # 1 KiB
    ...     y = x * 2              # 1 KiB more, freed at once
    ...     del y
    >>> mem.peak["cpu"], mem.live["cpu"]
    (2048, 1024)
    """

    def __init__(self, trace_device: str | None = None, stream_of: Callable[[], str] | None = None) -> None:
        super().__init__()
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.peak_by_phase: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.trace_device = trace_device
        # the allocator trace of trace_device, starting in the first phase
        self.trace: list[Alloc | Free | Phase] = [Phase("setup")] if trace_device is not None else []
        self._stream_of = stream_of or (lambda: "default")
        self._keys = 0  # the last trace key handed out: storages' ids are reused, trace keys never
        self._streams: dict[int, str] = {}  # trace key -> the stream it was allocated on
        self._recorded: dict[int, set[str]] = {}  # trace key -> the other streams it was used on
        self._held: dict[tuple[str, str], list[int]] = defaultdict(list)  # (alloc, used) streams -> keys
        self._phase = "setup"
        self._entries: dict[int, tuple[str, int, int]] = {}  # id(storage) -> (device type, bytes, trace key)
        self._resize = None
        self._counts: list = []
        self._fake_mode = None  # the FakeTensorMode whose dispatch is observed, if any
        self._inside_op = False

    def __enter__(self):
        tracker, original = self, torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            result = original(storage, nbytes)
            tracker._resized(storage)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if fake_mode is None or "dispatch" in vars(fake_mode):
            return super().__enter__()
        dispatch = fake_mode.dispatch

        def observed(func, types, args=(), kwargs=None):
            if tracker._inside_op:  # the fake implementation's own steps (see the comment above MemoryTracker)
                return dispatch(func, types, args, kwargs)
            tracker._inside_op = True
            try:
                out = dispatch(func, types, args, kwargs)
            finally:
                tracker._inside_op = False
            tracker._observe(func, args, out)
            return out

        fake_mode.dispatch, self._fake_mode = observed, fake_mode
        return self

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        if self._fake_mode is None:
            return super().__exit__(*exc)
        del self._fake_mode.dispatch  # back to the class's method
        self._fake_mode = None
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._observe(func, args, out)
        return out

    def _observe(self, func, args, out) -> None:
        if self._counts and func.namespace in _COLLECTIVE_NAMESPACES:
            self._count(func, args)
        if isinstance(out, torch.Tensor):
            self.track(out)
            return
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage if it is new (tensors made outside the tracker can be added this way).

        A wrapper subclass (a DTensor) owns no memory beyond its local tensor, which is what is counted."""
        if type(t) is not torch.Tensor and not isinstance(t, FakeTensor):
            local = getattr(t, "_local_tensor", None)
            if isinstance(local, torch.Tensor):
                self.track(local)
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._entries:
            return
        self._entries[key] = (t.device.type, 0, 0)
        weakref.finalize(storage, self._release, key)
        self._set(key, storage.nbytes())

    @contextlib.contextmanager
    def count_collectives(self) -> Iterator:
        """Count the collective ops dispatched inside the block, as ``lightning_shard.comm.count_collectives``
        does (calls and input bytes per kind).

        Example::

            with tracker.count_collectives() as counts:
                model(x).sum().backward()
            counts.calls["all_gather"]
        """
        from lightning_shard.comm import CollectiveCounts

        counts = CollectiveCounts()
        self._counts.append(counts)
        try:
            yield counts
        finally:
            self._counts.remove(counts)

    def _count(self, func, args) -> None:
        kind, position = _COLLECTIVE_KINDS.get(func._opname, (None, 0))
        if kind is None:
            return
        tensor = pytree.tree_leaves(args[position])[0]
        for counts in self._counts:
            counts.record(kind, tensor)

    def reset_peaks(self) -> None:
        """Start new peaks from the current live bytes."""
        self.peak = defaultdict(int, self.live)
        self.peak_by_phase = defaultdict(lambda: defaultdict(int))

    def _resized(self, storage) -> None:
        if id(storage) in self._entries:
            self._set(id(storage), storage.nbytes())

    def _set(self, key: int, nbytes: int) -> None:
        device, before, trace_key = self._entries[key]
        if device == self.trace_device and nbytes != before:
            # a resize is a new block and the old one's free, as resize_ on CUDA (FSDP frees this way)
            self._trace_free(trace_key)
            trace_key = self._trace_alloc(nbytes)
        self._entries[key] = (device, nbytes, trace_key)
        self.live[device] += nbytes - before
        if nbytes > before:
            live = self.live[device]
            self.peak[device] = max(self.peak[device], live)
            phase = self.peak_by_phase[self.phase]
            phase[device] = max(phase[device], live)

    def _release(self, key: int) -> None:
        device, nbytes, trace_key = self._entries.pop(key)
        self.live[device] -= nbytes
        if device == self.trace_device:
            self._trace_free(trace_key)

    # -- the allocator trace

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._phase = name
        if self.trace_device is not None:
            self.trace.append(Phase(name))

    def record_stream(self, t: torch.Tensor, stream: str) -> None:
        """``t`` is used on ``stream`` too (``Tensor.record_stream``): its block is held past its free until
        its allocation stream waits for ``stream`` (see ``wait_stream``)."""
        entry = self._entries.get(id(t.untyped_storage()))
        if entry is not None and entry[2] and self._streams[entry[2]] != stream:
            self._recorded.setdefault(entry[2], set()).add(stream)

    def wait_stream(self, waiter: str, waitee: str) -> None:
        """``waiter`` waits for ``waitee``: blocks of ``waiter`` held for use on ``waitee`` return to the pool."""
        for trace_key in self._held.pop((waiter, waitee), ()):
            streams = self._recorded[trace_key]
            streams.discard(waitee)
            if not streams:
                del self._recorded[trace_key]
                self.trace.append(Free(trace_key))

    def _trace_alloc(self, nbytes: int) -> int:
        if not nbytes:
            return 0
        self._keys += 1
        stream = self._stream_of()
        self._streams[self._keys] = stream
        self.trace.append(Alloc(self._keys, nbytes, stream))
        return self._keys

    def _trace_free(self, trace_key: int) -> None:
        if not trace_key:
            return
        stream = self._streams.pop(trace_key)
        recorded = self._recorded.get(trace_key)
        if recorded:
            for used in recorded:
                self._held[(stream, used)].append(trace_key)
            return
        self.trace.append(Free(trace_key))


_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# op name -> (kind, position of its input in the op's arguments); c10d's ops take (output, input, ...)
_COLLECTIVE_KINDS = {
    "_allgather_base_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0),
    "broadcast": ("broadcast", 0),
}
