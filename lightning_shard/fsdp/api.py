"""``fully_shard``, ``FSDPModule`` and ``summon_full_params``: the public face of our FSDP.

Example::

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)          # bottom-up: the root takes what the blocks left
    loss = model(x).sum(); loss.backward(); optim.step()
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import comm
from lightning_shard.device import handle_for, has_data, same_storage
from lightning_shard.fsdp.max_norm import install_max_norm_hooks
from lightning_shard.fsdp.optimizer_guard import REPLACED_MARK, install_step_guard
from lightning_shard.fsdp.param import FSDPParam
from lightning_shard.fsdp.param_group import FSDPParamGroup, MeshInfo
from lightning_shard.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from lightning_shard.fsdp.state import FSDPState
from lightning_shard.mesh import DeviceMesh, init_device_mesh
from lightning_shard.tensor import DTensor
from lightning_shard.tensor.grad_hooks import carry_over_grad_hooks

__all__ = ["fully_shard", "FSDPModule", "summon_full_params", "UnshardHandle"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather.

    >>> model = fully_shard(nn.Linear(4, 2))
    >>> handle = model.unshard(async_op=True)   # the all-gather runs while this rank does other work
    >>> handle.wait(); model.weight.shape        # the unsharded parameter, a plain tensor until reshard()
    torch.Size([2, 4])
    >>> model.reshard(); type(model.weight).__name__
    'DTensor'
    """

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.unshard()
        self._groups = []


