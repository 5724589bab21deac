"""Helpers for simulator tests: the Lightning strategy's own setup code, and a real Trainer, on a simulated
world."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import Accelerator

from strategies.precision import ShardPrecision
from strategies.strategy import ShardFSDPTPStrategy


class SimEnvironment(LightningEnvironment):
    """Rank ``rank`` of ``world`` with ``per_node`` processes per node, as a launcher would report them."""

    def __init__(self, rank: int, world: int, per_node: int) -> None:
        super().__init__()
        self.set_world_size(world)
        self.set_global_rank(rank)
        self._per_node = per_node

    def local_rank(self) -> int:
        return self.global_rank() % self._per_node

    def node_rank(self) -> int:
        return self.global_rank() // self._per_node


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


# ---------------------------------------------------------------------------------------------- a real Trainer
class SimAccelerator(Accelerator):
    """Lightning's accelerator for the simulator's stand-in device: ``setup_device`` sets the world's current
    device, as ``CUDAAccelerator`` calls ``torch.cuda.set_device``."""

    def __init__(self, world) -> None:
        super().__init__()
        self.world = world

    def setup_device(self, device: torch.device) -> None:
        self.world.handle.set_device(device)

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices):
        return devices

    def get_parallel_devices(self, devices: int) -> list[torch.device]:  # type: ignore[override]
        return [torch.device(self.world.device_type, i) for i in range(devices)]

    @staticmethod
    def auto_device_count() -> int:
        return 8

    @staticmethod
    def is_available() -> bool:
        return True

    def get_device_stats(self, device) -> dict:
        return {}

    @classmethod
    def name(cls) -> str:
        return "simulated"


class _LaunchedEnvironment(SimEnvironment):
    """As under torchrun: the processes exist already, so Lightning starts no launcher."""

    @property
    def creates_processes_externally(self) -> bool:
        return True


class SimTrainerStrategy(ShardFSDPTPStrategy):
    """The strategy with Lightning's value reads of its reductions answered locally: a fake world's collectives
    run (their devices checked) but carry no values, so ``reduce`` returns its input and a boolean decision
    this rank's (what every rank of a uniform simulated run decides)."""

    def reduce(self, tensor, group=None, reduce_op="mean"):
        super().reduce(tensor.clone() if isinstance(tensor, torch.Tensor) else tensor, group, reduce_op)
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        super().reduce_boolean_decision(decision, all)
        return decision


@contextmanager
def lightning_value_reads_answered_locally() -> Iterator[None]:
    """Inside the block, the two places of Lightning's fit loop that read a collective's value on the device
    (fake in a simulated world: ``.item()`` raises) still run the collective but do not read it:
    ``has_len_all_ranks`` (the dataloader's length summed over ranks, compared with zero) and the training
    loop's SIGTERM broadcast (read every step)."""
    import lightning.pytorch.loops.fit_loop as fit_loop
    import lightning.pytorch.loops.training_epoch_loop as epoch_loop
    from lightning.fabric.utilities.data import sized_len

    def has_len_all_ranks(dataloader, strategy, allow_zero_length_dataloader_with_multiple_devices=False):
        length = sized_len(dataloader)
        if length is None:
            return False
        strategy.reduce(torch.tensor(length, device=strategy.root_device), reduce_op="sum")
        return True

    def broadcast_sigterm_tensor(self) -> None:
        dist.broadcast(torch.tensor([0], device=self.trainer.strategy.root_device), src=0)

    saved = fit_loop.has_len_all_ranks, epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor
    fit_loop.has_len_all_ranks = has_len_all_ranks
    epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor = broadcast_sigterm_tensor
    try:
        yield
    finally:
        fit_loop.has_len_all_ranks, epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor = saved


class Batches:
    """A sized iterable of batches: a ``DataLoader`` draws its worker seed with ``.item()``, which a fake world
    cannot (and Lightning takes a list for several dataloaders)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def sim_trainer(world, per_node: int = 8, **trainer_kwargs):
    """A real ``lightning.Trainer`` with ``SimTrainerStrategy`` as ``world``'s rank; call ``fit`` inside
    ``lightning_value_reads_answered_locally()``. ``strategy_kwargs`` go to the strategy."""
    import lightning as L

    strategy_kwargs = trainer_kwargs.pop("strategy_kwargs", {})
    accelerator = SimAccelerator(world)
    strategy = SimTrainerStrategy(
        cluster_environment=_LaunchedEnvironment(world.rank, world.world_size, per_node),
        parallel_devices=accelerator.get_parallel_devices(per_node),
        **strategy_kwargs,
    )
    defaults = dict(
        accelerator=accelerator, devices=per_node, num_nodes=world.world_size // per_node, strategy=strategy,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    return L.Trainer(**{**defaults, **trainer_kwargs})
