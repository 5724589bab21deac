"""Our FSDP: per-parameter (ZeRO-3) sharding with flat-buffer groups and fused staging kernels.

Example::

    from lightning_shard.fsdp import fully_shard, MixedPrecisionPolicy
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
"""

from lightning_shard.fsdp.api import FSDPModule, UnshardHandle, fully_shard, summon_full_params
from lightning_shard.fsdp.optimizer_guard import check_optimizer_params
from lightning_shard.fsdp.param import built_on_meta
from lightning_shard.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "summon_full_params",
    "check_optimizer_params",
    "built_on_meta",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
]
