"""Hugging Face fine-tuning flows through ``Trainer(strategy="shard_fsdp_tp")``, each compared with one process on
the same global batches (2 gloo ranks, FSDP 2 or TP 2).

* A classifier from a saved base model (``from_pretrained(..., num_labels=3)``: transformers draws the missing
  head), with and without ``empty_init``.
* ``resize_token_embeddings`` after ``from_pretrained`` under ``empty_init`` (raised "incompatible tensor type")
  and on a model built on meta (mean resizing raised on ``Tensor.item()``); a tied, resized model saved with
  ``save_hf_pretrained`` and read back by ``from_pretrained``.
* peft LoRA on a loaded model under ``empty_init``: its FSDP groups mix loaded and meta parameters (raised, or
  dropped the loaded weights when a meta one came first), and the adapters get peft's initialisation (B was
  drawn from N(0, 0.02)); DoRA is refused there; ``save_hf_pretrained`` refuses a peft model (``from_pretrained``
  read its files as a randomly initialised model), and peft's own save round-trips.
* Padding labels (-100) with uneven valid tokens per rank, and label smoothing, train as DDP does (the mean of
  the ranks' losses); under ``loss_parallel`` label smoothing raised, then trained each TP rank on its own part
  of the loss; validation under ``loss_parallel`` raised, and a logged label-smoothed loss hung.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import strategies
from tests import hf_models as H
from tests.harness import distributed
from tests.lightning_models import sampler_batches
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _shared_path

pytest.importorskip("transformers")

STEPS, LR, LABELS = 2, 0.1, 3


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _cls_dataset(n: int = 32, seq: int = 8):
    g = torch.Generator().manual_seed(2)
    return TensorDataset(H.token_batch(n, seq, seed=1), torch.randint(0, LABELS, (n,), generator=g))


def _cls_loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


class _Lit(L.LightningModule):
    def __init__(self, make, loss=_cls_loss, data=_cls_dataset) -> None:
        super().__init__()
        self.model = make()
        self._loss, self._data = loss, data

    def on_train_start(self):  # the values the run starts from, gathered (the same on every rank)
        self.initial = {n: _full(p).clone() for n, p in self.model.named_parameters()}

    def training_step(self, batch, batch_idx):
        return self._loss(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self._data(), batch_size=2, shuffle=False)


def _reference(make, initial, world, loss=_cls_loss, data=_cls_dataset, steps=STEPS):
    model = make()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(initial[n])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    rows = data()
    for idx in sampler_batches(world, 2, n=len(rows))[:steps]:
        opt.zero_grad()
        loss(model, rows[idx]).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _fit(make, tp=1, empty_init=False, **kw):
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp), max_steps=STEPS)
    if empty_init:
        with trainer.init_module(empty_init=True):
            module = _Lit(make, **kw)
    else:
        module = _Lit(make, **kw)
    trainer.fit(module)
    return module


def _worst(module, ref):
    ours = {n: _full(p) for n, p in module.model.named_parameters()}
    assert ours.keys() == ref.keys()
    return max((ours[n] - ref[n]).abs().max().item() for n in ref)


def _save_base(tmp_path, family, seed=3):
    saved = H.build(family, seed=seed)
    if family == "llama":
        saved.config.pad_token_id = 0
    path = _shared_path(tmp_path, family)
    if dist.get_rank() == 0:
        saved.save_pretrained(path)
    dist.barrier()
    return saved, path


@pytest.mark.parametrize(("family", "tp", "empty_init"), [("llama", 1, False), ("llama", 1, True), ("bert", 2, True)])
@distributed(world_size=2)
def test_classifier_from_a_saved_base_model(tmp_path, family, tp, empty_init):
    from transformers import AutoModelForSequenceClassification

    saved, path = _save_base(tmp_path, family)

    def make():
        torch.manual_seed(11)
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=LABELS)

    module = _fit(make, tp=tp, empty_init=empty_init)
    base = dict(saved.named_parameters())
    one = dict(make().named_parameters())  # one process: the base model's weights, and a head transformers drew
    assert module.initial.keys() == one.keys()
    assert sum(name in base for name in one) > 5 and any(name not in base for name in one)
    for name, value in one.items():
        assert torch.equal(module.initial[name], value), name
        if name in base:
            assert torch.equal(value, base[name]), name
    ref = _reference(make, module.initial, world=2 // tp)
    assert _worst(module, ref) < 1e-5


def _lm_loss(model, batch):
    return H.lm_loss(model, batch[0])


@pytest.mark.parametrize(("family", "tp", "empty_init"), [("qwen2", 1, False), ("llama", 1, True), ("qwen2", 2, True)])
@distributed(world_size=2)
def test_resize_token_embeddings_after_from_pretrained(tmp_path, family, tp, empty_init):
    from transformers import AutoModelForCausalLM

    saved, path = _save_base(tmp_path, family)

    def make():
        torch.manual_seed(11)
        model = AutoModelForCausalLM.from_pretrained(path)
        model.resize_token_embeddings(H.VOCAB + 8)
        return model

    module = _fit(make, tp=tp, empty_init=empty_init, loss=_lm_loss, data=H.token_dataset)
    one = make()
    emb = one.get_input_embeddings().weight
    got = module.initial[[n for n, p in one.named_parameters() if p is emb][0]]
    assert torch.equal(got[: H.VOCAB], saved.get_input_embeddings().weight), "old rows"
    assert torch.equal(got, emb), "new rows: transformers' mean resizing, as in one process"
    for name, value in saved.named_parameters():
        if value.shape == module.initial[name].shape:
            assert torch.equal(module.initial[name], value), name
    if family == "qwen2":
        assert module.model.lm_head.weight is module.model.get_input_embeddings().weight
    ref = _reference(make, module.initial, world=2 // tp, loss=_lm_loss, data=H.token_dataset)
    assert _worst(module, ref) < 1e-5


@distributed(world_size=2)
def test_resize_token_embeddings_of_a_model_built_on_meta():
    def make():
        model = H.build("qwen2")
        model.resize_token_embeddings(H.VOCAB + 8)  # mean resizing by default: it needs values, meta has none
        return model

    module = _fit(make, empty_init=True, loss=_lm_loss, data=H.token_dataset)
    emb = module.initial["model.embed_tokens.weight"]
    assert emb.shape == (H.VOCAB + 8, H.HIDDEN) and torch.isfinite(emb).all()
    assert 0.8 < emb.std().item() / H.build("qwen2").config.initializer_range < 1.25
    ref = _reference(make, module.initial, world=2, loss=_lm_loss, data=H.token_dataset)
    assert _worst(module, ref) < 1e-5


@pytest.mark.parametrize(("tp", "checkpointing"), [(1, False), (2, False), (1, True)])
@distributed(world_size=2)
def test_peft_lora_on_from_pretrained_under_empty_init(tmp_path, tp, checkpointing):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    saved, path = _save_base(tmp_path, "llama")

    def make():
        torch.manual_seed(11)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
        model = AutoModelForCausalLM.from_pretrained(path)
        if checkpointing:  # Hugging Face's own, reentrant: the frozen embedding's output must require grad
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()
        return get_peft_model(model, config)

    module = _fit(make, tp=tp, empty_init=True, loss=_lm_loss, data=H.token_dataset)
    one = dict(make().named_parameters())  # one process: peft's initialisation (B = 0, A Kaiming-uniform)
    assert module.initial.keys() == one.keys()
    for name, value in one.items():
        got = module.initial[name]
        if "lora_A" in name:
            assert 0.8 < got.std().item() / value.std().item() < 1.25, name
            assert got.abs().max() <= value.abs().max() * 1.01 + 1e-3, name  # uniform: the same bound
        else:
            assert torch.equal(got, value), name  # the checkpoint's base weights, B = 0
    ref = _reference(make, module.initial, world=2 // tp, loss=_lm_loss, data=H.token_dataset)
    assert _worst(module, ref) < 1e-5


class _Head(torch.nn.Module):
    """A classifier on a Hugging Face backbone: the head registered first, so the LightningModule's FSDP group (the
    root's leftovers) starts with the head (built on meta under empty_init), then the loaded embedding and norm."""

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import AutoModel

        torch.manual_seed(11)
        self.head = torch.nn.Linear(H.HIDDEN, LABELS)
        self.backbone = AutoModel.from_pretrained(path)

    def forward(self, input_ids, labels):
        hidden = self.backbone(input_ids=input_ids).last_hidden_state[:, -1]
        return torch.nn.functional.cross_entropy(self.head(hidden), labels)


