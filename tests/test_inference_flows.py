"""Generation and inference through ``Trainer(strategy="shard_fsdp_tp")``, each compared with one process running the
same weights on the same inputs (2 gloo ranks: FSDP 2, TP 2 under the automatic plan, TP 2 with ``loss_parallel``).

* Hugging Face ``generate`` (greedy, KV cache on and off, left-padded prompts) in ``validation_step`` and
  ``predict_step``: under ``loss_parallel`` it failed on the vocabulary-sharded logits.
* Sampling under TP with a seed per rank: the ranks of a TP group drew different tokens.
* ``trainer.predict`` of logits: under ``loss_parallel`` each rank returned its vocabulary shard in a DTensor.
* ``trainer.validate`` under ``torch.inference_mode()`` (Lightning's default on NCCL), then ``fit``, then validate
  again, then the model scored in a plain loop: under TP the training after an inference-mode validate went wrong
  with no error, and the loss under ``loss_parallel`` raised in inference mode.
* ``output_hidden_states`` / ``output_attentions`` under TP (each rank returned its own heads' weights) and
  sequence-classification probabilities.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies
from tests import hf_models as H
from tests.harness import distributed
from tests.test_strategy import _trainer

pytest.importorskip("transformers")

NEW_TOKENS = 4
# (tensor_parallel_size, loss_parallel)
MODES = [(1, False), (2, False), (2, True)]


def _strategy(tp: int, loss_parallel: bool) -> strategies.ShardFSDPTPStrategy:
    return strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp, loss_parallel=loss_parallel)


def _prompts(n: int = 4, seq: int = 6) -> TensorDataset:
    """``n`` left-padded prompts of lengths ``seq, seq-1, ...`` (pad id 0), their attention masks and indices."""
    ids = H.token_batch(n, seq, seed=7).clamp(min=3)  # no pad / bos / eos ids inside a prompt
    mask = torch.ones_like(ids)
    for i in range(n):
        pad = i % (seq - 1)
        ids[i, :pad], mask[i, :pad] = 0, 0
    return TensorDataset(ids, mask, torch.arange(n))


def _generate(model, ids, mask, use_cache: bool) -> torch.Tensor:
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=use_cache,
        pad_token_id=0,
    )


class Generating(L.LightningModule):
    """Calls ``generate`` in ``validation_step`` (kept in ``self.generated``) and ``predict_step`` (returned)."""

    def __init__(self, family: str, use_cache: bool) -> None:
        super().__init__()
        self.model = H.build(family)
        self.model.generation_config.pad_token_id = 0
        self.use_cache = use_cache
        self.generated: list[tuple[torch.Tensor, torch.Tensor]] = []

    def validation_step(self, batch, batch_idx):
        ids, mask, idx = batch
        self.generated.append((idx, _generate(self.model, ids, mask, self.use_cache)))

    def predict_step(self, batch, batch_idx):
        ids, mask, idx = batch
        return idx, _generate(self.model, ids, mask, self.use_cache)

    def val_dataloader(self):
        return DataLoader(_prompts(), batch_size=2)

    def predict_dataloader(self):
        return DataLoader(_prompts(), batch_size=2)


def _reference_generate(family: str, idx: torch.Tensor, use_cache: bool) -> torch.Tensor:
    model = H.build(family).eval()
    ids, mask, _ = _prompts()[idx]
    with torch.no_grad():
        return _generate(model, ids, mask, use_cache)


def _cases(cases: list[tuple], default: set[tuple]) -> list:
    """``cases`` as pytest params, those outside ``default`` marked slow (the file's default run stays short)."""
    return [pytest.param(*c, marks=() if c in default else pytest.mark.slow) for c in cases]


GENERATE = [(f, tp, lp, cache) for f in ("llama", "gpt2") for tp, lp in MODES for cache in (True, False)]


@pytest.mark.parametrize(
    ("family", "tp", "loss_parallel", "use_cache"),
    _cases(
        GENERATE,
        {("llama", 2, True, True), ("llama", 1, False, True), ("gpt2", 1, False, False), ("gpt2", 2, False, True)},
    ),
)
@distributed(world_size=2)
def test_generate_in_validation_and_predict(family, tp, loss_parallel, use_cache):
    """Under ``loss_parallel`` generate failed on the vocabulary-sharded logits in both steps."""
    module = Generating(family, use_cache)
    trainer = _trainer(strategy=_strategy(tp, loss_parallel), limit_val_batches=None)
    with _lightning_inference_mode_on_gloo():
        trainer.validate(module)
        predictions = trainer.predict(module)
    assert len(module.generated) == len(predictions) > 0
    for idx, tokens in module.generated + predictions:
        assert type(tokens) is torch.Tensor
        want = _reference_generate(family, idx, use_cache)
        assert tokens.shape == want.shape and torch.equal(tokens, want), (idx, tokens, want)


class Sampling(Generating):
    """Samples in ``predict_step`` after seeding each rank differently (``seed + rank``, as a user might)."""

    def predict_step(self, batch, batch_idx):
        ids, mask, idx = batch
        torch.manual_seed(SEED + self.global_rank)
        return idx, _sample(self.model, ids, mask)


SEED = 1234


def _sample(model, ids, mask) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, pad_token_id=0)


