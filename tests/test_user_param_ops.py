"""User code acting on already-sharded parameters and gradients (``self.parameters()``, ``.grad``,
``state_dict()`` of the DTensor model in hooks such as ``on_fit_start`` or ``on_before_optimizer_step``),
each compared with the same code on the unsharded model in one process.

Meshes: FSDP 2 (every parameter ``Shard(0)`` on ``data_parallel``) and TP 2 as the strategy builds it (FSDP over
TP on a ``(1, 2)`` mesh: the parameters TP shards live on ``(data_parallel, tensor_parallel)``, the ones it leaves
alone, here a LayerNorm, on the 1-D ``data_parallel`` sub-mesh).

* ``torch.nn.init.*`` after sharding: random ones give one process's values exactly (our random ops draw the full
  tensor), so also the full fan-in/fan-out and an orthogonal full matrix; ``sparse_`` and ``dirac_`` of a
  sharded weight raise naming the function (they index with plain tensors / write through a gathered view).
* Hugging Face ``post_init()`` / ``init_weights()`` after ``fully_shard(model)``: GPT-2's scaled ``c_proj``
  initialisation was skipped (the sharded class counted as remote code), std 2x one process's, no error.
* Gradients: torch's ``clip_grad_norm_`` (norm 1, 2, inf; foreach on and off; ``error_if_nonfinite``),
  ``clip_grad_value_``, ``get_total_norm``, a user's sum of norms, ``parameters_to_vector`` /
  ``vector_to_parameters``, gradient noise, gradient centralisation. Under TP, combining the parameters of
  the two meshes raised "DTensor arguments live on different meshes".
* Weight-space ops: clamping, standardisation, ``renorm_``, ``matrix_norm(p, 2)``, per-row norms; a plain full
  tensor copied in / ``load_state_dict`` of a full state dict raise naming ``set_model_state_dict``;
  ``torch.save(state_dict())`` raises naming the checkpoint API.
* Weight-decay groups built from names, ``ndim`` and ``shape`` after sharding.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from lightning_shard.tensor import DTensor
from lightning_shard.tp import ColwiseParallel, RowwiseParallel, parallelize_module
from tests.harness import distributed

MESHES = ["fsdp", "tp"]
# The default run keeps one mesh per test (the one where a bug was, or FSDP); the other is slow.
FSDP_FIRST = ["fsdp", pytest.param("tp", marks=pytest.mark.slow)]
TP_FIRST = [pytest.param("fsdp", marks=pytest.mark.slow), "tp"]
TOL = {"fsdp": 1e-5, "tp": 5e-5}


class Net(nn.Module):
    """Column- and row-parallel Linears under TP, a LayerNorm TP leaves alone, a conv for ``dirac_``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 10)
        self.b = nn.Linear(10, 12)
        self.norm = nn.LayerNorm(12)
        self.conv = nn.Conv1d(4, 4, 3)

    def forward(self, x):
        return self.norm(self.b(torch.relu(self.a(x))))


