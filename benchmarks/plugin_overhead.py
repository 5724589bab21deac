"""Wall time of a pytest run of one empty test, with and without the package's pytest plugin.

The ``pytest11`` entry point loads its target into every pytest run in an environment where the package is
installed, so its import cost is paid by every run, including runs of tests that never use it. This times
``python -m pytest -q test_empty.py`` in a fresh process per run, configurations interleaved:

* ``disabled``: no plugin;
* ``enabled``: the plugin this tree's ``pyproject.toml`` names as entry point (``-p <target>``);
* ``enabled@REF`` (with ``--ref REF``): the same for the tree of git revision REF (extracted with
  ``git archive`` into a temporary directory), to compare before and after a change in one run.

All runs set ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` and load the plugin explicitly, so the installed copy of
the package (whatever its version) and other installed plugins play no part: the differences are the
plugin's own cost.

    python benchmarks/plugin_overhead.py --repeats 5 --ref HEAD~1 --json runs/plugin_overhead.json

``--json`` writes ``{config: {"median_s": ..., "runs_s": [...]}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINT = "strategies.testing"


def entry_point_target(root: Path) -> str:
    """The module the ``pytest11`` entry point ``strategies.testing`` of ``root/pyproject.toml`` loads."""
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]["pytest11"][ENTRY_POINT]


def extract_ref(ref: str, into: Path) -> Path:
    """The tree of git revision ``ref`` of this repository, extracted under ``into``."""
    archive = into / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), ref], check=True)
    dest = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest


def time_run(test_dir: Path, pythonpath: Path | None, plugin: str | None) -> float:
    """Seconds of one ``python -m pytest`` process on the empty test; raises if the run fails."""
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_empty.py"]
    if plugin is not None:
        cmd[3:3] = ["-p", plugin]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=test_dir, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0 or "1 passed" not in proc.stdout:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ref", help="also time the plugin of this git revision (e.g. HEAD~1)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="plugin_overhead_") as tmp:
        tmp = Path(tmp)
        test_dir = tmp / "tests"
        test_dir.mkdir()
        (test_dir / "test_empty.py").write_text("def test_empty():\n    pass\n")
        configs: dict[str, tuple[Path | None, str | None]] = {
            "disabled": (None, None),
            "enabled": (ROOT, entry_point_target(ROOT)),
        }
        if args.ref:
            old = extract_ref(args.ref, tmp)
            configs[f"enabled@{args.ref}"] = (old, entry_point_target(old))
        runs: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.repeats):  # interleaved, so load changes on the machine hit every config alike
            for name, (path, plugin) in configs.items():
                runs[name].append(time_run(test_dir, path, plugin))
    result = {name: {"median_s": statistics.median(r), "runs_s": r} for name, r in runs.items()}
    for name, (_, plugin) in configs.items():
        r = result[name]
        print(f"{name:>22} ({plugin or '-'}): median {r['median_s']:.2f} s  runs {[round(x, 2) for x in r['runs_s']]}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
