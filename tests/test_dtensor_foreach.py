"""``_foreach_*`` ops on DTensors: one local foreach call when every element's tensors share a layout, and the
optimizers that use them (AdamW foreach=True) exact against the plain single-process optimizer."""

import torch

from lightning_shard import init_device_mesh
from lightning_shard.fsdp import fully_shard
from lightning_shard.tensor import Replicate, Shard, distribute_tensor, fallback_counts, reset_fallback_counts
from lightning_shard.tensor.ops import foreach as foreach_mod
from tests.fsdp_models import batches, loss_fn, make_model, step_both
from tests.harness import distributed

SHAPES = [(7, 5), (3,), (1, 4), (6, 2)]  # uneven rows; (1, 4) leaves rank 1 an empty shard


class _NoPerElement:
    """Make the element-by-element path raise, to prove a call took the one-foreach path."""

    def __enter__(self):
        self._saved = foreach_mod._element

        def refuse(*a, **k):
            raise AssertionError("the foreach op was split into one op per tensor")

        foreach_mod._element = refuse

    def __exit__(self, *exc):
        foreach_mod._element = self._saved


def _opt_run(foreach: bool, mesh=None, steps: int = 5):
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    if mesh is None:
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
    else:
        params = [torch.nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, foreach=foreach)
    for k in range(steps):
        for p, gr in zip(params, grads[k]):
            p.grad = gr.clone() if mesh is None else distribute_tensor(gr, mesh, [Shard(0)])
        opt.step()
    return [p.detach().full_tensor() if mesh is not None else p.detach() for p in params]


@distributed(world_size=2)
def test_adamw_foreach_matches_plain_single_process():
    mesh = init_device_mesh("cpu", (2,))
    reset_fallback_counts()
    for foreach in (True, False):
        ref = _opt_run(foreach)
        if foreach:
            with _NoPerElement():
                got = _opt_run(foreach, mesh)
        else:
            got = _opt_run(foreach, mesh)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert fallback_counts() == {}


@distributed(world_size=2)
def test_one_local_foreach_call_with_tensor_scalars_and_out_of_place_results():
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(1)
    a = [torch.randn(s, generator=g) for s in SHAPES]
    b = [torch.randn(s, generator=g).abs() + 0.5 for s in SHAPES]
    da = [distribute_tensor(x, mesh, [Shard(0)]) for x in a]
    db = [distribute_tensor(x, mesh, [Shard(0)]) for x in b]
    scalars = torch.tensor([0.5, -1.0, 2.0, 0.25])
    with _NoPerElement():
        torch._foreach_addcdiv_(da, db, db, scalars)  # a tensor of scalars: no .item() per element
        torch._foreach_addcdiv_(a, b, b, scalars)
        sq = torch._foreach_sqrt(db)
        half = torch._foreach_mul(da, torch.tensor(0.5))
    for x, y in zip(da, a):
        assert x.placements == (Shard(0),)
        torch.testing.assert_close(x.full_tensor(), y, rtol=0, atol=0)
    for x, y in zip(sq, torch._foreach_sqrt(b)):
        assert x.placements == (Shard(0),) and x.shape == y.shape
        torch.testing.assert_close(x.full_tensor(), y, rtol=0, atol=0)
    for x, y in zip(half, a):
        torch.testing.assert_close(x.full_tensor(), y * 0.5, rtol=0, atol=0)
    # layouts that differ between lists take the per-element path and stay exact
    dr = [distribute_tensor(x, mesh, [Replicate()]) for x in b]
    torch._foreach_add_(da, dr, alpha=2.0)
    torch._foreach_add_(a, b, alpha=2.0)
    for x, y in zip(da, a):
        assert x.placements == (Shard(0),)
        torch.testing.assert_close(x.full_tensor(), y)
    # a reduction (max) is never computed shard by shard
    for x, y in zip(torch._foreach_max(da), torch._foreach_max(a)):
        torch.testing.assert_close(x.full_tensor(), y)


