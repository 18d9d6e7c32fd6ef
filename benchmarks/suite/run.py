"""The suite's orchestrator (the CLI process): one pair of worker processes per engine configuration,
the results merged, the targets evaluated, the table printed and the plots drawn. It imports no engine."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from aiotransfer._cli import console
from aiotransfer._cli.channel import Child

from .. import options
from . import cpu_report, floor_report, report
from .common import ALL_PHASES, ENGINES, MIB, EngineSpec, Params, make_params

__all__ = ["add_arguments", "run_suite"]


def _dist_version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nixl_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl_cu12", "nixl_cu13", "nixl"))


async def _run_pair(spec: EngineSpec, params: Params, ceilings: bool, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    for k in spec.unset:
        env.pop(k, None)
    env.update(spec.env)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    argv = [sys.executable, "-m", "benchmarks.suite.worker", "--role", "prefill", "--engine-key", spec.key,
            "--params", params.to_json()]
    if ceilings:
        argv.append("--ceilings")
    proc = await asyncio.wait_for(asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, limit=64 * MIB,
    ), 30.0)
    child = Child(proc)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            msg = await child.channel.recv(max(deadline - loop.time(), 0.001))
            if msg is None:
                raise RuntimeError(f"{spec.key} prefill worker exited (rc={await child.wait(5.0)}) without a result")
            if msg.get("event") == "progress":
                console.note(f"  {msg['message']}")
            elif msg.get("event") == "result":
                res: dict[str, Any] = msg["result"]
                return res
    finally:
        await child.close(30.0)


async def _suite_main(params: Params, engines: Sequence[str], quick: bool) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_at_start = list(os.getloadavg())
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    ceilings: dict[str, Any] | None = None
    timeout = 900.0 if params.scale != "full" else 3600.0
    want_ceilings = params.phases is None or "ceilings" in params.phases
    for key in engines:
        spec = ENGINES[key]
        if spec.engine == "nixl" and not _nixl_available():
            skipped[key] = "NIXL is not installed (pip install --no-deps nixl-cu12)"
            continue
        console.note(f"{spec.label} ({key}) ...")
        try:
            res = await _run_pair(spec, params, want_ceilings and ceilings is None, timeout)
        except (RuntimeError, asyncio.TimeoutError) as exc:
            results[key] = {"label": spec.label, "phases": {}, "error": f"{type(exc).__name__}: {exc}"}
            continue
        if "ceilings" in res["phases"]:
            ceilings = res["phases"].pop("ceilings")
            ceilings["measured_by"] = key
        results[key] = res
    versions = {d: _dist_version(d) for d in ("mooncake-transfer-engine-non-cuda", "nixl-cu12", "numpy", "pyzmq")}
    return {
        "suite": "full",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_start": load_at_start, "load_avg_at_end": list(os.getloadavg()),
                    "versions": versions},
        "quick": quick,
        "params": asdict(params),
        "note": "GB/s = 1e9 B/s; medians of the repeats; raw and aiotransfer alternate in the same pair of "
                "processes; ratio = aiotransfer GB/s / raw GB/s (> 1: aiotransfer faster). This machine kind is "
                "noisy: +-20 % between runs.",
        "ceilings": ceilings,
        "engines": results,
        "skipped": skipped,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "full", repeats="default 5, more for small sizes; fewer with --quick", seed=True,
                   quick="smaller sizes and counts (~30 s per engine)")
    p.add_argument("--host", default="127.0.0.1")
    options.engines(p, ",".join(ENGINES) + "; each runs in its own pair of processes")
    p.add_argument("--phases", default=None,
                   help=f"subset of {','.join(ALL_PHASES)} (default all but cpu, which runs only when named)")
    p.add_argument("--img-dir", default="bench-results/img", metavar="DIR",
                   help="where the PNG plots go (default %(default)s; '' for none)")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="re-derive the table and plots from a saved JSON of this suite (runs nothing)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: smallest configuration
    p.add_argument("--tp-library-credits", action="store_true",
                   help="TP figure: keep the library's default engine credits (1,024 per peer, shared by the 4 "
                        "prefill managers of the one Mooncake engine) instead of 256")
    p.add_argument("--engine-threads", choices=("normal", "background"), default="normal",
                   help="TransferConfig.engine_threads of every manager, both sides (default normal)")
    p.add_argument("--nixl-progress-delay-us", type=int, default=0, metavar="US",
                   help="TransferConfig.nixl_progress_delay_us of every manager, both sides (default 0: NIXL's "
                        "progress thread polls without pause)")
    p.add_argument("--no-yield-after-notify", action="store_true",
                   help="TransferConfig.yield_after_notify=False for every manager, both sides")
    p.add_argument("--floor-gap", type=float, default=None, metavar="SECONDS",
                   help="floor phase: idle time before each repetition (default 0.001)")


def run_suite(ns: argparse.Namespace) -> int:
    """``python -m benchmarks full``: run, write JSON + PNGs, print the table."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    out = ns.out or options.default_out("full")
    if ns.replot:
        with open(ns.replot) as fh:
            res = json.load(fh)
    else:
        engines = [e.strip() for e in (ns.engines or ",".join(ENGINES)).split(",") if e.strip()]
        unknown = [e for e in engines if e not in ENGINES]
        phases = [x.strip() for x in ns.phases.split(",")] if ns.phases else None
        if unknown or (phases and any(x not in ALL_PHASES for x in phases)):
            print(f"benchmarks full: engines are {', '.join(ENGINES)}; phases are {', '.join(ALL_PHASES)}",
                  file=sys.stderr)
            return 2
        params = make_params(quick=ns.quick, tiny=ns.tiny, repeats=ns.repeats, seed=ns.seed, host=ns.host,
                             phases=phases, tp_split_credits=not ns.tp_library_credits,
                             engine_threads=ns.engine_threads,
                             nixl_progress_delay_us=ns.nixl_progress_delay_us, floor_gap=ns.floor_gap,
                             yield_after_notify=not ns.no_yield_after_notify)
        try:
            res = asyncio.run(_suite_main(params, engines, ns.quick or ns.tiny))
        except KeyboardInterrupt:
            return 130
    res["figures"] = report.derive(res)
    res["targets"] = report.evaluate(res)
    res["images"] = []
    if ns.img_dir:
        try:
            res["images"] = report.plot_all(res, ns.img_dir)
        except ImportError as exc:
            print(f"plots skipped: {exc} (pip install matplotlib)", file=sys.stderr)
    print(report.table(res))
    for extra in (floor_report.table(res), cpu_report.table(res)):
        if extra:
            print("\n" + extra)
    if not ns.replot or ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out + ".tmp", "w") as fh:
            json.dump(res, fh, indent=1)
            fh.write("\n")
        os.replace(out + ".tmp", out)
        md = os.path.splitext(out)[0] + ".md"
        with open(md, "w") as fh:
            fh.write(report.markdown_table(res) + "\n")
            for extra in (floor_report.markdown(res), cpu_report.markdown(res)):
                if extra:
                    fh.write("\n" + extra + "\n")
        print(f"results written to {out} (table for the docs: {md})")
    if ns.img_dir and res.get("images"):
        print(f"plots written to {ns.img_dir}: {', '.join(os.path.basename(x) for x in res['images'])}")
    errors = [f"{k}.{ph}" for k, e in res["engines"].items() for ph, r in e.get("phases", {}).items()
              if isinstance(r, dict) and r.get("error")]
    errors += [k for k, e in res["engines"].items() if e.get("error")]
    if errors:
        print(f"benchmarks full: phases failed: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0
