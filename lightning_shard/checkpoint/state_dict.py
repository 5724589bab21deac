"""Model and optimizer state dicts keyed by parameter FQN, sharded (our DTensors) or full (plain tensors).

The keys are those of ``model.state_dict()`` on the unsharded model (FSDP and TP do not rename anything), so a
sharded state dict of one mesh, a full state dict, torch FSDP2's ``get_state_dict`` and a plain model's
``state_dict()`` all use the same names. The optimizer state is ``{"state": {fqn: {...}}, "param_groups":
[{..., "params": [fqn, ...]}]}``, exactly torch's ``get_optimizer_state_dict`` format.

Example::

    msd = get_model_state_dict(model)                       # {fqn: DTensor (sharded) or Tensor (buffers)}
    osd = get_optimizer_state_dict(model, optim)
    set_model_state_dict(model, msd); set_optimizer_state_dict(model, optim, osd)
    full = get_model_state_dict(model, full_state_dict=True, cpu_offload=True)   # rank 0 only
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.nn.modules.module import _IncompatibleKeys

from lightning_shard import comm
from lightning_shard.checkpoint._interop import from_torch
from lightning_shard.checkpoint._validate import Problems, castable, describe
from lightning_shard.device import same_storage
from lightning_shard.tensor import DTensor

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "check_optimizer_state_dict",
]

_STATE, _PG, _PARAMS = "state", "param_groups", "params"


# ------------------------------------------------------------------------------------------------ helpers
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _keep_full(cpu_offload: bool) -> bool:
    """torch's StateDictOptions rule: full + cpu_offload keeps the full tensors on rank 0 only."""
    return not cpu_offload or _rank() == 0


def _export(
    value: torch.Tensor, full: bool, cpu_offload: bool, cache: dict[int, torch.Tensor | None], keep: bool = True
) -> torch.Tensor | None:
    """One state tensor in the requested form. ``cache`` gathers a tied tensor once. ``keep=False`` (the ranks
    that return ``{}`` from a full, offloaded state dict): the gather still runs, as every rank must join it,
    but the result is dropped at once (``None``), so those ranks never hold the model on the host."""
    if id(value) in cache:
        return cache[id(value)]
    with torch.no_grad():
        if isinstance(value, TorchDTensor):
            value = from_torch(value)
        if isinstance(value, DTensor):
            if full:
                with comm.host_collectives_for(value):  # CPU-offloaded shards are gathered on the host
                    out = value.full_tensor()  # one parameter at a time: peak extra memory ~ this tensor
            else:
                local = value._local_tensor.detach()
                if cpu_offload:
                    local = local.cpu()
                out = DTensor(local, value._spec, requires_grad=False)
        else:
            out = value.detach()
        if cpu_offload and not isinstance(out, DTensor):
            out = out.cpu()
    if not keep:
        out = None
    cache[id(value)] = out
    return out


def _global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)  # our and torch's DTensors report the global shape


def _local_part(full: torch.Tensor, target: DTensor) -> torch.Tensor:
    """This rank's shard of ``full`` in ``target``'s layout (nested torch.chunk shards are contiguous ranges)."""
    spec = target._spec
    out = full
    for d, (off, size) in enumerate(zip(spec.local_offset, spec.local_shape)):
        out = out.narrow(d, off, size)
    return out


def _as_ours(value: torch.Tensor) -> torch.Tensor:
    return from_torch(value) if isinstance(value, TorchDTensor) else value


