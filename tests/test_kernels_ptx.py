"""Every numba.cuda kernel compiles to PTX for sm_80 and sm_90 with a real libNVVM; no GPU needed.

libNVVM comes from the NVIDIA pip wheels of the ``numba-cuda[cu12]`` extra (in the ``test`` extra).
The compile runs in a fresh subprocess without ``NUMBA_ENABLE_CUDASIM``: numba reads that variable once,
at import, and the simulator compiles nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json
    from numba.cuda.dispatcher import CUDADispatcher
    from numba_kernels import cuda as kc

    kernels = sorted(
        name for name, obj in vars(kc).items()
        if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device")
    )
    ptx = {f"{cc[0]}{cc[1]}": kc.compile_ptx(cc) for cc in ((8, 0), (9, 0))}
    print(json.dumps({"kernels": kernels, "ptx": ptx}))
    """
)


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(
            "compiling the CUDA kernels to PTX failed (libNVVM comes from `pip install 'numba-cuda[cu12]'`):\n"
            + proc.stderr[-4000:]
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_has_a_launch_signature(compiled: dict) -> None:
    from numba_kernels.cuda import LAUNCH_SIGNATURES  # plain import: the table needs no compiler

    assert compiled["kernels"], "no cuda.jit kernel found in numba_kernels/cuda.py"
    assert compiled["kernels"] == sorted(LAUNCH_SIGNATURES)


@pytest.mark.parametrize("sm", ["80", "90"])
def test_kernels_compile_to_ptx(compiled: dict, sm: str) -> None:
    ptx = compiled["ptx"][sm]
    assert sorted(ptx) == compiled["kernels"]
    for name, text in ptx.items():
        assert re.search(rf"^\.target sm_{sm}\b", text, re.M), f"{name}: no .target sm_{sm}"
        entries = re.findall(r"^\.visible \.entry (\S+)\(", text, re.M)
        assert len(entries) == 1, f"{name}: expected one kernel entry, found {entries}"
        assert f"4cuda{len(name)}{name}" in entries[0], f"{name}: entry {entries[0][:80]} is not this kernel"
        assert "ld.global" in text and "st.global" in text, f"{name}: no global loads/stores in the PTX"
