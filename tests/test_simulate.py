"""lightning_shard.simulate: the simulated accelerator cluster itself (fake world, memory tracker, guards)."""

import pytest
import torch
import torch.distributed as dist

from lightning_shard import comm, init_device_mesh
from lightning_shard.fsdp import fully_shard
from lightning_shard.simulate import MemoryTracker, simulated_world
from lightning_shard.tensor import Replicate
from tests.fsdp_models import VOCAB, make_model


def test_memory_tracker_counts_allocations_frees_and_storage_resizes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), MemoryTracker() as mem:
        a = torch.empty(1000, device="lazy")  # 4000 bytes
        b = a[10:20]  # a view: no new storage
        c = torch.empty(250, device="lazy", dtype=torch.float64)  # 2000 bytes
        assert mem.live["lazy"] == 6000
        del a
        assert mem.live["lazy"] == 6000  # b keeps the storage alive
        del b
        assert mem.live["lazy"] == 2000
        c.untyped_storage().resize_(0)
        assert mem.live["lazy"] == 0
        c.untyped_storage().resize_(800)
        assert mem.live["lazy"] == 800
        h = torch.empty(10)
        assert mem.live["cpu"] == 40 and h.device.type == "cpu"
    assert mem.peak["lazy"] == 6000


def test_simulated_world_rejects_bad_requests():
    with pytest.raises(ValueError, match="rank=8"), simulated_world(8, rank=8):
        pass
    with pytest.raises(ValueError, match="world_size=0"), simulated_world(0):
        pass
    with simulated_world(8, rank=1) as world:
        with pytest.raises(ValueError, match=r"mesh_shape \(3,\)"):
            init_device_mesh(world.device_type, (3,))
        with pytest.raises(ValueError, match="'meta' is not supported"):
            init_device_mesh("meta", (8,))
    assert not dist.is_initialized()


def test_cpu_tensor_on_the_accelerator_group_raises_naming_the_call_site():
    with simulated_world(8, rank=2) as world:
        assert comm.served_device_types() == {world.device_type}
        with pytest.raises(RuntimeError, match=r"comm.all_reduce at .*test_simulate.py:\d+"):
            comm.all_reduce(torch.zeros(3), dist.group.WORLD)
        # torch.distributed's own collectives are guarded too while the simulation runs
        with pytest.raises(RuntimeError, match="torch.distributed.broadcast"):
            dist.broadcast(torch.zeros(3), src=0)
        comm.all_reduce(torch.zeros(3, device=world.device), dist.group.WORLD)  # the accelerator: fine
        # the mesh's groups carry host tensors too (torch's "cpu:gloo,cuda:nccl"), where the engine means it
        mesh = init_device_mesh(world.device_type, (8,), mesh_dim_names=("data_parallel",))
        with comm.host_collectives():
            comm.all_reduce(torch.zeros(3), mesh.get_group())
        assert comm.served_device_types(mesh.get_group()) == {"cpu", world.device_type}
        # anywhere else a host tensor there is a device-to-host round trip on an accelerator path: refused
        with pytest.raises(RuntimeError, match=r"host tensor .* device-to-host round trip"):
            comm.all_reduce(torch.zeros(3), mesh.get_group())


def test_fully_shard_step_as_rank_3_of_8_counts_collectives_and_shards_memory():
    with simulated_world(8, rank=3) as world:
        mesh = init_device_mesh(world.device_type, (8,), mesh_dim_names=("data_parallel",))
        with torch.device("meta"):
            model = make_model()
        total = sum(p.numel() * 4 for p in model.parameters())
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=world.device)
        after_setup = world.memory.live[world.device_type]
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randint(0, VOCAB, (4, 6), device=world.device)
        with comm.count_collectives() as counts:
            model(x).sum().backward()
        opt.step()
    groups = len(model.blocks) + 1
    assert counts.calls["all_gather"] == 2 * (groups - 1) + 1
    assert counts.calls["reduce_scatter"] == groups
    # each rank holds about 1/8 of the parameters (padding to a multiple of 8 rows per parameter)
    assert total / 8 <= after_setup <= total / 8 * 1.5, (after_setup, total)
    assert all(p.device.type == world.device_type for p in model.parameters())


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16_compute"])
def test_materialising_a_sharded_model_never_allocates_an_unsharded_group(mp):
    """``to_empty`` after meta init re-adopts each group's new local tensors into a new flat shard; the
    unsharded buffer gets bytes only at the first all-gather, so setup holds shards only."""
    from lightning_shard.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
    with simulated_world(8, rank=3) as world:
        mesh = init_device_mesh(world.device_type, (8,), mesh_dim_names=("data_parallel",))
        with torch.device("meta"):
            model = make_model(n_blocks=3)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        world.memory.reset_peaks()
        model.to_empty(device=world.device)
        peak = world.memory.peak[world.device_type]
        after_setup = world.memory.live[world.device_type]
        groups = [m._fsdp_state.group for m in [*model.blocks, model]]
        model(torch.randint(0, VOCAB, (2, 6), device=world.device)).sum().backward()  # the buffers still work
    shard_bytes = [g.shard_flat.numel() * g.shard_flat.element_size() for g in groups]
    smallest_unsharded = min(g.layout.unsharded_numel * g.unsharded_flat.element_size() for g in groups)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert after_setup == sum(shard_bytes) + buffer_bytes
    # while a group is re-adopted its old local tensors and its new flat shard are both alive: at most one
    # more shard; an unsharded group (8x a shard here) on top would exceed it
    assert peak <= after_setup + max(shard_bytes) < after_setup + smallest_unsharded, (peak, shard_bytes)