class FSDPModule:
    """Mixed into every module passed to ``fully_shard`` (its class becomes ``FSDP<Class>``).

    Example: ``model.set_requires_gradient_sync(False)`` for micro-batches without communication.

    >>> model = fully_shard(nn.Sequential(nn.Linear(4, 4)))
    >>> type(model).__name__, isinstance(model, FSDPModule)
    ('FSDPSequential', True)
    """

    _fsdp_state: FSDPState

    def __deepcopy__(self, memo: dict):
        # A copy would share (or half-copy) the group's flat buffers, freed unsharded storage and hooks: torch's
        # FSDP2 refuses too. Refused before copy.deepcopy touches any tensor (a freed unsharded view crashes it).
        raise TypeError(
            f"copy.deepcopy: {type(self).__name__} is sharded by fully_shard and cannot be deep-copied. For a "
            "second copy of the weights (EMA, teacher), build the copy before sharding and shard it too, or "
            "load get_model_state_dict(model) into a second model; to save, use a state dict"
        )

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (e.g. before a custom forward); ``async_op`` returns a handle."""
        groups = [self._fsdp_state.group] if self._fsdp_state.group is not None else []
        for group in groups:
            group.start_unshard()
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and point the module back at the sharded DTensors."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def drop_unreduced_gradients(self) -> None:
        """Forget this module's gradients that are not in the sharded ``.grad`` yet: those kept unsharded by
        ``set_requires_gradient_sync(False)`` and the partial ones of a backward an exception stopped.

        Not in torch's FSDP2. Call it on every unit after an interrupted step, before training goes on:
        ``optimizer.zero_grad()`` clears only the sharded ``.grad``, and these were added into the next backward
        (the strategy calls it when a step raises). Local: no collective.

        Example::

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.drop_unreduced_gradients()
        """
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.drop_unreduced_grads()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: keep gradients unsharded and accumulate them locally (no communication) until set back."""
        for state in self._states(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep parameters unsharded after backward, for the next forward (gradient accumulation); an
        optimizer step in between reshards them first, so the forward after it gathers the updated weights."""
        for state in self._states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, *, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` after construction (as in ``fully_shard``; call on every rank)."""
        for state in self._states(recurse):
            _set_reshard(state, reshard_after_forward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start these modules' all-gathers when this module's forward starts (default: the module that ran
        forward next in the previous step; ``[]`` turns forward prefetch off for this module)."""
        self._fsdp_state.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start these modules' all-gathers when this module's backward starts (default: the previous one)."""
        self._fsdp_state.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        states: list[FSDPState] = []
        for sub in self.modules():
            state = getattr(sub, "_fsdp_state", None)
            if state is not None and state not in states:
                states.append(state)
        return states

    def _apply(self, fn, recurse=True):
        # Swap parameter objects' contents rather than replacing them, so the DTensors the optimizer and our
        # groups hold stay the same objects; then re-adopt the new local tensors into flat shard buffers.
        previous = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            result = super()._apply(fn, recurse)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(previous)
        group = self._fsdp_state.group
        if group is not None and any(
            not same_storage(fp.sharded._local_tensor, group.shard_flat)
            or fp.sharded._local_tensor.device != group.shard_flat.device
            for fp in group.params
        ):
            group.rebuild_after_apply()
        return result


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not already sharded by a nested call) over ``mesh``.

    Apply bottom-up: blocks first, then the root. A list of modules forms one group (for parameters tied
    across modules). A parameter that another call already sharded, met here under another name (a tie
    between the two calls' modules), raises: two groups would untie it. Put the modules in one list, or pass
    the parameter in ``ignored_params`` of the inner calls so that the enclosing call manages it.
    ``mesh`` is 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP); default: all ranks.
    Parameters become our DTensors ``Shard(0)`` (``(Replicate(), Shard(0))`` on a 2-D mesh), a 0-dim one
    ``Replicate()`` (kept whole on every rank, ``FSDPParam.replicated``); buffers stay plain and replicated.
    ``reshard_after_forward`` frees unsharded parameters after forward (True) or keeps them until after
    backward (False); an int ``k`` keeps a ``k``-way shard after forward, so the backward all-gather runs over
    ``k`` neighbouring ranks only (e.g. one node's GPUs; see ``post_forward.py``); ``k`` must divide the
    shard-group size (1 = False, the group size = True).

    Example::

        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))

    On one rank (the default mesh is every rank):

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    >>> for block in model:
    ...     _ = fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    >>> model = fully_shard(model)
    >>> type(model).__name__, model[0].weight.placements, model(torch.ones(3, 4)).dtype
    ('FSDPSequential', (Shard(dim=0),), torch.bfloat16)
    """
    _check_arguments(mesh, reshard_after_forward, mp_policy, offload_policy)
    install_step_guard()
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    _check_modules(modules)
    mesh = mesh if mesh is not None else _default_mesh(modules)
    mesh_info = MeshInfo(_check_mesh(mesh))
    reshard = _normalize_reshard(reshard_after_forward, mesh_info)
    device = _mesh_device(mesh)
    ignored = {id(p) for p in (ignored_params or ())}
    params, originals = _collect_params(modules, ignored, device, mesh)
    registered = [module._parameters[name] for module, name in (fp.refs[0] for fp in params)]
    group = FSDPParamGroup(params, originals, mesh_info, mp_policy, offload_policy, device) if params else None
    if group is not None:
        install_max_norm_hooks(group)  # embeddings whose forward renormalises their weight in place
        for fp, original in zip(params, registered):  # gradient hooks registered before sharding
            carry_over_grad_hooks(original, fp.sharded)
    _mark_taken(modules, params, registered)
    state = FSDPState(modules, group, mp_policy, bool(reshard))
    if group is not None:
        group.configure_post_forward(_post_forward_size(reshard))
    for m in modules:
        m._fsdp_state = state
        m.__class__ = _fsdp_class(type(m))
    _mark_managed(modules)
    return module


def _mark_managed(modules) -> None:
    """Mark every module under this call as torch's ``fully_shard`` marks the modules it manages, because other
    libraries read the marks. Hugging Face's speech encoders (wav2vec2, HuBERT, WavLM, data2vec-audio, SEW,
    ...) run every layer on every rank when ``is_fsdp_managed_module`` says so, where they would otherwise skip
    layers by each rank's own LayerDrop draw: the ranks' all-gathers then stop pairing up (a hang, or one
    layer's shards gathered into another's). torch.compile traces marked modules with their parameters as
    graph inputs, as it does under torch's FSDP2."""
    for root in modules:
        for m in root.modules():
            m._is_fsdp_managed_module = True
            m._fsdp_use_orig_params = True  # what torch.compile requires of a module marked as managed


def _check_arguments(mesh, reshard_after_forward, mp_policy, offload_policy) -> None:
    """Types of the keyword arguments, before anything is touched (a wrong type fails later with a message
    that never names the argument, e.g. ``'torch.dtype' object has no attribute 'param_dtype'``)."""
    if mesh is not None:
        _check_mesh(mesh)
    if not isinstance(reshard_after_forward, int):  # bool is an int
        raise TypeError(
            f"fully_shard: reshard_after_forward must be True, False or an int, got {reshard_after_forward!r} "
            f"({type(reshard_after_forward).__name__})"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        hint = f"MixedPrecisionPolicy(param_dtype={mp_policy})" if isinstance(mp_policy, torch.dtype) else None
        raise TypeError(
            f"fully_shard: mp_policy must be a lightning_shard.fsdp.MixedPrecisionPolicy, got {mp_policy!r} "
            f"({type(mp_policy).__module__}.{type(mp_policy).__name__}); pass "
            + (hint or "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=..., output_dtype=...)")
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard: offload_policy must be a lightning_shard.fsdp policy, got {offload_policy!r} "
            f"({type(offload_policy).__module__}.{type(offload_policy).__name__}); pass CPUOffloadPolicy() to keep "
            "shards on CPU, OffloadPolicy() for none"
        )


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expected nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard: {type(m).__name__} is already sharded (fully_shard was applied to it twice); "
                "call it once per module"
            )
        if isinstance(m, _CONTAINERS):
            raise ValueError(
                f"fully_shard: {type(m).__name__} has no forward, so its hooks would never run; apply "
                "fully_shard to each of its elements (or pass list(container) to shard them as one group)"
            )


