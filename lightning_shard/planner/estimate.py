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
  dtype) and one group's reduce-scatter staging buffer: the engine finishes the previous group's reduce-scatter
  (freeing its staging) before the next group stages its gradients (``FSDPState.post_backward``).
* **Buffers**: registered buffers (causal masks, rotary tables) are neither sharded nor offloaded.
* **Activations**: tensors saved for backward, measured by running the model's forward on the meta device
  (a deep copy cast to the compute dtype: nothing is allocated) at the real micro-batch and sequence length,
  with ``saved_tensors_hooks`` counting distinct storages (parameters and buffers excluded). Each saved
  tensor is attributed to the module running when it was saved, so TP's effect is applied per region:
  inside attention/MLP modules whose projections TP shards, the bytes divide by ``tp``; norms, residuals,
  embeddings and logits stay replicated (no sequence parallelism).
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

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shard.fsdp.units import find_repeated_blocks
from numba_kernels import GroupLayout

__all__ = [
    "Estimate",
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


def _style_kind(style) -> str:
    return type(style).__name__


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


def _is_sharded_region(plan: dict) -> tuple[set[str], set[str], set[str]]:
    """(column-parallel fqns, row-parallel fqns, region fqns whose inner activations TP shards)."""
    col = {f for f, s in plan.items() if _style_kind(s) == "ColwiseParallel"}
    row = {f for f, s in plan.items() if _style_kind(s) == "RowwiseParallel"}
    regions = {f for f, s in plan.items() if _style_kind(s) == "DivideAttributes"}
    for f in col:
        out = getattr(plan[f], "output_layouts", (None,))[0]
        if out is not None and out.is_shard():
            regions.add(f.rpartition(".")[0])
    return col, row, regions


# ---------------------------------------------------------------------------------------------- activations
class SavedTensorCounter:
    """Context manager counting the bytes of distinct storages autograd saves for backward.

    ``exclude`` holds storage keys (``untyped_storage()._cdata``) not to count (parameters, buffers). Each
    storage is attributed to the innermost module running when it is first saved (``records``:
    ``(module fqn path, bytes)``). DTensors count their local tensor. Works on meta and real tensors alike,
    so the planner's meta run and a measured run count the same thing.

    Example::

        with SavedTensorCounter(model) as counter:
            loss = model(x).sum()
        counter.total
    """

    def __init__(self, model: nn.Module | None = None, exclude: set[int] | None = None) -> None:
        self.exclude = set(exclude or ())
        self.model = model
        if model is not None:
            self.exclude |= {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        self.records: list[tuple[tuple[str, ...], int]] = []
        self._seen: set[int] = set()
        self._stack: list[str] = []
        self._handles: list = []
        self._hooks = None

    @property
    def total(self) -> int:
        return sum(b for _, b in self.records)

    def _pack(self, t: torch.Tensor):
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        key = _storage_key(local)
        if key not in self.exclude and key not in self._seen:
            self._seen.add(key)
            self.records.append((tuple(self._stack), local.untyped_storage().nbytes()))
        return t

    def __enter__(self) -> SavedTensorCounter:
        if self.model is not None:
            names = {id(m): n for n, m in self.model.named_modules()}

            def pre(mod, args):
                self._stack.append(names.get(id(mod), "?"))

            def post(mod, args, out):
                if self._stack:
                    self._stack.pop()

            for m in self.model.modules():
                self._handles.append(m.register_forward_pre_hook(pre))
                self._handles.append(m.register_forward_hook(post))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []


def _storage_key(t: torch.Tensor) -> int:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.untyped_storage()._cdata


@dataclass
class ActivationProfile:
    """What one meta forward at the real micro-batch saved for backward, by module, plus module I/O shapes.

    ``records``: (module fqn path, bytes) per saved storage. ``io``: fqn -> (input numel, output numel) of
    every module (for TP communication). ``compute_size``: bytes per element of the compute dtype.
    """

    records: list[tuple[tuple[str, ...], int]]
    io: dict[str, tuple[int, int]]
    compute_size: int
    batch: int
    seq_len: int
    embeddings: frozenset = frozenset()

    @property
    def total(self) -> int:
        return sum(b for _, b in self.records)

    def per_rank(self, plan: dict, tp: int) -> int:
        """Saved bytes per rank when ``plan`` shards the model over ``tp`` ranks (see module docstring)."""
        if tp == 1 or not plan:
            return self.total
        col, row, regions = _is_sharded_region(plan)
        total = 0.0
        for path, nbytes in self.records:
            inner = path[-1] if path else ""
            if inner in col:
                sharded = False  # a column-parallel Linear saves its replicated input
            elif inner in row and inner not in self.embeddings:
                sharded = True  # a row-parallel Linear saves its sharded input
            else:
                sharded = any(p in regions for p in path)
            total += nbytes / tp if sharded else nbytes
        return int(total)

    def tp_comm(self, plan: dict, tp: int) -> dict[str, int]:
        """Bytes each rank sends into TP collectives per step (forward + backward), by collective kind."""
        reduce = gather = 0
        if tp == 1 or not plan:
            return {"all_reduce": 0, "all_gather": 0}
        for fqn, style in plan.items():
            kind = _style_kind(style)
            if fqn not in self.io:
                continue
            n_in, n_out = self.io[fqn]
            if kind == "RowwiseParallel":
                reduce += n_out  # forward all-reduce of the partial output
            elif kind == "ColwiseParallel":
                reduce += n_in  # backward all-reduce of the partial input gradient
                out = getattr(style, "output_layouts", (None,))[0]
                if out is not None and out.is_replicate():
                    gather += -(-n_out // tp)  # forward all-gather of the sharded output
        return {"all_reduce": reduce * self.compute_size, "all_gather": gather * self.compute_size}


def _cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    memo: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            m._parameters[name] = memo[id(p)]


class _FlashAttentionOnMeta(torch.overrides.TorchFunctionMode):
    """On meta, ``F.scaled_dot_product_attention`` would fall back to the math path (which saves the
    attention matrix); real CPU and CUDA runs use a flash kernel that saves q, k, v, the output and the
    log-sum-exp. Route meta calls to the CPU flash op so the saved bytes are the ones a real run keeps."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if q.is_meta and mask is None:
                # GQA: the flash kernel reads the shared key/value heads without expanding them
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q,
                    k,
                    v,
                    kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0),
                    kwargs.get("is_causal", args[5] if len(args) > 5 else False),
                    scale=kwargs.get("scale"),
                )[0]
        return func(*args, **kwargs)


def _default_input(model: nn.Module, batch: int, seq_len: int, device) -> tuple:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError(
            "planner: cannot guess the model's input (no nn.Embedding); pass example_input=lambda batch, seq_len, "
            "device: (tensor, ...)"
        )
    return (torch.randint(0, emb.num_embeddings, (batch, seq_len), device=device),)


def _default_loss(output) -> torch.Tensor:
    out = output[0] if isinstance(output, (tuple, list)) else output
    if out.ndim >= 2 and out.is_floating_point():
        logits = out.reshape(-1, out.shape[-1]).float()
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits, target)
    return out.float().sum()


def profile_activations(
    model: nn.Module,
    *,
    precision: str,
    batch: int,
    seq_len: int,
    example_input: Callable | None = None,
    loss_fn: Callable | None = None,
) -> ActivationProfile:
    """Run forward (and the loss) of a meta copy of ``model`` in the compute dtype; record saved tensors."""
    _, compute, _ = precision_dtypes(precision)
    meta = copy.deepcopy(model).to(device="meta")
    _cast_params(meta, compute)  # as FSDP's mixed precision does: parameters only, buffers keep their dtype
    inputs = (example_input or (lambda b, t, d: _default_input(meta, b, t, d)))(batch, seq_len, torch.device("meta"))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    io: dict[str, tuple[int, int]] = {}
    names = {id(m): n for n, m in meta.named_modules()}

    def record_io(mod, args, out):
        n_in = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
        o = out[0] if isinstance(out, (tuple, list)) else out
        io.setdefault(names[id(mod)], (n_in, o.numel() if isinstance(o, torch.Tensor) else 0))

    handles = [m.register_forward_hook(record_io) for m in meta.modules()]
    try:
        with SavedTensorCounter(meta) as counter, _FlashAttentionOnMeta():
            out = meta(*inputs)
            (loss_fn or _default_loss)(out)
    finally:
        for h in handles:
            h.remove()
    embeddings = frozenset(n for n, m in meta.named_modules() if isinstance(m, nn.Embedding))
    return ActivationProfile(counter.records, io, _size(compute), batch, seq_len, embeddings)


# ---------------------------------------------------------------------------------------------- estimate
@dataclass
class Estimate:
    """Per-rank bytes of one training step on ``mesh = (dp, tp)`` (see the module docstring for each term).

    ``device_total`` is what must fit on one device; ``cpu_bytes`` is what CPU offload moves to host memory.
    ``comm`` maps collective kind to bytes each rank sends per step.
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

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def cpu_bytes(self) -> int:
        return self.model_states if self.cpu_offload else 0

    @property
    def device_total(self) -> int:
        states = 0 if self.cpu_offload else self.model_states
        return (
            states
            + self.unsharded_working_set
            + self.reduce_scatter_staging
            + self.activations
            + self.backward_transient
            + self.buffers
        )

    @property
    def comm_total(self) -> int:
        return sum(self.comm.values())

    def summary(self) -> str:
        rows = [
            ("sharded params", self.params),
            ("sharded grads", self.grads),
            ("optimizer state", self.optimizer),
            (f"unsharded working set ({self.unsharded_groups_alive} groups)", self.unsharded_working_set),
            ("reduce-scatter staging", self.reduce_scatter_staging),
            ("activations (saved for backward)", self.activations),
            ("backward transient", self.backward_transient),
            ("buffers (unsharded)", self.buffers),
            ("device total", self.device_total),
        ]
        lines = [f"mesh dp={self.mesh[0]} x tp={self.mesh[1]}" + (" (CPU offload)" if self.cpu_offload else "")]
        lines += [f"  {name:<42} {format_bytes(v):>10}" for name, v in rows]
        lines.append(f"  {'communication per step':<42} {format_bytes(self.comm_total):>10}")
        return "\n".join(lines)


def format_bytes(n: float) -> str:
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
) -> Estimate:
    """Per-rank bytes of one training step of ``model`` (on the meta device) on a ``(dp, tp)`` mesh.

    ``batch`` is the micro-batch of one data-parallel rank (what each rank's DataLoader yields; the ranks of
    one TP group share it). ``optimizer``: ``"adamw"``, ``"adam"``, ``"sgd"`` (momentum) or
    ``"sgd-nomomentum"``. ``example_input(batch, seq_len, device) -> tuple`` and ``loss_fn(output)`` describe
    the step when the defaults (token ids for the first embedding; cross-entropy on the logits) do not fit.
    ``activations`` reuses a :func:`profile_activations` result across meshes. ``reshard_after_forward`` as in
    ``fully_shard``; an int ``k`` counts the ``k``-way shards held from forward to backward and gathered then.

    Example::

        est = estimate(model, (8, 1), precision="bf16-mixed", batch=4, seq_len=2048)
        est.device_total, est.comm
    """
    dp, tp = (int(mesh_shape[0]), int(mesh_shape[1])) if len(mesh_shape) == 2 else (int(mesh_shape[0]), 1)
    if dp < 1 or tp < 1:
        raise ValueError(f"planner: mesh_shape={tuple(mesh_shape)} must be positive (dp, tp)")
    n_states = _OPTIMIZERS.get(optimizer.lower())
    if n_states is None:
        raise ValueError(f"planner: optimizer={optimizer!r} is not one of {sorted(_OPTIMIZERS)}")
    master, compute, reduce = precision_dtypes(precision)
    m_size, c_size, r_size = _size(master), _size(compute), _size(reduce)
    plan = tp_plan if tp_plan is not None else tp_plan_for(model, tp)
    local = _tp_local_shapes(model, plan, tp)
    blocks = find_blocks(model)
    groups = _groups(model, blocks)

    params = grads = optim = 0
    staging_of: list[int] = []  # per group, 0 when it has no trainable parameters
    unsharded: list[int] = []
    for params_of_group in groups:
        if not params_of_group:
            unsharded.append(0)
            staging_of.append(0)
            continue
        shapes = [local.get(id(p), p.shape) for p in params_of_group]
        shapes = [s if len(s) else torch.Size([1]) for s in shapes]
        layout = GroupLayout(shapes, dp)
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
    post_forward_size = _post_forward_size(reshard_after_forward, dp)
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

    profile = activations or profile_activations(
        model, precision=precision, batch=batch, seq_len=seq_len, example_input=example_input, loss_fn=loss_fn
    )
    acts = profile.per_rank(plan, tp)
    # Gradients of the activations of the block running backward (roughly its own saved bytes).
    per_block = acts / max(1, len(blocks)) if blocks else 0

    comm: dict[str, int] = {}
    ag = rs = 0
    for i, params_of_group in enumerate(groups):
        if not params_of_group:
            continue
        shapes = [local.get(id(p), p.shape) for p in params_of_group]
        layout = GroupLayout([s if len(s) else torch.Size([1]) for s in shapes], dp)
        is_root = i == len(groups) - 1
        if is_root or not reshard_after_forward:
            ag += layout.shard_numel * c_size
        elif post_forward_size:  # forward over all dp ranks, backward over k of them (k-way shard sent)
            ag += (layout.shard_numel + GroupLayout(layout.shapes, post_forward_size).shard_numel) * c_size
        else:
            ag += 2 * layout.shard_numel * c_size
        if any(p.requires_grad for p in params_of_group):
            rs += dp * layout.shard_numel * r_size
    tp_comm = profile.tp_comm(plan, tp)
    comm["all_gather"] = ag + tp_comm["all_gather"]
    comm["reduce_scatter"] = rs
    comm["all_reduce"] = tp_comm["all_reduce"]

    return Estimate(
        mesh=(dp, tp),
        params=params,
        grads=grads,
        optimizer=optim,
        unsharded_group=largest_block or root_unsharded,
        unsharded_groups_alive=1 + alive_blocks,
        unsharded_working_set=working,
        reduce_scatter_staging=staging,
        activations=acts,
        backward_transient=int(per_block),
        comm=comm,
        buffers=buffer_bytes(model, precision),
        cpu_offload=cpu_offload,
        groups=len([g for g in groups if g]),
        details={"blocks": len(blocks), "block_class": type(blocks[0]).__name__ if blocks else None},
    )


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