def _net(kind: str | None) -> Net:
    torch.manual_seed(0)
    net = Net()
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
        fully_shard(net.a, mesh=mesh)
        fully_shard(net, mesh=mesh)
    elif kind == "tp":  # the strategy's FSDP over TP with one data-parallel rank
        root = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        parallelize_module(net, root["tensor_parallel"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
        fully_shard(net.a, mesh=root["data_parallel"])
        fully_shard(net, mesh=root["data_parallel"])
    return net


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _with_grads(kind: str | None) -> Net:
    net = _net(kind)
    torch.manual_seed(1)
    net(torch.randn(8, 12)).pow(2).mean().backward()  # the same batch on every rank: the one-process gradient
    return net


def _worst(a, b) -> float:
    return max((_full(x).float() - _full(y).float()).abs().max().item() for x, y in zip(a, b, strict=True))


def _same_after(kind: str, op, with_grads: bool = True) -> float:
    """Run ``op(model)`` on one process's model and on the sharded one, with the same seed; the worst difference
    of ``op``'s results, the parameters and the gradients."""
    build = _with_grads if with_grads else _net
    ref, ours = build(None), build(kind)
    torch.manual_seed(7)
    expected = op(ref)
    torch.manual_seed(7)
    got = op(ours)
    expected, got = (expected, got) if isinstance(expected, (list, tuple)) else ([expected], [got])
    diffs = [_worst(expected, got), _worst(ref.parameters(), ours.parameters())]
    if with_grads:
        pairs = list(zip(ref.parameters(), ours.parameters(), strict=True))
        assert [r.grad is None for r, _ in pairs] == [o.grad is None for _, o in pairs]
        diffs.append(_worst([r.grad for r, _ in pairs if r.grad is not None], _grads(ours)))
    return max(diffs)


# ----------------------------------------------------------------------------- initialisation


def _init_all(init, ndims: tuple[int, ...]):
    def op(model):
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim in ndims:
                    init(p)
        return [p for p in model.parameters()]

    return op


INITS = {
    "normal_": (lambda p: nn.init.normal_(p, 0.0, 0.02), (1, 2, 3)),
    "trunc_normal_": (lambda p: nn.init.trunc_normal_(p, std=0.5, a=-0.5, b=0.5), (1, 2, 3)),
    "uniform_": (lambda p: nn.init.uniform_(p, -0.1, 0.1), (1, 2, 3)),
    "xavier_uniform_": (nn.init.xavier_uniform_, (2, 3)),
    "xavier_normal_": (nn.init.xavier_normal_, (2, 3)),
    "kaiming_uniform_": (lambda p: nn.init.kaiming_uniform_(p, a=math.sqrt(5)), (2, 3)),
    "kaiming_normal_": (lambda p: nn.init.kaiming_normal_(p, mode="fan_out"), (2, 3)),
    "orthogonal_": (nn.init.orthogonal_, (2, 3)),
    "eye_": (nn.init.eye_, (2,)),
    "zeros_": (nn.init.zeros_, (1, 2, 3)),
    "ones_": (nn.init.ones_, (1, 2, 3)),
    "constant_": (lambda p: nn.init.constant_(p, 0.3), (1, 2, 3)),
}


@pytest.mark.parametrize("kind", FSDP_FIRST)
@distributed(world_size=2)
def test_nn_init_after_sharding_gives_one_process_values(kind):
    for name, (init, ndims) in INITS.items():
        assert _same_after(kind, _init_all(init, ndims), with_grads=False) < TOL[kind], name
    # Distribution-level checks of the full tensors against the formulas (fans of the whole weight, not a shard's)
    net = _net(kind)
    torch.manual_seed(3)
    with torch.no_grad():
        nn.init.orthogonal_(net.a.weight)
        nn.init.xavier_normal_(net.b.weight)
    w = _full(net.a.weight)  # (10, 12): orthonormal rows
    torch.testing.assert_close(w @ w.T, torch.eye(10), atol=1e-5, rtol=0)
    std = _full(net.b.weight).std().item()  # (12, 10): sqrt(2 / (fan_in + fan_out)) = sqrt(2 / 22)
    assert abs(std / math.sqrt(2 / 22) - 1) < 0.2, std
    # sparse_ indexes each column with a plain index tensor, dirac_ writes through a gathered view: both raise,
    # naming the function (tests/test_known_gaps.py: the error's fix gives one process's values)
    with pytest.raises(RuntimeError, match=r"torch.nn.init.sparse_ on a sharded"), torch.no_grad():
        nn.init.sparse_(net.a.weight, 0.5)
    if kind == "fsdp":  # under TP the conv is not sharded, and dirac_ works
        with pytest.raises(RuntimeError, match=r"torch.nn.init.dirac_ on a sharded"), torch.no_grad():
            nn.init.dirac_(net.conv.weight)


@distributed(world_size=2)
def test_hugging_face_init_after_fully_shard_gives_one_process_values():
    pytest.importorskip("transformers")
    from tests.hf_models import build

    def sharded():
        model = build("gpt2")
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    for call in ("post_init", "init_weights", "initialize_weights"):
        ref, ours = build("gpt2"), sharded()
        for model in (ref, ours):  # transformers flags modules it initialised; a second call re-initialises
            for module in model.modules():
                module.__dict__.pop("_is_hf_initialized", None)
            torch.manual_seed(5)
            with torch.no_grad():
                getattr(model, call)()
        # GPT-2 scales c_proj by 1 / sqrt(2 * n_layer) = 0.5: std 0.01, not initializer_range's 0.02
        assert abs(_full(ours.transformer.h[0].mlp.c_proj.weight).std().item() / 0.01 - 1) < 0.2, call
        assert _worst(ref.parameters(), ours.parameters()) < 1e-6, call
        assert ours.lm_head.weight is ours.transformer.wte.weight  # still tied


# ----------------------------------------------------------------------------- gradients


def _clip_norm(norm_type: float, foreach: bool | None, error_if_nonfinite: bool = False):
    return lambda m: torch.nn.utils.clip_grad_norm_(
        m.parameters(), 0.05, norm_type=norm_type, foreach=foreach, error_if_nonfinite=error_if_nonfinite
    )


def _grads(m) -> list[torch.Tensor]:
    return [p.grad for p in m.parameters() if p.grad is not None]


def _in_place_on_grads(fn):
    def op(m):
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    fn(p)
        return torch.zeros(1)

    return op


def _vector_round_trip(m):
    vector = torch.nn.utils.parameters_to_vector(m.parameters())
    torch.nn.utils.vector_to_parameters(vector * 0.5, m.parameters())
    return vector


GRADIENT_OPS = {
    "clip_grad_norm_ 2": _clip_norm(2.0, None),
    "clip_grad_norm_ 1 foreach": _clip_norm(1.0, True),
    "clip_grad_norm_ inf no foreach": _clip_norm(math.inf, False),
    "clip_grad_norm_ error_if_nonfinite": _clip_norm(2.0, None, error_if_nonfinite=True),
    "clip_grad_value_": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01) or torch.zeros(1),
    "get_total_norm": lambda m: torch.nn.utils.get_total_norm(_grads(m)),
    "clip_grads_with_norm_": lambda m: (
        torch.nn.utils.clip_grads_with_norm_(_grads(m), 0.05, torch.nn.utils.get_total_norm(_grads(m), 1.0))
        or torch.zeros(1)
    ),
    "user sum of squared norms": lambda m: sum(g.norm() ** 2 for g in _grads(m)).sqrt(),
    "user stacked norms": lambda m: torch.stack([g.norm() for g in _grads(m)]).norm(),
    "parameters_to_vector of grads": lambda m: torch.nn.utils.parameters_to_vector(_grads(m)),
    "parameters_to_vector / vector_to_parameters": _vector_round_trip,
    "gradient noise": _in_place_on_grads(lambda p: p.grad.add_(torch.randn_like(p.grad) * 0.1)),
    "gradient centralisation dim 1": _in_place_on_grads(
        lambda p: p.grad.sub_(p.grad.mean(dim=1, keepdim=True)) if p.ndim > 1 else None
    ),
    "gradient centralisation dim 0": _in_place_on_grads(
        lambda p: p.grad.sub_(p.grad.mean(dim=0, keepdim=True)) if p.ndim > 1 else None
    ),
}


@pytest.mark.parametrize("kind", TP_FIRST)
@distributed(world_size=2)
def test_gradient_ops_in_user_hooks_match_one_process(kind):
    for name, op in GRADIENT_OPS.items():
        assert _same_after(kind, op) < TOL[kind], name
    ours = _with_grads(kind)
    if dist.get_rank() == 0:  # only rank 0's shard holds the inf: every rank must raise, none may hang
        ours.a.weight.grad.to_local()[0, 0] = math.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0, error_if_nonfinite=True)
    grad = ours.a.weight.grad  # gradient noise from the global shape: each rank would add a whole tensor
    with pytest.raises(RuntimeError, match=r"global shape of a sharded DTensor.*torch\.randn_like"):
        grad.add_(torch.randn(grad.shape))


