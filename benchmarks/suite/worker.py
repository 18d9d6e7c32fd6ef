"""Entry point of the suite's workers: ``python -m benchmarks.suite.worker --role prefill|decode``.

The prefill worker spawns its decode worker, runs the phases of its engine configuration and sends the
results to the orchestrator as one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiotransfer._cli.channel import Child, open_parent_channel

from .bulk import phase_ceilings, phase_concurrency, phase_lag, phase_scattered, phase_throughput
from .common import ENGINES, OPT_IN_PHASES, Params
from .context import Ctx, DecodeClient
from .cpu import phase_cpu
from .decode import decode_worker
from .floor import phase_floor
from .latency import phase_aux, phase_e2e
from .tp import phase_tp

__all__ = ["PHASES", "main", "prefill_worker"]


PHASES: dict[str, Callable[[Ctx], Awaitable[dict[str, Any]]]] = {
    "ceilings": phase_ceilings,
    "throughput": phase_throughput,
    "scattered": phase_scattered,
    "lag": phase_lag,
    "concurrency": phase_concurrency,
    "e2e": phase_e2e,
    "floor": phase_floor,
    "aux": phase_aux,
    "tp": phase_tp,
    "cpu": phase_cpu,
}


async def prefill_worker(ns: argparse.Namespace) -> int:
    chan = await open_parent_channel()
    spec = ENGINES[ns.engine_key]
    params = Params.from_json(ns.params)
    phases = [x for x in (("ceilings",) if ns.ceilings else ()) + spec.phases
              if (x not in OPT_IN_PHASES if params.phases is None else x in params.phases)]
    child = await Child.spawn("benchmarks.suite.worker", ["--engine-key", spec.key, "--params", ns.params])
    ctx = Ctx(spec, params, DecodeClient(child), chan)
    results: dict[str, Any] = {"engine": spec.engine, "label": spec.label, "ucx_tls": os.environ.get("UCX_TLS"),
                               "phases": {}}
    try:
        for name in phases:
            await ctx.progress(f"{name} ...")
            t0 = time.perf_counter()
            try:
                res = await PHASES[name](ctx)
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                res = {"error": f"{type(exc).__name__}: {exc}"}
            res["seconds"] = round(time.perf_counter() - t0, 2)
            results["phases"][name] = res
            ctx.results[name] = res
        results["describe"] = ctx.describe
    finally:
        results["decode_exit"] = await child.close(30.0)
        ctx.thread.shutdown(wait=False, cancel_futures=True)
    await chan.send({"event": "result", "result": results}, timeout=60.0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite.worker",
                                description="benchmark suite worker")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--engine-key", choices=tuple(ENGINES), required=True)
    p.add_argument("--params", required=True)
    p.add_argument("--ceilings", action="store_true")
    ns = p.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        return asyncio.run(decode_worker(ns) if ns.role == "decode" else prefill_worker(ns))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
