"""lightning_shard.simulate: torch's FSDP2 as the reference on the same simulation, flash-attention accounting,
and the staging kernels' stand-in."""

import json

import pytest
import torch
import torch.nn.functional as F

from lightning_shard.simulate import simulated_world
from lightning_shard.simulate.run import SimulationRequest, simulate_training
from tests.tp_models import Llama

# A Llama whose attention dominates its activations: head_dim 8, sequence 512, so one layer's S x S
# probabilities (4 heads x 512 x 512 x 4 bytes = 4 MiB) outweigh everything else it keeps (~0.3 MiB).
LAYERS, HEADS, SEQ = 4, 4, 512


def attention_heavy_llama():
    return Llama(vocab=101, dim=32, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=2, hidden=48, max_len=SEQ)


def _run(attention: str, engine=None) -> dict:
    request = SimulationRequest(devices=2, precision="32-true", seq_len=SEQ, attention=attention)
    return simulate_training(attention_heavy_llama, request, engine=engine)


def test_flash_accounting_drops_the_score_and_probability_matrices():
    math, flash = _run("math"), _run("flash")
    probabilities = 1 * HEADS * SEQ * SEQ * 4  # B x H x S x S in fp32, one layer
    # The math path keeps every layer's probabilities for backward and, while the last layer's softmax runs,
    # its scores too: (layers + 1) S x S matrices at the end of forward. Flash keeps none (its B x H x S
    # log-sum-exp and the saved output are < 2% of one matrix here).
    saved = math["peak_by_phase"]["forward"] - flash["peak_by_phase"]["forward"]
    assert (LAYERS + 1) * probabilities * 0.98 <= saved <= (LAYERS + 1) * probabilities * 1.05, saved / probabilities
    assert math["peak_device_bytes"] - flash["peak_device_bytes"] >= LAYERS * probabilities
    # the parameters, gradients and optimizer state are the same either way
    assert math["device_bytes_after_setup"] == flash["device_bytes_after_setup"]
    assert math["peak_by_phase"]["optimizer"] == flash["peak_by_phase"]["optimizer"]


def test_flash_accounting_keeps_what_flash_keeps_and_returns_gradients_of_the_right_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_shard.simulate.attention import flash_attention_accounting
    from lightning_shard.simulate.memory import MemoryTracker

    B, H, Hkv, S, D = 2, 8, 2, 64, 16
    with FakeTensorMode(), MemoryTracker() as mem, flash_attention_accounting():
        q = torch.empty(B, H, S, D, dtype=torch.bfloat16, device="lazy", requires_grad=True)
        k, v = (torch.empty(B, Hkv, S, D, dtype=torch.bfloat16, device="lazy", requires_grad=True) for _ in "kv")
        before = mem.live["lazy"]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # the output (bf16) and the log-sum-exp (fp32): nothing S x S
        assert mem.live["lazy"] - before == B * H * S * D * 2 + B * H * S * 4
        out.sum().backward()
    assert out.shape == (B, H, S, D) and out.dtype == torch.bfloat16
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    # outside the context, real tensors get torch's own attention
    with flash_attention_accounting():
        x = torch.randn(1, 2, 4, 8)
        torch.testing.assert_close(F.scaled_dot_product_attention(x, x, x), torch.softmax(x @ x.mT / 8**0.5, -1) @ x)


def test_staging_kernels_are_no_ops_on_fake_tensors_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_shard.simulate.kernels import simulated_staging_kernels
    from lightning_shard.simulate.memory import MemoryTracker
    from numba_kernels import GroupLayout, post_reduce, reduce_scatter_copy_in

    layout = GroupLayout([(3, 2), (5,)], world_size=2)
    with simulated_staging_kernels():
        out = torch.empty(2, layout.shard_numel)
        reduce_scatter_copy_in(layout, [torch.ones(3, 2), torch.ones(5)], out, predivide=2.0, impl="reference")
        assert out[0, 0].item() == 0.5  # real tensors: computed
        with FakeTensorMode(), MemoryTracker() as mem:
            staged = torch.empty(2, layout.shard_numel, device="lazy")
            grads = [torch.empty(3, 2, device="lazy"), torch.empty(5, device="lazy")]
            reduce_scatter_copy_in(layout, grads, staged, predivide=2.0, impl="reference")
            grad = torch.empty(layout.shard_numel, device="lazy")
            post_reduce(layout, staged[0], grad, postdivide=2.0, impl="reference")
            assert mem.peak["lazy"] == mem.live["lazy"]  # no temporaries (the reference path makes fp32 copies)
            with pytest.raises(ValueError, match="shape"):  # still validated
                post_reduce(layout, staged[0], torch.empty(3, device="lazy"), impl="reference")
    from numba_kernels import reference

    assert reference.post_reduce.__module__ == "numba_kernels.reference"  # restored


