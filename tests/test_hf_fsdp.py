"""Hugging Face model families under FSDP through the real Trainer, 2 ranks, against one process on the same
global batches (tiny random-init configs from tests/hf_models.py, no downloads).

The default run covers a causal LM with untied embeddings (Llama), one with tied embeddings (Qwen2) and an
encoder with a tied decoder weight and bias (BERT); ``slow`` covers the other families (T5 also runs by default
in tests/test_shared_params.py).
"""

import time

import lightning as L
import pytest

import strategies  # noqa: F401 - registers "shard_fsdp_tp"
from lightning_shard.tensor import DTensor
from tests.harness import distributed
from tests.hf_models import lit_hf, reference_params

STEPS = 4


def _fit_and_compare(family: str) -> float:
    module = lit_hf(family)
    names = [n for n, _ in module.model.named_parameters()]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="shard_fsdp_tp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert trainer.strategy.parallel_summary["fsdp_units"], family  # the repeated blocks were found
    ours = {n: p for n, p in module.model.named_parameters()}
    assert list(ours) == names, family  # no parameter added (untied) or lost
    assert all(isinstance(p, DTensor) for p in ours.values())
    ref = reference_params(family, STEPS)
    worst = max((ours[k].full_tensor() - ref[k]).abs().max().item() for k in ref)
    moved = max((ref[k] - lit_hf(family).model.get_parameter(k).detach()).abs().max().item() for k in ref)
    assert moved > 1e-3, family  # the steps changed the weights, so the comparison means something
    assert worst < 1e-6, (family, worst)
    return worst


def _run(families):
    for family in families:
        start = time.perf_counter()
        worst = _fit_and_compare(family)
        print(f"{family}: max |ours - reference| = {worst:.2e} ({time.perf_counter() - start:.1f} s)")


@distributed(world_size=2)
def test_hf_families_under_fsdp_match_one_process():
    _run(["llama", "qwen2", "bert"])


@pytest.mark.slow
@distributed(world_size=2)
def test_more_hf_families_under_fsdp_match_one_process():
    _run(["mistral", "gpt2", "opt", "t5"])
