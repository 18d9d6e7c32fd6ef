"""The ``cpu`` phase: the library's CPU time per call on the prefill side, against the raw engine's CPU time for
the same engine entries, in the same two processes, alternating.

The setup: ``cpu_buffers`` KV buffers on both sides (K then V of ``cpu_buffers // 2`` layers), pages of
``cpu_page_bytes``, ``staging="never"`` (the library posts the entries the raw engine posts). Page ``i`` of a
request is source page ``2 i`` and destination page ``2 i + 1``: every other page on both sides, so no two
pages of a request are adjacent and every (page, buffer) is its own engine entry (no run coalesces).

The calls, each timed alone after ``cpu_gap`` of idle:

* ``send_kv`` of each of ``cpu_pages`` pages, one room per call (the decode posts the room first, outside the
  measurement); the largest also with its pages given as a Python list instead of a NumPy array;
* ``send_layers`` of one layer (2 buffers) of a streamed chunk of ``cpu_layer_pages`` pages, the layers sent
  one after the other; the call that sends a chunk's last layer (and concludes the room) is kept apart;
* the same for a chunk of as many contiguous pages on both sides (pages past the scattered ones), which
  coalesce into one entry per buffer: a layer is then 2 entries, and what it costs above the raw engine is
  the library's own cost per layer, the shape of a layer on a GPU (a few large entries).

Library CPU of a call = the event loop thread's CPU time (``time.thread_time``) plus the CPU time of the
library's threads (the engine's driver ``aiotransfer-driver-*``, the offload executor ``aiotransfer-*``), read
from the kernel's per-thread clocks before and after the call. The engine's own threads (Mooncake's workers,
UCX's and NIXL's progress threads) and ZeroMQ's I/O threads are not the library's: their CPU time over the
same window is reported apart and counted on neither side. Raw CPU of a write = the CPU time of the thread
that posts the same entries with the manager's own native engine and polls them to completion
(:meth:`~aiotransfer._cli.raw.RawEngine.drain`), at most ``max_entries_in_flight`` in flight, sleeping
``poll_interval_min`` after a poll that completed nothing. Finally one call of the largest ``send_kv``, and one
``send_layers`` call, run under a CPU-time profiler on every library thread
(:mod:`~benchmarks.suite.cpu_profile`).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Awaitable
from typing import Any

import numpy as np

from aiotransfer._cli.raw import RawEngine, raw_engine
from aiotransfer._cli.workload import I64, fill_pages
from aiotransfer._plan import Blocks, as_index_array

from .common import TIMEOUT, median
from .context import Ctx, Flat
from .cpu_profile import CATEGORIES, profile_call

__all__ = ["GROUPS", "ThreadClocks", "phase_cpu"]

GROUPS = ("driver", "offload", "harness", "zmq", "native")
"""Threads other than the event loop's: the library's driver and offload threads, the harness's Python threads,
ZeroMQ's I/O threads, and the other native threads (the engine's own, the BLAS pool)."""
TAG = 0xC9
WARM_ROOMS = 3


def _cpu_clock(tid: int) -> int:
    """The clock id of thread ``tid``'s CPU time (Linux: ``CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD`` on the tid)."""
    return ((~tid) << 3) | 6


class ThreadClocks:
    """CPU time of this process's threads other than the calling one, from the kernel's per-thread clocks,
    each thread in one of :data:`GROUPS`."""

    def __init__(self) -> None:
        self.loop_tid = threading.get_native_id()
        self._native: dict[int, str] = {}

    @staticmethod
    def _python_group(name: str) -> str:
        if name.startswith("aiotransfer-driver-"):
            return "driver"
        return "offload" if name.startswith("aiotransfer-") else "harness"

    def _native_group(self, tid: int) -> str:
        group = self._native.get(tid)
        if group is None:
            try:
                with open(f"/proc/self/task/{tid}/comm") as fh:
                    comm = fh.read().strip()
            except OSError:
                comm = ""
            group = self._native[tid] = "zmq" if comm.startswith("ZMQbg") else "native"
        return group

    def read(self) -> dict[int, tuple[str, int]]:
        """Thread id -> (group, CPU ns)."""
        python = {t.native_id: self._python_group(t.name) for t in threading.enumerate() if t.native_id is not None}
        out: dict[int, tuple[str, int]] = {}
        for entry in os.listdir("/proc/self/task"):
            tid = int(entry)
            if tid == self.loop_tid:
                continue
            try:
                ns = time.clock_gettime_ns(_cpu_clock(tid))
            except OSError:
                continue  # the thread ended meanwhile
            out[tid] = (python.get(tid) or self._native_group(tid), ns)
        return out

    @staticmethod
    def delta(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, int]:
        """CPU ns per group between two readings (a thread started in between counts from zero)."""
        out = dict.fromkeys(GROUPS, 0)
        for tid, (group, ns) in after.items():
            prev = before.get(tid)
            out[group] += ns - (prev[1] if prev is not None and prev[0] == group else 0)
        return out


