"""``__torch_dispatch__`` for DTensor: check arguments, apply the op's sharding rule, run on local shards.

Flow for one op: (1) find the DTensor arguments and check they share one mesh and that any plain tensor is
a scalar; (2) ask the op's rule (``ops/``) for a plan; (3) redistribute inputs to the plan's placements;
(4) run the op on meta tensors with the global shapes to learn the outputs' global shapes and strides;
(5) run the op on the local shards and wrap the results as DTensors.

Steps (1), (2) and (4) depend only on the op, the arguments' specs and the non-tensor arguments, so their
outcome is cached per such key (``_decisions.py``, as torch's sharding propagator caches per ``OpSchema``): a
repeated op goes straight to (3) and (5).

Ops without a rule go to the replicate fallback (``fallback.py``): computed on replicated inputs, counted in
``fallback_counts()`` and warned about once per op, or refused under ``fallback_policy("error")``.

Example::

    reset_fallback_counts()
    loss = model(x).sum()
    assert fallback_counts() == {}
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from lightning_shard.tensor._decisions import (
    _DECISIONS,
    _STATS,
    Decision,
    _remember,
    clear_dispatch_cache,
    decision_key,
    dispatch_cache_info,
)
from lightning_shard.tensor._submesh import align_meshes, target_mesh
from lightning_shard.tensor.backward_plain import in_backward, same_on_every_rank
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.fallback import fallback_counts, reset_fallback_counts, run_fallback
from lightning_shard.tensor.implicit import implicit_replication_enabled
from lightning_shard.tensor.ops import _view_copies as view_copies
from lightning_shard.tensor.ops import load_rules
from lightning_shard.tensor.ops._registry import OpCall, Plan, find_rule, is_inplace
from lightning_shard.tensor.placements import Replicate
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

__all__ = ["dispatch", "fallback_counts", "reset_fallback_counts", "dispatch_cache_info", "clear_dispatch_cache"]

_CUSTOM: dict = {}  # ops handled end to end by a function (random ops, _foreach_*, in-place views, ...)


def register_custom(*ops):
    """Register a function ``handler(func, args, kwargs)`` that handles ``ops`` entirely."""

    def deco(fn):
        for op in ops:
            swap_custom(op, fn)
        return fn

    return deco


def swap_custom(op, handler):
    """Make ``handler`` (or nothing, for ``None``) the custom handler of the overload ``op`` and return the entry
    it replaces, for a context that installs handlers for a while (``loss_parallel``). Dispatch looks handlers
    up through a per-op cache, so every change goes through here: a bare ``_CUSTOM[op] = ...`` would leave ops
    dispatched before on their old handler.

    Example::

        previous = swap_custom(aten.nll_loss_forward.default, my_handler)
        ...
        swap_custom(aten.nll_loss_forward.default, previous)
    """
    previous = _CUSTOM.get(op)
    if handler is None:
        _CUSTOM.pop(op, None)
    else:
        _CUSTOM[op] = handler
    _custom_handler.cache_clear()
    return previous


@functools.cache
def _custom_handler(func):
    return _CUSTOM.get(func) or _CUSTOM.get(func.overloadpacket)


def dispatch(func, args: tuple, kwargs: dict):
    load_rules()
    if view_copies.LIVE:  # a view result that is a copy is alive: refuse writes into it, reads once stale
        view_copies.check(func, args, kwargs)
    handler = _custom_handler(func)
    if handler is not None:
        return handler(func, args, kwargs)
    return dispatch_by_rule(func, args, kwargs)


def dispatch_by_rule(func, args: tuple, kwargs: dict):
    """What ``dispatch`` does for an op with no custom handler: the same-layout pointwise fast path, a cached
    decision, or the op's rule (the fallback without one). A custom handler that declines an op calls it
    (``loss_parallel``'s handler of ``aten.add.Tensor`` declines nearly every add of a training step).

    Example: ``dispatch_by_rule(aten.add.Tensor, (a, b), {})`` for DTensors ``a`` and ``b``.
    """
    fast = _same_layout_pointwise(func, args, kwargs)
    if fast is not None:
        return fast
    if _decomposes_here(func):
        return func.decompose(*args, **kwargs)
    key, dtensors = decision_key(func, args, kwargs)
    decision = _DECISIONS.get(key) if key is not None else None
    if decision is not None:
        _STATS[0] += 1
        out = decision.run(func, args, kwargs, dtensors)
    else:
        _STATS[1] += key is not None
        out = _decide_and_run(func, args, kwargs, key, dtensors)
    if view_copies.is_view_op(func):  # cached or not: a view result that is a copy must be recorded
        view_copies.note_view(func, args, out)
    return out


@functools.cache
def _decomposes_here(func) -> bool:
    """True for an op without a rule that has a composite (``CompositeImplicitAutograd``) decomposition.

    Why: such ops are decomposed before they reach a tensor subclass, except under ``torch.inference_mode()``
    (Lightning's default for validate, test and predict), where the autograd keys are skipped and ``aten.linear``,
    ``aten.cross_entropy_loss``, ... arrive whole. Their decompositions run on the ops that have rules: without
    this, ``F.cross_entropy`` on loss-parallel logits raised (its plain target met the sharded logits in the
    fallback), and every ``linear`` gathered its inputs to run replicated."""
    if find_rule(func) is not None:
        return False
    return func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


def _decide_and_run(func, args: tuple, kwargs: dict, key, dtensors: list):
    """Run the op's rule (or the fallback) and remember the decision under ``key`` when it can be reused."""
    call = make_call(func, args, kwargs)
    rule = find_rule(func)
    try:
        plan = rule(call) if rule is not None else None
        meta_out = _run_on_meta(func, call) if plan is not None else None
    except NotImplementedError:
        # No meta kernel: the rule (or the dispatcher) cannot learn the output shapes; the fallback needs none
        # (its outputs are replicated, so local shapes are global ones).
        plan = meta_out = None
    decision = Decision.build(call, plan, meta_out) if key is not None else None
    if decision is None:
        if plan is None:
            return run_fallback(func, call.args, call.kwargs)
        return run_plan(call, plan, meta_out)
    _remember(key, decision)
    return decision.run(func, args, kwargs, dtensors)


_OUT_OF_PLACE, _IN_PLACE = 1, 2


@functools.cache
def _pointwise_kind(func) -> int:
    """0 if ``func`` cannot take the fast path below, else whether it is out of place or in place (cached per op:
    reading an op's tags and schema costs more than the fast path itself)."""
    if torch.Tag.pointwise not in func.tags or torch.Tag.nondeterministic_seeded in func.tags:
        return 0
    return _IN_PLACE if is_inplace(func) else _OUT_OF_PLACE


def _same_layout_pointwise(func, args: tuple, kwargs: dict):
    """Fast path for the optimizer's hot loop: a pointwise op whose DTensor arguments all share one spec
    (same shape and placements, no Partial) and whose other arguments are Python scalars or 0-dim tensors.
    The result has the same layout, so no rule, redistribution or meta run is needed.

    It runs once per optimizer op per parameter (AdamW on CPU: ~10 per parameter per step), so it is kept
    lean: identity checks before equality ones, and an out-of-place result shares its input's spec."""
    kind = _pointwise_kind(func)
    if not kind:
        return None
    if kwargs and (
        kwargs.get("memory_format", torch.preserve_format) != torch.preserve_format
        or any(isinstance(v, torch.Tensor) for v in kwargs.values())
    ):
        return None  # e.g. clone(memory_format=contiguous_format): the output strides differ from the input's
    spec = None
    local_args = []
    for a in args:
        if isinstance(a, DTensor):
            s = a._spec
            if spec is None:
                spec = s
                if s.has_partial() or not s.is_dense:
                    return None  # a non-dense input (expanded, sliced) gets a differently strided output
            elif s is not spec and (
                s.placements != spec.placements
                or s.shape != spec.shape
                or s.stride != spec.stride
                or (s.mesh is not spec.mesh and s.mesh != spec.mesh)  # identity first: DeviceMesh.__eq__ is slow
            ):
                return None
            local_args.append(a._local_tensor)
        elif isinstance(a, torch.Tensor) and a.ndim > 0 or isinstance(a, (list, tuple)):
            return None
        else:
            local_args.append(a)
    if spec is None:
        return None
    out = func(*local_args, **kwargs)
    if kind == _IN_PLACE:
        return args[0]
    if isinstance(out, tuple):  # frexp: (mantissa, exponent), each laid out like the input
        return tuple(_like(o, spec) for o in out)
    return _like(out, spec)


def _like(out: torch.Tensor, spec: DTensorSpec) -> DTensor:
    if out.dtype != spec.dtype:
        spec = DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride, out.dtype)
    return DTensor(out, spec, requires_grad=False)


#: Explanations of the mixing error that only a layer above this one can give (the tensor layer imports none of
#: them): each takes the DTensor arguments' specs and returns a sentence, or "" when its context does not apply.
#: ``lightning_shard.tp.loss`` registers one for the vocabulary-sharded logits inside ``loss_parallel()``.
_MIXING_HINTS: list[Callable[[list[DTensorSpec]], str]] = []


def register_mixing_hint(hint: Callable[[list[DTensorSpec]], str]) -> None:
    """Add ``hint`` to the explanations tried when a plain tensor meets DTensor arguments (once per function)."""
    if hint not in _MIXING_HINTS:
        _MIXING_HINTS.append(hint)


def _context_hint(specs: list[DTensorSpec]) -> str:
    return next((text for text in (hint(specs) for hint in _MIXING_HINTS) if text), "")


def _sharded_over_data_parallel(specs: list[DTensorSpec]) -> bool:
    for spec in specs:
        names = spec.mesh.mesh_dim_names or ()
        if any(n == "data_parallel" and p.is_shard() for n, p in zip(names, spec.placements)):
            return True
    return False


def _backward_hint(specs: list[DTensorSpec]) -> str:
    """For the mixing error inside a backward pass. A parameter still sharded by ``fully_shard`` there was used
    by a forward that runs again inside the backward: a custom ``autograd.Function`` whose backward recomputes
    its layers (reversible layers) calls them where their unit's hooks do not gather them. Said first, because
    the plain tensor then is an activation, which differs per rank for the ordinary reason."""
    if _sharded_over_data_parallel(specs):
        return (
            "; inside a backward pass, a DTensor sharded over 'data_parallel' is usually a parameter still sharded "
            "by fully_shard, used by a forward that runs again inside the backward: a custom autograd.Function "
            "whose backward recomputes its layers (e.g. the reversible layers of Hugging Face's Reformer, "
            "ReformerLayer.backward_pass) calls them where the hooks of their fully_shard unit do not gather "
            "them. Make the module that calls that Function the unit instead of its layers (for Reformer "
            "fsdp_unit={ReformerEncoder}; or fully_shard that module): its parameters stay gathered until its "
            "backward has run"
        )
    return "; inside a backward pass it is taken as replicated only when it is the same on every rank, and it differs"


def _fsdp_hint(specs: list[DTensorSpec]) -> str:
    """For the mixing error: a DTensor sharded over a ``data_parallel`` mesh dim met by a plain activation is,
    in practice, a parameter that ``fully_shard`` never all-gathered because its module ran outside its unit."""
    if not _sharded_over_data_parallel(specs):
        return ""
    return (
        ". A DTensor sharded over 'data_parallel' here is usually a parameter still sharded by fully_shard: "
        "its module ran outside the forward of its fully_shard unit, whose hooks all-gather it (e.g. "
        "checkpoint_sequential over a fully_shard-ed nn.Sequential calls its children directly, as does a "
        "forward calling a child of another unit; a forward reading another unit's parameter itself, e.g. "
        "F.linear(h, self.block.proj.weight) or self.block.norm.weight, meets it sharded whenever that "
        "unit is not inside its own forward; or a submodule of a Lightning module called directly "
        "after fit: under Trainer(strategy='shard_fsdp_tp') the LightningModule is the root unit). Call the "
        "unit itself, fully_shard the children, or all-gather the unit's parameters around the direct "
        "call: module.unshard(), then module.reshard() (module: the unit, e.g. the LightningModule); for "
        "a parameter read outside its module, keep the reader and the owner in one unit (fsdp_unit)"
    )


def _full_copy_hint(func, flat: list, plain: torch.Tensor) -> str:
    """For the mixing error of ``dtensor.copy_(plain)`` with the plain tensor of the DTensor's global shape: a
    full value written into a sharded parameter (``p.data.copy_(full)``, or ``module.load_state_dict(full_sd)``
    on a sharded model, which copies each value in). Each rank could hold a different ``plain``, so it is not
    taken as replicated; name the calls that say so."""
    if func is not torch.ops.aten.copy_.default or not isinstance(flat[0], DTensor) or plain.shape != flat[0].shape:
        return ""
    return (
        ". This copies a full (unsharded) tensor into a DTensor (p.copy_(full), or module.load_state_dict() of a "
        "full state dict on a sharded model). Distribute the value first: p.copy_(distribute_tensor(full, "
        "p.device_mesh, p.placements)); for a whole state dict call "
        "lightning_shard.checkpoint.set_model_state_dict(model, state_dict) on every rank (full tensors are "
        "cut to each shard; keys, shapes and dtypes checked before anything is written)"
    )


def _global_shape_hint(flat: list, positions: list[int], plain: torch.Tensor) -> str:
    """For the mixing error with a plain tensor of the global shape of a sharded DTensor argument: it was built
    from that shape (``p.grad += torch.randn(p.shape) * s`` for gradient noise, ``torch.zeros(p.shape)``), so
    every rank holds a whole tensor where the DTensor holds a part. The fully_shard hint would blame a forward."""
    sharded = [
        flat[i] for i in positions if flat[i].shape == plain.shape and flat[i]._local_tensor.shape != plain.shape
    ]
    if not sharded:
        return ""
    return (
        ". Its shape is the global shape of a sharded DTensor argument: build it from the DTensor instead "
        "(torch.randn_like(x), torch.zeros_like(x), x.new_full(...)), which gives each rank its part (random "
        "ones drawn as one device draws them), or distribute a full value with distribute_tensor(value, "
        "x.device_mesh, x.placements)"
    )


def _optimizer_hint() -> str:
    """For the mixing error raised inside an optimizer's ``step()``: name the optimizer and the fix. The plain
    tensor there is the optimizer's own (state built with ``torch.zeros(p.shape)``, as transformers' Adafactor
    does), not an activation, so the fully_shard hint would mislead. Walks the stack only when raising.

    A module's forward or an autograd backward nearer to the op than the ``step`` frame means the op belongs to
    the model, not to the optimizer: Lightning runs the whole training step (forward and backward) in a closure
    inside ``optimizer.step(closure)``, and the hint blamed the optimizer's state for a model's mixing."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) or frame.f_code.co_name == "_engine_run_backward":
            # A module's forward or the backward inside step(): the closure (Lightning runs every training_step
            # in one), whose plain tensors are activations and gradients, not the optimizer's state.
            return ""
        if frame.f_code.co_name == "step" and isinstance(owner, torch.optim.Optimizer):
            name = f"{type(owner).__module__}.{type(owner).__qualname__}"
            return (
                f". This happened inside {name}.step(): the optimizer built a plain tensor (optimizer state from "
                "torch.zeros(p.shape) or similar, of the parameter's full shape) and combined it with a sharded "
                "parameter or gradient; each rank holds only its shard of those. Build such state with "
                "torch.zeros_like(p) or p.new_zeros(...) (a DTensor sharded like p), or use an optimizer that "
                "does (for transformers' Adafactor: torch.optim.Adafactor)"
            )
        frame = frame.f_back
    return ""


def make_call(func, args: tuple, kwargs: dict) -> OpCall:
    """Collect the DTensor arguments of one op call and check them (same mesh, no non-scalar plain tensor)."""
    flat, tree = pytree.tree_flatten((args, kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, DTensor)]
    specs = [flat[i]._spec for i in positions]
    mesh = specs[0].mesh
    promoted = False
    if any(s.mesh != mesh for s in specs[1:]):
        mesh = target_mesh([s.mesh for s in specs], is_inplace(func))
        if not align_meshes(flat, positions, mesh):  # a sub-mesh and a mesh containing it (FSDP over TP)
            other = next(s.mesh for s in specs if s.mesh != mesh)
            raise RuntimeError(
                f"{func}: DTensor arguments live on different meshes ({mesh} and {other}); "
                "redistribute them onto one mesh first" + _fsdp_hint(specs)
            )
        promoted = True
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim > 0:
            if a.numel() != 1 and not implicit_replication_enabled() and not _formula_tensor(a, mesh):
                raise RuntimeError(
                    f"{func}: got a plain torch.Tensor of shape {tuple(a.shape)} mixed with DTensor arguments "
                    f"(placements {[list(s.placements) for s in specs]}); convert it with distribute_tensor() or "
                    "DTensor.from_local() first (only tensors of one element may be mixed)"
                    + (
                        (in_backward() and _backward_hint(specs))
                        or _full_copy_hint(func, flat, a)
                        or _optimizer_hint()
                        or _global_shape_hint(flat, positions, a)
                        or _fsdp_hint(specs)
                        or _context_hint(specs)
                    )
                )
            # One element: a scalar-like operand every rank holds (as torch's DTensor takes it): Replicate. Under
            # implicit_replication() the caller promises the same of a larger plain tensor.
            flat[i] = DTensor(
                a, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, a.shape, a.stride(), a.dtype), requires_grad=False
            )
            promoted = True
    if promoted:
        args, kwargs = pytree.tree_unflatten(flat, tree)
        positions = [i for i, a in enumerate(flat) if isinstance(a, DTensor)]
        specs = [flat[i]._spec for i in positions]
    return OpCall(func, args, kwargs, flat, positions, specs, mesh)


def _formula_tensor(a: torch.Tensor, mesh) -> bool:
    """A plain tensor a derivative formula built from a DTensor's global sizes (``at::zeros(self.sizes())``):
    inside a backward pass, taken as Replicate once it is confirmed the same on every rank (backward_plain.py)."""
    return in_backward() and same_on_every_rank(a, mesh)


def run_plan(call: OpCall, plan: Plan, meta_out=None):
    """Redistribute inputs as planned, run the op on local shards, wrap outputs as DTensors."""
    func = call.func
    inplace = is_inplace(func)
    src_args, src_kwargs = plan.local_args if plan.local_args is not None else (call.args, call.kwargs)
    flat, tree = pytree.tree_flatten((src_args, src_kwargs))
    dt_positions = [i for i, a in enumerate(flat) if isinstance(a, DTensor)]
    if len(dt_positions) != len(plan.inputs):
        raise AssertionError(f"{func}: rule planned {len(plan.inputs)} inputs for {len(dt_positions)} DTensors")
    local_flat = list(flat)
    for pos, want in zip(dt_positions, plan.inputs):
        t: DTensor = flat[pos]
        if inplace and pos == dt_positions[0] and tuple(want) != t.placements:
            raise RuntimeError(
                f"{func}: the in-place op would need its DTensor argument redistributed from "
                f"{list(t.placements)} to {list(want)}; redistribute it first (x = x.redistribute(...))"
            )
        local_flat[pos] = redistribute_local(t._local_tensor, t._spec, want)
    local_args, local_kwargs = pytree.tree_unflatten(local_flat, tree)
    if meta_out is None and not inplace:
        meta_out = _run_on_meta(func, call)
    local_out = func(*local_args, **local_kwargs)
    if inplace:
        return call.args[0]
    return wrap_outputs(local_out, meta_out, plan.outputs, call.mesh)


def wrap_outputs(local_out, meta_out, out_placements, mesh):
    """Wrap each tensor in ``local_out`` as a DTensor with the matching meta shape and planned placements."""
    flat_local, tree = pytree.tree_flatten(local_out)
    flat_meta, _ = pytree.tree_flatten(meta_out)
    wrapped, k = [], 0
    for loc, meta in zip(flat_local, flat_meta):
        if isinstance(loc, torch.Tensor):
            placements = out_placements[k]
            k += 1
            if placements is None:
                wrapped.append(loc)
                continue
            spec = DTensorSpec(mesh, tuple(placements), meta.shape, tuple(meta.stride()), meta.dtype)
            wrapped.append(DTensor(loc, spec, requires_grad=False))
        else:
            wrapped.append(loc)
    return pytree.tree_unflatten(wrapped, tree)


def _to_meta(a):
    if isinstance(a, DTensor):
        s = a._spec
        return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
    return a


def _run_on_meta(func, call: OpCall):
    args, kwargs = pytree.tree_map(_to_meta, (call.args, call.kwargs))
    if kwargs.get("device") is not None:
        kwargs = {**kwargs, "device": "meta"}  # x.to("cpu", copy=True) must not copy out of the meta tensor
    return func(*args, **kwargs)


def _fallback(call: OpCall):
    """The replicate fallback for an already collected call (kept for callers outside ``lightning_shard.tensor``)."""
    return run_fallback(call.func, call.args, call.kwargs)
