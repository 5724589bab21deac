"""Per-rank memory and communication of one training step on a ``(dp, tp)`` mesh, before allocating anything.

Where each number comes from (the engine's real layout, not a rule of thumb):

* **Parameters, gradients**: one FSDP group per block (the repeated block class) plus the root group (the
  rest, tied parameters once). Each group is laid out with the engine's own ``numba_kernels.GroupLayout``
  on the TP-local shapes (``planned_placements`` of the ``auto_tp_plan`` styles), so the padding to
  ``ceil(dim0 / dp)`` rows per parameter is exactly what ``group.shard_flat`` and ``group.grad_flat`` hold.
  Gradients live in the master dtype (fp32 unless ``*-true`` precision).
* **Optimizer state**: per trainable parameter, on its *unpadded* local shard (torch optimizers allocate
  ``zeros_like(param)``): SGD with momentum 1x, Adam/AdamW 2x, plus Adam's fp32 ``step`` scalar.
* **Unsharded working set**: a group's unsharded flat buffer (compute dtype) is alive between unshard and
  reshard. The root stays unsharded from forward to the end of backward; in backward the current block and
  the prefetched next one are unsharded together, plus the current block's unsharded gradients (compute
  dtype) and at most two groups' reduce-scatter staging buffers: the engine finishes the previous group's
  reduce-scatter (freeing its staging) before the next block stages its gradients (``FSDPState.post_backward``);
  only the root, staged in the final callback, overlaps the first block's.
* **Buffers**: registered buffers (causal masks, rotary tables) are neither sharded nor offloaded.
* **Activations**: tensors saved for backward, measured by running the model's forward on the meta device
  (a deep copy cast to the compute dtype: nothing is allocated) at the real micro-batch and sequence length,
  with ``saved_tensors_hooks`` counting distinct storages (parameters and buffers excluded). Each saved
  tensor is attributed to the module running when it was saved, so TP's effect is applied per region:
  inside attention/MLP modules whose projections TP shards, the bytes divide by ``tp``; norms, residuals,
  embeddings and logits stay replicated unless sequence parallelism (norms, residuals) or loss parallelism (the
  loss) shards them. Activation checkpointing, the backward transient and FLOPs: see ``planner.profile``.
* **Peak**: ``device_total`` is the largest of four phase peaks (setup, forward, backward, optimizer), each
  the sum of the terms alive together (see :func:`_phase_peaks`); checked against the fake-tensor simulator
  by ``benchmarks/planner_vs_simulator.py``.
* **Communication** (bytes each rank *sends into* collectives, the convention of
  ``lightning_shard.comm.count_collectives``): FSDP all-gathers of ``shard_numel`` elements (compute dtype)
  per group, twice for resharded blocks and once for the root; one reduce-scatter of ``dp * shard_numel``
  elements (reduce dtype) per trainable group. TP: one all-reduce of the output of every row-parallel module
  (forward), of the input gradient of every column-parallel one (backward), and the all-gather of a
  replicated LM head's logits; their shapes come from the same meta forward.

Example::

    with torch.device("meta"):
        model = MyLlama()
    est = estimate(model, (4, 2), precision="bf16-mixed", batch=8, seq_len=2048)
    print(est.summary())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_shard.fsdp.units import find_repeated_blocks
from lightning_shard.planner.profile import (
    ActivationOptions,
    ActivationProfile,
    SavedTensorCounter,
    default_input,
    default_loss,
    profile_activations,
)
from numba_kernels import GroupLayout

# the names measure.py and earlier callers import from here
_default_input, _default_loss = default_input, default_loss

__all__ = [
    "Estimate",
    "ActivationOptions",
    "ActivationProfile",
    "estimate",
    "find_blocks",
    "precision_dtypes",
    "profile_activations",
    "SavedTensorCounter",
    "tp_plan_for",
]

# precision -> (master/shard dtype, compute dtype, reduce dtype); mirrors strategies/precision.py (the engine
# cannot import strategies: layering).
_PRECISIONS = {
    "32-true": (torch.float32, torch.float32, torch.float32),
    "32": (torch.float32, torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.bfloat16, torch.float32),
    "16-mixed": (torch.float32, torch.float16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16, torch.float32),
    "16-true": (torch.float16, torch.float16, torch.float32),
    "64-true": (torch.float64, torch.float64, torch.float64),
    "64": (torch.float64, torch.float64, torch.float64),
}
_OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-nomomentum": 0}


def precision_dtypes(precision: str) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """``(master, compute, reduce)`` dtypes of a Lightning precision string, as the strategy maps them."""
    if precision not in _PRECISIONS:
        raise ValueError(f"planner: precision={precision!r} is not one of {sorted(_PRECISIONS)}")
    return _PRECISIONS[precision]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


# ---------------------------------------------------------------------------------------------- blocks
def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The FSDP units the strategy wraps (``lightning_shard.fsdp.units.find_repeated_blocks``).

    Example: ``find_blocks(llama)`` -> the ``LlamaBlock`` modules.
    """
    return find_repeated_blocks(model)


