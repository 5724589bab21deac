"""The FSDP units' training state: the transition table, illegal events, and the states of real steps."""

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard, training_state
from lightning_shard.fsdp.training_state import (
    FORWARD,
    IDLE,
    PRE_BACKWARD,
    TRANSITIONS,
    FSDPStateError,
    TrainingState,
    UnitState,
    record_transitions,
)
from tests.fsdp_models import batches, full_state, loss_fn, make_model, max_diff, rank_slice, train_reference
from tests.harness import distributed


def _dp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))


def _shard(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_docstring_table_is_the_transition_table():
    """The table a reader sees in training_state.py is the one the code enforces."""
    states = "IDLE|FORWARD|PRE_BACKWARD|POST_BACKWARD"
    rows = re.findall(rf"^({states}|any|not FORWARD) +(\w+) +({states})\s", training_state.__doc__, re.M)
    documented = set()
    for state, event, after in rows:
        if state == "any":
            froms = set(TrainingState)
        elif state == "not FORWARD":
            froms = set(TrainingState) - {FORWARD}
        else:
            froms = {TrainingState[state]}
        documented |= {(s, event, TrainingState[after]) for s in froms}
    assert documented == {(s, e, a) for (s, e), a in TRANSITIONS.items()}


def test_illegal_events_raise_naming_unit_state_and_event():
    s = UnitState("blocks.0 (Block)")
    with pytest.raises(FSDPStateError, match=r"'blocks.0 \(Block\)': post_forward is not allowed in state IDLE"):
        s.on("post_forward")
    s.on("pre_forward")
    for event in ("pre_backward", "post_backward"):
        with pytest.raises(FSDPStateError, match=f"{event} is not allowed in state FORWARD"):
            s.on(event)
    assert s.current is FORWARD  # a refused event changes nothing
    s.on("post_forward")
    s.on("pre_backward")
    s.on("post_backward")
    with pytest.raises(FSDPStateError, match="pre_forward is not allowed in state POST_BACKWARD"):
        s.on("pre_forward")
    with pytest.raises(ValueError, match="unknown training event 'backward'"):
        s.on("backward")
    assert s.on("end_backward") is IDLE


@distributed(world_size=2)
def test_states_of_a_real_step_follow_the_table():
    model = _shard(make_model(), _dp_mesh())
    x, y = batches(1, 4)[0]
    with record_transitions() as log:
        loss_fn(model, x, y).backward()
    assert all(TRANSITIONS[(before, event)] is after for _, before, event, after in log)
    per_unit = {}
    for unit, before, event, after in log:
        per_unit.setdefault(unit, []).append((before.name, event, after.name))
    assert list(per_unit) == ["root (FSDPTinyGPT)", "blocks.0 (FSDPBlock)", "blocks.1 (FSDPBlock)"]
    block = [
        ("IDLE", "pre_forward", "FORWARD"),
        ("FORWARD", "post_forward", "IDLE"),
        ("IDLE", "pre_backward", "PRE_BACKWARD"),
        ("PRE_BACKWARD", "post_backward", "POST_BACKWARD"),
        ("POST_BACKWARD", "end_backward", "IDLE"),
    ]
    assert per_unit["blocks.0 (FSDPBlock)"] == per_unit["blocks.1 (FSDPBlock)"] == block
    # the root's inputs are token ids: its post-backward is the end-of-backward catch-up
    assert per_unit["root (FSDPTinyGPT)"] == block
    order = [(u.split()[0], e) for u, _, e, _ in log if e in ("pre_forward", "pre_backward", "post_backward")]
    assert order == [
        ("root", "pre_forward"),
        ("blocks.0", "pre_forward"),
        ("blocks.1", "pre_forward"),
        ("root", "pre_backward"),
        ("blocks.1", "pre_backward"),
        ("blocks.1", "post_backward"),
        ("blocks.0", "pre_backward"),
        ("blocks.0", "post_backward"),
        ("root", "post_backward"),
    ]


class _BackwardInForward(nn.Module):
    """Runs a backward through its own previous output while its forward runs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.previous = None

    def forward(self, x):
        if self.previous is not None:
            self.previous.sum().backward()
        out = self.lin(x)
        self.previous = out
        return out


@distributed(world_size=2)
def test_backward_of_a_unit_inside_its_own_forward_raises():
    inner = _BackwardInForward()
    model = nn.Sequential(nn.Linear(4, 4), inner)
    fully_shard(inner, mesh=_dp_mesh())
    fully_shard(model, mesh=_dp_mesh())
    model(torch.randn(2, 4))
    with pytest.raises(FSDPStateError, match=r"unit '1 \(FSDP_BackwardInForward\)': pre_backward .* state FORWARD"):
        model(torch.randn(2, 4))


class _SharedTwice(nn.Module):
    """``shared`` is called twice; its first call's input (the raw batch) does not require grad."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


def _train_pairs(model, ref, steps, make_loss):
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        for m, opt, xb, yb in ((model, opts[0], x.chunk(world)[rank], y.chunk(world)[rank]), (ref, opts[1], x, y)):
            opt.zero_grad()
            make_loss(m, xb, yb).backward()
            opt.step()


@distributed(world_size=2)
def test_unit_called_twice_without_grad_on_first_input_keeps_both_gradients():
    """The second backward of ``shared`` has no post-backward hook (its input needs no grad): the end of
    backward must still reduce it (a stale per-step flag once skipped it, dropping that gradient)."""
    model = _SharedTwice()
    ref = copy.deepcopy(model)
    fully_shard(model.shared, mesh=_dp_mesh())
    fully_shard(model, mesh=_dp_mesh())
    _train_pairs(model, ref, 3, lambda m, x, y: F.mse_loss(m(x), y))
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


class _LinearCheckingStorage(torch.autograd.Function):
    """A linear layer whose backward fails if its weight's storage was freed (read garbage otherwise)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if weight.untyped_storage().nbytes() == 0:
            raise RuntimeError("backward read a parameter whose storage was freed")
        return grad @ weight, grad.flatten(0, -2).t() @ x.flatten(0, -2)


class _Mid(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return _LinearCheckingStorage.apply(x, self.weight)


class _CheckpointedUnit(nn.Module):
    """``mid`` (an FSDP unit) runs under activation checkpointing: recomputed inside its own backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(8, 8), _Mid(), nn.Linear(8, 3)

    def forward(self, x):
        h = checkpoint(self.mid, torch.tanh(self.inp(x)), use_reentrant=False)
        return self.out(torch.tanh(h))


@distributed(world_size=2)
def test_activation_checkpointing_around_a_unit_matches_one_process():
    """The recomputation runs the unit's hooks in state PRE_BACKWARD; it must not free the parameters its
    backward is about to read."""
    model = _CheckpointedUnit()
    ref = copy.deepcopy(model)
    fully_shard(model.mid, mesh=_dp_mesh())
    fully_shard(model, mesh=_dp_mesh())
    with record_transitions() as log:
        _train_pairs(model, ref, 3, lambda m, x, y: F.mse_loss(m(x), y))
    assert max_diff(full_state(model), full_state(ref)) < 1e-5
    assert ("mid (FSDP_Mid)", PRE_BACKWARD, "pre_forward", PRE_BACKWARD) in log


@distributed(world_size=2)
def test_a_step_whose_backward_raised_does_not_break_the_next_steps():
    model = _shard(make_model(), _dp_mesh())
    data = batches(3, 4)
    ref, _ = train_reference(make_model(), data[1:])
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)

    def boom(grad):
        raise RuntimeError("boom")

    x, y = data[0]
    out = model(rank_slice(x, rank, world))
    out.register_hook(boom)  # runs after the root's pre-backward hook queued the end-of-backward callback
    with pytest.raises(RuntimeError, match="boom"):
        F.cross_entropy(out.reshape(-1, out.shape[-1]), rank_slice(y, rank, world).reshape(-1)).backward()
    for x, y in data[1:]:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        opt.step()
    assert all(s.unit.current is IDLE for s in model._fsdp_state.all_states)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


