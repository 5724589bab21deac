"""A small GPT-2 (tied embeddings, SDPA attention, MLP, LayerNorm, cross-entropy) trained on DTensor
parameters placed by the auto TP plan (row- and column-sharded and replicated): SGD with momentum +
clip_grad_norm_, and AdamW, equal to one device, with no op on the fallback."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_shard import init_device_mesh
from lightning_shard.tensor import DTensor, fallback_counts, reset_fallback_counts
from lightning_shard.tp import auto_tp_plan, parallelize_module
from lightning_shard.utils import clip_grad_norm_
from tests import tp_models
from tests.harness import distributed

VOCAB, B, T = 101, 2, 8


def _train(model, optimizer_factory, clip: float | None, steps: int = 3):
    opt = optimizer_factory(model.parameters())
    g = torch.Generator().manual_seed(7)
    norms = []
    for _ in range(steps):
        idx, tgt = torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)
        loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            clip_fn = (
                clip_grad_norm_
                if any(isinstance(p, DTensor) for p in model.parameters())
                else (torch.nn.utils.clip_grad_norm_)
            )
            norms.append(float(clip_fn(list(model.parameters()), clip)))
        opt.step()
    return norms


def _max_diff(model, ref):
    ours = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    theirs = dict(ref.named_parameters())
    return max((ours[n] - theirs[n].detach()).abs().max().item() for n in theirs)


@distributed(world_size=2)
def test_transformer_on_dtensor_params_trains_like_one_device():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    optimizers = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        # Adam normalises each element's step, so rounding-level gradients would move by a whole lr: a small
        # lr and an eps above rounding noise keep the comparison meaningful (the 2e-4 bound).
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6, weight_decay=0.1),
    }
    for name, make_opt in optimizers.items():
        torch.manual_seed(0)
        ref = tp_models.GPT2(vocab=VOCAB)
        model = copy.deepcopy(ref)
        parallelize_module(model, mesh, auto_tp_plan(model, mesh))
        assert any(p.placements[0].is_shard() for p in model.parameters())
        reset_fallback_counts()
        clip = 0.5 if name == "sgd" else None
        norms = _train(model, make_opt, clip)
        ref_norms = _train(ref, make_opt, clip)
        assert fallback_counts() == {}, fallback_counts()
        bound = 1e-5 if name == "sgd" else 2e-4
        assert _max_diff(model, ref) < bound, name
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) < 1e-5 * max(1.0, b)
    assert dist.get_world_size() == 2
