"""Tiny random-init Hugging Face models, built from configs (no downloads): test material nobody here wrote.

Every factory returns a model in float32, eval-free (dropout 0), seeded, small enough for 2-4 CPU ranks:
hidden 64, 4 heads (2 KV heads where the family has grouped-query attention), 2 layers, vocabulary 128.

Example::

    model = build("llama")                       # LlamaForCausalLM
    ids = token_batch(batch=2, seq=8)
    loss = lm_loss(model, ids)                    # works for every family in FAMILIES

``FAMILIES`` maps each family to its builder and kind (``"causal"``, ``"masked"`` or ``"seq2seq"``).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
HIDDEN = 64
HEADS = 4
LAYERS = 2
MAX_POS = 64


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POS,
            tie_word_embeddings=False,
        )
    )


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POS,
        )
    )


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POS,
            tie_word_embeddings=True,
        )
    )


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=MAX_POS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            ffn_dim=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=MAX_POS,
            word_embed_proj_dim=HIDDEN,
            dropout=0.0,
            attention_dropout=0.0,
        )
    )


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=MAX_POS,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_kv=HIDDEN // HEADS,
            d_ff=2 * HIDDEN,
            num_layers=LAYERS,
            num_heads=HEADS,
            dropout_rate=0.0,
            tie_word_embeddings=True,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


# family -> (builder, loss kind)
FAMILIES: dict[str, tuple] = {
    "llama": (_llama, "causal"),
    "mistral": (_mistral, "causal"),
    "qwen2": (_qwen2, "causal"),
    "gpt2": (_gpt2, "causal"),
    "opt": (_opt, "causal"),
    "bert": (_bert, "masked"),
    "t5": (_t5, "seq2seq"),
}


def build(family: str, seed: int = 0) -> nn.Module:
    """A tiny random-init model of ``family`` (a key of ``FAMILIES``), float32, seeded.

    Example: ``build("t5")`` -> a 2-layer ``T5ForConditionalGeneration`` with tied embeddings.
    """
    builder, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = builder()
    model.config.use_cache = False
    return model.float()


def token_batch(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    """Token ids ``(batch, seq)`` in ``[0, VOCAB)``, the same on every rank for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own training loss on ``ids`` used as labels: next-token loss for causal LMs, masked-LM
    loss over every position for BERT, decoder loss for T5 (the ids are also the encoder input).

    Example: ``lm_loss(build("gpt2"), token_batch())`` -> a scalar tensor.
    """
    return model(input_ids=ids, labels=ids).loss


# ------------------------------------------------------------------------------------------------ Trainer runs
def token_dataset(n: int = 32, seq: int = 8, seed: int = 1):
    """``n`` rows of token ids (a TensorDataset), the same on every rank."""
    from torch.utils.data import TensorDataset

    return TensorDataset(token_batch(n, seq, seed))


def lit_hf(family: str, lr: float = 0.1, per_rank_batch: int = 2, save_dir: str | None = None, **save_kwargs):
    """A LightningModule training ``build(family)`` with ``lm_loss`` and SGD (momentum 0.9) on ``token_dataset``;
    with ``save_dir``, ``on_train_end`` writes the model with ``save_hf_pretrained(..., **save_kwargs)``.

    Example: ``Trainer(strategy="shard_fsdp_tp", max_steps=3).fit(lit_hf("t5"))``.
    """
    import lightning as L
    from torch.utils.data import DataLoader

    class LitHF(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(family)

        def training_step(self, batch, batch_idx):
            loss = lm_loss(self.model, batch[0])
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(token_dataset(), batch_size=per_rank_batch, shuffle=False)

        def on_train_end(self):
            if save_dir is not None:
                from lightning_shard.checkpoint import save_hf_pretrained

                save_hf_pretrained(self.model, save_dir, **save_kwargs)  # every rank; rank 0 writes

    return LitHF()


def reference_params(family: str, steps: int, world: int = 2, lr: float = 0.1, per_rank_batch: int = 2):
    """One process, the same global batches as ``world`` data-parallel ranks of ``lit_hf(family)`` see under
    Lightning's DistributedSampler: ``{fqn: tensor}`` after ``steps`` SGD steps."""
    from tests.lightning_models import sampler_batches

    model = build(family)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = token_dataset()
    n = len(data)
    for idx in sampler_batches(world, per_rank_batch, n=n)[:steps]:
        opt.zero_grad()
        lm_loss(model, data[idx][0]).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}
