"""LightningModules and a single-device reference loop for the strategy tests."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.fsdp_models import SEQ, VOCAB, TinyGPT, loss_fn


def dataset(n: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))


class LitGPT(L.LightningModule):
    """A LightningModule around a small LM: ``arch="gpt"`` (tests/fsdp_models.TinyGPT), ``"llama"``
    (tests/tp_models.Llama, for tensor parallelism) or ``"llama_pos"`` (tests/tp_models.LlamaWithPositionTable)."""

    def __init__(self, lr: float = 0.1, meta_init: bool = False, per_rank_batch: int = 4, arch: str = "gpt") -> None:
        super().__init__()
        self.lr = lr
        self.arch = arch
        self.meta_init = meta_init
        self.per_rank_batch = per_rank_batch
        self.model = None if meta_init else _seeded_model(arch)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = _build(self.arch)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.model, x, y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", loss_fn(self.model, x, y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", loss_fn(self.model, x, y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.per_rank_batch, shuffle=False)

    def val_dataloader(self):
        return DataLoader(dataset(16, seed=2), batch_size=self.per_rank_batch)

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        return self.val_dataloader()


def _build(arch: str):
    if arch == "llama":
        from tests.tp_models import Llama

        return Llama(vocab=VOCAB)
    if arch == "llama_pos":
        from tests.tp_models import LlamaWithPositionTable

        return LlamaWithPositionTable(vocab=VOCAB)
    return TinyGPT()


def _seeded_model(arch: str = "gpt"):
    torch.manual_seed(0)
    return _build(arch)


def sampler_batches(world: int, per_rank_batch: int, n: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """Global batches (indices) as Lightning's automatic DistributedSampler hands them to ``world`` ranks:
    it always shuffles training data (seed 0 unless PL_GLOBAL_SEED is set) and deals indices round-robin."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    per_rank = [order[r::world] for r in range(world)]
    steps = len(per_rank[0]) // per_rank_batch
    return [
        torch.tensor([i for r in range(world) for i in per_rank[r][k * per_rank_batch : (k + 1) * per_rank_batch]])
        for k in range(steps)
    ]


def reference_params(
    steps: int,
    world: int = 2,
    per_rank_batch: int = 4,
    lr: float = 0.1,
    accumulate: int = 1,
    clip: float | None = None,
    arch: str = "gpt",
):
    """Single-device SGD on the same global batches the ``world`` data-parallel ranks see, one optimizer step
    per ``accumulate`` micro-batches."""
    model = _seeded_model(arch)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = dataset()
    batches = iter(sampler_batches(world, per_rank_batch))
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x, y = data[next(batches)]
            (loss_fn(model, x, y) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}
