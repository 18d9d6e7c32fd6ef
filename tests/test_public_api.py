"""The curated public surface, and the import boundaries of DESIGN.md §2."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import aiotransfer

PKG = pathlib.Path(aiotransfer.__file__).parent


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
        if not rel.startswith("control/"):
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
from aiotransfer.engines.registry import create_engine
assert 'mooncake' not in sys.modules and 'torch' not in sys.modules
try:
    create_engine(TransferConfig(engine='mooncake_tcp'))
except EngineUnavailable as exc:
    assert "pip install 'aiotransfer[mooncake-cpu]'" in str(exc), exc
    print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
