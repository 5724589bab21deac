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
from lightning_shard.tensor.implicit import implicit_replication
from lightning_shard.tensor.interop import from_torch_dtensor, to_torch_dtensor
from lightning_shard.tensor.placements import Partial, Placement, Replicate, Shard, StridedShard
from lightning_shard.tensor.spec import DTensorSpec


def _allow_foreach_defaults() -> None:
    """Let torch's optimizers and ``clip_grad_*`` pick their foreach implementations for our DTensor, as they
    do for torch's (torch/distributed/tensor/__init__.py registers it the same way). Without it, ``AdamW()``
    on CUDA parameters that are our DTensors defaulted to the per-parameter loop: ~10 kernel launches and
    dispatches per parameter instead of ~10 per step (docs/dtensor.md, "Optimizer step: foreach")."""
    import torch.optim.optimizer as optim_module
    import torch.utils._foreach_utils as foreach_utils

    for supported in (optim_module._foreach_supported_types, foreach_utils._foreach_supported_types):
        if DTensor not in supported:
            supported.append(DTensor)


_allow_foreach_defaults()

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
    "implicit_replication",
    "reset_fallback_counts",
    "to_torch_dtensor",
    "from_torch_dtensor",
]
