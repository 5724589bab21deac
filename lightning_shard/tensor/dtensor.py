"""DTensor: a torch.Tensor wrapper subclass holding a local shard, a mesh and one placement per mesh dim.

Autograd sees the DTensor (its global shape); every aten op below autograd goes through
``__torch_dispatch__`` to a sharding rule (``dispatch.py``). The four conversions (``from_local``,
``to_local``, ``redistribute``, ``full_tensor``) are autograd functions, so gradients flow through them with
the placements a user expects: the gradient of a ``Partial`` input is ``Replicate``.

Example::

    x = DTensor.from_local(torch.randn(4, 5), mesh, [Shard(0)])   # a (4 * world, 5) tensor
    y = (x * 2).redistribute(mesh, [Replicate()])
    y.to_local().shape                                             # (4 * world, 5)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_shard.device import same_storage
from lightning_shard.mesh import DeviceMesh
from lightning_shard.sac import outside_sac
from lightning_shard.tensor._layout import check_placements, local_shape_and_offset
from lightning_shard.tensor.placements import Placement, Replicate
from lightning_shard.tensor.redistribute import redistribute_local
from lightning_shard.tensor.spec import DTensorSpec

__all__ = ["DTensor"]


class DTensor(torch.Tensor):
    """A distributed tensor. See the module docstring; build one with ``from_local`` or ``distribute_tensor``.

    >>> from lightning_shard import init_device_mesh
    >>> from lightning_shard.tensor import Shard
    >>> x = DTensor.from_local(torch.ones(2, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
    >>> x.shape, x.placements, (x * 2).full_tensor().sum().item()
    (torch.Size([2, 3]), (Shard(dim=0),), 12.0)
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    __slots__ = ["_local_tensor", "_spec"]

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=spec.stride,
            dtype=local_tensor.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        # The conjugate and negative bits are lazy views: the wrapper must carry the local tensor's, or torch
        # would read the wrapper as already resolved (conj(x) * 2 would lose the conjugation). torch's DTensor
        # does the same.
        if local_tensor.is_conj():
            torch._C._set_conj(r, True)
        if local_tensor.is_neg():
            torch._C._set_neg(r, True)
        return r

    # Ops skip __torch_function__ and go straight to __torch_dispatch__ (below autograd).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from lightning_shard.tensor.dispatch import dispatch

        try:
            return dispatch(func, args, kwargs or {})
        except (RuntimeError, ValueError, TypeError) as error:
            from lightning_shard.tensor.caller_hints import raise_for_caller

            raise_for_caller(error)  # prune / nn.init.sparse_ behind a refused op: name them (caller_hints.py)
            raise

    def __repr__(self) -> str:
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, placements={self.placements})"
        )

    def __tensor_flatten__(self):
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        spec, requires_grad = flatten_spec
        return DTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)

    def __reduce_ex__(self, protocol):
        # Pickling (torch.save, deepcopy of a model) keeps the local shard and the layout, not the mesh's groups.
        raise RuntimeError(
            "DTensor cannot be pickled directly: save shards with lightning_shard.checkpoint.save, or call "
            ".full_tensor() / .to_local() first"
        )

    def __deepcopy__(self, memo):
        local = self._local_tensor.detach().clone()
        out = DTensor(local, self._spec, requires_grad=self.requires_grad)
        if getattr(self, "_is_param", False):  # nn.Parameter(dtensor) is a DTensor flagged as a parameter
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    # ------------------------------------------------------------------ properties
    @property
    def data(self) -> torch.Tensor:
        """A detached DTensor sharing this one's local shard (as ``Tensor.data``)."""
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``x.data = value`` on a plain tensor swaps its storage. On a DTensor that would swap only the
        wrapper while the local shard, which every op and FSDP's all-gather read, stayed: the assignment was
        silently lost. A DTensor of the same shape, dtype and mesh is redistributed to this one's placements and
        copied into the local shard (also one on a sub-mesh of this one's mesh or on a mesh containing it, as
        ``_submesh.py`` aligns op arguments; same values; ``x`` does not alias ``value`` afterwards:
        ``torch.nn.utils.vector_to_parameters`` assigns replicated slices to sharded parameters this way);
        anything else raises, naming the way that works."""
        from lightning_shard.tensor._submesh import on_mesh  # _submesh builds DTensors: imported when used

        same = isinstance(value, DTensor) and value.shape == self.shape and value.dtype == self.dtype
        # A value on a sub-mesh of this one's mesh or on a mesh containing it (FSDP over TP, see _submesh.py)
        aligned = on_mesh(value, self._spec.mesh) if same else None
        if aligned is not None:
            with torch.no_grad():
                if aligned.placements != self.placements:
                    aligned = aligned.redistribute(self._spec.mesh, self.placements)
                self._local_tensor.copy_(aligned._local_tensor)
            return
        got = (
            f"a DTensor {tuple(value.shape)} {value.dtype} {value.placements}"
            if isinstance(value, DTensor)
            else f"a {type(value).__name__} {tuple(value.shape)} {value.dtype}"
        )
        raise TypeError(
            f"DTensor.data = ...: the new value must be a DTensor of the same shape, dtype and mesh "
            f"({tuple(self.shape)} {self.dtype} {self.placements}), got {got}. Write the values in place instead: "
            f"`with torch.no_grad(): param.copy_(distribute_tensor(full_value, param.device_mesh, "
            f"param.placements))`, or for a new dtype cast the module before sharding it"
        )

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dimension."""
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh this tensor is distributed over."""
        return self._spec.mesh

    # ------------------------------------------------------------------ conversions
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        *,
        shape: torch.Size | Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        run_check: bool = False,
    ) -> DTensor:
        """Wrap this rank's ``local_tensor`` as the shard of a DTensor (no communication unless asked).

        Without ``shape``, the global shape assumes every rank holds the same local shape (even shards);
        pass ``shape`` for uneven shards. ``run_check=True`` checks the local shapes against ``shape`` on
        every rank (one all-gather of shapes) and broadcasts ``Replicate`` dims from the first rank.

        Example: ``DTensor.from_local(torch.ones(3, 5), mesh, [Shard(0)], shape=(7, 5))`` on rank 1 of 2.
        """
        placements = check_placements(placements, local_tensor.ndim, device_mesh.ndim, "DTensor.from_local")
        if shape is None:
            shape = list(local_tensor.shape)
            for i, p in enumerate(placements):
                if p.is_shard():
                    shape[p.dim] *= device_mesh.size(i)
        shape = torch.Size(shape)
        stride = tuple(stride) if stride is not None else _global_stride(local_tensor, shape)
        spec = DTensorSpec(device_mesh, placements, shape, stride, local_tensor.dtype)
        if run_check:
            _check_local_shapes(local_tensor, spec)
        return _FromLocal.apply(local_tensor, spec, run_check)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard as a plain tensor (a view; gradients flow back to the DTensor).

        Example: ``x.to_local().shape == x._spec.local_shape``.
        """
        if not torch.is_grad_enabled():
            return self._local_tensor
        return _ToLocal.apply(self, tuple(grad_placements) if grad_placements is not None else None)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> DTensor:
        """The same global value laid out with ``placements`` (collectives as needed; see redistribute.py).

        Example: ``x.redistribute(mesh, [Replicate()])``.
        """
        if device_mesh is not None and device_mesh != self.device_mesh:
            raise ValueError(
                f"DTensor.redistribute: moving between meshes ({self.device_mesh} -> {device_mesh}) is not "
                "supported; redistribute on the tensor's own mesh"
            )
        if placements is None:
            raise ValueError("DTensor.redistribute: pass the target placements")
        placements = check_placements(placements, self.ndim, self.device_mesh.ndim, "DTensor.redistribute")
        # Even to the same placements, go through autograd (as torch does): the backward turns a Partial
        # gradient into the Replicate (or Shard) gradient the input's placements call for.
        return _Redistribute.apply(self, placements)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (all-gather / all-reduce as needed).

        Example: ``distribute_tensor(t, mesh, [Shard(0)]).full_tensor()`` equals ``t``.
        """
        replicated = self.redistribute(self.device_mesh, [Replicate()] * self.device_mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    def tolist(self) -> list | int | float | bool:
        """The global value as (nested) Python numbers, the same on every rank: a collective, as ``.item()``.

        Why: ``Tensor.tolist`` refuses every tensor subclass, and code written for plain tensors reads masks and
        scores this way after a step (peft's AdaLoRA turns its rank mask into a list in ``update_and_allocate``).
        Call it on every rank, as any other collective.

        Example: ``distribute_tensor(torch.tensor([1, 2]), mesh, [Shard(0)]).tolist()`` -> ``[1, 2]``.
        """
        with torch.no_grad():
            return self.full_tensor().tolist()

    def numpy(self, *, force: bool = False):
        """Refused with the two ways that work (torch refuses every tensor subclass, naming neither).

        Why not a collective, as ``tolist``: ``.numpy()`` is what code written for plain tensors calls on one
        rank (a ``rank_zero_only`` callback, sklearn metrics at epoch end); a collective there would hang.

        Example: ``x.full_tensor().numpy()`` (every rank) or ``x.to_local().numpy()`` (this rank's part).
        """
        raise RuntimeError(
            f"DTensor.numpy(): this DTensor {tuple(self.shape)} with placements {list(self.placements)} holds only "
            "this rank's part of the value; call .full_tensor().numpy() on every rank (a collective: the whole "
            "value) or .to_local().numpy() (this rank's part)"
        )


def _global_stride(local: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """Contiguous strides of ``shape`` in the same dim order as ``local``'s memory layout; ``local``'s own strides
    when it is the whole tensor (``shape`` is its shape) and a view with gaps, as torch's ``from_local`` keeps them.

    A view with gaps (ProphetNet's n-gram stream ``hidden_states[:, T:].view(B, 2, T, -1)``, handed to a TP LM
    head as a replicated input) declared dense would let ``reshape`` (inside ``F.linear`` on 3+ dims) take it for
    a view, which the local tensor then refuses with a stride error."""
    if local.ndim == 0:
        return ()
    order = sorted(range(local.ndim), key=lambda d: (local.stride(d), local.shape[d]), reverse=True)
    stride, acc = [0] * local.ndim, 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    if tuple(shape) == tuple(local.shape) and _has_gaps(local, stride):
        return tuple(local.stride())
    return tuple(stride)


def _has_gaps(local: torch.Tensor, dense: list[int]) -> bool:
    """Whether ``local``'s strides differ from the ``dense`` ones of its own shape on a dim of size > 1."""
    return any(n > 1 and s != d for n, s, d in zip(local.shape, local.stride(), dense))


def _check_local_shapes(local: torch.Tensor, spec: DTensorSpec) -> None:
    """Raise the same ValueError on every rank if any rank's local shape does not fit the global shape."""
    import torch.distributed as dist

    mesh = spec.mesh
    # Gather (local shape, global shape) so every rank builds the same message, even when ranks inferred
    # different global shapes (uneven shards passed without ``shape=``).
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (tuple(local.shape), tuple(spec.shape)))
    members = [r for r in mesh.mesh.flatten().tolist()]
    global_shapes = {seen[r][1] for r in members}
    if len(global_shapes) > 1:
        raise ValueError(
            f"DTensor.from_local(run_check=True): ranks disagree on the global shape ({sorted(global_shapes)}) "
            f"with placements {list(spec.placements)}; local shapes are "
            + ", ".join(f"rank {r}: {seen[r][0]}" for r in members)
            + ". Pass shape= (and stride=) for uneven shards"
        )
    errors = []
    for rank in members:
        coord = (mesh.mesh == rank).nonzero()[0].tolist()
        want, _ = local_shape_and_offset(spec.shape, spec.placements, mesh.shape, coord)
        if seen[rank][0] != tuple(want):
            errors.append(f"rank {rank} holds {seen[rank][0]}, expected {tuple(want)}")
    if errors:
        raise ValueError(
            f"DTensor.from_local(run_check=True): local shapes do not match global shape {tuple(spec.shape)} "
            f"with placements {list(spec.placements)}: " + "; ".join(errors)
        )


class _FromLocal(torch.autograd.Function):
    @staticmethod
    @outside_sac  # the clone and the broadcast into it (run_check) are one unit for SAC
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, run_check: bool) -> DTensor:
        ctx.spec = spec
        if run_check and any(p.is_replicate() for p in spec.placements):
            from lightning_shard import comm

            local = local.clone(memory_format=torch.contiguous_format)  # one copy; never write the caller's
            with comm.host_collectives_for(local):  # a host shard stays on the host
                for i, p in enumerate(spec.placements):
                    if p.is_replicate():
                        comm.broadcast(local, 0, spec.mesh.get_group(i))
        # view_as keeps autograd's view tracking honest: the DTensor aliases the user's tensor.
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec: DTensorSpec = ctx.spec
        if not isinstance(grad, DTensor):
            return grad, None, None
        if _builds_graph(grad):  # a double backward differentiates this gradient: keep it on the graph
            want = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
            return _ToLocal.apply(_Redistribute.apply(grad, want), None), None, None
        return _grad_local(grad, spec.placements), None, None


