"""``aiotransfer`` / ``python -m aiotransfer``: ``demo``, ``bench`` and ``doctor``.

The tools sit below the public face: they use ``from aiotransfer import ...`` and the pure modules
(:mod:`aiotransfer._staging`, :mod:`aiotransfer._plan`, :mod:`aiotransfer._lag`); the library never imports
them. One job per module:

* :mod:`~aiotransfer._cli.doctor`   -- what is installed, which transport Mooncake would use, the fix lines
* :mod:`~aiotransfer._cli.demo`     -- a prefill process moves a KV cache to a decode process, verified
* :mod:`~aiotransfer._cli.bench`    -- raw Mooncake against aiotransfer (figures (a)-(c))
* :mod:`~aiotransfer._cli.raw`      -- the raw-engine baselines (the only caller of ``engine.raw()``)
* :mod:`~aiotransfer._cli.workload` -- KV pool, request list, byte pattern, page allocator
* :mod:`~aiotransfer._cli.channel`  -- JSON lines between a tool and the child process it drives
* :mod:`~aiotransfer._cli.console`  -- tables within 100 columns, progress, engine logs kept apart
* :mod:`~aiotransfer._cli.files`    -- atomic JSON files

The benchmark suites, the SGLang and vLLM harnesses and their stubs are not part of the package: they live
in the repository's ``benchmarks/`` folder (``python -m benchmarks SUITE`` from a checkout) and build on
``channel``, ``raw``, ``workload``, ``console`` and ``files`` above.

Subcommand modules are imported when the parser is built, not with this package: ``python -m
aiotransfer._cli.demo`` (a demo child) finds its own module not yet imported.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def _summary(doc: str | None) -> str:
    """First paragraph of a module docstring, without its ``python -m ...``: prefix."""
    first = (doc or "").split("\n\n")[0].replace("\n", " ")
    return first.split("``: ", 1)[-1]


def _parser() -> argparse.ArgumentParser:
    from . import bench, demo, doctor

    p = argparse.ArgumentParser(prog="aiotransfer", description="asyncio-native KV-cache transfer: tools")
    sub = p.add_subparsers(dest="command", metavar="{demo,bench,doctor}")
    sub.required = True
    d = sub.add_parser("demo", help="prefill -> decode KV-cache transfer between two local processes",
                       description=_summary(demo.__doc__))
    demo.add_arguments(d)
    d.set_defaults(func=demo.run)
    b = sub.add_parser("bench", help="raw Mooncake vs aiotransfer, same engine, same run (the suites: "
                                     "python -m benchmarks, from a checkout)",
                       description=_summary(bench.__doc__))
    bench.add_arguments(b)
    b.set_defaults(func=bench.run)
    doc = sub.add_parser("doctor", help="which engines load, which transport, what is missing (and the fix)")
    doctor.add_arguments(doc)
    doc.set_defaults(func=doctor.doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        rc: int = ns.func(ns)
    except KeyboardInterrupt:
        return 130
    return rc
