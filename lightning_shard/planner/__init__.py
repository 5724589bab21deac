"""Memory and mesh planner: per-rank memory and communication of a training step, and the mesh that fits.

Example::

    with torch.device("meta"):
        model = build_model()
    result = plan(model, world_size=8, devices_per_node=8, device_memory_bytes=80 * 2**30,
                  precision="bf16-mixed", batch=8, seq_len=2048)
    print(result.table)            # mesh, memory per rank, communication per step, fits?
    dp, tp = result.choice.mesh
"""

from lightning_shard.planner.estimate import (
    ActivationProfile,
    Estimate,
    SavedTensorCounter,
    estimate,
    find_blocks,
    format_bytes,
    profile_activations,
)
from lightning_shard.planner.plan import MeshOption, PlanResult, choose_tensor_parallel_size, parse_bytes, plan

__all__ = [
    "estimate",
    "plan",
    "choose_tensor_parallel_size",
    "Estimate",
    "PlanResult",
    "MeshOption",
    "ActivationProfile",
    "SavedTensorCounter",
    "find_blocks",
    "format_bytes",
    "parse_bytes",
    "profile_activations",
]