async def _library_call(clocks: ThreadClocks, aw: Awaitable[Any]) -> dict[str, int]:
    """CPU ns of the loop thread and of each group of threads while ``aw`` runs, and its wall time."""
    before = clocks.read()
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    await aw
    w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    d = clocks.delta(before, clocks.read())
    return {"library": c1 - c0 + d["driver"] + d["offload"], "loop": c1 - c0, **d, "wall": w1 - w0}


def _summary(samples: list[dict[str, int]], keys: tuple[str, ...]) -> dict[str, Any]:
    """Medians (µs) of each key; ``samples_us`` of the first."""
    out: dict[str, Any] = {"n": len(samples)}
    for k in keys:
        out[f"{k}_us"] = round(median([s[k] / 1e3 for s in samples]), 1)
    out["samples_us"] = [round(s[keys[0]] / 1e3, 1) for s in samples]
    return out


_LIB_KEYS = ("library", "loop", "driver", "offload", "wall", "native", "zmq")
_RAW_KEYS = ("raw", "wall", "native", "zmq")


class _Run:
    """What every measurement of the phase shares."""

    def __init__(self, ctx: Ctx, f: Flat, raw: RawEngine) -> None:
        self.ctx, self.f, self.raw = ctx, f, raw
        self.mgr = f.mgrs[0]
        self.clocks = ThreadClocks()
        self.window = int(self.mgr.config.max_entries_in_flight)
        self.pause = float(self.mgr.config.poll_interval_min)
        self.gap = ctx.params.cpu_gap

    async def room(self, dst: I64) -> tuple[Any, int]:
        """A room the decode has posted (``dst``), its sender ready."""
        room = self.ctx.rooms(1)[0]
        await self.ctx.arm("cpu", str(room), [room], self.mgr.endpoint, dst=dst, timeout=TIMEOUT)
        tx = self.mgr.sender(room)
        await tx.wait_ready(timeout=TIMEOUT)
        return tx, room

    async def collect(self, room: int) -> None:
        col = await self.ctx.collect("cpu", str(room))
        if col["failed"]:
            raise RuntimeError(f"cpu: room {room} failed on the decode: {col['errors']}")

    async def send_kv(self, src: Any, dst: I64) -> dict[str, int]:
        tx, room = await self.room(dst)
        await asyncio.sleep(self.gap)
        s = await _library_call(self.clocks, tx.send_kv(src, timeout=TIMEOUT))
        await self.collect(room)
        return s

    async def raw_write(self, b: Blocks) -> dict[str, int]:
        await asyncio.sleep(self.gap)
        before = self.clocks.read()
        wall, cpu = await self.ctx.off(self.raw.drain, b.src, b.dst, b.length, self.window, self.pause)
        d = self.clocks.delta(before, self.clocks.read())
        return {"raw": int(cpu * 1e9), "wall": int(wall * 1e9), "native": d["native"], "zmq": d["zmq"]}

    def entries_sent(self) -> int:
        return int(self.mgr.stats().get("kv_entries_sent", 0))


async def _conversion(src: I64, reps: int) -> dict[str, float]:
    """CPU time (median, µs) of the library turning ``send_kv``'s pages into its index array
    (:func:`~aiotransfer._plan.as_index_array`), given as a Python list and as a NumPy array, on the loop thread
    where the library does it."""
    out: dict[str, float] = {}
    for name, pages in (("list", src.tolist()), ("array", src)):
        ts = []
        for _ in range(reps):
            c0 = time.thread_time_ns()
            as_index_array(pages, what="send_kv indices")
            ts.append(time.thread_time_ns() - c0)
            await asyncio.sleep(0)
        out[f"{name}_us"] = round(median(ts) / 1e3, 2)
    return out