# ---------------------------------------------------------------------------------------------- TP layout
def tp_plan_for(model: nn.Module, tp: int) -> dict:
    """``auto_tp_plan(model, tp)`` (empty for ``tp == 1``); a ``RuntimeError`` when TP is unavailable."""
    if tp == 1:
        return {}
    try:
        from lightning_shard.tp import auto_tp_plan
    except ImportError as e:  # pragma: no cover - TP is part of the engine
        raise RuntimeError(f"planner: tensor parallelism is unavailable ({e}); plan with tp=1") from e
    return auto_tp_plan(model, tp)


def _tp_local_shapes(model: nn.Module, plan: dict, tp: int) -> dict[int, torch.Size]:
    """id(param) -> the TP-local shape of TP rank 0 (``torch.chunk`` semantics: the largest local shard)."""
    shapes: dict[int, torch.Size] = {}
    for fqn, style in plan.items():
        planned = getattr(style, "planned_placements", None)
        if planned is None:
            continue
        module = model.get_submodule(fqn)
        for name, placements in planned(module).items():
            p = module._parameters.get(name)
            if p is None:
                continue
            shape = list(p.shape)
            for pl in placements:
                if pl.is_shard():
                    d = pl.dim % len(shape)
                    shape[d] = -(-shape[d] // tp)
            shapes[id(p)] = torch.Size(shape)
    return shapes


# ---------------------------------------------------------------------------------------------- estimate
@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: ``nbytes`` is the full buffer each call moves (the all-gather output,
    the reduce-scatter input, the all-reduce tensor), ``ranks`` the group size, ``scope`` which mesh dimension
    (``"fsdp"``, ``"tp"``, ``"replicate"``), ``calls`` how many per step, ``overlapped`` whether the engine
    runs it beside compute (FSDP prefetch and the asynchronous reduce-scatter) or on the critical path.

    Example: ``Collective("all_gather", nbytes=516000, ranks=2, scope="fsdp")`` is one all-gather per step of a
    516,000-byte output over 2 ranks, one of ``estimate(...).collectives``.
    """

    kind: str
    nbytes: int
    ranks: int
    scope: str
    calls: int = 1
    overlapped: bool = True


@dataclass
class Estimate:
    """Per-rank bytes of one training step on ``mesh = (dp, tp)`` (see the module docstring for each term).

    ``device_total`` is what must fit on one device; ``cpu_bytes`` is what CPU offload moves to host memory.
    ``comm`` maps collective kind to bytes each rank sends per step; ``collectives`` lists them for the time
    model. ``replicas``: HSDP replica count (parameters shard over ``dp // replicas`` ranks).

    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000))   # 129,000 fp32 parameters
    >>> est = estimate(model, (2, 1), batch=2, seq_len=16)
    >>> est.mesh, est.params, est.comm["all_gather"]    # half of the 516,000 bytes per rank, and what it sends
    ((2, 1), 258000, 258000)
    """

    mesh: tuple[int, int]
    params: int
    grads: int
    optimizer: int
    unsharded_group: int
    unsharded_groups_alive: int
    unsharded_working_set: int
    reduce_scatter_staging: int
    activations: int
    backward_transient: int
    comm: dict[str, int]
    buffers: int = 0
    cpu_offload: bool = False
    groups: int = 0
    details: dict = field(default_factory=dict)
    replicas: int = 1
    options: ActivationOptions = field(default_factory=ActivationOptions)
    reshard_after_forward: bool | int = True
    collectives: list[Collective] = field(default_factory=list)
    tokens: int = 0  # tokens one rank's step processes (its TP group's micro-batch)
    model_flops: int = 0  # this rank's share of forward + backward FLOPs, without recomputation
    hardware_flops: int = 0  # what the rank computes: causal attention halved, plus recomputation
    transient_parts: dict = field(default_factory=dict)
    memory_bound_bytes: int = 0  # bytes the forward's non-matmul ops write on this rank (time model)
    phases: dict = field(default_factory=dict)  # peak bytes per phase: setup, forward, backward, optimizer

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def cpu_bytes(self) -> int:
        return self.model_states if self.cpu_offload else 0

    @property
    def device_total(self) -> int:
        """The step's peak on the device: the largest of the phase peaks (``phases``)."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def comm_total(self) -> int:
        return sum(self.comm.values())

    @property
    def config(self) -> str:
        """``dp x tp``, HSDP replicas, checkpointing, SP/LP, reshard and offload, in one short label."""
        o = self.options
        parts = [f"{self.mesh[0]}x{self.mesh[1]}"]
        if self.replicas > 1:
            parts.append(f"hsdp {self.replicas}x{self.mesh[0] // self.replicas}")
        parts.append(f"ac={o.label}")
        if o.sequence_parallel:
            parts.append("sp")
        if o.loss_parallel:
            parts.append("lp")
        if self.reshard_after_forward is False:
            parts.append("no-reshard")
        elif not isinstance(self.reshard_after_forward, bool):
            parts.append(f"reshard={self.reshard_after_forward}")
        if self.cpu_offload:
            parts.append("offload")
        return " ".join(parts)

    def summary(self) -> str:
        rows = [
            ("sharded params", self.params),
            ("sharded grads", self.grads),
            ("optimizer state", self.optimizer),
            (f"unsharded working set ({self.unsharded_groups_alive} groups)", self.unsharded_working_set),
            ("reduce-scatter staging", self.reduce_scatter_staging),
            (f"activations (saved for backward, ac={self.options.label})", self.activations),
            ("backward transient", self.backward_transient),
            ("buffers (unsharded)", self.buffers),
        ]
        rows += [(f"peak in {phase}", v) for phase, v in self.phases.items()]
        rows.append((f"device total (peak, in {self.peak_phase})", self.device_total))
        lines = [f"mesh {self.config}" + (" (CPU offload)" if self.cpu_offload else "")]
        lines += [f"  {name:<52} {format_bytes(v):>10}" for name, v in rows]
        if self.cpu_offload:
            lines.append(f"  {'host memory (offloaded model states)':<52} {format_bytes(self.cpu_bytes):>10}")
        lines.append(f"  {'communication per step':<52} {format_bytes(self.comm_total):>10}")
        lines.append(
            "  not modelled: a pipeline-parallel axis (the engine has none); these are allocated bytes, the "
            "caching allocator's reserved bytes are simulated (planner.simulated_reserved)"
        )
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """A byte count in binary units, as the planner's tables print it.

    >>> format_bytes(512), format_bytes(3 * 2**30)
    ('512 B', '3.00 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _groups(model: nn.Module, blocks: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    """Parameters per FSDP group: one per block, then the root (the rest); tied parameters once."""
    seen: set[int] = set()
    groups = []
    for unit in [*blocks, model]:
        params = []
        for p in unit.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        groups.append(params)
    return groups


def estimate(
    model: nn.Module,
    mesh_shape: tuple[int, int],
    *,
    precision: str = "32-true",
    batch: int,
    seq_len: int,
    cpu_offload: bool = False,
    reshard_after_forward: bool | int = True,
    optimizer: str = "adamw",
    example_input: Callable | None = None,
    loss_fn: Callable | None = None,
    activations: ActivationProfile | None = None,
    tp_plan: dict | None = None,
    activation_checkpointing: str | set | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    replicas: int = 1,
    step: Callable | None = None,
) -> Estimate:
    """Per-rank bytes of one training step of ``model`` (on the meta device) on a ``(dp, tp)`` mesh.

    ``batch`` is the micro-batch of one data-parallel rank (what each rank's DataLoader yields; the ranks of
    one TP group share it). ``optimizer``: ``"adamw"``, ``"adam"``, ``"sgd"`` (momentum) or
    ``"sgd-nomomentum"``. ``example_input(batch, seq_len, device) -> tuple`` and ``loss_fn(output)`` describe
    the step when the defaults (token ids for the first embedding; cross-entropy on the logits) do not fit.
    ``activations`` reuses a :func:`profile_activations` result across meshes. ``reshard_after_forward`` as in
    ``fully_shard``; an int ``k`` counts the ``k``-way shards held from forward to backward and gathered then.
    ``activation_checkpointing``: ``None``, ``"full"``, ``"selective-op"`` or the strategy's policy (a set of
    module classes), see :class:`ActivationOptions`. ``replicas``: HSDP replica groups (``HYBRID_SHARD``):
    model states shard over ``dp // replicas`` ranks and gradients are all-reduced across replicas.

    Example::

        est = estimate(model, (8, 1), precision="bf16-mixed", batch=4, seq_len=2048,
                       activation_checkpointing="full")
        est.device_total, est.comm
    """
    dp, tp = (int(mesh_shape[0]), int(mesh_shape[1])) if len(mesh_shape) == 2 else (int(mesh_shape[0]), 1)
    if dp < 1 or tp < 1:
        raise ValueError(f"planner: mesh_shape={tuple(mesh_shape)} must be positive (dp, tp)")
    if replicas < 1 or dp % replicas:
        raise ValueError(f"planner: replicas={replicas} must be >= 1 and divide data-parallel size {dp}")
    n_states = _OPTIMIZERS.get(optimizer.lower())
    if n_states is None:
        raise ValueError(f"planner: optimizer={optimizer!r} is not one of {sorted(_OPTIMIZERS)}")
    opts = ActivationOptions(activation_checkpointing, sequence_parallel, loss_parallel)
    shard = dp // replicas  # ranks one parameter is sharded over (HSDP: within a replica group)
    master, compute, reduce = precision_dtypes(precision)
    m_size, c_size, r_size = _size(master), _size(compute), _size(reduce)
    plan = tp_plan if tp_plan is not None else tp_plan_for(model, tp)
    local = _tp_local_shapes(model, plan, tp)
    blocks = find_blocks(model)
    groups = _groups(model, blocks)
    layouts = [
        # a 0-dim parameter: one copy per rank, as FSDPParam.layout_shape lays it out
        GroupLayout([s if len(s) else torch.Size([shard]) for s in (local.get(id(p), p.shape) for p in g)], shard)
        if g
        else None
        for g in groups
    ]

    params = grads = optim = 0
    staging_of: list[int] = []  # per group, 0 when it has no trainable parameters
    unsharded: list[int] = []
    for params_of_group, layout in zip(groups, layouts):
        if layout is None:
            unsharded.append(0)
            staging_of.append(0)
            continue
        params += layout.shard_numel * m_size
        trainable = [i for i, p in enumerate(params_of_group) if p.requires_grad]
        if trainable:
            grads += layout.shard_numel * m_size
            staging_of.append(_staging_bytes(layout, r_size, direct=reduce == master and not cpu_offload))
            local_numel = sum(layout.local_rows(i, 0) * layout.inner_numels[i] for i in trainable)
            optim += n_states * local_numel * m_size
            if optimizer.lower().startswith("adam"):
                optim += 4 * len(trainable)  # fp32 step counter per parameter
        else:
            staging_of.append(0)
        unsharded.append(layout.unsharded_numel * c_size)

    staging = _staging_alive(staging_of)
    root_unsharded = unsharded[-1]
    block_unsharded = unsharded[:-1]
    largest_block = max(block_unsharded, default=0)
    post_forward_size = _post_forward_size(reshard_after_forward, shard)
    if reshard_after_forward:
        alive_blocks = min(2, len(block_unsharded))  # the current block and the prefetched next one
        blocks_bytes = largest_block * alive_blocks
        if post_forward_size:  # every block's k-way slice, held from its forward to its backward
            blocks_bytes += sum(-(-u // post_forward_size) for u in block_unsharded)
    else:
        alive_blocks = len(block_unsharded)
        blocks_bytes = sum(block_unsharded)
    # Backward also holds the current block's unsharded gradients and the root's (compute dtype).
    working = root_unsharded + blocks_bytes + largest_block + root_unsharded
    if cpu_offload:  # each all-gather first copies the shard to the device (current + prefetched group)
        working += 2 * max((lay.shard_numel for lay in layouts if lay is not None), default=0) * m_size

    profile = activations or profile_activations(
        model, precision=precision, batch=batch, seq_len=seq_len, example_input=example_input, loss_fn=loss_fn,
        step=step,
    )  # fmt: skip
    parts = profile.breakdown(plan, tp, opts)
    # Backward transient: at its start the full-vocabulary loss gradient; later, while a block runs backward,
    # its activation gradients (about its own saved bytes) plus, under checkpointing, its recomputed forward.
    transient = {
        "loss_gradient": profile.loss_gradient_bytes(tp, opts, plan),
        "block_backward": profile.block_backward_bytes(plan, tp, opts) + parts["recompute"],
    }
    on_device = not cpu_offload
    head_params = {id(p): p for fqn in profile.head for p in model.get_submodule(fqn).parameters(recurse=False)}
    head_grads = sum(local.get(i, p.shape).numel() for i, p in head_params.items() if p.requires_grad) * c_size
    setup = _setup_peak(model, blocks, groups, layouts, m_size, on_device, tp)
    phases = _phase_peaks(
        PhaseTerms(
            params=params if on_device else 0,
            optimizer=optim if on_device else 0,
            grads=grads if on_device else 0,
            buffers=buffer_bytes(model, precision),
            setup=setup,
            root=root_unsharded,
            head_grads=min(head_grads, root_unsharded),
            head_overlap=int(min(head_grads, root_unsharded) * profile.head_overlap),
            block=largest_block,
            gathered=largest_block * alive_blocks if reshard_after_forward else 0,
            held=sum(block_unsharded) if not reshard_after_forward else blocks_bytes - largest_block * alive_blocks,
            offload_copy=(working - (root_unsharded + blocks_bytes + largest_block + root_unsharded)) // 2,
            saved=parts["saved"],
            loss_saved=profile.loss_saved_bytes(tp, opts),
            block_saved=parts["block"] if not opts.checkpointing else 0,
            loss_forward=profile.loss_forward_bytes(tp, opts, plan),
            loss_gradient=transient["loss_gradient"],
            block_backward=transient["block_backward"],
            block_staging=max(staging_of[:-1], default=0),
            block_grads=max((lay.shard_numel * m_size for lay in layouts[:-1] if lay is not None), default=0)
            if on_device
            else 0,
            staging=staging,
            optimizer_temporaries=(2 if optimizer.lower().startswith("adam") else 0)
            * max((n for lay in layouts if lay is not None for n in _local_sizes(lay)), default=0)
            * m_size
            * on_device,
        )
    )

    collectives = _collectives(groups, layouts, shard, replicas, tp, c_size, r_size, reshard_after_forward,
                               post_forward_size, profile, plan, opts)  # fmt: skip
    comm = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for c in collectives:
        if c.scope == "tp":
            continue
        per_call = c.nbytes // c.ranks if c.kind == "all_gather" else c.nbytes  # count_collectives convention
        comm[c.kind] += per_call * c.calls
    tp_comm = profile.tp_comm(plan, tp, opts)
    comm["all_gather"] += tp_comm["all_gather"]
    comm["all_reduce"] += tp_comm["all_reduce"]

    model_flops = 3 * profile.flops // tp  # backward = 2x forward
    recompute = profile.recompute_fraction(opts)
    hardware = (3 + recompute) * profile.hardware_flops / tp
    return Estimate(
        mesh=(dp, tp),
        params=params,
        grads=grads,
        optimizer=optim,
        unsharded_group=largest_block or root_unsharded,
        unsharded_groups_alive=1 + alive_blocks,
        unsharded_working_set=working,
        reduce_scatter_staging=staging,
        activations=parts["saved"],
        backward_transient=max(transient.values()),
        comm=comm,
        buffers=buffer_bytes(model, precision),
        cpu_offload=cpu_offload,
        groups=len([g for g in groups if g]),
        details={
            "blocks": len(blocks),
            "block_class": type(blocks[0]).__name__ if blocks else None,
            "recompute_fraction": recompute,
        },
        replicas=replicas,
        options=opts,
        reshard_after_forward=reshard_after_forward,
        collectives=collectives,
        tokens=batch * seq_len,
        model_flops=int(model_flops),
        hardware_flops=int(hardware),
        transient_parts=transient,
        memory_bound_bytes=profile.memory_bound_bytes(plan, tp, opts),
        phases=phases,
    )


def _setup_peak(model, blocks, groups, layouts, m_size: int, on_device: bool, tp: int) -> int:
    """Peak bytes of materialising the sharded model (``to_empty``), buffers aside. ``Module._apply`` visits
    children before a module's own parameters, so each block is rebuilt in turn (its new local tensors and its
    flat shard; the unsharded buffer gets its bytes only at the first all-gather), while the root's
    parameters in modules registered before the first block (the embedding) already have their new local
    tensors; the root is rebuilt last, beside every block's shard. Under CPU offload the shards go to the
    host, the local tensors are on the device."""
    flats = [lay.shard_numel * m_size if lay is not None and on_device else 0 for lay in layouts]
    locals_ = [sum(_local_sizes(lay)) * m_size if lay is not None else 0 for lay in layouts]
    names = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    first = min((names[id(b)] for b in blocks), default=None)
    ancestors = {id(m) for m in model.modules() if any(b is m or _contains(m, b) for b in blocks[:1])}
    before = {id(p) for m in model.modules() if first is not None and names[id(m)] < first
              and id(m) not in ancestors for p in m.parameters(recurse=False)}  # fmt: skip
    # reset_parameters on a sharded parameter draws the whole tensor (lightning_shard.tensor.ops.random fills a
    # full-size tensor and copies this rank's part out of a view of it): one full copy of the largest parameter
    # beside every shard; under FSDP over TP (a strided shard, no view) redistributing the draw copies it once
    # more. Measured on the simulator (tests/test_planner_simulator.py).
    copies = 2 if tp > 1 else 1
    init = copies * max((p.numel() for p in model.parameters()), default=0) * m_size if on_device else 0
    root_layout, root_params = layouts[-1], groups[-1]
    early = 0
    if root_layout is not None:
        sizes = _local_sizes(root_layout)
        early = sum(n for p, n in zip(root_params, sizes) if id(p) in before) * m_size
    peak = max(sum(flats) + locals_[-1], sum(flats) + init)  # the root, last; then initialisation
    done = 0
    for i in range(len(blocks)):
        done += flats[i]
        peak = max(peak, early + done + locals_[i])
    return peak


def _contains(module: nn.Module, block: nn.Module) -> bool:
    return any(m is block for m in module.modules())


def _local_sizes(layout: GroupLayout) -> list[int]:
    return [layout.local_rows(i, 0) * layout.inner_numels[i] for i in range(len(layout.shapes))]


@dataclass(frozen=True)
class PhaseTerms:
    """Per-rank bytes that the phase peaks combine (see :func:`_phase_peaks`). ``params``, ``optimizer``,
    ``grads``: on the device (0 under CPU offload). ``setup``: the materialisation's peak (see
    :func:`_setup_peak`). ``root``/``block``: one
    unsharded group (compute dtype). ``head_grads``: the root's unsharded gradients that exist before the
    blocks' backward (parameters of the modules run after the last block: the LM head, the final norm), of
    which ``head_overlap`` coincide with the loss gradient's peak. ``gathered``: blocks unsharded around the
    running one (current + prefetched, when resharding). ``held``: block parameters kept from forward to backward
    (``reshard_after_forward=False``: all blocks; ``=k``: their k-way slices). ``saved``: activations at the
    end of forward, of which ``loss_saved`` the loss's and ``block_saved`` one block's (0 under checkpointing:
    a checkpointed block keeps only its input). ``block_staging``/``block_grads``: one block's reduce-scatter
    staging and sharded gradients. ``staging``: the most staging alive at once (end of backward).
    ``offload_copy``: under CPU offload, one group's shard copied to the device for its all-gather, freed
    once the all-gather is issued."""

    params: int
    optimizer: int
    grads: int
    buffers: int
    setup: int
    root: int
    head_grads: int
    head_overlap: int
    block: int
    gathered: int
    held: int
    offload_copy: int
    saved: int
    loss_saved: int
    block_saved: int
    loss_forward: int
    loss_gradient: int
    block_backward: int
    block_staging: int
    block_grads: int
    staging: int
    optimizer_temporaries: int


def _phase_peaks(t: PhaseTerms) -> dict[str, int]:
    """Peak bytes on the device per phase of a steady-state step (the optimizer state exists; ``zero_grad``
    freed the gradients, which come back group by group as backward reduces them):

    ========== ==========================================================================================
    setup      see :func:`_setup_peak`
    forward    states + buffers + the root unsharded (from the first to the last forward) + held blocks +
               every saved activation + the loss's transient (logits, fp32 copy)
    backward   the largest of: the loss's backward down to the last block (saved activations + the loss
               gradient + the share of the head's gradients alive at its peak); the first and
               second block's backward (the root's unsharded parameters, the head's gradients, the current and
               prefetched blocks, the current block's unsharded gradients, its activation gradients, and
               for the second the first's reduce-scatter staging and sharded gradients, less the activations
               already freed); under CPU offload, a block's all-gather (its shard copied to the device beside
               the gathered blocks); the end (all gradients, the last groups' staging, the root and its
               gradients)
    optimizer  states + all gradients + the optimizer's temporaries (the engine's DTensors take torch's
               for-loop AdamW: ``sqrt`` and the denominator of the largest parameter)
    ========== ==========================================================================================
    """
    base = t.params + t.optimizer + t.buffers
    activations = t.saved - t.loss_saved
    blocks = [
        base + t.root + t.head_grads + t.held + t.gathered + t.block + activations
        - k * t.block_saved + t.block_backward + k * (t.block_staging + t.block_grads)
        for k in (0, 1)
    ]  # fmt: skip
    return {
        "setup": t.setup + t.buffers,
        "forward": base + t.root + t.held + t.saved + t.loss_forward,
        "backward": max(
            base + t.root + t.head_overlap + t.held + t.saved + t.loss_gradient,
            *blocks,
            base + t.root + t.head_grads + t.held + t.gathered + activations + t.offload_copy,
            base + t.grads + t.staging + 2 * t.root,
        ),
        "optimizer": base + t.grads + t.optimizer_temporaries,
    }


def _collectives(groups, layouts, shard, replicas, tp, c_size, r_size, reshard, post_forward_size, profile, plan,
                 opts) -> list[Collective]:  # fmt: skip
    """The step's collectives: FSDP all-gathers and reduce-scatters per group, HSDP's all-reduce across
    replicas, TP's all-reduces and all-gathers (on the critical path: the engine runs them synchronously)."""
    out: list[Collective] = []
    last = len(groups) - 1
    for i, (g, layout) in enumerate(zip(groups, layouts)):
        if layout is None:
            continue
        gathered = layout.shard_numel * shard * c_size
        if i == last or not reshard:
            out.append(Collective("all_gather", gathered, shard, "fsdp", 1, overlapped=i != last))
        elif post_forward_size:
            out.append(Collective("all_gather", gathered, shard, "fsdp", 1))
            k_layout = GroupLayout(layout.shapes, post_forward_size)
            out.append(Collective("all_gather", k_layout.shard_numel * post_forward_size * c_size,
                                  post_forward_size, "fsdp", 1))  # fmt: skip
        else:
            out.append(Collective("all_gather", gathered, shard, "fsdp", 2))
        if any(p.requires_grad for p in g):
            out.append(Collective("reduce_scatter", shard * layout.shard_numel * r_size, shard, "fsdp", 1))
            if replicas > 1:
                out.append(Collective("all_reduce", layout.shard_numel * r_size, replicas, "replicate", 1))
    if tp > 1:
        recompute = 1 if opts.checkpointing in ("full", "selective-op") else 0  # recomputed forward collectives
        for t in profile.tp_transfers(plan, tp, opts):
            in_block = any(t.fqn.startswith(b + ".") for b in profile.blocks)
            calls = 1 + (recompute if t.forward and t.kind == "all_reduce" and in_block else 0)
            out.append(Collective(t.kind, t.elements * profile.compute_size, tp, "tp", calls, False))
    return out


