"""``loss_parallel()``: cross-entropy on logits sharded on the class (vocabulary) dim, without gathering them.

Inside the context, the DTensor ops that ``F.cross_entropy`` (and ``F.log_softmax`` + ``F.nll_loss``)
decompose into get vocab-parallel handlers when their input is sharded on the class dim:

* ``_log_softmax``: local max and sum of exponentials, each all-reduced over the sharding mesh dim
  (max, then sum), so every rank holds its columns of the exact log-probabilities.
* ``nll_loss_forward`` / ``nll_loss2d_forward``: each rank picks the targets that fall in its column range
  (others contribute 0) and one all-reduce (sum) of the picked values gives every row's loss; the loss is
  replicated. ``ignore_index``, class ``weight`` and ``reduction`` follow torch.
* ``nll_loss_backward`` / ``nll_loss2d_backward``: the gradient is scattered into the local columns only
  (no communication); it stays sharded like the input.
* ``_log_softmax_backward_data``: ``grad - exp(out) * sum(grad)``, the row sum all-reduced (one float per
  row). (torch fuses this into the nll backward; unfused it stays right for any upstream gradient.)

Uneven vocabularies (101 classes on 2 ranks) follow ``torch.chunk``. Inputs without a shard on the class
dim go to the ordinary rules. Like torch's, the backward must run inside the context too. Supported: one
mesh dim sharding the class dim, the other mesh dims ``Replicate``; a plain target is the full target.
Label smoothing sums the log-probabilities over the class dim (a partial sum, all-reduced) and zeroes
ignored rows with a plain mask, lifted to a replicated DTensor; class-probability targets take the ordinary
(gathering) path.

Example::

    with loss_parallel():
        loss = F.cross_entropy(logits, target)     # logits: DTensor (Shard(-1),) of shape (N, V)
        loss.backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lightning_shard import comm
from lightning_shard.tensor import dispatch as _dispatch
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.ops import load_rules
from lightning_shard.tensor.placements import Replicate
from lightning_shard.tensor.redistribute import redistribute_local

__all__ = ["loss_parallel", "full_logits", "sharded_logits_wanted", "replicated_loss"]

aten = torch.ops.aten
_NONE, _MEAN, _SUM = 0, 1, 2


def _class_mesh_dim(x: DTensor, dim: int) -> int | None:
    """The mesh dim sharding tensor dim ``dim`` when that is the only non-Replicate placement, else None."""
    shards = [i for i, p in enumerate(x.placements) if p.is_shard(dim)]
    if len(shards) != 1:
        return None
    if any(not p.is_replicate() for i, p in enumerate(x.placements) if i != shards[0]):
        return None
    return shards[0]


def _full_local(t):
    """The whole value of ``t`` on this rank (a plain tensor, or a DTensor made replicated)."""
    if isinstance(t, DTensor):
        return redistribute_local(t._local_tensor, t._spec, tuple([Replicate()] * t.device_mesh.ndim))
    return t


def _wrap(local: torch.Tensor, meta: torch.Tensor, mesh, placements) -> DTensor:
    from lightning_shard.tensor.spec import DTensorSpec

    spec = DTensorSpec(mesh, tuple(placements), meta.shape, tuple(meta.stride()), meta.dtype)
    return DTensor(local, spec, requires_grad=False)


def _meta(a):
    if isinstance(a, DTensor):
        s = a._spec
        return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    return a


def _col_range(x: DTensor, dim: int) -> tuple[int, int]:
    return x._spec.local_offset[dim], x._spec.local_shape[dim]


def _log_softmax(func, args, kwargs):
    x, dim, half_to_float = args
    dim = dim % x.ndim
    mesh_dim = _class_mesh_dim(x, dim)
    if mesh_dim is None:
        return None
    group = x.device_mesh.get_group(mesh_dim)
    local = x._local_tensor
    xmax = (
        local.amax(dim, keepdim=True) if local.shape[dim] else torch.full_like(local.sum(dim, keepdim=True), -torch.inf)
    )
    comm.all_reduce(xmax, group, op="max")
    shifted = local - xmax
    sumexp = shifted.exp().sum(dim, keepdim=True)
    comm.all_reduce(sumexp, group)
    out = shifted - sumexp.log()
    meta = func(_meta(x), dim, half_to_float)
    return _wrap(out.to(meta.dtype), meta, x.device_mesh, x.placements)


def _log_softmax_backward(func, args, kwargs):
    grad, out, dim, input_dtype = args
    if not isinstance(out, DTensor):
        return None
    dim = dim % out.ndim
    mesh_dim = _class_mesh_dim(out, dim)
    if mesh_dim is None or not isinstance(grad, DTensor) or grad.placements != out.placements:
        return None
    g = grad._local_tensor
    total = g.sum(dim, keepdim=True)
    comm.all_reduce(total, out.device_mesh.get_group(mesh_dim))
    result = g - out._local_tensor.exp() * total
    meta = func(_meta(grad), _meta(out), dim, input_dtype)
    return _wrap(result.to(meta.dtype), meta, out.device_mesh, out.placements)


def _picked(x: DTensor, target: torch.Tensor, ignore_index: int, channel: int):
    """(global-safe target, mask of targets in this rank's columns, local column index)."""
    start, length = _col_range(x, channel)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    mine = valid & (safe >= start) & (safe < start + length)
    local_idx = torch.where(mine, safe - start, 0)
    return safe, valid, mine, local_idx


def _nll_forward(func, args, kwargs):
    x, target, weight, reduction, ignore_index = args
    channel = 1 if x.ndim >= 2 else 0
    mesh_dim = _class_mesh_dim(x, channel)
    if mesh_dim is None or target.dtype.is_floating_point:
        return None
    t = _full_local(target)
    w = _full_local(weight)
    local = x._local_tensor
    safe, valid, mine, local_idx = _picked(x, t, ignore_index, channel)
    if local.shape[channel]:
        picked = local.gather(channel, local_idx.unsqueeze(channel)).squeeze(channel)
    else:
        picked = torch.zeros(t.shape, dtype=local.dtype, device=local.device)
    picked = torch.where(mine, picked, 0)
    comm.all_reduce(picked, x.device_mesh.get_group(mesh_dim))
    wt = w[safe] if w is not None else torch.ones_like(picked)
    wt = torch.where(valid, wt, 0).to(picked.dtype)
    loss = -picked * wt
    if reduction == _NONE:
        total = loss.new_zeros(())
        out = loss
    else:
        total = wt.sum()
        out = loss.sum() if reduction == _SUM else loss.sum() / total
    meta_out, meta_total = func(_meta(x), _meta(target), _meta(weight), reduction, ignore_index)
    replicated = tuple([Replicate()] * x.device_mesh.ndim)
    return _wrap(out, meta_out, x.device_mesh, replicated), _wrap(total, meta_total, x.device_mesh, replicated)


def _nll_backward(func, args, kwargs):
    grad, x, target, weight, reduction, ignore_index, total_weight = args
    channel = 1 if x.ndim >= 2 else 0
    mesh_dim = _class_mesh_dim(x, channel)
    if mesh_dim is None:
        return None
    t, w, g, total = (_full_local(a) for a in (target, weight, grad, total_weight))
    local = x._local_tensor
    safe, valid, mine, local_idx = _picked(x, t, ignore_index, channel)
    scale = torch.ones(t.shape, dtype=local.dtype, device=local.device) * g
    if reduction == _MEAN:
        scale = scale / total
    if w is not None:
        scale = scale * w[safe].to(local.dtype)
    value = torch.where(mine, -scale, 0).to(local.dtype)
    result = torch.zeros_like(local)
    if local.shape[channel]:
        result.scatter_(channel, local_idx.unsqueeze(channel), value.unsqueeze(channel))
    meta = func(*(_meta(a) for a in args))
    return _wrap(result, meta, x.device_mesh, x.placements)


def _masked_fill_plain_mask(func, args, kwargs):
    """``masked_fill`` of a DTensor with a plain mask: the mask is the full one on every rank (it comes from the
    plain target, ``target == ignore_index``), so it is lifted to a replicated DTensor.

    Why: ``F.cross_entropy(..., label_smoothing=s)`` zeroes the ignored rows of its smoothing term (the class-dim
    sum of the log-probabilities, a DTensor) with such a mask, in forward and backward; mixing a plain tensor of
    more than one element with DTensors raises, so label smoothing failed under loss_parallel."""
    x, mask = args[0], args[1]
    if not isinstance(x, DTensor) or isinstance(mask, DTensor) or not isinstance(mask, torch.Tensor):
        return None
    if mask.numel() <= 1:
        return None
    lifted = DTensor.from_local(mask, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
    return func(x, lifted, *args[2:], **kwargs)


def _add_partial_to_replicated(func, args, kwargs):
    """``a + b`` of a replicated and a partial-sum DTensor of the same shape: the partial one is all-reduced first,
    so the sum is replicated.

    Why: with ``label_smoothing`` the loss is ``(1 - s) * nll + smoothing * s / classes``, the nll term replicated,
    the smoothing term a partial sum over the vocabulary shards. A partial loss escaped into ``self.log``: its value
    needs an all-reduce, which a logger calling ``.item()`` on rank 0 only started alone (a hang), and which
    c10d's all-reduce of ``sync_dist`` did not do (each rank logged its own part). Replicated like the loss without
    smoothing, it is one all-reduce of the loss values (one per row at most) here instead."""
    a, b = args[0], args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        return None
    if a._spec.has_partial() == b._spec.has_partial():  # the common case, decided first: every add passes here
        return None
    if a.device_mesh != b.device_mesh or tuple(a.shape) != tuple(b.shape):
        return None
    kinds = [(all(p.is_replicate() for p in t.placements), all(p.is_partial() for p in t.placements)) for t in (a, b)]
    if not ((kinds[0][0] and kinds[1][1]) or (kinds[0][1] and kinds[1][0])):
        return None
    mesh = a.device_mesh
    replicate = [Replicate()] * mesh.ndim
    a, b = (t if kind[0] else _wrap(_full_local(t), _meta(t), mesh, replicate) for t, kind in zip((a, b), kinds))
    return func(a, b, *args[2:], **kwargs)


_HANDLERS = {
    aten.add.Tensor: _add_partial_to_replicated,
    aten.masked_fill_.Scalar: _masked_fill_plain_mask,
    aten.masked_fill.Scalar: _masked_fill_plain_mask,
    aten._log_softmax.default: _log_softmax,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.nll_loss_forward.default: _nll_forward,
    aten.nll_loss2d_forward.default: _nll_forward,
    aten.nll_loss_backward.default: _nll_backward,
    aten.nll_loss2d_backward.default: _nll_backward,
}
_DEPTH = 0
_FULL_DEPTH = 0
_SAVED: dict = {}


def _ordinary(func, args, kwargs, previous):
    """What the dispatcher does without our handler: the op's own custom handler, else its ordinary dispatch
    (fast path and decision cache included: the handlers decline most adds of a training step)."""
    if previous is not None:
        return previous(func, args, kwargs)
    return _dispatch.dispatch_by_rule(func, args, kwargs)


def _make(handler, previous):
    def run(func, args, kwargs):
        out = handler(func, args, kwargs)
        return _ordinary(func, args, kwargs, previous) if out is None else out

    return run


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute cross-entropy on class-sharded logits without gathering them (see the module docstring).

    Example::

        with loss_parallel():
            loss = F.cross_entropy(model(x), y)    # the LM head: ColwiseParallel(use_local_output=False)
            loss.backward()

    On one rank:

    >>> from torch import nn
    >>> from lightning_shard import init_device_mesh
    >>> from lightning_shard.tp import ColwiseParallel, parallelize_module
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> head = parallelize_module(nn.Linear(8, 10), mesh, ColwiseParallel(use_local_output=False))
    >>> logits = head(torch.randn(4, 8))
    >>> logits.placements                     # sharded over the vocabulary
    (Shard(dim=1),)
    >>> with loss_parallel():
    ...     loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    ...     loss.backward()
    >>> loss.placements, head.weight.grad.placements
    ((Replicate(),), (Shard(dim=0),))
    """
    global _DEPTH
    load_rules()
    if _DEPTH == 0:
        for op, handler in _HANDLERS.items():
            ordinary = _dispatch._custom_handler(op)  # registered for the overload or for its packet
            _SAVED[op] = _dispatch.swap_custom(op, _make(handler, ordinary))
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            for op, previous in _SAVED.items():
                _dispatch.swap_custom(op, previous)
            _SAVED.clear()


def _sharded_logits_hint(specs) -> str:
    """For the mixing error inside ``loss_parallel()``: the DTensor met is, in practice, the LM head's
    vocabulary-sharded logits or a value computed from them (an ``argmax`` compared with plain labels, a
    ``softmax`` against a plain target), which user code takes for a plain tensor."""
    if not sharded_logits_wanted():
        return ""
    return (
        ". Inside loss_parallel() (the strategy's loss_parallel=True runs the training, validation and test steps "
        "in it) an LM head planned for loss parallelism returns its logits as a vocabulary-sharded DTensor, and "
        "what is computed from them (argmax, softmax, topk, ...) is a DTensor too. Call .full_tensor() on that "
        "value before mixing it with plain tensors (e.g. logits.argmax(-1).full_tensor() == labels), or run the "
        "forward inside lightning_shard.tp.full_logits() to get plain, whole logits"
    )


_dispatch.register_mixing_hint(_sharded_logits_hint)


def sharded_logits_wanted() -> bool:
    """True inside ``loss_parallel()`` and outside ``full_logits()``: where an LM head planned for loss parallelism
    (``lightning_shard.tp.loss_head.LossParallelHead``) keeps its logits vocabulary-sharded."""
    return _DEPTH > 0 and _FULL_DEPTH == 0


@contextlib.contextmanager
def full_logits() -> Iterator[None]:
    """Inside, an LM head planned for loss parallelism returns full, plain logits, also within ``loss_parallel()``.

    Why: code that consumes the logits as plain tensors inside a loss-parallel step (Hugging Face ``generate`` in a
    ``validation_step``, a top-k over the vocabulary) cannot take a vocabulary-sharded DTensor.

    Example::

        with loss_parallel(), full_logits():
            tokens = model.generate(ids, max_new_tokens=4)
    """
    global _FULL_DEPTH
    _FULL_DEPTH += 1
    try:
        yield
    finally:
        _FULL_DEPTH -= 1


def replicated_loss(loss: DTensor) -> torch.Tensor:
    """A loss computed inside ``loss_parallel()`` as a plain tensor holding its whole value on every rank, with
    gradients flowing back into the DTensor graph (call ``backward`` on it inside ``loss_parallel()``).

    A loss with a partial placement (cross-entropy with label smoothing: its smoothing term sums the
    log-probabilities over the sharded vocabulary) is all-reduced first; its local value alone is one rank's part.

    Example::

        with loss_parallel():
            loss = replicated_loss(F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1)))
            loss.backward()
    """
    if any(not p.is_replicate() for p in loss.placements):
        loss = loss.redistribute(loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
    return loss.to_local()
