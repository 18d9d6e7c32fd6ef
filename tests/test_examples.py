"""Every example runs: the scripts in examples/ exit 0, the notebook executes, and the code in the docs and
README compiles and imports only names that exist."""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))
DOCS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_examples_exist() -> None:
    assert {"async_scheduler.py", "router.py", "hybrid_model.py", "quickstart.py"} <= set(SCRIPTS)
    assert "explore_transfer.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_imports_only_public_modules(script: str) -> None:
    """What the examples show a user can write: no import reaches an underscore module."""
    tree = ast.parse((EXAMPLES / script).read_text())
    for node in ast.walk(tree):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            if name.startswith("aiotransfer"):
                assert not any(p.startswith("_") for p in name.split(".")), f"{script} imports {name}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_script_exits_0(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"{script} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    assert proc.stdout.strip(), f"{script} printed no summary"


@pytest.mark.timeout(180)
def test_the_quickstart_prints_what_its_page_shows() -> None:
    """docs/quickstart.md shows the whole output of examples/quickstart.py: the same lines on stdout (the
    address aside) and nothing on stderr, at the library's own log level."""
    page = (ROOT / "docs" / "quickstart.md").read_text()
    block = re.search(r"```console\n\$ \.venv/bin/python examples/quickstart\.py\n(.*?)```", page, re.S)
    assert block, "docs/quickstart.md shows a run of examples/quickstart.py"
    env = _env()
    del env["MC_LOG_LEVEL"]
    proc = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

    def lines(text: str) -> list[str]:
        return [re.sub(r"tcp://[\d.]+:\d+", "tcp://<address>", ln) for ln in text.splitlines()]

    assert lines(proc.stdout) == lines(block.group(1))
    assert proc.stderr == ""


_RERUN = "run `PYTHONPATH=. .venv/bin/python scripts/execute-notebook.py examples/{}` and commit the result"


def _output_kinds(cell: Any) -> list[str]:
    """What a code cell showed, by kind: ``stdout``, ``error``, or the MIME types of a result (stderr is
    the engines' logging, which comes or not with the timing of the kernel's capture)."""
    kinds: list[str] = []
    for out in cell["outputs"]:
        if out["output_type"] == "stream":
            kinds.extend([out["name"]] if out["name"] != "stderr" else [])
        elif out["output_type"] == "error":
            kinds.append("error")
        else:
            kinds.extend(sorted(out.get("data", {})))
    return kinds


# Volatile values in what a cell shows: addresses (ports differ run to run) and a manager's generation.
_VOLATILE = [(re.compile(r"\b\d+\.\d+\.\d+\.\d+:\d+\b"), "<host:port>"),
             (re.compile(r"'generation': \d+"), "'generation': <generation>")]
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _shown(cell: Any) -> list[tuple[str, str]]:
    """What a code cell showed, by kind and content: the text it printed to stdout or returned, with addresses
    and generations masked, and every number masked too in a cell tagged ``measured`` (timings, latencies:
    its figures differ run to run, its shape does not); a figure by its MIME type alone. stderr is left out:
    it is the engines' logging, which comes or not with the timing of the kernel's capture."""
    measured = "measured" in cell.get("metadata", {}).get("tags", [])

    def text(value: Any) -> str:
        value = "".join(value) if isinstance(value, list) else str(value)
        for pattern, mask in _VOLATILE:
            value = pattern.sub(mask, value)
        return _NUMBER.sub("#", value) if measured else value

    shown: list[tuple[str, str]] = []
    for out in cell["outputs"]:
        if out["output_type"] == "stream":
            shown.extend([(out["name"], text(out["text"]))] if out["name"] != "stderr" else [])
        elif out["output_type"] == "error":
            shown.append(("error", out["ename"]))
        else:
            data = out.get("data", {})
            shown.extend((kind, text(data[kind]) if kind == "text/plain" else "") for kind in sorted(data))
    return shown


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_shows_the_installed_version(notebook: str) -> None:
    """A notebook that shows ``aiotransfer.__version__`` shows this one: its outputs are of this release."""
    import aiotransfer

    nb = json.loads((EXAMPLES / notebook).read_text())
    shown = [_shown(cell) for cell in nb["cells"] if cell["cell_type"] == "code"
             and "".join(cell["source"]).rstrip().endswith("aiotransfer.__version__")]
    assert shown, f"{notebook} does not show aiotransfer.__version__"
    assert shown == [[("text/plain", repr(aiotransfer.__version__))]], _RERUN.format(notebook)


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_is_committed_with_its_outputs(notebook: str) -> None:
    """The docs show the committed outputs: they come from one run of the committed cells, top to bottom,
    without an error, and the notebook draws."""
    nb = json.loads((EXAMPLES / notebook).read_text())
    code = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    sources = ["".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"] for cell in code]
    digest = hashlib.sha256("\0".join(sources).encode()).hexdigest()
    assert nb["metadata"].get("executed_code_sha256") == digest, "code changed since the outputs were made: " + (
        _RERUN.format(notebook))
    assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1)), _RERUN.format(notebook)
    kinds = [kind for cell in code for kind in _output_kinds(cell)]
    assert "error" not in kinds, _RERUN.format(notebook)
    assert kinds.count("image/png") >= 2, "the notebook draws its measurements: " + _RERUN.format(notebook)


