"""lightning_shard.comm: the collective wrappers' own choices, checked against torch.distributed on gloo ranks."""

import torch
import torch.distributed as dist

from lightning_shard import comm, init_device_mesh
from tests.harness import distributed


@distributed(world_size=4)
def test_reduce_scatter_scratch_matches_reduce_scatter_on_a_sub_group():
    # A 2x2 mesh: the "data_parallel" groups are {0, 2} and {1, 3}, so the group rank differs from the global
    # rank on ranks 1, 2, 3 (the chunk must be picked by group rank).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    group = mesh.get_group("data_parallel")
    g = torch.Generator().manual_seed(dist.get_rank())
    for dtype in (torch.float32, torch.bfloat16):
        for chunk_numel in (1001, (1 << 20) + 3):  # below and above the 4 MiB from which gloo all-reduces
            x = torch.randn(2, chunk_numel, generator=g).to(dtype)
            expected = torch.empty(chunk_numel, dtype=dtype)
            dist.reduce_scatter_tensor(expected, x.clone().view(-1), group=group)
            with comm.count_collectives() as counts:
                work, chunk = comm.reduce_scatter_scratch(x.view(-1), group, async_op=True)
            work.wait()
            assert torch.equal(chunk, expected), (dtype, chunk_numel)
            assert counts.calls == {"reduce_scatter": 1}
            assert counts.bytes["reduce_scatter"] == x.numel() * x.element_size()
            # from 4 MiB the result is left in this rank's chunk of the input (no output buffer)
            in_place = chunk.data_ptr() == x[mesh.get_local_rank("data_parallel")].data_ptr()
            assert in_place == (x.numel() * x.element_size() >= 4 << 20), (dtype, chunk_numel)
