"""Sharded and full checkpoint save and load on the simulated accelerator cluster (world 8, and 4 x 2 with
tensor parallelism): the engine's checkpoint code runs with a storage stand-in that records sizes instead of
writing tensor bytes (lightning_shard.simulate.checkpoint)."""

import math
import os

import pytest
import torch

from lightning_shard import comm, init_device_mesh
from lightning_shard.checkpoint import get_model_state_dict, get_optimizer_state_dict, save
from lightning_shard.checkpoint._safe_io import MARKER, SafeFileSystemReader
from lightning_shard.fsdp import fully_shard
from lightning_shard.simulate import simulated_world
from lightning_shard.simulate.checkpoint import simulate_checkpoints, simulated_storage
from lightning_shard.tensor import DTensor
from tests.tp_models import Llama

VOCAB = 256


def _meta_model() -> Llama:
    with torch.device("meta"):
        return Llama(vocab=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=128, max_len=16)


def _trained(world, tp: int):
    """A Llama sharded as on GPUs (TP with the auto plan when tp > 1, then fully_shard), after one AdamW step."""
    dp = world.world_size // tp
    mesh = init_device_mesh(world.device_type, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = _meta_model()
    if tp > 1:
        from lightning_shard.tp import auto_tp_plan, parallelize_module

        parallelize_module(model, mesh["tensor_parallel"], auto_tp_plan(model, mesh["tensor_parallel"]))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    model.to_empty(device=world.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, VOCAB, (2, 8), device=world.device)).float().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# dp 8 rank 0 and 4 x 2 rank 3 by default; 4 x 2 rank 0 in the slow run
@pytest.mark.parametrize(
    ("tp", "rank"),
    [(1, 0), pytest.param(2, 0, marks=pytest.mark.slow), pytest.param(2, 3, marks=pytest.mark.slow)],
    ids=["dp8-r0", "4x2-r0", "4x2-r3"],
)
def test_sharded_and_full_save_and_load_report_their_phases(tp, rank):
    reference = _meta_model()
    params = list(reference.parameters())
    model_bytes = _bytes(params)
    largest = max(_bytes([p]) for p in params)
    with simulated_world(8, rank=rank) as world:
        model, optimizer = _trained(world, tp)
        local = _bytes(p.to_local() for p in model.parameters())
        group_entries = len(optimizer.param_groups[0])  # lr, betas, ..., params: one pickled entry each
        live = world.memory.live[world.device_type]
        with comm.count_collectives() as counts:
            report = simulate_checkpoints(model, optimizer, world.memory)
        peaks = {k: v[world.device_type] for k, v in world.memory.peak_by_phase.items()}
        # the model is still sharded on the device and runs after both loads (an optimizer step cannot: loaded
        # values are unknown in a simulation, and AdamW reads its step counter with .item())
        assert all(isinstance(p, DTensor) and p.to_local().device == world.device for p in model.parameters())
        model(torch.randint(0, VOCAB, (2, 8), device=world.device)).float().sum().backward()
        assert all(p.grad is not None and p.grad.to_local().device == world.device for p in model.parameters())
    # Sharded: this rank writes (and reads back) its shards of the parameters and of AdamW's two moments, plus
    # the plain tensors (AdamW's step counters, 4-byte scalars) and the param groups' entries (each a small
    # torch.save archive of a few KiB at most).
    steps = 4 * len(params)
    tensors = 3 * local + steps
    assert tensors < report["sharded_bytes_written"] <= tensors + 4096 * group_entries, (report, tensors)
    assert report["sharded_bytes_read"] == report["sharded_bytes_written"]
    # ... with no device memory beyond the model's: the state dict views the shards, staging is on the host
    assert peaks["checkpoint_save"] == live and peaks["checkpoint_load"] == live, (peaks, live)
    # Full: rank 0's host receives every parameter and both moments whole; other ranks keep nothing (torch's rule)
    assert report["full_bytes_written"] == (3 * model_bytes + steps if rank == 0 else 0)
    if rank == 0:
        assert report["host_peak_by_phase"]["checkpoint_save_full"] >= 3 * model_bytes
    # ... gathered one tensor at a time over the mesh's groups on the device: never the whole model at once
    assert live < peaks["checkpoint_save_full"] <= live + 2 * largest, (peaks, live, largest)
    assert counts.calls["all_gather"] >= 3 * len(params)
    assert peaks["checkpoint_load_full"] == live


