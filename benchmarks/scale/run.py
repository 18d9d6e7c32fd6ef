"""``python -m benchmarks scale``: one prefill (this process) and a fleet of decodes (see :mod:`benchmarks.scale`)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import platform
import sys
import time
from typing import Any

from aiotransfer._cli import console
from aiotransfer._cli.files import write_json

from .. import options
from . import report
from .common import Params, raise_fd_limit
from .fleet import Fleet
from .phases import Prefill, Settings, churn, hold_rooms, idle, level, storm

__all__ = ["add_arguments", "run_scale"]

FULL_PEERS = "1,8,64,256,600,1000"
QUICK_PEERS = "1,8,64"


def _peers(text: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--peers wants numbers separated by commas, got {text!r}") from None
    if not xs or xs[0] < 1:
        raise argparse.ArgumentTypeError(f"--peers wants numbers >= 1, got {text!r}")
    return xs


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "scale", quick=f"peers {QUICK_PEERS}, churn of 500 with 50 alive, shorter waits (~1 min)")
    p.add_argument("--peers", type=_peers, default=None, metavar="N,N,...",
                   help=f"decode managers at each level (default {FULL_PEERS}; --quick {QUICK_PEERS})")
    p.add_argument("--processes", type=int, default=4, help="decode processes the fleet is spread over (default 4)")
    p.add_argument("--churn", type=int, default=None, metavar="D",
                   help="distinct decode endpoints registering with a fresh prefill (default 5000; --quick 500; "
                        "0: no churn)")
    p.add_argument("--churn-alive", type=int, default=None, metavar="A",
                   help="of those, at most this many alive at once (default 200; --quick 50)")
    p.add_argument("--hold", type=float, default=None, metavar="SECONDS",
                   help="how long every decode holds a room open at each level (default 3.0, three heartbeat "
                        "intervals; --quick 2.5)")
    p.add_argument("--idle", type=float, default=None, metavar="SECONDS",
                   help="idle time measured at each level (default 3.0; --quick 1.5)")
    p.add_argument("--min-rooms", type=int, default=None,
                   help="rooms of the per-room CPU figure at each level (default 512; --quick 128)")
    p.add_argument("--no-storm", action="store_true", help="skip the restart storm")
    p.add_argument("--host", default="127.0.0.1")


def _settings(ns: argparse.Namespace) -> Settings:
    quick = ns.quick
    return Settings(
        processes=ns.processes,
        idle_s=ns.idle if ns.idle is not None else (1.5 if quick else 3.0),
        hold_s=ns.hold if ns.hold is not None else (2.5 if quick else 3.0),
        min_rooms=ns.min_rooms if ns.min_rooms is not None else (128 if quick else 512),
        churn=ns.churn if ns.churn is not None else (500 if quick else 5000),
        churn_alive=ns.churn_alive if ns.churn_alive is not None else (50 if quick else 200),
        storm=not ns.no_storm,
    )


async def _fleet_phases(peers: list[int], st: Settings, host: str) -> dict[str, Any]:
    pf = await Prefill.start(host)
    fleet = Fleet(Params(prefill=pf.mgr.endpoint, host=host))
    out: dict[str, Any] = {"levels": [], "storm": None}
    try:
        await fleet.spawn(st.processes)
        console.note("no decodes yet: idle ...")
        out["baseline"] = await idle(pf, fleet, st.idle_s)
        out["baseline"]["probed"] = await hold_rooms(pf, min(st.hold_s, 2.0))  # the 1 ms probe's own cost
        for n in peers:
            console.note(f"{n} decodes ...")
            lv = await level(pf, fleet, n, st)
            out["levels"].append(lv)
            console.note("  " + report.level_line(lv))
        if st.storm and st.processes >= 2:
            console.note(f"restart storm: {st.processes // 2} of {st.processes} processes killed ...")
            out["storm"] = await storm(pf, fleet, st)
            console.note("  " + report.storm_line(out["storm"]))
    finally:
        await fleet.close()
        await pf.mgr.aclose()
    return out


async def _main(peers: list[int], st: Settings, host: str, out: str) -> dict[str, Any]:
    raise_fd_limit()
    t0 = time.perf_counter()
    load0 = list(os.getloadavg())
    res: dict[str, Any] = {
        "suite": "scale",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks", *sys.argv[1:]]),
        "settings": {**st.__dict__, "peers": peers},
    }
    res.update(await _fleet_phases(peers, st, host))
    res["churn"] = None
    write_json(out, {**res, "partial": "the churn is running"}, indent=1)  # kept should the churn not end
    if st.churn > 0:
        console.note(f"registration churn: {st.churn} endpoints, at most {st.churn_alive} alive ...")
        res["churn"] = await churn(host, st, st.processes)
        console.note("  " + report.churn_line(res["churn"]))
    res["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                      "load_avg_at_start": load0, "load_avg_at_end": list(os.getloadavg())}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def run_scale(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m benchmarks scale``."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    peers = ns.peers or _peers(QUICK_PEERS if ns.quick else FULL_PEERS)
    if ns.processes < 1:
        print("benchmarks scale: --processes must be >= 1", file=sys.stderr)
        return 2
    st = _settings(ns)
    out = ns.out or options.default_out("scale")
    # the library's own warnings (a churned endpoint seen again, peers declared dead in the storm: thousands
    # of lines) go to the log with the engines' and the workers' lines, not to the console
    lib = logging.getLogger("aiotransfer")
    handler = logging.StreamHandler(os.fdopen(os.dup(2), "w", buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    lib.addHandler(handler)
    lib.propagate = False
    try:
        res = asyncio.run(_main(peers, st, ns.host, out))
    finally:
        lib.removeHandler(handler)
        lib.propagate = True
        handler.close()
    res["summary"] = report.summary(res)
    res["targets"] = report.targets(res)
    write_json(out, res, indent=1)
    md = os.path.splitext(out)[0] + ".md"
    with open(md, "w") as fh:
        fh.write(report.markdown(res) + "\n")
    print(report.text(res))
    print(f"results written to {out} (table for the docs: {md})")
    return 0
