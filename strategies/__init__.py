"""The Lightning strategy "shard_fsdp_tp". Importing this package registers it (idempotently).

Example::

    import strategies
    from lightning.pytorch import Trainer
    trainer = Trainer(accelerator="cpu", devices=2, strategy="shard_fsdp_tp")
"""

from lightning.pytorch.strategies import StrategyRegistry

from strategies import loading
from strategies.precision import ShardedGradScaler, ShardPrecision
from strategies.strategy import ShardFSDPTPStrategy

ShardFSDPTPStrategy.register_strategies(StrategyRegistry)
loading.install()

__all__ = ["ShardFSDPTPStrategy", "ShardPrecision", "ShardedGradScaler"]
