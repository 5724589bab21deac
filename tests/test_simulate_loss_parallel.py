"""lightning_shard.simulate with ``--loss-parallel``: the LM head's logits stay vocabulary-sharded and the
cross-entropy runs inside loss parallelism, for this engine (``lightning_shard.tp.loss_parallel``, as the
strategy) and for torch's reference (torchtitan's ``Shard(-1)`` head and torch's ``loss_parallel``).

The expected bytes are derived from the shapes. N = B x S x V x 4 is the full fp32 logits; T the TP size.
Without loss parallelism the forward peaks while the head's output is all-gathered (the local logits N/T, the
gathered pieces N, the joined logits N); the log-softmax output N is allocated after the pieces are freed, so the
forward peak is N/T + 2N above the rest. The backward peaks in log-softmax's backward: its saved output, the
nll gradient and the result, 3N. With loss parallelism the decomposed log-softmax holds the local logits, the
shifted logits and their exponentials (3N/T) in forward; in backward its saved output, the gradient,
exp(out) and the product (4N/T). So the forward peak drops by 2N - 2N/T and the backward peak by 3N - 4N/T.
"""

import functools

import pytest

from lightning_shard.simulate.run import SimulationRequest, simulate_training
from tests.tp_models import Llama

B, S, V = 2, 128, 8192  # the logits (N = 8 MiB) outweigh everything else the tiny model holds
N = B * S * V * 4
SMALL = 64 * 1024  # the loss's per-row vectors (B x S floats, 1 KiB each) and the rest that is not logits


def tiny_llama():
    return Llama(vocab=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=48, max_len=S)


@functools.cache
def _run(loss_parallel: bool, engine: str = "ours", tp: int = 2) -> dict:
    from lightning_shard.simulate.reference import TORCH_ENGINE

    request = SimulationRequest(
        devices=2 * tp, tensor_parallel_size=tp, precision="32-true", batch=B, seq_len=S, loss="cross-entropy",
        loss_parallel=loss_parallel, checkpoint=False,
    )  # fmt: skip
    return simulate_training(tiny_llama, request, engine=TORCH_ENGINE if engine == "torch" else None)


def _drops(tp: int) -> tuple[int, int]:
    off, on = _run(False, tp=tp)["peak_by_phase"], _run(True, tp=tp)["peak_by_phase"]
    return off["forward"] - on["forward"], off["backward"] - on["backward"]


def test_loss_parallel_lowers_the_peaks_by_the_replicated_logits_and_adds_the_loss_all_reduces():
    forward, backward = _drops(tp=2)
    assert forward == pytest.approx(2 * N - 2 * N // 2, abs=SMALL)
    assert backward == pytest.approx(3 * N - 4 * N // 2, abs=SMALL)
    off, on = _run(False), _run(True)
    # the loss's four all-reduces (max and sum of exponentials in log-softmax, the picked targets, the row sums
    # of log-softmax's backward) replace the all-gather of the logits and the bytes it sent (N/T)
    assert on["collectives_per_step"]["all_reduce"] - off["collectives_per_step"]["all_reduce"] == 4
    assert off["collectives_per_step"]["all_gather"] - on["collectives_per_step"]["all_gather"] == 1
    assert off["comm_bytes_per_step"] - on["comm_bytes_per_step"] == pytest.approx(N // 2, abs=SMALL)


def test_torch_reference_under_loss_parallel_peaks_as_ours():
    # torch's DTensor derives output shapes on global-shape tensors in the active fake mode; the simulator's
    # tracker counted them (reference.private_sharding_propagation), and torch's forward peaked N above ours
    ours, torch = _run(True), _run(True, engine="torch")
    for phase in ("forward", "backward"):
        assert torch["peak_by_phase"][phase] == pytest.approx(ours["peak_by_phase"][phase], rel=0.01), phase
    # torch fuses log-softmax's backward into the nll's: one all-reduce fewer than ours
    assert torch["collectives_per_step"]["all_reduce"] > 0


def test_loss_parallel_needs_tensor_parallelism_and_cross_entropy():
    from lightning_shard.simulate.__main__ import main

    for kw in ({"tensor_parallel_size": 1, "loss": "cross-entropy"}, {"tensor_parallel_size": 2, "loss": "mean"}):
        with pytest.raises(ValueError, match="--loss-parallel.*--tensor-parallel-size > 1 and --loss cross-entropy"):
            SimulationRequest(devices=4, loss_parallel=True, **kw).check()
    assert main(["benchmarks.sim_models:llama_tiny", "--devices", "4", "--loss-parallel"]) == 1


def test_the_planner_simulates_loss_parallel_when_its_plan_uses_it():
    import torch

    from lightning_shard.planner import estimate
    from lightning_shard.planner.reserved import simulation_request

    with torch.device("meta"):
        model = Llama()
    common = dict(precision="bf16-mixed", batch=2, seq_len=16)
    request = simulation_request(
        estimate(model, (2, 2), loss_parallel=True, sequence_parallel=True, **common), **common
    )
    assert (request.tensor_parallel_size, request.loss_parallel, request.sequence_parallel) == (2, True, True)
    request.check()
    # without tensor parallelism the plan's flag changes nothing, as the strategy's
    assert not simulation_request(estimate(model, (4, 1), loss_parallel=True, **common), **common).loss_parallel


@pytest.mark.slow
def test_loss_parallel_drops_scale_with_the_tensor_parallel_size():
    forward, backward = _drops(tp=4)  # at T = 2 both drops are N; at T = 4 they differ
    assert forward == pytest.approx(2 * N - 2 * N // 4, abs=SMALL)
    assert backward == pytest.approx(3 * N - 4 * N // 4, abs=SMALL)


@pytest.mark.slow
def test_the_published_70b_setting_in_small_peaks_as_torch():
    """The 70B run's options (bf16-mixed, sequence parallel, full checkpointing, two steps) on the tiny Llama."""
    from lightning_shard.simulate.reference import TORCH_ENGINE

    request = SimulationRequest(
        devices=4, tensor_parallel_size=2, precision="bf16-mixed", batch=B, seq_len=S, steps=2, loss="cross-entropy",
        loss_parallel=True, sequence_parallel=True, activation_checkpointing="full", checkpoint=False,
    )  # fmt: skip
    ours, torch = simulate_training(tiny_llama, request), simulate_training(tiny_llama, request, engine=TORCH_ENGINE)
    for phase in ("forward", "backward", "optimizer"):
        assert torch["peak_by_phase"][phase] == pytest.approx(ours["peak_by_phase"][phase], rel=0.01), phase
