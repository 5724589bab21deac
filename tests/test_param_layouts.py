"""Unusual parameter layouts and dtypes under FSDP 2 and TP 2 (docs/fsdp.md "Parameter layouts and dtypes"),
each compared with one process training the same model on the same global batches (forward, backward, AdamW
steps, optimizer state, full and sharded checkpoints):

* non-contiguous parameters: conv weights in ``channels_last`` (before and after sharding), a transposed view
  ``nn.Parameter(w.t())``, a column slice, a row slice with a storage offset; under TP 2 a transposed and a
  sliced ``nn.Linear`` weight;
* shapes: a first dimension smaller than the number of ranks or not divisible by it, zero-element parameters;
* dtypes: a float64 model (no staging kernel takes float64: its copies take the torch reference path, in
  float64, where ``fully_shard`` raised an error naming no parameter), bf16 parameters, ``model.double()`` /
  ``.half()`` called after sharding;
* through the Trainer: ``precision="64-true"`` (refused before) on a ``channels_last`` ConvNet, resuming that
  ConvNet from sharded and full checkpoints, and the setup errors for an integer and a complex
  parameter.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import numba_kernels as nk
import strategies
from lightning_shard import init_device_mesh
from lightning_shard.checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
)
from lightning_shard.fsdp import fully_shard
from lightning_shard.tensor import DTensor
from tests.harness import distributed
from tests.lightning_models import sampler_batches
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path
from tests.test_trainer_features import _single_trainer


def _mesh(name: str = "data_parallel"):
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(name,))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in model.named_parameters()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
    return max(((a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0) for k in a)


class ConvNet(nn.Module):
    """Two convs (one strided), GroupNorm (per-sample, so a rank's half batch normalises as one process does)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.GroupNorm(2, 6)
        self.c2 = nn.Conv2d(6, 5, 3, stride=2)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.c1(x)))
        return self.head(F.relu(self.c2(x)).mean((2, 3)))


