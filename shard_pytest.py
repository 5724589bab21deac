"""The pytest side of ``strategies.testing``: hooks, the ``RunIf`` marker and the ``shard_parity`` fixture.

This is the module the package's ``pytest11`` entry point (named ``strategies.testing``) loads into every
pytest run in an environment where the package is installed, so it imports nothing heavy: no torch, no
Lightning, no ``strategies`` package (whose import registers the strategy with Lightning and costs seconds).
Those load when a test uses them: ``RunIf(...)`` imports Lightning's ``_runif_reasons``, the fixture imports
``strategies.testing.run_parity``. Users import everything from ``strategies.testing``; this module is
its light half, kept outside the ``strategies`` package because importing ``strategies.testing`` runs
``strategies/__init__.py`` first.

Example::

    pytest tests/                        # loaded by the entry point once the package is installed
    pytest -p strategies.testing tests/  # the same plugin, named explicitly
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from strategies.testing import ParityResult

__all__ = ["RunIf", "shard_parity", "pytest_collection_modifyitems", "pytest_configure"]


def RunIf(**kwargs: Any) -> pytest.MarkDecorator:  # noqa: N802 - Lightning's name
    """Skip a test unless its requirements hold; Lightning's ``RunIf`` on Lightning's ``_runif_reasons``.

    Takes every keyword of ``lightning.pytorch.utilities.testing._runif._runif_reasons`` (``min_cuda_gpus``,
    ``min_torch``, ``max_torch``, ``bf16_cuda``, ``standalone``, ``skip_windows``, ``dynamo``, ...).
    ``standalone=True`` means the test must run alone in its own process (it starts its own process group);
    it runs only when ``PL_RUN_STANDALONE_TESTS=1``, as in Lightning's CI.

    Example::

        @RunIf(min_cuda_gpus=2, standalone=True)
        def test_two_gpus():
            ...
    """
    from lightning.pytorch.utilities.testing._runif import _runif_reasons

    reasons, marker_kwargs = _runif_reasons(**kwargs)
    # The extra kwargs (min_cuda_gpus=True, standalone=True) stay on the skipif marker: collection filters read them.
    return pytest.mark.skipif(condition=len(reasons) > 0, reason=f"Requires: [{' + '.join(reasons)}]", **marker_kwargs)


def _has_runif_kwarg(item: pytest.Item, kwarg: str) -> bool:
    return any(m.name == "skipif" and m.kwargs.get(kwarg) for m in item.iter_markers())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Lightning's conftest rule: ``PL_RUN_STANDALONE_TESTS=1`` keeps only standalone tests,
    ``PL_RUN_CUDA_TESTS=1`` only ``min_cuda_gpus`` tests (both set: standalone ones, CPU included)."""
    options = {"standalone": "PL_RUN_STANDALONE_TESTS", "min_cuda_gpus": "PL_RUN_CUDA_TESTS"}
    if os.getenv("PL_RUN_STANDALONE_TESTS", "0") == "1" and os.getenv("PL_RUN_CUDA_TESTS", "0") == "1":
        del options["min_cuda_gpus"]
    keep, deselected = list(items), []
    for kwarg, env_var in options.items():
        if os.getenv(env_var, "0") != "1":
            continue
        for item in list(keep):
            if not _has_runif_kwarg(item, kwarg):
                keep.remove(item)
                deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "shard_parity: compares a LightningModule under shard_fsdp_tp with one device")


@pytest.fixture
def shard_parity(tmp_path) -> Callable[..., ParityResult]:
    """``shard_parity(module_factory, world_size=2, max_steps=3, strategy_kwargs=None, trainer_kwargs=None,
    atol=1e-5, **kw) -> ParityResult``: see ``strategies.testing.run_parity``. Logs of every process stay
    under ``tmp_path``.

    Example::

        def test_sharding_is_exact(shard_parity):
            assert shard_parity(make_module, world_size=2, max_steps=3).max_diff < 1e-5
    """
    from strategies.testing import run_parity  # imports torch and Lightning: only when a test asks for it

    counter = iter(range(10**6))

    def call(module_factory: Callable, *args, **kwargs) -> ParityResult:
        out = tmp_path / f"shard_parity_{next(counter)}"
        out.mkdir()
        kwargs.setdefault("out_dir", str(out))
        return run_parity(module_factory, *args, **kwargs)

    return call
