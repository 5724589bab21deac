"""Small models and a reference training loop shared by the FSDP tests."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ = 101, 16, 6


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyGPT(nn.Module):
    """Tied embeddings, uneven vocab (101), a frozen layer and a buffer."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, idx):
        x = self.embed(idx)
        x = x + self.scale * self.frozen(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(seed: int = 0, n_blocks: int = 2) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(n_blocks)


def batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
        for _ in range(steps)
    ]


def loss_fn(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def train_reference(model: nn.Module, data, lr: float = 0.1, optim: str = "sgd") -> tuple[nn.Module, list[float]]:
    """Single-process training on the full batches."""
    model = copy.deepcopy(model)
    opt = make_optimizer(model, lr, optim)
    losses = []
    for x, y in data:
        loss = loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def step_both(ref: nn.Module, ref_opt, model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor) -> None:
    """One optimizer step of the single-process reference on the whole batch and one of the data-parallel
    ``model`` on this rank's part of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for m, o, xs, ys in ((ref, ref_opt, x, y), (model, opt, rank_slice(x, rank, world), rank_slice(y, rank, world))):
        o.zero_grad()
        loss_fn(m, xs, ys).backward()
        o.step()


def make_optimizer(model: nn.Module, lr: float, optim: str):
    params = [p for p in model.parameters() if p.requires_grad]
    if optim == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr * 0.01, weight_decay=0.01)


def rank_slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world)[rank]


def global_loss(loss: torch.Tensor, group=None) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameter values by name, whatever the parameter type."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