def test_sharded_save_as_rank_3_of_8_writes_its_own_chunks_and_publishes(tmp_path):
    """DCP planned with this rank's layout: the metadata places each parameter's chunk at this rank's offset
    (torch.chunk rows over 8 ranks), and the directory is complete (marker, metadata, data file length)."""
    rank, world_size = 3, 8
    with simulated_world(world_size, rank=rank) as world:
        model, optimizer = _trained(world, tp=1)
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        with simulated_storage() as storage:
            save(state, tmp_path / "ckpt")
    path = tmp_path / "ckpt"
    assert (path / MARKER).is_file() and (path / ".metadata").is_file()
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    shapes = {n: tuple(p.shape) for n, p in _meta_model().named_parameters()}
    for name, shape in shapes.items():
        md = metadata.state_dict_metadata[f"model.{name}"]
        assert tuple(md.size) == shape
        rows = math.ceil(shape[0] / world_size)
        start = min(rank * rows, shape[0])
        held = max(0, min(rows, shape[0] - start))
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        assert chunks == ([((start, *[0] * (len(shape) - 1)), (held, *shape[1:]))] if held else []), (name, chunks)
    assert {k for k in metadata.state_dict_metadata if k.startswith("optimizer.state.")} >= {
        f"optimizer.state.{n}.{m}" for n in shapes for m in ("exp_avg", "exp_avg_sq")
    }
    sizes = {os.path.basename(f): os.path.getsize(path / os.path.basename(f)) for f in storage.files}
    assert sum(sizes.values()) == storage.written > 0


def test_strategy_sharded_checkpoint_save_and_load_on_a_4x2_mesh(tmp_path):
    """The Lightning strategy's own save_checkpoint / load_checkpoint (ModelCheckpoint's path) as rank 3 of a
    (data_parallel 4, tensor_parallel 2) mesh: Lightning's loop state in meta.pt, shards in the DCP directory."""
    import lightning.pytorch as pl

    from tests.sim_helpers import sim_strategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.llama = Llama(vocab=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=128, max_len=16)

        def forward(self, idx):
            return self.llama(idx)

    path = tmp_path / "epoch=3.ckpt"
    with simulated_world(8, rank=3) as world:
        strategy = sim_strategy(world, tensor_parallel_size=2, state_dict_type="sharded")
        with torch.device("meta"):
            module = Module()
        strategy.connect(module)
        strategy._parallelize(module)
        optimizer = torch.optim.AdamW(module.parameters())
        module(torch.randint(0, VOCAB, (2, 8), device=world.device)).float().sum().backward()
        optimizer.step()
        strategy.optimizers = [optimizer]
        with simulated_storage() as storage:
            checkpoint = {
                "state_dict": strategy.lightning_module_state_dict(),
                "optimizer_states": [strategy.optimizer_state(optimizer)],
                "epoch": 3,
            }
            strategy.save_checkpoint(checkpoint, path)
            rest = strategy.load_checkpoint(path)
        local = _bytes(p.to_local() for p in module.parameters())
    assert {"meta.pt", ".metadata", MARKER} <= set(os.listdir(path))
    assert rest == {"epoch": 3}
    assert storage.read == storage.written > 3 * local


def test_sharded_state_of_cpu_offloaded_shards_stays_on_the_host():
    """Converting a CPU-offloaded shard to torch's DTensor for DCP (torch's from_local) copied it to the
    accelerator: a sharded save held the offloaded state in device memory, and a load wrote into those copies,
    leaving the model's host shards unchanged."""
    from lightning_shard.checkpoint import save_load
    from lightning_shard.device import same_storage
    from lightning_shard.fsdp import CPUOffloadPolicy

    with simulated_world(8, rank=2) as world:
        mesh = init_device_mesh(world.device_type, (8,), mesh_dim_names=("data_parallel",))
        model = _meta_model()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        model.to_empty(device=world.device)
        live = world.memory.live[world.device_type]
        converted = save_load._to_dcp({"model": get_model_state_dict(model)})
        for name, p in model.named_parameters():
            local = converted["model"][name]._local_tensor
            assert local.device.type == "cpu" and same_storage(local, p.to_local()), name
        assert world.memory.live[world.device_type] == live  # nothing was copied to the device
