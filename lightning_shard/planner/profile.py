"""One meta forward (+ loss) of the model at the real micro-batch: what it saves for backward, per module.

Everything the planner says about activations, activation checkpointing, sequence and loss parallelism, the
backward transient and FLOPs comes from this one run on the meta device (nothing is allocated):

* ``records``: every distinct storage autograd saves for backward (``saved_tensors_hooks``), attributed to
  the module path running when it was first saved; the loss's own saved tensors get the path ``("<loss>",)``.
* ``inputs``: per module, the bytes of its distinct tensor inputs (what non-reentrant checkpointing keeps).
* ``op_outputs``: per module path, the outputs of matmuls and attention in call order (for torchtitan's
  selective "op" checkpointing, which saves those and recomputes the rest).
* ``flops``: forward FLOPs from ``torch.utils.flop_counter.FlopCounterMode`` (plus the CPU flash attention
  the meta run uses, which the counter has no formula for); backward is twice forward.
* ``logits_numel``: elements of the tensor the loss is computed on (the full-vocabulary loss gradient).

Example::

    prof = profile_activations(model, precision="bf16-mixed", batch=2, seq_len=2048)
    prof.per_rank(plan, 2, ActivationOptions(checkpointing="full", sequence_parallel=True))
"""

from __future__ import annotations

import contextlib
import copy
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "ActivationOptions",
    "ActivationProfile",
    "SavedTensorCounter",
    "default_input",
    "default_loss",
    "profile_activations",
]

LOSS = "<loss>"
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}


@dataclass(frozen=True)
class ActivationOptions:
    """How activations are kept: checkpointing and the TP layout of what lies between the sharded regions.

    ``checkpointing``: ``None``; ``"full"`` (every block recomputed: the strategy's policy set to the block
    class); ``"selective-op"`` (torchtitan's default: inside each block keep matmul and attention outputs,
    recompute every second matmul and everything else); or a set of module classes (the strategy's
    ``activation_checkpointing_policy``: each instance's forward is recomputed, its inputs kept).
    ``sequence_parallel``: norms, residuals and block inputs sharded on the sequence over TP.
    ``loss_parallel``: the LM head's logits and the loss stay sharded over the vocabulary.

    Example: ``ActivationOptions("full", sequence_parallel=True)``.
    """

    checkpointing: str | frozenset | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        ac = self.checkpointing
        if isinstance(ac, (set, list, tuple)):
            object.__setattr__(self, "checkpointing", frozenset(ac))
        elif ac not in (None, "full", "selective-op") and not isinstance(ac, frozenset):
            raise ValueError(
                f"planner: activation_checkpointing={ac!r}; use None, 'full', 'selective-op' or a set of module "
                "classes (the strategy's activation_checkpointing_policy)"
            )

    @property
    def label(self) -> str:
        ac = self.checkpointing
        if ac is None:
            return "none"
        if isinstance(ac, frozenset):
            return "{" + ",".join(sorted(c.__name__ for c in ac)) + "}"
        return ac


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
        self.inputs: dict[str, int] = {}
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
            nbytes = local.untyped_storage().nbytes()
            self.records.append((tuple(self._stack), nbytes))
            # a backward measured later (_LiveBytes) gets these bytes back when the tensor is freed
            weakref.finalize(local.untyped_storage(), _saved_tensor_freed, nbytes)
        return t

    def __enter__(self) -> SavedTensorCounter:
        if self.model is not None:
            names = {id(m): n for n, m in self.model.named_modules()}

            def pre(mod, args):
                name = names.get(id(mod), "?")
                self._stack.append(name)
                if name not in self.inputs:  # what checkpointing this module would keep: its tensor inputs
                    keys = {}
                    for a in args:
                        if isinstance(a, torch.Tensor) and _storage_key(a) not in self.exclude:
                            keys[_storage_key(a)] = a.untyped_storage().nbytes()
                    self.inputs[name] = sum(keys.values())

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