def _flags_as_all_reduce(counts) -> dict:
    counts = dict(counts)
    counts["all_reduce"] = counts.get("all_reduce", 0) + counts.pop("all_reduce_flags", 0)
    return counts


def test_dispatched_collective_counts_match_the_engines_own_counts():
    """The reference's collectives are counted from the dispatched ops; on the engine both counts agree, so the
    two engines' figures are comparable."""
    from lightning_shard import comm, init_device_mesh
    from lightning_shard.fsdp import fully_shard
    from lightning_shard.simulate import simulated_world
    from tests.fsdp_models import VOCAB, make_model

    with simulated_world(8, rank=1) as world:
        mesh = init_device_mesh(world.device_type, (8,), mesh_dim_names=("data_parallel",))
        with torch.device("meta"):
            model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=world.device)
        x = torch.randint(0, VOCAB, (4, 6), device=world.device)
        with comm.count_collectives() as ours, world.memory.count_collectives() as dispatched:
            model(x).sum().backward()
            comm.all_reduce(torch.zeros(3, device=world.device), mesh.get_group())
    # The flags of parameters no backward reached (one per group and backward) are all-reduces below comm.
    assert ours.calls["all_reduce_flags"] == len(model.blocks) + 1
    assert dict(dispatched.calls) == _flags_as_all_reduce(ours.calls)
    assert dict(dispatched.bytes) == _flags_as_all_reduce(ours.bytes)
    assert ours.calls["all_reduce"] == 1 and ours.calls["reduce_scatter"] == len(model.blocks) + 1