def _compare(lib: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    return {"diff_us": round(lib["library_us"] - raw["raw_us"], 1),
            "ratio": round(lib["library_us"] / raw["raw_us"], 2) if raw["raw_us"] > 0 else None}


async def _send_kv_case(run: _Run, src: I64, dst: I64, reps: int, with_list: bool) -> dict[str, Any]:
    ctx, mgr, n = run.ctx, run.mgr, int(src.size)
    blocks = mgr.plan_transfer(run.f.endpoint, src, dst, staging=False).blocks
    auto = mgr.plan_transfer(run.f.endpoint, src, dst, staging=None)
    before = run.entries_sent()
    await run.send_kv(src, dst)
    posted = run.entries_sent() - before
    if posted != len(blocks):
        raise RuntimeError(f"cpu: send_kv of {n} pages posted {posted} entries, the plan has {len(blocks)}")
    await ctx.verify("cpu", TAG, dst, what=f"cpu: send_kv {n} pages")
    await run.raw_write(blocks)
    await ctx.verify("cpu", TAG, dst, what=f"cpu: raw write of {n} pages")
    for _ in range(WARM_ROOMS - 1 if len(blocks) <= 65536 else 0):
        await run.send_kv(src, dst)
        await run.raw_write(blocks)
    as_list = src.tolist()
    variants = ["library", "raw", *(["library_list"] if with_list else [])]
    samples: dict[str, list[dict[str, int]]] = {v: [] for v in variants}
    for r in range(reps):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            if v == "raw":
                samples[v].append(await run.raw_write(blocks))
            else:
                samples[v].append(await run.send_kv(as_list if v == "library_list" else src, dst))
    await ctx.verify("cpu", TAG, dst, what=f"cpu: send_kv {n} pages (timed)")
    lib, raw = _summary(samples["library"], _LIB_KEYS), _summary(samples["raw"], _RAW_KEYS)
    out: dict[str, Any] = {"call": "send_kv", "pages": n, "entries": len(blocks), "reps": reps,
                           "auto_would_stage": bool(auto.staged), "library": lib, "raw": raw, **_compare(lib, raw)}
    if with_list:
        ls = _summary(samples["library_list"], _LIB_KEYS)
        out["library_list"] = {**ls, **_compare(ls, raw),
                               "list_minus_array_us": round(ls["library_us"] - lib["library_us"], 1),
                               "conversion": await _conversion(src, 200)}
    await ctx.progress(f"cpu: send_kv {n:,} page{'s' if n != 1 else ''} ({len(blocks):,} entries): library {lib['library_us']:.0f} us, "
                       f"raw {raw['raw_us']:.0f} us of CPU per call")
    return out


def _layer_blocks(blocks: Blocks, bases: list[int], layers: int) -> list[Blocks]:
    """The entries of each layer (buffer ``b`` holds layer ``b % layers``), found by their source buffer."""
    buf = np.searchsorted(np.asarray(bases, dtype=np.uint64), blocks.src, side="right") - 1
    out = []
    for layer in range(layers):
        m = (buf % layers) == layer
        out.append(Blocks(blocks.src[m], blocks.dst[m], blocks.length[m]))
    return out


async def _layers_case(run: _Run, src: I64, dst: I64, reps: int, contiguous: bool = False) -> dict[str, Any]:
    ctx, mgr, n = run.ctx, run.mgr, int(src.size)
    layers = ctx.params.cpu_buffers // 2
    per_layer = _layer_blocks(mgr.plan_transfer(run.f.endpoint, src, dst, staging=False).blocks,
                              run.f.pools[0].bases, layers)
    entries = 2 if contiguous else 2 * n
    if any(len(b) != entries for b in per_layer):
        raise RuntimeError(f"cpu: expected {entries} entries per layer, got {[len(b) for b in per_layer]}")
    samples: dict[str, list[dict[str, int]]] = {"library": [], "raw": [], "last": []}
    posted: list[int] = []
    calls = 0

    async def chunk(timed: bool) -> None:
        nonlocal calls
        tx, room = await run.room(dst)
        stream = tx.stream(src)
        for layer in range(layers):
            last = layer == layers - 1
            calls += 1
            order = ("library", "raw") if calls % 2 else ("raw", "library")
            for v in order:
                if v == "raw":
                    s = await run.raw_write(per_layer[layer])
                    if timed and not last:
                        samples["raw"].append(s)
                    continue
                before = run.entries_sent()
                await asyncio.sleep(run.gap)
                s = await _library_call(run.clocks, stream.send_layers(layer, timeout=TIMEOUT))
                posted.append(run.entries_sent() - before)
                if timed:
                    samples["last" if last else "library"].append(s)
        await run.collect(room)

    await chunk(False)
    await ctx.verify("cpu", TAG, dst, what=f"cpu: send_layers of {n} pages and raw layer writes")
    if any(p != entries for p in posted):
        raise RuntimeError(f"cpu: send_layers posted {sorted(set(posted))} entries per call, expected {entries}")
    while len(samples["library"]) < reps:
        await chunk(True)
    await ctx.verify("cpu", TAG, dst, what=f"cpu: send_layers of {n} pages (timed)")
    lib, raw = _summary(samples["library"], _LIB_KEYS), _summary(samples["raw"], _RAW_KEYS)
    kind = "contiguous " if contiguous else ""
    await ctx.progress(f"cpu: send_layers of one layer, {n} {kind}pages ({entries} entries): library "
                       f"{lib['library_us']:.0f} us, raw {raw['raw_us']:.0f} us of CPU per call")
    return {"call": "send_layers", "pages": n, "contiguous": contiguous, "layer_buffers": 2, "entries": entries,
            "layers": layers,
            "reps": len(samples["library"]), "library": lib, "raw": raw, **_compare(lib, raw),
            "last_call": _summary(samples["last"], _LIB_KEYS)}


async def _profile_layer(run: _Run, src: I64, dst: I64) -> dict[str, Any]:
    """One chunk streamed layer by layer, its second layer's ``send_layers`` call profiled."""
    layers = run.ctx.params.cpu_buffers // 2
    tx, room = await run.room(dst)
    stream = tx.stream(src)
    prof: dict[str, Any] = {}
    for layer in range(layers):
        if layer == min(1, layers - 1):
            await asyncio.sleep(run.gap)
            prof = await profile_call(run.mgr, functools.partial(stream.send_layers, layer, timeout=TIMEOUT))
        else:
            await stream.send_layers(layer, timeout=TIMEOUT)
    await run.collect(room)
    return prof


def _breakdown(prof: dict[str, Any], call: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """Each thread's category shares from the profile, applied to the unprofiled median CPU of that thread."""
    lib = call["library"]
    est = dict.fromkeys(CATEGORIES, 0.0)
    threads: dict[str, Any] = {}
    for where in ("loop", "driver", "offload"):
        p = prof[where]
        total = sum(p["seconds"][c] for c in CATEGORIES)
        shares = {c: (p["seconds"][c] / total if total else 0.0) for c in CATEGORIES}
        for c, f in shares.items():
            est[c] += f * lib[f"{where}_us"]
        threads[where] = {"unprofiled_us": lib[f"{where}_us"], "profiled_ms": p["cpu_ms"],
                          "shares": {c: round(f, 3) for c, f in shares.items()}, "top": p["top"]}
    return {"call": name or f"send_kv of {call['pages']:,} pages ({call['entries']:,} entries)",
            "estimate_us": {c: round(v, 1) for c, v in est.items()}, "threads": threads}


async def phase_cpu(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    nbuf, pb = p.cpu_buffers, p.cpu_page_bytes
    top = max(*p.cpu_pages, p.cpu_layer_pages)
    f = await ctx.flat("cpu", pages=2 * top + p.cpu_layer_pages, page_bytes=pb, nbuf=nbuf, num_layers=nbuf // 2,
                       cfgs=[{"staging": "never"}])
    try:
        src_all: I64 = np.arange(top, dtype=np.int64) * 2
        dst_all: I64 = src_all + 1
        await ctx.off(fill_pages, f.pools[0], TAG, src_all)
        run = _Run(ctx, f, raw_engine(f.mgrs[0], f.session))
        await run.send_kv(src_all[:1], dst_all[:1])  # the decode registers with its first room: plans need it
        calls: dict[str, Any] = {}
        biggest = max(p.cpu_pages)
        for n, reps in zip(p.cpu_pages, p.cpu_reps, strict=True):
            calls[f"send_kv:{n}"] = await _send_kv_case(run, src_all[:n], dst_all[:n], reps, n == biggest)
        n = p.cpu_layer_pages
        calls["send_layers"] = await _layers_case(run, src_all[:n], dst_all[:n], p.cpu_layer_reps)
        run_pages: I64 = np.arange(2 * top, 2 * top + n, dtype=np.int64)
        await ctx.off(fill_pages, f.pools[0], TAG, run_pages)
        calls["send_layers_contiguous"] = await _layers_case(run, run_pages, run_pages, p.cpu_layer_reps, True)
        tx, room = await run.room(dst_all[:biggest])
        await asyncio.sleep(run.gap)
        prof = await profile_call(run.mgr, lambda: tx.send_kv(src_all[:biggest], timeout=TIMEOUT))
        await run.collect(room)
        layer_prof = await _profile_layer(run, src_all[:n], dst_all[:n])
        return {
            "buffers": nbuf, "page_bytes": pb, "pool_pages": 2 * top + n, "staging": "never",
            "layout": "page i of a request: source page 2i, destination page 2i+1 (every other page on both sides: "
                      "one engine entry per page and buffer)",
            "window": run.window, "raw_pause_s": run.pause, "gap_s": run.gap,
            "raw_call": run.raw.drain_style,
            "calls": calls,
            "breakdown": _breakdown(prof, calls[f"send_kv:{biggest}"]),
            "layer_breakdown": _breakdown(layer_prof, calls["send_layers"],
                                          f"send_layers, 1 layer of {n:,} pages ({2 * n:,} entries)"),
            "definition": "library CPU = event-loop thread + the library's driver and offload threads, per call; "
                          "raw CPU = the posting thread's CPU, the same entries through the native engine polled to "
                          "completion (sleeping poll_interval_min between polls that complete nothing); the engine's "
                          "own threads and ZeroMQ's I/O threads (native_us, zmq_us) counted on neither side; medians",
        }
    finally:
        await ctx.close(f)