@distributed(world_size=2)
def test_new_module_under_empty_init_next_to_loaded_weights(tmp_path):
    from lightning_shard.fsdp import built_on_meta

    saved, path = _save_base(tmp_path, "llama")
    module = _fit(lambda: _Head(path), empty_init=True, loss=lambda model, batch: model(*batch))
    assert not any(built_on_meta(p) for p in module.parameters())
    one = dict(_Head(path).named_parameters())  # one process: nn.Linear's own initialisation, the saved backbone
    for name, value in saved.model.named_parameters():
        assert torch.equal(module.initial[f"backbone.{name}"], value), name
    for name in ("head.weight", "head.bias"):
        ratio = module.initial[name].std().item() / one[name].std().item()
        assert 0.7 < ratio < 1.4, (name, ratio)
    ref = _reference(lambda: _Head(path), module.initial, world=2, loss=lambda model, batch: model(*batch))
    assert _worst(module, ref) < 1e-5


def _padded_lm_dataset(n: int = 32, seq: int = 8):
    """Token ids and labels with -100 (padding) over a random tail of each row: 1 to ``seq`` valid labels per row,
    so ranks see different numbers of valid tokens."""
    ids = H.token_batch(n, seq, seed=1)
    g = torch.Generator().manual_seed(4)
    valid = torch.randint(1, seq + 1, (n,), generator=g)
    labels = torch.where(torch.arange(seq)[None, :] < valid[:, None], ids, torch.full_like(ids, -100))
    return TensorDataset(ids, labels)