@distributed(world_size=2)
def test_fully_sharded_gpt_adamw_foreach_matches_single_process():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    data = batches(3, 4)
    ref = make_model()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    rank = torch.distributed.get_rank()
    for x, y in data:
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        opt.zero_grad()
        loss_fn(model, x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        with _NoPerElement():
            opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


_FUSED = [
    (torch.optim.AdamW, {"weight_decay": 0.1}),
    (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    (torch.optim.Adagrad, {}),
]


def _fused_run(cls, kw: dict, mesh=None, grad_placements=None, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` fused steps of ``cls`` on SHAPES (FSDP-like Shard(0) parameters and a TP-like Replicate one)."""
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    placements = [[Shard(0)], [Shard(0)], [Replicate()], [Shard(0)]]
    grad_placements = grad_placements or placements
    if mesh is None:
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
    else:
        params = [torch.nn.Parameter(distribute_tensor(f, mesh, pl)) for f, pl in zip(fulls, placements)]
    opt = cls(params, lr=0.1, fused=True, **kw)
    for k in range(steps):
        for p, gr, pl in zip(params, grads[k], grad_placements):
            p.grad = gr.clone() if mesh is None else distribute_tensor(gr, mesh, pl)
        opt.step()
    return [p.detach().full_tensor() if mesh is not None else p.detach() for p in params]


@distributed(world_size=2)
def test_fused_optimizers_step_on_local_shards_exactly():
    """``fused=True`` Adam/AdamW/SGD/Adagrad: one local fused call (no gathered copy of the parameters and their
    state, which the replicate fallback made on every rank), equal to one process up to rounding: the CPU kernels
    compute a tensor's last partial vector without fused multiply-adds, and a shard ends elsewhere than the whole
    tensor (SGD: 1 ulp on one element)."""
    mesh = init_device_mesh("cpu", (2,))
    for cls, kw in _FUSED:
        reset_fallback_counts()
        got = _fused_run(cls, kw, mesh)
        assert fallback_counts() == {}, (cls.__name__, fallback_counts())
        for a, b in zip(got, _fused_run(cls, kw)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{cls.__name__} {tuple(a.shape)}")
    # a gradient laid out unlike its parameter: that parameter alone takes the fallback, still exact
    reset_fallback_counts()
    unlike = [[Shard(0)], [Replicate()], [Replicate()], [Shard(0)]]  # the second parameter is Shard(0)
    got = _fused_run(torch.optim.AdamW, {}, mesh, grad_placements=unlike)
    assert sum(fallback_counts().values()) == 3  # one per step
    for a, b in zip(got, _fused_run(torch.optim.AdamW, {})):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@distributed(world_size=2)
def test_fully_sharded_gpt_fused_adamw_matches_single_process():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    reset_fallback_counts()
    for x, y in batches(3, 4):
        step_both(ref, ref_opt, model, opt, x, y)
    assert fallback_counts() == {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


@distributed(world_size=2)
def test_optimizers_default_to_foreach_for_our_dtensor_where_torch_would(monkeypatch):
    """On CUDA torch's optimizers and ``clip_grad_norm_`` choose foreach for plain tensors and torch's DTensor;
    ours must be chosen too, or every parameter takes the per-tensor loop. CPU is not a foreach default device,
    so the test names it one."""
    import torch.optim.optimizer as optim_module
    from torch.utils._foreach_utils import _has_foreach_support

    mesh = init_device_mesh("cpu", (2,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    monkeypatch.setattr(optim_module, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    assert optim_module._default_to_fused_or_foreach([p], differentiable=False) == (False, True)
    assert _has_foreach_support([p], p.device)


_EVERY_OPTIMIZER = {
    "SGD": {"momentum": 0.9},
    "Adam": {"weight_decay": 0.1},
    "AdamW": {},
    "RAdam": {"weight_decay": 0.1},
    "NAdam": {"decoupled_weight_decay": True, "weight_decay": 0.1},
    "Adamax": {},
    "Adadelta": {},
    "Adagrad": {},
    "Adafactor": {},
    "RMSprop": {"momentum": 0.9},
    "ASGD": {},
    "Rprop": {},  # its per-tensor loop writes sign[sign.gt(0)] = etaplus: index_put_ with a mask
}


def _every_optimizer_run(name: str, foreach: bool, mesh=None, steps: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    # every rank builds the same tensors: no broadcast (src_data_rank=None), so the test is not a chain of tiny
    # collectives, slow on a loaded machine
    wrap = (
        (lambda t: t.clone())
        if mesh is None
        else (lambda t: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None))
    )
    params = [torch.nn.Parameter(wrap(f)) for f in fulls]
    opt = getattr(torch.optim, name)(params, lr=0.05, foreach=foreach, **_EVERY_OPTIMIZER[name])
    for k in range(steps):
        for p, gr in zip(params, grads[k]):
            p.grad = wrap(gr)
        opt.step()
    return [p.detach().full_tensor() if mesh is not None else p.detach() for p in params]


@distributed(world_size=2)
def test_every_torch_optimizer_steps_fsdp_shards_like_one_process():
    """Every optimizer of ``torch.optim`` (both implementations) on ``Shard(0)`` parameters, one with an empty
    shard: equal to one process, and never through the replicate fallback (which gathers the parameter)."""
    mesh = init_device_mesh("cpu", (2,))
    reset_fallback_counts()
    for name in _EVERY_OPTIMIZER:
        for foreach in (False, True):
            got = _every_optimizer_run(name, foreach, mesh)
            for a, b in zip(got, _every_optimizer_run(name, foreach)):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{name} foreach={foreach}")
    assert fallback_counts() == {}