def _grad_local(grad: DTensor, forward_placements: tuple[Placement, ...]) -> torch.Tensor:
    """Local gradient laid out like the forward input (Partial inputs get Replicate gradients)."""
    want = tuple(Replicate() if p.is_partial() else p for p in forward_placements)
    if grad.placements != want:
        return redistribute_local(grad._local_tensor, grad._spec, want)
    return grad._local_tensor


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, grad_placements):
        ctx.spec = x._spec
        ctx.grad_placements = grad_placements
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements or spec.placements
        # The gradient's memory layout may differ from the forward tensor's (e.g. it comes from a transpose):
        # the global strides must describe the gradient's own layout, or a later view of it fails.
        grad_spec = DTensorSpec(spec.mesh, placements, spec.shape, _global_stride(grad, spec.shape), grad.dtype)
        if _builds_graph(grad):  # a double backward differentiates this gradient: keep it on the graph
            return _FromLocal.apply(grad, grad_spec, False), None
        return DTensor(grad, grad_spec, requires_grad=False), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        ctx.spec = x._spec
        local = redistribute_local(x._local_tensor, x._spec, placements)
        if placements != x.placements and same_storage(local, x._local_tensor):
            local = local.clone()  # a local chunk (Replicate -> Shard) must not alias the source
        return DTensor(local, x._spec.with_placements(placements), requires_grad=x.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec: DTensorSpec = ctx.spec
        want = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
        if _builds_graph(grad):  # a double backward differentiates this gradient: keep it on the graph
            return _Redistribute.apply(grad, want), None
        local = redistribute_local(grad._local_tensor, grad._spec, want)
        grad_spec = DTensorSpec(spec.mesh, want, spec.shape, spec.stride, grad.dtype)
        return DTensor(local, grad_spec, requires_grad=False), None


def _builds_graph(grad: torch.Tensor) -> bool:
    """Whether this backward records a graph of ``grad`` (``create_graph=True``: a gradient penalty, a
    Hessian-vector product). Then the backward goes through these autograd Functions again instead of the
    local tensor, which has no history: a second derivative taken through it would silently miss the terms of
    every tensor-parallel collective (e.g. ``RowwiseParallel``'s all-reduce)."""
    return torch.is_grad_enabled() and grad.requires_grad
