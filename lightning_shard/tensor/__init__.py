"""Our distributed tensor: placements, DTensor, redistribution and op sharding rules.

Example::

    from lightning_shard import init_device_mesh
    from lightning_shard.tensor import DTensor, Shard, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    (x * 2).full_tensor()
"""

from lightning_shard.tensor.api import distribute_module, distribute_tensor
from lightning_shard.tensor.dispatch import fallback_counts, reset_fallback_counts
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.fallback import fallback_policy, get_fallback_policy
from lightning_shard.tensor.interop import from_torch_dtensor, to_torch_dtensor
from lightning_shard.tensor.placements import Partial, Placement, Replicate, Shard, StridedShard
from lightning_shard.tensor.spec import DTensorSpec

__all__ = [
    "DTensor",
    "DTensorSpec",
    "Placement",
    "Shard",
    "StridedShard",
    "Replicate",
    "Partial",
    "distribute_tensor",
    "distribute_module",
    "fallback_counts",
    "fallback_policy",
    "get_fallback_policy",
    "reset_fallback_counts",
    "to_torch_dtensor",
    "from_torch_dtensor",
]
