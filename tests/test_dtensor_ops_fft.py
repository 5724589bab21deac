"""FFT rules (``_fft_r2c``/``_fft_c2c``/``_fft_c2r``, and ``_conj`` for hfft/ihfft): every ``torch.fft``
function on ``Shard(0)`` and ``Replicate`` inputs on 2 ranks equals the plain op, without the fallback; a shard
on a dim the FFT does not transform stays, one on a transformed dim is gathered."""

import torch

from lightning_shard import init_device_mesh
from lightning_shard.tensor import Replicate, Shard, distribute_tensor, fallback_policy
from tests.harness import distributed

fft = torch.fft


def _data(*shape, seed=0, complex_=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return torch.complex(x, torch.randn(*shape, generator=g)) if complex_ else x


CASES = [
    # (name, fn, complex input, output keeps Shard(0) when the input is Shard(0))
    ("fft", lambda x: fft.fft(x), True, True),
    ("ifft", lambda x: fft.ifft(x, n=8), True, True),
    ("rfft", lambda x: fft.rfft(x, norm="ortho"), False, True),
    ("irfft", lambda x: fft.irfft(x), True, True),
    ("hfft", lambda x: fft.hfft(x), True, True),
    ("ihfft", lambda x: fft.ihfft(x), False, True),
    ("fft2 of the last two dims", lambda x: fft.fft2(x), True, True),
    ("rfftn of the last two dims", lambda x: fft.rfftn(x, dim=(1, 2)), False, True),
    ("fft over the sharded dim", lambda x: fft.fft(x, dim=0), True, False),
    ("fftn of every dim", lambda x: fft.fftn(x), True, False),
    ("irfftn of every dim", lambda x: fft.irfftn(x), True, False),
    ("hfftn of the last two dims", lambda x: fft.hfftn(x, dim=(-2, -1)), True, True),
]


@distributed(world_size=2)
def test_fft_ops_match_plain_and_keep_batch_shards():
    mesh = init_device_mesh("cpu", (2,))
    for name, fn, is_complex, keeps in CASES:
        x = _data(5, 4, 6, complex_=is_complex)  # 5 rows: uneven shards (3 + 2)
        want = fn(x)
        for placement in (Shard(0), Replicate()):
            with fallback_policy("error"):
                got = fn(distribute_tensor(x, mesh, [placement]))
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-4, atol=1e-4, msg=name)
            expected = Shard(0) if placement == Shard(0) and keeps else Replicate()
            assert got.placements == (expected,), (name, placement, got.placements)


@distributed(world_size=2)
def test_fft_keeps_a_shard_off_the_transformed_dims():
    mesh = init_device_mesh("cpu", (2,))
    x = _data(4, 6, 8, complex_=True)
    with fallback_policy("error"):
        got = fft.fft(distribute_tensor(x, mesh, [Shard(1)]), dim=2)
    assert got.placements == (Shard(1),)
    torch.testing.assert_close(got.full_tensor(), fft.fft(x, dim=2), rtol=1e-4, atol=1e-4)