def _default_mesh(modules) -> DeviceMesh:
    device_type = "cuda" if torch.cuda.is_available() and _first_param_device(modules).type != "cpu" else "cpu"
    world = dist.get_world_size() if dist.is_initialized() else 1
    return init_device_mesh(device_type, (world,), mesh_dim_names=("data_parallel",))


def _first_param_device(modules) -> torch.device:
    for m in modules:
        for p in m.parameters():
            return p.device
    return torch.device("cpu")


def _check_mesh(mesh: DeviceMesh) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard: mesh must be a lightning_shard DeviceMesh, got {type(mesh).__name__}; convert torch's "
            "with DeviceMesh.from_torch(mesh)"
        )
    names = mesh.mesh_dim_names or ()
    if mesh.ndim > 2 or "tensor_parallel" in names:
        raise ValueError(
            f"fully_shard: mesh {mesh} has no (or not only a) data-parallel dimension; pass the data-parallel "
            "sub-mesh, e.g. mesh['data_parallel'] (or mesh['replicate', 'data_parallel'] for HSDP)"
        )
    return mesh


def _normalize_reshard(value: bool | int, mesh_info: MeshInfo) -> bool | int:
    """True, False, or the post-forward shard size ``k`` (``1 < k < shard-group size``)."""
    if isinstance(value, bool):
        return value
    n = mesh_info.shard_size
    if isinstance(value, int) and value >= 1 and n % value == 0:
        return False if value == 1 else True if value == n else value
    raise ValueError(
        f"fully_shard: reshard_after_forward={value!r}; use True, False, or an int that divides the shard-group "
        f"size {n} (1 = False, {n} = True, in between: keep that many-way shard for backward)"
    )


def _post_forward_size(reshard: bool | int) -> int | None:
    return None if isinstance(reshard, bool) else reshard


def _set_reshard(state: FSDPState, value: bool | int) -> None:
    if state.group is None:
        state.reshard_after_forward = bool(value)
        return
    reshard = _normalize_reshard(value, state.group.mesh_info)
    state.reshard_after_forward = bool(reshard)
    state.group.configure_post_forward(_post_forward_size(reshard))


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """This process's device of the mesh's type (for an accelerator: the current one, as torch's FSDP2)."""
    return handle_for(mesh.device_type).current_device()


def _collect_params(modules, ignored: set[int], device: torch.device, mesh: DeviceMesh):
    """The parameters this call manages: not ignored and not already managed by a nested call."""
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    named: dict[int, tuple[str, nn.Parameter]] = {}
    for root in modules:
        for mod_name, sub in root.named_modules(remove_duplicate=False):
            for name, p in sub.named_parameters(recurse=False):
                if p is None or id(p) in ignored:
                    continue
                if isinstance(p, DTensor) and getattr(p, "_fsdp_managed", False):
                    continue  # a nested fully_shard owns it
                fqn = f"{mod_name}.{name}" if mod_name else name
                _check_dense_gradient(sub, mod_name, fqn)
                _check_not_taken(modules, fqn, p)
                if isinstance(p, DTensor):
                    _check_tp_param(fqn, p, mesh)
                refs.setdefault(id(p), []).append((sub, name))
                named.setdefault(id(p), (fqn, p))
    params, originals = [], []
    for key, (fqn, p) in named.items():
        _check_device(fqn, p, device)
        params.append(FSDPParam(fqn, p, refs[key]))
        originals.append(p if p.device.type in ("meta", device.type) else p.to(device))
    _check_not_top_down(modules)
    return params, originals