@distributed(world_size=2)
def test_dtensors_of_a_sub_mesh_and_its_root_combine():
    """A DTensor on the ``data_parallel`` sub-mesh is lifted onto ``(data_parallel, tensor_parallel)`` with
    ``Replicate()`` on the TP dim; one replicated over TP is viewed on the sub-mesh (an in-place target's mesh
    decides); one TP shards cannot be, and unrelated meshes still raise."""
    from lightning_shard.tensor import Replicate, Shard, distribute_tensor

    root = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    on_dp = distribute_tensor(x, root["data_parallel"], [Shard(0)])
    tp_sharded = distribute_tensor(y, root, [Replicate(), Shard(0)])
    tp_replicated = distribute_tensor(y, root, [Replicate(), Replicate()])
    total = on_dp + tp_sharded
    assert total.device_mesh is root
    torch.testing.assert_close(total.full_tensor(), x + y)
    on_dp.add_(tp_replicated)  # viewed on the sub-mesh: exact
    assert on_dp.device_mesh == root["data_parallel"]
    torch.testing.assert_close(on_dp.full_tensor(), x + y)
    with pytest.raises(RuntimeError, match="different meshes"):
        on_dp.add_(tp_sharded)  # each TP rank holds another part: no sub-mesh view of it exists
    with pytest.raises(RuntimeError, match="different meshes"):
        _ = on_dp + distribute_tensor(y, root["tensor_parallel"], [Replicate()])  # neither contains the other


