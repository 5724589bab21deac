"""FSDPParamGroup: the parameters of one ``fully_shard`` call, laid out in flat buffers.

Memory layout (the point where we go beyond torch FSDP2):

* ``shard_flat``: this rank's padded shards of all parameters, one buffer (``numba_kernels.GroupLayout``);
  each sharded parameter is a DTensor whose local tensor is a view into it, so without a dtype cast the
  all-gather reads it directly (no copy-in).
* ``unsharded_flat``: the full parameters, one buffer in the compute dtype; each unsharded parameter is a
  view into it. Its storage is freed (resized to 0) on reshard and re-allocated on unshard, so the views,
  which autograd may have saved for backward, stay valid across the two all-gathers of a step.
* ``grad_flat``: the sharded gradients, one fp32 buffer; each parameter's ``.grad`` is a DTensor view
  into it, so post-reduce is one fused kernel for the whole group. Held weakly: ``zero_grad()`` frees it.

Example::

    group = FSDPParamGroup(params, mesh_info, MixedPrecisionPolicy(), OffloadPolicy(), device)
    group.unshard()   # before the forward
    group.reshard()   # after it
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import comm
from lightning_shard.device import handle_for, has_data, same_storage
from lightning_shard.fsdp import buffers, collectives, grad_hooks
from lightning_shard.fsdp.optimizer_guard import mark_unsharded, register_before_step
from lightning_shard.fsdp.param import BUILT_ON_META, FSDPParam
from lightning_shard.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from lightning_shard.fsdp.post_forward import PostForwardShard
from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import DTensor, Replicate, Shard, StridedShard
from lightning_shard.tensor.spec import DTensorSpec
from numba_kernels import GroupLayout


@dataclass(frozen=True)
class MeshInfo:
    """The FSDP mesh: its shard dim (always the last) and, for HSDP, the replicate dim (the first)."""

    mesh: DeviceMesh

    @property
    def shard_dim(self) -> int:
        return self.mesh.ndim - 1

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.shard_dim)

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_dim)

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_dim)

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group(0) if self.mesh.ndim == 2 and self.mesh.size(0) > 1 else None

    @property
    def placements(self) -> tuple:
        return (Replicate(), Shard(0)) if self.mesh.ndim == 2 else (Shard(0),)

    def param_mesh_and_placements(self, fp: FSDPParam) -> tuple[DeviceMesh, tuple]:
        """Mesh and placements of the sharded DTensor of ``fp``: the FSDP mesh, or (dp, tp) for FSDP over TP.

        On (dp, tp) the data-parallel shard splits the TP-local tensor on dim 0: a plain ``Shard(0)`` when TP
        does not shard dim 0, else a ``StridedShard(0)`` (applied after TP's split).
        """
        dp_placements = (Replicate(),) * self.mesh.ndim if fp.replicated else self.placements
        if fp.tp_spec is None:
            return self.mesh, dp_placements
        tp_mesh, tp_placements = fp.tp_spec.mesh, fp.tp_spec.placements
        dp_name, tp_name = self.mesh.mesh_dim_names[0], tp_mesh.mesh_dim_names[0]
        mesh = self.mesh.root_mesh[dp_name, tp_name]
        if fp.replicated:
            return mesh, (Replicate(), *tp_placements)
        tp_shards_dim0 = any(p.is_shard(0) for p in tp_placements)
        dp = StridedShard(0, split_factor=tp_mesh.size()) if tp_shards_dim0 else Shard(0)
        return mesh, (dp, *tp_placements)


@dataclass(frozen=True)
class GradientBufferChoice:
    """Which buffer a group's reduce writes its gradients into, from three conditions.

    ================  ===========  ==============  =============================================
    reduce dtype !=   CPU offload  a ``.grad``     the reduced gradients go
    param dtype                    already exists
    ================  ===========  ==============  =============================================
    no                no           no              **direct**: the reduce-scatter's output is a
                                                   new gradient buffer; only the post-divide is
                                                   left, in place
    yes               any          no              a new gradient buffer, filled (cast) by the
                                                   post-reduce from the reduce output
    any               yes          no              a new pinned host buffer, copied from the
                                                   device (``collectives.finish_reduce_scatter``)
    any               any          yes             the current buffer if a ``.grad`` still views
                                                   it, else a new one holding the ``.grad``
                                                   values; the post-reduce accumulates
    ================  ===========  ==============  =============================================

    Direct saves a shard-sized temporary at the end of each group's backward, where the step's memory peaks
    (torch's FSDP2 likewise keeps its reduce-scatter output as the gradient). The non-direct rows are decided
    at ``finish_reduce`` (``FSDPParamGroup._gradient_target``).

    Example: ``GradientBufferChoice(casts=False, offloads=False, has_grads=False).direct`` is True.
    """

    casts: bool
    offloads: bool
    has_grads: bool

    @property
    def direct(self) -> bool:
        return not (self.casts or self.offloads or self.has_grads)


class GradientPresence:
    """Which parameters of a group got a gradient in a backward on any rank, so that the others keep ``.grad``
    None, as on one device.

    The reduce-scatter gives every rank a shard of every parameter's gradient (zeros where a rank computed
    none), so without this each parameter of a group that reduced would get a ``.grad``, also one that no rank
    used (a module defined but not called, a branch not taken). An optimizer treats a zero ``.grad`` and
    ``None`` differently: AdamW's weight decay and SGD's momentum and weight decay move a parameter with a
    zero gradient and skip one without. The decision must be the same on every rank (their optimizers update
    shards of the same parameters), and a parameter used on some ranks only has a gradient: so one small
    all-reduce (max) of one flag per parameter, issued with the reduce-scatter (asynchronous) and read at the
    end of backward (``FSDPParamGroup.wait_for_gradients``), as DDP all-reduces its "locally used" map with
    ``find_unused_parameters=True``. The read is skipped when this rank computed the gradient of every
    parameter that trains (the maximum is then known; a frozen one has a gradient on no rank): on an
    accelerator a read waits for the device, and in the common case no group waits. A parameter that already
    had a ``.grad`` before this backward (gradient accumulation) keeps it.

    Example: ``presence.start([True, False], [True, True], mesh_info, device)``, then after the reduction
    ``presence.note_fresh([True, True])``; ``presence.finish(presence.used())`` -> ``[1]`` when no rank had the
    second one.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.pending: list[tuple[object, torch.Tensor, MeshInfo]] = []
        self.fresh: list[bool] | None = None  # per parameter: no ``.grad`` before this backward's reductions
        self.anywhere: torch.Tensor | None = None  # the flags waited for so far in this backward
        self.here: list[bool] | None = None  # per parameter: a gradient on this rank in this backward
        self.trainable: list[bool] = [True] * n  # per parameter: requires_grad at the last reduction

    def start(self, local: list[bool], trainable: list[bool], mesh_info: MeshInfo, device: torch.device) -> None:
        """Issue the all-reduce of this reduction's flags (``local``: a gradient on this rank)."""
        self.here = local if self.here is None else [a or b for a, b in zip(self.here, local)]
        self.trainable = trainable
        flags = torch.tensor(local, dtype=torch.int32).to(device, non_blocking=True)
        work = comm.all_reduce_flags(flags, mesh_info.shard_group, async_op=True)
        self.pending.append((work, flags, mesh_info))

    def note_fresh(self, fresh: list[bool]) -> None:
        if self.fresh is None:
            self.fresh = fresh

    def _resolve(self) -> torch.Tensor | None:
        """Wait for the flags issued so far and fold them into ``anywhere`` (max over this backward)."""
        pending, self.pending = self.pending, []
        for work, flags, mesh_info in pending:
            if work is not None:
                work.wait()
            if mesh_info.replicate_group is not None:  # HSDP: and across replicas
                comm.all_reduce_flags(flags, mesh_info.replicate_group)
            self.anywhere = flags if self.anywhere is None else torch.maximum(self.anywhere, flags)
        return self.anywhere

    def used(self) -> list[bool] | None:
        """Per parameter, whether any rank computed a gradient in the reductions of this backward so far; None
        before any reduction, or with the simulator's fake tensors (no values)."""
        anywhere = self._resolve()
        if anywhere is None:
            return None
        if all(h or not t for h, t in zip(self.here, self.trainable)):  # the maximum is this rank's flags: no read
            return list(self.here)
        return self._read(anywhere)

    @staticmethod
    def _read(anywhere: torch.Tensor) -> list[bool] | None:
        """The flags on the host (on an accelerator this waits for the device); None for fake tensors."""
        return [bool(v) for v in anywhere.tolist()] if has_data(anywhere) else None

    def finish(self, used: list[bool] | None) -> list[int]:
        """The indices of the parameters whose ``.grad`` must go back to None (no rank had a gradient), from
        ``used()`` read at the end of this backward."""
        fresh, self.fresh, self.anywhere, self.here = self.fresh, None, None, None
        if fresh is None or used is None:
            return []  # no reduction finished (nothing assigned), or the simulator's fake tensors: no values
        return [i for i in range(self.n) if fresh[i] and not used[i]]


class FSDPParamGroup:
    """Flat-buffer sharded storage and the unshard / reshard / reduce steps of one group (module docstring)."""

    def __init__(
        self,
        params: list[FSDPParam],
        originals: list[nn.Parameter],
        mesh_info: MeshInfo,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        device: torch.device,
    ) -> None:
        self.params = params
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.device = device
        self.handle = handle_for(device)
        # Pinned host shards and gradients make the copies to and from the accelerator asynchronous.
        self.pin_memory = self.offload and offload_policy.pin_memory and device.type not in ("cpu", "meta")
        self.grad_offload_event: object | None = None  # CPU offload: the last device-to-host gradient copy
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            names = ", ".join(f"{p.fqn}: {p.dtype}" for p in params)
            raise ValueError(
                f"fully_shard: the parameters of one group must share a dtype, got {names}; cast the module or "
                "call fully_shard separately on the submodules holding each dtype"
            )
        self.orig_dtype = params[0].dtype
        self.compute_dtype = mp_policy.compute_dtype(self.orig_dtype)
        self.reduce_dtype = mp_policy.gradient_dtype(self.orig_dtype)
        self.layout = GroupLayout([p.layout_shape(mesh_info.shard_size) for p in params], mesh_info.shard_size)
        self.shard_flat = self._shard_originals(originals)
        # Drop the unsharded originals (copies moved to the device for sharding) before anything else is
        # allocated, so setup holds at most one unsharded group at a time.
        originals.clear()
        self.unsharded_flat = self._unallocated_unsharded_flat()
        self._grad_flat_ref: weakref.ref[torch.Tensor] | None = None  # see the grad_flat property
        self.is_unsharded = False
        self.pending_all_gather: collectives.CollectiveHandle | None = None
        self.pending_reduce: collectives.CollectiveHandle | None = None
        self.accumulated_grads: list[torch.Tensor | None] | None = None  # no-sync micro-batches
        # Which parameters got a gradient on any rank in this backward (``GradientPresence``).
        self.presence = GradientPresence(len(params))
        self.reduced_in_backward = False  # a reduction finished since the last end of backward (grad_hooks)
        self._warned_no_sync = False  # register_hook hooks reduce without gradient sync too: warned once
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.post_forward: PostForwardShard | None = None  # reshard_after_forward=<int> (configure_post_forward)
        # A backward with ``create_graph=True`` (gradient penalty, Hessian-vector product) recorded a graph that
        # reads the unsharded parameters: ``reshard`` keeps them allocated until ``release_graph``.
        self.held_for_graph = False
        # Called when a gradient lands on an unsharded parameter (the FSDP state queues its end of backward).
        self.on_unsharded_grad: Callable[[], None] | None = None
        # The root's group (set at the root's lazy init): its parameters report every gradient that reaches them.
        # A backward inside the root's forward (Lightning's manual optimization: ``training_step`` runs as the
        # root's forward) that reaches no inner unit fires no unit hook, and only this report queues the
        # end-of-backward callback that reduces those gradients; without it they never reached the sharded
        # ``.grad`` (a GAN's generator, the whole model one unit, did not train, with no error).
        self.reports_unsharded_grads = False
        if device.type != "meta":
            self.layout.warm(device, self.compute_dtype, self.reduce_dtype)
        if device.type == "cpu":
            _match_numba_threads_to_torch()

    # ------------------------------------------------------------------ construction
    @property
    def shard_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device

    def _shard_originals(self, originals: list[nn.Parameter]) -> torch.Tensor:
        """Copy this rank's rows of every parameter into a new flat shard and register DTensor params."""
        # A group is on meta only if all its parameters are: a model loaded with values and given new modules built
        # on meta (Hugging Face's from_pretrained, then LoRA adapters or a new head) mixes both in one group, and
        # a meta flat shard would drop the loaded values (the first parameter decided; a real one first raised
        # "Cannot copy out of meta tensor").
        device = originals[0].device if all(o.device.type == "meta" for o in originals) else self.shard_device
        flat = torch.zeros(self.layout.shard_numel, dtype=self.orig_dtype, device=device)
        if self.pin_memory and device.type == "cpu":
            flat = self.handle.pin(flat)
        rank = self.mesh_info.shard_rank
        for i, (fp, orig) in enumerate(zip(self.params, originals)):
            local = self._local_view(flat, i)
            source = orig._local_tensor if isinstance(orig, DTensor) else orig
            unset = device.type != "meta" and source.is_meta
            if device.type != "meta" and not unset and fp.replicated:
                local.copy_(source.detach())
            elif device.type != "meta" and not unset and local.numel() > 0:  # trailing ranks may hold no rows at all
                start = rank * self.layout.rows_per_shard[i]
                local.copy_(source.detach().narrow(0, start, local.shape[0]))
            mesh, placements = self.mesh_info.param_mesh_and_placements(fp)
            spec = DTensorSpec(mesh, placements, fp.global_shape, orig.stride(), self.orig_dtype)
            fp.sharded = nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=fp.requires_grad)
            fp.sharded._fsdp_managed = True
            if unset:  # a meta parameter in a real group: storage without a value, for the caller to initialise
                setattr(fp.sharded, BUILT_ON_META, True)
            fp.set_on_modules(fp.sharded)
        return flat

    def _local_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s part of a flat shard-sized buffer (shard, gradient), as its DTensor's local tensor."""
        offset = int(self.layout.shard_offsets[i])
        shape = self._local_shape(i)
        return flat[offset : offset + shape.numel()].view(shape)

    def _local_shape(self, i: int) -> torch.Size:
        """The local shape of parameter ``i``'s sharded DTensor: its rows, or a replicated parameter's own ``()``."""
        if self.params[i].replicated:
            return self.params[i].shape
        return self.layout.local_shape(i, self.mesh_info.shard_rank)

    def rebuild_after_apply(self) -> None:
        """Re-adopt parameters after ``module._apply`` (``to_empty``, ``.to(device)``, dtype casts).

        ``_apply`` gives each sharded DTensor a new local tensor; copy those into a new flat shard and make
        the DTensors view it again.
        """
        locals_ = [fp.sharded._local_tensor for fp in self.params]
        device = locals_[0].device
        if self.offload and device.type != "meta":
            # CPU offload keeps the shards on the host, wherever _apply put them (to_empty(device="cuda") after
            # meta init): pinned, as torch's FSDP2 moves and pins them.
            device = torch.device("cpu")
        elif not self.offload:
            self.device = device
            self.handle = handle_for(device)
        self.orig_dtype = locals_[0].dtype
        self.compute_dtype = self.mp_policy.compute_dtype(self.orig_dtype)
        self.reduce_dtype = self.mp_policy.gradient_dtype(self.orig_dtype)
        flat = torch.zeros(self.layout.shard_numel, dtype=self.orig_dtype, device=device)
        if self.pin_memory and device.type == "cpu":
            flat = self.handle.pin(flat)
        for i, (fp, local) in enumerate(zip(self.params, locals_)):
            view = self._local_view(flat, i)
            view.copy_(local)
            spec = DTensorSpec(
                fp.sharded._spec.mesh, fp.sharded._spec.placements, fp.global_shape, fp.sharded._spec.stride, flat.dtype
            )
            if fp.sharded.device != view.device:
                # The shard moved back to the host (CPU offload): the DTensor's own device must say so too, so
                # its gradient and optimizer state are host tensors. Same parameter object, new contents.
                new = nn.Parameter(DTensor(view, spec, requires_grad=False), requires_grad=fp.requires_grad)
                torch.utils.swap_tensors(fp.sharded, new)
                fp.sharded._fsdp_managed = True
            fp.sharded._local_tensor = view
            fp.sharded._spec = spec
        self.shard_flat = flat
        self.unsharded_flat = self._unallocated_unsharded_flat()
        for fp in self.params:
            fp.unsharded = None
        self._grad_flat_ref = None
        if self.post_forward is not None:  # its views point into the old unsharded buffer: build it again
            size, self.post_forward = self.post_forward.layout.world_size, None
            self.configure_post_forward(size)
        if device.type != "meta":
            self.layout.warm(self.device, self.compute_dtype, self.reduce_dtype)

    def configure_post_forward(self, size: int | None) -> None:
        """Keep a ``size``-way shard from forward to backward (``reshard_after_forward=size``); None: do not.

        Collective (creates the process groups of ``size`` neighbouring ranks): call it on every rank.
        """
        current = self.post_forward.layout.world_size if self.post_forward is not None else None
        if size == current:
            return
        self.post_forward = None
        if size is None:
            return
        info = self.mesh_info
        group = info.mesh.split_group(info.shard_dim, size)
        shapes = list(self.layout.shapes)
        self.post_forward = PostForwardShard(
            shapes, size, group, info.shard_rank % size, self.compute_dtype, self.unsharded_flat.device
        )

    # ------------------------------------------------------------------ unshard / reshard
    def start_unshard(self) -> None:
        """Issue the all-gather (async) unless the group is unsharded or a gather is in flight."""
        if self.is_unsharded or self.pending_all_gather is not None:
            return
        self._check_materialized()
        if self.post_forward is not None and self.post_forward.held:
            self.pending_all_gather = self.post_forward.start_all_gather()
            return
        self.pending_all_gather = collectives.start_all_gather(
            self.layout,
            self.shard_flat,
            self.mesh_info.shard_rank,
            self.mesh_info.shard_group,
            self.compute_dtype,
            self.device,
        )

    def unshard(self) -> None:
        """All-gather (or finish a prefetched all-gather) and point the modules at the unsharded params."""
        if self.is_unsharded:
            return
        self.start_unshard()
        handle, self.pending_all_gather = self.pending_all_gather, None
        self._allocate_unsharded_storage()
        collectives.finish_all_gather(handle, self.unsharded_flat)
        if self.post_forward is not None:
            self.post_forward.release()
        for fp, view in zip(self.params, self._unsharded_views()):
            fp.set_on_modules(view)
        # Only under grad mode: no gradient comes otherwise, and registering a hook toggles requires_grad, which
        # torch.func refuses inside vmap (a no_grad vmap over the model is allowed).
        if self.reports_unsharded_grads and torch.is_grad_enabled():
            self._report_unsharded_grads()
        self.is_unsharded = True

    def _unsharded_views(self) -> list[nn.Parameter]:
        """The unsharded parameters, created once per flat buffer so autograd's saved views stay valid.

        They are created outside inference mode even when the first unshard runs inside it (Lightning's
        ``trainer.validate`` before ``fit``): a TP DTensor wrapper built there is an inference tensor, and kept for
        every later step it trained the model wrong without an error."""
        views = []
        for i, fp in enumerate(self.params):
            if fp.unsharded is None:
                offset = int(self.layout.unsharded_offsets[i])
                with torch.inference_mode(False):
                    data = self.unsharded_flat[offset : offset + fp.shape.numel()].view(fp.shape)  # replicated: row 0
                    fp.unsharded = nn.Parameter(fp.wrap_unsharded(data), requires_grad=fp.requires_grad)
                mark_unsharded(fp.unsharded, fp.fqn)  # an optimizer holding it is refused (optimizer_guard)
            fp.sync_requires_grad()
            views.append(fp.unsharded)
        return views

    def hold_for_graph(self) -> None:
        """Keep the unsharded parameters allocated (a recorded graph reads them) until ``release_graph``, at the
        latest until the next optimizer step (whose update they would not show)."""
        if self.is_unsharded and not self.held_for_graph:
            self.held_for_graph = True
            _HELD_FOR_GRAPH.add(self)
            # A later backward through the recorded graph may bring gradients no hook of the unit sees: the
            # unsharded parameters report them (only on groups held for a graph and on the root's, so no other
            # backward pays a Python call per parameter).
            self._report_unsharded_grads()

    def _report_unsharded_grads(self) -> None:
        """Have each unsharded parameter call ``on_unsharded_grad`` when a backward accumulates its gradient."""
        for fp in self.params:
            if fp.unsharded is not None and not getattr(fp.unsharded, _GRAD_HOOK, False):
                _register_grad_hook(fp.unsharded, self._unsharded_grad_arrived)

    def reshard_before_next_step(self) -> None:
        """Left unsharded after backward (``reshard_after_backward=False``, for the next micro-batch's forward):
        the next optimizer step reshards it first. The step writes the shards; a forward after it reusing the
        values gathered before it trained on stale weights with no error."""
        if self.is_unsharded:
            _RESHARD_BEFORE_STEP.add(self)

    def release_graph(self) -> None:
        """Stop holding the unsharded parameters for a graph; the next ``reshard`` frees them."""
        self.held_for_graph = False
        _HELD_FOR_GRAPH.discard(self)

    def _unsharded_grad_arrived(self, param: torch.Tensor) -> None:
        if self.on_unsharded_grad is not None:
            self.on_unsharded_grad()

    def has_unsharded_grads(self) -> bool:
        """Whether a backward left gradients on the unsharded parameters that no reduce-scatter took yet."""
        return any(fp.unsharded is not None and fp.unsharded.grad is not None for fp in self.params)

    def reshard(self, keep_post_forward_shard: bool = False) -> None:
        """Point the modules back at the sharded DTensors and free the unsharded storage.

        ``keep_post_forward_shard`` (after forward, with ``configure_post_forward``): first keep this rank's
        ``size``-way slice for the backward all-gather. Otherwise a held slice is dropped too.
        Nothing happens while ``held_for_graph``: a recorded graph still reads the unsharded parameters.
        """
        if self.held_for_graph and self.is_unsharded:
            return
        if self.pending_all_gather is not None:  # a prefetch that was never used
            self.pending_all_gather.wait()
            self.pending_all_gather = None
        if self.post_forward is not None:
            if not keep_post_forward_shard:
                self.post_forward.release()
            elif self.is_unsharded:
                self.post_forward.keep(self.unsharded_flat, self.layout)
        if not self.is_unsharded:
            return
        for fp in self.params:
            fp.sync_requires_grad()  # a requires_grad_() on the module while unsharded reached the unsharded one
            fp.set_on_modules(fp.sharded)
        self._free_unsharded_storage()
        self.is_unsharded = False

    def _unallocated_unsharded_flat(self) -> torch.Tensor:
        """The unsharded buffer before its first all-gather: no storage yet (its shape comes with the first
        allocation, ``_allocate_unsharded_storage``), so building or re-adopting a group never holds a whole
        unsharded group, not even for a moment (on an accelerator, a ``torch.empty`` of it freed at once still
        raised the allocated peak of setup by the largest group: 1.96 GiB for Llama-3-8B's root in bf16)."""
        numel = self.layout.unsharded_numel if self.device.type == "meta" else 0  # meta: shapes only, no bytes
        return torch.empty(numel, dtype=self.compute_dtype, device=self.device)

    def _allocate_unsharded_storage(self) -> None:
        """Give the unsharded buffer its bytes (same storage object every step: autograd's saved views and
        the parameters' views stay valid), backed by pages up front on CPU."""
        storage = self.unsharded_flat.untyped_storage()
        storage.resize_(self.layout.unsharded_numel * self.unsharded_flat.element_size())
        if self.unsharded_flat.numel() != self.layout.unsharded_numel:  # the first unshard: give it its shape
            self.unsharded_flat.set_(storage, 0, (self.layout.unsharded_numel,))
        buffers.populate_pages(storage)

    def _free_unsharded_storage(self) -> None:
        if self.unsharded_flat.device.type != "meta":
            self.unsharded_flat.untyped_storage().resize_(0)

    def _check_materialized(self) -> None:
        if self.shard_flat.device.type == "meta":
            names = ", ".join(fp.fqn for fp in self.params[:3])
            raise RuntimeError(
                f"fully_shard: parameters ({names}, ...) are still on the meta device; materialize the model "
                "first, e.g. model.to_empty(device=...) then reset_parameters() on each module"
            )

    # ------------------------------------------------------------------ gradients
    def post_backward(self) -> None:
        """Reduce-scatter this backward's gradients (or keep them, without gradient sync).

        A parameter frozen since the unshard (``requires_grad`` now False on the sharded parameter) contributes
        no gradient: its unsharded parameter still required grad when the forward used it, e.g. the root's
        parameters under Lightning's ``toggle_optimizer`` inside ``training_step`` (the root unshards before
        the step's code runs). On one device it would have had none; reduced, it was added to the ``.grad`` the
        parameter kept from an earlier backward (gradient accumulation), silently.
        """
        trainable = [fp.requires_grad for fp in self.params]
        grads = [fp.unsharded_grad() if t else None for fp, t in zip(self.params, trainable)]
        for fp in self.params:
            if fp.unsharded is not None:
                fp.unsharded.grad = None
        if self.accumulated_grads is not None:
            grads = [_add(a, g) for a, g in zip(self.accumulated_grads, grads)]
            self.accumulated_grads = None
        if not any(g is not None for g in grads):
            return
        if not self.requires_gradient_sync and not self._reduce_despite_no_sync():
            self.accumulated_grads = grads
            return
        self.finish_reduce()  # at most one reduce-scatter in flight per group
        self.presence.start([g is not None for g in grads], trainable, self.mesh_info, self.device)
        predivide, _ = self._divide_factors()
        self.pending_reduce = collectives.start_reduce_scatter(
            self.layout,
            [fp.staged_grad(g, self.layout.world_size) for fp, g in zip(self.params, grads)],
            self.mesh_info.shard_group,
            self.reduce_dtype,
            self.device,
            predivide,
            output=self._direct_reduce_output(),
        )

    def _reduce_despite_no_sync(self) -> bool:
        """Whether a backward without gradient sync reduces anyway: ``register_hook`` hooks (``grad_hooks``) get
        each backward's reduced gradient, as one device gives a leaf's hooks each micro-batch's gradient; run on
        the sum of the micro-batches, a hook that is not linear (clamping) gave another result, silently."""
        hooked = self._tensor_hooked()
        if hooked and not self._warned_no_sync:
            self._warned_no_sync = True
            warnings.warn(
                f"fully_shard: parameters with register_hook hooks ({', '.join(hooked[:3])}, ...) are reduced in every "
                "backward, also after set_requires_gradient_sync(False): their hooks get each backward's gradient, "
                "as on one device. Use register_post_accumulate_grad_hook to act once per synced backward.",
                stacklevel=2,
            )
        return bool(hooked)

    def _tensor_hooked(self) -> list[str]:
        """The names of the parameters with ``register_hook`` hooks (``grad_hooks``), usually none."""
        return [fp.fqn for fp in self.params if grad_hooks.has_tensor_hooks(fp.sharded)]

    def drop_unreduced_grads(self) -> None:
        """Forget the gradients not yet reduced into the sharded ``.grad``: the no-sync accumulation and the
        unsharded parameters' ``.grad`` (the partial sums of a backward an exception stopped). ``zero_grad`` on the
        optimizer clears only the sharded ``.grad``; these would otherwise be added into the next backward."""
        self.accumulated_grads = None
        for fp in self.params:
            if fp.unsharded is not None:
                fp.unsharded.grad = None

    def _direct_reduce_output(self) -> torch.Tensor | None:
        """A new sharded gradient buffer when ``GradientBufferChoice`` says the reduce-scatter writes into it."""
        choice = GradientBufferChoice(
            casts=self.reduce_dtype != self.orig_dtype,
            offloads=self.shard_device != self.device,
            # register_hook hooks get this backward's gradient alone: reduced apart from .grad (finish_reduce)
            has_grads=any(fp.sharded.grad is not None for fp in self.params) or bool(self._tensor_hooked()),
        )
        return self._new_grad_flat() if choice.direct else None

    def finish_reduce(self) -> None:
        """Wait for the in-flight reduce-scatter and fold it into the sharded ``.grad`` DTensors."""
        if self.pending_reduce is None:
            return
        handle, self.pending_reduce = self.pending_reduce, None
        self.reduced_in_backward = True
        if handle.output is self.grad_flat:  # the reduce-scatter wrote straight into a new gradient buffer
            grad_flat, accumulate = handle.output, False
        else:
            grad_flat, accumulate = self._gradient_target()
        _, postdivide = self._divide_factors()
        if self._tensor_hooked():
            self._finish_reduce_through_hooks(handle, grad_flat, postdivide, accumulate)
        else:
            event = collectives.finish_reduce_scatter(
                self.layout, handle, grad_flat, postdivide, accumulate, self.mesh_info.replicate_group, self.handle
            )
            self.grad_offload_event = event or self.grad_offload_event
        self.presence.note_fresh([fp.requires_grad and fp.sharded.grad is None for fp in self.params])
        self._assign_grads(grad_flat)

    def _finish_reduce_through_hooks(
        self, handle: collectives.CollectiveHandle, grad_flat: torch.Tensor, postdivide: float | None, accumulate: bool
    ) -> None:
        """``finish_reduce`` for a group with ``register_hook`` hooks (``grad_hooks``): the reduced shard goes to a
        buffer of its own, each hooked parameter's part runs through its hooks as a DTensor placed like the
        parameter, and the result is then added to (or becomes) ``.grad``. Only parameters some rank computed a
        gradient for reach the hooks, as on one device; so the presence flags are waited for here."""
        fresh = buffers.empty(self.layout.shard_numel, self.orig_dtype, grad_flat.device)
        event = collectives.finish_reduce_scatter(
            self.layout, handle, fresh, postdivide, False, self.mesh_info.replicate_group, self.handle
        )
        # The hooks read ``fresh`` now, on the compute stream: on an accelerator the reduce stream writes it
        # (finish_reduce_scatter), so wait for that stream first; under CPU offload for the host copy.
        self.handle.wait_stream(self.handle.current_stream(), collectives.reduce_stream(self.handle))
        if event is not None:
            self.handle.wait_event(event)
        used = self.presence.used()
        for i, fp in enumerate(self.params):
            if not (fp.requires_grad and grad_hooks.has_tensor_hooks(fp.sharded)) or (used is not None and not used[i]):
                continue
            local = self._local_view(fresh, i)
            grad = DTensor(local, fp.sharded._spec, requires_grad=False)
            out = grad_hooks.run_tensor_hooks(fp.sharded, grad)
            if out is not grad:  # a returned replacement (an in-place change is in ``local`` already)
                local.copy_(grad_hooks.as_local_gradient(out, fp.sharded, fp.fqn))
        if accumulate:
            grad_flat.add_(fresh)
        else:
            grad_flat.copy_(fresh)

    def wait_for_gradients(self) -> None:
        """End of backward: the compute stream waits for the reduce stream, and the host for the last
        non-blocking gradient copy to the host (CPU offload), before an optimizer reads the gradients."""
        self.handle.wait_stream(self.handle.current_stream(), collectives.reduce_stream(self.handle))
        if self.grad_offload_event is not None:
            self.handle.wait_event(self.grad_offload_event)
            self.grad_offload_event = None
        used = self.presence.used()
        for i in self.presence.finish(used):
            self.params[i].sharded.grad = None  # no rank computed one: leave it None, as one device does
        if self.reduced_in_backward:
            self.reduced_in_backward = False
            self._run_post_accumulate_hooks(used)

    def _run_post_accumulate_hooks(self, used: list[bool] | None) -> None:
        """The parameters' post-accumulate-grad hooks (``grad_hooks``), once their ``.grad`` holds this backward's
        reduced gradient: for those some rank computed a gradient for (``used``; None: no flags, all)."""
        for i, fp in enumerate(self.params):
            if fp.sharded.grad is not None and (used is None or used[i]):
                grad_hooks.run_post_accumulate_hooks(fp.sharded)

    def _divide_factors(self) -> tuple[float | None, float | None]:
        return collectives.divide_factors(self.mesh_info.mesh.size(), self.reduce_dtype)

    @property
    def grad_flat(self) -> torch.Tensor | None:
        """The sharded gradient buffer (its views are the local tensors of the ``.grad`` DTensors), or None.

        The group holds it weakly, so it lives exactly as long as a ``.grad`` (or a reduction in flight) uses
        it: ``optimizer.zero_grad()`` frees it at once, as torch frees its sharded gradients, instead of it
        being held through the next forward and backward, where the step's memory peaks.
        """
        return None if self._grad_flat_ref is None else self._grad_flat_ref()

    def _new_grad_flat(self) -> torch.Tensor:
        # Uninitialised is fine: the reduce (or post-reduce without accumulation) writes every element.
        flat = buffers.empty(self.layout.shard_numel, self.orig_dtype, self.shard_device)
        if self.pin_memory:
            flat = self.handle.pin(flat)
        self._grad_flat_ref = weakref.ref(flat)
        return flat

    def _gradient_target(self) -> tuple[torch.Tensor, bool]:
        """The buffer the post-reduce writes, holding the current ``.grad`` values, and whether it accumulates.

        With every ``.grad`` None: a new buffer, overwritten (a gradient tensor the user kept is never
        written). Otherwise the current buffer if some ``.grad`` still views it, else a new one, with each
        ``.grad``'s values copied in (zeros for None).
        """
        existing = [fp.sharded.grad for fp in self.params]
        if all(g is None for g in existing):
            return self._new_grad_flat(), False
        flat = self.grad_flat
        if flat is None or not any(g is not None and self._views_into(g, flat, i) for i, g in enumerate(existing)):
            flat = self._new_grad_flat()
        for i, g in enumerate(existing):
            view = self._local_view(flat, i)
            if g is None:
                view.zero_()
            elif not self._views_into(g, flat, i):
                view.copy_(g._local_tensor)  # the user replaced .grad: take its values
        return flat, True

    def _assign_grads(self, grad_flat: torch.Tensor) -> None:
        for i, fp in enumerate(self.params):
            if not fp.requires_grad:
                continue
            g = fp.sharded.grad
            if g is None or not self._views_into(g, grad_flat, i):
                fp.sharded.grad = DTensor(self._local_view(grad_flat, i), fp.sharded._spec, requires_grad=False)

    def _views_into(self, grad: DTensor, flat: torch.Tensor, i: int) -> bool:
        """Whether ``grad``'s local tensor is parameter ``i``'s view into ``flat`` (its address and shape),
        checked without making the view."""
        local = grad._local_tensor
        offset = flat.storage_offset() + int(self.layout.shard_offsets[i])
        return same_storage(local, flat) and local.storage_offset() == offset and local.shape == self._local_shape(i)