def _staging_bytes(layout: GroupLayout, reduce_size: int, *, direct: bool) -> int:
    """One group's reduce-scatter staging: the ``(dp, shard_numel)`` input in the reduce dtype, plus a separate
    shard-sized output unless the reduce-scatter writes straight into the gradient buffer (no cast, no offload;
    ``FSDPParamGroup._direct_reduce_output``), where the output is the sharded gradient itself."""
    extra = 0 if direct else layout.shard_numel * reduce_size
    return layout.world_size * layout.shard_numel * reduce_size + extra


def _staging_alive(staging_of: list[int]) -> int:
    """Most staging bytes alive at once, given each group's (blocks in forward order, then the root).

    ``FSDPState.post_backward`` finishes the previous group's reduce-scatter before a block stages its own,
    so during backward one block's staging is alive at a time. The root's inputs do not require grad, so its
    reduce-scatter starts in the final callback, which has already forgotten the last reducing group: the
    staging of the first block (the last one reduced) is still alive then. At most two at once.
    """
    *blocks, root = staging_of
    alone = max(staging_of, default=0)
    return max(alone, (blocks[0] if blocks else 0) + root)


def buffer_bytes(model: nn.Module, precision: str) -> int:
    """Bytes of the model's registered buffers (e.g. causal masks, rotary tables) on every rank: FSDP and TP
    leave buffers unsharded. ``*-true`` precisions cast floating buffers with the model; mixed ones keep them."""
    master, _, _ = precision_dtypes(precision)
    total, seen = 0, set()
    for b in model.buffers():
        if id(b) in seen:
            continue
        seen.add(id(b))
        dtype = master if b.is_floating_point() and precision.endswith("-true") else b.dtype
        total += b.numel() * _size(dtype)
    return total


