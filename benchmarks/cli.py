"""``python -m benchmarks SUITE [options]``: one subcommand per suite, dispatched through :data:`SUITES`.

Each suite is a module with ``add_arguments(parser)`` and an entry point ``run(namespace) -> exit code``;
only the chosen suite's module is imported. Every run writes its JSON to ``--out`` (default
``bench-results/SUITE.json``), keeps the engines' and worker processes' own log lines in ``--log`` (default:
``--out`` with ``.log``) and shows its progress on stderr (:func:`aiotransfer._cli.console.session`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiotransfer._cli import console

from . import ROOT, options

__all__ = ["SUITES", "Suite", "main"]


@dataclass(frozen=True)
class Suite:
    module: str
    """Module with ``add_arguments(parser)`` and the entry point."""
    entry: str
    """Name of the entry point in ``module``: ``(namespace) -> exit code``."""
    help: str


SUITES: dict[str, Suite] = {
    "figures": Suite("aiotransfer._cli.bench", "run",
                     "raw Mooncake vs aiotransfer, figures (a)-(c) (what `aiotransfer bench` runs)"),
    "full": Suite("benchmarks.suite.run", "run_suite",
                  "the performance suite: every engine, every phase, JSON, table of targets, PNG plots"),
    "lifecycle": Suite("benchmarks.lifecycle", "run_lifecycle", "abort -> released() latency"),
    "handshake": Suite("benchmarks.handshake", "run_handshake",
                       "the prefill's loop lag while a decode's Mooncake handshake hangs"),
    "scale": Suite("benchmarks.scale.run", "run_scale",
                   "one prefill and a fleet of decodes: idle cost per peer, loop lag with every room open, "
                   "a restart storm, a registration churn"),
    "streaming": Suite("benchmarks.streaming", "run_streaming", "layer streaming's exposed transfer time"),
    "conversion": Suite("benchmarks.conversion", "run_conversion",
                        "page-size and layout conversion against plain staging"),
    "vllm": Suite("benchmarks.vllm_pd", "from_bench_cli",
                  "AiotransferConnector vs vLLM's NixlConnector (run with the vLLM venv's Python)"),
    "sglang": Suite("benchmarks.sglang.bench", "run_sglang",
                    "SGLang's own transfer layer vs aiotransfer (needs bash scripts/interop-venv.sh)"),
    "device": Suite("benchmarks.device_bench", "run_device",
                    "KV in GPU memory: aiotransfer vs the raw engine, aux by path, staging copies"),
}


def _parser(chosen: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description="aiotransfer's benchmarks, run from a checkout. "
                                            "`python -m benchmarks SUITE --help` lists a suite's options.")
    sub = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name, suite in SUITES.items():
        sp = sub.add_parser(name, help=suite.help, description=suite.help)
        if name == chosen:  # only the chosen suite's module is imported
            module = importlib.import_module(suite.module)
            module.add_arguments(sp)
            entry: Callable[[argparse.Namespace], int] = getattr(module, suite.entry)
            sp.set_defaults(entry=entry)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    ns = _parser(args[0] if args else None).parse_args(args)
    # Worker processes run `python -m benchmarks.…`: they find this checkout from any directory.
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)
    log = ns.log or os.path.splitext(ns.out or options.default_out(ns.suite))[0] + ".log"
    if getattr(ns, "replot", None) and not ns.log:
        log = None  # a re-plot runs no engine
    try:
        with console.session(log):
            rc: int = ns.entry(ns)
    except KeyboardInterrupt:
        rc = 130
    if log is None:
        return rc
    print(f"engine and worker logs: {log}", file=sys.stderr)
    if rc not in (0, 2, 130):
        tail = console.log_tail(log)
        if tail:
            print(f"last lines of {log}:\n{tail}", file=sys.stderr, end="")
    return rc
