"""Helpers for simulator tests: the Lightning strategy's own setup code on a simulated world."""

from __future__ import annotations

import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from strategies.precision import ShardPrecision
from strategies.strategy import ShardFSDPTPStrategy


class SimEnvironment(LightningEnvironment):
    """Rank ``rank`` of ``world`` with ``per_node`` processes per node, as a launcher would report them."""

    def __init__(self, rank: int, world: int, per_node: int) -> None:
        super().__init__()
        self.set_world_size(world)
        self.set_global_rank(rank)
        self._local = rank % per_node

    def local_rank(self) -> int:
        return self._local

    def node_rank(self) -> int:
        return self.global_rank() // 8


def sim_strategy(world, precision: str = "32-true", per_node: int = 8, **kwargs) -> ShardFSDPTPStrategy:
    """A ``ShardFSDPTPStrategy`` set up (mesh built) as ``world``'s rank, without a Trainer."""
    devices = [torch.device(world.device_type, i) for i in range(per_node)]
    strategy = ShardFSDPTPStrategy(
        parallel_devices=devices,
        cluster_environment=SimEnvironment(world.rank, world.world_size, per_node),
        precision_plugin=ShardPrecision(precision, world.device_type),
        **kwargs,
    )
    world.handle.set_device(strategy.root_device)  # Lightning's accelerator.setup_device does this first
    strategy._device_mesh = strategy._build_mesh()
    return strategy
