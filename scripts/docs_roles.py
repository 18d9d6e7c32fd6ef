"""A griffe extension for the API reference: Sphinx cross-reference roles become autorefs.

Docstrings are Google style with Markdown cross-references (``[KVSender][aiotransfer.KVSender]``).
Older docstrings still write Sphinx roles (``:class:`InvalidArgument```, ``:meth:`KVStream.send_layers```)
and reST's ``::`` before a literal block, which Markdown would print as they are. When the package is
loaded, this extension rewrites each role into an autorefs reference to the object the name resolves to
from the docstring's scope (it links where that object is documented in the site, and reads as code
where it is not: an internal helper, a standard-library name), and each ``::`` into a colon. mkdocs.yml
loads it; ``scripts/check-site.py`` fails the build on any role or reference left unrendered.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|attr|data|exc|obj|const):`(?P<target>[^`]+)`")
LITERAL = re.compile(r"(?m)(\S)::$|^\s*::$")
"""reST's literal-block marker ending a paragraph (``... like this::``); the indented block after it is
a Markdown code block as it is, so the marker becomes one colon (or goes, on a line of its own)."""

_PACKAGE = "aiotransfer"


class RolesToAutorefs(griffe.Extension):
    """Rewrite ``:role:`target``` in every docstring of the package into an optional autoref."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != _PACKAGE:
            return
        by_name: dict[str, list[str]] = {}
        objects = list(_walk(pkg))
        for obj in objects:
            by_name.setdefault(obj.name, []).append(obj.path)
        for obj in objects:
            if obj.docstring is not None and ":" in obj.docstring.value:
                text = ROLE.sub(lambda m, o=obj: _autoref(o, m, pkg, by_name), obj.docstring.value)
                obj.docstring.value = LITERAL.sub(lambda m: f"{m.group(1)}:" if m.group(1) else "", text)


def _walk(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


def _autoref(obj: griffe.Object, match: re.Match[str], pkg: griffe.Module, by_name: dict[str, list[str]]) -> str:
    text = match["target"]
    short = text.startswith("~")
    name = text.lstrip("~").lstrip(".")
    shown = name.rsplit(".", 1)[-1] if short else name
    path = _resolve(obj, name, pkg, by_name)
    if path is None:
        return f"`{shown}`"
    return f'<autoref identifier="{path}" optional>`{shown}`</autoref>'


def _resolve(obj: griffe.Object, name: str, pkg: griffe.Module, by_name: dict[str, list[str]]) -> str | None:
    """The full path ``name`` means in ``obj``'s docstring, or None (a name outside the package)."""
    if name.split(".", 1)[0] == _PACKAGE:
        return name
    first, _, rest = name.partition(".")
    scope = obj if obj.is_module or obj.is_class else obj.parent
    if scope is not None and obj.is_module and first in obj.members:  # a submodule named relatively
        return f"{obj.path}.{name}"
    for candidate in (scope, pkg):
        if candidate is None:
            continue
        try:
            head = candidate.resolve(first)
        except (griffe.NameResolutionError, ValueError, AttributeError):
            continue
        if head.split(".", 1)[0] == _PACKAGE:
            return f"{head}.{rest}" if rest else head
        return None  # imported from elsewhere (asyncio, zmq, ...)
    last = name.rsplit(".", 1)[-1]
    found = [p for p in by_name.get(last, []) if p.endswith(f".{name}")]
    return found[0] if len(found) == 1 else None
