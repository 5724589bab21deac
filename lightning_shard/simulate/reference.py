"""``TORCH_ENGINE``: torch's own FSDP2 (``torch.distributed.fsdp.fully_shard``) and, with tensor parallelism,
torch's ``parallelize_module`` with torchtitan's Llama plan, as the reference the simulator compares the
engine with (``python -m lightning_shard.simulate ... --reference torch``).

This module is the one place of ``lightning_shard`` that imports torch's distributed training APIs; the engine
never does. Both engines run the same simulated work in the same kind of world: the same factory, mesh shape,
precision policy, units (every repeated block, then the root), steps, and memory tracker, on the same fake
stand-in accelerator. torch's FSDP2 looks up a device module ``torch.<device type>`` (streams, events, the
current device); the stand-in device has none, so ``stand_in_device_module`` provides one for the run, with
streams and events that do nothing (fake tensors have no timing; memory is counted by storage lifetime, which
torch's FSDP2 ties to the same references on CPU and CUDA). torch's ``DeviceMesh`` reads its rank map's
values, so it is built with the fake mode suspended.

Tensor parallelism (T > 1) follows torchtitan's ``apply_tp`` for Llama (``torchtitan/models/llama3/infra/
parallelize.py``): embedding row-parallel with a sequence-sharded output, norms ``SequenceParallel``, q/k/v and
the MLP's gate/up column-parallel, o and down row-parallel with sequence-sharded outputs, the LM head
column-parallel from a sequence-sharded input (``--sequence-parallel``; without it, the same plan without the
sequence sharding, like the engine's default). With ``--loss-parallel`` the head's output stays a ``Shard(-1)``
DTensor (``use_local_output=False``) and the cross-entropy and its backward run inside torch's
``loss_parallel()``, as torchtitan's; without it the head's output is replicated, as in the engine's run, so both
compute the same loss on the same logits. torchtitan's attention reshapes with ``-1`` heads; the Llama of
``tests/tp_models.py`` reads ``n_heads``/``n_kv_heads``, so those are divided by T.

Example::

    report = simulate_training(llama3_8b, SimulationRequest(devices=8), engine=TORCH_ENGINE)
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn

from lightning_shard.simulate.handle import NullEvent, NullStream

__all__ = ["TORCH_ENGINE", "compare", "stand_in_device_module", "torchtitan_llama_plan"]


class _WithoutRng:
    """The stand-in device's module without its RNG functions, for torch's engine: torch's DTensor draws random
    values through an offset-based tracker when the device module has ``set_rng_state``, which reads the state's
    values (a fake world has none); without it, random ops run on each local shard, the same memory."""

    _HIDDEN = frozenset({"get_rng_state", "set_rng_state", "manual_seed"})

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        if name in self._HIDDEN:
            raise AttributeError(name)
        return getattr(self._module, name)


@contextlib.contextmanager
def stand_in_device_module(device_type: str, device_count: int) -> Iterator[None]:
    """Give torch a ``torch.<device_type>`` module for the block, if it has none (see the module docstring).

    Example::

        with stand_in_device_module("lazy", 8):
            fully_shard(model, mesh=torch_mesh)
    """
    existing = getattr(torch, device_type, None)
    if existing is not None:  # simulated_world registered its SimDeviceModule: hide its RNG from torch's DTensor
        setattr(torch, device_type, _WithoutRng(existing))
        try:
            yield
        finally:
            setattr(torch, device_type, existing)
        return
    current = NullStream()
    module = types.ModuleType(f"torch.{device_type}")
    module.Stream, module.Event = NullStream, NullEvent
    module.current_stream = lambda device=None: current
    module.stream = lambda stream: contextlib.nullcontext()
    module.current_device = lambda: 0
    module.device_count = lambda: device_count
    module.set_device = lambda device: None
    module.is_available = lambda: True
    module.is_initialized = lambda: True
    module.synchronize = lambda device=None: None
    setattr(torch, device_type, module)
    try:
        yield
    finally:
        delattr(torch, device_type)


@contextlib.contextmanager
def host_device_meshes() -> Iterator[None]:
    """Build torch's ``DeviceMesh`` objects with the fake mode suspended inside the block: a mesh reads its rank
    map's values (host bookkeeping, never device data), which a fake tensor has not. torch's FSDP2 builds one
    more mesh (data x tensor parallel) inside ``fully_shard`` for TP parameters."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def __init__(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = __init__
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def private_sharding_propagation() -> Iterator[None]:
    """Run torch's DTensor output-metadata propagation in a fake mode of its own inside the block, as on a GPU.

    Why: torch's ``ShardingPropagator`` derives an op's output shape by running it on tensors of the *global*
    shapes in ``detect_fake_mode() or FakeTensorMode()``. On a GPU no fake mode is active, so those tensors are
    a private fake mode's and hold no memory. In the simulator ``detect_fake_mode`` finds the simulation's fake
    mode, whose memory tracker would count them as device memory: on each propagation cache miss, global-shape
    tensors a GPU never allocates (under loss parallelism the cross-entropy's forward and backward each make the
    full fp32 logits, 63 GiB for Llama 3.1 70B at 16 x 8192 tokens, where the rank holds an eighth), and peaks
    that would depend on which simulations ran before in the process."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def fake_host_pinning() -> Iterator[None]:
    """Let torch's FSDP2 pin its CPU-offloaded shards on fake tensors inside the block.

    Why: ``CPUOffloadPolicy(pin_memory=True)`` calls ``Tensor.pin_memory()`` and ``is_pinned()`` on the host
    shards, which fake tensors do not implement (``aten._pin_memory``: NYI). Here a fake host tensor's
    ``pin_memory()`` returns a host copy, what pinning allocates, remembered as pinned (weakly: the copy's life
    is its storage's), and ``is_pinned()`` answers from that; real tensors are untouched."""
    import weakref

    from torch._subclasses.fake_tensor import FakeTensor

    pinned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    original_pin, original_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned

    def pin_memory(self, *args, **kwargs):
        if not isinstance(self, FakeTensor):
            return original_pin(self, *args, **kwargs)
        copy = self.clone()
        storage = copy.untyped_storage()
        pinned[id(storage)] = storage
        return copy

    def is_pinned(self, *args, **kwargs):
        if not isinstance(self, FakeTensor):
            return original_is_pinned(self, *args, **kwargs)
        storage = self.untyped_storage()
        return pinned.get(id(storage)) is storage

    torch.Tensor.pin_memory, torch.Tensor.is_pinned = pin_memory, is_pinned
    try:
        yield
    finally:
        torch.Tensor.pin_memory, torch.Tensor.is_pinned = original_pin, original_is_pinned


@contextlib.contextmanager
def _torch_context(device_type: str, device_count: int) -> Iterator[None]:
    with (
        stand_in_device_module(device_type, device_count),
        host_device_meshes(),
        private_sharding_propagation(),
        fake_host_pinning(),
    ):
        yield


def _meshes(device_type: str, request):
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_shard.simulate.run import mesh_shape

    shape, names, fsdp_names = mesh_shape(request)
    with unset_fake_temporarily():  # the rank map is host bookkeeping (host_device_meshes)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return mesh, mesh if fsdp_names == names else mesh[fsdp_names[0]]


def torchtitan_llama_plan(model: nn.Module, sequence_parallel: bool = True, loss_parallel: bool = False) -> dict:
    """torchtitan's Llama tensor-parallel plan for the module names of ``tests/tp_models.Llama`` (torchtitan's
    wq/wk/wv/wo are q/k/v/o_proj, w1/w2/w3 are gate/down/up_proj). ``loss_parallel=True``: the LM head's logits
    stay vocabulary-sharded DTensors, for a cross-entropy inside torch's ``loss_parallel()``.

    ``sequence_parallel=False`` drops the sequence sharding (norms replicated, the embedding and the o/down
    projections reduce to replicated outputs): the plan of torch's TP tutorial without sequence parallelism,
    to compare with the engine's default plan.

    Example::

        parallelize_module(model, tp_mesh, torchtitan_llama_plan(model))
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    _check_llama(model)
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks),
        "output": ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    gather_sequence = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    for i in range(len(model.layers)):
        prefix = f"layers.{i}."
        plan.update({
            prefix + "attention.q_proj": ColwiseParallel(),
            prefix + "attention.k_proj": ColwiseParallel(),
            prefix + "attention.v_proj": ColwiseParallel(),
            prefix + "attention.o_proj": RowwiseParallel(output_layouts=between_blocks),
            prefix + "feed_forward.gate_proj": ColwiseParallel(),
            prefix + "feed_forward.down_proj": RowwiseParallel(output_layouts=between_blocks),
            prefix + "feed_forward.up_proj": ColwiseParallel(),
        })  # fmt: skip
        if sequence_parallel:
            plan.update({
                prefix + "attention_norm": SequenceParallel(),
                prefix + "attention": PrepareModuleInput(**gather_sequence),
                prefix + "ffn_norm": SequenceParallel(),
                prefix + "feed_forward": PrepareModuleInput(**gather_sequence),
            })  # fmt: skip
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


_LLAMA_NAMES = (
    "tok_embeddings",
    "norm",
    "output",
    "layers.0.attention_norm",
    "layers.0.attention.q_proj",
    "layers.0.attention.k_proj",
    "layers.0.attention.v_proj",
    "layers.0.attention.o_proj",
    "layers.0.ffn_norm",
    "layers.0.feed_forward.gate_proj",
    "layers.0.feed_forward.up_proj",
    "layers.0.feed_forward.down_proj",
)


def _check_llama(model: nn.Module) -> None:
    names = dict(model.named_modules())
    missing = [n for n in _LLAMA_NAMES if n not in names]
    if missing:
        raise ValueError(
            f"simulate: --reference torch with --tensor-parallel-size > 1 applies torchtitan's Llama plan, which "
            f"needs a Llama shaped like tests/tp_models.Llama; {type(model).__name__} has no {missing}. Run the "
            "reference without tensor parallelism, or use such a model"
        )


def _divide_heads(model: nn.Module, tp: int) -> None:
    for layer in model.layers:
        attention = layer.attention
        for attr in ("n_heads", "n_kv_heads"):
            heads = getattr(attention, attr)
            if heads % tp:
                raise ValueError(f"simulate: {attr}={heads} does not divide by --tensor-parallel-size {tp}")
            setattr(attention, attr, heads // tp)


def _parallelize(model: nn.Module, mesh, fsdp_mesh, request) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_shard.fsdp.units import find_repeated_blocks

    if request.tensor_parallel_size > 1:
        plan = torchtitan_llama_plan(model, request.sequence_parallel, request.loss_parallel)
        parallelize_module(model, mesh["tensor_parallel"], plan)
        _divide_heads(model, request.tensor_parallel_size)
    from lightning_shard.simulate.run import _POLICIES

    ours = _POLICIES[request.precision]
    reshard = request.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")  # as the engine's
    kwargs = {
        "mesh": fsdp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=ours.param_dtype, reduce_dtype=ours.reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if request.cpu_offload else OffloadPolicy(),
    }
    from lightning_shard.simulate.run import checkpoint_blocks

    blocks = find_repeated_blocks(model)
    checkpoint_blocks(blocks, request, preserve_rng_state=False)  # as the engine's run, before sharding
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root as torchtitan shards it: reshard_after_forward left to torch, which keeps the root's parameters
    # unsharded after forward (backward needs them at once), as the engine's root does; an explicit True would
    # make torch free and re-gather them.
    fully_shard(model, reshard_after_forward=None if reshard else False, **kwargs)


def _clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torchtitan's clipping: the total norm of the DTensor gradients as a full tensor, then clip with it. The
    norm is taken per mesh first (without sequence parallelism the norms' weights live on the data-parallel
    mesh only, the rest on the 2-D mesh, and DTensors of two meshes cannot meet in one op)."""
    from torch.distributed.tensor import DTensor

    parameters = list(parameters)
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def _materialize(model: nn.Module, device: torch.device, request) -> None:
    """As torchtitan materialises: on the host under CPU offload (torch's FSDP2 refuses offloaded parameters
    elsewhere and copies them to the device in each all-gather), the buffers on the device (torchtitan's
    ``buffer_device``), else everything on the device."""
    if not request.cpu_offload:
        model.to_empty(device=device)
        return
    model.to_empty(device="cpu")
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _engine():
    from lightning_shard.simulate.run import Engine

    # torchtitan calls backward on the loss DTensor itself (parallel_loss: the identity)
    return Engine(
        name="torch",
        meshes=_meshes,
        parallelize=_parallelize,
        clip_grad_norm=_clip_grad_norm,
        device_module=_torch_context,
        materialize=_materialize,
        loss_parallel=_loss_parallel,
    )


TORCH_ENGINE = _engine()


def compare(ours: dict, reference: dict) -> dict:
    """``ours`` with ``reference`` (torch's report) under ``"reference"`` and the ratios ours / torch under
    ``"ratio_to_reference"``: peak device bytes and peak reserved bytes (overall and per phase), bytes after
    setup, collectives per kind and bytes sent per step.

    Example::

        report = compare(simulate_training(f, r), simulate_training(f, r, engine=TORCH_ENGINE))
        report["ratio_to_reference"]["peak_device_bytes"]    # e.g. 0.93
    """

    def ratio(a, b):
        return round(a / b, 4) if b else None

    phases = ours["peak_by_phase"]
    ratios = {
        "peak_device_bytes": ratio(ours["peak_device_bytes"], reference["peak_device_bytes"]),
        "peak_by_phase": {p: ratio(phases[p], reference["peak_by_phase"].get(p, 0)) for p in phases},
        "peak_reserved_bytes": ratio(ours["peak_reserved_bytes"], reference["peak_reserved_bytes"]),
        "reserved_by_phase": {
            p: ratio(v, reference["reserved_by_phase"].get(p, 0)) for p, v in ours["reserved_by_phase"].items()
        },
        "device_bytes_after_setup": ratio(ours["device_bytes_after_setup"], reference["device_bytes_after_setup"]),
        "collectives_per_step": {
            kind: ratio(ours["collectives_per_step"].get(kind, 0), reference["collectives_per_step"].get(kind, 0))
            for kind in sorted(set(ours["collectives_per_step"]) | set(reference["collectives_per_step"]))
        },
        "comm_bytes_per_step": ratio(ours["comm_bytes_per_step"], reference["comm_bytes_per_step"]),
        "simulation_seconds": ratio(ours["simulation_seconds"], reference["simulation_seconds"]),
        "simulation_cpu_seconds": ratio(ours["simulation_cpu_seconds"], reference["simulation_cpu_seconds"]),
    }
    return {**ours, "reference": reference, "ratio_to_reference": ratios}
