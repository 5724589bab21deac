"""FSDPState: the forward/backward hooks of one ``fully_shard`` call, and the root's end-of-backward work.

Per step, for each group: pre-forward unshards (all-gather) and wraps the inputs so that their gradient
marks the end of the module's backward; post-forward reshards (per ``reshard_after_forward``) and hooks
the outputs so that their gradient unshards again before the module's backward (pre-backward); the module's
post-backward reduce-scatters the gradients and reshards. The root (the outermost ``fully_shard`` module,
found at the first forward) queues a callback at the end of backward that finishes every group:
reduce-scatters groups whose post-backward never fired (inputs that did not require grad), waits for the
in-flight reduce-scatters and reshards, so nothing leaks into the next step.

The training state of each unit (IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD) changes only through
``UnitState.on(event)``; ``training_state.py`` has the transition table, and an event the table does not allow
raises ``FSDPStateError`` naming the unit.

Prefetch: in forward, each group starts the all-gather of the group that ran forward after it in the
previous step (the first step has no recorded order, so nothing is prefetched); in backward, the group that
runs backward next (reverse of the recorded forward order). ``set_modules_to_forward_prefetch`` and
``set_modules_to_backward_prefetch`` replace these defaults. A forward prefetch that the forward did not use
(a module skipped this step) is dropped when the root's forward ends, so it can never serve stale values.

Example: see ``lightning_shard.fsdp.fully_shard``.
"""

from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd import Variable

from lightning_shard.fsdp.forward_checks import check_forward_parameters
from lightning_shard.fsdp.param_group import FSDPParamGroup
from lightning_shard.fsdp.policies import MixedPrecisionPolicy
from lightning_shard.fsdp.rank_agreement import check_units_agree
from lightning_shard.fsdp.training_state import FORWARD, IDLE, POST_BACKWARD, PRE_BACKWARD, TrainingState, UnitState
from lightning_shard.sac import outside_sac