def _check_tensor(problems: Problems, key: str, value: Any, target: torch.Tensor) -> bool:
    """Record why ``value`` cannot be copied into ``target``; True when it can."""
    if not isinstance(value, torch.Tensor):
        problems.mismatch(key, describe(target.shape, target.dtype), f"a {type(value).__name__}")
        return False
    if _global_shape(value) != _global_shape(target):
        problems.mismatch(key, describe(target.shape, target.dtype), describe(value.shape, value.dtype))
        return False
    if not castable(value.dtype, target.dtype):
        problems.dtype(key, target.dtype, value.dtype)
        return False
    value = _as_ours(value)
    if isinstance(value, DTensor) and isinstance(target, DTensor) and value.device_mesh != target.device_mesh:
        problems.mismatch(
            key,
            f"a tensor on mesh {target.device_mesh} or a full tensor",
            f"a DTensor on mesh {value.device_mesh} (load from a DCP directory to reshard between meshes)",
        )
        return False
    return True


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` starts where ``b`` does (a state dict loaded into the model it came from): by storage
    identity, not data pointer, which is null for every fake tensor of the simulator."""
    return same_storage(a, b) and a.storage_offset() == b.storage_offset()


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` (full tensor or DTensor) into ``target`` in place, keeping ``target``'s layout."""
    value = _as_ours(value)
    if isinstance(target, DTensor):
        local = target._local_tensor
        if isinstance(value, DTensor):
            if value.placements != target.placements:
                value = value.redistribute(target.device_mesh, target.placements)
            src = value._local_tensor
        else:
            src = _local_part(value, target)
        if not _same_memory(src, local):
            local.copy_(src)
    else:
        if isinstance(value, DTensor):
            with comm.host_collectives_for(value):
                src = value.full_tensor()
        else:
            src = value
        if not _same_memory(src, target):
            target.copy_(src)


# ------------------------------------------------------------------------------------------------ model
def get_model_state_dict(
    model: nn.Module, *, full_state_dict: bool = False, cpu_offload: bool = False
) -> dict[str, torch.Tensor]:
    """``model``'s parameters and persistent buffers by FQN.

    Sharded (default): each DTensor parameter as our DTensor sharing the parameter's local storage (loading
    into it, e.g. with :func:`lightning_shard.checkpoint.load`, writes the parameter), plain tensors detached.
    ``full_state_dict=True``: plain full tensors, all-gathered one parameter at a time (collective: every rank
    must call it; peak extra memory ~ the largest parameter). ``cpu_offload=True`` moves the values to CPU;
    with ``full_state_dict=True`` only rank 0 keeps them and other ranks get ``{}`` (torch's rule), so rank 0's
    host memory holds the model while no rank's device holds more than one extra parameter.
    Tied parameters appear under each of their names (as in ``model.state_dict()``) and are gathered once.

    Example::

        sd = get_model_state_dict(model, full_state_dict=True, cpu_offload=True)
        if dist.get_rank() == 0:
            torch.save(sd, "model.pt")

    >>> from lightning_shard.fsdp import fully_shard
    >>> model = fully_shard(nn.Linear(4, 2))
    >>> {k: (type(v).__name__, tuple(v.shape)) for k, v in get_model_state_dict(model, full_state_dict=True).items()}
    {'weight': ('Tensor', (2, 4)), 'bias': ('Tensor', (2,))}
    >>> type(get_model_state_dict(model)["weight"]).__name__   # sharded: the parameters' DTensors
    'DTensor'
    """
    keep = not full_state_dict or _keep_full(cpu_offload)
    cache: dict[int, torch.Tensor | None] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            out[key] = value  # _extra_state
            continue
        t = _export(value, full_state_dict, cpu_offload, cache, keep)
        if keep:
            out[key] = t
    return out