def _hf_padded_loss(model, batch):  # transformers' own causal-LM loss: a mean over this rank's valid tokens
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def _smoothed_loss(model, batch):
    ids, labels = batch
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, label_smoothing=0.1
    )


def _ddp_loss(loss, ranks):
    """What DDP (and torch's FSDP2) trains on: the mean of the ranks' losses, each a mean over its own rows."""

    def mean_of_ranks(model, batch):
        rows = len(batch[0]) // ranks
        return sum(loss(model, [t[r * rows : (r + 1) * rows] for t in batch]) for r in range(ranks)) / ranks

    return mean_of_ranks


@pytest.mark.parametrize(("loss", "tp", "loss_parallel"), [
    (_hf_padded_loss, 1, False), (_smoothed_loss, 1, False), (_smoothed_loss, 2, True), (_hf_padded_loss, 2, True),
])  # fmt: skip
@distributed(world_size=2)
def test_padding_labels_and_label_smoothing_train_as_ddp(loss, tp, loss_parallel):
    trainer = _trainer(
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp, loss_parallel=loss_parallel),
        max_steps=STEPS,
    )
    module = _Lit(lambda: H.build("llama"), loss=loss, data=_padded_lm_dataset)
    trainer.fit(module)
    dp = 2 // tp
    ref = _reference(
        lambda: H.build("llama"), module.initial, world=dp, loss=_ddp_loss(loss, dp), data=_padded_lm_dataset
    )
    assert _worst(module, ref) < 1e-5