# ----------------------------------------------------------------------------- weight-space ops


def _standardise(p):
    p.copy_((p - p.mean(dim=1, keepdim=True)) / (p.std(dim=1, keepdim=True) + 1e-5))


def _data_init(m):
    """The pre-``transformers.initialization`` style: ``.data.normal_`` / ``fill_`` / ``zero_`` by module type."""
    for module in m.modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.weight.data.normal_(0.0, 0.02) if isinstance(module, nn.Linear) else module.weight.data.fill_(1.0)
            module.bias.data.zero_()
    return torch.zeros(1)


def _global_magnitude_pruning(m):
    """One threshold over every parameter (under TP a cat of both meshes' parameters), then masks in place."""
    weights = list(m.parameters())
    magnitudes = torch.cat([p.detach().abs().flatten() for p in weights])
    threshold = magnitudes.kthvalue(magnitudes.numel() // 2).values
    with torch.no_grad():
        for p in weights:
            p.mul_(p.abs() >= threshold)
    return threshold


def _load_own_state_dict(m):
    m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})  # DTensor values: loads
    return torch.zeros(1)


WEIGHT_OPS = {
    ".data init by module type": _data_init,
    "global magnitude pruning": _global_magnitude_pruning,
    "load_state_dict of its own state_dict": _load_own_state_dict,
    "clamp_ (WGAN)": _in_place_on_grads(lambda p: p.data.clamp_(-0.05, 0.05)),
    "weight standardisation": _in_place_on_grads(lambda p: _standardise(p) if p.ndim == 2 else None),
    "renorm_ max-norm rows": _in_place_on_grads(lambda p: p.renorm_(2, 0, 0.5) if p.ndim == 2 else None),
    "spectral norm": lambda m: [torch.linalg.matrix_norm(p.detach(), 2) for p in m.parameters() if p.ndim == 2],
    "row and column norms": lambda m: [p.norm(dim=d) for p in m.parameters() if p.ndim == 2 for d in (0, 1)],
    "state_dict values": lambda m: list(m.state_dict().values()),
}