def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load ``state_dict`` (sharded or full form, or a mix) into ``model`` in place, all-or-nothing.

    Every key, shape and dtype is checked first; on any problem a ``ValueError`` lists the first offending keys
    and no parameter is touched. Full tensors are cut to each parameter's shard; DTensors on the parameter's
    mesh are redistributed to its placements if needed. Values are copied into the existing local tensors
    (FSDP's flat shard buffers stay intact). ``strict=False`` skips missing and unexpected keys.

    Example::

        set_model_state_dict(model, torch.load("model.pt", weights_only=True))
    """
    targets = model.state_dict(keep_vars=True)
    problems = Problems("set_model_state_dict")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"set_model_state_dict: state_dict must be a mapping of FQN to tensor, got {type(state_dict)}")
    state_dict, hooks_said = _run_load_pre_hooks(model, state_dict, strict)
    for message in hooks_said.error_msgs:
        problems.add(message)
    if strict:
        problems.missing([k for k in targets if k not in state_dict] + hooks_said.missing_keys)
        problems.unexpected([k for k in state_dict if k not in targets] + hooks_said.unexpected_keys)
    matched = 0
    for key, target in targets.items():
        if key in state_dict and isinstance(target, torch.Tensor):
            matched += _check_tensor(problems, key, state_dict[key], target)
    problems.raise_if_any(n_expected=len(targets), n_matched=matched)
    with torch.no_grad():
        for key, target in targets.items():
            if key not in state_dict:
                continue
            if isinstance(target, torch.Tensor):
                _copy_into(target, state_dict[key])
            else:
                _set_extra_state(model, key, state_dict[key])
    missing = [k for k in targets if k not in state_dict]
    _run_load_post_hooks(model, missing, [k for k in state_dict if k not in targets])


@dataclasses.dataclass
class _PreHookReport:
    """What the load pre-hooks added to ``load_state_dict``'s lists (torch's hooks may append to them)."""

    missing_keys: list[str] = dataclasses.field(default_factory=list)
    unexpected_keys: list[str] = dataclasses.field(default_factory=list)
    error_msgs: list[str] = dataclasses.field(default_factory=list)


def _run_load_pre_hooks(
    model: nn.Module, state_dict: Mapping[str, Any], strict: bool
) -> tuple[dict[str, Any], _PreHookReport]:
    """``state_dict`` after the modules' load pre-hooks (``register_load_state_dict_pre_hook``,
    ``_register_load_state_dict_pre_hook``), run as ``model.load_state_dict`` runs them: parents first, each on
    a copy holding the keys under its module's prefix, after its parents' hooks changed them. They rewrite old
    checkpoints into the current layout: ``weight_norm``'s ``weight_g``/``weight_v`` into its parametrization,
    Hugging Face Mamba's ``embedding.`` into ``embeddings.``, ESM's rotary keys. Skipped, a renamed key was
    "missing", and with ``strict=False`` the parameter silently kept its old values. The caller's mapping is not
    changed (``load_state_dict`` copies it too).
    """
    working = dict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    report = _PreHookReport()
    for prefix, module in model.named_modules(remove_duplicate=False, prefix=""):
        hooks = list(module._load_state_dict_pre_hooks.values())
        if not hooks:
            continue
        prefix = f"{prefix}." if prefix else ""
        local = {k: v for k, v in working.items() if k.startswith(prefix)}
        local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
        for hook in hooks:
            hook(local, prefix, local_metadata, strict, report.missing_keys, report.unexpected_keys, report.error_msgs)
        # As in load_state_dict, a module's hook decides its own keys only.
        working = {k: v for k, v in working.items() if not k.startswith(prefix)}
        working.update((k, v) for k, v in local.items() if k.startswith(prefix))
    return working, report


def _run_load_post_hooks(model: nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """The modules' ``register_load_state_dict_post_hook`` hooks, as ``model.load_state_dict`` runs them after
    loading (children first); torch's ``set_model_state_dict`` goes through ``load_state_dict`` and so runs them.
    Without this, a hook that re-ties weights or recomputes a buffer from the loaded values would be skipped,
    silently."""
    incompatible = _IncompatibleKeys(missing, unexpected)
    for module in _children_first(model):
        for hook in module._load_state_dict_post_hooks.values():
            hook(module, incompatible)


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


def _set_extra_state(model: nn.Module, key: str, value: Any) -> None:
    module_name = key.rpartition(".")[0] if "." in key else ""
    model.get_submodule(module_name).set_extra_state(value)


# ------------------------------------------------------------------------------------------------ optimizer
def _param_fqns(model: nn.Module) -> tuple[dict[int, str], dict[str, nn.Parameter]]:
    """id(param) -> canonical FQN (the first name, as torch's named_parameters gives) and every name -> param."""
    canonical: dict[int, str] = {}
    by_name: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        by_name[name] = p
    return canonical, by_name


def check_optimizer_loadable(optim: torch.optim.Optimizer) -> None:
    """Refuse, on every rank alike, to load into an optimizer whose state cannot be loaded exactly.

    Two kinds: a ``step`` that requires a closure (``torch.optim.LBFGS``) cannot create a fresh optimizer's state
    to load into (a zero step without a closure raised a ``TypeError`` from inside the checkpoint code), and
    state held in lists or dicts of tensors (LBFGS's history of flat vectors over all parameters, ``old_dirs``,
    ``old_stps``, ``ro``) is not per-parameter state, whose lengths a fresh optimizer cannot know. Saving such
    state works (the weights in it load with ``load_from_checkpoint``); resuming it does not.

    Example: ``check_optimizer_loadable(torch.optim.LBFGS(model.parameters()))`` raises ``ValueError``.
    """
    needs_closure = _step_needs_closure(optim)
    nested = sorted(
        {
            key
            for entry in optim.state.values()
            for key, value in entry.items()
            if isinstance(value, (list, tuple, dict))
            and any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))
        }
    )
    if not needs_closure and not nested:
        return
    why = f"its state holds lists of tensors ({', '.join(map(repr, nested))})" if nested else ""
    why = why or "its step() requires a closure, so no state can be created to load into"
    raise ValueError(
        f"set_optimizer_state_dict: cannot load the state of {type(optim).__module__}.{type(optim).__qualname__} "
        f"into its sharded parameters: {why}. Resume the weights only (load_from_checkpoint, or "
        "set_model_state_dict) with a new optimizer, or train with an optimizer whose state is per parameter "
        "(Adam, SGD, Adafactor, Muon, ...)."
    )


