"""scripts/check-site.py, which `make test` runs on the built site, catches what the renderer left raw."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _check_site() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_site", ROOT / "scripts" / "check-site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_raw_role_fails() -> None:
    problems = _check_site().check_page("<p>Raises :class:<code>InvalidArgument</code> on bad input.</p>")
    assert problems and "raw role" in problems[0]


def test_an_unresolved_reference_fails() -> None:
    check = _check_site().check_page
    assert check('<p>See [<code>KVSender.sned_kv</code>][aiotransfer.KVSender.sned_kv].</p>')
    assert check("<p>leftover <autoref identifier='x'>x</autoref></p>")


def test_code_and_links_pass() -> None:
    page = (
        '<p>See <a class="autorefs autorefs-internal" href="#aiotransfer.KVSender.send_kv"><code>send_kv</code></a>'
        ' and <code>stats()["latency"]["loop_lag"]</code>.</p>'
        "<pre><code>:class:`X` in a code block is an example, not a role</code></pre>"
    )
    assert _check_site().check_page(page) == []