def test_cli_reports_memory_and_collectives_and_rejects_bad_requests(tmp_path, capsys):
    from lightning_shard.simulate.__main__ import main

    out = tmp_path / "report.json"
    argv = ["benchmarks.sim_models:llama_tiny", "--devices", "8", "--seq-len", "16", "--json", str(out)]
    assert main(argv) == 0
    import json

    report = json.loads(out.read_text())
    assert report["collectives_per_step"]["reduce_scatter"] == 3  # two blocks and the root
    assert report["device_bytes_after_setup"] < report["peak_device_bytes"]
    assert set(report["peak_by_phase"]) >= {"setup", "forward", "backward", "optimizer"}
    assert main(["benchmarks.sim_models:llama_tiny", "--devices", "8", "--tensor-parallel-size", "3"]) == 1
    assert "does not divide --devices 8" in capsys.readouterr().err
    assert main(["benchmarks.sim_models:nope", "--devices", "8"]) == 1
    assert "cannot load the factory" in capsys.readouterr().err


def _not_a_model():
    return 3


def _mlp_without_embedding():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))


def test_cli_names_what_it_cannot_simulate_instead_of_a_traceback(tmp_path, capsys):
    # Each of these ended in a traceback from deep inside torch or the model (or, for --json, after the whole
    # simulation had run), and the no-embedding error named a flag the CLI did not have.
    from lightning_shard.simulate.__main__ import main

    tiny = ["benchmarks.sim_models:llama_tiny", "--devices", "8"]
    assert main(tiny) == 1  # the default --seq-len 512 is longer than the model's rotary cache of 16
    err = capsys.readouterr().err
    assert "first forward failed on token ids of shape (1, 512)" in err and "--seq-len" in err
    assert main(["tests.test_simulate:_not_a_model", "--devices", "8"]) == 1
    assert "returned a int, not an nn.Module" in capsys.readouterr().err
    assert main([*tiny, "--seq-len", "16", "--json", str(tmp_path / "missing" / "out.json")]) == 1
    assert "does not exist or is not writable" in capsys.readouterr().err
    assert main([*tiny, "--seq-len", "16", "--json", str(tmp_path)]) == 1  # a folder
    assert "is a folder or a file that cannot be written" in capsys.readouterr().err
    mlp = ["tests.test_simulate:_mlp_without_embedding", "--devices", "2", "--seq-len", "4", "--no-checkpoint"]
    assert main(mlp) == 1 and "pass --vocab-size" in capsys.readouterr().err
    assert main([*mlp, "--vocab-size", "4", "--precision", "32-true"]) == 0  # the flag the message names exists


class _HostCollectiveInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)

    def forward(self, x):
        comm.all_reduce(torch.zeros(1), dist.group.WORLD)  # a host tensor over the accelerator's group
        return self.embed(x)


def test_a_device_error_in_the_first_forward_keeps_its_type():
    # The first forward's errors are named with the input shape for the CLI; the device checks' own errors were
    # relabelled as an input problem ("pass a --seq-len it accepts").
    from lightning_shard.simulate.run import SimulationRequest, simulate_training

    request = SimulationRequest(devices=2, seq_len=4, checkpoint=False, precision="32-true")
    with pytest.raises(comm.DeviceDisciplineError, match="comm.all_reduce at .*test_simulate.py"):
        simulate_training(_HostCollectiveInForward, request)


class _ScaledLinear(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return super().forward(x) * self.scale.exp()


def test_a_scalar_parameter_steps_on_the_simulated_accelerator():
    # A 0-dim parameter (CLIP's logit_scale) is kept whole on every rank: its copy into the shard, the gradient
    # staged into every row and the optimizer step run on the device, with no host tensor on an accelerator group.
    from lightning_shard.utils import clip_grad_norm_

    with simulated_world(8, rank=5) as world:
        mesh = init_device_mesh(world.device_type, (8,), mesh_dim_names=("data_parallel",))
        model = _ScaledLinear()
        fully_shard(model, mesh=mesh)
        model.to(world.device)
        opt = torch.optim.AdamW(model.parameters())
        with comm.count_collectives() as counts:
            model(torch.ones(2, 4, device=world.device)).sum().backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        assert counts.calls["reduce_scatter"] == 1 and "all_reduce" not in counts.calls  # no extra collective
        assert model.scale.placements == (Replicate(),) and model.scale.grad.shape == ()
        assert model.scale.grad.device.type == world.device_type


def test_a_factory_that_converts_its_model_to_its_own_dtype_simulates():
    # `model.float()` on a float32 model (what many model builders end with) is a no-op conversion; under the
    # simulation's fake mode torch's _apply swaps fake parameters, which their weak references refused: the
    # factory failed with "Couldn't swap Embedding.weight". The factory now builds real meta tensors, as on a GPU.
    from lightning_shard.simulate.run import SimulationRequest, simulate_training

    request = SimulationRequest(devices=2, seq_len=4, checkpoint=False, precision="32-true")
    report = simulate_training(lambda: make_model().float(), request)
    assert report["collectives_per_step"]["reduce_scatter"] > 0
