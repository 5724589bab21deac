"""Memory, communication and time planner: per-rank memory of a training step, its predicted time, and the
configuration (mesh, activation checkpointing, resharding, offload) that fits and runs fastest.

Does not model a pipeline-parallel axis (the engine has none).

Example::

    with torch.device("meta"):
        model = build_model()
    result = plan(model, world_size=8, devices_per_node=8, device_memory_bytes=80 * 2**30,
                  precision="bf16-mixed", batch=8, seq_len=2048, activation_checkpointing="auto")
    print(result.table)            # configuration, memory per rank, communication, tokens/s, MFU, fits?
    dp, tp = result.choice.mesh
"""

from lightning_shard.planner.estimate import Collective, Estimate, estimate, find_blocks, format_bytes
from lightning_shard.planner.plan import (
    Configuration,
    MeshOption,
    NoFitError,
    PlanResult,
    choose_configuration,
    choose_tensor_parallel_size,
    hsdp_replicas,
    parse_bytes,
    plan,
)
from lightning_shard.planner.profile import (
    ActivationOptions,
    ActivationProfile,
    SavedTensorCounter,
    profile_activations,
)
from lightning_shard.planner.reserved import SimulatedMemory, simulated_reserved
from lightning_shard.planner.timing import DEVICES, Device, StepTime, step_time

__all__ = [
    "estimate",
    "plan",
    "step_time",
    "choose_tensor_parallel_size",
    "choose_configuration",
    "Configuration",
    "hsdp_replicas",
    "Estimate",
    "Collective",
    "PlanResult",
    "MeshOption",
    "NoFitError",
    "ActivationOptions",
    "ActivationProfile",
    "SavedTensorCounter",
    "Device",
    "DEVICES",
    "StepTime",
    "find_blocks",
    "format_bytes",
    "parse_bytes",
    "profile_activations",
    "simulated_reserved",
    "SimulatedMemory",
]
