"""save_hf_pretrained: a sharded Hugging Face model written so that from_pretrained loads it bit-exactly."""

import json
import os
import weakref

import lightning as L
import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import strategies  # noqa: F401 - registers "shard_fsdp_tp"
from lightning_shard.checkpoint import get_model_state_dict, huggingface, save_hf_pretrained
from tests.harness import distributed
from tests.hf_models import FAMILIES, OWN_FAMILIES, build, lit_hf


def _saved_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open is not iterable
    return out


def _loader(family: str):
    import transformers

    kind = FAMILIES[family][1]
    return {
        "causal": transformers.AutoModelForCausalLM,
        "masked": transformers.AutoModelForMaskedLM,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[kind]


# ---------------------------------------------------------------------------------------------- one process
# Families whose transformers checkpoint layout differs from their modules (fused or stacked experts, fused
# qkv): save_hf_pretrained refuses them with the recipe that works (gather on rank 0, transformers saves).
CONVERTED_ON_SAVE = {
    *("gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "afmoe"),
    # further decoder families: fused 3-D experts (and Qwen3-Next's, MiniMax's, GraniteMoE's other conversions)
    *("olmoe", "granitemoe", "granitemoeshared", "granitemoehybrid", "deepseek_v2", "longcat_flash", "glm4_moe"),
    *("ernie4_5_moe", "hunyuan_v1_moe", "dots1", "lfm2_moe", "phimoe", "qwen3_next", "minimax"),
}


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_same_tensors_and_names_as_transformers_save_pretrained(family, tmp_path):
    model = build(family)
    model.save_pretrained(tmp_path / "hf")  # the oracle: transformers' own writer
    if family in CONVERTED_ON_SAVE:
        with pytest.raises(NotImplementedError, match="weight conversions.*model.save_pretrained"):
            save_hf_pretrained(model, tmp_path / "ours")
        assert not (tmp_path / "ours").exists()
        return
    save_hf_pretrained(model, tmp_path / "ours")
    theirs, ours = _saved_tensors(tmp_path / "hf"), _saved_tensors(tmp_path / "ours")
    assert ours.keys() == theirs.keys()  # each tied tensor once, under the name transformers keeps
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
    assert json.loads((tmp_path / "ours" / "config.json").read_text()) == json.loads(
        (tmp_path / "hf" / "config.json").read_text()
    )


def test_sharded_files_index_and_stale_files(tmp_path):
    model = build("llama")
    save_hf_pretrained(model, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["weight_map"].keys() == model.state_dict().keys()
    assert not (tmp_path / "model.safetensors").exists()
    loaded = _loader("llama").from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    save_hf_pretrained(model, tmp_path)  # one file now: the shards and the index of the first save go
    assert sorted(p for p in os.listdir(tmp_path) if "safetensors" in p) == ["model.safetensors"]


def test_failed_save_leaves_the_previous_save_as_it_was(tmp_path, monkeypatch):
    import errno

    model = build("llama")
    save_hf_pretrained(model, tmp_path, max_shard_size="40KB")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.config.update({"saved_by_the_second_save": True})  # config.json changes too
    real_write_file, calls = huggingface._write_file, []

    def disk_full_at_second_file(path, entries, write):
        calls.append(path)
        if len(calls) == 2:
            return OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_write_file(path, entries, write)

    monkeypatch.setattr(huggingface, "_write_file", disk_full_at_second_file)
    with pytest.raises(OSError, match="No space left"):
        save_hf_pretrained(model, tmp_path, max_shard_size="40KB")
    assert len(calls) > 2  # several files, the first one written before the failure
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing new, no temporaries
    loaded = _loader("llama").from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in previous.items())

    monkeypatch.setattr(huggingface, "_write_file", real_write_file)
    save_hf_pretrained(model, tmp_path, max_shard_size="40KB")  # the next save that succeeds is complete
    assert sorted(os.listdir(tmp_path)) == sorted(before)
    loaded = _loader("llama").from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert json.loads((tmp_path / "config.json").read_text())["saved_by_the_second_save"] is True


def test_one_full_tensor_alive_at_a_time(tmp_path, monkeypatch):
    model = build("gpt2")
    previous: list[weakref.ref] = []
    full = huggingface._full

    def recording(tensor):
        assert all(ref() is None for ref in previous), "the previous full tensor is still alive"
        out = full(tensor)
        previous.append(weakref.ref(out))
        return out

    monkeypatch.setattr(huggingface, "_full", recording)
    save_hf_pretrained(model, tmp_path)
    assert len(previous) == len(_saved_tensors(tmp_path))


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        save_hf_pretrained(build("gpt2"), "unused", max_shard_size="lots")


# ---------------------------------------------------------------------------------------------- 2 ranks
def _fit_and_save(family: str, directory: str, strategy="shard_fsdp_tp", **save_kwargs):
    module = lit_hf(family, save_dir=directory, **save_kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)  # on_train_end saves
    return module.model


@distributed(world_size=2)
def test_trained_under_fsdp_then_from_pretrained_is_bit_exact(tmp_path):
    # tmp_path differs per rank: rank 0's directory is the one written and read
    directory = [str(tmp_path)]
    dist.broadcast_object_list(directory, src=0)
    for family, kwargs in (("qwen2", {}), ("t5", {}), ("llama", {"max_shard_size": "50KB"})):
        path = os.path.join(directory[0], family)
        model = _fit_and_save(family, path, **kwargs)
        full = get_model_state_dict(model, full_state_dict=True)  # every rank: gathered after the save
        if dist.get_rank() == 0:
            before = build(family).state_dict()
            assert any(not torch.equal(full[k], before[k]) for k in before), "training changed nothing"
            loaded = _loader(family).from_pretrained(path)
            theirs = loaded.state_dict()
            assert theirs.keys() == full.keys()
            for key, value in full.items():
                assert theirs[key].dtype == value.dtype and torch.equal(theirs[key], value), (family, key)
        dist.barrier()
    if dist.get_rank() == 0:
        t5 = _loader("t5").from_pretrained(os.path.join(directory[0], "t5"))
        assert t5.lm_head.weight is t5.shared.weight  # written once, tied again by from_pretrained


@distributed(world_size=2)
def test_saved_from_tensor_parallel_is_bit_exact(tmp_path):
    directory = [str(tmp_path / "llama-tp")]
    dist.broadcast_object_list(directory, src=0)
    model = _fit_and_save("llama", directory[0], strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2))
    assert any(p.device_mesh.size(1) == 2 and p.placements[1].is_shard() for p in model.parameters())
    full = get_model_state_dict(model, full_state_dict=True)
    if dist.get_rank() == 0:
        theirs = _loader("llama").from_pretrained(directory[0]).state_dict()
        assert theirs.keys() == full.keys()
        assert all(torch.equal(theirs[k], v) for k, v in full.items())


@distributed(world_size=2)
def test_write_failure_is_raised_on_every_rank(tmp_path):
    target = [str(tmp_path / "a-file")]
    dist.broadcast_object_list(target, src=0)
    if dist.get_rank() == 0:
        open(target[0], "w").close()  # a file where the directory should go
    dist.barrier()
    model = build("gpt2")
    from lightning_shard.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    with pytest.raises((OSError, RuntimeError), match="rank 0 failed to write|File exists"):
        save_hf_pretrained(model, target[0])


@distributed(world_size=2)
def test_uneven_and_empty_shards_are_written_exactly(tmp_path):
    from torch import nn

    from lightning_shard.fsdp import fully_shard

    directory = [str(tmp_path)]
    dist.broadcast_object_list(directory, src=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 1))  # 7 rows: 4 + 3; bias (1,): 1 + 0
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fully_shard(model)
    save_hf_pretrained(model, directory[0])
    if dist.get_rank() == 0:
        ours = _saved_tensors(directory[0])
        assert ours.keys() == expected.keys()
        assert all(torch.equal(ours[k], expected[k]) for k in expected)