def _step_needs_closure(optim: torch.optim.Optimizer) -> bool:
    closure = inspect.signature(type(optim).step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create lazily-initialised state (e.g. Adam's exp_avg) with one zero-gradient, zero-lr step.

    The same trick as torch's ``state_dict._init_optim_state``: without it a fresh optimizer has no state tensors
    to load into. Parameters are unchanged (zero lr); gradients are restored afterwards. Unlike torch's, which
    returns early when a parameter has a gradient, it also runs then: a module trained by an earlier
    ``trainer.fit`` keeps its last step's gradients, and a new Trainer resuming it from a checkpoint built a
    template without state that refused the checkpoint's ("unexpected keys ... momentum_buffer").
    """
    if optim.state or _step_needs_closure(optim):  # LBFGS: no step without a closure (check_optimizer_loadable)
        return
    params = [p for g in optim.param_groups for p in g[_PARAMS]]
    kept = [p.grad for p in params]
    _zero_lr_step(optim, params)
    for p, grad in zip(params, kept):
        p.grad = grad


def _zero_lr_step(optim: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One step with zero gradients at lr 0 (the lazily-built state appears, the parameters stay)."""
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for group in optim.param_groups:
        if "lr" in group:
            lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step()
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)


def _optim_fqns(model: nn.Module, optim: torch.optim.Optimizer) -> list[list[str]]:
    canonical, _ = _param_fqns(model)
    groups = []
    for i, group in enumerate(optim.param_groups):
        names = []
        for j, p in enumerate(group[_PARAMS]):
            if id(p) not in canonical:
                raise ValueError(
                    f"optimizer state dict: parameter {j} of param group {i} (shape {tuple(p.shape)}) is not a "
                    f"parameter of {type(model).__name__}; pass the model whose parameters the optimizer updates"
                )
            names.append(canonical[id(p)])
        groups.append(names)
    return groups


def get_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    full_state_dict: bool = False,
    cpu_offload: bool = False,
) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter FQN: ``{"state": {fqn: {...}}, "param_groups": [...]}``.

    Each group keeps its hyperparameters and lists its parameters by FQN. State tensors shaped like a DTensor
    parameter (exp_avg, momentum_buffer, ...) are DTensors already; sharded form keeps them (sharing storage),
    full form gathers them one at a time, with the same ``cpu_offload``/rank-0 rule as
    :func:`get_model_state_dict`. A fresh optimizer gets its state created first (one zero-lr step on zero
    gradients, as torch does), so the result can be loaded into. Frozen parameters never have state.

    Example::

        osd = get_optimizer_state_dict(model, optim)
        osd["param_groups"][0]["params"]   # ['embed.weight', 'blocks.0.norm.weight', ...]

    >>> from lightning_shard.fsdp import fully_shard
    >>> model = fully_shard(nn.Linear(4, 2))
    >>> optim = torch.optim.AdamW(model.parameters())
    >>> model(torch.ones(1, 4)).sum().backward(); optim.step()
    >>> osd = get_optimizer_state_dict(model, optim)
    >>> osd["param_groups"][0]["params"], sorted(osd["state"]["weight"])
    (['weight', 'bias'], ['exp_avg', 'exp_avg_sq', 'step'])
    """
    _init_optim_state(optimizer)
    groups = _optim_fqns(model, optimizer)
    keep = not full_state_dict or _keep_full(cpu_offload)
    cache: dict[int, torch.Tensor | None] = {}
    state: dict[str, dict[str, Any]] = {}
    for group, names in zip(optimizer.param_groups, groups):
        for p, fqn in zip(group[_PARAMS], names):
            if p not in optimizer.state:
                continue
            entry = {}
            for k, v in optimizer.state[p].items():
                # tensors also inside lists (LBFGS's history): a full state dict must hold no DTensor
                entry[k] = pytree.tree_map_only(
                    torch.Tensor, lambda t: _export(t, full_state_dict, cpu_offload, cache, keep), v
                )
            if keep:  # the other ranks only join the gathers (see get_model_state_dict)
                state[fqn] = entry
    if not keep:
        return {}
    param_groups = []
    for group, names in zip(optimizer.param_groups, groups):
        g = {k: copy.deepcopy(v) for k, v in group.items() if k != _PARAMS}
        g[_PARAMS] = list(names)
        param_groups.append(g)
    return {_STATE: state, _PG: param_groups}


def _by_fqn(model: nn.Module, optimizer: torch.optim.Optimizer, osd: Mapping[str, Any]) -> Mapping[str, Any]:
    """``osd`` keyed by FQN: torch's ``optimizer.state_dict()`` numbers parameters in param-group order
    (Lightning's DDP checkpoints hold that form); map those numbers to this optimizer's parameters, in order."""
    saved_groups = list(osd[_PG])
    if not any(isinstance(i, int) for g in saved_groups for i in g.get(_PARAMS, [])):
        return osd
    groups = _optim_fqns(model, optimizer)
    saved_sizes = [len(g.get(_PARAMS, [])) for g in saved_groups]
    sizes = [len(names) for names in groups]
    if saved_sizes != sizes:
        raise ValueError(
            "set_optimizer_state_dict: the optimizer state is keyed by parameter index (torch's "
            "optimizer.state_dict(), e.g. from Lightning's DDP strategy), so parameters are matched by their order "
            f"in the param groups; the state's groups hold {saved_sizes} parameters, the optimizer's {sizes}. "
            "Build the optimizer over the same parameters in the same order (e.g. the same configure_optimizers)."
        )
    fqn_of = {i: name for g, names in zip(saved_groups, groups) for i, name in zip(g[_PARAMS], names)}
    unknown = [i for i in osd[_STATE] if i not in fqn_of]
    if unknown:
        raise ValueError(f"set_optimizer_state_dict: state for parameter indices {unknown[:5]} not in any group")
    return {
        _STATE: {fqn_of[i]: st for i, st in osd[_STATE].items()},
        _PG: [{**g, _PARAMS: list(names)} for g, names in zip(saved_groups, groups)],
    }


def _check_groups(problems: Problems, saved_groups: list, groups: list[list[str]]) -> None:
    if len(saved_groups) != len(groups):
        problems.add(f"{len(saved_groups)} param groups in the state dict, {len(groups)} in the optimizer")
        return
    for i, (saved, names) in enumerate(zip(saved_groups, groups)):
        saved_names = [str(n) for n in saved.get(_PARAMS, [])]
        if sorted(saved_names) != sorted(names):
            extra = sorted(set(saved_names) - set(names))[:3]
            lacking = sorted(set(names) - set(saved_names))[:3]
            problems.add(f"param group {i} lists other parameters (unexpected {extra}, missing {lacking})")


def check_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer, optim_state_dict: Mapping[str, Any]):
    """Raise unless ``optim_state_dict``'s param groups list the optimizer's parameters (by FQN, per group).

    The one check of :func:`set_optimizer_state_dict` that ``load`` cannot do from shapes and dtypes alone.

    Example: ``load(state, path, before_commit=lambda s: check_param_groups(model, optim, s["optimizer"]))``.
    """
    problems = Problems("set_optimizer_state_dict")
    if not isinstance(optim_state_dict, Mapping) or _PG not in optim_state_dict:
        raise ValueError("set_optimizer_state_dict: the optimizer state has no 'param_groups'")
    optim_state_dict = _by_fqn(model, optimizer, optim_state_dict)
    _check_groups(problems, list(optim_state_dict[_PG]), _optim_fqns(model, optimizer))
    problems.raise_if_any(n_expected=0)


def _plan_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, optim_state_dict: Any, strict: bool):
    """Check ``optim_state_dict`` against ``optimizer`` (raises, nothing copied); return what the copy needs."""
    problems = Problems("set_optimizer_state_dict")
    if not isinstance(optim_state_dict, Mapping) or _STATE not in optim_state_dict or _PG not in optim_state_dict:
        raise ValueError(
            "set_optimizer_state_dict: expected {'state': {fqn: {...}}, 'param_groups': [...]} as returned by "
            f"get_optimizer_state_dict, got {type(optim_state_dict).__name__} with keys "
            f"{list(optim_state_dict)[:5] if isinstance(optim_state_dict, Mapping) else '-'}"
        )
    check_optimizer_loadable(optimizer)
    _init_optim_state(optimizer)
    optim_state_dict = _by_fqn(model, optimizer, optim_state_dict)
    groups = _optim_fqns(model, optimizer)
    _, by_name = _param_fqns(model)
    saved_groups = list(optim_state_dict[_PG])
    _check_groups(problems, saved_groups, groups)
    param_of = {name: by_name[name] for names in groups for name in names}
    saved_state = optim_state_dict[_STATE]
    expected_keys = 0
    matched = 0
    for fqn, p in param_of.items():
        current = optimizer.state.get(p, {})
        saved = saved_state.get(fqn)
        if saved is None:  # no state saved for it (never stepped: unused, frozen then): it gets none, as in torch
            continue
        expected_keys += len(current)
        for k, target in current.items():
            key = f"state.{fqn}.{k}"
            if k not in saved:
                if strict:
                    problems.missing([key])
            elif isinstance(target, torch.Tensor):
                matched += _check_tensor(problems, key, saved[k], target)
        if strict:
            problems.unexpected(f"state.{fqn}.{k}" for k in saved if k not in current)
    if strict:
        problems.unexpected(f"state.{fqn}" for fqn in saved_state if fqn not in param_of)
    problems.raise_if_any(n_expected=expected_keys, n_matched=matched)
    return saved_state, param_of, saved_groups, groups


def check_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, optim_state_dict: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Raise the error :func:`set_optimizer_state_dict` would raise, without copying anything.

    Lets a caller that loads a model and an optimizer together check both before touching either.

    Example::

        check_optimizer_state_dict(model, optim, osd); set_model_state_dict(model, msd)
        set_optimizer_state_dict(model, optim, osd)
    """
    _plan_optimizer(model, optimizer, optim_state_dict, strict)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
) -> None:
    """Load an FQN-keyed optimizer state (sharded or full form) into ``optimizer``, all-or-nothing.

    The param groups must list the same parameters (by FQN, any order within a group) as the optimizer's;
    their hyperparameters (lr, betas, weight_decay, ...) are taken from the state dict. Every state tensor is
    checked against the optimizer's own (created first if the optimizer is fresh): same keys, global shapes
    and dtypes (bfloat16/float16 values load into float32 ones exactly; narrowing is refused). Only then are
    values copied in place (full tensors cut to the parameter's shard). torch's index-keyed form
    (``optimizer.state_dict()``, as in Lightning DDP checkpoints) is accepted too: indices are matched to
    this optimizer's parameters in param-group order.

    Example::

        set_optimizer_state_dict(model, optim, osd)
    """
    saved_state, param_of, saved_groups, groups = _plan_optimizer(model, optimizer, optim_state_dict, strict)
    with torch.no_grad():
        for fqn, p in param_of.items():
            saved = saved_state.get(fqn)
            if saved is None:
                optimizer.state.pop(p, None)  # as torch's Optimizer.load_state_dict: no saved state, no state
                continue
            current = optimizer.state[p]
            for k, v in saved.items():
                target = current.get(k)
                if isinstance(target, torch.Tensor):
                    _copy_into(target, v)
                elif k in current or not strict:
                    current[k] = copy.deepcopy(v) if not isinstance(v, torch.Tensor) else v
        if len(saved_groups) == len(groups):
            for group, saved in zip(optimizer.param_groups, saved_groups):
                for k, v in saved.items():
                    if k != _PARAMS:
                        group[k] = v
