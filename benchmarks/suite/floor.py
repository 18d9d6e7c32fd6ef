"""The ``floor`` phase: how far a small room sits above its floor on one machine, and where the rest goes.

A room's floor is one control message from the decode to the prefill (the metadata), the engine write,
and one message back (``Success``): one ZeroMQ round trip plus one raw write. In the same two processes,
in blocks, round after round, each round in a new random order, with an idle gap before every repetition
(``--floor-gap``, 1 ms by default, as in ``e2e``):

* ``zmq``: a :class:`~aiotransfer._control.messages.Ping` from a
  :class:`~aiotransfer._control.endpoint.ControlPlane` in the decode worker to one in the prefill worker,
  which answers :class:`~aiotransfer._control.messages.Pong` from its handler (``try_send``); timed on the
  decode from before the send to the Pong's dispatch. ``zmq_yield``: the same, the answer followed by
  ``sched_yield`` (what ``yield_after_notify`` does after a room's ``Success``);
* ``raw``: one write of 4 KiB, 64 KiB and 1 MiB through the prefill manager's own native engine, submit
  to completion, spinning (:meth:`~aiotransfer._cli.raw.RawEngine.latency`, as ``e2e``'s raw figure);
* ``room``: a whole room of the same sizes (one contiguous run of 4 KiB pages: one engine entry), timed
  on the decode from ``send_metadata`` to ``done()`` returning, the prefill waiting in ``wait_ready`` and
  then calling ``send_kv``. ``room`` runs with the trace recorder off (the figure); ``room_traced`` with it
  on in both processes (:mod:`aiotransfer._trace`), which gives the stage breakdown.

Both processes read ``CLOCK_MONOTONIC`` (``time.perf_counter_ns``), one clock for the machine: checked in
the run, as ``e2e`` does. Thread wake-ups per room are counted from the kernel's context-switch counters
of every thread of both processes (``/proc/self/task/*/status``) around the room blocks.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from aiotransfer import _trace
from aiotransfer._cli.raw import raw_engine
from aiotransfer._cli.workload import fill_pages
from aiotransfer._control.endpoint import ControlPlane
from aiotransfer._control.messages import Message, Ping, Pong

from .common import KIB, MIB
from .context import Ctx

__all__ = ["PATH", "SIDE", "SIZES", "STAGES", "DecodeFloor", "breakdown", "phase_floor", "thread_switches"]

SIZES = (4 * KIB, 64 * KIB, MIB)
PAGE = 4 * KIB
STEP_TIMEOUT = 60.0
"""Bound on one room, one round trip or one block of them."""
WARM = 10

PATH: tuple[tuple[str, str, str, str], ...] = (
    ("start", "request_send", "decode", "send_metadata: checks, route, the request built"),
    ("request_send", "request_in", "decode->prefill", "request over ZeroMQ, the prefill's loop wakes and dispatches it"),
    ("request_in", "ready", "prefill", "the sender is ready, its waiting task resumes (wait_ready returns)"),
    ("ready", "planned", "prefill", "send_kv: checks, reservation, entries built"),
    ("planned", "submitted", "prefill", "poll loop's write: credit, room gate, engine submit"),
    ("submitted", "engine_done", "prefill", "the engine's write, until the poll loop sees it complete"),
    ("engine_done", "status_in", "prefill->decode",
     "Success built and handed to ZeroMQ, over ZeroMQ, the decode's loop wakes and dispatches it"),
    ("status_in", "done", "decode", "the status applied, the done() waiter resumes"),
    ("done", "end", "decode", "the caller resumes"),
)
"""A room's critical path: consecutive marks (from, to, where, what happens between them)."""
SIDE: tuple[tuple[str, str, str, str], ...] = (
    ("request_send", "request_sent", "decode", "the request's send call returns (the loop thread may lose its CPU "
     "to the threads the send woke)"),
    ("engine_done", "success_out", "prefill", "Success handed to ZeroMQ, with the CPU yield after it"),
)
"""Marks off the critical path, from the path mark they follow."""
STAGES = (*(a for a, _, _, _ in PATH), "end", "request_sent", "success_out")