@distributed(world_size=2)
def test_sampling_under_tp_draws_one_token_per_tp_group():
    """The TP ranks sampled different tokens (each its own seed), then ran their forwards on different sequences
    while the collectives mixed them; ``generate`` now starts from the TP group's first rank's random state."""
    predictions = _trainer(strategy=_strategy(2, False)).predict(Sampling("llama", True))
    ref = H.build("llama").eval()
    for idx, tokens in predictions:
        ids, mask, _ = _prompts()[idx]
        torch.manual_seed(SEED)  # TP rank 0's seed
        with torch.no_grad():
            want = _sample(ref, ids, mask)
        assert torch.equal(tokens, want), (tokens, want)


# ------------------------------------------------------------------------------------------------ logits
class Scoring(L.LightningModule):
    """Predicts the logits of ``_prompts()`` (full vocabulary) and records the type the validation step sees."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = H.build(family)
        self.val_logits_types: list[str] = []

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits

    def validation_step(self, batch, batch_idx):
        ids, mask, _ = batch
        self.val_logits_types.append(type(self(ids, mask)).__name__)

    def predict_step(self, batch, batch_idx):
        ids, mask, idx = batch
        return idx, self(ids, mask)

    def val_dataloader(self):
        return DataLoader(_prompts(), batch_size=2)

    def predict_dataloader(self):
        return DataLoader(_prompts(), batch_size=2)


def _reference_logits(family: str, idx: torch.Tensor) -> torch.Tensor:
    ids, mask, _ = _prompts()[idx]
    with torch.no_grad():
        return H.build(family).eval()(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize(("tp", "loss_parallel"), _cases(MODES, {(2, True)}))
@distributed(world_size=2)
def test_predict_returns_full_logits(tp, loss_parallel):
    """Under ``loss_parallel`` each rank returned its vocabulary shard in a DTensor."""
    module = Scoring("llama")
    trainer = _trainer(strategy=_strategy(tp, loss_parallel), limit_val_batches=None)
    predictions = trainer.predict(module)
    for idx, logits in predictions:
        assert type(logits) is torch.Tensor  # not a DTensor, not this rank's vocabulary shard
        want = _reference_logits("llama", idx)
        assert logits.shape == want.shape and (logits - want).abs().max() < 5e-5
    trainer.validate(module)  # validation runs inside loss_parallel(): sharded logits for the loss there
    assert set(module.val_logits_types) == {"DTensor" if loss_parallel and tp > 1 else "Tensor"}


# ------------------------------------------------------------------------------------------------ inference mode
def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _val_rows() -> TensorDataset:
    return TensorDataset(H.token_batch(8, 8, seed=5), torch.arange(8))


class Validating(L.LightningModule):
    """Trains ``H.lm_loss`` with SGD; each validation batch records (step, row indices, loss, inference mode)."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = H.build(family)
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor, bool]] = []

    def on_train_start(self):
        self.initial = {n: _full(p).clone() for n, p in self.model.named_parameters()}

    def training_step(self, batch, batch_idx):
        return H.lm_loss(self.model, batch[0])

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask)

    def validation_step(self, batch, batch_idx):
        ids, idx = batch
        loss = H.lm_loss(self.model, ids)
        self.seen.append((self.global_step, idx, _full(loss).clone(), torch.is_inference_mode_enabled()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(H.token_dataset(), batch_size=2)

    def val_dataloader(self):
        return DataLoader(_val_rows(), batch_size=2)


@contextlib.contextmanager
def _lightning_inference_mode_on_gloo() -> Iterator[None]:
    """Lightning's evaluation loops run under ``torch.inference_mode()`` (``Trainer(inference_mode=True)``, the
    default) on NCCL, but fall back to ``torch.no_grad()`` on gloo; this makes them take the NCCL choice here."""
    from lightning.pytorch.loops import utilities

    saved = utilities._distributed_is_initialized
    utilities._distributed_is_initialized = lambda: False  # read only by the loops' no-grad decorator
    try:
        yield
    finally:
        utilities._distributed_is_initialized = saved


def _logits_of(out) -> torch.Tensor:
    return out.logits


def _model_with(family: str, params: dict[str, torch.Tensor]):
    model = H.build(family).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    return model


@pytest.mark.parametrize(
    ("tp", "loss_parallel", "inference_mode"),
    _cases([(*m, im) for m in MODES for im in (True, False)], {(2, False, True), (2, True, True)}),
)
@distributed(world_size=2)
def test_validate_fit_validate_then_score_in_a_plain_loop(tp, loss_parallel, inference_mode):
    """``trainer.validate`` (inference mode) before and after ``fit`` (whose own validation runs mid-epoch under
    ``no_grad``, as Lightning always does there), then the trained model scored in a plain loop on every rank."""
    family, dp = "llama", 2 // tp
    module = Validating(family)
    trainer = _trainer(
        strategy=_strategy(tp, loss_parallel),
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=None,
        inference_mode=inference_mode,
    )
    with _lightning_inference_mode_on_gloo():
        trainer.validate(module)
        trainer.fit(module)
        trainer.validate(module)
    initial = {n: _full(p) for n, p in H.build(family).named_parameters()}
    assert all(torch.equal(module.initial[n], initial[n]) for n in initial)
    after = {k: H.reference_params(family, k, world=dp, initial=initial) for k in (0, 2, 4)}
    steps = [step for step, *_ in module.seen]
    assert sorted(set(steps)) == [0, 2, 4] and steps[-1] == 4
    for i, (step, idx, loss, inference) in enumerate(module.seen):
        assert inference is (inference_mode and (step == 0 or i >= len(steps) - steps.count(4) // 2))
        with torch.no_grad():
            want = H.lm_loss(_model_with(family, after[step]), _val_rows()[idx][0])
        assert (loss - want).abs() < 5e-5, (step, idx, loss, want)
    got = {n: _full(p) for n, p in module.model.named_parameters()}
    assert max((got[n] - after[4][n]).abs().max().item() for n in got) < 5e-5
    ids = H.token_batch(3, 8, seed=9)
    with torch.no_grad():
        want = _model_with(family, after[4])(input_ids=ids).logits
    module.eval()
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            assert (_logits_of(module(ids, None)) - want).abs().max() < 5e-5  # through the root unit's hooks
            # a submodule of the root unit called directly: its parameters are gathered by the root's unshard()
            with pytest.raises(RuntimeError, match=r"module\.unshard\(\)"):
                module.model(input_ids=ids)
            module.unshard()
            logits = module.model(input_ids=ids).logits
            tokens = module.model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            module.reshard()
        assert type(logits) is torch.Tensor and (logits - want).abs().max() < 5e-5
        assert torch.equal(
            tokens,
            _model_with(family, after[4]).generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0),
        )


# ------------------------------------------------------------------------------------------------ outputs beyond logits
@pytest.mark.parametrize(("family", "tp"), _cases([("llama", 1), ("llama", 2), ("gpt2", 2)], {("llama", 2)}))
@distributed(world_size=2)
def test_hidden_states_and_attentions_in_predict(family, tp):
    """``output_hidden_states`` and ``output_attentions`` (eager attention) in a predict step equal one process; under
    TP each rank returned the attention weights of its own heads only."""
    predictions = _trainer(strategy=_strategy(tp, False)).predict(Outputs(family))
    ref = _eager(family).eval()
    for idx, hidden, attentions in predictions:
        ids, mask, _ = _prompts()[idx]
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
        assert len(hidden) == len(want.hidden_states) and len(attentions) == len(want.attentions)
        for got, exp in zip(hidden + attentions, want.hidden_states + want.attentions):
            assert type(got) is torch.Tensor and got.shape == exp.shape, (got.shape, exp.shape)
            assert (got - exp).abs().max() < 5e-5


def _eager(family: str):
    model = H.build(family)
    model.config._attn_implementation = "eager"
    return model


class Outputs(Scoring):
    def __init__(self, family: str) -> None:
        L.LightningModule.__init__(self)
        self.model = _eager(family)

    def predict_step(self, batch, batch_idx):
        ids, mask, idx = batch
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
        return idx, list(out.hidden_states), list(out.attentions)


# ------------------------------------------------------------------------------------------------ classification
def _classifier(family: str):
    from transformers import AutoModelForSequenceClassification

    base = H.build(family)
    torch.manual_seed(5)
    config = base.config
    config.num_labels, config.pad_token_id = 3, 0
    return AutoModelForSequenceClassification.from_config(config).float().eval()


class Classifying(L.LightningModule):
    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = _classifier(family)

    def predict_step(self, batch, batch_idx):
        ids, mask, idx = batch
        return idx, self.model(input_ids=ids, attention_mask=mask).logits.softmax(-1)

    def predict_dataloader(self):
        return DataLoader(_prompts(), batch_size=2)


@pytest.mark.parametrize(("family", "tp"), _cases([("llama", 1), ("llama", 2), ("bert", 2)], {("bert", 2)}))
@distributed(world_size=2)
def test_sequence_classification_probabilities(family, tp):
    predictions = _trainer(strategy=_strategy(tp, False)).predict(Classifying(family))
    ref = _classifier(family)
    for idx, probs in predictions:
        ids, mask, _ = _prompts()[idx]
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=mask).logits.softmax(-1)
        assert type(probs) is torch.Tensor and probs.shape == want.shape == (len(idx), 3)
        assert (probs - want).abs().max() < 5e-5