class _Redirected(nn.Module):
    """A root whose ``step`` calls ``self(x)``: Lightning runs ``training_step``/``validation_step`` as the root's
    forward (its forward redirection), so the root's forward runs inside its own forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.shared(x)))

    def step(self, x, y):
        return F.mse_loss(self(x), y)


@distributed(world_size=2)
def test_root_called_inside_its_own_forward_as_lightning_redirects_steps():
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    model = _Redirected()
    ref = copy.deepcopy(model)
    fully_shard(model.shared, mesh=_dp_mesh())
    fully_shard(model, mesh=_dp_mesh())
    redirect = _ForwardRedirection()

    def loss(m, x, y):
        if m is not model:
            return m.step(x, y)
        with torch.no_grad():  # a validation step between training steps
            torch.testing.assert_close(redirect(m, m, "step", x, y), ref.step(x, y))
        return redirect(m, m, "step", x, y)

    _train_pairs(model, ref, 3, loss)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


class _ManualStep(nn.Module):
    """Lightning's manual optimization in miniature: ``manual_step`` runs as the root's forward (forward
    redirection) and calls ``backward`` inside it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)

    def manual_step(self, x, y):
        loss = F.mse_loss(self(x), y)
        loss.backward()
        return loss.detach()


@pytest.mark.parametrize("inner_unit", [False, True])
@distributed(world_size=2)
def test_backward_inside_the_roots_forward_reduces_the_roots_own_parameters(inner_unit):
    """With no inner unit in the backward (the whole model one unit, as ``fsdp_unit`` matching nothing makes it),
    no unit's backward hook fires: the gradients that reach the root's own parameters must still be reduced into
    the sharded ``.grad`` before the optimizer step. They were not: a GAN's generator under manual optimization
    never trained, with no error."""
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    model = _ManualStep()
    ref = copy.deepcopy(model)
    if inner_unit:
        fully_shard(model.net[0], mesh=_dp_mesh())
    fully_shard(model, mesh=_dp_mesh())
    redirect = _ForwardRedirection()

    def loss(m, x, y):
        if m is not model:
            return F.mse_loss(m(x), y)
        redirect(m, m, "manual_step", x, y)
        return torch.zeros((), requires_grad=True)  # the backward ran inside the forward

    _train_pairs(model, ref, 3, loss)
    assert max_diff(full_state(model), full_state(ref)) < 1e-5