def _check_dense_gradient(module: nn.Module, mod_name: str, fqn: str) -> None:
    """``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` give their weight a sparse COO gradient,
    which the reduce-scatter into a flat gradient buffer cannot take (it failed deep inside backward with
    "Could not run 'aten::as_strided' with arguments from the 'SparseCPU' backend" or a stride error)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
        raise ValueError(
            f"fully_shard: '{mod_name or type(module).__name__}' is an {type(module).__name__} with sparse=True, "
            f"whose parameter {fqn!r} gets sparse gradients, which fully_shard cannot reduce-scatter. Build it "
            "with sparse=False (the same gradient values, dense; use torch.optim.Adam/AdamW instead of SparseAdam)"
        )


# A parameter a fully_shard call took keeps its original object registered wherever that call's modules do not
# reach (e.g. the other T5Stack, or the root's lm_head). Another call meeting that object would shard a second,
# independent copy: the tie would break silently. The original is marked so that such a call raises instead.
_TAKEN = REPLACED_MARK  # the optimizer guard refuses an optimizer holding such a parameter


@dataclass(frozen=True)
class _Taken:
    fqn: str  # relative to the module of that call that holds it
    modules: tuple[weakref.ref, ...]
    what: str  # "fully_shard(T5Stack)"


def _call_name(modules) -> str:
    return f"fully_shard({', '.join(type(m).__name__.removeprefix('FSDP') for m in modules)})"


def _mark_taken(modules, params: list[FSDPParam], registered: list[nn.Parameter]) -> None:
    owners = tuple(weakref.ref(m) for m in modules)
    for fp, p in zip(params, registered):
        setattr(p, _TAKEN, _Taken(fp.fqn, owners, _call_name(modules)))


def _check_not_taken(modules, fqn: str, p: nn.Parameter) -> None:
    taken: _Taken | None = getattr(p, _TAKEN, None)
    if taken is None:
        return
    other = _name_within(modules, taken)
    raise ValueError(
        f"{_call_name(modules)}: parameter {fqn!r} is the same Parameter as {other}, which an earlier "
        f"{taken.what} call already sharded into its own group; two groups would each train their own copy "
        "(the tie would silently break). Put every module that uses it in one group: fully_shard([module_a, "
        "module_b]), or pass it in ignored_params to the fully_shard call of each sub-module that uses it so that "
        "the enclosing call (e.g. fully_shard(model)) manages it. The Lightning strategy's fsdp_unit='auto' does "
        "the latter."
    )


def _name_within(modules, taken: _Taken) -> str:
    """The earlier call's name for the parameter, as a path inside this call's modules when it is one."""
    owners = [ref() for ref in taken.modules]
    for root in modules:
        for mod_name, sub in root.named_modules():
            if mod_name and any(sub is o for o in owners):
                return repr(f"{mod_name}.{taken.fqn}")
    return f"{taken.fqn!r} of {taken.what}"


def _check_tp_param(fqn: str, p: DTensor, mesh: DeviceMesh) -> None:
    """A parameter that is already our DTensor must live on a TP sub-mesh of the FSDP mesh's root mesh."""
    tp_mesh = p.device_mesh
    ok = (
        mesh.ndim == 1
        and tp_mesh.ndim == 1
        and tp_mesh.root_mesh is mesh.root_mesh
        and mesh.root_mesh is not mesh
        and mesh.mesh_dim_names is not None
        and tp_mesh.mesh_dim_names is not None
        and not any(pl.is_partial() for pl in p.placements)
    )
    if not ok:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is already a DTensor on {tp_mesh} with placements {list(p.placements)}; "
            f"FSDP over TP needs the TP mesh and the FSDP mesh {mesh} to be named 1-D sub-meshes of one root mesh, "
            "e.g. root = init_device_mesh(..., mesh_dim_names=('data_parallel', 'tensor_parallel')), then "
            "parallelize_module(m, root['tensor_parallel'], plan) and fully_shard(m, mesh=root['data_parallel'])"
        )


def _check_device(fqn: str, p: nn.Parameter, device: torch.device) -> None:
    if p.device.type == "meta" or p.device.type == device.type:
        return
    if device.type != "cpu" and p.device.type == "cpu":
        return  # moved to the accelerator, one group at a time, as torch's fully_shard does
    raise ValueError(
        f"fully_shard: parameter {fqn!r} is on {p.device} but the mesh is a {device.type} mesh; move the module "
        f"to {device.type} first or use a mesh of device type {p.device.type!r}"
    )


def _check_not_top_down(modules) -> None:
    for m in modules:
        below = _managed_below(m)
        for sub in m.modules():
            if isinstance(sub, FSDPModule):
                continue
            for p in sub.parameters(recurse=False):
                if isinstance(p, DTensor) and getattr(p, "_fsdp_managed", False) and id(p) not in below:
                    raise ValueError(
                        f"fully_shard: {type(m).__name__} holds parameters already sharded by an enclosing module's "
                        "fully_shard; apply fully_shard bottom-up (inner blocks first, then the root)"
                    )


