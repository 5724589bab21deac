"""Tiny standard ``torch.nn`` architectures (not transformers' models) for ``tests/test_arch.py``, a
LightningModule around any of them and the single-process reference on the same global batches.

Each family is one model whose loss sums the losses of several variants fed the same batch, so one Trainer
run checks them all; a parameter's name says which variant it belongs to.

Example::

    module = LitArch("rnn")
    _trainer().fit(module)                                      # 2 ranks, FSDP
    ref = reference_run("rnn", steps=3, world=2)                # one process, the same 8-row global batches
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import sampler_batches

V, T, E = 16, 6, 8  # vocabulary, sequence length, embedding width
CLASSES = 4


# ---------------------------------------------------------------------------------------------- data
def _tokens(n: int, g: torch.Generator):
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


def _images(n: int, g: torch.Generator):
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def _sequences(n: int, g: torch.Generator):
    return torch.randn(n, T, E, generator=g), torch.randn(n, T, E, generator=g)


# ---------------------------------------------------------------------------------------------- 1. RNNs
class RNNBlock(nn.Module):
    """An LSTM and a projection back to the input width, with a residual: a repeated block (an FSDP unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(E, E, batch_first=True)
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        return x + self.proj(self.rnn(x)[0])


class RNNFamily(nn.Module):
    """LSTM (2 layers, bidirectional), GRU (time-major), LSTM with ``proj_size``, nn.RNN, and a stack of
    LSTM blocks, each with its own head, on one shared embedding."""

    data = staticmethod(_tokens)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, E)
        self.lstm = nn.LSTM(E, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(E, 6)
        self.lstm_proj = nn.LSTM(E, 6, proj_size=4, batch_first=True)
        self.rnn = nn.RNN(E, 5, nonlinearity="relu", batch_first=True)
        self.blocks = nn.ModuleList(RNNBlock() for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(width, V) for width in (12, 6, 4, 5, E))

    def forward(self, x):
        h = self.embed(x)
        outs = [self.lstm(h)[0], self.gru(h.transpose(0, 1))[0].transpose(0, 1), self.lstm_proj(h)[0], self.rnn(h)[0]]
        b = h
        for block in self.blocks:
            b = block(b)
        outs.append(b)
        return [head(o) for head, o in zip(self.heads, outs)]

    def loss(self, x, y):
        return sum(F.cross_entropy(o.reshape(-1, V), y.reshape(-1)) for o in self(x))


# ---------------------------------------------------------------------------------------------- 2. BatchNorm
class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, norm: type[nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = norm(c_out)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class BatchNormCNN(nn.Module):
    """Conv2d + BatchNorm2d + ReLU blocks, average pooling, a linear classifier."""

    data = staticmethod(_images)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(3, 4), ConvBlock(4, 4))
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))

    def loss(self, x, y):
        return F.cross_entropy(self(x), y)


# ---------------------------------------------------------------------------------------------- 3. parametrizations
class Scale(nn.Module):
    """A custom parametrization: the weight times a fixed factor plus its transpose-free square (any
    differentiable function of the original)."""

    def forward(self, w):
        return 0.5 * w + 0.1 * w * w


class ParamFamily(nn.Module):
    """``parametrizations.weight_norm``, ``parametrizations.spectral_norm``, a custom
    ``register_parametrization``, and the old-style ``nn.utils.weight_norm`` (a forward pre-hook)."""

    data = staticmethod(_sequences)

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils import parametrizations

        self.wn = parametrizations.weight_norm(nn.Linear(E, E))
        self.sn = parametrizations.spectral_norm(nn.Linear(E, E))
        self.custom = nn.Linear(E, E)
        parametrize.register_parametrization(self.custom, "weight", Scale())
        with warnings.catch_warnings():  # deprecated in favour of parametrizations.weight_norm; still used
            warnings.simplefilter("ignore")
            self.old_wn = nn.utils.weight_norm(nn.Linear(E, E))

    def forward(self, x):
        return self.old_wn(torch.tanh(self.custom(torch.tanh(self.sn(torch.tanh(self.wn(x)))))))

    def loss(self, x, y):
        return F.mse_loss(self(x), y)


