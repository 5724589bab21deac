"""Measure on a real run what ``estimate`` predicts: the check of the planner (tests, benchmark, users).

``measure_step`` shards a real model on a ``(dp, tp)`` mesh exactly as the strategy does (auto TP plan,
then ``fully_shard`` on every block and the root), runs one training step and counts, on this rank:

* parameters / gradients: ``nbytes`` of every group's ``shard_flat`` / ``grad_flat`` storage;
* optimizer state: ``nbytes`` of the local storages of every optimizer state tensor (DTensors unwrapped);
* activations: distinct storages saved for backward during forward and the loss (``SavedTensorCounter``,
  parameters' sharded and unsharded flat buffers and buffers excluded), the same counter the planner runs
  on the meta device;
* communication: ``lightning_shard.comm.count_collectives()`` over forward + backward;
* reduce-scatter staging: the most bytes of staging buffers (and separate reduce-scatter outputs) alive at
  once, tracked by weak references to what ``collectives.start_reduce_scatter`` returns;
* buffers: ``nbytes`` of the model's registered buffers on this rank;
* on CUDA also ``torch.cuda.max_memory_allocated`` over the step.

Must be called on every rank of an initialised process group. Example::

    measured = measure_step(lambda: MyModel(), (2, 1), precision="32-true", batch=4, seq_len=16)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import comm
from lightning_shard.fsdp import FSDPModule, MixedPrecisionPolicy, collectives, fully_shard
from lightning_shard.mesh import init_device_mesh
from lightning_shard.planner.estimate import (
    SavedTensorCounter,
    _default_input,
    _default_loss,
    find_blocks,
    precision_dtypes,
    tp_plan_for,
)

__all__ = ["measure_step"]


def _storage_bytes(t: torch.Tensor) -> int:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.untyped_storage().nbytes()


@contextlib.contextmanager
def track_reduce_scatter_staging():
    """Yields a dict whose ``"peak"`` becomes the most bytes of reduce-scatter staging alive at once.

    Each ``start_reduce_scatter`` allocates a staging buffer (its views, e.g. a reduced chunk left in place,
    keep it alive) and maybe a separate output. Both are held weakly; at each new start the bytes of those
    still alive are summed, so a buffer the engine frees early is not counted.
    """
    live: list[tuple[weakref.ref, int]] = []
    result = {"peak": 0, "max_alive_groups": 0}
    original = collectives.start_reduce_scatter

    def tracked(*args, **kwargs):
        handle = original(*args, **kwargs)
        staged = handle.input
        for t in {id(staged): staged, id(handle.output): handle.output}.values():
            base = t if t._base is None else t._base
            if any(ref() is base for ref, _ in live):
                continue
            is_output_buffer = t is handle.output and kwargs.get("output") is t  # the gradient buffer itself
            if not is_output_buffer:
                live.append((weakref.ref(base), base.untyped_storage().nbytes()))
        live[:] = [(r, n) for r, n in live if r() is not None]
        result["peak"] = max(result["peak"], sum(n for _, n in live))
        result["max_alive_groups"] = max(result["max_alive_groups"], sum(1 for r, _ in live if r() is not None))
        return handle

    collectives.start_reduce_scatter = tracked
    try:
        yield result
    finally:
        collectives.start_reduce_scatter = original


def measure_step(
    model_factory: Callable[[], nn.Module],
    mesh_shape: tuple[int, int],
    *,
    precision: str = "32-true",
    batch: int,
    seq_len: int,
    optimizer: str = "adamw",
    reshard_after_forward: bool = True,
    example_input: Callable | None = None,
    loss_fn: Callable | None = None,
    device: str = "cpu",
) -> dict[str, int]:
    """One sharded training step; returns this rank's measured bytes per term (see the module docstring)."""
    dp, tp = mesh_shape
    if dp * tp != dist.get_world_size():
        raise ValueError(f"measure_step: mesh {mesh_shape} needs {dp * tp} ranks, have {dist.get_world_size()}")
    master, compute, reduce = precision_dtypes(precision)
    torch.manual_seed(0)
    model = model_factory().to(device=device, dtype=master)
    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    if tp > 1:
        from lightning_shard.tp import parallelize_module

        parallelize_module(model, mesh["tensor_parallel"], tp_plan_for(model, tp))
    mp = MixedPrecisionPolicy(
        param_dtype=compute if compute != master else None, reduce_dtype=reduce if reduce != compute else None
    )
    for block in find_blocks(model):
        fully_shard(block, mesh=mesh["data_parallel"], mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh["data_parallel"], mp_policy=mp, reshard_after_forward=reshard_after_forward)
    groups = []
    for m in model.modules():
        g = m._fsdp_state.group if isinstance(m, FSDPModule) else None
        if g is not None and g not in groups:
            groups.append(g)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer.lower() == "sgd":
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    elif optimizer.lower() in ("adam", "adamw"):
        opt = torch.optim.AdamW(params, lr=1e-3)
    else:
        opt = torch.optim.SGD(params, lr=1e-3)

    dp_rank = mesh.get_local_rank("data_parallel")
    gen_state = torch.get_rng_state()
    torch.manual_seed(1000 + dp_rank)  # the ranks of one TP group see the same micro-batch
    make_input = example_input or (lambda b, t, d: _default_input(model, b, t, d))
    inputs = make_input(batch, seq_len, torch.device(device))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    torch.set_rng_state(gen_state)

    exclude = {g.unsharded_flat.untyped_storage()._cdata for g in groups}
    exclude |= {g.shard_flat.untyped_storage()._cdata for g in groups}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    with comm.count_collectives() as counts, track_reduce_scatter_staging() as staging:
        with SavedTensorCounter(model, exclude) as saved:
            loss = (loss_fn or _default_loss)(model(*inputs))
        loss.backward()
    activations = saved.total
    del loss
    opt.step()
    out = {
        "params": sum(g.shard_flat.untyped_storage().nbytes() for g in groups),
        "grads": sum(g.grad_flat.untyped_storage().nbytes() for g in groups if g.grad_flat is not None),
        "optimizer": sum(
            _storage_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ),
        "activations": activations,
        "comm_all_gather": counts.bytes["all_gather"],
        "comm_reduce_scatter": counts.bytes["reduce_scatter"],
        "comm_all_reduce": counts.bytes["all_reduce"],
        "comm_total": sum(counts.bytes.values()),
        "reduce_scatter_staging": staging["peak"],
        "buffers": sum(b.untyped_storage().nbytes() for b in {id(b): b for b in model.buffers()}.values()),
    }
    if device == "cuda":
        out["cuda_peak_step"] = torch.cuda.max_memory_allocated() - base
    return out