def _managed_below(root: nn.Module) -> set[int]:
    """The ids of the sharded parameters that the FSDP units strictly below ``root`` manage: collected once per
    call (asking per parameter walked every module for each of them, quadratic in the model's size)."""
    ids = set()
    for sub in root.modules():
        state = getattr(sub, "_fsdp_state", None)
        if sub is not root and state is not None and state.group is not None:
            ids.update(id(fp.sharded) for fp in state.group.params)
    return ids


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``, the class a sharded module takes. It keeps ``cls``'s ``__module__``: code that decides by a
    class's module reads it from the sharded module too. transformers' ``is_custom_code()`` is
    ``not cls.__module__.startswith("transformers.")``; with this module's name a sharded Hugging Face model
    counted as remote code, and ``post_init()`` / ``init_weights()`` after ``fully_shard`` skipped every module
    without parameters of its own (GPT-2's ``GPT2MLP`` and ``GPT2Attention``, whose scaled ``c_proj``
    initialisation then kept twice the standard deviation of one process's, with no error). torch's FSDP2 names
    its own module there."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _FSDP_CLASSES[cls]


def _state_of(module, what: str) -> FSDPState:
    state = getattr(module, "_fsdp_state", None)
    if state is None:
        raise ValueError(f"{what}: {type(module).__name__} is not an FSDP module (call fully_shard on it first)")
    return state


@contextlib.contextmanager
def summon_full_params(module: nn.Module, writeback: bool = True, rank0_only: bool = False) -> Iterator[None]:
    """Temporarily give every FSDP module in ``module`` its full parameters (in their own dtype, fp32).

    Inside the block, FSDP hooks are off, so forward runs as a plain module (e.g. text generation on rank 0
    only). With ``writeback=True`` edits to the full parameters are written back to the shards on exit.
    ``rank0_only=True`` keeps the full parameters on rank 0 only (others keep their shards) and cannot be
    combined with ``writeback``. Every rank must enter the block (the all-gathers are collective).

    Example::

        with summon_full_params(model, writeback=False, rank0_only=True):
            if dist.get_rank() == 0:
                print(model(prompt))

    >>> model = fully_shard(nn.Linear(4, 2))
    >>> with summon_full_params(model):
    ...     type(model.weight).__name__, model.weight.shape   # plain, unsharded parameters inside
    ('Parameter', torch.Size([2, 4]))
    >>> type(model.weight).__name__
    'DTensor'
    """
    if rank0_only and writeback:
        raise ValueError("summon_full_params: rank0_only=True cannot write back; pass writeback=False")
    states = []
    for sub in module.modules():
        state = getattr(sub, "_fsdp_state", None)
        if state is not None and state not in states:
            states.append(state)
    full: list[tuple[FSDPParamGroup, list[torch.Tensor]]] = []
    for state in states:
        group = state.group
        if group is None:
            continue
        group.reshard()
        group.finish_reduce()
        tensors = _gather_full(group)
        keep = not rank0_only or dist.get_rank() == 0
        if keep:
            for fp, t in zip(group.params, tensors):
                fp.set_on_modules(nn.Parameter(fp.wrap_unsharded(t), requires_grad=fp.requires_grad))
        full.append((group, tensors if keep else []))
        state.summoned = True
    try:
        with torch.no_grad():
            yield
    finally:
        for state in states:
            state.summoned = False
        for group, tensors in full:
            if writeback and tensors:
                with torch.no_grad():
                    for i, (fp, t) in enumerate(zip(group.params, tensors)):
                        local = fp.sharded._local_tensor
                        start = group.mesh_info.shard_rank * group.layout.rows_per_shard[i]
                        local.copy_(t if fp.replicated else t.narrow(0, start, local.shape[0]))
            for fp in group.params:
                fp.set_on_modules(fp.sharded)


def _gather_full(group: FSDPParamGroup) -> list[torch.Tensor]:
    """All-gather the group's shards in their own dtype into fresh full tensors (one collective)."""
    from numba_kernels import all_gather_copy_out

    shard = group.shard_flat.to(group.device)
    out = torch.empty((group.layout.world_size, group.layout.shard_numel), dtype=shard.dtype, device=group.device)
    comm.all_gather_into(out.view(-1), shard, group.mesh_info.shard_group)
    full = [torch.empty(shape, dtype=shard.dtype, device=group.device) for shape in group.layout.shapes]
    all_gather_copy_out(group.layout, out, full, impl="auto" if has_data(out) else "reference")
    return [t[0] if fp.replicated else t for fp, t in zip(group.params, full)]  # replicated: every row the same
