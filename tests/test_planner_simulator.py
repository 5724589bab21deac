"""Planner vs the fake-tensor simulator (``lightning_shard.simulate``): the peak of each phase of a training
step, predicted on meta without running it, against the engine's real setup and steps run on fake tensors
with a memory tracker (the oracle). Also the loss's transients, measured on meta, against shapes."""

import pytest
import torch

from lightning_shard.planner import estimate
from lightning_shard.planner.profile import ActivationOptions, profile_activations
from lightning_shard.simulate.run import SimulationRequest, simulate_training

B, T, V, D = 2, 16, 101, 32  # micro-batch, sequence, vocabulary and width of tests/tp_models.Llama()


def _llama():
    from benchmarks.sim_models import llama_tiny

    return llama_tiny()


def _mean_loss(out):
    return out.float().mean()  # the simulator's loss


def test_loss_transients_are_measured_from_the_loss_itself():
    with torch.device("meta"):
        model = _llama()
    n = B * T * V  # logits
    mean = profile_activations(model, precision="bf16-mixed", batch=B, seq_len=T, loss_fn=_mean_loss)
    # forward: bf16 logits (2) + their fp32 copy (4); backward: the fp32 gradient of mean (4) and its bf16 cast (2)
    scalars = 16  # the loss itself, its gradient, NLL's total weight: a few bytes, far below one byte per logit
    assert mean.loss_forward == pytest.approx(n * (2 + 4), abs=scalars)
    assert mean.loss_backward == pytest.approx(n * (4 + 2), abs=scalars)
    ce = profile_activations(model, precision="bf16-mixed", batch=B, seq_len=T)
    # cross-entropy saves its fp32 log-softmax (an activation), so forward keeps the same 6 bytes beside it;
    # backward: the NLL gradient and log-softmax's input gradient, both fp32, at once
    assert ce.loss_forward == pytest.approx(n * (2 + 4), abs=scalars)
    assert ce.loss_backward == pytest.approx(n * (4 + 4), abs=scalars)
    # under TP without loss parallel the logits are all-gathered along the vocabulary: local (1/2), sent as it
    # lies, + gathered (1) + laid out along the vocabulary (1), in fp32 under 32-true
    fp32 = profile_activations(model, precision="32-true", batch=B, seq_len=T, loss_fn=_mean_loss)
    from lightning_shard.planner.estimate import tp_plan_for

    plan = tp_plan_for(model, 2)
    assert fp32.loss_forward_bytes(2, ActivationOptions(), plan) == 4 * (n // 2) + 4 * n * 2
    # loss parallel: no gather; the fp32 logits (no copy under 32-true) are sharded over the vocabulary
    assert fp32.loss_forward_bytes(2, ActivationOptions(loss_parallel=True), plan) == pytest.approx(4 * n // 2, abs=8)


@pytest.mark.parametrize(
    "devices, tp, precision, offload",
    [(2, 1, "bf16-mixed", False), (2, 2, "32-true", False), (2, 1, "bf16-mixed", True)],
    ids=["dp2-bf16", "tp2-fp32", "dp2-offload"],
)
def test_phase_peaks_match_the_simulator(devices, tp, precision, offload):
    request = SimulationRequest(devices=devices, tensor_parallel_size=tp, precision=precision, batch=B, seq_len=T,
                                steps=2, cpu_offload=offload, checkpoint=False, attention="math")  # fmt: skip
    sim = simulate_training(_llama, request)
    with torch.device("meta"):
        model = _llama()
    # both count attention as torch's math path runs it (the simulator's --attention math)
    prof = profile_activations(model, precision=precision, batch=B, seq_len=T, loss_fn=_mean_loss, attention="math")
    est = estimate(model, (devices // tp, tp), precision=precision, batch=B, seq_len=T, loss_fn=_mean_loss,
                   activations=prof, cpu_offload=offload)  # fmt: skip
    for phase in ("setup", "forward", "backward"):
        assert est.phases[phase] == pytest.approx(sim["peak_by_phase"][phase], rel=0.05), phase
    assert est.device_total == pytest.approx(sim["peak_device_bytes"], rel=0.05)


@pytest.mark.parametrize("ac", [pytest.param("full", marks=pytest.mark.slow), "selective-op"])
def test_checkpointed_peaks_match_the_simulator(ac):
    # benchmarks/planner_vs_simulator.py's Llama (4 blocks of width 256, 2 x 256 tokens), flash accounting on both
    # sides, as its table. selective-op: the planner's recomputation rebuilt the matmul outputs the policy keeps
    # from forward too (1.09x the simulated backward).
    from benchmarks.planner_vs_simulator import Config, plan, simulate

    config = Config("dp 8", 8, ac=ac)
    sim = simulate(config, "flash")
    est = plan(config, "flash", {})
    for phase in ("forward", "backward", "optimizer"):
        assert est.phases[phase] == pytest.approx(sim["peak_by_phase"][phase], rel=0.05), phase
    assert est.device_total == pytest.approx(sim["peak_device_bytes"], rel=0.05)