class Strided(nn.Module):
    """Parameters that are views: transposed, a column slice, a row slice at a storage offset; and shapes whose
    first dimension is 1 (< 2 ranks), 3 (not divisible) or 0, and one with no columns."""

    def __init__(self) -> None:
        super().__init__()
        self.wt = nn.Parameter(torch.randn(8, 5).t())  # (5, 8), stride (1, 5)
        self.rows = nn.Parameter(torch.randn(20, 8)[3:8])  # (5, 8), storage offset 24
        self.cols = nn.Parameter(torch.randn(8, 10)[:, 2:7])  # (8, 5), stride (10, 1)
        self.one = nn.Parameter(torch.randn(1, 5))
        self.odd = nn.Parameter(torch.randn(3, 5))
        self.no_rows = nn.Parameter(torch.randn(0, 5))
        self.no_cols = nn.Parameter(torch.randn(5, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh((x @ self.wt) @ self.rows.t())
        h = h + self.one + self.cols.sum(0) + self.no_rows.sum(0) + self.no_cols.sum()
        return h @ self.odd.t()


def _shard_children(model: nn.Module, mesh) -> None:
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _train(model: nn.Module, data, one_process: bool) -> torch.optim.Optimizer:
    """AdamW steps on the global batches (one process) or on this rank's half of each."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    rank, world = dist.get_rank(), dist.get_world_size()
    for x, y in data:
        if not one_process:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def _data(shape: tuple[int, ...], classes: int, dtype=torch.float32, steps: int = 3):
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(4, *shape, generator=g, dtype=dtype), torch.randint(0, classes, (4,), generator=g))
        for _ in range(steps)
    ]


def _optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        f"{names[id(p)]}.{k}": (v.full_tensor() if isinstance(v, DTensor) else v)
        for p, state in opt.state.items()
        for k, v in state.items()
        if k != "step"
    }


def _check_like_one_process(build, shard, data, tol: float, path: str) -> None:
    """Train ``build()`` sharded and in one process; compare parameters, AdamW state, the full state dicts
    (model and optimizer), and a sharded save loaded into a fresh sharded model."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    shard(model, _mesh())
    assert _worst(_full(model), _full(ref)) == 0  # nothing permuted or truncated by sharding
    opt, ref_opt = _train(model, data, False), _train(ref, data, True)
    assert _worst(_full(model), _full(ref)) < tol
    assert _worst(_optimizer_state(model, opt), _optimizer_state(ref, ref_opt)) < tol
    assert _worst(get_model_state_dict(model, full_state_dict=True), ref.state_dict()) < tol
    full_osd = get_optimizer_state_dict(model, opt, full_state_dict=True)["state"]
    for name, p in ref.named_parameters():
        for k, v in ref_opt.state[p].items():
            assert _worst({k: full_osd[name][k]}, {k: v}) < tol, (name, k)
    save({"model": get_model_state_dict(model)}, path)
    torch.manual_seed(1)
    fresh = build()
    shard(fresh, _mesh())
    load({"model": get_model_state_dict(fresh)}, path)
    assert _worst(_full(fresh), _full(model)) == 0
    set_model_state_dict(fresh, ref.state_dict())  # a full state dict of the same layouts
    assert _worst(_full(fresh), _full(ref)) == 0


# ---------------------------------------------------------------------------------------------- float64
def test_float64_staging_ops_compute_in_float64() -> None:
    """No kernel takes float64: ``impl="auto"`` copies it with torch, dividing in float64 (float32 arithmetic
    would round a float64 model's gradients)."""
    layout = nk.GroupLayout([(5, 3), (4,)], 2)
    grads = [torch.randn(5, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    staged = torch.empty(2, layout.shard_numel, dtype=torch.float64)
    nk.reduce_scatter_copy_in(layout, grads, staged, predivide=3.0)
    assert torch.equal(staged[0, :9], grads[0][:3].reshape(-1) / 3.0)
    out = torch.ones(layout.shard_numel, dtype=torch.float64)
    nk.post_reduce(layout, staged[1], out, postdivide=7.0, accumulate=True)
    assert torch.equal(out, 1.0 + staged[1] / 7.0)
    full = torch.empty(layout.unsharded_numel, dtype=torch.float64)
    shard = torch.randn(2, layout.shard_numel, dtype=torch.float64)
    nk.all_gather_copy_out(layout, shard, full)
    assert torch.equal(full[:9], shard[0, :9]) and torch.equal(full[9:15], shard[1, :6])
    with pytest.raises(ValueError, match=r"has dtype torch.float64, which no kernel handles"):
        nk.reduce_scatter_copy_in(layout, grads, staged, impl="cpu")


@distributed(world_size=2)
def test_float64_model_trains_like_one_process(tmp_path):
    data = _data((3, 8, 8), 4, torch.float64)
    _check_like_one_process(lambda: ConvNet().double(), _shard_children, data, 1e-12, _shared_path(tmp_path, "f64"))


# ---------------------------------------------------------------------------------------------- layouts
@distributed(world_size=2)
def test_channels_last_convnet_trains_like_one_process(tmp_path):
    data = [(x.to(memory_format=torch.channels_last), y) for x, y in _data((3, 8, 8), 4)]

    def build():
        return ConvNet().to(memory_format=torch.channels_last)

    _check_like_one_process(build, _shard_children, data, 1e-5, _shared_path(tmp_path, "cl"))


@pytest.mark.slow
@distributed(world_size=2)
def test_strided_views_and_odd_shapes_train_like_one_process(tmp_path):
    _check_like_one_process(
        Strided, lambda m, mesh: fully_shard(m, mesh=mesh), _data((5,), 3), 1e-5, _shared_path(tmp_path, "sv")
    )


@pytest.mark.slow
@distributed(world_size=2)
def test_bf16_parameters_train_like_one_process(tmp_path):
    def build():
        return Strided().to(torch.bfloat16)

    data = [(x.bfloat16(), y) for x, y in _data((5,), 3)]
    # the reduce-scatter sums two bf16 half-batch gradients where one process has one full-batch gradient
    _check_like_one_process(build, lambda m, mesh: fully_shard(m, mesh=mesh), data, 2e-2, _shared_path(tmp_path, "bf"))


@pytest.mark.slow
@distributed(world_size=2)
def test_dtype_and_memory_format_changed_after_sharding():
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model).double().to(memory_format=torch.channels_last)
    _shard_children(model, _mesh())
    model.double()
    model.to(memory_format=torch.channels_last)
    assert _worst(_full(model), _full(ref)) == 0
    data = _data((3, 8, 8), 4, torch.float64)
    _train(model, data, False), _train(ref, data, True)
    assert _worst(_full(model), _full(ref)) < 1e-12
    model.half()
    ref.half()
    x = data[0][0].half()
    assert (model(x).float() - ref(x).float()).abs().max() < 1e-2


class Linears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.up.weight = nn.Parameter(torch.randn(6, 8).t())  # (8, 6), stride (1, 8)
        self.down.weight = nn.Parameter(torch.randn(6, 10)[:, 1:9])  # (6, 8), stride (10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.slow
@distributed(world_size=2)
def test_tensor_parallel_strided_linear_weights_train_like_one_process():
    from lightning_shard.tp import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Linears()
    ref = copy.deepcopy(model)
    parallelize_module(model, _mesh("tensor_parallel"), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert _worst(_full(model), _full(ref)) == 0
    data = _data((6,), 6)
    _train(model, data, True), _train(ref, data, True)  # TP: every rank sees the whole batch
    assert _worst(_full(model), _full(ref)) < 5e-5


# ---------------------------------------------------------------------------------------------- the Trainer
class LitConv(L.LightningModule):
    """The ConvNet in ``channels_last``, AdamW; ``one_process=True`` draws the global batches Lightning's
    DistributedSampler deals to 2 ranks (re-drawn each epoch: ``reload_dataloaders_every_n_epochs=1``)."""

    def __init__(self, one_process: bool = False, n: int = 16, extra: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ConvNet().to(memory_format=torch.channels_last)
        self.one_process, self.n = one_process, n
        if extra is not None:  # a parameter fully_shard refuses
            self.extra = nn.Parameter(_EXTRAS[extra](), requires_grad=extra != "int")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x.contiguous(memory_format=torch.channels_last)), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        data = TensorDataset(torch.randn(self.n, 3, 8, 8, generator=g), torch.randint(0, 4, (self.n,), generator=g))
        if self.one_process:
            batches = sampler_batches(2, 2, n=self.n, seed=self.current_epoch)
            return DataLoader(data, batch_sampler=[b.tolist() for b in batches])
        return DataLoader(data, batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)


_EXTRAS = {
    "int": lambda: torch.zeros(4, dtype=torch.int64),
    "complex": lambda: torch.randn(4, dtype=torch.complex64),  # a learnable FFT filter
}
_ONE_PROCESS = dict(limit_val_batches=0, num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=1)


@distributed(world_size=2)
def test_precision_64_true_trains_like_one_process():
    ours = LitConv()
    _trainer(precision="64-true", max_steps=3).fit(ours)
    ref = LitConv(one_process=True)
    _single_trainer(precision="64-true", max_steps=3, **_ONE_PROCESS).fit(ref)
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    assert _worst(_full(ours), _full(ref)) < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@distributed(world_size=2)
def test_channels_last_resumes_like_one_process(state_dict_type, tmp_path):
    path = _shared_path(tmp_path, "cl") + ".ckpt"
    first = _trainer(strategy=strategies.ShardFSDPTPStrategy(state_dict_type=state_dict_type), max_epochs=1)
    first.fit(LitConv(n=8))
    first.save_checkpoint(path)
    resumed = LitConv(n=8)
    strategy = strategies.ShardFSDPTPStrategy(state_dict_type=state_dict_type)
    _trainer(strategy=strategy, max_steps=-1, max_epochs=2).fit(resumed, ckpt_path=path)
    ref = LitConv(one_process=True, n=8)
    _single_trainer(max_epochs=2, **_ONE_PROCESS).fit(ref)
    assert _worst(_full(resumed), _full(ref)) < 1e-5


@pytest.mark.slow
@distributed(world_size=2)
def test_parameters_fully_shard_refuses_raise_at_setup():
    for extra, match in [
        ("int", "parameter 'extra' has dtype torch.int64"),
        ("complex", r"parameter 'extra' has dtype torch.complex64.*view_as_real"),
    ]:
        with pytest.raises(ValueError, match=match):
            _trainer(max_steps=1).fit(LitConv(extra=extra))


@pytest.mark.slow
@distributed(world_size=2)
def test_precision_64_true_under_tensor_parallel_trains_like_one_process():
    from tests.test_trainer_features import _full as full_params
    from tests.test_trainer_flows import _fit_both

    ours, ref = _fit_both("llama", 2, precision="64-true", max_steps=5)  # TP 2: the automatic plan on a Llama
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    assert _worst(full_params(ours), full_params(ref)) < 1e-12


@pytest.mark.slow
@distributed(world_size=2)
def test_fabric_precision_64_true_trains_like_one_process():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="shard_fsdp_tp", precision="64-true")
    fabric.launch()
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model).double()
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    rank = dist.get_rank()
    for x, y in _data((3, 8, 8), 4):
        out = model(x.chunk(2)[rank])
        assert out.dtype == torch.float32  # outputs come back in the default dtype, as Fabric's DoublePrecision
        opt.zero_grad()
        fabric.backward(F.cross_entropy(out, y.chunk(2)[rank]))
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x.double()).float(), y).backward()
        ref_opt.step()
    ours = {n.removeprefix("_forward_module."): p for n, p in _full(model).items()}
    assert all(p.dtype == torch.float64 for p in ours.values())
    assert _worst(ours, _full(ref)) < 1e-12
