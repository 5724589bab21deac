"""Strategy setup on the simulated accelerator cluster: a model built on the host (in ``__init__``, not on meta)
is sharded before it is moved, with tensor parallelism too, so no device ever holds the whole model."""

import pytest
import torch

from lightning_shard.simulate import simulated_world
from lightning_shard.tensor import DTensor
from tests.sim_helpers import sim_strategy
from tests.tp_models import Llama, RMSNorm

N_LAYERS = 8


def _host_model() -> Llama:
    model = Llama(vocab=256, dim=64, n_layers=N_LAYERS, n_heads=4, n_kv_heads=2, hidden=128, max_len=16)
    for m in model.modules():
        if isinstance(m, RMSNorm):  # a buffer on a module that tensor parallelism replicates (SequenceParallel)
            m.register_buffer("scale", torch.ones(m.weight.shape))
    return model


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("world_size", [2, pytest.param(8, marks=pytest.mark.slow)], ids=["tp2", "dp4xtp2"])
def test_setup_peak_with_tensor_parallelism_is_the_sharded_model_plus_one_unit(world_size):
    """With TP > 1 the strategy moved a model built in ``__init__`` to the device whole before sharding it."""
    with simulated_world(world_size, rank=1) as world:
        strategy = sim_strategy(world, tensor_parallel_size=2, sequence_parallel=True, per_node=world_size)
        model = _host_model()
        model_bytes = _nbytes(model.parameters())
        block_bytes = _nbytes(model.layers[0].parameters())
        root_bytes = model_bytes - N_LAYERS * block_bytes
        world.memory.reset_peaks()
        strategy._parallelize(model)
        peak = world.memory.peak[world.device_type]
        device = strategy.root_device
        assert all(p.to_local().device == device for p in model.parameters())
        assert all((b.to_local() if isinstance(b, DTensor) else b).device == device for b in model.buffers())
        assert any(isinstance(b, DTensor) for b in model.buffers())  # the SequenceParallel norms' buffers
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randint(0, 256, (2, 8), device=device)).float().sum().backward()
        optimizer.step()
    # each device holds 1/world of the parameters (padded) plus, while fully_shard moves it, one unit's TP
    # shard (a block, or the root's embedding + head); the whole model would be `model_bytes`
    sharded = model_bytes / world_size
    bound = sharded * 1.3 + max(block_bytes, root_bytes) / 2 * 1.2
    assert peak <= bound < model_bytes, (peak, bound, model_bytes)
