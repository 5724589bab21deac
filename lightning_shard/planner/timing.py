"""Time of one training step from an :class:`~lightning_shard.planner.estimate.Estimate`: compute from FLOPs
and a device's peak, communication from link bandwidths and collective volumes, overlapped as the engine does.

The model, per rank:

* **Compute**: ``hardware_flops / (peak(compute dtype) * matmul_efficiency)``, plus the eager non-matmul
  ops (norms, activations, rotary, casts, the loss), which are bound by memory bandwidth: three times the bytes
  they write (one write, about two reads) over ``memory_bandwidth * MEMORY_EFFICIENCY``. FLOPs come from
  ``torch.utils.flop_counter.FlopCounterMode`` on the meta forward (backward = 2x forward, plus what activation
  checkpointing recomputes; causal attention counts half, as a flash kernel computes it).
  ``matmul_efficiency`` is one assumed number per device (the share of peak that training kernels reach in
  eager mode), not fitted to any run.
* **Communication**: ring collectives, ``(n - 1) / n`` of the buffer per all-gather / reduce-scatter and twice
  that per all-reduce, over the slowest link the group crosses: the intra-node bandwidth (NVLink) when the
  group's ranks share a node, the per-device inter-node bandwidth otherwise; plus a per-call latency.
* **Overlap, as the engine does it**: FSDP all-gathers are prefetched one block ahead and reduce-scatters run
  asynchronously, so per block only ``max(0, communication - compute)`` is exposed; the root's all-gather
  (before the first block) and the last reduce-scatters (after the last block) are exposed. HSDP's
  all-reduce across replicas runs synchronously in ``finish_reduce``, TP collectives run synchronously in
  the forward/backward: both are on the critical path.
* **Optimizer**: memory-bound on the device (each state read and written once); with CPU offload, on the host
  at ``host_optimizer_rate`` parameters per second, plus the host<->device copies of shards and gradients.

Example::

    est = estimate(model, (8, 1), precision="bf16-mixed", batch=2, seq_len=8192, activation_checkpointing="full")
    t = step_time(est, DEVICES["h100"], devices_per_node=8)
    t.tokens_per_second_per_device, t.mfu
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_shard.planner.estimate import Estimate

__all__ = ["Device", "DEVICES", "StepTime", "step_time", "device_named"]


@dataclass(frozen=True)
class Device:
    """A device and its links. Bandwidths in bytes/s as NCCL achieves them (bus bandwidth), peaks in FLOP/s.

    Example: ``Device("my GPU", {"bf16": 300e12, "fp32": 20e12}, 80 * 2**30, 200e9, 20e9, 1.5e12, 0.5)``.
    """

    name: str
    peak_flops: dict
    memory_bytes: int
    intra_node_bandwidth: float  # per device, within a node (NVLink)
    inter_node_bandwidth: float  # per device, across nodes (the NIC each device uses)
    memory_bandwidth: float  # HBM, for the optimizer step
    matmul_efficiency: float  # share of peak that eager training kernels reach (assumed, one per device)
    latency: float = 20e-6  # per collective call and log2(ranks) step
    host_bandwidth: float = 25e9  # host<->device copies (PCIe), for CPU offload
    host_optimizer_rate: float = 0.5e9  # parameters per second a host AdamW step updates per rank

    def peak(self, dtype_name: str) -> float:
        return self.peak_flops.get(dtype_name, self.peak_flops["fp32"])


GiB = 2**30
# Sources: NVIDIA H100 / A100 datasheets (dense bf16 and fp32 peaks, NVLink 900 / 600 GB/s bidirectional per
# GPU, i.e. 450 / 300 GB/s each way, of which NCCL reaches about 80%); inter-node 400 Gb/s (H100, torchtitan's
# Grand Teton hosts) and 200 Gb/s (A100 HDR) per GPU at about 80%. matmul_efficiency: the best bf16 MFU the
# Llama 3 paper reports on H100 (43%, arXiv 2407.21783 Table 4) and Megatron-LM's best on A100 (54.2%, the 530B
# model with sequence parallelism and selective recomputation, arXiv 2205.05198; 52% in arXiv 2104.04473); both
# are whole-step figures, used here as the ceiling of the compute alone.
DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 80 * GiB, 360e9, 40e9, 3.35e12, 0.43),
    "a100": Device("A100 SXM", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 80 * GiB, 240e9, 20e9, 2.0e12, 0.542),
    # a server CPU socket as one "device" (gloo over shared memory / Ethernet); rough, for relative plans only
    "cpu": Device("CPU (one socket)", {"bf16": 1e12, "fp32": 1e12}, 256 * GiB, 10e9, 1.25e9, 100e9, 0.5, 50e-6),
}


MEMORY_EFFICIENCY = 0.7  # share of HBM bandwidth eager elementwise kernels reach (assumed)


def device_named(name: str | Device) -> Device:
    """``"h100"``, ``"a100"``, ``"cpu"`` (or a :class:`Device`) -> the device; a ``ValueError`` otherwise."""
    if isinstance(name, Device):
        return name
    key = str(name).lower().replace(" ", "")
    if key not in DEVICES:
        raise ValueError(f"planner: unknown device {name!r}; use one of {sorted(DEVICES)} or pass a Device(...)")
    return DEVICES[key]


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one step on one rank, its parts, tokens/s per device and MFU (model FLOPs without
    recomputation over the device's peak in the compute dtype).

    Example: ``plan(model, 8, 8, "80GB", batch=2, seq_len=2048).choice.time.mfu`` (see the module docstring).
    """

    step: float
    compute: float
    exposed_comm: float
    optimizer: float
    tokens_per_second_per_device: float
    mfu: float
    parts: dict = field(default_factory=dict)