def _ensure_python3_kernel() -> None:
    """The ``python3`` kernel of this interpreter (ipykernel); registered into this venv if missing."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
                       check=True, capture_output=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_executes(notebook: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbclient  # in the `test` extra, like ipykernel
    import nbformat

    for key, value in _env().items():
        monkeypatch.setenv(key, value)  # the kernel inherits it
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's own paths (no deprecation warning)
    _ensure_python3_kernel()
    committed = nbformat.read(EXAMPLES / notebook, as_version=4)
    nb = nbformat.read(EXAMPLES / notebook, as_version=4)  # executed in memory: the file stays as committed
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=60, resources={"metadata": {"path": str(EXAMPLES)}},
    )
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    # The committed outputs are those of this code and this release: each cell shows the same text again
    # (the version, the states, the stats, the errors) and the same kinds of figure; only addresses and,
    # in a cell tagged `measured`, the measured numbers may differ.
    ran = [(c.source, _shown(c)) for c in nb.cells if c.cell_type == "code"]
    kept = [(c.source, _shown(c)) for c in committed.cells if c.cell_type == "code"]
    for (source, now), (_, then) in zip(ran, kept, strict=True):
        assert now == then, f"{_RERUN.format(notebook)}; the cell\n{source}\nnow shows {now}\nnot {then}"


# -- code in the docs ------------------------------------------------------------------------------

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)  # pymdownx.snippets include, relative to the repo root


def _snippets() -> list[Any]:
    out: list[Any] = []
    for path in DOCS:
        text = path.read_text()
        doc = path.relative_to(ROOT).as_posix()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 2
            out.append(pytest.param(doc, line, m.group(1), id=f"{doc}:{line}"))
    return out


# What Python 3.11 added that code written from the docs would reach for; the package supports 3.10.
_NEWER_THAN_310 = {"asyncio.timeout", "asyncio.timeout_at", "asyncio.Timeout", "asyncio.TaskGroup", "asyncio.Runner",
                   "ExceptionGroup", "BaseExceptionGroup"}


def _newer_than_310(tree: ast.AST) -> list[str]:
    """The names and syntax of Python 3.11 and later that ``tree`` uses."""
    found = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute | ast.Name)
             and ast.unparse(node) in _NEWER_THAN_310]
    return found + ["except*" for node in ast.walk(tree) if type(node).__name__ == "TryStar"]


def test_the_python_310_check_sees_what_311_added() -> None:
    code = "async with asyncio.timeout(1):\n    await x\ntry:\n    pass\nexcept* ValueError:\n    pass\n"
    tree = compile(code, "<doc>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    assert _newer_than_310(tree) == ["asyncio.timeout", "except*"]


@pytest.mark.parametrize(("doc", "line", "code"), _snippets())
def test_doc_snippet_compiles_and_imports_real_names(doc: str, line: int, code: str) -> None:
    """Python blocks in the docs parse (top-level ``await`` allowed), run on Python 3.10 (the oldest the
    package supports: no ``asyncio.timeout``), and every ``from aiotransfer... import`` names something that
    exists, so the docs cannot drift from the API unnoticed."""
    source = _SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text(), textwrap.dedent(code))
    if source.lstrip().startswith(">>>"):  # a REPL session: keep the input lines
        source = "\n".join(ln[4:] for ln in source.splitlines() if ln.startswith((">>> ", "... ")))
    try:
        tree = compile(source, f"{doc}:{line}", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        pytest.fail(f"{doc}, block at line {line}: {exc}")
    assert not _newer_than_310(tree), f"{doc}:{line}: needs Python 3.11: {_newer_than_310(tree)}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiotransfer"):
            assert not any(p.startswith("_") for p in (node.module or "").split(".")), (
                f"{doc}:{line}: the docs import from the public modules only, not {node.module}")
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{doc}:{line}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("aiotransfer"):
                    importlib.import_module(alias.name)
