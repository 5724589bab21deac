"""``auto_tp_plan``: find a tensor-parallel plan from a model's structure, names and shapes.

No list of model classes: the plan comes from what the modules look like. "Linear" below means ``nn.Linear``
or Hugging Face's ``Conv1D`` (GPT-2; weight stored ``(in, out)``), recognised by name and shape.

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
  The output projection may also be the only Linear of a sibling module (BERT's ``attention.output.dense``
  next to ``attention.self``). A per-head table (an ``nn.Embedding`` child whose width is the head count: T5's
  ``relative_attention_bias``, rows = buckets, columns = heads) is column-parallel, split like the heads; so is
  one outside the attentions that all of them share (MPNet's encoder-level table), when every attention is
  sharded by heads with that head count. Left replicated: every attention of a class one of whose instances
  holds a query projection but no key/value projection (Gemma 3n's, Gemma 4's KV-shared layers): that instance
  attends over key/value states an earlier layer computed, and runs replicated on all its query heads.
* One input redistribution per attention and per MLP module (Megatron's ``f``): the module holding q/k/v
  and an MLP module holding only its Linears get ``PrepareModuleInput`` on their first input, positional or
  keyword (``hidden_states=``), so the column-parallel projections share one DTensor input and their input
  gradients are reduced once: 2 all-reduces per block and pass without sequence parallel.
* ``nn.MultiheadAttention`` is left replicated: its projection is a bare ``in_proj_weight`` parameter
  consumed inside ``F.multi_head_attention_forward``, which no Linear style can shard.
* MLP: a direct ``nn.Linear`` child ``down`` (d_h -> d) and one or more siblings ``up`` (d -> d_h), e.g.
  fc1/fc2, up/gate/down, linear1/linear2 (named, or d_h != d): ``ColwiseParallel`` on each up,
  ``RowwiseParallel`` on down; d_h must divide by the TP size. In a block with an attention, an up and a
  down that are the only Linears of sibling modules also count (BERT's ``intermediate``/``output``). Left
  replicated: a pair whose outer width no attention reads (a bottleneck, down then up), and an MLP module whose
  class source reduces over a dim (``mean``, ``std``, ``topk``, ...: the split hidden activations).
* Embeddings (token, positional, token type): ``RowwiseParallel`` (vocabulary-parallel rows); this is also
  what keeps a tied LM head consistent (both place the shared weight ``Shard(0)``). Left replicated, with
  whatever shares its weight: a subclass whose ``forward`` computes its own indices (BART's learned positions),
  an embedding whose parent reads ``self.<name>.weight`` (DeBERTa-v2's ``rel_embeddings``), and one tied
  to a module whose parent reads that module's weight (MobileBERT's LM head concatenates its decoder's).
* An attention whose ``forward`` takes the width of all heads from elsewhere stays replicated, with the
  reason: its output reshaped with its input's width (FSMT, ProphetNet, PEGASUS-X), or every head's
  keys/values handed in as an argument and concatenated to its own (MVP's prompts); so does one that draws
  random numbers in its own code (BigBird's block-sparse random blocks, drawn per head: split, every rank drew
  the first heads' blocks, silently not one device's).
* Other Linear children of a sharded attention whose output width is the query's (DeBERTa-v2's
  ``pos_key_proj``) are ``ColwiseParallel`` like q. Training-mode dropout inside sharded modules is reported
  (summary line and warning): it acts on each rank's local columns, not as on one device.
* LM head: an ``nn.Linear`` outside the blocks whose weight is tied to an embedding or whose
  ``out_features`` is an embedding's vocabulary: ``ColwiseParallel``, output ``Replicate()`` or, with
  ``loss_parallel=True``, ``LossParallelHead``: a ``Shard(-1)`` DTensor inside :func:`loss_parallel`, the full
  logits, plain, outside it; gathered still where the head's parent holds a per-vocabulary tensor that the model's
  code applies to the logits as a plain tensor (BART's and Marian's ``final_logits_bias``). The blocks are the
  layers of an ``nn.ModuleList`` holding a recognised attention or MLP, and the other layers of the same class in
  that list (Reformer's LSH-attention layer, whose attention is not recognised, beside a local-attention one).
* Sequence parallel (``sequence_parallel=True``): norms in and around the blocks get
  ``SequenceParallel(use_local_output=True)``, embeddings reduce-scatter to the sequence dim (``Shard(-2)``:
  dim 1 of ``(B, T, C)``, dim 0 of a ``(T, C)`` positional lookup), attention and MLP modules gather their
  input with ``PrepareModuleInput``, output projections reduce-scatter. Without an LM head the last block's
  output is gathered (``PrepareModuleOutput``) for a pooler/classifier. Only when every block's attention
  and MLP are sharded submodules; otherwise the summary says why it is off. A Hugging Face model where it
  would be on gets a ``ValueError`` (its forward builds masks and positions from the sharded embedding output),
  as does a model holding an RNN (``nn.LSTM``/``nn.GRU``/``nn.RNN``, which runs over the whole sequence).
  ``sequence_parallel="auto"`` (the strategy's default) is ``True`` where that applies, except that a Hugging
  Face model, an RNN, or a tensor of 2+ dims outside the blocks owned by anything but an embedding, Linear or norm
  (a position table the model's own code could slice by the local sequence length), turns it off with the
  reason instead.

Example::

    plan, summary = auto_tp_plan(model, tp_mesh, return_summary=True)
    print("\\n".join(summary))       # e.g. "layers.0.attn.q_proj: ColwiseParallel"
    parallelize_module(model, tp_mesh, plan)
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import Placement, Replicate, Shard
from lightning_shard.tp.loss_head import LossParallelHead
from lightning_shard.tp.style import (
    ColwiseParallel,
    DivideAttributes,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    is_linear,
    linear_dims,
)

__all__ = ["auto_tp_plan", "HEAD_ATTRS", "KV_HEAD_ATTRS", "HIDDEN_ATTRS"]

#: attention-module attributes holding the query head count: divided by the TP size.
HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads", "nhead")
#: attention-module attributes holding the key/value head count (GQA): divided by the TP size.
KV_HEAD_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")
#: attention-module attributes divided by the TP size when they equal the query projection's width
#: (``n_heads * head_dim``, what a forward reshapes the attention output with).
HIDDEN_ATTRS = ("hidden_size", "embed_dim", "n_embd", "d_model", "dim", "all_head_size", "inner_dim")

_Q = {"q_proj", "q", "wq", "query", "q_lin", "to_q", "query_proj"}
_K = {"k_proj", "k", "wk", "key", "k_lin", "to_k", "key_proj"}
_V = {"v_proj", "v", "wv", "value", "v_lin", "to_v", "value_proj"}
_FUSED = {"qkv", "qkv_proj", "c_attn", "wqkv", "Wqkv", "query_key_value", "in_proj"}
_O = {"o_proj", "out_proj", "wo", "o", "c_proj", "proj", "dense", "out", "out_lin", "to_out"}
_DOWN = {"down_proj", "w2", "fc2", "c_proj", "linear2", "dense_4h_to_h", "down", "fc_out", "wo"}


@dataclass
class _Attn:
    fqn: str  # the module holding the q/k/v (or fused) projections: its input is prepared once
    q: list[str]  # absolute FQNs: [q, k, v] or [fused]
    o: str  # absolute FQN of the output projection (a child, or a Linear in a sibling module as in BERT)
    heads: int | None = None
    kv_heads: int | None = None
    divide: list[str] = field(default_factory=list)
    head_tables: list[str] = field(default_factory=list)  # per-head embeddings (T5's relative_attention_bias)
    # Other Linear children projecting into the query's head space (DeBERTa-v2's pos_key_proj/pos_query_proj):
    # the forward reshapes their output with the divided head count, so they are split like q.
    head_projections: list[str] = field(default_factory=list)
    head_norms: list[str] = field(default_factory=list)  # norms over head_dim inside (Qwen3's q_norm/k_norm)
    sharded: bool = False
    reason: str = ""
    # The module holds only the projections (and per-head tables), so its input can be prepared once. A whole
    # block written as one module (norms, attention and MLP Linears side by side) cannot: its residual adds and
    # norms take the same input, plainly.
    whole_module: bool = True


@dataclass
class _Mlp:
    fqn: str
    ups: list[str]  # absolute FQNs
    down: str  # absolute FQN
    hidden: int
    whole_module: bool  # the module's Linear children are exactly the MLP (so its input can be prepared)
    sharded: bool = False
    reason: str = ""


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _linear_children(m: nn.Module) -> dict[str, nn.Module]:
    return {n: c for n, c in m.named_children() if is_linear(c)}


def _int_attr(m: nn.Module, names) -> tuple[str, int] | None:
    for n in names:
        v = getattr(m, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return n, v
    return None


def _sibling_output(fqn: str, modules: dict[str, nn.Module], width: int) -> str | None:
    """BERT-style attention: the output projection lives in a sibling module (``attention.output.dense``
    next to ``attention.self``). The sibling's only Linear must be named like an output projection and take
    the attention width as input."""
    if not fqn:
        return None
    parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    for name, sib in modules[parent].named_children():
        sib_fqn = _join(parent, name)
        if sib_fqn == fqn:
            continue
        lin = _linear_children(sib)
        if len(lin) == 1:
            ((n, c),) = lin.items()
            if n in _O and linear_dims(c)[0] == width:
                return _join(sib_fqn, n)
    return None


def _find_attention(fqn: str, m: nn.Module, tp: int, modules: dict[str, nn.Module]) -> _Attn | None:
    lin = _linear_children(m)
    o = next((n for n in lin if n in _O), None)
    fused = next((n for n in lin if n in _FUSED), None)
    q, k, v = (next((n for n in lin if n in s), None) for s in (_Q, _K, _V))
    if not (fused or (q and k and v)):
        return None
    width = linear_dims(lin[q] if q and k and v else lin[fused])[1]
    o_fqn = _join(fqn, o) if o is not None else _sibling_output(fqn, modules, width if q else width // 3)
    if o_fqn is None:
        return None
    if fused and not (q and k and v):
        a = _Attn(fqn, [_join(fqn, fused)], o_fqn, sharded=True)
        a.whole_module = _holds_only(m, fqn, [*a.q, a.o])
        return a
    a = _Attn(fqn, [_join(fqn, n) for n in (q, k, v)], o_fqn)
    rest = {_join(fqn, n): c for n, c in lin.items() if n not in {q, k, v, o}}
    rest_mlp = _match_mlp(fqn, rest, False) if rest else None
    if rest and (rest_mlp is None or {*rest_mlp.ups, rest_mlp.down} != set(rest)):
        # A Linear beside q/k/v/o that is not a compact block's MLP (an output gate such as AFMoE's
        # gate_proj, a decay projection) reads or scales the head-split activations at full width.
        extra = next(f for f in rest if rest_mlp is None or f not in {*rest_mlp.ups, rest_mlp.down})
        a.reason = (
            f"Linear {extra.rsplit('.', 1)[-1]} {linear_dims(rest[extra])} inside the attention is neither q/k/v/o "
            "nor part of an MLP, left replicated"
        )
        return a
    q_width = width
    head = _int_attr(m, HEAD_ATTRS)
    if head is None:
        hd = _int_attr(m, ("head_dim", "head_size", "d_head", "attention_head_size", "key_value_proj_dim"))
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
        a.kv_heads = a.heads * linear_dims(lin[k])[1] // q_width
    if a.heads % tp or a.kv_heads % tp:
        kv_txt = f", kv heads {a.kv_heads}" if a.kv_heads != a.heads else ""
        a.reason = f"heads {a.heads}{kv_txt} not divisible by tp {tp}, left replicated"
        a.divide = []
        return a
    for n in HIDDEN_ATTRS:
        if getattr(m, n, None) == q_width and not isinstance(getattr(m, n), bool):
            a.divide.append(n)
    # A per-head table (T5's relative_attention_bias: rows are position buckets, columns are heads) must be
    # split like the heads: column-parallel, so each rank looks up the bias of its own heads.
    a.head_tables = [
        _join(fqn, n) for n, c in m.named_children() if isinstance(c, nn.Embedding) and c.embedding_dim == a.heads
    ]
    a.head_projections = [
        _join(fqn, n) for n, c in lin.items() if n not in (q, k, v, o) and linear_dims(c)[1] == q_width
    ]
    head_dim = q_width // a.heads
    owned = [q, k, v, o, *(t.rsplit(".", 1)[-1] for t in a.head_tables + a.head_projections)]
    owned += _output_norms(m, o)  # ALBERT's LayerNorm after its output projection: whole width, replicated
    a.head_norms, other = _per_head_norms(m, fqn, owned, head_dim)
    if other and set(lin) <= {q, k, v, o}:
        # Parameters of the attention's own (not a Linear's) act on the activations between the projections,
        # which TP splits by heads: one replicated copy on each rank would see only its heads and get a partial
        # gradient (silently wrong training), or a whole-width norm would normalise over half the width.
        a.reason = (
            f"{other[0]} inside the attention acts on the head-split activations and is not a per-head norm "
            f"(parameters of size head_dim {head_dim}), left replicated"
        )
        a.divide, a.head_norms, a.head_projections = [], [], []
        return a
    blocker = _head_split_blocker_in_source(m)
    if blocker is not None:
        a.reason = f"{blocker}, left replicated"
        a.divide, a.head_norms, a.head_projections, a.head_tables = [], [], [], []
        return a
    a.whole_module = _holds_only(m, fqn, [*a.q, a.o, *a.head_tables, *a.head_projections, *a.head_norms])
    a.sharded = True
    return a


# Names a forward gives its input's last dim (the stream width): ``tgt_len, bsz, embed_dim = query.size()`` binds
# its last name, ``hidden_dim=token_hidden_states.shape[2]`` / ``d = x.size(-1)`` one name.
_UNPACKED_SHAPE = re.compile(r"^[ \t]*([\w \t,]+?)\s*=\s*(\w+)\.(?:size\(\)|shape)[ \t]*(?:#.*)?$", re.MULTILINE)
_LAST_DIM = re.compile(r"\b(\w+)\s*=\s*(\w+)\.(?:shape\[(?:-1|2)\]|size\((?:-1|2)\))")
_CAT_LIST = re.compile(r"torch\.cat\(([^\n]*)")  # the rest of the line: the tensors (indexed ones too)
_CACHE_ARG = re.compile(r"past|cache|layer_past", re.IGNORECASE)
# A random draw in code (not an initialiser's ``nn.init.*_`` call, which runs in ``__init__``/``reset_parameters``)
_RANDOM_DRAW = re.compile(
    r"\b(?:np|numpy)\.random\.\w+|\btorch\.(?:rand|randn|randint|randperm|rand_like|randn_like|multinomial|bernoulli)\("
)
_INIT_METHODS = {"__init__", "reset_parameters", "_init_weights", "_reset_parameters"}


def _code_beyond_init(cls: type) -> str:
    """The source of ``cls``'s own methods and its bases' (not ``nn.Module``'s), initialisers left out."""
    parts = []
    for c in cls.__mro__:
        if c in (nn.Module, object):
            continue
        for name, f in vars(c).items():
            f = getattr(f, "__func__", f)  # a staticmethod's or classmethod's function
            if inspect.isfunction(f) and name not in _INIT_METHODS:
                parts.append(_source(f))
    return "\n".join(parts)


def _head_split_blocker_in_source(m: nn.Module) -> str | None:
    """Why the attention ``m``'s own ``forward`` cannot run on a share of the heads, from its source, or None.

    Splitting the heads divides the head-count and width attributes the forward reshapes with; two ways of
    writing it take the width of all heads from elsewhere:

    * the output reshaped with the width of the forward's input (FSMT's ``tgt_len, bsz, embed_dim =
      query.size()`` then ``view(tgt_len, bsz, embed_dim)``; ProphetNet's, PEGASUS-X's global-local attention):
      each rank's heads are half of that width, a shape error in the first forward;
    * a forward argument holding every head's keys or values concatenated to the keys/values (MVP's per-layer
      ``attn_prompt``, made outside the attention): a rank's heads met all heads, a shape error.

    A third is silent: an attention drawing random numbers in its own code (BigBird's block-sparse attention
    draws each head's random blocks from ``np.random`` seeded per layer): on a share of the heads every rank drew
    the first heads' patterns, so ranks past the first attended to other blocks than one device, with no error
    (BigBird: 1.6e-4 off one process after 3 steps). Dropout (``nn.functional.dropout``) is not such a draw; the
    plan reports it (``_note_dropout``).
    """
    forward = type(m).forward
    src = _source(forward)
    try:
        args = [n for n in inspect.signature(forward).parameters if n != "self"]
    except (TypeError, ValueError):
        return None
    widths = [(names.split(",")[-1].strip(), x) for names, x in _UNPACKED_SHAPE.findall(src) if x in args]
    widths += [(name, x) for name, x in _LAST_DIM.findall(src) if x in args]
    for name, x in widths:
        if name and name != "_" and re.search(rf"\.(?:view|reshape)\([^()]*\b{name}\b", src):
            return f"{type(m).__name__}.forward reshapes its output with the width of its input ({name} from {x})"
    draws = _RANDOM_DRAW.search(_code_beyond_init(type(m)))
    if draws:
        return (
            f"{type(m).__name__} draws random numbers in its code ({draws.group(0).rstrip('(')}): drawn per head on a "
            "share of the heads, each rank would repeat the first heads' draws instead of one device's"
        )
    for items in _CAT_LIST.findall(src):
        words = set(re.findall(r"\w+", items))
        extra = [n for n in args[1:] if n in words and not _CACHE_ARG.search(n)]
        if extra and any("key" in w or "value" in w for w in words - set(extra)):
            return (
                f"{type(m).__name__}.forward concatenates its argument {extra[0]} (every head's keys or values, "
                "made outside the attention) to the keys/values"
            )
    return None


def _per_head_norms(m: nn.Module, fqn: str, owned: list[str | None], head_dim: int) -> tuple[list[str], list[str]]:
    """The attention module's parameters outside its projections and per-head tables (``owned``, child names):
    ``(per_head_norms, others)``. A per-head norm (Qwen3's and Gemma 3's ``q_norm``/``k_norm``) is a norm child
    whose parameters all have shape ``(head_dim,)``: it runs on each rank's heads alone, so TP keeps it with
    replicated parameters and sums its gradient. ``others`` describes every other parameter, e.g.
    ``"q_norm (weight (64,))"`` for OLMo 2's norm over the whole projection width."""
    norms: list[str] = []
    others: list[str] = []
    skip = {n for n in owned if n is not None}
    for name, child in m.named_children():
        params = list(child.named_parameters())
        if name in skip or not params:
            continue
        if _is_norm(child) and all(tuple(p.shape) == (head_dim,) for _, p in params):
            norms.append(_join(fqn, name))
        else:
            others.append(f"{name} ({', '.join(f'{n} {tuple(p.shape)}' for n, p in params)})")
    others += [f"{n} {tuple(p.shape)}" for n, p in m.named_parameters(recurse=False)]
    return norms, others


def _output_norms(m: nn.Module, o: str | None) -> list[str]:
    """Norm children of the attention ``m`` that its forward applies after the output projection ``o`` (a child):
    they see the all-reduced, whole-width output, not the head-split activations, so they need no split (their
    first call in the source comes after ``self.<o>(``; a norm called before it, such as BitNet's sub-norm or
    OLMo 2's q_norm, is not one)."""
    source = _source(type(m).forward)
    at_o = source.find(f"self.{o}(") if o else -1
    if at_o < 0:
        return []
    return [name for name, child in m.named_children() if _is_norm(child) and source.find(f"self.{name}(") > at_o]


def _holds_only(m: nn.Module, fqn: str, owned: list[str]) -> bool:
    """Whether every parameter of module ``m`` (at ``fqn``) belongs to one of the ``owned`` submodules (those
    outside ``m``, such as BERT's sibling output projection, do not count)."""
    prefix = f"{fqn}." if fqn else ""
    mine = {id(p) for f in owned if f.startswith(prefix) for p in m.get_submodule(f[len(prefix) :]).parameters()}
    return all(id(p) in mine for p in m.parameters())


def _match_mlp(fqn: str, lin: dict[str, nn.Module], whole: bool) -> _Mlp | None:
    """An up/down pair among ``lin`` (absolute FQN -> Linear): a contracting ``down`` (d_h -> d) and ups of
    the transposed shape (d -> d_h); a conventional down name first, else any contracting Linear."""
    last = {f: f.rsplit(".", 1)[-1] for f in lin}
    dims = {f: linear_dims(c) for f, c in lin.items()}
    candidates = [f for f in lin if last[f] in _DOWN] + [f for f in lin if dims[f][0] > dims[f][1]]
    for dn in candidates:
        d_in, d_out = dims[dn]
        ups = [f for f in lin if f != dn and dims[f] == (d_out, d_in)]
        if ups:
            return _Mlp(fqn, ups, dn, d_in, whole and set(ups) | {dn} == set(lin))
    return None


def _find_mlp(fqn: str, m: nn.Module) -> _Mlp | None:
    mlp = _match_mlp(fqn, {_join(fqn, n): c for n, c in _linear_children(m).items()}, True)
    if mlp is not None and not mlp.whole_module:
        # Other Linears beside the pair: the shapes alone do not say which way data flows between them
        # (DeepSeek's low-rank attention has q_a_proj 64 -> 32 feeding q_b_proj 32 -> 64, the reverse of an
        # MLP's up -> down), so this is no MLP (compact blocks holding an attention are matched separately).
        return None
    if mlp is not None and mlp.whole_module:
        # Its input can be prepared for the MLP alone only if the module holds nothing else (OPT's decoder
        # layer holds fc1/fc2 next to the attention and the norms).
        mine = {
            id(p) for f in [*mlp.ups, mlp.down] for p in m.get_submodule(f[len(fqn) + 1 if fqn else 0 :]).parameters()
        }
        mlp.whole_module = all(id(p) in mine for p in m.parameters())
    return mlp


def _mlp_blocker(mlp: _Mlp, modules: dict[str, nn.Module], attns: dict, tp: int, widths: set[int]) -> str:
    """Why ``mlp`` cannot be split over ``tp`` ranks, or ``""``.

    An MLP reads and writes the stream its block works on, so its outer width (``down``'s output) is a width an
    attention of the model reads (``widths``). A pair of the right shapes whose outer width is none of them is a
    bottleneck whose data flows the other way, down then up: Gemma 3n's and Gemma 4's decoder layer holds
    ``per_layer_input_gate`` (64 -> 16), whose output feeds ``per_layer_projection`` (16 -> 64). Split as an MLP,
    the row-parallel "down" took the full 64-wide input for a 32-wide shard, a shape error deep in forward.

    A parameter of an MLP module besides its Linears (a learnable activation such as xIELU's ``alpha_p``, a
    norm over the hidden width) acts on the hidden activations that TP splits: a replicated copy would get a
    partial gradient on each rank (silently wrong training) or not fit the local width. A module that also
    holds an attention is a whole layer (OPT's, ``nn.TransformerEncoderLayer``), whose other parameters are its
    attention's and its norms on the block input."""
    outer = linear_dims(modules[mlp.down])[1]
    if widths and outer not in widths:
        up = mlp.ups[0].rsplit(".", 1)[-1]
        return (
            f"Linears {up} ({outer} -> {mlp.hidden}) and {mlp.down.rsplit('.', 1)[-1]} ({mlp.hidden} -> {outer}) "
            f"have an MLP's shapes but their outer width {outer} is no width an attention reads "
            f"({', '.join(map(str, sorted(widths)))}): a bottleneck (down, then up), not an MLP"
        )
    if mlp.hidden % tp:
        return f"MLP hidden size {mlp.hidden} not divisible by tp {tp}"
    m = modules[mlp.fqn]
    holds_attention = any(a == mlp.fqn or a.startswith(mlp.fqn + ".") for a in attns)
    # The MLP's own class and its parameter-free children's (an activation module acts on the hidden activations
    # too; a child with parameters, such as BitNet's ffn_sub_norm, is named by the rule below).
    classes = [type(m)] + [type(c) for c in m.children() if not is_linear(c) and next(c.parameters(), None) is None]
    found = {} if holds_attention else {c: sorted(set(_REDUCTION.findall(_source(c)))) for c in classes}
    where = next((c for c in classes if found.get(c)), None)
    if where is not None:
        # Gemma 3n's activation sparsity (_gaussian_topk) cuts the gate activations at mean + k * std over the
        # hidden dim: split, each rank used its own half's mean and std, and trained wrong with no error (loss
        # 5.78 against 7.23 after 3 steps at lr 0.5). Of transformers 5.24's 354 *MLP classes it is the only one
        # with a reduction (besides Zaya's router); the source cannot say over which dim, so any one blocks.
        owner = type(m).__name__ if where is type(m) else f"{type(m).__name__}'s child {where.__name__}"
        return (
            f"{owner} reduces over a dim in its code ({', '.join(found[where])}): over the split hidden "
            "activations each rank would use its own shard's values"
        )
    if mlp.whole_module or holds_attention:
        return ""
    if any(isinstance(c, nn.MultiheadAttention) for c in m.modules()):
        return ""  # nn.TransformerEncoderLayer: linear1/linear2 next to its self_attn and norms
    prefix = f"{mlp.fqn}." if mlp.fqn else ""
    mine = {id(p) for f in [*mlp.ups, mlp.down] for p in modules[f].parameters()}
    other = [f"{prefix}{n} {tuple(p.shape)}" for n, p in m.named_parameters() if id(p) not in mine]
    return f"MLP holds {other[0]} besides its Linears, which would act on the split hidden activations" if other else ""


def _find_sibling_mlp(fqn: str, m: nn.Module, claimed: set[str]) -> _Mlp | None:
    """BERT-style MLP: the up and down projections live in sibling submodules of a block
    (``intermediate.dense`` and ``output.dense``); only Linears not claimed by an attention count."""
    lin = {
        _join(fqn, c, n): x
        for c, child in m.named_children()
        for n, x in _linear_children(child).items()
        if _join(fqn, c, n) not in claimed
    }
    return _match_mlp(fqn, lin, False)


# A reduction call in an MLP class's source (``x.mean(-1)``, ``torch.std(x, dim=-1)``, ``x.topk(k)``, ...).
_REDUCTION = re.compile(
    r"(?<![\w])(?:torch\.)?\.?(mean|std|var|sum|amax|amin|topk|softmax|log_softmax|logsumexp|sort|argsort|cumsum|norm)\s*\("
)


@functools.cache
def _source(obj) -> str:
    """The source of a class or function ("" where there is none); read once per object (a plan reads each
    block's classes once per block)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _shared_head_tables(modules: dict[str, nn.Module], attns: dict) -> list[str]:
    """Per-head tables outside the attentions: an embedding whose width is the head count, when every attention
    is sharded by heads with that count (MPNet's encoder-level ``relative_attention_bias``: rows are position
    buckets, columns heads, looked up once and added to every layer's scores). They are split like the heads, as
    a table inside the attention is; vocabulary-parallel, a rank's scores (its heads) met the bias of all heads:
    a shape error in forward. With a fused-qkv attention (its math runs on all heads) or one left replicated,
    the attentions stay replicated instead (``_per_head_parameter_outside``).
    """
    if not attns or not all(a.sharded and len(a.q) > 1 for a in attns.values()):
        return []
    heads = {a.heads for a in attns.values()}
    widths = {linear_dims(modules[a.q[0]])[1] for a in attns.values()}
    if len(heads) != 1 or heads & widths:  # a width equal to the head count could be anything
        return []
    (count,) = heads
    inside_attention = [f for f in modules if any(f.startswith(a + ".") for a in attns)]
    return [
        f
        for f, m in modules.items()
        if isinstance(m, nn.Embedding) and m.embedding_dim == count and f not in inside_attention
    ]


def _position_bias_tables(modules: dict[str, nn.Module], attns: dict, shared_head_tables: list[str]) -> dict:
    """The candidates for ``_per_head_parameter_outside``: ``{parameter name: (shape, ModuleList elements
    holding it)}`` for each 2-D parameter named like a position bias (``_is_position_bias_table``) outside the
    attentions, norms, Linears, convolutions (and their parametrizations) and ``shared_head_tables``."""
    skipped = set(attns) | set(shared_head_tables)
    skipped |= {f for f, m in modules.items() if _is_norm(m) or is_linear(m) or isinstance(m, nn.modules.conv._ConvNd)}
    layers = {_join(f, n) for f, m in modules.items() if isinstance(m, nn.ModuleList) for n in m._modules}
    tables = {}
    for f, m in modules.items():
        ancestors = _ancestors(f)
        if skipped.intersection(ancestors):
            continue
        for n, p in m.named_parameters(recurse=False):
            if _is_position_bias_table(_join(f, n), p):
                tables[_join(f, n)] = (tuple(p.shape), layers.intersection(ancestors))
    return tables


def _ancestors(fqn: str) -> list[str]:
    """``fqn`` and the names of the modules holding it: ``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]``."""
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _per_head_parameter_outside(a: _Attn, modules: dict[str, nn.Module], tables: dict) -> str | None:
    """A (positions, heads) parameter outside the attentions, in the attention's own layer or outside the layers
    (BEiT's ``relative_position_bias.relative_position_bias_table`` (distances, heads) in the layer, or
    ``shared_position_bias`` in the encoder), whose lookup the model adds to the attention scores of every head.
    With the heads split, each rank's scores met the bias of all heads: a shape error, or a silent broadcast with
    one head per rank. ``tables``: ``_position_bias_tables``. Returns the parameter's name and shape, or None.
    """
    if not a.sharded or len(a.q) < 2 or a.heads in {linear_dims(modules[a.q[0]])[1]}:
        return None
    mine = set(_ancestors(a.fqn))
    for name, (shape, layers) in tables.items():
        if shape[-1] == a.heads and layers <= mine:  # not in another layer
            return f"{name} {shape}"
    return None


def _shared_kv_reader(a: _Attn, modules: dict[str, nn.Module], attns: dict) -> str | None:
    """A module of the attention ``a``'s class that holds a query projection but no key, value or fused one: it
    reads the key/value states an earlier layer computed (Gemma 3n's and Gemma 4's KV-shared layers, whose
    producer stores them for the layers after it). Such states come from the producer's projections, so with the
    producer split by heads they are this rank's heads only, while the reader (not recognised as an attention)
    runs replicated on all its query heads: a shape error, or, with one key/value head per rank, a silent
    broadcast of that head over every query head. Every attention of the class stays replicated (which layer
    produces which states is in the model's code, not its structure). Returns the reader's name, or None."""
    cls = type(modules[a.fqn])
    for fqn, m in modules.items():
        if type(m) is not cls or fqn in attns:
            continue
        lin = _linear_children(m)
        if any(n in _Q for n in lin) and not any(n in _K | _V | _FUSED for n in lin):
            return fqn
    return None


def _is_position_bias_table(name: str, p: nn.Parameter) -> bool:
    """2-D, (positions, heads) and named as a position bias; a router's weights and biases (experts wide) are
    not one."""
    shaped = p.ndim == 2 and p.shape[0] > 1
    return shaped and bool(_POSITION_BIAS.search(name)) and not _ROUTING.search(name)


_POSITION_BIAS = re.compile(r"relative|position|bias", re.IGNORECASE)
_ROUTING = re.compile(r"expert|router|gate|moe", re.IGNORECASE)


def _embedding_unshardable(fqn: str, modules: dict[str, nn.Module]) -> str | None:
    """Why the ``RowwiseParallel`` embedding style cannot serve the embedding ``fqn``, or None.

    The style turns the module's first input into a DTensor and its output back; a vocabulary-sharded weight
    used any other way meets plain tensors in the model's own code (an error in forward at best). Two such
    ways are visible in the source: a subclass whose ``forward`` does not pass its first argument straight to
    ``super().forward`` / ``F.embedding`` (BART's learned positions compute their own position ids), and a
    parent class reading ``self.<name>.weight`` (DeBERTa-v2's ``rel_embeddings``). A third is ``max_norm``: the
    lookup renormalises whole rows of the weight in place, which no rank holding a slice of the rows can do
    for the rows the others look up.
    """
    m = modules[fqn]
    if getattr(m, "max_norm", None) is not None:
        # Its forward renormalises whole rows of the weight in place; FSDP repeats that on the master weight for
        # a replicated weight only (lightning_shard.fsdp.max_norm).
        return f"max_norm={m.max_norm} renormalises whole rows of the weight in place"
    forward = type(m).forward
    if forward is not nn.Embedding.forward:
        first = _first_arg(m)
        src = _source(forward)
        passes = first is not None and re.search(
            rf"(super\(\)\.forward|F\.embedding|nn\.functional\.embedding)\(\s*{first}\b", src
        )
        if not passes:
            return f"{type(m).__name__}.forward does not pass its input straight to the embedding lookup"
    return _weight_read_directly(fqn, modules)


def _weight_read_directly(fqn: str, modules: dict[str, nn.Module], *, values: bool = False) -> str | None:
    """Whether the module holding ``fqn`` reads ``self.<name>.weight`` in its code (DeBERTa-v2's
    ``rel_embeddings``; MobileBERT's LM head ``torch.cat([self.decoder.weight.t(), self.dense.weight])``, its
    decoder tied to the token embedding): that code meets the weight as it is, a shard where a style split it.
    ``values=True`` ignores reads of its metadata only (Mamba's ``.to(self.lm_head.weight.dtype)``) and the
    assignment that ties it (``self.lm_head.weight = self.wte.weight`` in ``__init__``)."""
    parent, _, name = fqn.rpartition(".")
    owner = modules.get(parent)
    after = _METADATA_NOT_NEXT if values else ""
    if owner is not None and any(
        re.search(rf"self\.{name}\.weight\b{after}", _source(cls))
        for cls in type(owner).__mro__
        if cls is not nn.Module
    ):
        return f"{type(owner).__name__} reads self.{name}.weight directly"
    return None


# Reading a weight's metadata (Mamba's ``hidden_states.to(self.lm_head.weight.dtype)``) does not use its values.
_METADATA_NOT_NEXT = r"(?!\.(?:dtype|device|shape|ndim|size\(|requires_grad|is_meta)|\s*=[^=])"


def _first_arg(m: nn.Module) -> str | None:
    """The name of ``m.forward``'s first parameter (HF layers pass ``hidden_states=`` by keyword)."""
    try:
        params = list(inspect.signature(m.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    first = params[0] if params else None
    if first is None or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        return None
    return first.name


def _prepare_block_input(m: nn.Module, layout: Placement) -> PrepareModuleInput:
    """One input redistribution for a whole attention or MLP module (Megatron's ``f``): its first input,
    positional or by keyword, becomes one DTensor ``layout -> Replicate()`` shared by every column-parallel
    projection inside, so their input gradients are summed locally and reduced once."""
    name = _first_arg(m)
    kw = {name: layout} if name else None
    return PrepareModuleInput(
        input_layouts=(layout,),
        desired_input_layouts=(Replicate(),),
        input_kwarg_layouts=kw,
        desired_input_kwarg_layouts={name: Replicate()} if name else None,
    )


def _hugging_face_model(modules: dict[str, nn.Module], block: str) -> str | None:
    """The class name of the outermost Hugging Face ``PreTrainedModel`` holding ``block``, else None.
    Recognised by the class hierarchy's names, so ``transformers`` is not imported."""
    for fqn, m in modules.items():  # named_modules order: parents first
        if (not fqn or block.startswith(fqn + ".")) and any(
            c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(m).__mro__
        ):
            return type(m).__name__
    return None


def _sequence_parallel_choice(value) -> bool:
    """``True``/``"auto"`` -> try sequence parallel, ``False`` -> not; anything else is refused."""
    if value is True or value == "auto":
        return True
    if value is False:
        return False
    raise ValueError(f"auto_tp_plan: sequence_parallel={value!r} must be True, False or 'auto'")


def _sequence_parallel_blocker(blocks: list[str], attns: dict, mlps: dict, mha: list[str]) -> str | None:
    """Why the blocks' structure rules sequence parallel out, or None."""
    if mha:
        return f"nn.MultiheadAttention at {mha[0]} needs a replicated input"
    if not blocks:
        return "no repeated blocks (nn.ModuleList of attention/MLP blocks) found"
    if len(stacks := sorted({b.rsplit(".", 1)[0] for b in blocks})) > 1:
        # An encoder's last norm would hand its sequence shard to the decoder's cross-attention, whose k/v
        # projections take a plain tensor as replicated: wrong results, no error.
        return f"blocks in {len(stacks)} stacks ({', '.join(stacks)}): an encoder-decoder"
    for b in blocks:
        a = [x for x in attns.values() if x.fqn == b or x.fqn.startswith(b + ".")]
        p = [x for x in mlps.values() if x.fqn == b or x.fqn.startswith(b + ".")]
        if not a or not all(x.sharded for x in a):
            return f"block {b} has no sharded attention submodule"
        if not all(x.whole_module for x in a):
            return f"attention {a[0].fqn} shares its module with other layers (norms or an MLP)"
        if not p or not all(x.sharded and x.whole_module for x in p):
            return f"block {b} has no sharded MLP submodule"
    return None


def _recurrence(modules: dict[str, nn.Module]) -> str | None:
    """An RNN (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) anywhere in the model, else None: it runs over the whole
    sequence, and sequence parallel hands it each rank's part (an LSTM head after the blocks trained wrong under
    ``sequence_parallel=True`` with no error)."""
    for fqn, m in modules.items():
        if isinstance(m, nn.RNNBase):
            return f"{type(m).__name__} {fqn} runs over the whole sequence"
    return None


def _position_table_outside_blocks(model: nn.Module, modules: dict[str, nn.Module], blocks: list[str]) -> str | None:
    """For ``"auto"``: a tensor of 2+ dims outside the blocks that no position-wise module owns, else None.

    Under sequence parallel the code between the embedding and the blocks sees only this rank's part of the
    sequence as a plain tensor. A position table there (``x + self.pe[:x.size(1)]``, a learned ``nn.Parameter``
    of positions) would then add positions ``0..T/tp`` on every rank: a wrong result with no error. Embeddings,
    Linears and norms act on each position alone, and one-dim tensors broadcast over channels, so those are
    safe; anything else turns ``"auto"`` off and is named (``sequence_parallel=True`` overrides it).
    """

    def position_wise(owner: nn.Module) -> bool:
        return isinstance(owner, (nn.Embedding, nn.Dropout)) or is_linear(owner) or _is_norm(owner)

    named = [*model.named_parameters(remove_duplicate=True), *model.named_buffers(remove_duplicate=True)]
    for name, t in named:
        owner_fqn = name.rpartition(".")[0]
        if any(owner_fqn == b or owner_fqn.startswith(b + ".") for b in blocks):
            continue
        if t.ndim >= 2 and not position_wise(modules[owner_fqn]):
            kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
            return (
                f"{kind} {name} {tuple(t.shape)} outside the blocks may be indexed by position, which sequence "
                "parallel would shard; pass sequence_parallel=True if it is not"
            )
    return None


def auto_tp_plan(
    model: nn.Module,
    tp_mesh: DeviceMesh | int,
    *,
    sequence_parallel: bool | Literal["auto"] = False,
    loss_parallel: bool = False,
    return_summary: bool = False,
) -> dict[str, ParallelStyle | tuple[ParallelStyle, ...]] | tuple[dict, list[str]]:
    """A ``parallelize_module`` plan for ``model`` on the 1-D ``tp_mesh`` (or a TP size), found from the
    model's structure (see the module docstring for the rules).

    Returns the plan (a plain dict of FQN -> style, or a tuple of styles applied in order); with
    ``return_summary=True`` returns ``(plan, summary)`` where ``summary`` is a list of lines, one per
    considered module: ``"<fqn>: <how it is sharded>"`` or ``"<fqn>: <why not>, left replicated"``.
    ``loss_parallel=True`` makes the LM head return vocab-sharded DTensor logits inside ``loss_parallel()``
    (the full logits, plain, outside it).
    ``sequence_parallel="auto"`` (the strategy's default) turns it on where ``True`` would apply and nothing
    outside the blocks could be indexed by position (see the module docstring); otherwise off with the reason
    as the first summary line, never an error.

    Example::

        plan, summary = auto_tp_plan(model, mesh["tensor_parallel"], sequence_parallel=True, return_summary=True)
        parallelize_module(model, mesh["tensor_parallel"], plan)

    >>> import torch
    >>> class MLP(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
    ...     def forward(self, x):
    ...         return self.down(torch.relu(self.up(x)))
    >>> plan, summary = auto_tp_plan(nn.Sequential(MLP()), 2, return_summary=True)
    >>> summary
    ['0: MLP, hidden 16 split over tp 2', '0.up: ColwiseParallel', '0.down: RowwiseParallel']
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

    def inside(f: str, parents) -> bool:
        return any(f == p or f.startswith(p + ".") for p in parents)

    # ---- find structures
    mha = [f for f, m in modules.items() if isinstance(m, nn.MultiheadAttention)]
    inside_mha = {f for f in modules for a in mha if f.startswith(a + ".")}
    attns: dict[str, _Attn] = {}
    mlps: dict[str, _Mlp] = {}
    for fqn, m in modules.items():
        if fqn in inside_mha or isinstance(m, nn.MultiheadAttention):
            continue
        a = _find_attention(fqn, m, tp, modules)
        if a is not None:
            attns[fqn] = a
    shared_head_tables = _shared_head_tables(modules, attns)
    bias_tables = _position_bias_tables(modules, attns, shared_head_tables)
    for a in attns.values():
        table = _per_head_parameter_outside(a, modules, bias_tables)
        if table is not None:
            a.sharded, a.divide, a.head_tables, a.head_projections, a.head_norms = False, [], [], [], []
            a.reason = (
                f"per-head parameter {table} outside the attention: the bias it makes covers every head, "
                "left replicated"
            )
    for a in attns.values():
        reader = _shared_kv_reader(a, modules, attns)
        if reader is not None and a.sharded:
            a.sharded, a.divide, a.head_tables, a.head_projections, a.head_norms = False, [], [], [], []
            a.reason = (
                f"{reader} (the same class, with a query but no key/value projection) attends over key/value "
                "states another layer computes; split by heads they would reach it as this rank's heads only, "
                "left replicated"
            )
    claimed = {f for a in attns.values() for f in [*a.q, a.o, *a.head_projections]}
    for fqn, m in modules.items():
        if fqn in inside_mha or fqn in attns or isinstance(m, nn.MultiheadAttention):
            continue
        mlp = _find_mlp(fqn, m)
        if mlp is not None and not ({mlp.down, *mlp.ups} & claimed):
            mlps[fqn] = mlp
            claimed |= {mlp.down, *mlp.ups}

    # A block written as one module (attention and MLP Linears side by side, e.g. nanoGPT-style compact blocks):
    # the MLP is among the Linears the attention did not claim.
    for a in attns.values():
        if not a.whole_module:
            rest = {
                _join(a.fqn, n): c
                for n, c in _linear_children(modules[a.fqn]).items()
                if _join(a.fqn, n) not in claimed
            }
            mlp = _match_mlp(a.fqn, rest, False)
            if mlp is not None:
                mlps[a.fqn] = mlp
                claimed |= {mlp.down, *mlp.ups}

    def block_list(structures) -> list[str]:
        return [
            _join(f, n)
            for f, m in modules.items()
            if isinstance(m, nn.ModuleList)
            for n, _ in m.named_children()
            if any(inside(x, [_join(f, n)]) for x in structures)
        ]

    # BERT-style MLPs whose up and down projections sit in sibling modules of an attention block.
    for b in block_list(list(attns)):
        if not any(inside(x, [b]) for x in mlps):
            mlp = _find_sibling_mlp(b, modules[b], claimed)
            if mlp is not None:
                mlps[b] = mlp
                claimed |= {mlp.down, *mlp.ups}
    blocks = block_list(list(attns) + list(mlps) + mha)
    # Outermost blocks only (T5 nests a ModuleList of layers inside each block).
    blocks = [b for b in blocks if not any(b != o and b.startswith(o + ".") for o in blocks)]
    blocks = _with_same_class_siblings(modules, blocks)
    in_block = {f for f in modules if inside(f, blocks)}
    embeddings = [
        f for f, m in modules.items() if isinstance(m, nn.Embedding) and f not in inside_mha and not inside(f, attns)
    ]
    embeddings = [e for e in embeddings if e not in shared_head_tables]
    # Embeddings a vocabulary-parallel style cannot serve (their own forward looks up indices it computes, or
    # their weight is read directly), and everything sharing their weight, stay replicated.
    unshardable = {e: why for e in embeddings if (why := _embedding_unshardable(e, modules))}
    for f, m in modules.items():  # a module tied to an embedding whose weight its owner's code reads
        emb = next((e for e in embeddings if e != f and getattr(m, "weight", None) is modules[e].weight), None)
        if emb is not None and emb not in unshardable and (why := _weight_read_directly(f, modules, values=True)):
            unshardable[emb] = f"its weight is tied to {f}, and {why}"
    kept_weights = {id(modules[e].weight): e for e in unshardable}
    for e in embeddings:
        if e not in unshardable and id(modules[e].weight) in kept_weights:
            unshardable[e] = f"its weight is shared with {kept_weights[id(modules[e].weight)]}, which stays replicated"
    vocab_emb = max(embeddings, key=lambda e: modules[e].num_embeddings, default=None)
    tied = {id(modules[e].weight): e for e in embeddings}
    heads = [
        f
        for f, m in modules.items()
        if is_linear(m)
        and f not in in_block
        and f not in inside_mha
        and f not in claimed
        and id(m.weight) not in kept_weights
        and (
            id(m.weight) in tied
            or (
                vocab_emb is not None
                and linear_dims(m) == (modules[vocab_emb].embedding_dim, modules[vocab_emb].num_embeddings)
            )
        )
    ]
    # MLP hidden sizes must divide, and nothing but the MLP's Linears may act on its (split) hidden activations;
    # the pair must read and write a stream width (what the attentions read), else it is a bottleneck.
    widths = {linear_dims(modules[a.q[0]])[0] for a in attns.values()} | {modules[f].embed_dim for f in mha}
    for mlp in mlps.values():
        mlp.reason = _mlp_blocker(mlp, modules, attns, tp, widths)
        mlp.sharded = not mlp.reason

    # ---- can sequence parallel run?
    sp = _sequence_parallel_choice(sequence_parallel)
    if sp:
        why = _sequence_parallel_blocker(blocks, attns, mlps, mha)
        hf = _hugging_face_model(modules, blocks[0]) if blocks and why is None else None
        if why is None and hf is not None:
            if sequence_parallel is True:
                # Explicitly asked for and cannot work: refuse here, on every rank alike, instead of a raw
                # shape error in forward or an option silently ignored.
                raise ValueError(
                    f"auto_tp_plan: sequence_parallel=True cannot apply to the Hugging Face model {hf}: its "
                    "forward builds the attention mask and positions from the embedding output, which sequence "
                    "parallel shards along the sequence (a shape mismatch in forward); pass sequence_parallel=False"
                )
            why = f"the Hugging Face model {hf} builds its attention mask and positions from the embedding output"
        if why is None:
            why = _recurrence(modules)
            if why is not None and sequence_parallel is True:  # it cannot work: refuse, as for Hugging Face
                raise ValueError(
                    f"auto_tp_plan: sequence_parallel=True cannot apply: {why} (it would see each rank's part of "
                    "the sequence only, a wrong result with no error); pass sequence_parallel=False"
                )
        if why is None and sequence_parallel == "auto":
            why = _position_table_outside_blocks(model, modules, blocks)
        if why:
            lines.append(f"sequence_parallel: off ({why})")
            sp = False
        else:
            lines.append("sequence_parallel: on (sequence dim 1)")
    seq = Shard(1)
    block_in = seq if sp else Replicate()

    # ---- embeddings
    for e in embeddings:
        emb = modules[e]
        if e in unshardable:
            lines.append(f"{e}: embedding left replicated ({unshardable[e]})")
            continue
        add(e, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-2) if sp else Replicate()))
        out = "reduce-scattered to the sequence dim" if sp else "all-reduced"
        lines.append(f"{e}: RowwiseParallel (vocab-parallel embedding, {emb.num_embeddings} rows; output {out})")

    # ---- attention
    for t in shared_head_tables:
        add(t, ColwiseParallel(input_layouts=Replicate()))
        lines.append(f"{t}: ColwiseParallel (per-head table shared by the attentions, columns split like the heads)")
    for mha_fqn in mha:
        lines.append(
            f"{mha_fqn}: nn.MultiheadAttention left replicated (its packed in_proj_weight is used inside "
            "F.multi_head_attention_forward; no Linear style can shard it)"
        )
    for a in attns.values():
        if not a.sharded:
            lines.append(f"{a.fqn}: {a.reason}")
            continue
        if a.whole_module:
            add(a.fqn, _prepare_block_input(modules[a.fqn], block_in))
        o_style = RowwiseParallel(output_layouts=seq if sp else None)
        if len(a.q) == 1:
            fused = modules[a.q[0]]
            d_in, d_out = linear_dims(fused)
            add(a.q[0], ColwiseParallel(output_layouts=Replicate()))
            o_style = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else None)
            lines.append(
                f"{a.fqn}: attention with fused qkv '{a.q[0].rsplit('.', 1)[-1]}' ({d_in} -> {d_out}): "
                "projections sharded, attention math replicated"
            )
            lines.append(
                f"{a.q[0]}: ColwiseParallel(output_layouts=Replicate()) (fused qkv: output gathered, "
                "a column shard would mix q, k and v)"
            )
            add(a.o, o_style)
            lines.append(f"{a.o}: RowwiseParallel(input_layouts=Replicate())")
            continue
        if a.divide:
            add(a.fqn, DivideAttributes(a.divide))
        kv = f", kv heads {a.kv_heads}" if a.kv_heads != a.heads else ""
        adj = f"; divides {', '.join(a.divide)} by {tp}" if a.divide else ""
        lines.append(f"{a.fqn}: attention, heads {a.heads}{kv} split over tp {tp}{adj}")
        for n in a.q:
            add(n, ColwiseParallel())
            lines.append(f"{n}: ColwiseParallel")
        add(a.o, o_style)
        lines.append(f"{a.o}: RowwiseParallel")
        for n in a.head_projections:
            add(n, ColwiseParallel())
            lines.append(f"{n}: ColwiseParallel (projects into the query's head space, split like the heads)")
        for t in a.head_tables:
            add(t, ColwiseParallel(input_layouts=Replicate()))
            lines.append(f"{t}: ColwiseParallel (per-head table, columns split like the heads)")
        for t in a.head_norms:
            # Its input is this rank's heads (a plain tensor): as a shard on a non-normalised dim, the norm runs
            # locally and its replicated weight's gradient is summed over the TP ranks.
            add(t, SequenceParallel(sequence_dim=-2, use_local_output=True))
            lines.append(f"{t}: per-head norm, parameters replicated, gradient summed over tp")

    # ---- MLPs
    for mlp in mlps.values():
        if not mlp.sharded:
            lines.append(f"{mlp.fqn}: {mlp.reason}, left replicated")
            continue
        if mlp.whole_module:
            add(mlp.fqn, _prepare_block_input(modules[mlp.fqn], block_in))
        lines.append(f"{mlp.fqn}: MLP, hidden {mlp.hidden} split over tp {tp}")
        for u in mlp.ups:
            add(u, ColwiseParallel())
            lines.append(f"{u}: ColwiseParallel")
        add(mlp.down, RowwiseParallel(output_layouts=seq if sp else None))
        lines.append(f"{mlp.down}: RowwiseParallel")

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
        # Dropout on the sequence-sharded stream (the embedding's, each residual branch's): as a plain tensor
        # every rank would draw the same mask for its part of the sequence (positions t and t + T/tp dropped
        # alike), not one device's. A DTensor input draws one device's mask and keeps its part, as torch's
        # SequenceParallel does for nn.Dropout. Only where the input is surely the sequence-sharded stream: in a
        # block outside the sharded attention and MLP (whose dropout may act on heads or hidden columns), or
        # before the first block; one after the blocks may see the gathered output.
        sharded_units = [a.fqn for a in attns.values() if a.sharded and a.whole_module]
        sharded_units += [p.fqn for p in mlps.values() if p.sharded and p.whole_module]
        first = order.index(blocks[0])
        for f, m in modules.items():
            if not isinstance(m, nn.Dropout) or f in inside_mha or inside(f, sharded_units):
                continue
            if f in in_block or order.index(f) < first:
                add(f, SequenceParallel(use_local_output=True))
                lines.append(f"{f}: SequenceParallel (dropout on the sequence-sharded activations)")
        if not heads:
            add(last, PrepareModuleOutput(output_layouts=seq, desired_output_layouts=Replicate()))
            lines.append(f"{last}: output gathered from the sequence dim (no LM head follows)")

    # ---- heads and other Linears no rule claimed
    for f, m in modules.items():
        if not is_linear(m) or f in claimed or f in inside_mha:
            continue
        d_in, d_out = linear_dims(m)
        if f in heads:
            head_input = seq if sp else Replicate()
            gather_why = _why_no_loss_parallel(f, modules, d_out) if loss_parallel else None
            if loss_parallel and gather_why is None:
                add(f, LossParallelHead(input_layouts=head_input))
            else:
                add(f, ColwiseParallel(input_layouts=head_input, output_layouts=Replicate()))
            tie = (
                f", weight tied to {tied[id(m.weight)]} (both Shard(0) on the vocabulary)"
                if id(m.weight) in tied
                else ""
            )
            out = (
                "vocab-sharded DTensor logits inside loss_parallel(), gathered outside it"
                if loss_parallel and gather_why is None
                else "logits gathered"
            )
            if gather_why is not None:
                out += f"; no loss parallelism: {gather_why}"
            lines.append(f"{f}: ColwiseParallel (LM head, {d_out} classes{tie}; {out})")
        elif f in in_block:
            lines.append(
                f"{f}: Linear {d_in} -> {d_out} inside a block but not part of a recognised attention or MLP, "
                "left replicated"
            )
        else:
            lines.append(
                f"{f}: Linear {d_in} -> {d_out} outside the blocks, not an LM head (not tied to the token "
                f"embedding and not its shape), left replicated"
            )
    _note_dropout(modules, [a.fqn for a in attns.values() if a.sharded and len(a.q) > 1], mlps, lines)
    final = {k: (v[0] if len(v) == 1 else tuple(v)) for k, v in plan.items()}
    return (final, lines) if return_summary else final


def _with_same_class_siblings(modules: dict[str, nn.Module], blocks: list[str]) -> list[str]:
    """``blocks`` plus the other layers of their ModuleLists that are of a block's class: a layer whose attention
    or MLP the rules do not recognise (Reformer's LSH-attention layer beside a local-attention one) is still a
    block, so its Linears are never taken for an LM head or said to be outside the blocks."""
    kinds = {(b.rsplit(".", 1)[0], type(modules[b])) for b in blocks if "." in b}
    extra = [
        f"{parent}.{n}"
        for parent, kind in kinds
        for n, child in modules[parent].named_children()
        if type(child) is kind and f"{parent}.{n}" not in blocks
    ]
    return [b for b in modules if b in blocks or b in extra]


def _why_no_loss_parallel(fqn: str, modules: dict[str, nn.Module], vocab: int) -> str | None:
    """Why the LM head ``fqn`` must gather its logits under ``loss_parallel``, or None when it need not."""
    beside = _per_vocabulary_tensor_beside(fqn, modules, vocab)
    if beside is not None:
        return (
            f"{beside}, a per-vocabulary tensor beside the head that the model's code applies to the logits as a "
            "plain tensor"
        )
    return _router_loss_added(modules)


def _router_loss_added(modules: dict[str, nn.Module]) -> str | None:
    """A Hugging Face mixture-of-experts model whose config adds the routers' auxiliary loss to the loss it returns
    (``output_router_logits=True``: Mixtral, Qwen2-MoE, NLLB-MoE, ...): under loss parallelism the vocabulary-parallel
    loss is a DTensor, and adding the plain auxiliary loss to it sends DTensor gradients into the routers' and
    experts' backward, which mix them with this rank's local activations (an error in the first backward)."""
    for fqn, m in modules.items():
        config = getattr(m, "config", None)
        if getattr(config, "output_router_logits", False) is True:
            return (
                f"{fqn or 'the model'}.config.output_router_logits=True adds the routers' auxiliary loss, a plain "
                "tensor, to the loss, which loss parallelism would make a DTensor"
            )
    return None


def _per_vocabulary_tensor_beside(fqn: str, modules: dict[str, nn.Module], vocab: int) -> str | None:
    """A buffer or parameter of the LM head ``fqn``'s parent with one value per vocabulary entry (BART's, Marian's
    and PEGASUS's ``final_logits_bias`` of shape ``(1, vocab)``, added to the head's output in the model's
    forward), as ``"name (shape)"``, else None. Vocabulary-sharded logits met it as a plain tensor: an error in
    the first step under ``loss_parallel``."""
    parent = modules.get(fqn.rpartition(".")[0])
    if parent is None:
        return None
    head_own = {id(t) for t in modules[fqn].parameters()}  # BERT's prediction bias is the decoder's own bias
    owned = [*parent.named_buffers(recurse=False), *parent.named_parameters(recurse=False)]
    for name, t in owned:
        if t is None or id(t) in head_own:
            continue
        if t.ndim >= 1 and t.shape[-1] == vocab and t.numel() == vocab:
            return f"{name} {tuple(t.shape)}"
    return None


def _dropout_p(m: nn.Module) -> float:
    """The largest dropout probability ``m`` may apply: its ``nn.Dropout`` modules, or float attributes named
    ``*dropout*`` (Hugging Face attention passes ``self.dropout``/``attention_dropout`` to its kernel)."""
    ps = [d.p for d in m.modules() if isinstance(d, nn.Dropout)]
    ps += [v for k, v in vars(m).items() if "dropout" in k and isinstance(v, float)]
    return max(ps, default=0.0)


def _note_dropout(modules: dict[str, nn.Module], attns: list[str], mlps: dict, lines: list[str]) -> None:
    """Say (summary line and a warning) where dropout in training mode meets tensor-parallel local shards.

    Inside a sharded attention or MLP the activations are each rank's local columns (its heads, its part of
    the MLP hidden size), plain tensors: every rank, seeded alike, draws the same mask for its own columns. That
    is valid dropout, but not the mask one device draws (and head groups on different ranks get equal masks),
    so training is not bit-identical to one device. DTensor random ops do match one device (docs/dtensor.md).
    """
    found = [
        (f, p)
        for f in [*attns, *(m.fqn for m in mlps.values() if m.sharded)]
        if modules[f].training and (p := _dropout_p(modules[f])) > 0
    ]
    if not found:
        return
    where = ", ".join(f"{f} (p={p:g})" for f, p in found[:3])
    where += f" and {len(found) - 3} more" if len(found) > 3 else ""
    text = (
        f"dropout in training mode inside tensor-parallel modules: {where}. It applies to each rank's local shard "
        "(its heads / MLP columns) with the same random stream on every rank: valid dropout, but not the masks one "
        "device draws, so results are not bit-identical to one device (eval mode or dropout 0 are)"
    )
    lines.append(f"dropout: {text}")
    warnings.warn(f"auto_tp_plan: {text}", stacklevel=3)


def _is_norm(m: nn.Module) -> bool:
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    params = list(m.parameters(recurse=False))
    return "norm" in type(m).__name__.lower() and all(p.ndim <= 1 for p in params) and not list(m.children())