# ----------------------------------------------------------------------------------------------------
# both sides
# ----------------------------------------------------------------------------------------------------
def thread_switches() -> dict[str, list[int]]:
    """Voluntary and involuntary context switches of this process's threads, summed by thread: the calling
    thread (the event loop's) is ``loop``, other Python threads go by their name (without the pool index),
    native threads by their kernel name. Empty where ``/proc`` has no per-thread status."""
    me = threading.get_native_id()
    named = {t.native_id: re.sub(r"_\d+$", "", t.name) for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, list[int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:
            continue  # the thread ended meanwhile
        name = "loop" if int(tid) == me else named.get(int(tid)) or f"native {fields.get('Name', '?').strip()}"
        counts = out.setdefault(name, [0, 0])
        counts[0] += int(fields.get("voluntary_ctxt_switches", "0"))
        counts[1] += int(fields.get("nonvoluntary_ctxt_switches", "0"))
    return out


def switches_delta(before: Mapping[str, Sequence[int]], after: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    return {k: [a - b for a, b in zip(v, before.get(k, (0, 0)), strict=True)] for k, v in after.items()}


def _add_switches(total: dict[str, list[int]], delta: Mapping[str, Sequence[int]]) -> None:
    for k, v in delta.items():
        t = total.setdefault(k, [0, 0])
        t[0] += v[0]
        t[1] += v[1]


async def _bounded(fut: asyncio.Future[Any], timeout: float, what: str) -> Any:
    """``await fut`` for at most ``timeout`` seconds: a future of its own and one timer, as ``done()``."""
    def expire() -> None:
        if not fut.done():
            fut.set_exception(TimeoutError(f"{what}: no answer within {timeout}s"))

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await fut
    finally:
        timer.cancel()


def _pct(xs: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(xs, dtype=np.float64), q)), 2) if len(xs) else None


def summary_us(ns: Sequence[int]) -> dict[str, Any]:
    """Median, p90 and count of durations given in nanoseconds, in microseconds."""
    us = [x / 1e3 for x in ns]
    return {"n": len(us), "p50_us": _pct(us, 50), "p90_us": _pct(us, 90), "min_us": round(min(us), 2) if us else None}


def breakdown(marks: Sequence[Sequence[Any]], rooms: Sequence[int]) -> dict[str, Any]:
    """Per-stage deltas (µs) along :data:`PATH` and :data:`SIDE` over ``rooms``; each room's first mark of a
    stage counts, and a delta is measured on the rooms that have both marks."""
    wanted = set(rooms)
    at: dict[int, dict[str, int]] = {}
    for room, stage, t in marks:
        if room in wanted:
            at.setdefault(room, {}).setdefault(stage, t)

    def rows(segments: Sequence[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
        return [{"from": a, "to": b, "where": where, "what": what,
                 **summary_us([m[b] - m[a] for m in at.values() if a in m and b in m])}
                for a, b, where, what in segments]

    return {"rooms": len(wanted), "complete": sum(all(s in at.get(r, {}) for s in STAGES) for r in wanted),
            "path": rows(PATH), "side": rows(SIDE),
            "total": summary_us([m["end"] - m["start"] for m in at.values() if "start" in m and "end" in m])}


# ----------------------------------------------------------------------------------------------------
# decode side (the decode worker's floor_* commands)
# ----------------------------------------------------------------------------------------------------
class DecodeFloor:
    """The decode worker's half of the phase: the pinging control plane, the timed rooms, the recorder."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.plane: ControlPlane | None = None
        self.waiting: dict[int, asyncio.Future[int]] = {}
        self.nonce = 0

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, Pong):
            fut = self.waiting.pop(msg.nonce, None)
            if fut is not None and not fut.done():
                fut.set_result(time.perf_counter_ns())

    async def _plane(self) -> ControlPlane:
        if self.plane is None:
            plane = ControlPlane(self.host, 0, self._on_message, max_sockets=4, max_message_bytes=4 * KIB)
            await plane.start()
            self.plane = plane
        return self.plane

    async def rtt(self, peer: str, n: int, gap: float) -> list[int]:
        plane = await self._plane()
        loop = asyncio.get_running_loop()
        out = []
        for _ in range(n):
            self.nonce += 1
            fut: asyncio.Future[int] = loop.create_future()
            self.waiting[self.nonce] = fut
            t0 = time.perf_counter_ns()
            await plane.send(peer, Ping(endpoint=plane.endpoint, nonce=self.nonce), timeout=STEP_TIMEOUT)
            t1: int = await _bounded(fut, STEP_TIMEOUT, "Pong")
            out.append(t1 - t0)
            await asyncio.sleep(gap)
        return out

    async def rooms(self, mgr: Any, peer: str, rooms: Sequence[int], dst: Sequence[int], gap: float,
                    trace: bool) -> dict[str, Any]:
        pages = np.asarray(dst, dtype=np.int64)
        times: list[int] = []
        before = thread_switches()
        if trace:
            _trace.start()
        try:
            for room in rooms:
                rx = mgr.receiver(room, peer)
                t0 = time.perf_counter_ns()
                _trace.mark(room, "start")
                await rx.send_metadata(pages, timeout=STEP_TIMEOUT)
                await rx.done(timeout=STEP_TIMEOUT)
                _trace.mark(room, "end")
                times.append(time.perf_counter_ns() - t0)
                await asyncio.sleep(gap)
        finally:
            rec = _trace.stop() if trace else None
        return {"ns": times, "marks": rec.take() if rec is not None else [],
                "dropped": rec.dropped if rec is not None else 0,
                "switches": switches_delta(before, thread_switches())}

    async def handle(self, cmd: dict[str, Any], manager: Callable[[str], Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "floor_rtt":
            return {"ns": await self.rtt(cmd["peer"], int(cmd["n"]), float(cmd["gap"]))}
        if op == "floor_rooms":
            return await self.rooms(manager(cmd["name"]), cmd["peer"], cmd["rooms"], cmd["dst"], float(cmd["gap"]),
                                    bool(cmd["trace"]))
        if op == "floor_clock":
            return {"t": time.perf_counter_ns(), "impl": time.get_clock_info("perf_counter").implementation}
        if op == "floor_close":
            await self.aclose()
            return {}
        raise ValueError(f"unknown command {op!r}")

    async def aclose(self) -> None:
        for fut in self.waiting.values():
            fut.cancel()
        self.waiting.clear()
        plane, self.plane = self.plane, None
        if plane is not None:
            await plane.aclose(linger=0.0)


# ----------------------------------------------------------------------------------------------------
# prefill side
# ----------------------------------------------------------------------------------------------------
class _Echo:
    """The prefill worker's control plane answering every Ping with a Pong from its handler."""

    def __init__(self, host: str) -> None:
        self.plane = ControlPlane(host, 0, self._on_message, max_sockets=4, max_message_bytes=4 * KIB)
        self.yield_cpu = False

    def _on_message(self, msg: Message) -> Any:
        if not isinstance(msg, Ping):
            return None
        pong = Pong(endpoint=self.plane.endpoint, nonce=msg.nonce)
        if self.plane.try_send(msg.endpoint, pong, yield_cpu=self.yield_cpu):
            return None
        return self.plane.send(msg.endpoint, pong, timeout=STEP_TIMEOUT)


async def _clock_check(ctx: Ctx, n: int = 20) -> dict[str, Any]:
    """The decode's ``perf_counter_ns`` reading must fall between ours taken around the call."""
    ok = True
    impl = ""
    for _ in range(n):
        a = time.perf_counter_ns()
        r = await ctx.dec.call("floor_clock")
        b = time.perf_counter_ns()
        ok &= a <= r["t"] <= b
        impl = r["impl"]
    mine = time.get_clock_info("perf_counter").implementation
    return {"clock": "time.perf_counter_ns", "prefill": mine, "decode": impl, "consistent": ok and mine == impl}


async def phase_floor(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    pages = MIB // PAGE
    f = await ctx.flat("floor", pages=pages, page_bytes=PAGE)
    echo = _Echo(p.host)
    await echo.plane.start()
    try:
        mgr, pool = f.mgrs[0], f.pools[0]
        tag = 0xF100
        await ctx.off(fill_pages, pool, tag, np.arange(pages, dtype=np.int64))
        raw = raw_engine(mgr, f.session)
        clock = await _clock_check(ctx)
        samples: dict[str, list[int]] = {}
        marks: list[list[Any]] = []
        traced: dict[int, list[int]] = {s: [] for s in SIZES}
        switches: dict[str, dict[str, list[int]]] = {"prefill": {}, "decode": {}}
        rooms_switched = 0

        async def zmq(n: int, yield_cpu: bool) -> list[int]:
            echo.yield_cpu = yield_cpu
            return list((await ctx.dec.call("floor_rtt", timeout=STEP_TIMEOUT + n, peer=echo.plane.endpoint, n=n,
                                            gap=p.floor_gap))["ns"])

        async def raw_writes(n: int, size: int) -> list[int]:
            out = []
            for _ in range(n):
                s = await ctx.off(raw.latency, f.src_base, f.dst_base, size, timeout=STEP_TIMEOUT)
                out.append(int(s * 1e9))
                await asyncio.sleep(p.floor_gap)
            return out

        async def rooms(n: int, size: int, trace: bool) -> list[int]:
            nonlocal rooms_switched
            npg = size // PAGE
            src = np.arange(npg, dtype=np.int64)
            ids = ctx.rooms(n)
            txs = [mgr.sender(r) for r in ids]

            async def serve() -> None:
                for tx in txs:
                    await tx.wait_ready(timeout=STEP_TIMEOUT)
                    _trace.mark(tx.room, "ready")
                    await tx.send_kv(src, timeout=STEP_TIMEOUT)
                    await tx.done(timeout=STEP_TIMEOUT)

            before = thread_switches()
            if trace:
                _trace.start()
            try:
                _, res = await asyncio.gather(serve(), ctx.dec.call(
                    "floor_rooms", timeout=STEP_TIMEOUT + 2 * n, name="floor", peer=mgr.endpoint, rooms=ids,
                    dst=list(range(npg)), gap=p.floor_gap, trace=trace))
            finally:
                rec = _trace.stop() if trace else None
            if trace:
                marks.extend(list(m) for m in (rec.take() if rec is not None else []))
                marks.extend(res["marks"])
                traced[size].extend(ids)
            else:
                _add_switches(switches["prefill"], switches_delta(before, thread_switches()))
                _add_switches(switches["decode"], res["switches"])
                rooms_switched += n
            return list(res["ns"])

        items: list[tuple[str, Callable[[int], Any]]] = [
            ("zmq", lambda n: zmq(n, False)),
            ("zmq_yield", lambda n: zmq(n, True)),
            *((f"raw:{s}", lambda n, s=s: raw_writes(n, s)) for s in SIZES),
            *((f"room:{s}", lambda n, s=s: rooms(n, s, False)) for s in SIZES),
            *((f"room_traced:{s}", lambda n, s=s: rooms(n, s, True)) for s in SIZES),
        ]
        # warm-up (connections, registration, page cache), rooms first (NIXL's raw writes need the peer's metadata
        # the rooms' handshake loads): untimed; checks the bytes of every room size
        for key, run in sorted(items, key=lambda item: not item[0].startswith("room")):
            await run(WARM)
            if key.startswith("room:"):
                await ctx.verify("floor", tag, np.arange(int(key.split(":")[1]) // PAGE), what=f"floor {key}")
        marks.clear()
        for s in SIZES:
            traced[s].clear()
        switches = {"prefill": {}, "decode": {}}
        rooms_switched = 0
        rng = np.random.default_rng([p.seed, 0xF100])
        for _ in range(p.floor_rounds):  # a fresh order every round: no measurement always follows the same one
            for i in rng.permutation(len(items)):
                key, run = items[int(i)]
                samples.setdefault(key, []).extend(await run(p.floor_reps))
        await ctx.verify("floor", tag, np.arange(pages), what="floor (raw and rooms)")
        await ctx.dec.call("floor_close")
        res: dict[str, Any] = {
            "clock": clock, "gap_s": p.floor_gap, "rounds": p.floor_rounds, "reps_per_round": p.floor_reps,
            "page_bytes": PAGE,
            "zmq_rtt": summary_us(samples["zmq"]), "zmq_rtt_yield": summary_us(samples["zmq_yield"]),
            "sizes": {},
            "switches_per_room": {side: {k: [round(v[0] / max(rooms_switched, 1), 2),
                                             round(v[1] / max(rooms_switched, 1), 2)] for k, v in sw.items()
                                         if v[0] or v[1]}
                                  for side, sw in switches.items()},
            "switches_rooms": rooms_switched,
            "definition": "zmq: Ping -> Pong between two ControlPlanes of the two processes; raw: one write through "
                          "the native engine, submit to completion (spin); room: decode send_metadata -> done() "
                          "(prefill in wait_ready, then send_kv); floor = zmq + raw medians; CLOCK_MONOTONIC",
        }
        zmq_p50 = res["zmq_rtt"]["p50_us"]
        for s in SIZES:
            raw_s, room_s = summary_us(samples[f"raw:{s}"]), summary_us(samples[f"room:{s}"])
            floor_p50 = zmq_p50 + raw_s["p50_us"]
            res["sizes"][str(s)] = {
                "bytes": s, "raw": raw_s, "floor_p50_us": round(floor_p50, 2),
                "room": room_s, "room_traced": summary_us(samples[f"room_traced:{s}"]),
                "ratio_p50": round(room_s["p50_us"] / floor_p50, 2),
                "ratio_p90": round(room_s["p90_us"] / (res["zmq_rtt"]["p90_us"] + raw_s["p90_us"]), 2),
                "stages": breakdown(marks, traced[s]),
            }
        r4 = res["sizes"][str(4 * KIB)]
        await ctx.progress(f"floor: 4 KiB room p50 {r4['room']['p50_us']} us = {r4['ratio_p50']}x the floor "
                           f"({zmq_p50} us zmq + {r4['raw']['p50_us']} us raw)")
        return res
    finally:
        await echo.plane.aclose(linger=0.0)
        await ctx.close(f)
