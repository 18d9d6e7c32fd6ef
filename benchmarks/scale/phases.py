"""The measurements of the ``scale`` suite, all on the prefill (this process): one level of the fleet, the
restart storm, and the registration churn."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiotransfer import KVArgs, KVManager, LoopLagMonitor, TransferConfig

from .common import DECODE_PAGES, PAGE_BYTES, PREFILL_PAGES, Params, pct, process_probe, room_number
from .fleet import Fleet

__all__ = ["Prefill", "Settings", "churn", "hold_rooms", "idle", "level", "storm"]

_STRIDE = 1 << 24
"""Room numbers of one batch: :func:`~.common.room_number` from its base; each batch gets a fresh base."""
_MIN_BATCH = 32
"""Rooms of one batch of the per-room CPU figure at least (up to ``DECODE_PAGES`` per decode where the fleet
is small), so that the few commands to the fleet's processes per batch stay small against the rooms."""


@dataclass
class Settings:
    processes: int = 4
    idle_s: float = 3.0
    hold_s: float = 3.0
    """How long every decode holds its room open (at least two heartbeat intervals)."""
    min_rooms: int = 512
    """Rooms of the per-room CPU measurement at each level: rounds of one room per decode until this many."""
    timeout: float = 120.0
    churn: int = 5000
    churn_alive: int = 200
    storm: bool = True


class Prefill:
    """The prefill manager and its loop's clocks."""

    def __init__(self, mgr: KVManager) -> None:
        self.mgr = mgr
        self._bases = itertools.count(_STRIDE, _STRIDE)

    @staticmethod
    async def start(host: str) -> Prefill:
        buf = np.repeat(np.arange(1, PREFILL_PAGES + 1, dtype=np.uint8)[:, None], PAGE_BYTES, axis=1)
        cfg = TransferConfig(engine="mooncake_tcp", hostname=host, staging="never", staging_bytes=0)
        mgr = KVManager(KVArgs([buf], page_size=1, dtype="uint8"), cfg)
        await asyncio.wait_for(mgr.start(), 60.0)
        return Prefill(mgr)

    def base(self) -> int:
        return next(self._bases)

    async def serve(self, room: int, timeout: float) -> str | None:
        """One room from the prefill's side: ready, one 4 KiB page, Success. None, or why it failed."""
        try:
            tx = self.mgr.sender(room)
            await tx.wait_ready(timeout=timeout)
            await tx.send_kv([room % PREFILL_PAGES], timeout=timeout)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:240]
        return None

    def registrations(self) -> dict[str, int]:
        """The registrations the prefill holds, under every name ``stats()`` gives them."""
        s: dict[str, Any] = dict(self.mgr.stats())
        return {k: int(s[k]) for k in ("decode_peers", "registrations") if isinstance(s.get(k), int)}


async def _rooms(pf: Prefill, fleet: Fleet, timeout: float, hold: float = 0.0, per_decode: int = 1
                 ) -> dict[str, Any]:
    """Every decode of the fleet opens ``per_decode`` rooms, the prefill serves them all (after ``hold`` seconds
    with every room open, sampling its loop's lag): counts, and the prefill's loop and process CPU over it."""
    base = pf.base()
    rooms = [room_number(base, i, j) for w in fleet.workers for i in w.indices for j in range(per_decode)]
    c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
    await fleet.all("open", timeout + 10, base=base, timeout=timeout, per_decode=per_decode)
    senders = [pf.mgr.sender(r) for r in rooms]
    ready = await asyncio.gather(*(_attempt(tx.wait_ready(timeout=timeout)) for tx in senders))
    out: dict[str, Any] = {}
    if hold:
        out["hold"] = await hold_rooms(pf, hold)
    to_send = [(tx, room) for tx, room, r in zip(senders, rooms, ready, strict=True) if r is None]
    sent = await asyncio.gather(*(_attempt(tx.send_kv([room % PREFILL_PAGES], timeout=timeout))
                                  for tx, room in to_send))
    got = await fleet.all("collect", timeout + 10, base=base, timeout=timeout)
    c1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
    errors = [e for e in ready + sent if e] + [e for g in got for e in g["errors"]]
    room_s = [x for g in got for x in g["room_s"]]
    failed = {room for room, e in zip(rooms, ready, strict=True) if e}
    failed |= {room for (_, room), e in zip(to_send, sent, strict=True) if e}
    failed |= {room for g in got for room in g["failed_rooms"]}
    out.update(rooms=len(rooms), failed=len(failed), failed_prefill=sum(e is not None for e in ready + sent),
               failed_decode=sum(g["failed"] for g in got), errors=sorted(set(errors))[:3],
               loop_cpu_s=c1 - c0, process_cpu_s=p1 - p0, wall_s=w1 - w0,
               room_ms={"p50": pct([x * 1e3 for x in room_s], 50), "p99": pct([x * 1e3 for x in room_s], 99)})
    return out


