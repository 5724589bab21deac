"""The Lightning strategy "shard_fsdp_tp", for the Trainer and for Fabric. Importing this package registers it
in both registries (idempotently).

Example::

    import strategies
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer
    trainer = Trainer(accelerator="cpu", devices=2, strategy="shard_fsdp_tp")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="shard_fsdp_tp")
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from strategies import loading
from strategies.fabric import ShardFSDPTPFabricStrategy
from strategies.fabric_precision import ShardFabricPrecision
from strategies.precision import ShardedGradScaler, ShardPrecision
from strategies.strategy import ShardFSDPTPStrategy

ShardFSDPTPStrategy.register_strategies(StrategyRegistry)
ShardFSDPTPFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
loading.install()

__all__ = [
    "ShardFSDPTPFabricStrategy",
    "ShardFSDPTPStrategy",
    "ShardFabricPrecision",
    "ShardPrecision",
    "ShardedGradScaler",
]