# ---------------------------------------------------------------------------------------------- 4. nn.Transformer
class TransformerFamily(nn.Module):
    """nn.TransformerEncoder (batch-first, post-norm), nn.TransformerDecoder (sequence-first, pre-norm) and
    a standalone nn.MultiheadAttention, on float sequences."""

    data = staticmethod(_sequences)

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        enc = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(enc, 2, enable_nested_tensor=False)
        dec = nn.TransformerDecoderLayer(E, 2, 16, dropout=0.0, batch_first=batch_first, norm_first=True)
        self.decoder = nn.TransformerDecoder(dec, 2, norm=nn.LayerNorm(E))
        self.mha = nn.MultiheadAttention(E, 2, batch_first=True)

    def forward(self, x):
        seq = x if self.batch_first else x.transpose(0, 1)
        memory = self.encoder(seq)
        out = self.decoder(seq, memory)
        out = out if self.batch_first else out.transpose(0, 1)
        attn, _ = self.mha(out, out, out, need_weights=False)  # self-attention: eval takes the fused fast path
        return out + attn

    def loss(self, x, y):
        return F.mse_loss(self(x), y)


# ---------------------------------------------------------------------------------------------- 5. embeddings
class EmbeddingFamily(nn.Module):
    """nn.EmbeddingBag (sum with offsets and per-sample weights, mean, max) and nn.Embedding with
    ``padding_idx``; ``max_norm`` is the separate ``MaxNormEmbedding`` (it renormalises in place)."""

    data = staticmethod(_tokens)

    def __init__(self) -> None:
        super().__init__()
        self.bag_sum = nn.EmbeddingBag(V, E, mode="sum")
        self.bag_mean = nn.EmbeddingBag(V, E, mode="mean")
        self.bag_max = nn.EmbeddingBag(V, E, mode="max")
        self.pad = nn.Embedding(V, E, padding_idx=0)
        self.head = nn.Linear(E, V)

    def forward(self, x):
        n = x.shape[0]
        flat = x.reshape(-1)
        offsets = torch.arange(0, n * T, T, device=x.device)
        weights = (flat.float() + 1.0) / V
        pooled = (
            self.bag_sum(flat, offsets, per_sample_weights=weights) + self.bag_mean(x) + self.bag_max(flat, offsets)
        )
        return self.head(self.pad(x) + pooled[:, None, :])

    def loss(self, x, y):
        return F.cross_entropy(self(x).reshape(-1, V), y.reshape(-1))


class MaxNormEmbedding(nn.Module):
    """nn.Embedding(max_norm=...): its forward renormalises the looked-up rows of the weight in place."""

    data = staticmethod(_tokens)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, E, max_norm=1.0)
        self.head = nn.Linear(E, V)
        with torch.no_grad():
            self.embed.weight.mul_(3.0)  # most rows above max_norm, so the renormalisation matters

    def forward(self, x):
        return self.head(self.embed(x))

    def loss(self, x, y):
        return F.cross_entropy(self(x).reshape(-1, V), y.reshape(-1))


