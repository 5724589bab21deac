"""Hugging Face models built under ``Trainer.init_module(empty_init=True)`` get transformers' own initialisation.

Under ``empty_init`` a model's parameters are built on the meta device; transformers' ``post_init`` then runs on
tensors without values. After sharding, the strategy materialises them: ``reset_parameters()`` alone gives torch's
defaults (an embedding drawn from N(0, 1), 50x transformers' ``initializer_range`` of 0.02; Kaiming-uniform
Linear weights) and leaves RMSNorm / GPT-2 ``Conv1D`` weights without a value (the strategy raised before the
first step). The strategy now also runs the model's own ``_init_weights`` on the tensors built on meta.

Checked against a model built the ordinary way in one process (``from_config`` on a real device: transformers'
initialisation): every constant tensor (norm weights, biases, an embedding's padding row) is equal, every random
one has the same standard deviation within 20%; then training from the initial values equals one process trained
from them on the same batches. TP 2 on BERT shards its embedding (with a padding row) by rows.

``from_pretrained`` under ``empty_init`` keeps the checkpoint's values: transformers builds the model on meta and
then assigns the loaded tensors, which ``empty_init`` used to move to meta as well (the weights were dropped, and
the model trained from a random initialisation without an error).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import strategies
from tests import hf_models as H
from tests.harness import distributed
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path

pytest.importorskip("transformers")

STEPS = 2


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _lit(family: str, pretrained: str | None = None):
    module = H.lit_hf(family)
    if pretrained is not None:
        module.model = type(module.model).from_pretrained(pretrained)

    def on_train_start():  # the values the run starts from, gathered (the same on every rank)
        module.initial = {n: _full(p).clone() for n, p in module.model.named_parameters()}

    module.on_train_start = on_train_start
    return module


def _same_initialisation(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == expected.keys()
    for name, want in expected.items():
        got = ours[name]
        assert got.shape == want.shape, name
        assert torch.isfinite(got).all(), name
        if want.min() == want.max():  # ones / zeros
            assert torch.equal(got, want), name
            continue
        rows = [i for i in range(want.shape[0]) if want.ndim == 2 and not want[i].any()]
        for i in rows:  # an embedding's padding row
            assert not got[i].any(), (name, i)
        ratio = (got.std() / want.std()).item()
        assert 0.8 < ratio < 1.25, f"{name}: std {got.std():.4f}, transformers' initialisation {want.std():.4f}"


@pytest.mark.parametrize(("family", "tp"), [("llama", 2), ("gpt2", 1), ("bert", 2)])
@distributed(world_size=2)
def test_hugging_face_model_under_empty_init_starts_from_its_own_initialisation(family, tp):
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=STEPS)
    with trainer.init_module(empty_init=True):
        module = _lit(family)
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module)
    expected = {n: p.detach() for n, p in H.build(family).named_parameters()}
    _same_initialisation(module.initial, expected)
    reference = H.reference_params(family, STEPS, world=2 // tp, initial=module.initial)
    trained = {n: _full(p) for n, p in module.model.named_parameters()}
    assert max((trained[n] - reference[n]).abs().max().item() for n in reference) < 1e-5


@distributed(world_size=2)
def test_from_pretrained_under_empty_init_keeps_the_checkpoint(tmp_path):
    saved = H.build("llama", seed=3)
    path = _shared_path(tmp_path, "llama")
    if dist.get_rank() == 0:  # transformers' save_pretrained writes on the main process only
        saved.save_pretrained(path)
    dist.barrier()
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(), max_steps=STEPS)
    with trainer.init_module(empty_init=True):
        module = _lit("llama", pretrained=path)
    trainer.fit(module)
    for name, p in saved.named_parameters():
        assert torch.equal(module.initial[name], p), name
    reference = H.reference_params("llama", STEPS, initial=module.initial)
    trained = {n: _full(p) for n, p in module.model.named_parameters()}
    assert max((trained[n] - reference[n]).abs().max().item() for n in reference) < 1e-5