class FSDPState:
    """Hooks of one ``fully_shard`` call (its group may be ``None`` when it owns no parameter) and its unit's
    training state (``unit``)."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: FSDPParamGroup | None,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.is_root: bool | None = None
        self.all_states: list[FSDPState] = []  # root only: every state in its tree, in module order
        self.forward_order: list[FSDPState] = []  # root only: order of first pre-forward this step
        self.last_forward_order: list[FSDPState] = []  # root only: the previous step's, for forward prefetch
        self.unit = UnitState(", ".join(type(m).__name__ for m in modules))  # renamed by path at lazy init
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self.root: FSDPState | None = None
        self.summoned = False  # inside summon_full_params: hooks off, the module runs as a plain module
        # Calls of this unit's modules now running (a pair of hooks around each call, the exit one also when the
        # forward raises). Above 1 in FORWARD, a call runs inside the unit's own forward (Lightning's forward
        # redirection runs ``training_step`` as the root's forward, which calls ``self(x)``): it passes through.
        self.calls_running = 0
        self.last_reducing_group: FSDPParamGroup | None = None  # root only: the reduce-scatter in flight
        # After a backward inside this unit's forward resharded it: hooks on the modules holding its parameters
        # that gather them again at their next call in the same forward (``_reshard_inside_forward``).
        self._regather_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._callback_queued = False  # root only: the end-of-backward callback is queued
        # root only: True when the ranks already compared the model (the Lightning strategy, before sharding);
        # else the units are compared at the first forward (rank_agreement.py)
        self.agreement_checked = False
        # Under torch.compile the hooks run eagerly, as torch's FSDP2 runs its own by default
        # (torch._dynamo.config.skip_fsdp_hooks): they all-gather, free and swap parameters, which no graph holds.
        # A compiled model breaks its graph at each FSDP unit's boundary; a unit's forward itself compiles.
        pre_forward, post_forward = _eager_under_compile(self._pre_forward), _eager_under_compile(self._post_forward)
        enter, leave = _eager_under_compile(self._enter_call), _eager_under_compile(self._leave_call)
        if group is not None:  # a gradient reaching the parameters outside the unit's hooks (higher-order autograd)
            group.on_unsharded_grad = self._unsharded_grad_arrived
        for module in modules:
            module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_pre_hook(enter, prepend=True)  # first of all
            module.register_forward_hook(post_forward, prepend=False)
            module.register_forward_hook(leave, always_call=True)  # last, and also after an exception

    @property
    def training_state(self) -> TrainingState:
        return self.unit.current

    # ------------------------------------------------------------------ lazy init
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        self.root = self
        seen = set()
        for module in self.modules:
            for path, sub in module.named_modules():
                state = getattr(sub, "_fsdp_state", None)
                if state is not None and id(state) not in seen:
                    seen.add(id(state))
                    self.all_states.append(state)
                    state.unit.unit = f"{path or 'root'} ({type(sub).__name__})"
                    if state is not self:
                        if state.is_root:
                            raise RuntimeError(
                                "fully_shard: a module ran forward as its own root before its parent was wrapped; "
                                "apply fully_shard bottom-up and run forward on the outermost module"
                            )
                        state.is_root = False
                        state.root = self
        self._sync_requires_grad_at_each_call()
        if self.group is not None:
            self.group.reports_unsharded_grads = True
        if not self.agreement_checked:
            check_units_agree(self)

    def _sync_requires_grad_at_each_call(self) -> None:
        """Root only: each module holding the root group's parameters gives them the sharded parameters'
        current ``requires_grad`` when it is called.

        The root unshards once, before its forward's code runs, and under Lightning that code is the whole
        ``training_step`` (forward redirection): freezing or unfreezing parameters inside it (a GAN's phases,
        ``toggle_optimizer``) otherwise reached the unsharded parameters only at the next step, so a parameter
        unfrozen for its phase got no gradient and did not train, silently. Inner units unshard in their own
        forward, after such code ran.
        """
        if self.group is None:
            return
        own = {id(m) for m in self.modules}
        held: dict[int, tuple[nn.Module, list]] = {}
        for fp in self.group.params:
            for module, _ in fp.refs:
                if id(module) not in own:
                    held.setdefault(id(module), (module, []))[1].append(fp)
        for module, params in held.values():
            module.register_forward_pre_hook(functools.partial(self._sync_requires_grad, params))

    def _sync_requires_grad(self, params: list, module: nn.Module, args: tuple) -> None:
        if self.group is not None and self.group.is_unsharded:
            for fp in params:
                fp.sync_requires_grad()

    # ------------------------------------------------------------------ forward
    def _enter_call(self, module: nn.Module, args: tuple) -> None:
        self.calls_running += 1

    def _leave_call(self, module: nn.Module, args: tuple, output) -> None:
        self.calls_running -= 1

    def _nested_call(self) -> bool:
        """Whether this call runs inside the same unit's own forward (the outer call's hooks do the work)."""
        return self.calls_running > 1 and self.unit.current is FORWARD

    @outside_sac
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.summoned:
            return args, kwargs
        # functional_call, torch.func (forward_checks.py): before the lazy init, whose ranks-agree check at the
        # first forward is a collective that cannot run on functorch's wrapped tensors either
        check_forward_parameters(self.unit.unit, self.group)
        self._lazy_init()
        if self._nested_call():
            return args, kwargs
        if self.is_root and not _in_backward():
            self._root_pre_forward()
        before = self.unit.current
        self.unit.on("pre_forward")
        if before is PRE_BACKWARD:  # activation checkpointing recomputes the unit: keep it unsharded for backward
            if self.group is not None:
                self.group.unshard()
            return self._cast_inputs(args, kwargs)
        if self.root is not None and self not in self.root.forward_order:
            self.root.forward_order.append(self)
        if self.group is not None:
            self.group.unshard()
            # A forward inside backward is a reentrant checkpoint's recompute: the units after this one in the
            # forward order have finished their backward, so prefetching them would gather (and hold until the
            # end of backward) parameters nothing reads; backward prefetch orders the recomputes instead.
            if not _in_backward():
                for state in self._forward_prefetch_targets():
                    if state.group is not None:
                        state.group.start_unshard()
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled():
            args, kwargs = self._mark_inputs_for_post_backward(args, kwargs)
        return args, kwargs

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _root_pre_forward(self) -> None:
        # Outside backward no end-of-backward callback can be pending; units left mid-step by an exception in
        # the last forward or backward (whose callback autograd then dropped) start this step from IDLE.
        self._callback_queued = False
        if any(state.unit.current is not IDLE for state in self.all_states):
            for state in self.all_states:
                state.unit.on("reset")
        for state in self.all_states:  # a forward after a backward that ended early (e.g. an exception)
            if state.group is not None:
                state.group.finish_reduce()
                if state.group.post_forward is not None:  # from a forward whose backward never ran
                    state.group.post_forward.release()
        if self.forward_order:
            self.last_forward_order = self.forward_order
        self.forward_order = []

    def _forward_prefetch_targets(self) -> list[FSDPState]:
        return _prefetch_targets(self, self.forward_prefetch, (self.root or self).last_forward_order, +1)

    def _drop_unused_prefetches(self) -> None:
        """Root, end of forward: wait for and drop all-gathers that forward prefetched but never used."""
        for state in self.all_states:
            group = state.group
            if group is not None and group.pending_all_gather is not None and not group.is_unsharded:
                group.reshard()

    @outside_sac
    def _post_forward(self, module: nn.Module, args: tuple, output):
        if self.summoned:
            return output
        if self._nested_call():  # the inner call returned inside the outer one, which reshards and registers
            return output
        if self.unit.current is PRE_BACKWARD:  # the recomputation (activation checkpointing) returned
            self.unit.on("post_forward")
            return self._cast_output(output)
        recompute = _in_backward()  # a reentrant checkpoint's recompute: this unit's backward runs next
        if self.is_root and not recompute:
            self._drop_unused_prefetches()
        self._remove_regather_hooks()
        grad = torch.is_grad_enabled()
        # The root's parameters would be all-gathered again right away for backward: keep them (as torch does),
        # and so a recomputed unit's (torch reshards it and all-gathers again at its pre-backward). Without grad
        # no backward comes, so always free them.
        if self.group is not None and (not grad or (self.reshard_after_forward and not self.is_root and not recompute)):
            self.group.reshard(keep_post_forward_shard=grad)  # only kept with reshard_after_forward=<int>
        self.unit.on("post_forward")
        output = self._cast_output(output)
        if grad:
            output = self._register_pre_backward(output)
        return output

    def _cast_output(self, output):
        if self.mp_policy.output_dtype is not None:
            return _cast_floats(output, self.mp_policy.output_dtype)
        return output

    # ------------------------------------------------------------------ backward
    def _mark_inputs_for_post_backward(self, args, kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        idx = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not idx:
            return args, kwargs
        outs = _PostBackward.apply(self, *[flat[i] for i in idx])
        outs = (outs,) if isinstance(outs, torch.Tensor) else outs
        for i, t in zip(idx, outs):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)

    def _register_pre_backward(self, output):
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor):
        before = self.unit.current
        self.unit.on("pre_backward")
        if before is PRE_BACKWARD:
            return grad
        (self.root or self)._queue_final_callback()
        if self.group is not None:
            self.group.unshard()
            for state in self._backward_prefetch_targets():
                if state.group is not None:
                    state.group.start_unshard()
        return grad

    def _backward_prefetch_targets(self) -> list[FSDPState]:
        return _prefetch_targets(self, self.backward_prefetch, (self.root or self).forward_order, -1)

    def _queue_final_callback(self) -> None:
        if self._callback_queued:
            return
        self._callback_queued = True
        Variable._execution_engine.queue_callback(self._root_post_backward_final)

    def _unsharded_grad_arrived(self) -> None:
        """A gradient landed on an unsharded parameter: make sure this backward ends with the root's callback,
        which reduces it. A gradient penalty's backward reaches the parameters through the graph its
        ``create_graph=True`` backward recorded, where no output or input hook of the unit has to fire."""
        (self.root or self)._queue_final_callback()

    def post_backward(self) -> None:
        self.unit.on("post_backward")
        if self.group is not None:
            _hold_for_graph(self.group)
            # Bound memory: the previous group's reduce-scatter finishes (its staging buffer is freed) before
            # this group stages its gradients, so at most two staging buffers are alive, as in torch's FSDP2.
            root = self.root or self
            previous = root.last_reducing_group
            if previous is not None and previous is not self.group:
                previous.finish_reduce()
            # Free the unsharded parameters before staging the gradients (they stay attached to the unsharded
            # parameter objects), so the two are never alive together; torch's FSDP2 orders it the same way.
            if self.group.reshard_after_backward:
                self.group.reshard()
            self.group.post_backward()
            root.last_reducing_group = self.group

    def _root_post_backward_final(self) -> None:
        self._callback_queued = False
        self.last_reducing_group = None
        for state in self.all_states:
            # Gradients that reached the parameters after the unit's post-backward, through the graph a backward
            # with ``create_graph=True`` recorded (a gradient penalty's second derivative): reduced below, added to
            # the rest. Only for groups held for such a graph, a decision every rank makes alike.
            late = state.group is not None and state.group.held_for_graph and state.group.has_unsharded_grads()
            if state.group is not None:
                _hold_for_graph(state.group, end_of_backward=True)
            if state.unit.current is FORWARD:  # this backward ran inside the unit's forward, which goes on
                state._reshard_inside_forward()
                state.unit.on("end_backward")
                continue
            group = state.group
            # Unsharded without a post-backward since its last pre-backward: its inputs did not require grad (the
            # root's token ids; a unit called twice whose first call's inputs did not), so no hook fired for it.
            unreduced = state.unit.current is not POST_BACKWARD and group is not None and group.is_unsharded
            if group is not None and (unreduced or late):
                state.post_backward()
            if group is not None:
                group.finish_reduce()
                if group.reshard_after_backward:
                    group.reshard()
                else:
                    group.reshard_before_next_step()
            state.unit.on("end_backward")
        for state in self.all_states:
            if state.group is not None:
                state.group.wait_for_gradients()

    def _reshard_inside_forward(self) -> None:
        """End of a backward that ran inside this unit's forward, which goes on afterwards.

        Lightning's manual optimization does this: ``training_step`` runs as the root's forward (forward
        redirection) and calls ``manual_backward(loss)`` and ``optimizer.step()`` inside it. No pre- or
        post-backward hook fired for the unit (its forward has not returned), yet the backward left gradients
        on its unsharded parameters: reduce them into the sharded ``.grad`` now, before the optimizer reads
        them, and reshard, so that the step's update is what the forward's next use of these parameters
        gathers (hooks on the modules that hold them; a use outside those modules' calls meets the sharded
        DTensor and raises). Left as it is when the backward gave its parameters no gradient (e.g.
        ``torch.autograd.grad`` inside forward): the forward goes on with the same parameters.
        """
        group = self.group
        if group is None or not group.is_unsharded or all(fp.unsharded_grad() is None for fp in group.params):
            return
        group.post_backward()
        group.finish_reduce()
        group.reshard()
        owners = {id(module): module for fp in group.params for module, _ in fp.refs}
        self._remove_regather_hooks()
        self._regather_hooks = [m.register_forward_pre_hook(self._regather) for m in owners.values()]

    @outside_sac
    def _regather(self, module: nn.Module, args: tuple) -> None:
        """A module holding this unit's parameters is called again inside the unit's forward: all-gather them."""
        self._remove_regather_hooks()
        if self.unit.current is FORWARD and self.group is not None:
            self.group.unshard()

    def _remove_regather_hooks(self) -> None:
        for handle in self._regather_hooks:
            handle.remove()
        self._regather_hooks = []


def _hold_for_graph(group: FSDPParamGroup, end_of_backward: bool = False) -> None:
    """Keep ``group``'s unsharded parameters while a recorded graph reads them.

    A backward with ``create_graph=True`` (grad mode is on inside it) records a graph of the gradients that
    saves the unsharded parameters; freeing them at reshard made the later backward through that graph fail on
    a storage of size 0 (torch's FSDP2 fails the same way). They stay allocated until a backward without
    ``create_graph`` ends (the one through the recorded graph), or until the next optimizer step: the memory
    of one unsharded model, as on one device."""
    if torch.is_grad_enabled():
        group.hold_for_graph()
    elif end_of_backward:
        group.release_graph()


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


def _eager_under_compile(hook):
    """``hook`` run eagerly (opaque) when torch.compile traces it, called directly otherwise (a disabled
    function costs a few microseconds per call even in eager code)."""
    disabled = torch.compiler.disable(hook)

    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)

    return run


def _prefetch_targets(
    state: FSDPState, explicit: list[FSDPState] | None, order: list[FSDPState], step: int
) -> list[FSDPState]:
    """``explicit`` if the user set it, else the state ``step`` places from ``state`` in ``order`` (if any)."""
    if explicit is not None:
        return explicit
    if state not in order:
        return []
    j = order.index(state) + step
    return [order[j]] if 0 <= j < len(order) else []


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs; its backward runs once the module's backward is done."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.post_backward()
        return (None, *grads)


def _cast_floats(tree, dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, tree)