def test_cli_reference_torch_reports_both_engines_and_the_ratios(tmp_path, capsys):
    from lightning_shard.simulate.__main__ import main

    out = tmp_path / "report.json"
    argv = ["benchmarks.sim_models:llama_tiny", "--devices", "8", "--seq-len", "16", "--reference", "torch"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    torch_report, ratios = report["reference"], report["ratio_to_reference"]
    assert report["engine"] == "lightning_shard" and torch_report["engine"] == "torch"
    # same model, same mesh: torch's FSDP2 holds the same shards after setup (padding differs at most)
    assert abs(torch_report["device_bytes_after_setup"] - report["device_bytes_after_setup"]) < 1024
    # one reduce-scatter per unit (two blocks and the root), and the forward/backward all-gathers
    assert torch_report["collectives_per_step"]["reduce_scatter"] == 3
    assert torch_report["collectives_per_step"]["all_gather"] >= 5
    assert ratios["peak_device_bytes"] == round(report["peak_device_bytes"] / torch_report["peak_device_bytes"], 4)
    for phase in ("forward", "backward", "optimizer"):
        assert ratios["peak_by_phase"][phase] == round(
            report["peak_by_phase"][phase] / torch_report["peak_by_phase"][phase], 4
        )
    assert "ratio" in capsys.readouterr().out
    assert not hasattr(torch, "lazy")  # the stand-in device module is gone after the run


def test_reference_torch_runs_cpu_offload(tmp_path):
    # torch's FSDP2 pins its offloaded shards (aten._pin_memory: not implemented for fake tensors) and refuses
    # offloaded parameters materialised off the host: --cpu-offload --reference torch crashed in both.
    from lightning_shard.simulate.__main__ import main

    out = tmp_path / "report.json"
    argv = ["benchmarks.sim_models:llama_tiny", "--devices", "8", "--seq-len", "16", "--cpu-offload"]
    assert main([*argv, "--reference", "torch", "--no-checkpoint", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    torch_report = report["reference"]
    assert report["host_bytes_offloaded"] > 0
    assert torch_report["host_bytes_offloaded"] == report["host_bytes_offloaded"]  # the same fp32 shards
    assert torch_report["device_bytes_after_setup"] == report["device_bytes_after_setup"]  # the buffers alone


@pytest.mark.parametrize(
    "sequence_parallel", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tp2", "tp2_sp"]
)
def test_reference_with_tensor_parallelism_runs_torchtitans_plan(sequence_parallel):
    from lightning_shard.simulate.reference import TORCH_ENGINE

    request = SimulationRequest(
        devices=4, tensor_parallel_size=2, seq_len=16, precision="bf16-mixed", sequence_parallel=sequence_parallel
    )
    from benchmarks.sim_models import llama_tiny

    ours = simulate_training(llama_tiny, request)
    ref = simulate_training(llama_tiny, request, engine=TORCH_ENGINE)
    # 2-D sharding: each rank holds ~1/4 of the parameters (norms are replicated over TP in both)
    assert (
        abs(ref["device_bytes_after_setup"] - ours["device_bytes_after_setup"])
        <= 0.1 * ours["device_bytes_after_setup"]
    )
    calls = ref["collectives_per_step"]
    if sequence_parallel:
        # torchtitan's plan: every block gathers its sequence-sharded input twice (attention, MLP) in forward
        # and reduce-scatters the o and down outputs: 2 layers x 2 more of each than FSDP alone
        assert calls["reduce_scatter"] >= 3 + 2 * 2 and calls["all_gather"] >= 5 + 2 * 2
    else:
        assert calls["all_reduce"] >= 2 * 2  # the o and down projections' outputs, per layer
    assert not hasattr(torch, "lazy")


def test_reference_with_tensor_parallelism_needs_a_llama_shaped_model():
    from lightning_shard.simulate.reference import TORCH_ENGINE
    from tests.tp_models import GPT2

    request = SimulationRequest(devices=4, tensor_parallel_size=2, seq_len=8, precision="32-true")
    with pytest.raises(ValueError, match="torchtitan's Llama plan.*has no"):
        simulate_training(lambda: GPT2(), request, engine=TORCH_ENGINE)


def test_tracker_sees_collectives_and_temporaries_inside_a_dtensor_op():
    """A DTensor runs its redistributions inside its ``__torch_dispatch__``; the tracker must see them (a
    dispatch mode above the fake mode is switched off there). torch's total norm of a Shard(0) gradient stacks
    the partial norms and reduces them inside an op."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_shard.simulate import simulated_world
    from lightning_shard.simulate.reference import host_device_meshes, stand_in_device_module

    with simulated_world(8) as world, stand_in_device_module(world.device_type, 8), host_device_meshes():
        with unset_fake_temporarily():
            mesh = init_device_mesh(world.device_type, (8,))
        grad = distribute_tensor(torch.empty(64, 4, device=world.device), mesh, [Shard(0)])
        with world.memory.count_collectives() as counts:
            norm = torch.nn.utils.get_total_norm([grad], 2.0)
    assert norm.placements[0].is_replicate()  # the reduction happened inside the op
    assert dict(counts.calls) == {"all_reduce": 1}


def test_unknown_attention_accounting_is_rejected():
    with pytest.raises(ValueError, match="--attention 'flashy'"):
        SimulationRequest(devices=8, attention="flashy").check()


def test_tracker_counts_a_device_to_host_copy_on_the_host_only():
    """``.cpu()`` of a device tensor allocates host memory only; the fake implementation's same-size
    temporary on the source device is not what a GPU kernel allocates."""
    with simulated_world(2, rank=0) as world:
        x = torch.empty(1024, device=world.device)
        device_live = world.memory.live[world.device_type]
        world.memory.reset_peaks()
        y = x.cpu()
        assert world.memory.peak[world.device_type] == device_live
        assert world.memory.live["cpu"] >= y.numel() * 4
