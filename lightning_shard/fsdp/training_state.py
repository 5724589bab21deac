"""The training state of one FSDP unit (one ``fully_shard`` call), and the one place where it changes.

A unit moves through four states per step. Each hook of ``state.py`` names the event it handles and calls
``UnitState.on(event)``; the table below is the whole machine. A (state, event) pair missing from it is
an engine bug or a misuse (e.g. a backward hook while the unit's forward has not returned) and raises
``FSDPStateError`` naming the unit, its state and the event, instead of running collectives out of order.

==============  ==============  ==============  ==========================================================
state           event           next state      when, and what the hook does
==============  ==============  ==============  ==========================================================
IDLE            pre_forward     FORWARD         the unit's forward starts: unshard (all-gather), prefetch
PRE_BACKWARD    pre_forward     PRE_BACKWARD    activation checkpointing recomputes the unit in backward:
                                                it is unsharded already, nothing to do
FORWARD         post_forward    IDLE            forward returned: reshard (outside backward, per
                                                ``reshard_after_forward``), hook the outputs' gradients
PRE_BACKWARD    post_forward    PRE_BACKWARD    the recomputation returned: keep the parameters
IDLE            pre_backward    PRE_BACKWARD    an output's gradient arrives: unshard again, prefetch
PRE_BACKWARD    pre_backward    PRE_BACKWARD    another output's gradient (nothing to do)
POST_BACKWARD   pre_backward    PRE_BACKWARD    the unit ran forward twice: its earlier call's backward
PRE_BACKWARD    post_backward   POST_BACKWARD   the inputs' gradients are done: reshard, reduce-scatter
IDLE            post_backward   POST_BACKWARD   end of backward, unit still unsharded although no output
                                                gradient reached it (root's catch-up; nothing to reduce)
POST_BACKWARD   post_backward   POST_BACKWARD   a second input path of the same call (nothing left)
not FORWARD     end_backward    IDLE            the root's final callback: every reduce finished
FORWARD         end_backward    FORWARD         a backward inside the unit's forward: the forward goes on.
                                                With gradients on its parameters (Lightning's manual
                                                optimization: ``manual_backward`` inside ``training_step``)
                                                they are reduced and the unit resharded, gathered again at
                                                the next call of a module holding them; without
                                                (``torch.autograd.grad`` in forward) it is left alone
any             reset           IDLE            the root's next forward after a step that raised midway
==============  ==============  ==============  ==========================================================

A call of the unit's forward inside its own forward (Lightning runs ``training_step`` as the root's forward,
and it calls ``self(x)``; a module of a list group called inside another) is not an event: it passes through
and the outer call's hooks do the work (``FSDPState.calls_running`` tells it apart from a forward that an
exception left unfinished).

Not in the table, hence errors: ``post_forward`` without a ``pre_forward`` (IDLE, POST_BACKWARD), any
backward event while the unit's forward runs (FORWARD), and a forward of a unit whose backward is done
(POST_BACKWARD) inside the same backward.

Beside the training state, a unit's group (``FSDPParamGroup``) carries state that is not part of this
machine, because it changes independently of it:

==========================  =================================================================================
group state                 meaning
==========================  =================================================================================
``is_unsharded``            the unsharded parameters are allocated and registered on the modules
``pending_all_gather``      an all-gather (a prefetch) is in flight; ``unshard`` finishes it
``pending_reduce``          a reduce-scatter is in flight; ``finish_reduce`` folds it into ``.grad``
``accumulated_grads``       unsharded gradients kept without sync (``set_requires_gradient_sync(False)``)
``FSDPState.is_root``       None until the first forward (lazy init), then True for the outermost unit
==========================  =================================================================================

Example::

    state = UnitState("blocks.0")
    state.on("pre_forward")           # IDLE -> FORWARD
    state.on("post_forward")          # FORWARD -> IDLE
    state.on("post_forward")          # raises FSDPStateError: post_forward in state IDLE
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum, auto


class TrainingState(Enum):
    """Where one FSDP unit is in its step (module docstring: the transition table)."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = TrainingState

EVENTS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "end_backward", "reset")

TRANSITIONS: dict[tuple[TrainingState, str], TrainingState] = {
    (IDLE, "pre_forward"): FORWARD,
    (PRE_BACKWARD, "pre_forward"): PRE_BACKWARD,
    (FORWARD, "post_forward"): IDLE,
    (PRE_BACKWARD, "post_forward"): PRE_BACKWARD,
    (IDLE, "pre_backward"): PRE_BACKWARD,
    (PRE_BACKWARD, "pre_backward"): PRE_BACKWARD,
    (POST_BACKWARD, "pre_backward"): PRE_BACKWARD,
    (PRE_BACKWARD, "post_backward"): POST_BACKWARD,
    (IDLE, "post_backward"): POST_BACKWARD,
    (POST_BACKWARD, "post_backward"): POST_BACKWARD,
    **{(s, "end_backward"): IDLE for s in (IDLE, PRE_BACKWARD, POST_BACKWARD)},
    (FORWARD, "end_backward"): FORWARD,
    **{(s, "reset"): IDLE for s in TrainingState},
}


class FSDPStateError(RuntimeError):
    """An event that the unit's training state does not allow (see ``training_state`` for the table).

    Example: ``UnitState("blocks.0").on("post_backward")`` is allowed (IDLE -> POST_BACKWARD);
    ``UnitState("blocks.0").on("post_forward")`` raises this.
    """


class UnitState:
    """The training state of one unit; ``on(event)`` is the only way it changes.

    Example::

        s = UnitState("blocks.0")
        s.on("pre_forward"); s.current        # TrainingState.FORWARD
    """

    __slots__ = ("unit", "current")

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self.current = IDLE

    def on(self, event: str) -> TrainingState:
        """Apply ``event`` (one of ``EVENTS``); returns the new state, raises ``FSDPStateError`` if not allowed."""
        before = self.current
        after = TRANSITIONS.get((before, event))
        if after is None:
            if event not in EVENTS:
                raise ValueError(f"fully_shard: unknown training event {event!r}; one of {', '.join(EVENTS)}")
            allowed = sorted(e for (s, e) in TRANSITIONS if s is before and e not in ("end_backward", "reset"))
            raise FSDPStateError(
                f"fully_shard unit {self.unit!r}: {event} is not allowed in state {before.name} (allowed there: "
                f"{', '.join(allowed) or 'none'}). The FSDP hooks ran out of order: a forward that did not return "
                "before its backward, a forward of the unit inside its own finished backward, or hooks called by "
                "hand; see lightning_shard/fsdp/training_state.py for the table"
            )
        self.current = after
        for log in _RECORDERS:
            log.append((self.unit, before, event, after))
        return after

    def __repr__(self) -> str:
        return f"UnitState({self.unit!r}, {self.current.name})"


_RECORDERS: list[list[tuple[str, TrainingState, str, TrainingState]]] = []


@contextlib.contextmanager
def record_transitions() -> Iterator[list[tuple[str, TrainingState, str, TrainingState]]]:
    """Record every transition of every unit inside the block as ``(unit, before, event, after)``.

    For tests and debugging (the hooks' order in a step, e.g. which unit prefetched what).

    Example::

        with record_transitions() as log:
            model(x).sum().backward()
        [(unit, event) for unit, _, event, _ in log][:2]   # [("", "pre_forward"), ("blocks.0", "pre_forward")]
    """
    log: list[tuple[str, TrainingState, str, TrainingState]] = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)
