"""Name the plan when a half-complete tensor-parallel plan fails in forward.

A hand-written plan that makes q/k/v column-parallel but leaves ``o_proj`` out, shards ``up_proj`` but not
``down_proj``, or puts ``ColwiseParallel`` where ``RowwiseParallel`` belongs hands a local column shard (a
``ColwiseParallel`` output with ``use_local_output=True``) to code that expects the whole tensor, or the whole
tensor to a ``RowwiseParallel`` Linear that takes it as a shard. Either ends in a shape error deep in the
model's forward (a ``view`` by the head count, a matmul, a broadcast) that names neither the plan nor a fix.
No static check can tell which module consumes a Linear's output (that is the model's own code), so this
watches the forward instead: it records column shards handed on and not yet consumed by a ``RowwiseParallel``
Linear, and ``RowwiseParallel`` Linears that took a plain input with no column shard pending. When forward
raises in a planned module or one of its ancestors while either is recorded, the error gets a note (Python's
``add_note``; the original error and traceback stay) naming those modules, their styles and the fix.
A forward that succeeds is left alone: code may consume a column shard itself, on purpose.

Example::

    parallelize_module(attn, tp_mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                       "v_proj": ColwiseParallel()})          # o_proj forgotten
    attn(x)   # RuntimeError: shape '[2, 8, 4, 8]' is invalid ...
              # + note: "tensor-parallel plan: ColwiseParallel on 'q_proj', ... no RowwiseParallel ..."
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_shard.tp.style import ColwiseParallel, ParallelStyle, RowwiseParallel

_NOTE = "tensor-parallel plan:"


@dataclass
class _Watch:
    """What one ``parallelize_module`` call's forward has handed on so far (reset by each consumer)."""

    styles: dict[str, str]
    # Ordered sets (dict keys), bounded by the plan's size however many forwards run.
    pending: dict[str, None] = field(default_factory=dict)  # ColwiseParallel outputs no RowwiseParallel consumed
    orphans: dict[str, None] = field(default_factory=dict)  # RowwiseParallel Linears that found no pending shard

    def note(self, where: str, module: nn.Module) -> str | None:
        parts = []
        if self.pending:
            names = ", ".join(repr(n) for n in self.pending)
            parts.append(
                f"ColwiseParallel on {names} handed on a local column shard (use_local_output=True, output "
                f"Shard(-1)) that no RowwiseParallel module consumed before this error in {where!r} "
                f"({type(module).__name__}). A column-parallel output must reach the RowwiseParallel module that "
                "consumes it (attention: q/k/v_proj -> o_proj; MLP: up/gate_proj -> down_proj; with every "
                "producer of that module's input column-parallel), or be gathered with "
                "ColwiseParallel(output_layouts=Replicate()); code that reshapes by a head count also needs "
                "DivideAttributes (or use tp_plan='auto' / auto_tp_plan)"
            )
            if self.styles.get(where) == "ColwiseParallel":
                parts.append(f"{where!r} consumes a column shard, so it is RowwiseParallel, not ColwiseParallel")
        if self.orphans:
            names = ", ".join(repr(n) for n in self.orphans)
            parts.append(
                f"RowwiseParallel on {names} took a plain input as a column shard (input_layouts=Shard(-1)) "
                "but no ColwiseParallel module had produced one: plan the Linears that produce its input "
                "ColwiseParallel, or give it input_layouts=Replicate() if its input is the whole tensor"
            )
        return f"{_NOTE} " + "; ".join(parts) if parts else None


def _hands_on_shard(style: ParallelStyle) -> bool:
    return isinstance(style, ColwiseParallel) and style.use_local_output and style.output_layouts[0].is_shard()


def _takes_shard(style: ParallelStyle, module: nn.Module) -> bool:
    return (
        isinstance(style, RowwiseParallel)
        and not isinstance(module, nn.Embedding)
        and style.input_layouts[0].is_shard()
    )


def _ancestors(root: nn.Module, fqns: set[str]) -> dict[str, nn.Module]:
    """Every planned module and every module above one, by FQN (the error may surface in any of them)."""
    wanted = {""} | {".".join(f.split(".")[:i]) for f in fqns for i in range(1, f.count(".") + 2)}
    return {fqn: m for fqn, m in root.named_modules() if fqn in wanted}


def watch_plan(root: nn.Module, items: list[tuple[str, nn.Module, ParallelStyle]]) -> None:
    """Install the forward hooks described in the module docstring for the applied plan ``items``."""
    watch = _Watch({fqn: type(style).__name__ for fqn, _, style in items})
    for fqn, module, style in items:
        if _hands_on_shard(style):
            module.register_forward_hook(lambda m, a, out, fqn=fqn: watch.pending.setdefault(fqn))
        elif _takes_shard(style, module):
            # prepend: see the input before the style's own pre-hook has made it a DTensor
            module.register_forward_pre_hook(lambda m, args, fqn=fqn: _consume(watch, fqn, args), prepend=True)
    for fqn, module in _ancestors(root, {fqn for fqn, _, _ in items}).items():
        module.register_forward_hook(lambda m, a, out, fqn=fqn: _annotate(watch, fqn, m, out), always_call=True)


def _consume(watch: _Watch, fqn: str, args: tuple) -> None:
    plain = bool(args) and isinstance(args[0], torch.Tensor) and not hasattr(args[0], "device_mesh")
    if plain and not watch.pending:
        watch.orphans.setdefault(fqn)
    watch.pending.clear()


def _annotate(watch: _Watch, fqn: str, module: nn.Module, out) -> None:
    """On the exception path (torch calls ``always_call`` hooks with ``None`` inside its ``except``), add the
    note once, in the innermost watched module, and forget the forward's records."""
    # ``out`` first: the normal path reads no exception state (cheap, and nothing torch.compile has to trace)
    error = None if out is not None else sys.exc_info()[1]
    if error is None:
        if fqn == "":  # the whole module's forward ran: its records are of no later error
            watch.pending.clear()
            watch.orphans.clear()
        return
    if not any(str(n).startswith(_NOTE) for n in getattr(error, "__notes__", ())):
        note = watch.note(fqn, module)
        if note is not None:
            error.add_note(note)
    watch.pending.clear()
    watch.orphans.clear()