async def _attempt(aw: Awaitable[Any]) -> str | None:
    try:
        await aw
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:240]
    return None


async def hold_rooms(pf: Prefill, seconds: float) -> dict[str, Any]:
    """The prefill's loop while every room is open: lag (1 ms probe), loop CPU per second."""
    mon = LoopLagMonitor(interval=0.001, attribute=True)
    c0, w0 = time.thread_time(), time.perf_counter()
    mon.start()
    await asyncio.sleep(seconds)
    await mon.stop()
    c1, w1 = time.thread_time(), time.perf_counter()
    return {**_lag(mon), "loop_cpu_ms_per_s": round((c1 - c0) / (w1 - w0) * 1e3, 2),
            "library_loop_lag": pf.mgr.stats().get("latency", {}).get("loop_lag")}


def _lag(mon: LoopLagMonitor) -> dict[str, Any]:
    s = mon.summary()
    keep = ("p50_ms", "p99_ms", "max_ms", "samples", "seconds", "loop_cpu_share", "runqueue_ms_per_s",
            "steal_ms_per_s", "late_runqueue_share", "worst")
    return {k: s[k] for k in keep if k in s}


async def idle(pf: Prefill, fleet: Fleet, seconds: float) -> dict[str, Any]:
    d0 = await fleet.all("probe", 60)
    a, c0 = process_probe(), time.thread_time()
    await asyncio.sleep(seconds)
    b, c1 = process_probe(), time.thread_time()
    d1 = await fleet.all("probe", 60)
    wall = b["wall_s"] - a["wall_s"]
    decode_cpu = sum(y["cpu_s"] - x["cpu_s"] for x, y in zip(d0, d1, strict=True))
    return {"process_cpu_ms_per_s": round((b["cpu_s"] - a["cpu_s"]) / wall * 1e3, 2),
            "loop_cpu_ms_per_s": round((c1 - c0) / wall * 1e3, 2),
            "rss_kib": b["rss_kib"], "fds": b["fds"], "threads": b["threads"],
            "decode_processes": {"cpu_ms_per_s": round(decode_cpu / wall * 1e3, 2),
                                 "rss_kib": sum(y["rss_kib"] for y in d1), "fds": sum(y["fds"] for y in d1),
                                 "threads": sum(y["threads"] for y in d1)}}


