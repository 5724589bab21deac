"""Activation checkpointing on the simulated accelerator: torch.utils.checkpoint finds a device module for the
stand-in device (its RNG state stashed and restored through the recording handle), and the simulated peak
drops by the activations the checkpointed blocks no longer keep."""

import torch
from torch import nn

from lightning_shard.simulate import simulated_world
from lightning_shard.simulate.run import SimulationRequest, simulate_training
from tests.sim_helpers import sim_strategy

VOCAB, DIM, HIDDEN, LAYERS = 64, 32, 128, 8
BATCH, SEQ = 4, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_activation_checkpointing_lowers_the_peak_by_the_blocks_saved_activations():
    peaks = {}
    # The first simulation of an op sequence in a process decides each DTensor op (rule, meta run) where later
    # ones reuse the cached decision, holding a few more temporaries at the peak: warm up first, so both
    # measured runs take the same path.
    for ac in (None, False, True):
        request = SimulationRequest(
            devices=2,
            precision="32-true",
            batch=BATCH,
            seq_len=SEQ,
            activation_checkpointing=bool(ac),
            checkpoint=False,
        )
        peaks[ac] = simulate_training(Net, request)["peak_device_bytes"]
    # Without checkpointing each block keeps, besides its input, the up projection's output (for gelu's
    # backward) and gelu's output (for down's): 2 x (B, S, HIDDEN) fp32. With it a block keeps only its input,
    # and backward recomputes one block at a time, so the peak holds one block's intermediates again.
    per_block = 2 * BATCH * SEQ * HIDDEN * 4
    expected = (LAYERS - 1) * per_block
    saved = peaks[False] - peaks[True]
    assert 0.9 * expected <= saved <= 1.1 * expected, (peaks, expected)


def test_strategy_activation_checkpointing_recomputes_with_the_accelerator_rng_state():
    """The strategy's own wrapper (torch.utils.checkpoint, non-reentrant, RNG state preserved) as rank 1 of 8."""
    with simulated_world(8, rank=1) as world:
        strategy = sim_strategy(world, activation_checkpointing_policy={Block})
        model = Net()
        strategy._parallelize(model)
        world.handle.calls.clear()
        loss = model(torch.randint(0, VOCAB, (2, 8), device=strategy.root_device)).sum()
        stashed = world.handle.count("get_rng_state")
        loss.backward()
        restored = world.handle.count("set_rng_state")
        assert all(p.grad is not None and p.grad.device == strategy.root_device for p in model.parameters())
    # one stash in forward and one restore in the recomputation per checkpointed block
    assert stashed >= LAYERS and restored >= LAYERS, world.handle.calls
    assert not hasattr(torch, world.device_type)  # the stand-in's device module is gone with the world
