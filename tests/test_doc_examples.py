"""The documentation's examples are current: every public name has a docstring with an example, the ``>>>``
examples run, and the code in README.md and docs/*.md names only what exists (docs/testing.md,
"Documentation examples").

* Public names are those in the ``__all__`` of ``lightning_shard``, its subpackages, ``lightning_shard.utils``,
  ``strategies`` and ``numba_kernels``. A class or function needs a docstring with an example (``>>>``, or an
  ``Example`` paragraph with code in it); a constant needs a comment on the line above its assignment (a value
  carries no docstring of its own).
* ``>>>`` examples in every module of the three packages run with :mod:`doctest` on the 1-rank gloo pool of
  ``tests/harness.py`` (``init_device_mesh("cpu", (1,))`` works there), ``torch`` imported. A line that needs more
  ranks, a GPU or a new process ends in ``# the reason  # doctest: +SKIP``.
* Examples that are not ``>>>`` (``Example::`` blocks and inline ``Example: ``...````), the ``python`` blocks of
  README.md and docs/*.md and the inline Python of their prose are checked statically: they parse, what they
  import from our packages exists, the attributes they take of our names exist, and the arguments they pass to
  our callables bind to the signatures. ``python -m`` modules, ``pytest -p`` plugins, scripts, backticked dotted
  names (```lightning_shard.tp.loss_parallel```) and ``tests/...py::name`` references must exist too.
* A docs python block with no free names runs as written, on the ranks it is written for (``SELF_CONTAINED_BLOCKS``).
* The README's Quick start commands are ``./dev`` subcommands, ``.ci/run`` runs ``./dev test``, and that runs
  ruff and the tests without ``slow``.
"""

from __future__ import annotations

import ast
import builtins
import doctest
import functools
import importlib
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch

from tests.harness import distributed, run_distributed

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_PACKAGES = (
    "lightning_shard",
    "lightning_shard.tensor",
    "lightning_shard.fsdp",
    "lightning_shard.tp",
    "lightning_shard.checkpoint",
    "lightning_shard.planner",
    "lightning_shard.simulate",
    "lightning_shard.utils",  # a module, but its clip_grad_norm_ is public API (DESIGN.md)
    "strategies",
    "numba_kernels",
)
OUR_TOP_LEVEL = ("lightning_shard", "strategies", "numba_kernels", "tests")
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


# ---------------------------------------------------------------------------------------------------------------
# (a) every public name has a docstring with an example


def _source_files() -> list[Path]:
    return sorted(
        path
        for package in ("lightning_shard", "strategies", "numba_kernels")
        for path in (ROOT / package).rglob("*.py")
    )


def _public_names() -> list[tuple[str, str, object]]:
    names = []
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        names += [(package, name, getattr(module, name)) for name in module.__all__]
    return names


def _has_example(doc: str) -> bool:
    """A ``>>>`` example, or an ``Example`` paragraph with code in it (``Example: see there.`` is none)."""
    return ">>>" in doc or bool(_docstring_examples(inspect.cleandoc(doc)))


def _constant_commented(name: str) -> bool:
    """A constant counts as documented when a comment sits on the line right above its assignment."""
    for path in _source_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(rf"{name}\s*(:[^=]*)?=", line) and i > 0 and lines[i - 1].lstrip().startswith("#"):
                return True
    return False


def _example_problem(name: str, obj: object) -> str | None:
    if not (inspect.isclass(obj) or callable(obj)):
        return None if _constant_commented(name) else "constant without a comment above its assignment"
    doc = obj.__doc__
    if not doc or not doc.strip():
        return "no docstring"
    return None if _has_example(doc) else "docstring without an example"


def test_every_public_name_has_a_docstring_with_an_example():
    offenders = [
        f"{package}.{name}: {problem}"
        for package, name, obj in _public_names()
        if (problem := _example_problem(name, obj)) is not None
    ]
    assert not offenders, "public names without a documented example:\n" + "\n".join(offenders)