class _OpLog(TorchDispatchMode):
    """Outputs of matmuls and attention, with the module path running (for selective-op checkpointing), and
    the FLOPs of the CPU flash attention the meta run uses (``FlopCounterMode`` has no formula for it)."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.outputs: list[tuple[tuple[str, ...], str, int]] = []
        self.attention_flops = 0
        self.causal_attention_flops = 0
        self.flops: list[tuple[tuple[str, ...], int]] = []  # (module path, forward FLOPs) per matmul/attention
        self.memory_bound: list[tuple[tuple[str, ...], int]] = []  # (module path, bytes written) other ops
        self.loss_log_softmax = False  # the loss runs a log-softmax (cross-entropy): loss parallel decomposes it

    def _memory_bound(self, args, kwargs, out) -> None:
        """Bytes a non-matmul op writes into new storage (views and in-place ops write none): eager
        elementwise and reduction kernels are bound by memory bandwidth, not FLOPs."""
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        seen = {_storage_key(t) for t in leaves if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in seen:
                seen.add(_storage_key(t))
                self.memory_bound.append((tuple(self.stack), t.untyped_storage().nbytes()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in _MATMULS and name not in _ATTENTION:
            self._memory_bound(args, kwargs, out)
        if name == "_log_softmax" and self.stack[-1:] == [LOSS]:
            self.loss_log_softmax = True
        if name in _MATMULS:
            self.outputs.append((tuple(self.stack), "mm", out.untyped_storage().nbytes()))
            a = args[1] if name in ("addmm", "baddbmm") else args[0]
            self.flops.append((tuple(self.stack), 2 * out.numel() * a.shape[-1]))
        elif name in _ATTENTION:
            q, k = args[0], args[1]
            flops = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]  # QK^T and PV
            if name == "_scaled_dot_product_flash_attention_for_cpu":
                self.attention_flops += flops
            causal = (kwargs or {}).get("is_causal", args[4] if len(args) > 4 else False)
            self.causal_attention_flops += flops // 2 if causal else flops
            self.flops.append((tuple(self.stack), flops))
            first = out[0] if isinstance(out, tuple) else out
            nbytes = sum(t.untyped_storage().nbytes() for t in (out if isinstance(out, tuple) else (out,))[:2])
            self.outputs.append((tuple(self.stack), "attention", nbytes or first.untyped_storage().nbytes()))
        return out


@dataclass
class ActivationProfile:
    """What one meta forward at the real micro-batch saved for backward, by module, plus module I/O shapes.

    ``records``: (module fqn path, bytes) per saved storage. ``io``: fqn -> (input numel, output numel) of
    every module (for TP communication). ``inputs``: fqn -> bytes of its tensor inputs. ``compute_size``:
    bytes per element of the compute dtype. ``flops``: forward FLOPs (model FLOPs, attention counted in full);
    ``hardware_flops``: the same with causal attention halved (what a flash kernel computes).

    Example: ``profile_activations(model, precision="bf16-mixed", batch=2, seq_len=2048).per_rank(plan, 2)``;
    ``estimate(..., activations=profile)`` reuses one profile across meshes.
    """

    records: list[tuple[tuple[str, ...], int]]
    io: dict[str, tuple[int, int]]
    compute_size: int
    batch: int
    seq_len: int
    embeddings: frozenset = frozenset()
    inputs: dict[str, int] = field(default_factory=dict)
    op_outputs: list[tuple[tuple[str, ...], str, int]] = field(default_factory=list)
    flops: int = 0
    hardware_flops: int = 0
    logits_numel: int = 0
    classes: dict[str, type] = field(default_factory=dict)
    blocks: tuple[str, ...] = ()
    flops_by_path: list[tuple[tuple[str, ...], int]] = field(default_factory=list)
    memory_bound: list[tuple[tuple[str, ...], int]] = field(default_factory=list)
    loss_forward: int = 0  # measured: bytes alive beyond the saved tensors while the loss runs (logits included)
    loss_backward: int = 0  # measured: peak bytes the loss's backward allocates (down to the logits' gradient)
    block_backward: int = 0  # measured: peak bytes the last block's backward allocates (input gradients only)
    head: tuple[str, ...] = ()  # modules run after the last block: their gradients exist before the blocks'
    head_overlap: float = 0.0  # measured: share of the head's weight gradients adding to the loss backward's peak
    loss_log_softmax: bool = False  # the loss runs a log-softmax (cross-entropy)
    attention: str = "flash"

    def memory_bound_bytes(self, plan: dict, tp: int, opts: ActivationOptions | None = None) -> int:
        """Per rank, bytes the forward's non-matmul ops write (sharded like the saved tensors of the same
        module: inside TP regions, and between them under SP, each rank computes its shard)."""
        opts = opts or ActivationOptions()
        return int(sum(b / tp if self._sharded(p, plan, opts, tp) else b for p, b in self.memory_bound))

    def recompute_fraction(self, opts: ActivationOptions | None = None) -> float:
        """Share of the forward FLOPs that checkpointing runs again in backward."""
        opts = opts or ActivationOptions()
        ckpt = set(self._checkpointed(opts))
        total = sum(f for _, f in self.flops_by_path)
        if not ckpt or not total:
            return 0.0
        inside = 0
        count: dict[str, int] = {}
        for (path, f), (_, kind, _) in zip(self.flops_by_path, self.op_outputs):
            o = next((p for p in path if p in ckpt), None)
            if o is None:
                continue
            if opts.checkpointing == "selective-op":
                if kind != "mm":
                    continue  # attention outputs are saved
                count[o] = count.get(o, 0) + 1
                if count[o] % 2:
                    continue  # odd matmuls saved, even ones recomputed
            inside += f
        return inside / total

    @property
    def total(self) -> int:
        return sum(b for _, b in self.records)

    # ------------------------------------------------------------------ per-rank bytes under TP / SP / LP / AC
    def _sharded(self, path: tuple[str, ...], plan: dict, opts: ActivationOptions, tp: int) -> bool:
        if tp == 1:
            return False
        if path and path[-1] == LOSS:
            return opts.loss_parallel
        if not plan:
            return False
        col, row, regions = _sharded_regions(plan)
        inner = path[-1] if path else ""
        if inner in self.embeddings:
            return False  # token ids and lookups
        if inner in col:
            # a column-parallel Linear saves its replicated input (gathered from the sequence shards under SP);
            # the LM head's logits stay sharded under loss parallel
            return False
        if inner in row:
            return True  # a row-parallel Linear saves its sharded input
        if any(p in regions for p in path):
            return True
        return opts.sequence_parallel  # norms, residuals between regions: sequence-sharded under SP

    def _checkpointed(self, opts: ActivationOptions) -> list[str]:
        """Outermost module fqns whose forward is recomputed in backward."""
        ac = opts.checkpointing
        if ac is None:
            return []
        if ac in ("full", "selective-op"):
            chosen = list(self.blocks)
        else:
            chosen = [f for f, cls in self.classes.items() if isinstance(cls, type) and issubclass(cls, tuple(ac))]
        chosen = sorted(chosen, key=len)
        outer: list[str] = []
        for f in chosen:
            if not any(f == o or f.startswith(o + ".") for o in outer):
                outer.append(f)
        return outer

    def breakdown(self, plan: dict, tp: int, opts: ActivationOptions | None = None) -> dict[str, int]:
        """Per-rank bytes: ``saved`` (alive from forward to backward) and ``recompute`` (the largest
        checkpointed module's saved bytes, rebuilt during its backward), ``block`` (one block's saved bytes
        without checkpointing: the activation gradients of the block running backward)."""
        opts = opts or ActivationOptions()
        ckpt = self._checkpointed(opts)
        col, _, regions = _sharded_regions(plan) if tp > 1 and plan else (set(), set(), set())

        def owner(path: tuple[str, ...]) -> str | None:
            return next((p for p in path if p in ckpt_set), None)

        ckpt_set = set(ckpt)
        saved = 0.0
        inside: dict[str, float] = {f: 0.0 for f in ckpt}
        per_block: dict[str, float] = {}
        for path, nbytes in self.records:
            b = nbytes / tp if self._sharded(path, plan, opts, tp) else nbytes
            blk = next((p for p in path if p in self.blocks), None)
            if blk is not None:
                per_block[blk] = per_block.get(blk, 0.0) + b
            o = owner(path)
            if o is None:
                saved += b
            else:
                inside[o] += b
        for f in ckpt:  # kept inputs of each checkpointed module
            inp = self.inputs.get(f, 0)
            replicated_input = f in regions or f in col or tp == 1 or not opts.sequence_parallel
            saved += inp if replicated_input else inp / tp
        if opts.checkpointing == "selective-op":
            # the outputs the policy saves are kept from forward; the recomputation rebuilds the rest only
            kept = self._selective_op_saved(plan, opts, tp, ckpt_set)
            saved += sum(kept.values())
            inside = {f: max(0.0, b - kept.get(f, 0.0)) for f, b in inside.items()}
        return {
            "saved": int(saved),
            "recompute": int(max(inside.values(), default=0.0)),
            "block": int(max(per_block.values(), default=0.0)),
        }

    def _selective_op_saved(self, plan: dict, opts: ActivationOptions, tp: int, ckpt: set[str]) -> dict[str, float]:
        """torchtitan's selective op policy: save attention outputs and every second matmul output per block.
        Per-rank bytes by checkpointed module."""
        col, row, regions = _sharded_regions(plan) if tp > 1 and plan else (set(), set(), set())
        kept: dict[str, float] = {}
        mm_count: dict[str, int] = {}
        for path, kind, nbytes in self.op_outputs:
            o = next((p for p in path if p in ckpt), None)
            if o is None:
                continue
            inner = path[-1] if path else ""
            if kind == "mm":
                mm_count[o] = mm_count.get(o, 0) + 1
                if mm_count[o] % 2 == 0:
                    continue  # recomputed: only every second matmul is saved
                sharded = inner in col or (inner in row and opts.sequence_parallel)
            else:
                sharded = any(p in regions for p in path)
            kept[o] = kept.get(o, 0.0) + (nbytes / tp if sharded and tp > 1 else nbytes)
        return kept

    def per_rank(self, plan: dict, tp: int, opts: ActivationOptions | None = None) -> int:
        """Saved bytes per rank when ``plan`` shards the model over ``tp`` ranks (see the module docstring)."""
        return self.breakdown(plan, tp, opts)["saved"]

    def loss_gradient_bytes(self, tp: int, opts: ActivationOptions | None = None, plan: dict | None = None) -> int:
        """Start of backward, at full vocabulary (sharded over TP only under loss parallel): the peak the
        backward from the loss down to the last block allocates, measured on the meta run (cross-entropy: the
        NLL gradient, dense fp32, and log-softmax's fp32 input gradient beside it, 8 bytes per logit). Without
        a measurement: that formula. With the logits all-gathered over TP (no loss parallel), the gather's
        backward also copies this rank's chunk of the logits' gradient while the whole gradient is alive."""
        opts = opts or ActivationOptions()
        shards = tp if opts.loss_parallel else 1
        measured = self.loss_backward or self.logits_numel * max(4 + 4, 4 + self.compute_size)
        gathered = self._gathered_logits(plan, tp, opts) * self.compute_size
        return max(measured // shards + self._decomposed_log_softmax(tp, opts), gathered + gathered // tp)

    def loss_forward_bytes(self, tp: int, opts: ActivationOptions | None = None, plan: dict | None = None) -> int:
        """End of forward: the logits and what the loss allocates beyond the tensors it saves (e.g. the fp32
        copy of bf16 logits), measured on the meta run; sharded over TP only under loss parallel. With the
        logits all-gathered over TP (no loss parallel), the gather along the vocabulary holds the local logits
        (sent as they lie: ``Redistribution.all_gather``), the gathered buffer and the logits laid out along the
        vocabulary: the larger of the two."""
        opts = opts or ActivationOptions()
        gathered = self._gathered_logits(plan, tp, opts) * self.compute_size
        local = self.loss_forward // (tp if opts.loss_parallel else 1) + self._decomposed_log_softmax(tp, opts)
        return max(local, 2 * gathered + gathered // tp)

    def _decomposed_log_softmax(self, tp: int, opts: ActivationOptions) -> int:
        """Loss parallel runs log-softmax and its backward as local ops around two all-reduces
        (``lightning_shard.tp.loss``, as torch's ``loss_parallel``) instead of the fused kernels the meta run
        measures: forward holds the shifted logits and their exponential beside the output, backward
        ``exp(out)`` and its product beside the result, each one fp32 tensor of the local logits more."""
        if tp == 1 or not opts.loss_parallel or not self.loss_log_softmax:
            return 0
        return 4 * self.logits_numel // tp

    def loss_saved_bytes(self, tp: int, opts: ActivationOptions | None = None) -> int:
        """Per rank, the loss's saved tensors (freed by the loss's backward, before any block's)."""
        opts = opts or ActivationOptions()
        return int(sum(b / tp if self._sharded(p, {}, opts, tp) else b for p, b in self.records if p[-1:] == (LOSS,)))

    def block_backward_bytes(self, plan: dict, tp: int, opts: ActivationOptions | None = None) -> int:
        """Per rank, what one block's backward allocates for activation gradients: measured at ``tp = 1`` on
        the meta run, scaled like the block's saved bytes under TP / SP; without a measurement, one block's
        saved bytes."""
        per_rank = self.breakdown(plan, tp, opts)["block"]
        if not self.block_backward:
            return per_rank
        whole = self.breakdown({}, 1, ActivationOptions())["block"]
        return int(self.block_backward * per_rank / whole) if whole else self.block_backward

    def _gathered_logits(self, plan: dict | None, tp: int, opts: ActivationOptions) -> int:
        """Elements of the largest output TP all-gathers in forward (the logits without loss parallel)."""
        if tp == 1 or not plan:
            return 0
        return max((t.elements for t in self.tp_transfers(plan, tp, opts) if t.kind == "all_gather"), default=0)

    def tp_comm(self, plan: dict, tp: int, opts: ActivationOptions | None = None) -> dict[str, int]:
        """Bytes each rank sends into TP collectives per step (forward + backward), by collective kind.

        Under sequence parallelism each all-reduce becomes a reduce-scatter plus an all-gather of the same
        total volume; it is reported as ``all_reduce``. Loss parallel drops the logits all-gather.
        """
        sent = {"all_reduce": 0, "all_gather": 0}
        if tp == 1 or not plan:
            return sent
        for t in self.tp_transfers(plan, tp, opts):  # an all-gather sends this rank's chunk of the output
            sent[t.kind] += (-(-t.elements // tp) if t.kind == "all_gather" else t.elements) * self.compute_size
        return sent

    def tp_transfers(self, plan: dict, tp: int, opts: ActivationOptions | None = None) -> list[TPTransfer]:
        """The TP collectives of one step, one entry per module (``elements``: the collective's tensor, i.e. the
        reduced tensor or the gathered output, per call):

        =====================================  ===================================================
        plan entry                             collective
        =====================================  ===================================================
        ``RowwiseParallel``                    forward all-reduce of the partial output
        ``ColwiseParallel``, plain input       backward all-reduce of the partial input gradient
        ``ColwiseParallel`` under a module     none of its own: the enclosing module's
        whose ``PrepareModuleInput`` hands     ``PrepareModuleInput`` redistributes the input once,
        it a DTensor (q/k/v, gate/up)          so one backward all-reduce per region
        ``ColwiseParallel``, replicated out    forward all-gather of the output (not with loss parallel)
        =====================================  ===================================================
        """
        opts = opts or ActivationOptions()
        regions = _shared_input_regions(plan)
        region_input: dict[str, int] = {}
        out: list[TPTransfer] = []
        for fqn, style in flat_styles(plan):
            kind = type(style).__name__
            if fqn not in self.io:
                continue
            n_in, n_out = self.io[fqn]
            if kind == "RowwiseParallel":
                out.append(TPTransfer("all_reduce", n_out, fqn, forward=True))
            elif kind == "ColwiseParallel":
                if fqn in regions:
                    region_input[regions[fqn]] = max(region_input.get(regions[fqn], 0), n_in)
                else:
                    out.append(TPTransfer("all_reduce", n_in, fqn, forward=False))
                layout = getattr(style, "output_layouts", (None,))[0]
                if layout is not None and layout.is_replicate() and not opts.loss_parallel:
                    out.append(TPTransfer("all_gather", n_out, fqn, forward=True))
        out += [TPTransfer("all_reduce", n, region, forward=False) for region, n in region_input.items()]
        return out


@dataclass(frozen=True)
class TPTransfer:
    """One TP collective of a step: ``kind`` (``"all_reduce"``/``"all_gather"``), ``elements`` of its tensor (the
    reduced tensor, or the whole gathered output) per call, the module ``fqn`` it belongs to, and whether it
    runs in forward (then recomputed under activation checkpointing).

    Example: ``TPTransfer("all_reduce", 4096, "layers.0.attention", forward=False)``.
    """

    kind: str
    elements: int
    fqn: str
    forward: bool


def flat_styles(plan: dict) -> list[tuple[str, object]]:
    """``(fqn, style)`` for every style of a TP plan, where an entry may be a tuple of styles (e.g. a
    ``PrepareModuleInput`` with the ``DivideAttributes`` of an attention module).

    Example: ``flat_styles({"attn": (prepare, divide)})`` -> ``[("attn", prepare), ("attn", divide)]``.
    """
    return [(fqn, s) for fqn, entry in plan.items() for s in (entry if isinstance(entry, tuple) else (entry,))]


def _shared_input_regions(plan: dict) -> dict[str, str]:
    """Column-parallel fqn -> its parent's fqn, where the parent's ``PrepareModuleInput`` hands it a DTensor
    input (``use_local_output=False``): the region's input gradients are summed locally and reduced once."""
    prepared = {
        fqn
        for fqn, s in flat_styles(plan)
        if type(s).__name__ == "PrepareModuleInput" and not getattr(s, "use_local_output", True)
    }
    return {
        fqn: fqn.rpartition(".")[0]
        for fqn, s in flat_styles(plan)
        if type(s).__name__ == "ColwiseParallel" and fqn.rpartition(".")[0] in prepared
    }


def _sharded_regions(plan: dict) -> tuple[set[str], set[str], set[str]]:
    """(column-parallel fqns, row-parallel fqns, region fqns whose inner activations TP shards)."""
    styles = flat_styles(plan)
    col = {f for f, s in styles if type(s).__name__ == "ColwiseParallel"}
    row = {f for f, s in styles if type(s).__name__ == "RowwiseParallel"}
    regions = {f for f, s in styles if type(s).__name__ == "DivideAttributes"}
    for f in col:
        out = getattr(plan[f], "output_layouts", (None,))[0]
        if out is not None and out.is_shard():
            regions.add(f.rpartition(".")[0])
    return col, row, regions


def _cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    memo: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            m._parameters[name] = memo[id(p)]


_MEASURING: list[_LiveBytes] = []  # the _LiveBytes blocks running now


def _saved_tensor_freed(nbytes: int) -> None:
    for tracker in _MEASURING:
        tracker.live -= nbytes


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create inside the block that are still alive, less the saved tensors (counted
    by a ``SavedTensorCounter``) that die inside it, and the peak of that (each storage counted from its
    creation until it is freed). Works on meta tensors, whose storages have sizes.

    Example::

        with _LiveBytes() as during:
            torch.autograd.grad(loss, logits)
        during.peak   # bytes the loss's backward needs above what was alive before it
    """

    def __enter__(self):
        _MEASURING.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _MEASURING.remove(self)
        return super().__exit__(*exc)

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {_storage_key(t) for t in leaves if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not hasattr(t, "_local_tensor"):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._seen and key not in inputs:  # views and in-place results allocate nothing
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


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


@contextlib.contextmanager
def _hugging_face_on_meta():
    """Hugging Face's mask builder looks for packed sequences in the position ids with a data-dependent check
    (``tensor.all()`` -> ``bool``), which meta tensors cannot answer. A training batch built from token ids
    holds one sequence per row: answer "not packed" for meta position ids while the planner runs."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if isinstance(position_ids, torch.Tensor) and position_ids.is_meta:
            return None
        return original(position_ids, *args, **kwargs)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _cast_inputs(dtype: torch.dtype):
    def hook(module, args, kwargs):
        def cast(t):
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook


def default_input(model: nn.Module, batch: int, seq_len: int, device) -> tuple:
    """Token ids ``(batch, seq_len)`` for the model's first ``nn.Embedding`` (a ``ValueError`` without one)."""
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError(
            "planner: cannot guess the model's input (no nn.Embedding); pass example_input=lambda batch, seq_len, "
            "device: (tensor, ...)"
        )
    return (torch.randint(0, emb.num_embeddings, (batch, seq_len), device=device),)


def _logits_of(output):
    """The tensor a language-model loss is computed on: a tensor, the first of a tuple/list, a dict's or a
    Hugging Face ``ModelOutput``'s ``logits`` (else its first tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor) and "logits" not in output:
        return output["loss"]  # a training_step's {"loss": ...}
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    values = output.values() if isinstance(output, dict) else output
    if hasattr(output, "to_tuple"):
        values = output.to_tuple()
    first = next((v for v in values if isinstance(v, torch.Tensor)), None) if not isinstance(output, str) else None
    if first is None:
        raise TypeError(
            f"planner: cannot find a tensor in the model's output ({type(output).__name__}); pass "
            "loss_fn=lambda output: <scalar tensor>"
        )
    return first


def default_loss(output) -> torch.Tensor:
    """Cross-entropy on the logits (upcast to fp32, as language-model losses do), or the sum of a non-logit
    output. Understands tensors, tuples, dicts and Hugging Face outputs (their ``.loss`` when the model
    computed one, e.g. given ``labels``; else cross-entropy on ``.logits``)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    out = _logits_of(output)
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
    step: Callable | None = None,
    attention: str = "flash",
) -> ActivationProfile:
    """Run forward (and the loss) of a meta copy of ``model`` in the compute dtype; record saved tensors,
    module inputs, matmul/attention outputs and FLOPs; then the loss's backward down to the logits, for its
    transient. ``step(meta_model, inputs) -> output`` replaces the call ``meta_model(*inputs)`` (e.g. a
    LightningModule's ``training_step``). ``attention``: ``"flash"`` (what GPUs and CPUs run: the flash kernel
    saves q, k, v, the output and the log-sum-exp) or ``"math"`` (the unfused path, which keeps the
    ``B x H x S x S`` scores; what the simulator's stand-in device runs).

    Example: ``estimate(model, (4, 2), batch=2, seq_len=2048, activations=profile_activations(model,
    precision="32-true", batch=2, seq_len=2048))`` reuses one profile across meshes (see the module docstring).
    """
    if attention not in ("flash", "math"):
        raise ValueError(f"planner: attention={attention!r}; use 'flash' (GPUs, CPUs) or 'math' (unfused)")
    from lightning_shard.planner.estimate import find_blocks, precision_dtypes

    _, compute, _ = precision_dtypes(precision)
    meta = copy.deepcopy(model).to(device="meta")
    _cast_params(meta, compute)  # as FSDP's mixed precision does: parameters only, buffers keep their dtype
    inputs = (example_input or (lambda b, t, d: default_input(meta, b, t, d)))(batch, seq_len, torch.device("meta"))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    io: dict[str, tuple[int, int]] = {}
    names = {id(m): n for n, m in meta.named_modules()}

    def record_io(mod, args, out):
        n_in = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
        o = out[0] if isinstance(out, (tuple, list)) else out
        io.setdefault(names[id(mod)], (n_in, o.numel() if isinstance(o, torch.Tensor) else 0))

    handles = [m.register_forward_hook(record_io) for m in meta.modules()]
    units = [*find_blocks(meta), meta]
    if compute != torch.float32:  # FSDP casts each unit's floating inputs to the compute dtype (cast_forward_inputs)
        handles += [u.register_forward_pre_hook(_cast_inputs(compute), with_kwargs=True) for u in units]
    last_block: list = []  # (input, output) of the last block's forward, for its backward transient
    after_blocks: list[str] = []  # modules whose forward starts after the last block's (the LM head, ...)
    blocks_of_meta = find_blocks(meta)
    if blocks_of_meta:
        handles.append(blocks_of_meta[-1].register_forward_hook(lambda m, a, o: last_block.append((a, o))))
        handles += [
            m.register_forward_pre_hook(lambda m, a: after_blocks.append(names[id(m)]) if last_block else None)
            for m in meta.modules()
        ]
    flop_counter = FlopCounterMode(display=False)
    try:
        with SavedTensorCounter(meta) as counter, flop_counter:
            oplog = _OpLog(counter._stack)
            routing = _FlashAttentionOnMeta() if attention == "flash" else contextlib.nullcontext()
            with oplog, routing, _hugging_face_on_meta():
                if step is not None:
                    out = step(meta, inputs)
                else:
                    kwargs = inputs[-1] if inputs and isinstance(inputs[-1], dict) else None
                    out = meta(*inputs[:-1], **kwargs) if kwargs is not None else meta(*inputs)
                counter._stack[:] = [LOSS]
                logits = _logits_of(out)
                saved_before_loss = counter.total
                with _LiveBytes() as in_loss:
                    loss = (loss_fn or default_loss)(out)
                counter._stack[:] = []
        last = last_block[-1] if last_block else None
        head = tuple(dict.fromkeys(after_blocks))
        head_params = [q for f in head for q in meta.get_submodule(f).parameters(recurse=False) if q.requires_grad]
        loss_forward, loss_backward, head_overlap = _loss_transients(
            logits, loss, in_loss.peak, counter.total - saved_before_loss, _block_output(last), head_params
        )
        block_backward = _block_backward_transient(last)
    finally:
        for h in handles:
            h.remove()
    embeddings = frozenset(n for n, m in meta.named_modules() if isinstance(m, nn.Embedding))
    flops = flop_counter.get_total_flops() + oplog.attention_flops
    matmul_flops = flops - oplog.attention_flops - _counted_attention(flop_counter)
    return ActivationProfile(
        counter.records,
        io,
        torch.empty((), dtype=compute, device="meta").element_size(),
        batch,
        seq_len,
        embeddings,
        inputs=dict(counter.inputs),
        op_outputs=oplog.outputs,
        flops=int(flops),
        hardware_flops=int(matmul_flops + oplog.causal_attention_flops),
        logits_numel=logits.numel() if logits.is_floating_point() and logits.ndim >= 2 else 0,
        classes={n: type(m) for n, m in meta.named_modules()},
        blocks=tuple(names[id(b)] for b in find_blocks(meta)),
        flops_by_path=oplog.flops,
        memory_bound=oplog.memory_bound,
        loss_forward=loss_forward,
        loss_backward=loss_backward,
        block_backward=block_backward,
        attention=attention,
        head=head,
        head_overlap=head_overlap,
        loss_log_softmax=oplog.loss_log_softmax,
    )


def _block_output(io) -> torch.Tensor | None:
    if io is None:
        return None
    out = io[1]
    y = out[0] if isinstance(out, (tuple, list)) and out else out
    return y if isinstance(y, torch.Tensor) and y.requires_grad else None


def _block_backward_transient(io) -> int:
    """Peak bytes one block's backward allocates for its activation gradients, measured by running it on meta
    (the incoming gradient included; weight gradients excluded: FSDP's unsharded gradients are counted apart).
    Conservative: the block's saved tensors, freed as its backward proceeds, are counted as still alive.
    Zero when the block's input or output is not a single differentiable tensor."""
    if io is None:
        return 0
    x = next((a for a in io[0] if isinstance(a, torch.Tensor) and a.requires_grad), None)
    y = _block_output(io)
    if x is None or y is None:
        return 0
    grad = torch.ones_like(y)
    try:
        with _LiveBytes() as in_backward:
            torch.autograd.grad(y, x, grad)
    except Exception:  # e.g. the graph was already freed by a custom step: one block's saved bytes stand in
        return 0
    return grad.untyped_storage().nbytes() + in_backward.peak


def _loss_transients(
    logits: torch.Tensor,
    loss,
    peak_in_loss: int,
    saved_in_loss: int,
    block_output: torch.Tensor | None,
    head_params: list[torch.Tensor],
) -> tuple[int, int, float]:
    """(forward, backward) bytes of the loss beyond the tensors it saves: in forward the logits plus the
    peak of what the loss allocated, less what it saved (counted with the activations); in backward the peak
    that the backward from the loss down to the last block's output (the loss, the LM head's input gradient,
    the final norm; the head's weight gradient is FSDP's, counted apart) needs above what was alive before,
    run here on meta at no cost; and the share of the head's weight gradients that adds to that peak (all
    when the loss gradient is still alive as they are computed, as in fp32; none when a cast freed it first).
    Zero when the step's output is not a logits tensor the loss differentiates."""
    if not (isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.ndim >= 2):
        return 0, 0, 0.0
    forward = logits.untyped_storage().nbytes() + max(0, peak_in_loss - saved_in_loss)
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad and logits.requires_grad):
        return forward, 0, 0.0
    target = block_output if block_output is not None else logits
    try:
        with _LiveBytes() as in_backward:
            torch.autograd.grad(loss, target, retain_graph=bool(head_params))
        if not head_params:
            return forward, in_backward.peak, 0.0
        with _LiveBytes() as with_head:  # again, also computing the head's weight gradients, kept to the end
            grads = torch.autograd.grad(loss, [target, *head_params])
    except Exception:  # a loss or model whose backward cannot run on meta: the formula stands in
        return forward, 0, 0.0
    head = sum(g.untyped_storage().nbytes() for g in grads[1:])
    return forward, in_backward.peak, min(1.0, max(0, with_head.peak - in_backward.peak) / head) if head else 0.0


def _counted_attention(counter: FlopCounterMode) -> int:
    """FLOPs the counter itself attributed to attention ops (CUDA kernels on a real run)."""
    total = 0
    for op, flops in counter.get_flop_counts().get("Global", {}).items():
        if getattr(op, "__name__", str(op)) in _ATTENTION:
            total += flops
    return total
