"""The op-database harnesses of ``benchmarks/`` (``dtensor_opdb.py``, ``dtensor_opdb_grad.py``) for tests: loaded
as modules, and run through our DTensor alone on the calling rank's 2-rank mesh.

Example (inside a ``@distributed(world_size=2)`` test)::

    fwd = harness("dtensor_opdb")
    results = run_ours(["add"], lambda opinfo, lib: {fwd.op_key(opinfo): fwd.run_op(opinfo, "ours", lib, 3)})
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_shard import init_device_mesh

_BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def harness(name: str):
    """``benchmarks/<name>.py`` as a module (the gradient harness imports the forward one by that name too)."""
    if _BENCHMARKS not in sys.path:
        sys.path.insert(0, _BENCHMARKS)
    return importlib.import_module(name)


def run_ours(names: list[str] | None, one: Callable[[object, tuple], dict]) -> dict:
    """The results ``one(opinfo, library)`` gives for each OpInfo of ``names`` (None: all of op_db), merged; the
    library is our DTensor's entry of the harness's ``_libs`` on a 2-rank mesh."""
    fwd = harness("dtensor_opdb")
    mesh = init_device_mesh("cpu", (2,))
    lib = fwd._libs(mesh, mesh.to_torch())["ours"]
    results: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for opinfo in fwd.select_ops(names):
            results.update(one(opinfo, lib))
    # torch's op database imports torch.testing._internal.common_utils, which calls
    # torch.backends.disable_global_flags(); this worker is reused by later tests, where Lightning's
    # Trainer(deterministic=True) then failed setting torch.backends.cudnn.benchmark.
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True  # its module global
    return results