def heads_of(model: nn.Module) -> set[int]:
    """Attention head counts found on submodules (query and key/value heads), for TP divisibility."""
    names = ("n_heads", "num_heads", "n_head", "num_attention_heads", "nhead", "n_kv_heads",
             "num_key_value_heads", "num_kv_heads", "n_kv_head")  # fmt: skip
    found: set[int] = set()
    for m in model.modules():
        for n in names:
            v = getattr(m, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                found.add(v)
        if isinstance(m, nn.MultiheadAttention):
            found.add(m.num_heads)
    return found


def dims_divisible(model: nn.Module, plan: dict, tp: int) -> list[str]:
    """Names of TP-sharded block parameters whose sharded dimension ``tp`` does not divide (empty: all good).

    Embeddings and the LM head may split unevenly (``torch.chunk`` semantics, the engine handles it); the
    projections inside blocks must split evenly (heads and hidden units are reshaped per rank).
    """
    bad = []
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in find_blocks(model)]
    for fqn, style in plan.items():
        planned = getattr(style, "planned_placements", None)
        if planned is None or not any(fqn.startswith(b + ".") for b in block_names):
            continue
        module = model.get_submodule(fqn)
        if isinstance(module, nn.Embedding):
            continue
        for name, placements in planned(module).items():
            p = module._parameters.get(name)
            for pl in placements:
                if p is not None and pl.is_shard() and p.shape[pl.dim % p.ndim] % tp:
                    bad.append(f"{fqn}.{name} dim {pl.dim % p.ndim} = {p.shape[pl.dim % p.ndim]}")
    return bad


def _post_forward_size(reshard_after_forward: bool | int, dp: int) -> int | None:
    """The ``k`` of ``reshard_after_forward=k`` when it keeps a smaller shard (1 < k < dp), else None."""
    if isinstance(reshard_after_forward, bool) or reshard_after_forward in (1, dp):
        return None
    return int(reshard_after_forward)
