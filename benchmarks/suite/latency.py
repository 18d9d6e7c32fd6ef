"""Latency phases: a 4 KiB ``send_kv`` through ``done()`` on both sides (end to end, one clock for both
processes), and ``send_aux`` by path."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from aiotransfer._cli.raw import raw_engine
from aiotransfer._cli.workload import fill_pages

from .common import TIMEOUT, aux_pattern, stats_us
from .context import Ctx

__all__ = ["phase_aux", "phase_e2e"]


async def _clock_check(ctx: Ctx, n: int = 20) -> dict[str, Any]:
    """Both workers read CLOCK_MONOTONIC: the decode's reading must fall between ours around the call."""
    before, after = [], []
    ok = True
    for _ in range(n):
        a = time.monotonic()
        d = (await ctx.dec.call("clock"))["t"]
        b = time.monotonic()
        ok &= a <= d <= b
        before.append(d - a)
        after.append(b - d)
    return {"clock": "time.monotonic", "info": str(time.get_clock_info("monotonic")),
            "consistent": ok, "decode_minus_before_us": stats_us(before), "after_minus_decode_us": stats_us(after)}


async def phase_e2e(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    slots = 64
    f = await ctx.flat("e2e", pages=slots, page_bytes=4096)
    try:
        mgr, pool = f.mgrs[0], f.pools[0]
        tag = 0xE2E
        await ctx.off(fill_pages, pool, tag, np.arange(slots, dtype=np.int64))
        raw = raw_engine(mgr, f.session)
        clock = await _clock_check(ctx)
        warm, reps = 10, p.e2e_reps
        rooms = ctx.rooms(warm + reps)
        await ctx.arm("e2e", "b", rooms, mgr.endpoint, dsts=[[k % slots] for k in range(len(rooms))])
        t_start, t_sent, t_done = [], [], []
        failures: list[str] = []
        for k, room in enumerate(rooms):
            try:
                tx = mgr.sender(room)
                await tx.wait_ready(timeout=TIMEOUT)
                t0 = time.monotonic()
                await tx.send_kv([k % slots], timeout=TIMEOUT)
                t1 = time.monotonic()
                await tx.done(timeout=TIMEOUT)
                t2 = time.monotonic()
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                t0 = t1 = t2 = float("nan")
            t_start.append(t0)
            t_sent.append(t1)
            t_done.append(t2)
            await asyncio.sleep(0.001)  # let the decode settle (no overlap between requests)
        col = await ctx.collect("e2e", "b")
        await ctx.verify("e2e", tag, np.arange(min(slots, len(rooms))), what="aiotransfer 4 KiB")
        ts0, ts1, ts2 = (np.asarray(x[warm:]) for x in (t_start, t_sent, t_done))
        td = np.asarray(col["done_ts"][warm:])
        e2e = np.maximum(ts2, td) - ts0
        ok = np.isfinite(e2e)
        for _ in range(warm):
            await ctx.off(raw.latency, f.src_base, f.dst_base, 4096)
        raw_lat = [await ctx.off(raw.latency, f.src_base, f.dst_base, 4096) for _ in range(reps)]
        await ctx.verify("e2e", tag, [0], what="raw 4 KiB")
        res: dict[str, Any] = {
            "bytes": 4096, "reps": reps, "clock": clock,
            "aiotransfer": {
                "e2e": stats_us(e2e[ok].tolist()),
                "send_kv": stats_us((ts1 - ts0)[ok].tolist()),
                "decode_done": stats_us((td - ts0)[ok].tolist()),
                "prefill_done": stats_us((ts2 - ts0)[ok].tolist()),
                "failed": len(failures) + col["failed"],
                "definition": "max(prefill done(), decode done()) - start of send_kv, CLOCK_MONOTONIC in both",
            },
            "raw": {**stats_us(raw_lat), "call": "single 4 KiB write, submit to completion (spin); no "
                    "notification to the decode"},
        }
        await ctx.progress(f"4 KiB end to end: p50 {res['aiotransfer']['e2e']['p50_us']} us, "
                           f"p99 {res['aiotransfer']['e2e']['p99_us']} us (raw write p50 {res['raw']['p50_us']} us)")
        return res
    finally:
        await ctx.close(f)


async def phase_aux(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    paths = ("engine", "tcp")
    warm, reps = 5, p.aux_reps
    per_path = warm + reps
    slots = 2 * per_path
    f = await ctx.flat("aux", pages=64, page_bytes=4096, n=2, cfgs=[{"aux_path": x} for x in paths],
                       aux_slots=slots, aux_bytes=p.aux_bytes)
    try:
        rooms = {x: ctx.rooms(per_path) for x in paths}
        dst_slot = {x: [2 * j + i for j in range(per_path)] for i, x in enumerate(paths)}

        def fill() -> None:
            for i, x in enumerate(paths):
                for j, room in enumerate(rooms[x]):
                    f.auxes[i][j] = aux_pattern(room, p.aux_bytes)

        await ctx.off(fill)
        for i, x in enumerate(paths):
            await ctx.arm("aux", x, rooms[x], f.mgrs[i].endpoint, dsts=[[j % 64] for j in range(per_path)],
                          aux=dst_slot[x])
        t_start: dict[str, list[float]] = {x: [] for x in paths}
        t_call: dict[str, list[float]] = {x: [] for x in paths}
        used: dict[str, set[str]] = {x: set() for x in paths}
        failures: list[str] = []
        for j in range(per_path):
            for i, x in enumerate(paths) if j % 2 == 0 else reversed(list(enumerate(paths))):
                try:
                    tx = f.mgrs[i].sender(rooms[x][j])
                    await tx.wait_ready(timeout=TIMEOUT)
                    await tx.send_kv([j % 64], timeout=TIMEOUT)
                    t0 = time.monotonic()
                    await tx.send_aux(j, timeout=TIMEOUT)
                    t1 = time.monotonic()
                    await tx.done(timeout=TIMEOUT)
                    used[x].add(str(tx.aux_path))
                except Exception as exc:
                    failures.append(f"{x}: {type(exc).__name__}: {exc}")
                    t0 = t1 = float("nan")
                t_start[x].append(t0)
                t_call[x].append(t1 - t0)
                await asyncio.sleep(0.001)
        out: dict[str, Any] = {"aux_bytes": p.aux_bytes, "reps": reps, "paths": {}}
        for x in paths:
            col = await ctx.collect("aux", x)
            bad = (await ctx.dec.call("verify_aux", name="aux", rooms=rooms[x], slots=dst_slot[x]))["bad"]
            td = np.asarray(col["done_ts"][warm:])
            e2e = td - np.asarray(t_start[x][warm:])
            ok = np.isfinite(e2e)
            out["paths"][x] = {
                "e2e": stats_us(e2e[ok].tolist()),
                "send_aux_call": stats_us(np.asarray(t_call[x][warm:])[ok].tolist()),
                "paths_used": sorted(used[x]),
                "decode_paths_seen": sorted({str(a) for a in col["aux_paths"]}),
                "failed": col["failed"], "bad_aux_slots": bad,
            }
        out["failed"] = len(failures)
        out["errors"] = failures[:3]
        out["definition"] = ("e2e: send_aux start (after the last KV chunk) to decode done(), i.e. aux landed and "
                             "Success seen by decode; CLOCK_MONOTONIC in both processes")
        e, t = out["paths"]["engine"]["e2e"], out["paths"]["tcp"]["e2e"]
        await ctx.progress(f"send_aux: engine p50 {e['p50_us']} us / tcp p50 {t['p50_us']} us")
        return out
    finally:
        await ctx.close(f)