@pytest.mark.parametrize("tp", [1, 2])
@distributed(world_size=2)
def test_tied_resized_model_saved_and_reloaded_in_one_process(tmp_path, tp):
    from transformers import AutoModelForCausalLM

    from lightning_shard.checkpoint import get_model_state_dict, save_hf_pretrained

    saved, path = _save_base(tmp_path, "qwen2")
    out = _shared_path(tmp_path, "trained")

    def make():
        model = AutoModelForCausalLM.from_pretrained(path)
        model.resize_token_embeddings(H.VOCAB + 6, mean_resizing=False)
        return model

    module = _fit(make, tp=tp, empty_init=True, loss=_lm_loss, data=H.token_dataset)
    save_hf_pretrained(module.model, out)
    full = get_model_state_dict(module.model, full_state_dict=True)
    if dist.get_rank() == 0:
        ref = _reference(make, module.initial, world=2 // tp, loss=_lm_loss, data=H.token_dataset)
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert loaded.config.vocab_size == H.VOCAB + 6 and loaded.config.tie_word_embeddings
        assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
        theirs = dict(loaded.named_parameters())
        assert theirs.keys() == ref.keys()
        for name, value in ref.items():
            assert torch.equal(theirs[name], full[name]), name
            assert (theirs[name] - value).abs().max() < 1e-5, name
    dist.barrier()


@distributed(world_size=2)
def test_peft_model_is_refused_by_save_hf_pretrained_and_saved_by_peft(tmp_path):
    # save_hf_pretrained wrote base_model.model.* and lora_A.default.* names; from_pretrained then loaded a randomly
    # initialised model, printing a report and raising nothing. It now raises on every rank, and the way it names
    # (a full state dict given to peft's save_pretrained on rank 0) round-trips the trained adapters.
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_shard.checkpoint import get_model_state_dict, save_hf_pretrained

    saved, path = _save_base(tmp_path, "llama")
    out = _shared_path(tmp_path, "adapters")

    def make():
        torch.manual_seed(11)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)

    module = _fit(make, tp=2, loss=_lm_loss, data=H.token_dataset)
    for target in (module.model, module.model.get_base_model()):
        with pytest.raises(TypeError, match="holds peft adapters.*peft_model.save_pretrained"):
            save_hf_pretrained(target, out)
    sd = get_model_state_dict(module.model, full_state_dict=True, cpu_offload=True)
    if dist.get_rank() == 0:
        module.model.save_pretrained(out, state_dict=sd)
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), out)
        theirs = dict(loaded.named_parameters())
        assert theirs.keys() == sd.keys()
        assert any("lora_B" in n and sd[n].abs().max() > 0 for n in sd)  # trained away from B = 0
        for name, value in sd.items():
            assert torch.equal(theirs[name], value), name
    dist.barrier()


@pytest.mark.parametrize("option", [{"use_dora": True}])
@distributed(world_size=2)
def test_lora_initialised_from_the_base_weights_is_refused_under_empty_init(tmp_path, option):
    # DoRA's magnitude vector (the base weight's norm) was computed on meta adapters: the first step raised on a
    # NaN placeholder, naming reset_parameters() as the fix. (OLoRA / PiSSA fail inside get_peft_model itself.)
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    saved, path = _save_base(tmp_path, "llama")

    def make():
        config = LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0, **option)
        return get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)

    name = next(iter(option))
    with pytest.raises(ValueError, match=f"LoRA adapter 'default' was built on the meta device.*{name}"):
        _fit(make, empty_init=True, loss=_lm_loss, data=H.token_dataset)


class _LitEval(_Lit):
    def training_step(self, batch, batch_idx):
        loss = self._loss(self.model, batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(self.model, batch)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(batch[0]))
        self.log("val_loss_unsynced", loss, prog_bar=True, batch_size=len(batch[0]))

    def val_dataloader(self):
        return DataLoader(self._data(), batch_size=4, shuffle=False)


@pytest.mark.parametrize("loss", [_hf_padded_loss, _smoothed_loss])
@distributed(world_size=2)
def test_validation_under_loss_parallel_matches_one_process(tmp_path, loss):
    trainer = _trainer(
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2, loss_parallel=True), limit_val_batches=2
    )
    module = _LitEval(lambda: H.build("llama"), loss=loss, data=_padded_lm_dataset)
    trainer.validate(module)
    model, rows = H.build("llama"), _padded_lm_dataset()
    with torch.no_grad():
        expected = sum(loss(model, rows[4 * k : 4 * k + 4]) for k in range(2)) / 2
    for key in ("val_loss", "val_loss_unsynced"):
        got = trainer.callback_metrics[key]
        assert abs(got.item() - expected.item()) < 1e-5, (key, got, expected)
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(_shared_path(tmp_path, "logs"))  # rank 0 writes the logged values
    trainer = _trainer(
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2, loss_parallel=True),
        max_steps=2,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=True,
    )
    trainer.fit(module)
