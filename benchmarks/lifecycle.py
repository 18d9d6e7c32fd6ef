"""``python -m benchmarks lifecycle``: how long a failed room's pages stay out of the pool.

The decode (this process) opens a room of scattered pages, the prefill (a child process) starts sending it,
and the decode aborts once the first bytes have landed. Measured: abort -> ``rx.released()`` (the prefill's
drain acknowledgement crossing back), and on the prefill the time from its room failing to
``tx.released()``. Each engine runs in its own pair of processes; figures are p50 / p99 over the rooms, with
the old advice (keep the pages out for ``engine_timeout_s``) beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import numpy as np

from aiotransfer import AiotransferError, KVArgs, KVManager, TransferConfig
from aiotransfer._cli.channel import Child, open_parent_channel
from aiotransfer._cli.files import write_json

from . import options

__all__ = ["run_lifecycle"]

_PAGES, _BUFFERS, _ITEM = 2048, 4, 16 << 10
_ROOM_PAGES = 1024


def _config(engine: str) -> TransferConfig:
    if engine == "nixl_shm":
        return TransferConfig(engine="nixl")
    return TransferConfig(engine=engine)


def _buffers(seed: int | None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (_PAGES, _ITEM), dtype=np.uint8) if seed is not None
            else np.zeros((_PAGES, _ITEM), np.uint8) for _ in range(_BUFFERS)]


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


async def _prefill(ns: argparse.Namespace) -> int:
    """Child: a prefill that sends each room it is told of, and reports how long its release took."""
    channel = await open_parent_channel()
    async with KVManager(KVArgs(_buffers(1), page_size=16, dtype="uint8"), _config(ns.engine)) as mgr:
        await channel.send({"event": "ready", "endpoint": mgr.endpoint})
        rng = np.random.default_rng(2)
        async def room(r: int) -> dict[str, Any]:
            tx = mgr.sender(r)
            await tx.wait_ready(timeout=10)
            failed_at = 0.0
            try:
                await tx.send_kv(rng.permutation(_PAGES)[:_ROOM_PAGES], timeout=30)
            except AiotransferError:
                failed_at = time.perf_counter()
            await tx.released(timeout=30)
            return {"release_ms": (time.perf_counter() - failed_at) * 1e3 if failed_at else None}

        results: dict[int, asyncio.Task[dict[str, Any]]] = {}

        async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
            if cmd["cmd"] == "open":
                task = asyncio.ensure_future(room(int(cmd["room"])))
                results[int(cmd["room"])] = task
                return {}
            if cmd["cmd"] == "result":
                return await asyncio.wait_for(results.pop(int(cmd["room"])), 30)
            raise ValueError(f"unknown command {cmd['cmd']!r}")

        await channel.serve(handle, idle_timeout=120)
    return 0


async def _decode(engine: str, rooms: int) -> dict[str, Any]:
    child = await Child.spawn("benchmarks.lifecycle", ["--engine", engine])
    try:
        ready = await child.expect("ready", 60)
        dst_bufs = _buffers(None)
        rng = np.random.default_rng(3)
        lat: list[float] = []
        prefill_ms: list[float] = []
        causes: dict[str, int] = {}
        async with KVManager(KVArgs(dst_bufs, page_size=16, dtype="uint8"), _config(engine)) as mgr:
            for r in range(1, rooms + 1):
                dst = rng.permutation(_PAGES)[:_ROOM_PAGES]
                probe = dst_bufs[0][dst, :8].copy()
                await child.channel.send({"cmd": "open", "room": r})
                await child.expect("ok", 10)
                rx = mgr.receiver(r, ready["endpoint"])
                await rx.send_metadata(dst, timeout=10)
                deadline = time.monotonic() + 5
                for _ in range(1 << 22):  # abort once the first bytes have landed: the rest is in flight
                    if not (dst_bufs[0][dst, :8] == probe).all() or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0)
                await rx.abort("benchmark abort")
                t0 = time.perf_counter()
                await rx.released(timeout=60)
                lat.append((time.perf_counter() - t0) * 1e3)
                cause = rx.release_cause or "?"
                causes[cause] = causes.get(cause, 0) + 1
                await child.channel.send({"cmd": "result", "room": r})
                res = await child.expect("ok", 40)
                if res.get("release_ms") is not None:
                    prefill_ms.append(res["release_ms"])
            engine_timeout = float(mgr.config.engine_timeout_s or 30)
    finally:
        await child.close()
    return {
        "engine": engine, "rooms": rooms, "room_bytes": _ROOM_PAGES * _BUFFERS * _ITEM,
        "abort_to_released_ms": {"p50": _pct(lat, 50), "p99": _pct(lat, 99), "max": max(lat)},
        "prefill_failed_to_released_ms": {"p50": _pct(prefill_ms, 50), "p99": _pct(prefill_ms, 99),
                                          "n": len(prefill_ms)},
        "causes": causes, "old_advice_s": engine_timeout,
        "old_advice_over_p99": engine_timeout * 1e3 / _pct(lat, 99),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "lifecycle", quick="10 rooms per engine instead of 50")
    options.engines(p, "mooncake_tcp,nixl_shm")


def run_lifecycle(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m benchmarks lifecycle``."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    engines = (ns.engines or "mooncake_tcp,nixl_shm").split(",")
    rooms = 10 if ns.quick else 50
    out = []
    for engine in engines:
        res = asyncio.run(_decode(engine, rooms))
        out.append(res)
        a, p = res["abort_to_released_ms"], res["prefill_failed_to_released_ms"]
        print(f"{engine}, {rooms} rooms of {res['room_bytes'] >> 20} MiB:")
        print(f"  abort -> rx.released(): p50 {a['p50']:.2f} ms, p99 {a['p99']:.2f} ms (max {a['max']:.2f})")
        print(f"  prefill failed -> tx.released(): p50 {p['p50']:.2f} ms, p99 {p['p99']:.2f} ms")
        print(f"  causes {res['causes']}")
        print(f"  the old advice ({res['old_advice_s']:.0f} s) kept pages out {res['old_advice_over_p99']:.0f}x "
              "longer than p99")
    write_json(ns.out or options.default_out("lifecycle"), out, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="decode")
    p.add_argument("--engine", default="mooncake_tcp")
    ns = p.parse_args(argv)
    return asyncio.run(_prefill(ns))


if __name__ == "__main__":
    sys.exit(main())
