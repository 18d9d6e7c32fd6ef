#!/usr/bin/env python3
"""Fail when the built documentation shows text the renderer did not understand.

Usage: ``python scripts/check-site.py [SITE_DIR]`` (default ``site``), after ``mkdocs build``.

It reads every HTML page, with code blocks, styles and scripts left out and inline code read as one word, and reports:

- a Sphinx role printed as text (``:class:`X```, ``:meth:``, ``:func:``, ``:mod:``, ``:attr:``, ``:data:``,
  ``:exc:``): a docstring the API reference did not translate;
- a cross-reference left unresolved (``[title][identifier]`` as text, or an ``<autoref>`` element that
  mkdocs-autorefs did not replace): a link to an object no page documents.

Exit status 0 when the site is clean, 1 with one line per finding otherwise.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

PRE = re.compile(r"<(pre|style|script)\b.*?</\1>", re.S | re.I)
CODE = re.compile(r"<code\b[^>]*>.*?</code>", re.S | re.I)
TAG = re.compile(r"<[^>]+>")
ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`?")
UNRESOLVED = re.compile(r"\[[^\[\]\n]{1,200}\]\[[^\[\]\n]{0,200}\]")
AUTOREF_TAG = re.compile(r"<autoref\b", re.I)


def check_page(text: str) -> list[str]:
    """What is wrong with one page's HTML, one line each."""
    problems: list[str] = []
    body = PRE.sub("", text)
    if AUTOREF_TAG.search(body):
        problems.append("an <autoref> element was left in the page")
    visible = html.unescape(TAG.sub("", CODE.sub("`code`", body)))
    for line in visible.splitlines():
        line = line.strip()
        if ROLE.search(line):
            problems.append(f"raw role: {line[:160]}")
        problems.extend(f"unresolved cross-reference: {m.group(0)}" for m in UNRESOLVED.finditer(line))
    return problems


def main(argv: list[str]) -> int:
    site = Path(argv[1] if len(argv) > 1 else "site")
    pages = sorted(site.rglob("*.html"))
    if not pages:
        print(f"check-site: no HTML pages under {site}/ (run mkdocs build first)", file=sys.stderr)
        return 1
    failures = 0
    for page in pages:
        for problem in check_page(page.read_text(encoding="utf-8")):
            print(f"{page.relative_to(site)}: {problem}", file=sys.stderr)
            failures += 1
    if failures:
        print(f"check-site: {failures} problem(s) in {site}/", file=sys.stderr)
        return 1
    print(f"check-site: {len(pages)} pages, no raw roles or unresolved cross-references")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