# Groups an optimizer step reshards first (below): those holding their unsharded parameters for a recorded graph,
# and those left unsharded after backward.
_HELD_FOR_GRAPH: weakref.WeakSet[FSDPParamGroup] = weakref.WeakSet()
_RESHARD_BEFORE_STEP: weakref.WeakSet[FSDPParamGroup] = weakref.WeakSet()


def _reshard_before_optimizer_step() -> None:
    """Before any optimizer step: reshard the groups kept unsharded past their backward (``hold_for_graph``,
    ``reshard_before_next_step``).

    The step writes the sharded parameters; unsharded copies gathered before it would otherwise be reused by
    the next forward with the old values (a ``loss.backward(create_graph=True)`` step, or one after
    ``set_reshard_after_backward(False)``, trained on stale weights with no error). A graph recorded before the
    step is stale on one device too."""
    for group in list(_HELD_FOR_GRAPH):
        group.release_graph()
        group.reshard()
    for group in list(_RESHARD_BEFORE_STEP):
        group.reshard()
    _RESHARD_BEFORE_STEP.clear()


register_before_step(_reshard_before_optimizer_step)


_GRAD_HOOK = "_ls_unsharded_grad_hook"  # set on an unsharded parameter by ``_register_grad_hook``


def _register_grad_hook(param: nn.Parameter, hook: Callable[[torch.Tensor], None]) -> None:
    """``param.register_post_accumulate_grad_hook(hook)``, also on a frozen parameter (torch refuses the
    registration there, but keeps and runs the hook once the parameter is unfrozen)."""
    frozen = not param.requires_grad
    param.requires_grad_(True)
    param.register_post_accumulate_grad_hook(hook)
    param.requires_grad_(not frozen)
    setattr(param, _GRAD_HOOK, True)


def _match_numba_threads_to_torch() -> None:
    """Use no more kernel threads than torch's intra-op pool: several ranks per machine already share the
    cores, and two thread pools each sized to all cores would oversubscribe them."""
    import numba

    numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, torch.get_num_threads())))


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a.add_(b)