# ---------------------------------------------------------------------------------------------- 6. odd uses
class MiscFamily(nn.Module):
    """A frozen submodule, a parameter used twice in one forward, a module called twice, a module never
    called (no gradient), GroupNorm, PReLU, Conv1d and ConvTranspose1d."""

    data = staticmethod(_sequences)

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(E, E)
        self.frozen.requires_grad_(False)
        self.shared = nn.Parameter(torch.randn(E, E) * 0.3)
        self.twice = nn.Linear(E, E)
        self.unused = nn.Linear(E, E)
        self.conv = nn.Conv1d(E, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.prelu = nn.PReLU(6)
        self.deconv = nn.ConvTranspose1d(6, E, 3, padding=1)

    def forward(self, x):
        h = self.frozen(x)
        h = torch.tanh(h @ self.shared) @ self.shared.T
        h = self.twice(torch.tanh(self.twice(h)))
        c = self.deconv(self.prelu(self.gn(self.conv(h.transpose(1, 2)))))
        return h + c.transpose(1, 2)

    def loss(self, x, y):
        return F.mse_loss(self(x), y)


FAMILIES = {
    "rnn": RNNFamily,
    "bn_cnn": BatchNormCNN,
    "param": ParamFamily,
    "transformer": TransformerFamily,
    "transformer_seq_first": lambda: TransformerFamily(batch_first=False),
    "embedding": EmbeddingFamily,
    "max_norm": MaxNormEmbedding,
    "misc": MiscFamily,
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[name]()


def dataset(name: str, n: int = 32, seed: int = 1) -> TensorDataset:
    model_cls = FAMILIES[name]
    data = model_cls.data if isinstance(model_cls, type) else TransformerFamily.data
    return TensorDataset(*data(n, torch.Generator().manual_seed(seed)))


def make_optimizer(params, opt: str):
    if opt == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class LitArch(L.LightningModule):
    """A LightningModule training ``FAMILIES[name]`` with its own loss; validation logs the same loss in
    eval mode (under ``torch.no_grad``, as Lightning runs it)."""

    def __init__(self, name: str, opt: str = "sgd", per_rank_batch: int = 4, n: int = 32) -> None:
        super().__init__()
        self.name, self.opt, self.per_rank_batch, self.n = name, opt, per_rank_batch, n
        self.model = build(name)

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(*batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model.loss(*batch), sync_dist=True)

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.opt)

    def train_dataloader(self):
        return DataLoader(dataset(self.name, self.n), batch_size=self.per_rank_batch)

    def val_dataloader(self):
        return DataLoader(dataset(self.name, 8, seed=2), batch_size=self.per_rank_batch)


def reference_run(
    name: str, steps: int, world: int, per_rank_batch: int = 4, opt: str = "sgd", n: int = 32, per_rank_buffers=False
):
    """One process, the ``world`` data-parallel ranks' batches concatenated per step (Lightning's sampler
    order); returns the model after ``steps`` optimizer steps and, per rank, its buffers.

    ``per_rank_buffers`` (BatchNorm): each rank's rows run forward separately, with that rank's copy of the
    buffers (batch statistics over its own rows, running statistics of its own batches, as every data-parallel
    rank keeps them), and the loss is the mean over ranks; otherwise the global batch runs as one.
    """
    model = build(name)
    optim = make_optimizer(model.parameters(), opt)
    data = dataset(name, n)
    buffers = [_buffers(model) for _ in range(world)]
    for idx in sampler_batches(world, per_rank_batch, n=n)[:steps]:
        optim.zero_grad()
        if not per_rank_buffers:
            model.loss(*data[idx]).backward()
        else:
            for r in range(world):
                _load_buffers(model, buffers[r])
                (model.loss(*data[idx[r * per_rank_batch : (r + 1) * per_rank_batch]]) / world).backward()
                buffers[r] = _buffers(model)
        optim.step()
    if not per_rank_buffers:
        buffers = [_buffers(model) for _ in range(world)]
    return model, buffers


def reference_val_loss(model: nn.Module, name: str, world: int, buffers: list[dict], per_rank_batch: int = 4) -> float:
    """The ``val_loss`` Lightning logs with ``sync_dist=True``: each data-parallel rank's batches of the
    validation set (its ``DistributedSampler`` share, not shuffled), in eval mode under ``no_grad`` with that
    rank's buffers; the mean over batches and ranks (all batches have the same size)."""
    data = dataset(name, 8, seed=2)
    losses = []
    model.eval()
    with torch.no_grad():
        for r in range(world):
            _load_buffers(model, buffers[r])
            rows = list(range(r, len(data), world))
            for k in range(0, len(rows), per_rank_batch):
                losses.append(model.loss(*data[rows[k : k + per_rank_batch]]).item())
    model.train()
    return sum(losses) / len(losses)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _load_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(values[n])