# ---------------------------------------------------------------------------------------------------------------
# (b) the >>> examples run


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules_with_doctests() -> list[str]:
    # __main__ modules run a command line when imported
    return [_module_name(p) for p in _source_files() if p.name != "__main__.py" and ">>>" in p.read_text()]


def run_doctests(module_name: str) -> None:
    """Run one module's ``>>>`` examples (on a rank of the 1-rank pool) and fail with doctest's report."""
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    report: list[str] = []
    # Examples may use ``torch`` without importing it, as the docs' code does.
    for test in finder.find(module, module_name, extraglobs={"torch": torch}):
        runner.run(test, out=report.append)
    failed, attempted = runner.summarize(verbose=False)
    assert attempted, f"{module_name} has '>>>' in its source but doctest found no example"
    assert not failed, "".join(report)


@pytest.mark.parametrize("module_name", _modules_with_doctests())
@distributed(world_size=1)
def test_doctests_run(module_name):
    run_doctests(module_name)


# ---------------------------------------------------------------------------------------------------------------
# (c) examples that are not doctests, and the docs' code: they parse and name what exists


def _attribute(obj: object, attr: str) -> object:
    """``getattr``, except that an instance attribute a class declares (a dataclass field, an annotation)
    exists on the class too, with no value to go further into."""
    if inspect.isclass(obj) and not hasattr(obj, attr):
        declared = {name for cls in obj.__mro__ for name in getattr(cls, "__annotations__", {})}
        if attr in declared:
            return None
    return getattr(obj, attr)


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted`` and take the rest as attributes; raise if anything is
    missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if obj is None:  # a declared field: what lies below it is the value's, unknown here
                return None
            obj = _attribute(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _ours(dotted: str) -> bool:
    return dotted.split(".")[0] in OUR_TOP_LEVEL


def _imported_names(tree: ast.AST, known: dict[str, str]) -> list[str]:
    """Record ``local name -> dotted name`` for imports from our packages; return the imports that fail."""
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(a.asname or a.name.split(".")[0], a.name, a.asname is not None) for a in node.names]
            for local, dotted, aliased in pairs:
                if _ours(dotted):
                    known[local] = dotted if aliased else local
                    problems += _resolution_problem(dotted)
        elif isinstance(node, ast.ImportFrom) and node.module and _ours(node.module) and node.level == 0:
            for alias in node.names:
                known[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                problems += _resolution_problem(f"{node.module}.{alias.name}")
    return problems


def _resolution_problem(dotted: str) -> list[str]:
    try:
        _resolve(dotted)
    except (ImportError, AttributeError) as err:
        return [f"{dotted}: {type(err).__name__}: {err}"]
    return []


def _unbound_method(dotted: str) -> bool:
    """A plain function taken from a class by name (``Class.method``): its signature still has ``self``."""
    owner, _, attr = dotted.rpartition(".")
    try:
        owner_obj = _resolve(owner)
    except (ImportError, AttributeError):
        return False
    return inspect.isclass(owner_obj) and inspect.isfunction(inspect.getattr_static(owner_obj, attr, None))


def _call_problem(call: ast.Call, dotted: str) -> list[str]:
    """The call's arguments must bind to the signature: no unknown keyword, not too many positionals (missing
    ones are fine: examples elide)."""
    try:
        target = _resolve(dotted)
        signature = inspect.signature(target)
    except (TypeError, ValueError, ImportError, AttributeError):
        return []
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return []
    # ``f(x, ...)``: the ellipsis elides arguments, it is not one.
    args = [a for a in call.args if not (isinstance(a, ast.Constant) and a.value is Ellipsis)]
    positionals = [None] * (len(args) + (1 if _unbound_method(dotted) else 0))
    try:
        signature.bind_partial(*positionals, **{k.arg: None for k in call.keywords})
    except TypeError as err:
        return [f"{dotted}(...): {err}"]
    return []


def _reference_problems(tree: ast.AST, known: dict[str, str]) -> list[str]:
    """Attributes taken of our names and keywords passed to our callables must exist."""
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (dotted := _dotted(node)) is not None:
            head, _, rest = dotted.partition(".")
            if head in known:
                problems += _resolution_problem(f"{known[head]}.{rest}")
        elif isinstance(node, ast.Call) and (dotted := _dotted(node.func)) is not None:
            head, _, rest = dotted.partition(".")
            if head in known:
                problems += _call_problem(node, ".".join(filter(None, [known[head], rest])))
    return problems


_SHELL = re.compile(r"^\s*(\$ )?(python3?|torchrun|srun|pip|pytest|\./\w+)\b")


def check_shell(source: str) -> list[str]:
    """Problems of shell commands: a ``python -m`` module or a ``python`` script of ours that does not exist."""
    problems = []
    for module in re.findall(r"python3? -m ([\w.]+)", source):
        if _ours(module) and importlib.util.find_spec(module) is None:
            problems.append(f"python -m {module}: no such module")
    for module in re.findall(r"pytest -p ([\w.]+)", source):
        if _ours(module) and importlib.util.find_spec(module) is None:
            problems.append(f"pytest -p {module}: no such plugin module")
    for script in re.findall(r"python3? ((?:examples|benchmarks|tests)/[\w/]+\.py)", source):
        if not (ROOT / script).exists():
            problems.append(f"python {script}: no such file")
    return problems


def check_code(source: str, known: dict[str, str] | None = None) -> list[str]:
    """Problems of one example or code block: a syntax error, a missing name of ours, an unknown keyword."""
    if _SHELL.match(source.strip().splitlines()[0] if source.strip() else ""):
        return check_shell(source)
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError as err:
        return [f"does not parse: {err.msg} (line {err.lineno}): {source.strip()[:200]!r}"]
    bound = _bound_names(tree)
    known = {name: dotted for name, dotted in (known or {}).items() if name not in bound}
    problems = _imported_names(tree, known)
    return problems + _reference_problems(tree, known)


def _bound_names(tree: ast.AST) -> set[str]:
    """Names the code itself assigns (``plan = ...``, ``for mesh in ...``, a function's arguments), which then
    stand for its own values, not for a public name of ours of the same spelling."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound


@functools.cache
def _public_namespace() -> dict[str, str]:
    """The public names a docs block may use without importing them (an earlier block of the page did)."""
    return {name: f"{package}.{name}" for package, name, _ in _public_names()}


def _docstring_examples(doc: str) -> list[str]:
    """The non-doctest examples of a docstring: ``Example::`` literal blocks and ``Example: ``code````."""
    examples = []
    for match in re.finditer(r"Examples?\b[^\n]*?::\n((?:\s*\n|[ \t]+\S.*\n?)+)", doc + "\n"):
        block = textwrap.dedent(match.group(1))
        if ">>>" not in block:
            examples.append(block)
    for match in re.finditer(r"Examples?:[^:\n]*?``(.+?)``", doc, re.DOTALL):
        examples.append(" ".join(match.group(1).split()))
    return examples


def _dotted_name_of(module, name: str, value: object) -> str:
    if inspect.ismodule(value):
        return value.__name__
    if inspect.isclass(value) or inspect.isroutine(value):
        return f"{value.__module__}.{value.__qualname__}"
    return f"{module.__name__}.{name}"


def _module_namespace(module) -> dict[str, str]:
    """Names an example may use without importing them: our names in the globals of the module it is in."""
    known = {}
    for name, value in vars(module).items():
        dotted = _dotted_name_of(module, name, value)
        if not name.startswith("__") and _ours(dotted) and "<" not in dotted:
            known[name] = dotted
    return known


def _our_modules() -> list[str]:
    return [_module_name(path) for path in _source_files() if path.name != "__main__.py"]


def _docstrings(module) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the module and of every class, function and method defined in it."""
    found = [(module.__name__, module.__doc__ or "")]
    objects = [v for v in vars(module).values() if getattr(v, "__module__", None) == module.__name__]
    for obj in objects:
        members = vars(obj).values() if inspect.isclass(obj) else ()
        for member in [obj, *members]:
            member = inspect.unwrap(getattr(member, "__func__", member))
            if (inspect.isclass(member) or inspect.isroutine(member)) and member.__doc__:
                found.append((f"{module.__name__}.{getattr(member, '__qualname__', '?')}", member.__doc__))
    return found


def test_docstring_examples_name_what_exists():
    problems = []
    for module_name in _our_modules():
        module = importlib.import_module(module_name)
        known = {**_public_namespace(), **_module_namespace(module)}
        for where, doc in _docstrings(module):
            for example in _docstring_examples(inspect.cleandoc(doc)):
                problems += [f"{where}: {p}" for p in check_code(example, known)]
    assert not problems, "stale docstring examples:\n" + "\n".join(sorted(set(problems)))


def _inline_code_problems(text: str) -> list[str]:
    """Inline code in the prose that is Python (``ShardFSDPTPStrategy(timeout=...)``): the keywords it passes to
    our names exist. Spans that are not Python (a signature with ``*``, a path) are prose."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    problems = []
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose):
        try:
            tree = ast.parse(span)
        except SyntaxError:
            continue
        known = {k: v for k, v in _public_namespace().items() if k not in _bound_names(tree)}
        found = _imported_names(tree, known) + _reference_problems(tree, known)
        problems += [f"`{span}`: {p}" for p in found]
    return problems


def _code_block_problems(text: str) -> list[str]:
    """``python`` blocks are checked as Python; ``bash`` blocks, and unlabelled ones that start with a command,
    as shell; other unlabelled blocks (output, tables) are not code."""
    problems = []
    for language, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        if language == "python":
            problems += check_code(block, _public_namespace())
        elif language in ("bash", "sh", "shell") or (not language and _SHELL.match(block)):
            problems += check_shell(block)
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_code_blocks_parse_and_name_what_exists(doc):
    text = doc.read_text()
    problems = _code_block_problems(text) + check_shell(text) + _inline_code_problems(text)
    for dotted in sorted(set(re.findall(r"`((?:lightning_shard|strategies|numba_kernels)(?:\.\w+)+)", text))):
        problems += _resolution_problem(dotted)
    assert not problems, f"{doc.name}:\n" + "\n".join(problems)


def _test_reference_problem(path: str, name: str) -> list[str]:
    file = ROOT / path
    if not file.exists():
        return [f"{path}: no such file"]
    if name and not re.search(rf"^(?:def|class) {re.escape(name)}\b", file.read_text(), re.MULTILINE):
        return [f"{path}::{name}: no such test"]
    return []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_existing_test_files_and_tests(doc):
    # A "# tests/..." comment heads an example of the user's own test file, which need not exist here.
    references = set(re.findall(r"(?<!# )(tests/[\w/]+\.py)(?:::\s*(\w+))?", doc.read_text()))
    problems = [p for path, name in sorted(references) for p in _test_reference_problem(path, name)]
    assert not problems, f"{doc.name}:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------------------------
# (d) the docs' python blocks that need nothing from outside (no free names) run

# How each self-contained python block of the docs (doc name, index among its python blocks) runs: on that many
# ranks of the pool (0: in this process, without a process group), or why it does not run here.
SELF_CONTAINED_BLOCKS = {
    ("dtensor.md", 0): 2,
    ("gpu.md", 0): 0,
    ("mesh.md", 0): 4,
    ("huggingface.md", 0): "downloads a model and fine-tunes it through the Trainer",
    ("testing.md", 0): "defines a test with the harness, which tests/test_harness.py tests",
    ("testing_your_model.md", 0): "imports the user's own project",
    ("testing_your_model.md", 1): "defines tests for GPUs",
}


def _python_blocks(doc_name: str) -> list[str]:
    text = (ROOT / ("README.md" if doc_name == "README.md" else f"docs/{doc_name}")).read_text()
    return [block for language, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
            if language == "python"]  # fmt: skip


def _free_names(tree: ast.AST) -> set[str]:
    bound = _bound_names(tree) | set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def _self_contained(block: str) -> bool:
    try:
        return not _free_names(ast.parse(textwrap.dedent(block)))
    except SyntaxError:  # test_docs_code_blocks_parse_and_name_what_exists reports it
        return False


def test_every_self_contained_docs_block_says_how_it_runs():
    found = {
        (doc.name, index)
        for doc in DOCS
        for index, block in enumerate(_python_blocks(doc.name))
        if _self_contained(block)
    }
    assert found == set(SELF_CONTAINED_BLOCKS), "update SELF_CONTAINED_BLOCKS"


def run_docs_block(doc_name: str, index: int) -> None:
    """Execute one python block of the docs as a script would."""
    block = textwrap.dedent(_python_blocks(doc_name)[index])
    exec(compile(block, f"{doc_name} python block {index}", "exec"), {"__name__": "__docs__"})


def _block_param(key: tuple[str, int]):
    how = SELF_CONTAINED_BLOCKS[key]
    marks = [pytest.mark.skip(reason=how)] if isinstance(how, str) else []
    marks += [pytest.mark.slow] if how == 4 else []  # the 4-rank pool's start alone takes ~20 s
    return pytest.param(*key, marks=marks, id=f"{key[0]}-{key[1]}")


@pytest.mark.parametrize(("doc_name", "index"), [_block_param(key) for key in SELF_CONTAINED_BLOCKS])
def test_self_contained_docs_block_runs(doc_name, index):
    ranks = SELF_CONTAINED_BLOCKS[(doc_name, index)]
    if ranks:
        run_distributed(run_docs_block, ranks, doc_name, index)
    else:
        run_docs_block(doc_name, index)


def _dev_subcommands() -> set[str]:
    return set(re.findall(r"^\s*(\w+)\)", (ROOT / "dev").read_text(), re.MULTILINE))


def test_readme_quick_start_matches_dev_and_ci():
    readme = (ROOT / "README.md").read_text()
    quick_start = re.search(r"## Quick start\n+```bash\n(.*?)```", readme, re.DOTALL).group(1)
    commands = [line.split() for line in quick_start.strip().splitlines()]
    assert all(c[0] == "./dev" and c[1] in _dev_subcommands() for c in commands), commands
    assert [c[1] for c in commands] == ["demo", "test"]
    dev = (ROOT / "dev").read_text()
    demo = re.search(r"^\s*demo\).*$", dev, re.MULTILINE).group(0)
    assert "examples/finetune_classifier.py" in demo and "--devices 2" in demo  # "on 2 CPU processes"
    assert (ROOT / "examples/finetune_classifier.py").exists()
    test = re.search(r"^\s*test\).*$", dev, re.MULTILINE).group(0)
    assert "lint" in test and '-m "not slow"' in test  # "runs ruff and the test suite without the tests marked slow"
    assert "ruff check" in dev and "ruff format --check" in dev
    assert re.search(r"^\./dev test\s*$", (ROOT / ".ci/run").read_text(), re.MULTILINE)
    for subcommand in re.findall(r"`\./dev (\w+)", readme + (ROOT / "docs/testing.md").read_text()):
        assert subcommand in _dev_subcommands(), subcommand
    python = re.search(r"Python (3\.\d+) or newer", readme).group(1)  # "Both need only Python 3.11 or newer"
    assert f'requires-python = ">={python}"' in (ROOT / "pyproject.toml").read_text()
