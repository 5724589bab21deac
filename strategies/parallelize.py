"""Apply TP and FSDP to a user's model with no parallelization code from the user.

Order: tensor parallelism on ``mesh["tensor_parallel"]`` (the auto plan or a given one), then
``fully_shard`` bottom-up on every FSDP unit (the repeated block class by default) and the root, then
materialize meta-device parameters shard by shard, then check that nothing can drift: every parameter is
a DTensor, and replicated copies agree across ranks.

Example::

    apply_parallelism(model, mesh, fsdp_unit="auto", tp_plan="auto", mp_policy=MixedPrecisionPolicy())
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import comm
from lightning_shard.device import handle_for, has_data
from lightning_shard.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    built_on_meta,
    fully_shard,
)
from lightning_shard.fsdp.param import BUILT_ON_META
from lightning_shard.fsdp.units import SharedSplit, find_repeated_blocks, split_shared_params
from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import DTensor


def is_parallelized(model: nn.Module) -> bool:
    """True if the user already applied parallelism (our FSDP/DTensor or torch's) in ``configure_model``."""
    for m in model.modules():
        if isinstance(m, FSDPModule) or type(m).__name__.startswith("FSDP"):
            return True
    return any(isinstance(p, DTensor) or type(p).__name__ == "DTensor" for p in model.parameters())


def find_fsdp_units(model: nn.Module, fsdp_unit: str | set[type] | Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The modules to wrap with ``fully_shard`` (before the root), innermost first.

    ``"auto"``: ``lightning_shard.fsdp.units.find_repeated_blocks`` (e.g. the transformer layers).
    """
    if callable(fsdp_unit) and not isinstance(fsdp_unit, (set, frozenset, str)):
        chosen = [m for m in model.modules() if m is not model and fsdp_unit(m)]
    elif isinstance(fsdp_unit, (set, frozenset)):
        chosen = [m for m in model.modules() if m is not model and isinstance(m, tuple(fsdp_unit))]
    elif fsdp_unit == "auto":
        chosen = find_repeated_blocks(model)
    else:
        raise ValueError(f"fsdp_unit={fsdp_unit!r}: use 'auto', a set of module classes, or a callable module -> bool")
    # innermost first, so fully_shard runs bottom-up
    depth = {id(m): name.count(".") + 1 for name, m in model.named_modules() if name}
    return sorted(chosen, key=lambda m: -depth.get(id(m), 0))


def shared_params_to_leave(model: nn.Module, units: list[nn.Module], fsdp_unit) -> dict[nn.Module, SharedSplit]:
    """Per unit, the shared (tied) parameters it must leave to an enclosing unit (the root at the latest).

    With ``fsdp_unit="auto"`` a unit that holds only some names of a shared parameter leaves it to the
    innermost enclosing unit that holds them all (T5: the embedding used by both ``T5Stack`` units goes to the
    root), so the tie is kept. A unit the user chose is not changed behind their back: a split raises, on
    every rank alike (before fully_shard runs, so no rank waits in a collective), naming both names and the fix.

    Example: ``shared_params_to_leave(t5, [t5.encoder, t5.decoder], "auto")`` -> ``{t5.encoder: ..., t5.decoder: ...}``.
    """
    leave = split_shared_params(model, units)
    if leave and fsdp_unit != "auto":
        unit, split = next(iter(leave.items()))
        inside, outside = split.pairs[0]
        raise ValueError(
            f"shard_fsdp_tp: fsdp_unit={fsdp_unit!r} makes {type(unit).__name__} an FSDP unit that holds parameter "
            f"{inside!r} but not {outside!r}, which is the same (tied) parameter; the two FSDP groups would each "
            "train their own copy. Use fsdp_unit='auto' (shared parameters stay in the enclosing unit), or choose "
            "units that each hold every use of a shared parameter or none of them."
        )
    return leave


def apply_parallelism(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    fsdp_unit,
    tp_plan,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    cpu_offload: bool,
    fsdp_mesh: DeviceMesh,
    activation_checkpointing_policy: set[type] | None = None,
    sequence_parallel: bool | str = False,
    loss_parallel: bool = False,
) -> dict:
    """TP (if the TP dim is larger than 1), activation checkpointing, FSDP; returns a summary dict.

    The summary's TP entries: ``tp_plan`` (the plan applied), ``tp_summary`` (``auto_tp_plan``'s lines, empty
    for a user's plan) and ``tp_coverage`` (a ``lightning_shard.tp.coverage.TPCoverage``: the fraction of
    weight-matrix elements the plan shards and the modules it leaves replicated, with the reason).
    """
    summary: dict = {"tp_plan": None, "tp_summary": [], "tp_coverage": None, "fsdp_units": []}
    tp_size = mesh.size("tensor_parallel")
    if tp_size > 1 and tp_plan is not None:
        from lightning_shard.tp import auto_tp_plan, parallelize_module
        from lightning_shard.tp.coverage import tp_coverage

        tp_mesh = mesh["tensor_parallel"]
        if tp_plan == "auto":
            plan, lines = auto_tp_plan(
                model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, return_summary=True
            )
        else:
            plan, lines = tp_plan, []
        summary["tp_coverage"] = tp_coverage(model, plan, lines)  # before the parameters become DTensors
        parallelize_module(model, tp_mesh, plan)
        summary["tp_plan"], summary["tp_summary"] = plan, lines
    if activation_checkpointing_policy:
        summary["checkpointed"] = _apply_activation_checkpointing(model, activation_checkpointing_policy)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    units = find_fsdp_units(model, fsdp_unit)
    if (not units and fsdp_unit != "auto") or summary.get("checkpointed") == 0:  # named in the warning
        blocks = find_repeated_blocks(model)
        summary["repeated_block"] = type(blocks[0]).__name__ if blocks else None
    leave = shared_params_to_leave(model, units, fsdp_unit)
    for unit in units:
        fully_shard(
            unit,
            mesh=fsdp_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
            ignored_params=leave.get(unit, SharedSplit.none()).params,
        )
        summary["fsdp_units"].append(type(unit).__name__)
    summary["shared_left_to_parent"] = sorted({pair[0] for split in leave.values() for pair in split.pairs})
    fully_shard(
        model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload
    )
    return summary


def _apply_activation_checkpointing(model: nn.Module, classes: set[type]) -> int:
    """Recompute the forward of every instance of ``classes`` in backward (non-reentrant checkpointing); returns
    how many modules that covers."""
    from torch.utils.checkpoint import checkpoint

    count = 0
    for m in model.modules():
        count += isinstance(m, tuple(classes))
        if isinstance(m, tuple(classes)) and not getattr(m, "_ls_checkpointed", False):
            forward = m.forward

            def checkpointed(*args, _forward=forward, **kwargs):
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            m.forward = checkpointed
            m._ls_checkpointed = True
    return count


def unmatched_choices(fsdp_unit, activation_checkpointing_policy, summary: dict) -> list[str]:
    """Warnings for a user's ``fsdp_unit`` or ``activation_checkpointing_policy`` that matched no module.

    Why: the run is still right, but not what was asked for: with no FSDP unit the whole model is gathered at
    once (the peak memory of an unsharded model), with nothing checkpointed no activation memory is saved. A
    class from another model family, or one a wrapper (peft, ``torch.compile``) replaced, matches nothing.
    """
    block = summary.get("repeated_block")
    known = f" (its repeated block class is {block})" if block else ""
    out = []
    if fsdp_unit != "auto" and not summary.get("fsdp_units"):
        out.append(
            f"shard_fsdp_tp: fsdp_unit={_describe(fsdp_unit)} matched no module, so the whole model is one FSDP unit "
            f"(gathered at once: the peak memory of the unsharded model){known}; pass the class of the repeated "
            "block, or fsdp_unit='auto'"
        )
    if activation_checkpointing_policy and summary.get("checkpointed") == 0:
        out.append(
            f"shard_fsdp_tp: activation_checkpointing_policy={_describe(activation_checkpointing_policy)} matched "
            f"no module, so nothing is recomputed in backward (no activation memory saved){known}; pass the class "
            "of the repeated block, or 'auto'"
        )
    return out


def _describe(choice) -> str:
    if isinstance(choice, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(c.__name__ for c in choice)) + "}"
    return getattr(choice, "__qualname__", repr(choice))


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model whose parameters are on the meta device (no memory) and whose buffers are real.

    Every plain ``nn.Parameter`` registered inside is replaced by a meta parameter as it is registered (its
    host tensor, usually ``torch.empty``, is dropped at once; one parameter is allocated at a time). Buffers are
    built as the model's ``__init__`` computes them: rotary ``cos``/``sin`` tables, position ids, masks and
    scales keep their values, including the non-persistent ones no checkpoint holds. A meta buffer has
    no value to recover: ``to_empty`` gives it uninitialised memory, different on every rank, which no
    ``reset_parameters()`` re-computes (the silent wrong result this avoids). Hugging Face accelerate's
    ``init_empty_weights()`` keeps buffers real by default for the same reason.

    A parameter registered a second time (a tied weight) is already on meta and stays the same object.

    Hugging Face's ``resize_token_embeddings`` on a model whose embeddings hold values (loaded by
    ``from_pretrained``) builds its new embedding and head on the host: it copies the old rows into them and
    assigns ``old.weight.data = new.weight.data``, which needs real tensors (on meta, the head's copied rows were
    dropped, and the embedding's assignment failed with "incompatible tensor type").

    Example::

        with parameters_on_meta():
            model = MyModel()          # parameters on meta, buffers on the host
    """
    original = nn.Module.register_parameter
    kept_real = [0]  # > 0 inside a resize of real embeddings: new parameters stay on the host

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if (
            param is not None
            and type(param) is nn.Parameter
            and not param.is_meta
            and not _loads(module, name)
            and not kept_real[0]
        ):
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    restore = _resize_keeps_real_embeddings(kept_real)
    try:
        yield
    finally:
        nn.Module.register_parameter = original
        restore()


def _resize_keeps_real_embeddings(kept_real: list[int]) -> Callable[[], None]:
    """Wrap transformers' ``PreTrainedModel.resize_token_embeddings`` (when transformers is imported) so that
    resizing embeddings that hold values builds the new ones on the host (``kept_real[0] > 0`` meanwhile); returns
    the function that unwraps it. Embeddings on meta (a model built from its config) are resized on meta, without
    ``mean_resizing`` (it needs the old rows' values)."""
    cls = _pretrained_model_class()
    if cls is None or "resize_token_embeddings" not in cls.__dict__:
        return lambda: None
    original = cls.__dict__["resize_token_embeddings"]

    def resize_token_embeddings(self, *args, **kwargs):
        weight = getattr(self.get_input_embeddings(), "weight", None)
        real = weight is not None and not weight.is_meta
        if not real:  # transformers' mean resizing samples from the old rows' covariance: no values on meta.
            # The new rows are initialised with the rest after sharding (transformers' _init_weights).
            args, kwargs = args[:2], {**kwargs, "mean_resizing": False}
        kept_real[0] += real
        try:
            return original(self, *args, **kwargs)
        finally:
            kept_real[0] -= real

    cls.resize_token_embeddings = resize_token_embeddings
    return lambda: setattr(cls, "resize_token_embeddings", original)


def _loads(module: nn.Module, name: str) -> bool:
    """Whether registering ``name`` on ``module`` replaces a meta parameter: loading values into a model built on
    meta (transformers' ``from_pretrained`` builds on meta, then assigns the checkpoint's tensors), which must
    keep them, not construction (a module's ``__init__`` registers each parameter once)."""
    existing = module._parameters.get(name)
    return existing is not None and existing.is_meta


def materialize(model: nn.Module, device: torch.device) -> list[str] | None:
    """Give meta-device parameters and buffers real storage on ``device`` and initialise them; returns the
    names of those that nothing initialised (this rank's shards) for ``check_initialised``, or ``None`` when
    nothing was on meta (or the tensors are the simulator's fakes), so that no check is needed on any rank.

    Each module's ``reset_parameters()`` runs on its (sharded) parameters; our DTensor random ops produce
    exactly the values one device would, so every rank allocates only its shards. All ranks start from rank
    0's RNG states, of the CPU generator and of ``device``'s (``reset_parameters`` of parameters on the
    accelerator draws from its generator), so replicated values agree; afterwards the generators are where one
    device's would be (``_restore_or_advance``). Tensors that were not on meta keep their values (``to_empty``
    alone would replace them).

    A meta tensor that no ``reset_parameters()`` writes (a module without one, such as an RMSNorm holding
    ``nn.Parameter(torch.ones(d))``, or a buffer computed in ``__init__``) has no value: it is filled with a
    marker (NaN; the largest integer; ``False``) instead of leftover memory, and its name is returned. A
    checkpoint loaded before the first step may still fill it; ``check_initialised`` then raises for what is
    left, on every rank, instead of training on it.
    """
    # fully_shard gives a meta parameter real storage (no value) when its group also holds real ones, and flags it
    meta_params = {name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta or built_on_meta(p)}
    meta_buffers = {name for name, b in model.named_buffers(remove_duplicate=False) if b.is_meta}
    if not meta_params and not meta_buffers:
        return None
    with torch.no_grad():
        kept_params = {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()
            if name not in meta_params
        }
    kept_buffers = {
        (id(m), key): b for m in model.modules() for key, b in m._buffers.items() if b is not None and not b.is_meta
    }
    model.to_empty(device=device)
    for m in model.modules():
        for key in m._buffers:
            if (id(m), key) in kept_buffers:
                m._buffers[key] = kept_buffers[(id(m), key)]
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    fresh = {id(params[name]) for name in meta_params} | {id(buffers[name]) for name in meta_buffers}
    if not has_data(_local(params[next(iter(meta_params))]) if meta_params else buffers[next(iter(meta_buffers))]):
        _reset_parameters_from_rank_0(model, device, fresh)  # the simulator's fake tensors: no values to fill or check
        return None
    with torch.no_grad():
        for name in meta_params:
            _fill_marker(_local(params[name]))
        for name in meta_buffers:
            _fill_marker(buffers[name])
    versions = {name: buffers[name]._version for name in meta_buffers}
    _reset_parameters_from_rank_0(model, device, fresh)
    with torch.no_grad():
        for name, value in kept_params.items():
            _local(params[name]).copy_(value)
    for name in meta_params:
        params[name].__dict__.pop(BUILT_ON_META, None)  # initialised now (or reported below)
    unset = [name for name in sorted(meta_params) if _holds_marker(_local(params[name]))]
    for name in sorted(meta_buffers):
        buf = buffers[name]
        # bool has no marker value: unset unless reset_parameters() wrote it (and then it stays listed)
        if (buf.dtype == torch.bool and buf._version == versions[name]) or _holds_marker(buf):
            unset.append(name)
    return unset


def _reset_parameters_from_rank_0(model: nn.Module, device: torch.device, fresh: set[int]) -> None:
    """Run every module's ``reset_parameters()``, then Hugging Face models' own initialisation of the tensors in
    ``fresh`` (ids of those just materialised from meta), all from rank 0's RNG states."""
    handle = handle_for(device)
    states = [torch.get_rng_state(), handle.get_rng_state()]
    synced = comm.broadcast_object(states, src=0)
    torch.set_rng_state(synced[0])
    if synced[1] is not None:
        handle.set_rng_state(synced[1])
    try:
        with torch.no_grad(), _padding_rows_zeroed_on_shards(model):
            for m in model.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
            for hf_model in _outermost_hugging_face_models(model):
                _hugging_face_initialize(hf_model, fresh)
            _peft_lora_initialize(model, fresh)  # after transformers', which also reaches the adapters' Linears
    finally:
        _restore_or_advance(states, synced, handle)


def _restore_or_advance(own: list, synced: list, handle) -> None:
    """After the init from rank 0's RNG states: a rank whose states were rank 0's keeps the advanced states, as one
    device would (a second model materialised next, e.g. two critics under ``empty_init=True``, then gets other
    values than the first instead of the same ones); a rank with states of its own (seeded per rank) gets them back.
    """
    if all(_same_state(a, b) for a, b in zip(own, synced)):
        return
    torch.set_rng_state(own[0])
    if own[1] is not None:
        handle.set_rng_state(own[1])


def _same_state(own, synced) -> bool:
    """Whether a generator state is the one rank 0 sent. Identity first: the simulator's fake backend hands each
    rank its own objects back (states made under fake tensors, which have no values to compare)."""
    if own is synced:
        return True
    return isinstance(own, torch.Tensor) and isinstance(synced, torch.Tensor) and torch.equal(own, synced)


@contextmanager
def _padding_rows_zeroed_on_shards(model: nn.Module) -> Iterator[None]:
    """Inside, embeddings whose weight is sharded along its rows have no ``padding_idx``; on exit it is put back
    and its row is zeroed in the shard that holds it.

    Why: ``nn.Embedding.reset_parameters`` and Hugging Face's ``_init_weights`` zero the padding row through
    ``weight[padding_idx]``, a select along the sharded dim, which the DTensor computes as a gathered copy (a
    write into it would be lost, so it raises). The row is written where it lives instead.
    """
    sharded = [
        (m, m.padding_idx)
        for m in model.modules()
        if isinstance(m, nn.Embedding)
        and m.padding_idx is not None
        and isinstance(m.weight, DTensor)
        and any(p.is_shard(0) for p in m.weight.placements)
    ]
    for m, _ in sharded:
        m.padding_idx = None
    try:
        yield
    finally:
        for m, row in sharded:
            m.padding_idx = row
            spec = m.weight._spec
            local_row = row - spec.local_offset[0]
            if 0 <= local_row < spec.local_shape[0]:
                with torch.no_grad():
                    m.weight._local_tensor[local_row].zero_()


def _pretrained_model_class() -> type | None:
    """transformers' ``PreTrainedModel``, or ``None`` when transformers was never imported (then no Hugging Face
    model exists; importing it here would cost seconds for nothing)."""
    if "transformers" not in sys.modules:
        return None
    try:  # transformers imports its submodules lazily
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


def _outermost_hugging_face_models(model: nn.Module) -> list[nn.Module]:
    """The ``transformers.PreTrainedModel`` instances in ``model`` that no other one contains (none if
    transformers was never imported: nothing can be one)."""
    pretrained = _pretrained_model_class()
    if pretrained is None:
        return []
    found: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if isinstance(m, pretrained):
            found.append(m)
        else:
            for child in m.children():
                walk(child)

    walk(model)
    return found


def _hugging_face_initialize(hf_model: nn.Module, fresh: set[int]) -> None:
    """Run the model's own weight initialisation (``_init_weights``: ``normal_(std=initializer_range)`` for
    Linear and Embedding weights, ones for norms, zero biases, recomputed rotary tables, ...) on the tensors
    that were built on meta, as ``from_config`` would have done on a real device.

    Why: under ``empty_init`` Hugging Face's ``post_init`` ran on meta tensors (no values) and flagged every
    module ``_is_hf_initialized``; ``reset_parameters()`` alone gives torch's defaults instead (an embedding
    drawn from N(0, 1), 50x Hugging Face's 0.02) and leaves norms without one unset. The module flags are
    cleared so the initialisation runs again; tensors not in ``fresh`` (not built on meta) are flagged as
    initialised and keep their values, which is how transformers itself skips loaded weights.
    """
    initialize = getattr(hf_model, "initialize_weights", None)
    if not callable(initialize):
        return
    for sub in hf_model.modules():
        sub.__dict__.pop("_is_hf_initialized", None)
        for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
            if t is not None and id(t) not in fresh:
                t._is_hf_initialized = True
    initialize()


# What peft's reset_lora_parameters (or nn.Linear's own initialisation) draws: no values needed.
_LORA_INITS = (True, False, "gaussian")


def _peft_lora_initialize(model: nn.Module, fresh: set[int]) -> None:
    """Give peft's LoRA adapters built on meta the initialisation peft gives them (``init_lora_weights``: by default
    A Kaiming-uniform and B zero, so that the adapted model starts equal to the base model).

    Why: under ``empty_init``, ``get_peft_model`` on a loaded model builds the adapters on meta, and peft's own
    initialisation ran on tensors without values; the adapters' Linears then got ``reset_parameters()`` and
    transformers' ``_init_weights`` (B drawn from N(0, 0.02): the model no longer started from the checkpoint's
    function, without an error). Initialisations computed from the base weights (PiSSA, OLoRA, LoftQ, EVA, ...,
    and DoRA's magnitude vector) cannot run on meta: they raise, naming the adapter and the fix.
    """
    configs: dict[str, object] = {}
    for m in model.modules():
        found = getattr(m, "peft_config", None)
        if isinstance(found, dict):
            for name, config in found.items():
                configs.setdefault(name, config)
    for m in model.modules():
        if not callable(getattr(m, "reset_lora_parameters", None)):
            continue
        tables = [getattr(m, key, {}) for key in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")]
        for adapter in sorted({a for table in tables for a in table}):
            tensors = [t for table in tables if adapter in table for t in _tensors_of(table[adapter])]
            if not any(id(t) in fresh for t in tensors):
                continue
            config = configs.get(adapter)
            init = getattr(config, "init_lora_weights", True)
            dora = bool(getattr(config, "use_dora", False))  # its magnitude vector is the base weight's norm
            if dora or (init.lower() if isinstance(init, str) else init) not in _LORA_INITS:
                what = "use_dora=True" if dora else f"init_lora_weights={init!r}"
                raise ValueError(
                    f"shard_fsdp_tp: the LoRA adapter {adapter!r} was built on the meta device (empty_init=True) "
                    f"with {what}, which peft computes from the base weights; it cannot be computed after "
                    "sharding. Call get_peft_model outside Trainer.init_module(empty_init=True)"
                    + ("" if dora else ", or use init_lora_weights=True / 'gaussian' / False")
                )
            if init is False:  # peft leaves the Linears' own initialisation (transformers' replaced it above)
                for table in tables[:2]:
                    if adapter in table:
                        table[adapter].reset_parameters()
            else:
                m.reset_lora_parameters(adapter, init)


def _tensors_of(entry: nn.Module | torch.Tensor) -> list[torch.Tensor]:
    return [entry] if isinstance(entry, torch.Tensor) else list(entry.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _fill_marker(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(False)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _holds_marker(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds ``_fill_marker``'s value somewhere (never for bool: no value marks it)."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).max).any())


def still_unset(model: nn.Module, names: list[str]) -> list[str]:
    """Of ``names`` (from ``materialize``), those whose tensor on this rank still holds the marker (bool
    buffers stay listed: nothing marks them)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    left = []
    for name in names:
        t = params.get(name, buffers.get(name))
        if t is None:
            continue
        if (t.dtype == torch.bool and name not in params) or _holds_marker(_local(t)):
            left.append(name)
    return left


def check_initialised(model: nn.Module, names: list[str], who: str = "shard_fsdp_tp") -> None:
    """Raise on every rank if a tensor ``materialize`` could not initialise still holds no value, after any
    checkpoint was loaded: one small all-gather (the ranks hold different shards, so each may list other
    names; call it on every rank whenever ``materialize`` returned a list, even an empty one).

    Example: ``check_initialised(model, materialize(model, device))`` (no error when every tensor is set).
    """
    left = still_unset(model, names)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        left = sorted({name for names_on_rank in comm.all_gather_objects(left) for name in names_on_rank})
    if not left:
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    kinds = [("parameters", [n for n in left if n in params]), ("buffers", [n for n in left if n not in params])]
    shown = "; ".join(
        f"{kind} " + ", ".join(repr(n) for n in group[:4]) + (f" and {len(group) - 4} more" if len(group) > 4 else "")
        for kind, group in kinds
        if group
    )
    fixes = []
    adapters = _peft_adapter_names(model, kinds[0][1])
    if adapters:
        fixes.append(
            f"{adapters[0]!r} and the like are peft adapter weights, whose initialisation the strategy runs only "
            "for LoRA: call get_peft_model outside Trainer.init_module(empty_init=True) / fabric.init_module("
            "empty_init=True) (on a model loaded without it), or use LoRA"
        )
    if kinds[0][1]:
        fixes.append(
            "give each owning module a reset_parameters() that sets its parameters (an RMSNorm holding "
            "nn.Parameter(torch.ones(d)): `def reset_parameters(self): torch.nn.init.ones_(self.weight)`)"
        )
    if kinds[1][1]:
        fixes.append(
            "build the model under Trainer.init_module(empty_init=True) / fabric.init_module(empty_init=True), "
            "which keep buffers real, rather than under torch.device('meta')"
        )
    fixes.append("load a checkpoint holding them before the first step (fit(..., ckpt_path=...))")
    fixes.append("or build the model without empty_init")
    raise RuntimeError(
        f"{who}: {shown} were built on the meta device and nothing gave them values: no reset_parameters() wrote "
        "them and no checkpoint loaded them, so they would train on placeholder values. Fix: " + "; ".join(fixes)
    )


def _peft_adapter_names(model: nn.Module, names: list[str]) -> list[str]:
    """The names among ``names`` of parameters that a peft tuner layer (a module with ``get_base_layer``, e.g.
    IA3's or LoHa's ``Linear``) holds beside its base layer."""
    modules = dict(model.named_modules())
    found = []
    for name in names:
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            owner = modules.get(".".join(parts[:i]))
            if owner is not None and callable(getattr(owner, "get_base_layer", None)):
                if parts[i] != "base_layer":
                    found.append(name)
                break
    return found


def broadcast_plain_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make every rank hold the values of the mesh's first rank (coordinate 0 on every dim) of every plain
    parameter and buffer, before sharding: one broadcast per mesh dimension, over the mesh's groups, which
    carry host tensors too (so an unsharded model stays on the host until it is sharded).

    Parameters go in registration order (which the ranks must share: FSDP lays them out in it), buffers in name
    order: a model may register its buffers in an order that differs per process (Cohere Compass's rotary tables,
    one per entry of a ``set`` of layer types, whose order follows the process's string hash seed), and paired by
    position one rank's sliding-window table received the other's full-attention values.

    Example: ``broadcast_plain_model(model, mesh)`` on a (2, 4) mesh: along dim 0, then along dim 1.
    """
    buffers = {}
    for _, b in sorted(model.named_buffers(remove_duplicate=False), key=lambda item: item[0]):
        buffers.setdefault(id(b), b)  # a buffer under several names once, at its first name in name order
    with torch.no_grad():
        for t in [*model.parameters(), *buffers.values()]:
            if not isinstance(t, DTensor) and not t.is_meta:
                for dim in range(mesh.ndim):
                    if mesh.size(dim) > 1:
                        with comm.host_collectives_for(t):  # a model built on the host stays there until sharded
                            comm.broadcast(t.data, 0, mesh.get_group(dim))


def check_no_drift(model: nn.Module) -> None:
    """Raise if a parameter is not a DTensor, or if replicated copies of a DTensor differ across ranks.

    One all-gather of a checksum vector per mesh dimension that replicates something.
    """
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(
            f"shard_fsdp_tp: parameters {plain[:5]} are neither sharded nor replicated DTensors after setup; they "
            "could drift apart across ranks. Remove them from ignored parameters or shard them."
        )
    by_group: dict[int, tuple[dist.ProcessGroup, list[tuple[str, torch.Tensor]], DTensor]] = {}
    for name, p in model.named_parameters():
        for i, placement in enumerate(p.placements):
            if placement.is_replicate() and p.device_mesh.size(i) > 1:
                group = p.device_mesh.get_group(i)
                by_group.setdefault(id(group), (group, [], p))[1].append((name, p.to_local().detach().double().sum()))
    for group, items, first in by_group.values():
        sums = torch.stack([s for _, s in items])  # on the parameters' device: the device the group serves
        with comm.host_collectives_for(first):  # CPU-offloaded parameters: their checksums are on the host
            gathered = comm.all_gather_list(sums, group)
        if not has_data(sums):
            continue  # fake tensors (the simulator): the collective ran, there are no values to compare
        gathered = [g.cpu() for g in gathered]
        for k, (name, _) in enumerate(items):
            values = [g[k].item() for g in gathered]
            if max(values) - min(values) > 1e-6 * max(1.0, abs(values[0])):
                raise RuntimeError(
                    f"shard_fsdp_tp: replicated parameter {name!r} differs across ranks (checksums {values}); "
                    "initialise the model identically on every rank (seed_everything) or build it on meta"
                )


def random_layer_skipping(model: nn.Module) -> list[str]:
    """Modules that skip layers at random in training (LayerDrop: a float attribute ``layerdrop`` > 0, as Hugging
    Face's BART, mBART, Whisper, M2M100, ... encoders and decoders hold it) by each rank's own draw. Under FSDP
    and TP every rank must skip the same layers or their collectives stop pairing up (a hang, or one layer's
    shards gathered into another's), so the strategy warns about them. Modules that ask Hugging Face's
    ``is_fsdp_managed_module`` first (wav2vec2, HuBERT, WavLM, ...) run every layer under ``fully_shard``, which
    marks its modules, and are not listed.

    Example: ``random_layer_skipping(bart)`` -> ``["model.encoder (BartEncoder, layerdrop=0.1)"]``.
    """
    found = []
    for name, m in model.named_modules():
        rate = getattr(m, "layerdrop", None)
        if not isinstance(rate, float) or rate <= 0 or _asks_fsdp(type(m)):
            continue
        found.append(f"{name or 'the model'} ({type(m).__name__}, layerdrop={rate})")
    return found


def _asks_fsdp(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "is_fsdp_managed_module" in source or "synced_gpus" in source
