"""Train a Llama-style causal LM with FSDP x TP (``strategy="shard_fsdp_tp"``), then resume from its checkpoint.

On CPU, 4 processes as a 2 x 2 mesh (2-way FSDP x 2-way tensor parallel, auto plan)::

    python examples/finetune_llm.py --devices 4 --tensor-parallel-size 2 --max-steps 60
    python examples/finetune_llm.py --devices 4 --tensor-parallel-size 2 --max-steps 90 \\
        --resume runs/finetune_llm/step=60.ckpt                      # continues at step 60

and unchanged on GPUs (``--precision bf16-mixed`` there). ``--devices 2 --tensor-parallel-size 1`` is FSDP only.

The model (``examples/llama.py``: RMSNorm, rotary, GQA through SDPA, SwiGLU) is plain PyTorch; the strategy
finds its tensor-parallel plan (q/k/v/o, gate/up/down, embedding, LM head) and FSDP units (the blocks). The
text is character-level and generated (the review sentences of ``examples/reviews.py``), so nothing is
downloaded. Validation perplexity comes from torchmetrics; checkpoints are sharded directories written by
``ModelCheckpoint`` (``--save-every``) and at the end; ``--resume PATH`` restores model, optimizer and loop
state from one, on any number of devices. After training, a greedy sample is generated through
``trainer.predict``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/ is a folder of scripts, not a package

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_info  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402
from reviews import LABELS, sentence  # noqa: E402
from summary import parallel_summary  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torchmetrics.text import Perplexity  # noqa: E402

import strategies  # noqa: E402

# Lightning advice that does not apply here: validation on a DistributedSampler (each rank validates its share,
# torchmetrics syncs the counts), fit() without validation data (we validate before and after), and a
# deprecation inside Lightning itself.
for _message in (".*DistributedSampler.*", ".*validation_step.*no `val_dataloader`.*", ".*LeafSpec.*"):
    warnings.filterwarnings("ignore", _message)

PAD = "\0"


class CharCorpus:
    """Generated review sentences, one per line, as a character-level token stream (vocab padded to 64)."""

    def __init__(self, n_sentences: int = 6000, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.text = "\n".join(sentence(rng, rng.randrange(len(LABELS))) for _ in range(n_sentences)) + "\n"
        chars = sorted(set(self.text))
        self.itos = [PAD, *chars] + [PAD] * (-(len(chars) + 1) % 64)  # a multiple of 64: splits evenly under TP
        self.stoi = {c: i for i, c in enumerate(self.itos) if i == 0 or c != PAD}
        self.ids = torch.tensor([self.stoi[c] for c in self.text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def decode(self, ids) -> str:
        return "".join(self.itos[i] for i in ids)

    def windows(self, seq_len: int, val_fraction: float = 0.1) -> tuple[TensorDataset, TensorDataset]:
        """Non-overlapping (input, next-token target) windows; the last ``val_fraction`` is validation."""
        n = (len(self.ids) - 1) // seq_len
        x = self.ids[: n * seq_len].view(n, seq_len)
        y = self.ids[1 : n * seq_len + 1].view(n, seq_len)
        cut = int(n * (1 - val_fraction))
        return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


class LitLlama(L.LightningModule):
    def __init__(self, vocab_size: int = 64, lr: float = 3e-3, max_steps: int = 100, **model_kwargs) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Llama(LlamaConfig(vocab_size=vocab_size, **model_kwargs))
        self.val_ppl = Perplexity()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_ppl.update(logits.float(), y)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def predict_step(self, batch, batch_idx):
        """Greedy continuation of each prompt (all ranks run it: the forward needs every rank's shards).

        With TP > 1 the strategy runs this model sequence-parallel, which needs a sequence length divisible by
        the TP size: each window is left-filled with ``fill_id`` (a newline, as the prompts are filled).
        """
        (idx,) = batch
        multiple = self.trainer.strategy.device_mesh.size("tensor_parallel")
        keep = self.model.cfg.max_len // multiple * multiple
        for _ in range(self.sample_len):
            window = idx[:, -keep:]
            window = F.pad(window, (-window.size(1) % multiple, 0), value=self.fill_id)
            nxt = self(window)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    sample_len = 40
    fill_id = 0  # main() sets the newline's id

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1, betas=(0.9, 0.95))
        total = max(1, self.hparams.max_steps)
        warmup = max(1, total // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / total)
        )  # linear warm-up, then linear decay to 10%
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintSummary(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        rank_zero_info(parallel_summary(trainer, pl_module))

    def on_train_start(self, trainer, pl_module):  # after a checkpoint given to fit(ckpt_path=...) is restored
        self.t0, self.step0 = time.perf_counter(), trainer.global_step
        if self.step0:
            rank_zero_info(f"resumed at step {self.step0}")

    def on_train_end(self, trainer, pl_module):
        steps = trainer.global_step - self.step0
        if steps:
            rank_zero_info(f"training: {steps} steps, {(time.perf_counter() - self.t0) / steps:.2f} s per step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=int, default=4, help="processes (CPU) or GPUs; default 4")
    p.add_argument("--accelerator", default="auto", help="auto (GPUs when present), cpu or gpu")
    p.add_argument("--precision", default="32-true", help="e.g. 32-true, bf16-mixed (GPU), bf16-true")
    p.add_argument("--tensor-parallel-size", type=int, default=2, help="TP degree; data-parallel = devices / TP")
    p.add_argument("--seq-len", type=int, default=64, help="characters per training window")
    p.add_argument("--batch-size", type=int, default=8, help="windows per data-parallel rank per step")
    p.add_argument("--dim", type=int, default=128, help="model width (layers: --layers)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sentences", type=int, default=6000, help="generated sentences in the corpus")
    p.add_argument("--max-steps", type=int, default=60, help="total optimizer steps (also when resuming)")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save-every", type=int, default=0, help="ModelCheckpoint every N steps (0: at the end only)")
    p.add_argument("--resume", default=None, help="checkpoint to resume from (sharded directory or full file)")
    p.add_argument("--out-dir", default="runs/finetune_llm", help="checkpoints go here")
    p.add_argument("--sample", action=argparse.BooleanOptionalAction, default=True, help="generate a sample")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the job; returns (on every rank) the metrics, steps and checkpoint path, for tests."""
    args = parse_args(argv)
    start = time.perf_counter()
    L.seed_everything(args.seed, verbose=False)
    corpus = CharCorpus(args.sentences, args.seed)
    train, val = corpus.windows(args.seq_len)
    model = LitLlama(
        vocab_size=corpus.vocab_size,
        lr=args.lr,
        max_steps=args.max_steps,
        dim=args.dim,
        n_layers=args.layers,
        hidden=(8 * args.dim // 3 + 31) // 32 * 32,
        max_len=max(256, args.seq_len),
    )
    model.fill_id = corpus.stoi["\n"]
    out = Path(args.out_dir)
    callbacks: list[L.Callback] = [PrintSummary()]
    if args.save_every:
        callbacks.append(
            ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=args.save_every, save_top_k=-1)
        )
    trainer = L.Trainer(
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=args.tensor_parallel_size),
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=args.val_batches,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(args.save_every),
        enable_model_summary=False,
        callbacks=callbacks,
    )
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=args.batch_size)
    trainer.fit(model, train_loader, ckpt_path=args.resume)
    result = {
        "steps": trainer.global_step,
        "start_step": callbacks[0].step0,
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "tp_plan": trainer.strategy.parallel_summary.get("tp_plan"),
    }
    result["val_ppl"] = trainer.validate(model, val_loader, verbose=False)[0]["val_ppl"]
    rank_zero_info(
        f"step {trainer.global_step}: train loss {result['train_loss']:.3f}, validation perplexity "
        f"{result['val_ppl']:.2f} (uniform over {corpus.vocab_size} symbols: {corpus.vocab_size})"
    )
    ckpt = out / f"step={trainer.global_step}.ckpt"
    if not ckpt.exists():
        trainer.save_checkpoint(ckpt, weights_only=False)  # with the optimizer state, to resume from
    result["checkpoint"] = str(ckpt)
    rank_zero_info(f"checkpoint: {ckpt} (resume with --resume {ckpt} --max-steps {2 * trainer.global_step})")
    if args.sample:
        prompts = ["The coffee was", "Did anyone try", "I would not", "The laptop"]
        width = max(map(len, prompts))
        idx = torch.tensor([[corpus.stoi[c] for c in p.rjust(width, "\n")] for p in prompts])
        out_ids = trainer.predict(model, DataLoader(TensorDataset(idx), batch_size=len(prompts)))[0]
        result["samples"] = [corpus.decode(row).lstrip("\n").split("\n")[0] for row in out_ids.tolist()]
        for text in result["samples"]:
            rank_zero_info(f"sample: {text!r}")
    rank_zero_info(f"done in {time.perf_counter() - start:.0f} s")
    return result


if __name__ == "__main__":
    main()
