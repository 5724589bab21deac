"""``simulated_world``: this process plays rank ``r`` of ``N`` accelerators, on fake tensors.

Inside the block: torch's fake process group (``FakeStore`` + the ``"fake"`` backend; collectives return at
once and move no data), a ``FakeTensorMode`` (tensors have shape, dtype and device but no memory; mixing
devices in one op raises ``FakeTensorDeviceMismatchError``), the stand-in accelerator ``lazy`` with its
``RecordingHandle`` registered, and a ``MemoryTracker``. The default group serves the accelerator only, as
Lightning's NCCL group does, so a CPU tensor in a collective on it raises in ``lightning_shard.comm``, and
also in ``torch.distributed``'s own collectives, which the simulator guards the same way while it runs
(NCCL would fail there; torch's fake group would not).

What a fake world cannot do: anything that reads values (``.item()``, ``bool(tensor)``, object collectives
carry no data), so the engine skips value checks on tensors without data (``device.has_data``).

Example::

    with simulated_world(8, rank=3) as world:
        mesh = init_device_mesh(world.device_type, (8,), mesh_dim_names=("data_parallel",))
        ...
    world.memory.peak["lazy"], world.handle.calls
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_shard import comm
from lightning_shard.device import register_handle
from lightning_shard.simulate.handle import STAND_IN_DEVICE, RecordingHandle, SimDeviceModule
from lightning_shard.simulate.memory import MemoryTracker

__all__ = ["SimWorld", "simulated_world"]


@dataclass
class SimWorld:
    """What ``simulated_world`` yields: the rank, the accelerator device, its recording handle and memory.

    Example: ``world.rank, world.device_type, world.handle.device_count()`` is ``(3, "lazy", 8)`` inside
    ``simulated_world(8, rank=3)`` (see there).
    """

    rank: int
    world_size: int
    handle: RecordingHandle
    memory: MemoryTracker
    fake_mode: FakeTensorMode

    @property
    def device_type(self) -> str:
        return self.handle.device_type

    @property
    def device(self) -> torch.device:
        return torch.device(self.handle.device_type, self.rank % self.handle.device_count())


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int = 0, *, devices_per_node: int = 8) -> Iterator[SimWorld]:
    """Run the block as ``rank`` of ``world_size`` simulated accelerators (see the module docstring).

    The process's device is already chosen, as Lightning and torchrun do before the model is built.

    Example (in a process without a process group; it raises ``RuntimeError`` otherwise)::

        with simulated_world(8, rank=3) as world:
            x = torch.empty(1024, device=world.device_type)   # a fake "lazy" tensor: no memory, counted
            world.memory.peak["lazy"], dist.get_world_size()    # (4096, 8)
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"simulated_world: world_size={world_size!r} must be a positive int")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"simulated_world: rank={rank!r} must be in [0, {world_size})")
    if dist.is_initialized():
        raise RuntimeError("simulated_world: torch.distributed is already initialized; run the simulation alone")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    handle = RecordingHandle(STAND_IN_DEVICE, device_count=min(devices_per_node, world_size))
    handle.set_device(rank % handle.device_count())
    handle.calls.clear()
    with register_handle(handle), _device_module(handle), _guarded_collectives(), comm.strict_host_collectives():
        dist.init_process_group(handle.backend, store=FakeStore(), rank=rank, world_size=world_size)
        try:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            memory = MemoryTracker(handle.device_type, lambda: handle.current_stream().name)
            handle.memory = memory
            with fake_mode, memory:
                yield SimWorld(rank, world_size, handle, memory, fake_mode)
        finally:
            dist.destroy_process_group()
            _forget_groups()


@contextlib.contextmanager
def _device_module(handle: RecordingHandle) -> Iterator[None]:
    """Register ``torch.<stand-in type>`` (a ``SimDeviceModule``) while the simulation runs: torch's
    device-generic code (``torch.utils.checkpoint``, ``torch.random.fork_rng``) looks the device's module up
    there, as it finds ``torch.cuda``; a CPU build has none for the stand-in type."""
    import sys

    name = handle.device_type
    if hasattr(torch, name):
        raise RuntimeError(f"simulated_world: torch.{name} exists already; the stand-in device needs its name free")
    torch._register_device_module(name, SimDeviceModule(handle))
    try:
        yield
    finally:
        delattr(torch, name)
        sys.modules.pop(f"torch.{name}", None)


# torch.distributed's tensor collectives; the simulator checks their tensors' devices as NCCL would.
_GUARDED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "broadcast",
    "all_to_all_single",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
)


@contextlib.contextmanager
def _guarded_collectives() -> Iterator[None]:
    originals = {name: getattr(dist, name) for name in _GUARDED if hasattr(dist, name)}

    def guard(name, fn):
        def guarded(*args, **kwargs):
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, list) else [a])]
            group = kwargs.get("group")
            comm.check_devices(f"torch.distributed.{name}", group, *[t for t in tensors if torch.is_tensor(t)])
            return fn(*args, **kwargs)

        return guarded

    for name, fn in originals.items():
        setattr(dist, name, guard(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _forget_groups() -> None:
    """Drop the caches that hold this world's process groups (a later world gets new ones)."""
    from lightning_shard import comm, mesh, utils
    from lightning_shard.checkpoint import _interop
    from lightning_shard.tensor import interop

    mesh._GROUP_CACHE.clear()
    comm._SERVED.clear()
    utils._FLAT_GROUPS.clear()
    # torch meshes built over this world's groups (checkpoints convert our DTensors to torch's); the tensor
    # cache is keyed by mesh equality, so a later world's equal mesh would get one of these, with this rank
    interop._TORCH_MESHES.clear()
    interop._OUR_MESHES.clear()
    _interop._TORCH_MESHES.clear()
