"""Collectives per transformer block under the automatic TP plan (Megatron-style: one input redistribution
before each attention and MLP block), counted with ``lightning_shard.comm.count_collectives()`` over one
forward + backward, and compared with torch's ``parallelize_module`` on an equivalent plan (``CommDebugMode``).

Per-block counts are the difference between a 2-block and a 1-block model, so embeddings and the LM head
cancel out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_shard import comm, init_device_mesh
from lightning_shard.tensor import fallback_counts, reset_fallback_counts
from lightning_shard.tp import auto_tp_plan, loss_parallel, parallelize_module
from tests import tp_models
from tests.harness import distributed

VOCAB, B, T = 101, 2, 8

BUILDERS = {
    "llama": lambda n: tp_models.Llama(n_layers=n),
    "gpt2": lambda n: tp_models.GPT2(n_layer=n),
    "bert": lambda n: tp_models.Bert(layers=n),
}


def _step(model, lp=False):
    idx = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    with loss_parallel() if lp else _null():
        out = model(idx)
        tgt = idx if out.ndim == 3 else idx[:, 0] % out.shape[-1]
        loss = F.cross_entropy(out.flatten(0, -2), tgt.flatten())
        loss.backward()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _count(name, n_layers, tp_mesh, sp, lp=False):
    torch.manual_seed(0)
    model = BUILDERS[name](n_layers)
    parallelize_module(model, tp_mesh, auto_tp_plan(model, tp_mesh, sequence_parallel=sp, loss_parallel=lp))
    reset_fallback_counts()
    with comm.count_collectives() as counts:
        _step(model, lp)
    assert fallback_counts() == {}, fallback_counts()
    return counts.calls


def _per_block(name, tp_mesh, sp):
    two, one = _count(name, 2, tp_mesh, sp), _count(name, 1, tp_mesh, sp)
    return {k: two[k] - one[k] for k in set(two) | set(one) if two[k] != one[k]}, two


@distributed(world_size=2)
def test_megatron_collectives_per_block():
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    # Without sequence parallel: one all-reduce after attention and after the MLP in forward, one for each
    # block input gradient in backward (q/k/v and gate/up share one input redistribution).
    for name in ("llama", "bert"):
        per_block, _ = _per_block(name, tp_mesh, sp=False)
        assert per_block == {"all_reduce": 4}, (name, per_block)
    # GPT-2's fused qkv output is gathered (a column shard would mix q, k and v) and the attention runs
    # replicated: one all-gather of the qkv output in forward, one of the attention output's gradient in
    # backward (the output projection takes its columns of a replicated input).
    per_block, _ = _per_block("gpt2", tp_mesh, sp=False)
    assert per_block == {"all_reduce": 4, "all_gather": 2}, per_block
    # Sequence parallel: each all-reduce becomes an all-gather + reduce-scatter pair.
    for name in ("llama", "bert"):
        per_block, _ = _per_block(name, tp_mesh, sp=True)
        assert per_block == {"all_gather": 4, "reduce_scatter": 4}, (name, per_block)


@distributed(world_size=2)
def test_llama_collectives_equal_torch_parallelize_module():
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel as TC
    from torch.distributed.tensor.parallel import PrepareModuleInput as TP
    from torch.distributed.tensor.parallel import RowwiseParallel as TRow
    from torch.distributed.tensor.parallel import SequenceParallel as TSP
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    for sp in (False, True):
        ours = _count("llama", 2, tp_mesh, sp)
        # torchtitan's Llama plan; without sequence parallel its Shard(1) layouts become Replicate().
        seq = TS(1) if sp else TR()
        torch.manual_seed(0)
        model = tp_models.Llama(n_layers=2)
        plan = {
            "tok_embeddings": TRow(input_layouts=TR(), output_layouts=seq),
            "output": TC(input_layouts=seq, output_layouts=TR()),
        }
        if sp:
            plan["norm"] = TSP()
        for i, layer in enumerate(model.layers):
            layer.attention.n_heads //= 2
            layer.attention.n_kv_heads //= 2
            p = f"layers.{i}."
            plan |= {
                p + "attention": TP(input_layouts=(seq,), desired_input_layouts=(TR(),)),
                p + "attention.q_proj": TC(),
                p + "attention.k_proj": TC(),
                p + "attention.v_proj": TC(),
                p + "attention.o_proj": TRow(output_layouts=seq),
                p + "feed_forward": TP(input_layouts=(seq,), desired_input_layouts=(TR(),)),
                p + "feed_forward.gate_proj": TC(),
                p + "feed_forward.up_proj": TC(),
                p + "feed_forward.down_proj": TRow(output_layouts=seq),
            }
            if sp:
                plan |= {p + "attention_norm": TSP(), p + "ffn_norm": TSP()}
        torch_parallelize(model, tp_mesh.to_torch(), plan)
        with CommDebugMode() as debug:
            _step(model)
        theirs = {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}
        assert sum(ours.values()) == debug.get_total_counts(), (sp, dict(ours), theirs)
        if not sp:
            assert ours["all_reduce"] == theirs.get("all_reduce", 0), (dict(ours), theirs)


def _hf(family, n_layers):
    """A tiny Hugging Face model with its first ``n_layers`` blocks (the same weights for 1 and 2 blocks)."""
    from tests import hf_models

    model = hf_models.build(family)
    blocks = {"llama": "model.layers", "gpt2": "transformer.h", "bert": "bert.encoder.layer"}[family]
    parent, name = blocks.rsplit(".", 1)
    layers = model.get_submodule(blocks)
    setattr(model.get_submodule(parent), name, torch.nn.ModuleList(list(layers)[:n_layers]))
    return model


@distributed(world_size=2)
def test_megatron_collectives_per_block_hugging_face():
    pytest.importorskip("transformers")
    from tests import hf_models

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    expected = {"llama": {"all_reduce": 4}, "bert": {"all_reduce": 4}, "gpt2": {"all_reduce": 4, "all_gather": 2}}
    for family, want in expected.items():
        calls = []
        for n in (2, 1):
            model = _hf(family, n)
            parallelize_module(model, tp_mesh, auto_tp_plan(model, tp_mesh))
            with comm.count_collectives() as counts:
                hf_models.lm_loss(model, hf_models.token_batch()).backward()
            calls.append(counts.calls)
        two, one = calls
        per_block = {k: two[k] - one[k] for k in set(two) | set(one) if two[k] != one[k]}
        assert per_block == want, (family, per_block)
