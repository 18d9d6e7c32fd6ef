"""``python -m benchmarks handshake``: the prefill's event loop while a decode's handshake hangs.

This process is a prefill (Mooncake over TCP). A healthy decode (a child process) asks it for one small room
after another (four 4 KiB pages: writes the loop posts itself when it can), while a hostile decode (another
child, :mod:`benchmarks.hostile`) registers with it again and again and leaves Mooncake's handshake
hanging: ``once``, it answers the bounded first contact and holds the engine's own request (and the engine's
mutex with it) ``--hold`` seconds; ``silent``, it answers nothing. A phase without the hostile decode is the
reference. Measured per phase: the prefill loop's lag (1 ms probe: p50, p99, max), and the healthy rooms'
latency from the decode's request to its ``done()`` (p50, p99, max) and count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import numpy as np

from aiotransfer import AiotransferError, KVArgs, KVManager, TransferConfig
from aiotransfer._cli.channel import Child, open_parent_channel
from aiotransfer._cli.files import write_json
from aiotransfer._lag import LoopLagMonitor

from . import options

__all__ = ["run_handshake"]

_BUFFERS, _PAGES, _ITEM = 1, 256, 4096
_ROOM = 4
_HANDSHAKE_TIMEOUT = 3.0
"""The prefill's ``handshake_timeout``: the bound of the first contact with a decode that does not answer."""


def _args(seed: int | None) -> KVArgs:
    rng = np.random.default_rng(seed)
    bufs = [rng.integers(0, 255, (_PAGES, _ITEM), dtype=np.uint8) if seed is not None
            else np.zeros((_PAGES, _ITEM), np.uint8) for _ in range(_BUFFERS)]
    return KVArgs(bufs, page_size=16, dtype="uint8")


async def _decode(ns: argparse.Namespace) -> int:
    """Child: a decode that opens the rooms it is told of (``open``: send_metadata, then done())."""
    channel = await open_parent_channel()
    cfg = TransferConfig(engine="mooncake_tcp", handshake_timeout=ns.hold + 10)
    async with KVManager(_args(None), cfg) as mgr:
        if ns.mode != "healthy":
            from .hostile import front_handshake

            front_handshake(mgr, ns.hold, ns.mode)
        await channel.send({"event": "ready", "endpoint": mgr.endpoint})

        async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
            room, peer = int(cmd["room"]), str(cmd["peer"])
            pages = [(room * _ROOM + i) % _PAGES for i in range(_ROOM)]
            rx = mgr.receiver(room, peer)
            t0 = time.perf_counter()
            try:
                await rx.send_metadata(pages, timeout=ns.hold + 10)
                await rx.done(timeout=ns.hold + 10)
            except AiotransferError as exc:
                return {"ms": (time.perf_counter() - t0) * 1e3, "error": str(exc)[:200]}
            return {"ms": (time.perf_counter() - t0) * 1e3}

        await channel.serve(handle, idle_timeout=300)
    return 0


def _pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs), q)), 3) if xs else float("nan")


async def _phase(prefill: KVManager, healthy: Child, hostile: Child | None, seconds: float,
                 room0: int) -> dict[str, Any]:
    ep = prefill.endpoint
    lat: list[float] = []
    errors: list[str] = []
    registrations = 0
    stop = False

    async def serve_rooms() -> None:
        r = room0
        while not stop:
            tx = prefill.sender(r)
            await healthy.channel.send({"cmd": "open", "room": r, "peer": ep})
            try:
                await tx.wait_ready(timeout=60)
                await tx.send_kv([(r * _ROOM + i) % _PAGES for i in range(_ROOM)], timeout=60)
            except AiotransferError as exc:  # a stalled loop misses its heartbeats: the decode gives up on us
                errors.append(f"prefill: {exc}"[:200])
            reply = await healthy.expect("ok", 60)
            await tx.released(timeout=60)
            lat.append(float(reply["ms"]))
            if reply.get("error"):
                errors.append(str(reply["error"]))
            r += 1

    async def register_again() -> None:
        nonlocal registrations
        r = room0 + 500_000
        while not stop and hostile is not None:
            await hostile.channel.send({"cmd": "open", "room": r, "peer": ep})
            await hostile.expect("ok", 120)  # refused (its engine never answered ours), or timed out
            registrations += 1
            r += 1

    mon = LoopLagMonitor(interval=0.001)
    mon.start()
    tasks = [asyncio.ensure_future(serve_rooms()), asyncio.ensure_future(register_again())]
    await asyncio.sleep(seconds)
    stop = True
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    await mon.stop()
    lags = [float(x) for x in mon.samples]
    return {
        "seconds": seconds, "rooms": len(lat), "failed_rooms": len(errors), "room_errors": errors[:3],
        "hostile_registrations": registrations,
        "loop_lag_ms": {"p50": _pct(lags, 50), "p99": _pct(lags, 99), "max": round(max(lags), 3) if lags else None},
        "room_ms": {"p50": _pct(lat, 50), "p99": _pct(lat, 99), "max": round(max(lat), 3) if lat else None},
    }


async def _prefill(ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"hold_s": ns.hold, "handshake_timeout_s": _HANDSHAKE_TIMEOUT, "phases": {}}
    cfg = TransferConfig(engine="mooncake_tcp", handshake_timeout=_HANDSHAKE_TIMEOUT, staging="never")
    healthy = await Child.spawn("benchmarks.handshake", ["--role", "decode", "--mode", "healthy",
                                                               "--hold", str(ns.hold)])
    children = [healthy]
    try:
        await healthy.expect("ready", 60)
        async with KVManager(_args(1), cfg) as prefill:
            room = 1
            for mode in ns.phases.split(","):
                hostile = None
                if mode != "none":
                    hostile = await Child.spawn("benchmarks.handshake", ["--role", "decode", "--mode", mode,
                                                                               "--hold", str(ns.hold)])
                    children.append(hostile)
                    await hostile.expect("ready", 60)
                res = await _phase(prefill, healthy, hostile, ns.seconds, room)
                room += 100_000
                out["phases"][mode] = res
                lag, rl = res["loop_lag_ms"], res["room_ms"]
                print(f"hostile decode {mode}: loop lag p50 {lag['p50']} ms, p99 {lag['p99']} ms, "
                      f"max {lag['max']} ms", flush=True)
                print(f"  {res['rooms']} healthy rooms: latency p50 {rl['p50']} ms, p99 {rl['p99']} ms, "
                      f"max {rl['max']} ms, {res['failed_rooms']} failed", flush=True)
                print(f"  {res['hostile_registrations']} hostile registrations", flush=True)
    finally:
        for child in children:
            await child.close()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "handshake", quick="6 s per phase instead of 20")


def run_handshake(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m benchmarks handshake``."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    hold = 4.0
    seconds = 6.0 if ns.quick else 20.0
    args = argparse.Namespace(hold=hold, seconds=seconds, phases="none,once,silent")
    out = asyncio.run(_prefill(args))
    write_json(ns.out or options.default_out("handshake"), out, indent=2)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.handshake")
    p.add_argument("--role", choices=("decode",), required=True)
    p.add_argument("--mode", choices=("healthy", "once", "silent"), default="healthy")
    p.add_argument("--hold", type=float, default=4.0)
    return asyncio.run(_decode(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