async def level(pf: Prefill, fleet: Fleet, n: int, st: Settings) -> dict[str, Any]:
    """The fleet grown to ``n`` decodes: a first room each (registration), idle, per-room CPU, held rooms."""
    t0 = time.perf_counter()
    await fleet.grow(n, st.timeout)
    warm = await _rooms(pf, fleet, st.timeout)
    quiet = await idle(pf, fleet, st.idle_s)
    per_decode = min(DECODE_PAGES, -(-_MIN_BATCH // n))
    rounds = max(1, -(-st.min_rooms // (n * per_decode)))
    batches = [await _rooms(pf, fleet, st.timeout, per_decode=per_decode) for _ in range(rounds)]
    rooms = sum(b["rooms"] for b in batches)
    loop_cpu = sum(b["loop_cpu_s"] for b in batches)
    wall = sum(b["wall_s"] for b in batches)
    # the same commands to the fleet with no room: what a batch costs the loop besides its rooms
    empty = [await _rooms(pf, fleet, st.timeout, per_decode=0) for _ in range(3)]
    harness = float(np.median([b["loop_cpu_s"] for b in empty]))
    harness_wall = float(np.median([b["wall_s"] for b in empty]))
    idle_loop = quiet["loop_cpu_ms_per_s"] / 1e3 * max(wall - rounds * harness_wall, 0.0)
    held = await _rooms(pf, fleet, st.timeout + st.hold_s, hold=st.hold_s)
    failed = sum(b["failed"] for b in [warm, *batches, held])
    return {
        "peers": n, "idle": quiet,
        "first_rooms": {k: warm[k] for k in ("rooms", "failed", "failed_prefill", "failed_decode", "errors",
                                              "wall_s")},
        "per_room": {"rooms": rooms, "rounds": rounds, "rooms_per_decode": per_decode,
                     "loop_cpu_us": round(loop_cpu / rooms * 1e6, 1),
                     "loop_cpu_net_us": round((loop_cpu - rounds * harness - idle_loop) / rooms * 1e6, 1),
                     "harness_loop_cpu_us_per_batch": round(harness * 1e6, 1),
                     "process_cpu_us": round(sum(b["process_cpu_s"] for b in batches) / rooms * 1e6, 1),
                     "wall_us": round(wall / rooms * 1e6, 1),
                     "room_ms": batches[-1]["room_ms"]},
        "held": {"seconds": st.hold_s, **held["hold"], "rooms": held["rooms"],
                 "failed": held["failed"], "failed_prefill": held["failed_prefill"],
                 "failed_decode": held["failed_decode"], "errors": held["errors"]},
        "rooms_failed": failed,
        "errors": sorted({e for b in [warm, *batches, held] for e in b["errors"]})[:3],
        "registrations": pf.registrations(),
        "seconds": round(time.perf_counter() - t0, 2),
    }


async def storm(pf: Prefill, fleet: Fleet, st: Settings) -> dict[str, Any]:
    """Every decode holds a room; half of the processes are killed and as many new ones started, whose decodes
    open a room each as soon as they are up. The prefill then sends every held room."""
    base, base2 = pf.base(), pf.base()
    await fleet.all("open", st.timeout + 10, base=base, timeout=st.timeout)
    held = {i: pf.mgr.sender(room_number(base, i)) for w in fleet.workers for i in w.indices}
    ready = await asyncio.gather(*(_attempt(tx.wait_ready(timeout=st.timeout)) for tx in held.values()))
    victims = fleet.workers[: len(fleet.workers) // 2]
    killed = {i for v in victims for i in v.indices}
    first_new = fleet.size
    fresh = range(first_new, first_new + len(killed))
    mon = LoopLagMonitor(interval=0.001, attribute=True)
    mon.start()
    t_kill = time.perf_counter()
    await asyncio.gather(*(v.kill() for v in victims))
    t_dead = time.perf_counter()

    async def send(i: int, tx: Any) -> tuple[int, str | None, float]:
        err = await _attempt(tx.send_kv([room_number(base, i) % PREFILL_PAGES], timeout=st.timeout))
        return i, err, time.perf_counter() - t_dead

    sends = asyncio.ensure_future(asyncio.gather(*(send(i, tx) for (i, tx), r in zip(held.items(), ready, strict=True)
                                                   if r is None)))
    new_rooms = asyncio.ensure_future(asyncio.gather(*(pf.serve(room_number(base2, i), st.timeout)
                                                       for i in fresh)))
    replaced = await fleet.replace(victims, base2, st.timeout)
    sent = await sends
    new_errors = await new_rooms
    survivors = [w for w in fleet.workers if w not in {r[0] for r in replaced}]
    got_old = await asyncio.gather(*(w.call("collect", st.timeout + 10, base=base, timeout=st.timeout)
                                     for w in survivors))
    got_new = await asyncio.gather(*(w.call("collect", st.timeout + 10, base=base2, timeout=st.timeout)
                                     for w, _ in replaced))
    await mon.stop()
    kept_failed = {room_number(base, i) for i, e, _ in sent if i not in killed and e}
    kept_failed |= {room for g in got_old for room in g["failed_rooms"]}
    new_failed = {room_number(base2, i) for i, e in zip(fresh, new_errors, strict=True) if e}
    new_failed |= {room for g in got_new for room in g["failed_rooms"]}
    killed_res = [(e, t) for i, e, t in sent if i in killed]
    kept_res = [e for i, e, _ in sent if i not in killed]
    fail_s = [t for e, t in killed_res if e]
    up = [x for g in got_new for x in g["since_up_s"]]
    return {
        "peers": len(held), "processes_killed": len(victims), "decodes_killed": len(killed),
        "kill_to_gone_s": round(t_dead - t_kill, 3),
        "killed_rooms": {"rooms": len(killed), "failed": len(fail_s), "not_ready": sum(e is not None for e in ready),
                         "fail_after_gone_s": {"p50": pct(fail_s, 50), "max": _r(max(fail_s)) if fail_s else None},
                         "reasons": sorted({str(e)[:120] for e, _ in killed_res if e})[:3]},
        "surviving_rooms": {"rooms": len(kept_res), "failed": len(kept_failed),
                            "failed_prefill": sum(e is not None for e in kept_res),
                            "failed_decode": sum(g["failed"] for g in got_old),
                            "errors": sorted({e for e in kept_res if e} | {e for g in got_old for e in g["errors"]})[:3]},
        "new_decodes": {"decodes": len(fresh), "failed": len(new_failed),
                        "failed_prefill": sum(e is not None for e in new_errors),
                        "failed_decode": sum(g["failed"] for g in got_new),
                        "first_room_after_up_s": {"p50": pct(up, 50), "max": _r(max(up)) if up else None},
                        "errors": sorted({e for e in new_errors if e} | {e for g in got_new for e in g["errors"]})[:3]},
        "loop_lag": _lag(mon),
        "registrations": pf.registrations(),
    }


async def churn(host: str, st: Settings, processes: int) -> dict[str, Any]:
    """A fresh prefill; ``st.churn`` decodes, each on a new endpoint, at most ``st.churn_alive`` alive at once,
    each one room and gone. The prefill's registrations sampled every 0.2 s."""
    pf = await Prefill.start(host)
    served: set[asyncio.Task[str | None]] = set()
    errors: list[str] = []

    def finished(task: asyncio.Task[str | None]) -> None:
        served.discard(task)
        if not task.cancelled() and task.result():
            errors.append(str(task.result()))

    def on_event(msg: dict[str, Any]) -> None:
        if msg.get("event") == "room":
            task = asyncio.ensure_future(pf.serve(int(msg["room"]), st.timeout))
            served.add(task)
            task.add_done_callback(finished)

    fleet = Fleet(Params(prefill=pf.mgr.endpoint, host=host), on_event)
    peak: dict[str, int] = {}
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def sample() -> None:
        while True:
            regs = pf.registrations()
            for k, v in regs.items():
                peak[k] = max(peak.get(k, 0), v)
            samples.append({"t": round(time.perf_counter() - t0, 2), **regs})
            await asyncio.sleep(0.2)

    sampler = asyncio.ensure_future(sample())
    try:
        await fleet.spawn(processes)
        counts = [st.churn // processes + (w < st.churn % processes) for w in range(processes)]
        slots = [max(1, st.churn_alive // processes + (w < st.churn_alive % processes)) for w in range(processes)]
        budget = max(600.0, st.churn / 2)
        got = await asyncio.gather(*(w.call("churn", budget + 30, room0=(w_i + 1) * 10_000_000, count=c, slots=s,
                                            timeout=st.timeout, budget=budget)
                                     for w_i, (w, c, s) in enumerate(zip(fleet.workers, counts, slots, strict=True))))
        if served:
            await asyncio.wait_for(asyncio.gather(*served), st.timeout)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        await fleet.close()
    wall = time.perf_counter() - t0
    final = pf.registrations()
    for k, v in final.items():
        peak[k] = max(peak.get(k, 0), v)
    stats = pf.mgr.stats()
    await pf.mgr.aclose()
    accepted = sum(g["ok"] for g in got)
    alive = sum(slots)
    return {
        "endpoints": st.churn, "alive_at_once": alive, "accepted": accepted,
        "distinct_endpoints": len({e for g in got for e in g["endpoints"]}),
        "failed": sum(g["failed"] for g in got), "prefill_failed": len(errors),
        "errors": sorted({e for g in got for e in g["errors"]} | set(errors))[:3],
        "registrations_peak": peak, "registrations_final": final,
        "peak_over_alive": {k: round(v / alive, 2) for k, v in peak.items()},
        "peers_refused": stats.get("peers_refused", 0),
        "registrations_forgotten": dict(stats).get("decode_peers_forgotten", 0),
        "dropped": {**stats.get("control_dropped", {}), **{k: v for k, v in stats.items() if k.startswith("dropped_")}},
        "seconds": round(wall, 2), "endpoints_per_s": round(st.churn / wall, 1),
        "samples": samples[:: max(1, len(samples) // 200)],
    }


def _r(x: float) -> float:
    return round(x, 4)
