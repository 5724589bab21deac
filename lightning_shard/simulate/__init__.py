"""Run the engine as rank ``r`` of ``N`` simulated accelerators on one CPU: fake tensors, torch's fake process
group, a recording stand-in for ``torch.cuda`` and a memory tracker (``simulated_world``).

Example::

    from lightning_shard.simulate import simulated_world
    with simulated_world(8, rank=0) as world:
        ...   # build a mesh on world.device_type, shard, train; read world.memory.peak
"""

from lightning_shard.simulate.handle import STAND_IN_DEVICE, RecordingHandle
from lightning_shard.simulate.memory import MemoryTracker
from lightning_shard.simulate.world import SimWorld, simulated_world

__all__ = ["simulated_world", "SimWorld", "RecordingHandle", "MemoryTracker", "STAND_IN_DEVICE"]
