"""The curated public surface, and the import boundaries: vendor packages only under engines/,
zmq only in the control plane, and ``import aiotransfer`` with no engine installed."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys

import aiotransfer

PKG = pathlib.Path(aiotransfer.__file__).parent

PUBLIC_MODULES = {
    "aiotransfer",
    "aiotransfer.errors",
    "aiotransfer.engines",
    "aiotransfer.testing",
    "aiotransfer.testing.pytest_plugin",
    "aiotransfer.integrations",
    "aiotransfer.integrations.vllm",
}
"""Every module a user may import. Anything else carries a leading underscore; a new public module is a
promise, made here on purpose."""


def test_all_names_resolve_and_are_unique() -> None:
    assert len(aiotransfer.__all__) == len(set(aiotransfer.__all__))
    for name in aiotransfer.__all__:
        assert getattr(aiotransfer, name) is not None, name
    public = {n for n in dir(aiotransfer) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(aiotransfer.__all__), public - set(aiotransfer.__all__)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_vendor_and_zmq_imports_stay_in_their_layers() -> None:
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        names = _imports(path)
        if not rel.startswith("engines/"):
            assert not names & {"mooncake", "nixl", "nixl_cu12", "nixl_cu13", "mori"}, rel
        if not rel.startswith("_control/"):
            assert "zmq" not in names, rel


def test_import_works_without_any_engine() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('mooncake', 'nixl', 'nixl_cu12', 'nixl_cu13', 'mori', 'torch'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import aiotransfer
from aiotransfer import TransferConfig, EngineUnavailable
from aiotransfer.engines import create_engine
assert 'mooncake' not in sys.modules and 'torch' not in sys.modules
assert 'aiotransfer.testing' not in sys.modules  # the test engine loads only when used
try:
    create_engine(TransferConfig(engine='mooncake_tcp'))
except EngineUnavailable as exc:
    assert "pip install 'aiotransfer[mooncake-cpu]'" in str(exc), exc
    print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _public_modules() -> list[str]:
    """Every module a user may import: no path part starts with an underscore (tools sit below, in _cli)."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts[1:]):
            continue
        out.append(".".join(parts))
    return out


def test_the_public_modules_are_exactly_the_promised_ones() -> None:
    """A module added without an underscore fails here: make it private, or add it to PUBLIC_MODULES and to
    docs/api.md."""
    assert set(_public_modules()) == PUBLIC_MODULES


def test_the_signature_types_are_exported() -> None:
    """The types of ``send_kv``'s ``indices`` and ``ready`` and of ``stats()`` are importable from the root,
    and a CUDA event stand-in satisfies ``DeviceWork``."""
    import typing

    import numpy as np

    for name in ("PageIndices", "SupportsArray", "DeviceWork", "ManagerStats", "LatencySummary"):
        assert name in aiotransfer.__all__, name

    class Event:
        def query(self) -> bool:
            return True

    assert isinstance(Event(), aiotransfer.DeviceWork)
    assert not isinstance(object(), aiotransfer.DeviceWork)
    assert np.ndarray in {typing.get_origin(a) or a for a in typing.get_args(aiotransfer.PageIndices)}
    keys = aiotransfer.ManagerStats.__required_keys__ | aiotransfer.ManagerStats.__optional_keys__
    assert {"senders_active", "in_flight", "latency", "failures_by_reason", "kv_bytes_sent",
            "dropped_invalid-aux", "rooms_sent_success"} <= keys
    assert {"senders_active", "latency", "control_dropped"} <= aiotransfer.ManagerStats.__required_keys__


def test_every_public_module_declares_what_it_exports() -> None:
    """As anyio's test_all_attributes: each public module has an ``__all__`` whose names exist, once each,
    and which lists every public class and function the module defines."""
    import importlib
    import inspect

    optional = {"aiotransfer.integrations.vllm"}  # imports vLLM, present only in the vLLM environment
    for name in _public_modules():
        if name in optional:
            continue
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{name} has no __all__"
        assert len(exported) == len(set(exported)), name
        for attr in exported:
            assert hasattr(module, attr), f"{name}.__all__ names {attr!r}, which does not exist"
        defined = {
            n for n, v in vars(module).items()
            if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__ == name
        }
        assert defined <= set(exported), f"{name} defines but does not export {sorted(defined - set(exported))}"


def test_the_test_engine_is_public_and_selected_by_name() -> None:
    """``aiotransfer.testing`` exports the fabric users steer and the engine ``engine="memory"`` creates."""
    import aiotransfer.testing as testing
    from aiotransfer.engines import available_engines, create_engine

    assert set(testing.__all__) == {"MemoryFabric", "Write", "WriteOutcome", "Page", "MemoryEngine", "current_fabric",
                                    "default_fabric"}
    assert "memory" in available_engines()
    with testing.MemoryFabric() as fabric:
        engine = create_engine(aiotransfer.TransferConfig(engine="memory"))
    assert isinstance(engine, testing.MemoryEngine) and engine.fabric is fabric
    engine.close()


def _module_imports(path: pathlib.Path, name: str) -> set[str]:
    """aiotransfer modules imported anywhere in the module: at module level, in TYPE_CHECKING blocks and in
    function bodies (a lazy import closes a circle as surely as an eager one, only later)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("aiotransfer"):
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("aiotransfer"))
    return out


def test_the_package_has_no_import_circle() -> None:
    modules = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {
        name: {m for m in _module_imports(path, name) if m in modules and m != name and not name.startswith(m + ".")}
        for name, path in modules.items()
    }
    for deps in graph.values():
        deps.discard("aiotransfer")  # ``from . import _x`` names a sibling; the root re-exports, it is no step
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(nxt):], nxt]))
            if nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)


def test_the_core_never_imports_the_tools() -> None:
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("_cli/") or rel == "__main__.py":
            continue
        imported = _module_imports(path, "aiotransfer." + rel[:-3].replace("/", "."))
        assert not any(m.startswith("aiotransfer._cli") for m in imported), rel


def _api_page_names() -> set[str]:
    """The root's names the API page documents: its ``::: aiotransfer.NAME`` entries and the members it lists
    of ``aiotransfer.errors`` (also exported from the root)."""
    import re

    text = (PKG.parent / "docs" / "api.md").read_text()
    names = set(re.findall(r"^::: aiotransfer\.([A-Za-z_]\w*)\s*$", text, re.M))
    errors = re.search(r"^::: aiotransfer\.errors\n(?:    .*\n)*?      members:\n((?:        - \w+\n)+)", text, re.M)
    assert errors is not None
    names |= set(re.findall(r"- (\w+)", errors.group(1)))
    return names - {"errors", "engines", "testing", "integrations"}


def test_the_api_page_documents_exactly_the_roots_exports() -> None:
    """As httpcore's test_exported_members: what ``aiotransfer`` exports is what the API page documents."""
    assert set(aiotransfer.__all__) == _api_page_names()


def test_every_export_names_the_root_as_its_module() -> None:
    """Reprs, tracebacks and pickles show ``aiotransfer.X``, where users import it from, never the private
    module it lives in."""
    import pickle

    for name in aiotransfer.__all__:
        obj = getattr(aiotransfer, name)
        if isinstance(obj, type) or inspect.isfunction(obj):
            assert obj.__module__ == "aiotransfer", name
    exc = pickle.loads(pickle.dumps(aiotransfer.TransferFailed("link down", room=3)))
    assert isinstance(exc, aiotransfer.TransferFailed) and exc.room == 3
    assert "aiotransfer.TransferFailed" in repr(aiotransfer.TransferFailed)
