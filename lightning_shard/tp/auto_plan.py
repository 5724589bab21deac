"""``auto_tp_plan``: find a tensor-parallel plan from a model's structure, names and shapes.

No list of model classes: the plan comes from what the modules look like.

* Attention: a module whose direct ``nn.Linear`` children include q/k/v projections (``q_proj``/``wq``/
  ``query``/``q`` ..., same for k and v) or one fused qkv projection (``qkv``/``c_attn``/``Wqkv``/
  ``query_key_value``/``in_proj``), plus an output projection (``o_proj``/``out_proj``/``wo``/``c_proj``/
  ``proj``/``dense``/``out``). Separate q/k/v: ``ColwiseParallel`` on q, k, v and ``RowwiseParallel`` on
  the output, heads split evenly (GQA: query and key/value head counts must both divide by the TP size, else
  the block stays replicated and the summary says why). The module gets ``DivideAttributes`` for the
  attributes its forward reshapes with (see ``HEAD_ATTRS``/``KV_HEAD_ATTRS``/``HIDDEN_ATTRS``; ``head_dim``
  stays). Fused qkv: ``ColwiseParallel(output_layouts=Replicate())`` (a plain column shard of a fused
  projection would hand a rank parts of q, k and v) and ``RowwiseParallel(input_layouts=Replicate())`` on
  the output; the attention math between them runs replicated, so no attribute changes.
* ``nn.MultiheadAttention`` is left replicated: its projection is a bare ``in_proj_weight`` parameter
  consumed inside ``F.multi_head_attention_forward``, which no Linear style can shard.
* MLP: a direct ``nn.Linear`` child ``down`` (d_h -> d) and one or more siblings ``up`` (d -> d_h), e.g.
  fc1/fc2, up/gate/down, linear1/linear2 (named, or d_h != d): ``ColwiseParallel`` on each up,
  ``RowwiseParallel`` on down; d_h must divide by the TP size.
* Embeddings (token, positional, token type): ``RowwiseParallel`` (vocabulary-parallel rows); this is also
  what keeps a tied LM head consistent (both place the shared weight ``Shard(0)``).
* LM head: an ``nn.Linear`` outside the blocks whose weight is tied to an embedding or whose
  ``out_features`` is an embedding's vocabulary: ``ColwiseParallel``, output ``Replicate()`` or, with
  ``loss_parallel=True``, a ``Shard(-1)`` DTensor for :func:`loss_parallel`.
* Sequence parallel (``sequence_parallel=True``): norms in and around the blocks get
  ``SequenceParallel(use_local_output=True)``, embeddings reduce-scatter to the sequence dim (``Shard(-2)``:
  dim 1 of ``(B, T, C)``, dim 0 of a ``(T, C)`` positional lookup), attention and MLP modules gather their
  input with ``PrepareModuleInput``, output projections reduce-scatter. Without an LM head the last block's
  output is gathered (``PrepareModuleOutput``) for a pooler/classifier. Only when every block's attention
  and MLP are sharded submodules; otherwise the summary says why it is off.

Example::

    plan, summary = auto_tp_plan(model, tp_mesh, return_summary=True)
    print("\\n".join(summary))       # e.g. "layers.0.attn.q_proj: ColwiseParallel"
    parallelize_module(model, tp_mesh, plan)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import Replicate, Shard
from lightning_shard.tp.style import (
    ColwiseParallel,
    DivideAttributes,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["auto_tp_plan", "HEAD_ATTRS", "KV_HEAD_ATTRS", "HIDDEN_ATTRS"]

#: attention-module attributes holding the query head count: divided by the TP size.
HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "nhead")
#: attention-module attributes holding the key/value head count (GQA): divided by the TP size.
KV_HEAD_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")
#: attention-module attributes divided by the TP size when they equal the query projection's width
#: (``n_heads * head_dim``, what a forward reshapes the attention output with).
HIDDEN_ATTRS = ("hidden_size", "embed_dim", "n_embd", "d_model", "dim", "all_head_size", "inner_dim")

_Q = {"q_proj", "q", "wq", "query", "q_lin", "to_q"}
_K = {"k_proj", "k", "wk", "key", "k_lin", "to_k"}
_V = {"v_proj", "v", "wv", "value", "v_lin", "to_v"}
_FUSED = {"qkv", "qkv_proj", "c_attn", "wqkv", "Wqkv", "query_key_value", "in_proj"}
_O = {"o_proj", "out_proj", "wo", "o", "c_proj", "proj", "dense", "out", "out_lin", "to_out"}
_DOWN = {"down_proj", "w2", "fc2", "c_proj", "linear2", "dense_4h_to_h", "down", "fc_out", "wo"}


@dataclass
class _Attn:
    fqn: str
    q: list[str]  # child names: [q, k, v] or [fused]
    o: str
    heads: int | None = None
    kv_heads: int | None = None
    divide: list[str] = field(default_factory=list)
    sharded: bool = False
    reason: str = ""


@dataclass
class _Mlp:
    fqn: str
    ups: list[str]
    down: str
    hidden: int
    whole_module: bool  # the module's Linear children are exactly the MLP (so its input can be prepared)
    sharded: bool = False


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _linear_children(m: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in m.named_children() if isinstance(c, nn.Linear)}


def _int_attr(m: nn.Module, names) -> tuple[str, int] | None:
    for n in names:
        v = getattr(m, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return n, v
    return None


def _find_attention(fqn: str, m: nn.Module, tp: int) -> _Attn | None:
    lin = _linear_children(m)
    names = set(lin)
    o = next((n for n in lin if n in _O), None)
    fused = next((n for n in lin if n in _FUSED), None)
    q, k, v = (next((n for n in lin if n in s), None) for s in (_Q, _K, _V))
    if o is None or not (fused or (q and k and v)):
        return None
    if fused and not (q and k and v):
        return _Attn(fqn, [fused], o, sharded=True)
    del names
    a = _Attn(fqn, [q, k, v], o)
    q_width = lin[q].out_features
    head = _int_attr(m, HEAD_ATTRS)
    if head is None:
        hd = _int_attr(m, ("head_dim", "head_size", "d_head"))
        if hd is None or q_width % hd[1]:
            a.reason = f"head count unknown (no {'/'.join(HEAD_ATTRS)} attribute), left replicated"
            return a
        a.heads = q_width // hd[1]
    else:
        a.heads = head[1]
        a.divide.append(head[0])
    kv = _int_attr(m, KV_HEAD_ATTRS)
    if kv is not None:
        a.kv_heads = kv[1]
        a.divide.append(kv[0])
    else:
        a.kv_heads = a.heads * lin[k].out_features // q_width
    if a.heads % tp or a.kv_heads % tp:
        kv_txt = f", kv heads {a.kv_heads}" if a.kv_heads != a.heads else ""
        a.reason = f"heads {a.heads}{kv_txt} not divisible by tp {tp}, left replicated"
        a.divide = []
        return a
    for n in HIDDEN_ATTRS:
        if getattr(m, n, None) == q_width and not isinstance(getattr(m, n), bool):
            a.divide.append(n)
    a.sharded = True
    return a


def _find_mlp(fqn: str, m: nn.Module, used: set[str]) -> _Mlp | None:
    lin = {n: c for n, c in _linear_children(m).items() if n not in used}
    # The down projection contracts (d_h -> d); prefer a conventional name, else any contracting Linear.
    candidates = [n for n in lin if n in _DOWN] + [n for n, c in lin.items() if c.in_features > c.out_features]
    for dn in candidates:
        down = lin[dn]
        ups = [
            n
            for n, u in lin.items()
            if n != dn and u.out_features == down.in_features and u.in_features == down.out_features
        ]
        if ups:
            whole = set(ups) | {dn} == set(_linear_children(m))
            return _Mlp(fqn, ups, dn, down.in_features, whole)
    return None


def auto_tp_plan(
    model: nn.Module,
    tp_mesh: DeviceMesh | int,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    return_summary: bool = False,
) -> dict[str, ParallelStyle | tuple[ParallelStyle, ...]] | tuple[dict, list[str]]:
    """A ``parallelize_module`` plan for ``model`` on the 1-D ``tp_mesh`` (or a TP size), found from the
    model's structure (see the module docstring for the rules).

    Returns the plan (a plain dict of FQN -> style, or a tuple of styles applied in order); with
    ``return_summary=True`` returns ``(plan, summary)`` where ``summary`` is a list of lines, one per
    considered module: ``"<fqn>: <how it is sharded>"`` or ``"<fqn>: <why not>, left replicated"``.
    ``loss_parallel=True`` makes the LM head return vocab-sharded DTensor logits for ``loss_parallel()``.

    Example::

        plan, summary = auto_tp_plan(model, mesh["tensor_parallel"], sequence_parallel=True, return_summary=True)
        parallelize_module(model, mesh["tensor_parallel"], plan)
    """
    if isinstance(tp_mesh, DeviceMesh):
        if tp_mesh.ndim != 1:
            raise ValueError(
                f"auto_tp_plan: the tensor-parallel mesh must be 1-D, got shape {tp_mesh.shape}; pass "
                "mesh['tensor_parallel']"
            )
        tp = tp_mesh.size()
    else:
        tp = int(tp_mesh)
    modules = dict(model.named_modules())
    order = list(modules)
    lines: list[str] = []
    plan: dict[str, list[ParallelStyle]] = {}

    def add(fqn: str, style: ParallelStyle) -> None:
        plan.setdefault(fqn, []).append(style)

    # ---- find structures
    mha = [f for f, m in modules.items() if isinstance(m, nn.MultiheadAttention)]
    inside_mha = {f for f in modules for a in mha if f.startswith(a + ".")}
    attns: dict[str, _Attn] = {}
    mlps: dict[str, _Mlp] = {}
    for fqn, m in modules.items():
        if fqn in inside_mha or isinstance(m, nn.MultiheadAttention):
            continue
        a = _find_attention(fqn, m, tp)
        if a is not None:
            attns[fqn] = a
            continue
        mlp = _find_mlp(fqn, m, set())
        if mlp is not None:
            mlps[fqn] = mlp
    blocks = [
        _join(f, n)
        for f, m in modules.items()
        if isinstance(m, nn.ModuleList)
        for n, _ in m.named_children()
        if any(a == _join(f, n) or a.startswith(_join(f, n) + ".") for a in list(attns) + list(mlps) + mha)
    ]
    in_block = {f for f in modules for b in blocks if f == b or f.startswith(b + ".")}
    embeddings = [f for f, m in modules.items() if isinstance(m, nn.Embedding)]
    vocab = {modules[e].num_embeddings for e in embeddings}
    tied = {id(modules[e].weight): e for e in embeddings}
    heads = [
        f
        for f, m in modules.items()
        if isinstance(m, nn.Linear)
        and f not in in_block
        and f not in inside_mha
        and (id(m.weight) in tied or m.out_features in vocab)
    ]
    # MLP hidden sizes must divide.
    for mlp in mlps.values():
        mlp.sharded = mlp.hidden % tp == 0

    # ---- can sequence parallel run?
    sp = sequence_parallel
    if sp:
        why = None
        if mha:
            why = f"nn.MultiheadAttention at {mha[0]} needs a replicated input"
        elif not blocks:
            why = "no repeated blocks (nn.ModuleList of attention/MLP blocks) found"
        else:
            for b in blocks:
                a = [x for x in attns.values() if x.fqn.startswith(b + ".")]
                p = [x for x in mlps.values() if x.fqn.startswith(b + ".")]
                if not a or not all(x.sharded for x in a):
                    why = f"block {b} has no sharded attention submodule"
                elif not p or not all(x.sharded and x.whole_module for x in p):
                    why = f"block {b} has no sharded MLP submodule"
                if why:
                    break
        if why:
            lines.append(f"sequence_parallel: off ({why})")
            sp = False
        else:
            lines.append("sequence_parallel: on (sequence dim 1)")
    seq = Shard(1)

    # ---- embeddings
    for e in embeddings:
        emb = modules[e]
        add(e, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-2) if sp else Replicate()))
        out = "reduce-scattered to the sequence dim" if sp else "all-reduced"
        lines.append(f"{e}: RowwiseParallel (vocab-parallel embedding, {emb.num_embeddings} rows; output {out})")

    # ---- attention
    for mha_fqn in mha:
        lines.append(
            f"{mha_fqn}: nn.MultiheadAttention left replicated (its packed in_proj_weight is used inside "
            "F.multi_head_attention_forward; no Linear style can shard it)"
        )
    for a in attns.values():
        if not a.sharded:
            lines.append(f"{a.fqn}: {a.reason}")
            continue
        if sp:
            add(a.fqn, PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)))
        o_style = RowwiseParallel(output_layouts=seq if sp else None)
        if len(a.q) == 1:
            fused = modules[_join(a.fqn, a.q[0])]
            add(_join(a.fqn, a.q[0]), ColwiseParallel(output_layouts=Replicate()))
            o_style = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else None)
            lines.append(
                f"{a.fqn}: attention with fused qkv '{a.q[0]}' ({fused.in_features} -> {fused.out_features}): "
                "projections sharded, attention math replicated"
            )
            lines.append(
                f"{_join(a.fqn, a.q[0])}: ColwiseParallel(output_layouts=Replicate()) (fused qkv: output gathered, "
                "a column shard would mix q, k and v)"
            )
            add(_join(a.fqn, a.o), o_style)
            lines.append(f"{_join(a.fqn, a.o)}: RowwiseParallel(input_layouts=Replicate())")
            continue
        if a.divide:
            add(a.fqn, DivideAttributes(a.divide))
        kv = f", kv heads {a.kv_heads}" if a.kv_heads != a.heads else ""
        adj = f"; divides {', '.join(a.divide)} by {tp}" if a.divide else ""
        lines.append(f"{a.fqn}: attention, heads {a.heads}{kv} split over tp {tp}{adj}")
        for n in a.q:
            add(_join(a.fqn, n), ColwiseParallel())
            lines.append(f"{_join(a.fqn, n)}: ColwiseParallel")
        add(_join(a.fqn, a.o), o_style)
        lines.append(f"{_join(a.fqn, a.o)}: RowwiseParallel")

    # ---- MLPs
    for mlp in mlps.values():
        if not mlp.sharded:
            lines.append(f"{mlp.fqn}: MLP hidden size {mlp.hidden} not divisible by tp {tp}, left replicated")
            continue
        if sp:
            add(mlp.fqn, PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)))
        lines.append(f"{mlp.fqn}: MLP, hidden {mlp.hidden} split over tp {tp}")
        for u in mlp.ups:
            add(_join(mlp.fqn, u), ColwiseParallel())
            lines.append(f"{_join(mlp.fqn, u)}: ColwiseParallel")
        add(_join(mlp.fqn, mlp.down), RowwiseParallel(output_layouts=seq if sp else None))
        lines.append(f"{_join(mlp.fqn, mlp.down)}: RowwiseParallel")

    # ---- norms (sequence parallel) and the end of the blocks
    if sp:
        last = blocks[-1]
        after_blocks = order.index(last)
        for f, m in modules.items():
            if not _is_norm(m) or f in inside_mha:
                continue
            if f in in_block or order.index(f) < after_blocks or heads:
                add(f, SequenceParallel(use_local_output=True))
                lines.append(f"{f}: SequenceParallel")
            else:
                lines.append(f"{f}: norm after the blocks without an LM head, runs replicated")
        if not heads:
            add(last, PrepareModuleOutput(output_layouts=seq, desired_output_layouts=Replicate()))
            lines.append(f"{last}: output gathered from the sequence dim (no LM head follows)")

    # ---- heads and other top-level Linears
    for f, m in modules.items():
        if (
            not isinstance(m, nn.Linear)
            or f in in_block
            or f in inside_mha
            or any(f.startswith(x.fqn + ".") for x in list(attns.values()) + list(mlps.values()))
        ):
            continue
        if f in heads:
            add(
                f,
                ColwiseParallel(
                    input_layouts=seq if sp else Replicate(),
                    output_layouts=Shard(-1) if loss_parallel else Replicate(),
                    use_local_output=not loss_parallel,
                ),
            )
            tie = (
                f", weight tied to {tied[id(m.weight)]} (both Shard(0) on the vocabulary)"
                if id(m.weight) in tied
                else ""
            )
            out = "vocab-sharded DTensor logits for loss_parallel" if loss_parallel else "logits gathered"
            lines.append(f"{f}: ColwiseParallel (LM head, {m.out_features} classes{tie}; {out})")
        else:
            lines.append(
                f"{f}: Linear {m.in_features} -> {m.out_features} outside the blocks, not an LM head (no embedding "
                f"has {m.out_features} rows), left replicated"
            )
    final = {k: (v[0] if len(v) == 1 else tuple(v)) for k, v in plan.items()}
    return (final, lines) if return_summary else final


def _is_norm(m: nn.Module) -> bool:
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    params = list(m.parameters(recurse=False))
    return "norm" in type(m).__name__.lower() and all(p.ndim <= 1 for p in params) and not list(m.children())
