"""The user-facing pytest plugin ``strategies.testing``: shard_parity on CPU ranks and the RunIf marker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from strategies.testing import ParityResult, RankInterleavedSampler, RunIf, _ReferenceOrderSampler, run_parity
from tests.lightning_models import LitGPT

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


def make_gpt() -> LitGPT:
    return LitGPT(lr=0.1)


class ScaledLossGPT(LitGPT):
    """Deliberately broken for data parallelism: the loss scale depends on the rank."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (1 + self.global_rank)


def make_broken_gpt() -> ScaledLossGPT:
    return ScaledLossGPT(lr=0.1)


def test_samplers_reproduce_the_global_batches():
    ranks = [list(RankInterleavedSampler(10, r, 2)) for r in range(2)]
    assert ranks == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert list(RankInterleavedSampler(7, 1, 3)) == [1, 4]  # equal counts: the tail (6) is dropped
    # micro-batches of 2: (step 0, rank 0), (step 0, rank 1), (step 1, rank 0), ...
    assert list(_ReferenceOrderSampler(10, 2, 2)) == [0, 2, 1, 3, 4, 6, 5, 7]


def test_runif_uses_lightnings_reasons():
    import torch

    mark = RunIf(min_cuda_gpus=2, standalone=True).mark
    assert mark.name == "skipif" and mark.kwargs["min_cuda_gpus"] and mark.kwargs["standalone"]
    if torch.cuda.device_count() < 2:
        assert mark.kwargs["condition"]
        assert "GPUs>=2" in mark.kwargs["reason"] and mark.kwargs["reason"].startswith("Requires: [")
    if os.environ.get("PL_RUN_STANDALONE_TESTS", "0") != "1":
        assert "Standalone execution" in mark.kwargs["reason"]
    assert not RunIf(min_torch="1.0").mark.kwargs["condition"]


def test_factory_must_be_importable():
    with pytest.raises(TypeError, match="module level"):
        run_parity(lambda: LitGPT())


@pytest.mark.slow  # ~60 s (a pytest run in new processes); the plugin's other tests run by default
def test_parity_and_broken_model_through_the_plugin(pytester):
    """``pytest -p strategies.testing``: the fixture passes for a correct model, fails for a rank-dependent
    loss, and RunIf skips GPU tests with Lightning's reason text."""
    pytester.makepyfile(
        test_user=textwrap.dedent(
            """
            import pytest
            from strategies.testing import RunIf
            from tests.test_testing_plugin import make_broken_gpt, make_gpt

            def test_correct(shard_parity):
                result = shard_parity(make_gpt, world_size=2, max_steps=3)
                assert result.max_diff < 1e-5 and result.steps == 3
                assert len(result.losses) == 3
                assert max(abs(a - b) for a, b in zip(result.losses, result.reference_losses)) < 1e-5

            def test_tensor_parallel(shard_parity):  # TP ranks share data: the reference accumulates 1 batch
                assert shard_parity(make_gpt, world_size=2, max_steps=2, strategy_kwargs={"tensor_parallel_size": 2}).ok

            def test_broken(shard_parity):
                with pytest.raises(AssertionError, match=r"parameters differ from the single-device run"):
                    shard_parity(make_broken_gpt, world_size=2, max_steps=2)

            @RunIf(min_cuda_gpus=2, standalone=True)
            def test_on_gpus():
                raise AssertionError("must not run without GPUs")
            """
        )
    )
    env_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    pytester._monkeypatch.setenv("PYTHONPATH", env_path)
    pytester._monkeypatch.delenv("PL_RUN_STANDALONE_TESTS", raising=False)
    result = pytester.runpytest_subprocess("-p", "strategies.testing", "-rs", "-p", "no:cacheprovider", timeout=600)
    outcomes = result.parseoutcomes()
    import torch

    if torch.cuda.device_count() < 2:
        assert outcomes.get("passed") == 3 and outcomes.get("skipped") == 1, result.stdout.str()
        result.stdout.fnmatch_lines(["*SKIPPED*Requires: [[]GPUs>=2 + Standalone execution[]]*"])
    else:
        assert outcomes.get("passed") == 3, result.stdout.str()


@pytest.mark.slow  # about 10 s (a pytest run in new processes); `./dev test -m slow` runs it
def test_standalone_env_keeps_only_standalone_tests(pytester):
    pytester.makepyfile(
        test_sel=textwrap.dedent(
            """
            from strategies.testing import RunIf

            @RunIf(standalone=True)
            def test_alone():
                pass

            def test_plain():
                pass
            """
        )
    )
    pytester._monkeypatch.setenv("PL_RUN_STANDALONE_TESTS", "1")
    pytester._monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-p", "strategies.testing")
    result.assert_outcomes(passed=1, deselected=1)


@pytest.mark.slow
def test_failing_rank_shows_its_traceback(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*RuntimeError: boom on rank 1"):
        run_parity(make_exploding_gpt, world_size=2, max_steps=2, out_dir=str(tmp_path))


class ExplodingGPT(LitGPT):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            raise RuntimeError("boom on rank 1")
        return super().training_step(batch, batch_idx)


def make_exploding_gpt() -> ExplodingGPT:
    return ExplodingGPT()


def test_parity_result_reports_worst_parameters():
    result = ParityResult({"a": 1e-7, "b": 3e-3, "c": 2e-4}, [1.0], [1.0], atol=1e-5, steps=1)
    assert not result.ok and result.worst(2) == [("b", 3e-3), ("c", 2e-4)]
    with pytest.raises(AssertionError, match=r"(?s)2 of 3 parameters.*b: 3\.000e-03.*c: 2\.000e-04"):
        result.assert_close()
    assert sys.modules["strategies.testing"].ParityResult is ParityResult


_HEAVY = ("torch", "lightning", "numba", "strategies", "lightning_shard")


def _pytest11_targets() -> dict[str, str]:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]["pytest11"]


def test_entry_point_imports_nothing_heavy():
    """The pytest11 entry point loads its module into every pytest run: it must not import torch/Lightning."""
    targets = _pytest11_targets()
    assert "strategies.testing" in targets  # the name users pass to -p / -p no:
    for name, target in targets.items():
        probe = f"import sys, {target}; print(sorted(m for m in {_HEAVY!r} if m in sys.modules))"
        proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "[]", f"entry point {name} = {target} imports {proc.stdout.strip()}"


def test_plugin_run_stays_light_until_used(pytester):
    """A pytest run with the plugin enabled and no test using it imports no torch; hooks and fixture are there."""
    pytester.makepyfile(
        test_light=textwrap.dedent(
            f"""
            import sys

            def test_nothing_heavy(pytestconfig):
                assert pytestconfig.pluginmanager.hasplugin("shard_pytest")
                assert sorted(m for m in {_HEAVY!r} if m in sys.modules) == []
            """
        )
    )
    pytester._monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester._monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # only the plugin under test
    result = pytester.runpytest_subprocess("-p", "shard_pytest", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    listing = pytester.runpytest_subprocess("-p", "shard_pytest", "-p", "no:cacheprovider", "--fixtures")
    listing.stdout.fnmatch_lines(["shard_parity*"])
