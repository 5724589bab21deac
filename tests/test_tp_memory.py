"""Memory of tensor parallelism: no full-size buffer kept behind a shard, no extra copy around an all-gather.

Found by ``benchmarks/tp_memory.py`` (docs/benchmarks.md, "TP 2"): with the same plan as torch's
``parallelize_module`` on the Trainer benchmark's GPT, ours held 11.8 MiB more after setup (each ``Shard(0)``
parameter's local shard was a view into the full parameter broadcast by ``distribute_tensor``) and 8 MiB more
at the forward peak (the gathered logits' shard was copied with its dim moved to the front before the
all-gather). Live bytes here are counted by a dispatch mode that follows the storages of the tensors the
ops under it create (weak references: a storage counts until it is freed), the same way for ours and for
torch's DTensor on the same data.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed.tensor as tdt
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_shard import init_device_mesh
from lightning_shard.tensor import Replicate, Shard, distribute_tensor
from lightning_shard.tp import ColwiseParallel, RowwiseParallel, parallelize_module
from tests.harness import distributed


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by the ops run under the mode and still alive, sampled after each op
    (an op's output is allocated while its inputs live, so that is where peaks are)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if id(s) not in self.storages:
                    self.storages[id(s)] = (weakref.ref(s), s.nbytes())
        self.storages = {k: v for k, v in self.storages.items() if v[0]() is not None}
        self.peak = max(self.peak, sum(n for _, n in self.storages.values()))
        return out


def _owns_exactly(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


@distributed(world_size=2)
def test_a_distributed_shard_holds_only_its_own_bytes():
    mesh = init_device_mesh("cpu", (2,))
    for placement in (Shard(0), Shard(1), Replicate()):
        for src in (0, None):
            local = distribute_tensor(torch.randn(8, 6), mesh, [placement], src_data_rank=src).to_local()
            assert _owns_exactly(local), (placement, src, local.untyped_storage().nbytes(), local.numel() * 4)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 64))
    plan = {
        "0": RowwiseParallel(input_layouts=Replicate()),
        "1": ColwiseParallel(),
        "3": RowwiseParallel(),
        "4": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)
    held = {n: p.to_local().untyped_storage().nbytes() for n, p in model.named_parameters()}
    own = {n: p.to_local().numel() * 4 for n, p in model.named_parameters()}
    assert held == own  # before: the Shard(0) weights (0, 1, 4) held their full parameter's bytes


@distributed(world_size=2)
def test_gathering_a_last_dim_shard_peaks_no_higher_than_torch():
    """Shard(-1) -> Replicate (a column-parallel LM head's logits): ours' live bytes at the peak <= torch's."""
    mesh = init_device_mesh("cpu", (2,))
    full = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0))  # the same on every rank
    ours = distribute_tensor(full, mesh, [Shard(-1)])
    theirs = tdt.distribute_tensor(full, mesh.to_torch(), [tdt.Shard(-1)])
    peaks = {}
    for name, x, target in (("ours", ours, [Replicate()]), ("torch", theirs, [tdt.Replicate()])):
        with LiveBytes() as mode:
            y = x.redistribute(x.device_mesh, target).to_local()
        assert torch.equal(y, full)
        peaks[name] = mode.peak
        del y
    local_bytes = full.numel() * 4 // 2
    # torch: the gathered buffer (2 shards) and the result (2 shards); before, ours also held a moved copy
    assert peaks["ours"] <= peaks["torch"] == 4 * local_bytes, peaks


@distributed(world_size=4)
def test_a_chunk_of_a_gathered_buffer_does_not_keep_the_buffer():
    """(Shard(0), Shard(0)) -> (Replicate(), Shard(0)) on a 2 x 2 mesh gathers both mesh dims, then chunks
    dim 0 again: the shard is copied out of the gathered buffer, not a view keeping all of it alive."""
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    x = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
    local = x.redistribute(mesh, [Replicate(), Shard(0)]).to_local()
    assert torch.equal(local, full.chunk(2)[mesh.get_coordinate()[1]])
    assert _owns_exactly(local), (local.untyped_storage().nbytes(), local.numel() * 4)
