"""Options every suite takes, so that each suite's ``add_arguments`` names only its own."""

from __future__ import annotations

import argparse

__all__ = ["common", "default_out", "engines"]


def default_out(name: str) -> str:
    """Where suite ``name`` writes its JSON unless told (``--out``)."""
    return f"bench-results/{name}.json"


def common(p: argparse.ArgumentParser, name: str, *, repeats: str | None = None, seed: bool = False,
           quick: str = "smaller sizes and fewer repeats") -> None:
    """``--out``, ``--log``, ``--quick`` and, when asked, ``--repeats`` (``repeats`` is its default's words)
    and ``--seed``."""
    p.add_argument("--out", default=None, metavar="JSON",
                   help=f"where the results go (default {default_out(name)})")
    p.add_argument("--log", default=None, metavar="PATH",
                   help="where the engines' and worker processes' own log lines go (default: --out with .log)")
    p.add_argument("--quick", action="store_true", help=quick)
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=None, help=f"timed repetitions ({repeats})")
    if seed:
        p.add_argument("--seed", type=int, default=0)


def engines(p: argparse.ArgumentParser, default: str) -> None:
    """``--engines``: engine configurations, comma-separated."""
    p.add_argument("--engines", default=None, help=f"engines, comma-separated (default {default})")
