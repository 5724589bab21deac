"""``simulated_reserved``: the memory a planned configuration *reserves* on a GPU, from the fake-tensor simulator
(``lightning_shard.simulate``) and its replay of PyTorch's CUDA caching allocator.

The planner's phase model predicts *allocated* bytes (what tensors hold). GPUs run out of, and published runs
report, *reserved* bytes (``torch.cuda.max_memory_reserved()``): the allocator's segments, which add rounding,
per-stream pools and fragmentation to what is allocated. That depends on the exact order and sizes of the
step's allocations, so it is not estimated from the phase model: the engine's real setup and two training
steps run on fake tensors (the second step has the optimizer state), and their allocation trace is replayed
through the allocator's rules (``lightning_shard.simulate.allocator``). The simulation builds the model from a
factory (on meta) and feeds token ids, with cross-entropy on the fp32 logits as the planner's default loss; it
runs activation checkpointing of every block (``"full"``, or torchtitan's ``"selective-op"`` policy) or none, so
per-class policies raise ``ValueError``; sequence and loss parallelism are passed through as the plan has them.

Example::

    result = plan(model, 8, 8, "80GB", precision="bf16-mixed", batch=2, seq_len=8192)
    r = simulated_reserved(build_llama, result.choice.estimate, precision="bf16-mixed", batch=2, seq_len=8192)
    r.peak_reserved / 2**30
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lightning_shard.planner.estimate import Estimate

__all__ = ["SimulatedMemory", "simulated_reserved", "simulation_request"]


@dataclass(frozen=True)
class SimulatedMemory:
    """Per-device peaks of a simulated step: ``peak_allocated`` (tensors), ``peak_reserved`` (the caching
    allocator's segments), ``reserved_by_phase``; ``planned_allocated`` is the planner's estimate beside them.

    Example: ``simulated_reserved(build_llama, est, precision="bf16-mixed", batch=1, seq_len=2048).peak_reserved``.
    """

    planned_allocated: int
    peak_allocated: int
    peak_reserved: int
    reserved_by_phase: dict[str, int]

    @property
    def reserved_over_allocated(self) -> float:
        """The allocator's overhead on the simulated step: reserved / allocated peaks."""
        return self.peak_reserved / self.peak_allocated


def simulation_request(
    est: Estimate,
    *,
    precision: str,
    batch: int,
    seq_len: int,
    devices_per_node: int = 8,
    expandable_segments: bool = False,
    device_memory: int | None = None,
    attention: str = "flash",
    loss: str = "cross-entropy",
):
    """The ``SimulationRequest`` that runs the configuration ``est`` describes; ``ValueError`` for what the
    simulator cannot run (per-class checkpointing policies). Loss parallelism needs ``loss="cross-entropy"``
    and, like the strategy's flag, changes nothing without tensor parallelism."""
    from lightning_shard.simulate.run import SimulationRequest

    ac = est.options.checkpointing
    if ac not in (None, "full", "selective-op"):
        raise ValueError(
            f"planner: activation_checkpointing={ac!r} cannot be simulated (the simulator checkpoints every block, "
            "fully or with torchtitan's selective op policy, or none); simulate with None, 'full' or 'selective-op'"
        )
    dp, tp = est.mesh
    if est.replicas > 1:
        strategy = "HYBRID_SHARD"
    elif est.reshard_after_forward is False:
        strategy = "SHARD_GRAD_OP"
    else:
        strategy = "FULL_SHARD"
    return SimulationRequest(
        devices=dp * tp, tensor_parallel_size=tp, sharding_strategy=strategy, precision=precision, batch=batch,
        seq_len=seq_len, steps=2, cpu_offload=est.cpu_offload, activation_checkpointing=ac or False,
        devices_per_node=devices_per_node, checkpoint=False, sequence_parallel=est.options.sequence_parallel,
        attention=attention, expandable_segments=expandable_segments, device_memory=device_memory, loss=loss,
        loss_parallel=est.options.loss_parallel and tp > 1,
    )  # fmt: skip


def simulated_reserved(factory: Callable[[], nn.Module], est: Estimate, **request) -> SimulatedMemory:
    """Simulate the configuration of ``est`` (the model from ``factory``, called on meta) as rank 0 and return
    its allocated and reserved peaks; ``request``: ``simulation_request``'s keywords.

    Example::

        est = estimate(model, (8, 1), precision="bf16-mixed", batch=1, seq_len=2048)
        mem = simulated_reserved(build_llama, est, precision="bf16-mixed", batch=1, seq_len=2048)
        mem.peak_reserved, mem.reserved_over_allocated
    """
    from lightning_shard.simulate.run import simulate_training

    report = simulate_training(factory, simulation_request(est, **request))
    return SimulatedMemory(
        planned_allocated=est.device_total,
        peak_allocated=report["peak_device_bytes"],
        peak_reserved=report["peak_reserved_bytes"],
        reserved_by_phase=report["reserved_by_phase"],
    )