def _bandwidth(scope: str, ranks: int, est: Estimate, device: Device, devices_per_node: int) -> float:
    dp, tp = est.mesh
    if scope == "tp":
        span = tp  # TP ranks are adjacent (the innermost mesh dimension)
    elif scope == "fsdp":
        span = (dp // est.replicas) * tp  # a shard group's ranks are tp apart
    else:
        span = dp * tp  # replicas are a node (or more) apart
    return device.intra_node_bandwidth if span <= devices_per_node else device.inter_node_bandwidth


def _collective_time(kind: str, nbytes: int, ranks: int, bandwidth: float, device: Device) -> float:
    if ranks <= 1:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (ranks - 1) / ranks * nbytes / bandwidth + device.latency * math.ceil(math.log2(ranks))


def step_time(est: Estimate, device: Device | str, devices_per_node: int, precision: str = "bf16-mixed") -> StepTime:
    """Predicted step time of ``est`` on ``device`` (see the module docstring).

    Example: ``step_time(estimate(model, (8, 1), batch=2, seq_len=2048), "h100", devices_per_node=8).mfu``.
    """
    device = device_named(device)
    dtype = "fp32" if precision.startswith("32") else ("fp16" if precision.startswith("16") else "bf16")
    rate = device.peak(dtype) * device.matmul_efficiency
    blocks = max(1, est.details.get("blocks") or 1)
    # forward is 1 / (3 + r) of the work, backward (with the recomputed share r of forward) the rest
    r = est.details.get("recompute_fraction", 0.0)
    # eager non-matmul ops: each output written once and about two inputs read, backward twice the forward
    memory_bound = 3 * est.memory_bound_bytes * (3 + r) / (device.memory_bandwidth * MEMORY_EFFICIENCY)
    compute = est.hardware_flops / rate + memory_bound
    fwd, bwd = compute / (3 + r), compute * (2 + r) / (3 + r)

    fsdp_fwd = fsdp_bwd = serial = 0.0
    for c in est.collectives:
        t = _collective_time(c.kind, c.nbytes, c.ranks, _bandwidth(c.scope, c.ranks, est, device, devices_per_node),
                             device)  # fmt: skip
        if not c.overlapped or c.scope in ("tp", "replicate"):
            serial += t * c.calls
        elif c.kind == "all_gather":
            fsdp_fwd += t
            fsdp_bwd += t * (c.calls - 1)
        else:
            fsdp_bwd += t * c.calls
    if est.cpu_offload:  # shards copied in before each all-gather, gradients copied out after each reduce
        h2d = sum(c.nbytes / max(1, c.ranks) * c.calls for c in est.collectives if c.kind == "all_gather")
        fsdp_fwd += h2d / 2 / device.host_bandwidth
        fsdp_bwd += (h2d / 2 + est.grads) / device.host_bandwidth
    # per block: prefetched communication hides behind the block's compute; the excess is exposed
    exposed_fwd = blocks * max(0.0, fsdp_fwd / blocks - fwd / blocks)
    exposed_bwd = blocks * max(0.0, fsdp_bwd / blocks - bwd / blocks)
    tail = fsdp_bwd / blocks  # the last reduce-scatters finish after the last block's compute
    head = fsdp_fwd / blocks  # the first all-gather precedes any compute
    if est.cpu_offload:
        n_params = est.optimizer / 8 if est.optimizer else est.params / 4
        optimizer = n_params / device.host_optimizer_rate
    else:
        optimizer = 2 * est.model_states / (device.memory_bandwidth * 0.5)
    exposed = exposed_fwd + exposed_bwd + head + tail + serial
    step = compute + exposed + optimizer
    dp, tp = est.mesh
    tokens = est.tokens / tp  # a TP group shares one micro-batch
    return StepTime(
        step=step,
        compute=compute,
        exposed_comm=exposed,
        optimizer=optimizer,
        tokens_per_second_per_device=tokens / step,
        mfu=est.model_flops / step / device.peak(dtype),
        parts={
            "forward_compute": fwd,
            "backward_compute": bwd,
            "fsdp_comm_forward": fsdp_fwd,
            "fsdp_comm_backward": fsdp_bwd,
            "exposed_fsdp": exposed_fwd + exposed_bwd + head + tail,
            "tp_and_replica_comm": serial,
            "recompute_fraction": r,
            "memory_bound_ops": memory_bound,
        },
    )
