"""``simulate_training``: the setup and training steps the strategy runs on GPUs, as rank ``r`` of ``N``
simulated accelerators, with a memory and collective report.

The steps (the engine's own, no Lightning): a ``(data_parallel, tensor_parallel)`` mesh (or ``(replicate,
data_parallel)`` for HYBRID_SHARD, ``(replicate, 1)`` for NO_SHARD), the model built on meta by the factory,
tensor parallelism with ``auto_tp_plan`` when T > 1, ``fully_shard`` on every repeated block and the root,
materialisation (``to_empty`` + ``reset_parameters``), then K steps of forward, backward, clipping by norm
and AdamW, then (unless ``checkpoint=False``) a sharded and a full checkpoint save and load through the
engine's checkpoint code with a storage stand-in (``lightning_shard.simulate.checkpoint``).

Attention is counted as a GPU's flash attention keeps it (``attention.py``; ``attention="math"`` for torch's
math path) and the staging kernels as launches that allocate nothing (``kernels.py``). ``engine=`` swaps the
engine-specific steps (meshes, TP + ``fully_shard``, clipping): ``reference.TORCH_ENGINE`` runs torch's own
FSDP2 on the same simulation, for ``--reference torch``.

Example::

    report = simulate_training(build_llama, SimulationRequest(devices=8, precision="bf16-mixed", seq_len=8192))
    report["peak_device_bytes"]
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_shard import comm
from lightning_shard.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from lightning_shard.fsdp.units import find_repeated_blocks
from lightning_shard.mesh import init_device_mesh
from lightning_shard.simulate.attention import flash_attention_accounting
from lightning_shard.simulate.kernels import simulated_staging_kernels
from lightning_shard.simulate.world import simulated_world
from lightning_shard.tp.loss import loss_parallel, replicated_loss
from lightning_shard.utils import clip_grad_norm_

__all__ = ["SimulationRequest", "simulate_training", "Engine", "ENGINE", "checkpoint_blocks"]

_POLICIES = {
    "32-true": MixedPrecisionPolicy(),
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}
_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")


@dataclass(frozen=True)
class SimulationRequest:
    """What to simulate; ``check()`` raises ``ValueError`` naming what cannot be honoured."""

    devices: int
    tensor_parallel_size: int = 1
    sharding_strategy: str = "FULL_SHARD"
    precision: str = "bf16-mixed"
    batch: int = 1
    seq_len: int = 512
    steps: int = 1
    cpu_offload: bool = False
    activation_checkpointing: bool | str = False  # True or "full": every block; "selective-op": torchtitan's op SAC
    rank: int = 0
    devices_per_node: int = 8
    vocab_size: int | None = None
    checkpoint: bool = True  # our engine only: torch's FSDP2 (--reference torch) saves with its own code
    sequence_parallel: bool = False  # with T > 1: auto_tp_plan(sequence_parallel=...), as the strategy's flag
    attention: str = "flash"  # how SDPA's memory is counted: "flash" (a GPU's fused kernels) or "math"
    expandable_segments: bool = False  # the allocator replay's setting (PYTORCH_CUDA_ALLOC_CONF)
    device_memory: int | None = None  # bytes per device for the allocator replay (None: unlimited)
    loss: str = "mean"  # "mean" of the fp32 logits, or "cross-entropy" on them (torchtitan's loss)
    loss_parallel: bool = False  # with T > 1 and cross-entropy: vocabulary-sharded logits, as the strategy's flag

    def check(self) -> None:
        if self.devices < 1:
            raise ValueError(f"simulate: --devices {self.devices} must be at least 1")
        if self.tensor_parallel_size < 1 or self.devices % self.tensor_parallel_size:
            raise ValueError(
                f"simulate: --tensor-parallel-size {self.tensor_parallel_size} does not divide --devices "
                f"{self.devices}; choose a divisor"
            )
        if self.sharding_strategy not in _SHARDING:
            raise ValueError(f"simulate: --sharding-strategy {self.sharding_strategy!r} is not one of {_SHARDING}")
        if self.sharding_strategy in ("HYBRID_SHARD", "NO_SHARD") and self.tensor_parallel_size > 1:
            raise ValueError(f"simulate: {self.sharding_strategy} with tensor parallelism is not supported")
        if self.precision not in _POLICIES:
            raise ValueError(f"simulate: --precision {self.precision!r} is not one of {sorted(_POLICIES)}")
        if self.attention not in ("flash", "math"):
            raise ValueError(f"simulate: --attention {self.attention!r} is not 'flash' or 'math'")
        if not 0 <= self.rank < self.devices:
            raise ValueError(f"simulate: --rank {self.rank} must be in [0, {self.devices})")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"simulate: --vocab-size {self.vocab_size} must be positive")
        if self.steps < 1 or self.batch < 1 or self.seq_len < 1:
            raise ValueError("simulate: --steps, --batch and --seq-len must be positive")
        if self.activation_checkpointing not in (False, True, "full", "selective-op"):
            raise ValueError(
                f"simulate: --activation-checkpointing {self.activation_checkpointing!r} is not 'full' or "
                "'selective-op'"
            )
        if self.loss not in ("mean", "cross-entropy"):
            raise ValueError(f"simulate: --loss {self.loss!r} is not 'mean' or 'cross-entropy'")
        if self.device_memory is not None and self.device_memory <= 0:
            raise ValueError(f"simulate: --device-memory {self.device_memory} must be positive")
        if self.loss_parallel and (self.tensor_parallel_size < 2 or self.loss != "cross-entropy"):
            raise ValueError(
                f"simulate: --loss-parallel shards the cross-entropy over the tensor-parallel ranks; it needs "
                f"--tensor-parallel-size > 1 and --loss cross-entropy (got --tensor-parallel-size "
                f"{self.tensor_parallel_size}, --loss {self.loss}). Pass both, or drop --loss-parallel"
            )


@dataclass(frozen=True)
class Engine:
    """The engine-specific steps of a simulation: this package's (``ENGINE``) or torch's, the reference
    (``lightning_shard.simulate.reference.TORCH_ENGINE``). Everything else (the world, the model, the data, the
    steps, the memory accounting) is shared, so the two reports compare like with like."""

    name: str
    meshes: Callable  # (device_type, request) -> (mesh, fsdp_mesh)
    parallelize: Callable  # (model, mesh, fsdp_mesh, request) -> None: TP, then fully_shard per unit
    clip_grad_norm: Callable  # (parameters, max_norm) -> total norm
    device_module: Callable = lambda device_type, count: contextlib.nullcontext()  # what the engine needs of torch
    materialize: Callable = lambda model, device, request: model.to_empty(device=device)  # storage for meta params
    loss_parallel: Callable = contextlib.nullcontext  # () -> the context of the loss's forward and backward
    parallel_loss: Callable = lambda loss: loss  # a loss computed inside loss_parallel -> the tensor to backward


def simulate_training(
    factory: Callable[[], nn.Module], request: SimulationRequest, engine: Engine | None = None
) -> dict:
    """Run ``request`` (see the module docstring) with ``engine`` (default: this package's) and return the
    report dict."""
    request.check()
    engine = engine or ENGINE
    started, started_cpu = time.perf_counter(), time.process_time()
    with contextlib.ExitStack() as stack:
        world = stack.enter_context(
            simulated_world(request.devices, request.rank, devices_per_node=request.devices_per_node)
        )
        stack.enter_context(engine.device_module(world.device_type, world.handle.device_count()))
        stack.enter_context(simulated_staging_kernels())
        if request.attention == "flash":
            stack.enter_context(flash_attention_accounting())
        mem = world.memory
        mesh, fsdp_mesh = engine.meshes(world.device_type, request)
        try:
            # Real meta tensors, as on a GPU: under the fake mode a no-op conversion in the factory (``.float()``
            # on a float32 model) made torch's ``_apply`` swap a fake parameter (it always swaps those), which the
            # weak references held to it refused ("Couldn't swap Embedding.weight").
            with unset_fake_temporarily(), torch.device("meta"):
                model = factory()
        except Exception as e:
            raise ValueError(f"simulate: the model factory {factory!r} failed: {e!r}") from e
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"simulate: the model factory {factory!r} returned a {type(model).__name__}, not an nn.Module; "
                "it must return the model (token ids in, logits out)"
            )
        engine.parallelize(model, mesh, fsdp_mesh, request)
        engine.materialize(model, world.device, request)
        with torch.no_grad():
            for m in model.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        after_setup = mem.live[world.device_type]
        host_after_setup = mem.live["cpu"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        vocab = request.vocab_size or _vocab_of(model)
        for step in range(request.steps):
            with comm.count_collectives() as ours, mem.count_collectives() as dispatched:
                x = torch.randint(0, vocab, (request.batch, request.seq_len), device=world.device)
                # As the strategy: forward, loss and backward inside loss parallelism (its backward ops need it)
                with engine.loss_parallel() if request.loss_parallel else contextlib.nullcontext():
                    mem.phase = "forward"
                    with _model_input_errors(request) if step == 0 else contextlib.nullcontext():
                        loss = _loss(model(x), x, request)
                    if request.loss_parallel:
                        loss = engine.parallel_loss(loss)
                    mem.phase = "backward"
                    loss.backward()
                mem.phase = "optimizer"
                engine.clip_grad_norm(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                del loss
        checkpoint = _simulate_checkpoints(model, optimizer, world, request) if engine is ENGINE else {}
    device = world.device_type
    counts = ours if engine is ENGINE else dispatched  # torch's collectives bypass lightning_shard.comm
    reserved = _replay_allocator(mem.trace, request)
    return {
        "peak_device_bytes": mem.peak[device],
        "peak_by_phase": {phase: peaks.get(device, 0) for phase, peaks in mem.peak_by_phase.items()},
        **reserved,
        "device_bytes_after_setup": after_setup,
        "collectives_per_step": dict(counts.calls),
        "comm_bytes_per_step": sum(counts.bytes.values()),
        "host_bytes_offloaded": host_after_setup if request.cpu_offload else 0,
        "checkpoint_bytes": checkpoint,
        "simulation_seconds": round(time.perf_counter() - started, 1),
        "simulation_cpu_seconds": round(time.process_time() - started_cpu, 1),  # this process's CPU time
        "engine": engine.name,
    }


@contextlib.contextmanager
def _model_input_errors(request: SimulationRequest):
    """Name the input when the first forward fails (a model that limits the sequence length, a batch it cannot
    take): the CLI prints a ``ValueError``'s message, not a traceback from inside the model. The original error
    is chained and its text kept; the device checks' ``DeviceDisciplineError`` passes unchanged."""
    try:
        yield
    except comm.DeviceDisciplineError:
        raise  # the engine's own device checks name their call site: not an input problem
    except (RuntimeError, IndexError, TypeError) as e:
        raise ValueError(
            f"simulate: the first forward failed on token ids of shape ({request.batch}, {request.seq_len}): "
            f"{type(e).__name__}: {e}. If the model limits the sequence length (a position table, a rotary "
            "cache), pass a --seq-len it accepts"
        ) from e


def _replay_allocator(trace: list, request: SimulationRequest) -> dict:
    """The CUDA caching allocator's peak reserved bytes on the simulation's allocator trace (overall and by
    phase; ``lightning_shard.simulate.allocator``), and the streams whose pools the trace used."""
    from lightning_shard.simulate.allocator import AllocatorConfig, AllocatorOutOfMemory, replay

    config = AllocatorConfig(expandable_segments=request.expandable_segments, capacity=request.device_memory)
    try:
        r = replay(trace, config)
    except AllocatorOutOfMemory as e:
        raise ValueError(f"simulate: out of memory at --device-memory {request.device_memory}: {e}") from e
    return {
        "peak_reserved_bytes": r.peak_reserved,
        "reserved_by_phase": r.reserved_by_phase,
        "allocator_segments": r.segments,
        "allocator_releases": r.releases,
        "allocator_streams": sorted({e.stream for e in trace if hasattr(e, "stream")}),
    }


def _simulate_checkpoints(
    model: nn.Module, optimizer: torch.optim.Optimizer, world, request: SimulationRequest
) -> dict:
    """A sharded and a full save and load after the steps (phases ``checkpoint_save``, ``checkpoint_load``,
    ``checkpoint_save_full``, ``checkpoint_load_full``); ``{}`` with ``checkpoint=False``."""
    if not request.checkpoint:
        return {}
    from lightning_shard.simulate.checkpoint import simulate_checkpoints

    return simulate_checkpoints(model, optimizer, world.memory)


def mesh_shape(r: SimulationRequest) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]:
    """The mesh's shape, its dimension names, and the names of the dimensions FSDP shards over."""
    dp = r.devices // r.tensor_parallel_size
    if r.sharding_strategy == "NO_SHARD":
        return (dp, 1), ("replicate", "data_parallel"), ("replicate", "data_parallel")
    if r.sharding_strategy == "HYBRID_SHARD":
        per_node = min(r.devices_per_node, dp)
        if dp % per_node:
            raise ValueError(f"simulate: HYBRID_SHARD needs --devices {dp} to be a multiple of {per_node} per node")
        return (dp // per_node, per_node), ("replicate", "data_parallel"), ("replicate", "data_parallel")
    return (dp, r.tensor_parallel_size), ("data_parallel", "tensor_parallel"), ("data_parallel",)


def _meshes(device_type: str, r: SimulationRequest):
    shape, names, fsdp_names = mesh_shape(r)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return mesh, mesh if fsdp_names == names else mesh[fsdp_names[0]]


def _parallelize(model: nn.Module, mesh, fsdp_mesh, r: SimulationRequest) -> None:
    if r.tensor_parallel_size > 1:
        from lightning_shard.tp import auto_tp_plan, parallelize_module

        plan = auto_tp_plan(
            model, mesh["tensor_parallel"], sequence_parallel=r.sequence_parallel, loss_parallel=r.loss_parallel
        )
        parallelize_module(model, mesh["tensor_parallel"], plan)
    blocks = find_repeated_blocks(model)
    checkpoint_blocks(blocks, r)
    kwargs = {
        "mesh": fsdp_mesh,
        "reshard_after_forward": r.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD"),
        "mp_policy": _POLICIES[r.precision],
        "offload_policy": CPUOffloadPolicy() if r.cpu_offload else OffloadPolicy(),
    }
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _loss(logits: torch.Tensor, tokens: torch.Tensor, r: SimulationRequest) -> torch.Tensor:
    """The step's loss on the fp32 logits: their mean, or cross-entropy as torchtitan computes it (the next
    tokens' ids are the inputs shifted; their values do not change the memory). A Hugging Face output's
    ``.logits`` are used."""
    logits = getattr(logits, "logits", logits)
    if r.loss == "mean":
        return logits.float().mean()
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten(0, 1))


def checkpoint_blocks(blocks: list[nn.Module], r: SimulationRequest, preserve_rng_state: bool = True) -> None:
    """Recompute each block's forward in backward (``r.activation_checkpointing``: every activation, or
    torchtitan's selective op policy), as torchtitan wraps each block before sharding it.
    ``preserve_rng_state=False`` for torch's engine, which is shown no device RNG (``reference._WithoutRng``);
    the RNG state holds no device memory."""
    if not r.activation_checkpointing:
        return
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    from lightning_shard.simulate.selective_ac import op_sac_context

    context = op_sac_context if r.activation_checkpointing == "selective-op" else noop_context_fn
    for block in blocks:
        block.forward = lambda *a, _f=block.forward, **k: checkpoint(
            _f, *a, use_reentrant=False, context_fn=context, preserve_rng_state=preserve_rng_state, **k
        )


def _vocab_of(model: nn.Module) -> int:
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ValueError("simulate: the model has no nn.Embedding to draw token ids for; pass --vocab-size")


ENGINE = Engine(
    "lightning_shard",
    _meshes,
    _parallelize,
    clip_grad_norm_,
    loss_parallel=loss_parallel,
    parallel_loss=replicated_loss,
)
