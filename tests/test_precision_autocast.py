"""precision="bf16-mixed" means Lightning's autocast: the loss is fp32 and matches DDP's bf16-mixed.

The reference is what DDP's bf16-mixed computes on one rank: the fp32 model under
``torch.autocast("cpu", dtype=torch.bfloat16)`` on the same local batch.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (registers "shard_fsdp_tp")
from tests.fsdp_models import DIM, SEQ, VOCAB, Block
from tests.harness import distributed

CLASSES, N = 10, 32
TOLERANCE = 2e-3  # relative, first-step loss


class Classifier(nn.Module):
    """Two blocks, mean pooling, a linear head: the loss is computed by the user on the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def _model() -> Classifier:
    torch.manual_seed(0)
    return Classifier()


def _data() -> TensorDataset:
    """Labels mostly the fp32 model's own predictions (a model part-way through training: loss ~2, not ~ln 10)."""
    x = torch.randint(0, VOCAB, (N, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = _model()(x).argmax(-1)
    y[::4] = (y[::4] + 1) % CLASSES
    return TensorDataset(x, y)


def _ddp_bf16_mixed_loss(x, y) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(_model()(x), y).item()


class LitClassifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _model()
        self.first = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if self.first is None:
            self.first = (x, y, loss.dtype, loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=N // dist.get_world_size())


def _check_first_loss(x, y, dtype, loss) -> None:
    assert dtype == torch.float32  # autocast computes losses in fp32
    reference = _ddp_bf16_mixed_loss(x, y)
    assert abs(loss - reference) / reference < TOLERANCE, (loss, reference)


@distributed(world_size=2)
def test_trainer_bf16_mixed_first_loss_matches_ddp_autocast():
    from tests.test_strategy import _trainer

    module = LitClassifier()
    trainer = _trainer(max_steps=1, precision="bf16-mixed")
    trainer.fit(module)
    assert all(p.dtype == torch.float32 for p in module.parameters())  # fp32 master weights stay
    _check_first_loss(*module.first)


@distributed(world_size=2)
def test_bf16_mixed_autocasts_with_an_accelerator_instance():
    # Lightning names "cuda" as the autocast device for any accelerator given as an object; on this CPU the
    # strategy then ran autocast("cuda"), disabled with a warning: the step ran without autocast (fp32 losses by
    # chance, bf16 weights: not Lightning's bf16-mixed). setup_environment settles it on the root device's type.
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
    from lightning.pytorch.accelerators import CPUAccelerator

    from tests.test_strategy import _trainer

    module = LitClassifier()
    seen = []
    module.model.head.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    _trainer(max_steps=1, precision="bf16-mixed", accelerator=CPUAccelerator()).fit(module)
    assert seen == [True]
    _check_first_loss(*module.first)
    fabric = L.Fabric(accelerator=FabricCPU(), devices=2, strategy="shard_fsdp_tp", precision="bf16-mixed")
    fabric.launch()
    model = fabric.setup_module(_model())
    seen.clear()
    model.module.head.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    model(_data().tensors[0][:2])
    assert seen == [True]


@distributed(world_size=2)
def test_fabric_bf16_mixed_first_loss_matches_ddp_autocast():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="shard_fsdp_tp", precision="bf16-mixed")
    fabric.launch()
    model = fabric.setup_module(_model())
    autocast_seen = []
    model.module.head.register_forward_pre_hook(lambda m, a: autocast_seen.append(torch.is_autocast_enabled("cpu")))
    x, y = _data().tensors
    x, y = x.chunk(2)[dist.get_rank()], y.chunk(2)[dist.get_rank()]
    loss = F.cross_entropy(model(x), y)  # the usual Fabric loop: the model's output comes back in fp32
    assert autocast_seen == [True]
    _check_first_loss(x, y, loss.dtype, loss.item())
    fabric.backward(loss)


class RecordsDefaultDtype(LitClassifier):
    """A step that makes a tensor without a dtype (a mask, noise, a constant), as user code does."""

    def training_step(self, batch, batch_idx):
        self.made = torch.ones(1).dtype
        return super().training_step(batch, batch_idx)


def _default_dtype_in_a_step(precision: str, **trainer_kwargs) -> torch.dtype:
    module = RecordsDefaultDtype()
    L.Trainer(max_steps=1, precision=precision, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs).fit(module)  # fmt: skip
    return module.made


@distributed(world_size=2)
def test_true_precisions_make_step_tensors_in_their_dtype_as_on_one_device():
    # Lightning's HalfPrecision / DoublePrecision (one device, DDP) make the "-true" dtype the default inside a step
    for precision, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("64-true", torch.float64)):
        one_device = _default_dtype_in_a_step(precision, accelerator="cpu", devices=1)
        assert one_device == dtype, (precision, one_device)
        ours = _default_dtype_in_a_step(precision, accelerator="cpu", devices=2, strategy="shard_fsdp_tp")
        assert ours == one_device, (precision, ours)
        assert torch.get_default_dtype() == torch.float32  # restored after the step


def test_the_autocast_device_is_the_accelerators_even_where_cuda_exists(monkeypatch):
    # Trainer(accelerator="cpu", precision="bf16-mixed") on a machine with a GPU: the strategy replaced Lightning's
    # MixedPrecision(device="cpu") by autocast("cuda"), which leaves every CPU op in fp32 (no error).
    from lightning.pytorch.plugins.precision import MixedPrecision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    strategy = strategies.ShardFSDPTPStrategy()
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert strategy.precision_plugin.device == "cpu"
    with strategy.precision_plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")


def test_fabrics_autocast_device_is_the_accelerators_even_where_cuda_exists(monkeypatch):
    from lightning.fabric.plugins.precision import MixedPrecision

    from strategies.fabric import ShardFSDPTPFabricStrategy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    strategy = ShardFSDPTPFabricStrategy()
    strategy.precision = MixedPrecision("bf16-mixed", "cpu")
    assert strategy.precision.trainer_plugin.device == "cpu"