@pytest.mark.parametrize("kind", FSDP_FIRST)
@distributed(world_size=2)
def test_weight_space_ops_match_one_process(kind):
    for name, op in WEIGHT_OPS.items():
        assert _same_after(kind, op) < TOL[kind], name
    ours = _net(kind)
    full = {k: torch.randn(v.shape) for k, v in _net(None).state_dict().items()}
    with pytest.raises(RuntimeError, match=r"full \(unsharded\) tensor.*set_model_state_dict"):
        ours.load_state_dict(full)
    with pytest.raises(RuntimeError, match=r"full \(unsharded\) tensor.*distribute_tensor"), torch.no_grad():
        ours.a.weight.copy_(full["a.weight"])
    with pytest.raises(RuntimeError, match="DTensor cannot be pickled directly"):
        torch.save(ours.state_dict(), io.BytesIO())


# ----------------------------------------------------------------------------- optimizer groups


def _decay_groups(model) -> list[list]:
    """The usual splits: no weight decay for biases, norms and 1-dim tensors, by name and ``ndim``; and
    nanoGPT's, by module type over ``named_modules()`` (sharded modules are subclasses of their class)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "bias" in name or "norm" in name else decay).append((name, tuple(p.shape)))
    by_type = []
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            decays = name == "weight" and isinstance(module, (nn.Linear, nn.Conv1d))
            by_type.append((f"{module_name}.{name}".lstrip("."), decays))
    return [decay, no_decay, sorted(by_type)]


@pytest.mark.parametrize("kind", MESHES)
@distributed(world_size=2)
def test_weight_decay_groups_from_names_and_shapes_match_one_process(kind):
    assert _decay_groups(_net(kind)) == _decay_groups(_net(None))
    assert list(_net(kind).state_dict()) == list(_net(None).state_dict())  # the same keys, in the same order


# ----------------------------------------------------------------------------- through the Trainer


def _clipping_flow():
    from tests.test_trainer_flows import Flow

    class ClipsItself(Flow):
        """Clips with torch's own function on ``self.parameters()`` and logs a grad norm it computes itself."""

        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.user_norms.append(float(sum(g.norm() ** 2 for g in grads) ** 0.5))
            total = torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)  # a DTensor under the strategy
            self.log("clipped_from", total, sync_dist=True)

        def on_fit_start(self):
            self.user_norms = []

    return ClipsItself


@pytest.mark.slow
@distributed(world_size=2)
def test_user_clipping_under_a_partial_tp_plan_trains_like_one_process():
    """TP 2 with a plan for the MLPs only: attention and norms stay on the data-parallel sub-mesh."""
    import strategies
    from tests.test_trainer_features import _full as full_params
    from tests.test_trainer_features import _single_trainer
    from tests.test_trainer_flows import ONE_PROCESS, _trainer

    plan = {f"model.layers.*.feed_forward.{n}": ColwiseParallel() for n in ("up_proj", "gate_proj")}
    plan["model.layers.*.feed_forward.down_proj"] = RowwiseParallel()
    module = _clipping_flow()
    ours = module("llama")
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2, tp_plan=plan), max_steps=3)
    trainer.fit(ours)
    ref = module("llama", mirrors=1)
    ref_trainer = _single_trainer(max_steps=3, **ONE_PROCESS)
    ref_trainer.fit(ref)
    logged, ref_logged = trainer.callback_metrics["clipped_from"], ref_trainer.callback_metrics["clipped_from"]
    torch.testing.assert_close(_full(logged), ref_logged, rtol=5e-5, atol=5e-5)
    assert len(ours.user_norms) == 3 and min(ours.user_norms) > 0.5  # clipping was active at every step
    torch.testing.assert_close(torch.tensor(ours.user_norms), torch.tensor(ref.user_norms), rtol=5e-5, atol=5e-5)
    assert _worst(full_params(ours).values(), full_params(ref).values()) < TOL["tp"]
