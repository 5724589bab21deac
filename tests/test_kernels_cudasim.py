"""The numba.cuda kernels, run on CPU under numba's CUDA simulator.

``NUMBA_ENABLE_CUDASIM`` must be set before numba is first imported, and other
test modules import numba normally, so the checks run in a fresh subprocess
(this file executed as a script). The simulator is slow: small shapes only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import warnings
    import torch
    from numba import config
    assert config.ENABLE_CUDASIM, "simulator not enabled"
    import numba_kernels as nk
    from numba_kernels import reference as ref
    from numba_kernels.testing import assert_bits_equal, check_against_reference

    warnings.simplefilter("ignore", RuntimeWarning)  # numpy scalars warn on x/0, inf-inf in the simulator
    n = check_against_reference("cuda", "cpu", world_sizes=(3,), seed=1, n_params=3, full=True)
    n += check_against_reference("cuda", "cpu", world_sizes=(1, 8), seed=2, n_params=3, full=False)
    # casts at the edges, through the simulator's copy of the conversion code
    x = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 6e-8, 65519.0, 65520.0, 1.0 + 2**-8,
                      1.0 + 3 * 2**-9, 2.0**-25, 3.4e38])
    layout = nk.GroupLayout([(x.numel(),)], 1)
    for dt in (torch.bfloat16, torch.float16):
        out = torch.empty(1, x.numel(), dtype=dt)
        nk.all_gather_copy_in(layout, x, out, 0, impl="cuda")
        assert_bits_equal(out[0], x.to(dt), f"f32->{dt}")
        back = torch.empty(x.numel())
        nk.post_reduce(layout, out[0], back, impl="cuda")
        assert_bits_equal(back, out[0].float(), f"{dt}->f32")
    print("OK", n)
    """
)


def test_cuda_kernels_under_simulator() -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        pytest.fail(f"simulator checks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    assert proc.stdout.strip().startswith("OK")
