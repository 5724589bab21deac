"""The replicate fallback is exact or raises; in-place views update shape, strides and placements; the
fallback policy (warn / error) and fallback_counts(); the errors torch's op database found.

Every value is compared with the plain op on the same data."""

import warnings

import pytest
import torch

from lightning_shard import init_device_mesh
from lightning_shard.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    fallback_policy,
    get_fallback_policy,
    reset_fallback_counts,
)
from tests.harness import distributed


def _data(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _check(got, want):
    assert isinstance(got, DTensor)
    full = got.full_tensor()
    assert full.shape == want.shape and full.dtype == want.dtype, (full.shape, want.shape, full.dtype, want.dtype)
    torch.testing.assert_close(full.resolve_conj(), want.resolve_conj())


@distributed(world_size=2)
def test_inplace_views_update_shape_stride_and_placements():
    mesh = init_device_mesh("cpu", (2,))
    x = _data(1, 6)
    d = distribute_tensor(x, mesh, [Shard(1)])
    assert d.squeeze_(0) is d
    assert d.shape == (6,) and d.stride() == (1,) and d.placements == (Shard(0),)
    _check(d, x.squeeze(0))
    assert d.to_local().shape == (3,)

    y = _data(4, 6, seed=1)
    for name, fn in [
        ("unsqueeze_", lambda t: t.unsqueeze_(1)),
        ("t_", lambda t: t.t_()),
        ("transpose_", lambda t: t.transpose_(0, 1)),
        ("swapdims_", lambda t: t.swapdims_(1, 0)),
        ("squeeze_", lambda t: t.unsqueeze_(0).squeeze_()),
    ]:
        for placement in (Shard(0), Shard(1), Replicate()):
            want = fn(y.clone())
            d = distribute_tensor(y, mesh, [placement])
            base_local = d.to_local()
            out = fn(d)
            assert out is d, name
            assert d.shape == want.shape and d.stride() == want.stride(), (name, placement, d.shape, d.stride())
            _check(d, want)
            # still a view of the same shard: writing through it is seen by an earlier alias of the shard
            assert d.to_local().untyped_storage().data_ptr() == base_local.untyped_storage().data_ptr()


@distributed(world_size=2)
def test_matmul_vector_matrix_has_the_plain_shape():
    mesh = init_device_mesh("cpu", (2,))
    v, m = _data(6), _data(6, 4, seed=1)
    for pv, pm in [(Shard(0), Shard(0)), (Replicate(), Shard(1)), (Shard(0), Replicate()), (Replicate(), Replicate())]:
        _check(torch.matmul(distribute_tensor(v, mesh, [pv]), distribute_tensor(m, mesh, [pm])), v @ m)
        _check(torch.matmul(distribute_tensor(m.t(), mesh, [pm]), distribute_tensor(v, mesh, [pv])), m.t() @ v)


@distributed(world_size=2)
def test_inplace_view_that_needs_redistribution_raises_naming_the_op():
    mesh = init_device_mesh("cpu", (2,))
    d = distribute_tensor(_data(1, 6), mesh, [Shard(0)])  # the squeezed dim is the sharded one
    with pytest.raises(RuntimeError, match="squeeze_"):
        d.squeeze_(0)
    with pytest.raises(RuntimeError, match="as_strided_"):
        d.as_strided_((6,), (1,))


@distributed(world_size=2)
def test_conjugate_and_negative_bits_survive():
    mesh = init_device_mesh("cpu", (2,))
    c = _data(4, 6, dtype=torch.complex64)
    for p in (Shard(0), Replicate()):
        d = distribute_tensor(c, mesh, [p])
        assert torch.conj(d).is_conj()
        _check(torch.conj(d) * 2, c.conj() * 2)
        _check(torch.fft.hfftn(d), torch.fft.hfftn(c))
        _check(torch.conj(d).redistribute(mesh, [Replicate()]), c.conj())
        _check(torch.neg(torch.conj(d)) + 1, -c.conj() + 1)


@distributed(world_size=2)
def test_stft_and_fallback_outputs_match_plain():
    mesh = init_device_mesh("cpu", (2,))
    x = _data(2, 40)
    win = torch.hann_window(8)
    want = torch.stft(x, 8, window=win, return_complex=True)
    for p in (Shard(0), Replicate()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.stft(
                distribute_tensor(x, mesh, [p]),
                8,
                window=distribute_tensor(win, mesh, [Replicate()]),
                return_complex=True,
            )
        _check(got, want)


@distributed(world_size=2)
def test_errors_found_by_the_op_database():
    mesh = init_device_mesh("cpu", (2,))
    x = _data(4, 6)
    for p in (Shard(0), Shard(1), Replicate()):
        d = distribute_tensor(x, mesh, [p])
        _check(torch.softmax(d, -1, dtype=torch.float64), torch.softmax(x, -1, dtype=torch.float64))
        _check(torch.log_softmax(d, 0, dtype=torch.float64), torch.log_softmax(x, 0, dtype=torch.float64))
        _check(d.to("cpu", torch.float64, copy=True), x.to(torch.float64))
        mant, expo = torch.frexp(d)
        _check(mant, torch.frexp(x)[0])
        _check(expo, torch.frexp(x)[1])
        one = torch.tensor([2.5])  # a one-element plain tensor is a scalar-like operand, as torch's DTensor takes it
        _check(d * one, x * one)
        _check(torch.where(d > 0, d, one), torch.where(x > 0, x, one))
    with pytest.raises(RuntimeError, match=r"aten.add.Tensor: got a plain torch.Tensor of shape \(2,\)"):
        distribute_tensor(x, mesh, [Shard(0)]) + torch.ones(2)


@distributed(world_size=2)
def test_op_without_meta_kernel_runs_through_the_fallback():
    mesh = init_device_mesh("cpu", (2,))
    x = _data(5, 3)
    # aten._local_scalar_dense / item and nonzero's data-dependent output have no meta kernel for a shape
    d = distribute_tensor(x, mesh, [Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _check(torch.nonzero(d > 0), torch.nonzero(x > 0))
        assert d.sum().item() == pytest.approx(x.sum().item(), rel=1e-5)


@distributed(world_size=2)
def test_inplace_fallback_writes_back_and_refuses_shape_changes():
    mesh = init_device_mesh("cpu", (2,))
    x = _data(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in (Shard(0), Shard(1), Partial(), Replicate()):
            d = (
                distribute_tensor(x, mesh, [Replicate()]).redistribute(mesh, [p])
                if p != Partial()
                else (DTensor.from_local(x / 2, mesh, [Partial()]))
            )
            d.cumsum_(0)  # no sharding rule on the scanned dim
            assert d.placements == (p,)
            _check(d, x.cumsum(0))
        d = distribute_tensor(x, mesh, [Shard(0)])
        with pytest.raises(RuntimeError, match="resize_"):
            d.resize_(3, 8)
        out = distribute_tensor(torch.empty(6, 4), mesh, [Shard(0)])
        with pytest.raises(RuntimeError, match="plain torch.Tensor"):
            torch.cumsum(d, 1, out=torch.empty(6, 4))
        torch.cumsum(d, 0, out=out)
        _check(out, x.cumsum(0))


@distributed(world_size=2)
def test_fallback_policy_and_counts():
    mesh = init_device_mesh("cpu", (2,))
    x = _data(6, 4)
    d = distribute_tensor(x, mesh, [Shard(0)])
    assert get_fallback_policy() == "warn"
    reset_fallback_counts()
    with fallback_policy("error"):
        assert get_fallback_policy() == "error"
        _check(d * 2 + 1, x * 2 + 1)  # sharding rules: no fallback, no error
        with pytest.raises(RuntimeError, match=r"aten.renorm.default .*fallback policy is 'error'"):
            torch.renorm(d, 2, 0, 1.0)
    assert get_fallback_policy() == "warn"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = torch.renorm(d, 2, 0, 1.0)
        torch.renorm(d, 2, 0, 1.0)
    _check(out, torch.renorm(x, 2, 0, 1.0))
    assert fallback_counts() == {"aten.renorm.default": 3}
    assert sum("aten.renorm.default" in str(w.message) for w in seen) <= 1  # once per op and process
    fallback_policy("error")  # the setter form: takes effect without a with-block
    try:
        with pytest.raises(RuntimeError, match="renorm"):
            torch.renorm(d, 2, 0, 1.0)
    finally:
        fallback_policy("warn")
    with pytest.raises(ValueError, match="'raise'"):
        fallback_policy("raise")
