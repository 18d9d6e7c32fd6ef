"""Phases that move bulk data: ceilings, throughput per size, scattered pages (with the planning time),
loop lag under load, and requests in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aiotransfer import InvalidArgument, LoopLagMonitor
from aiotransfer._cli.raw import RawMooncake, raw_engine
from aiotransfer._cli.workload import I64, fill_pages
from aiotransfer._staging import gather_pages, host_view

from .ceilings import memcpy_ceiling, tcp_ceiling
from .common import KIB, MIB, gbps, lag_record, median, rep_count, stats_us, timing
from .context import Ctx, addr, attempt, send
from .cpu import ThreadClocks

__all__ = ["phase_ceilings", "phase_concurrency", "phase_lag", "phase_scattered", "phase_throughput"]


async def phase_ceilings(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    sizes = sorted({*p.sizes, *p.sizes_nixl_tcp, p.scattered_pages * 4096, p.conc_size, p.lag_size, 4096})
    memcpy = await ctx.off(memcpy_ceiling, sizes, p.repeats)
    port = (await ctx.dec.call("tcp_sink", bufsize=64 * MIB))["port"]
    try:
        tcp = await ctx.off(tcp_ceiling, p.host, port, sizes, p.repeats, max(p.e2e_reps, 50))
    finally:
        await ctx.dec.call("tcp_sink_stop")
    return {"memcpy": memcpy, "tcp": tcp["sizes"], "tcp_rtt_4k": tcp["rtt_4k"],
            "note": "memcpy: numpy copyto of the same bytes, in-process; tcp: Python sendall/recv_into between "
                    "the two worker processes over loopback, 8-byte header + 1-byte ack per message"}


async def phase_throughput(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    sizes = sorted(p.sizes_nixl_tcp if ctx.spec.key == "nixl_tcp" else p.sizes)
    page = min(64 * KIB, min(sizes))
    pages = max(sizes) // page
    f = await ctx.flat("thr", pages=pages, page_bytes=page)
    try:
        mgr, pool = f.mgrs[0], f.pools[0]
        tag = 0x7A1
        await ctx.off(fill_pages, pool, tag, np.arange(pages, dtype=np.int64))
        raw = raw_engine(mgr, f.session)
        out: dict[str, Any] = {}
        for s in sizes:
            n = s // page
            idx = np.arange(n, dtype=np.int64)
            reps = rep_count(s, p.repeats)
            rooms = ctx.rooms(reps + 1)
            await ctx.arm("thr", str(s), rooms, mgr.endpoint, dst=idx)
            await send(mgr, rooms[0], idx)
            await ctx.verify("thr", tag, idx, what=f"aiotransfer {s} B")
            for style in raw.single_styles:
                await ctx.off(raw.single, style, f.src_base, f.dst_base, s)
                await ctx.verify("thr", tag, idx, what=f"raw {style} {s} B")
            raw_t: dict[str, list[float]] = {st: [] for st in raw.single_styles}
            aio_t: list[float] = []
            order: list[str | None] = [*raw.single_styles, None]
            for r in range(reps):
                k = r % len(order)
                for st in order[k:] + order[:k]:
                    if st is None:
                        aio_t.append(await send(mgr, rooms[r + 1], idx))
                    else:
                        raw_t[st].append(await ctx.off(raw.single, st, f.src_base, f.dst_base, s))
            col = await ctx.collect("thr", str(s))
            raw_med = {st: median(ts) for st, ts in raw_t.items()}
            best = min(raw_med, key=lambda k: raw_med[k])
            aio_med = median(aio_t)
            out[str(s)] = {
                "bytes": s, "reps": reps,
                "aiotransfer": timing(s, aio_t),
                "raw": {st: timing(s, ts) for st, ts in raw_t.items()},
                "raw_best": best,
                "raw_same_call": raw.same_call,
                "ratio": raw_med[best] / aio_med,
                "ratio_same_call": raw_med[raw.same_call] / aio_med,
                "failed": col["failed"],
            }
            await ctx.progress(f"throughput {s // KIB} KiB: aiotransfer {gbps(s, aio_med):.2f} GB/s, "
                               f"raw {gbps(s, raw_med[best]):.2f} GB/s")
        return {"page_bytes": page, "sizes": out}
    finally:
        await ctx.close(f)


async def _planning(mgr: Any, endpoint: str, src: I64, dst: I64, reps: int) -> dict[str, Any]:
    """Planning time on the scattered input, measured on the loop thread where the library runs it:
    ``plan_transfer`` forced direct (``plan_kv_us``) and deciding as ``send_kv`` would
    (``staging_plan_us``), then the gather copy of a staged plan."""
    plan_t, stage_t = [], []
    direct = plan = None
    for _ in range(reps):
        try:
            t0 = time.perf_counter()
            direct = mgr.plan_transfer(endpoint, src, dst, staging=False)
            plan_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plan = mgr.plan_transfer(endpoint, src, dst, staging=None)
            stage_t.append(time.perf_counter() - t0)
        except InvalidArgument:
            return {"error": "decode peer not registered"}
        await asyncio.sleep(0)
    out: dict[str, Any] = {
        "plan_kv_us": median(plan_t) * 1e6,
        "staging_plan_us": median(stage_t) * 1e6,
        "direct_entries": int(direct.entries) if direct is not None else None,
        "staged": bool(plan is not None and plan.staged),
    }
    if plan is not None and plan.staged and plan.src_slice is not None:
        s_sl = plan.src_slice
        kv = [mgr.args.kv[i] for i in plan.src_buffers]
        views = [host_view(b.ptr, b.nbytes) for b in kv]
        counts = [b.num_items for b in kv]
        scratch = np.empty(src.size * s_sl.bytes_per_page * len(views), dtype=np.uint8)
        gather_t = []
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            gather_pages(views, counts, src, s_sl, scratch)
            gather_t.append(time.perf_counter() - t0)
            await asyncio.sleep(0)
        out["gather_ms"] = median(gather_t) * 1e3
    return out


async def phase_scattered(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    n = p.scattered_pages
    pb = 4096
    area = 4 * n
    f = await ctx.flat("sc", pages=area + n, page_bytes=pb)
    try:
        mgr, pool = f.mgrs[0], f.pools[0]
        rng = np.random.default_rng([p.seed, 0x5CA7])
        src = rng.choice(area, size=n, replace=False).astype(np.int64)
        dst = rng.choice(area, size=n, replace=False).astype(np.int64)
        contig = np.arange(area, area + n, dtype=np.int64)
        tag_s, tag_c = 0x5C1, 0x5C2
        await ctx.off(fill_pages, pool, tag_s, src)
        await ctx.off(fill_pages, pool, tag_c, contig)
        raw = raw_engine(mgr, f.session)
        s_addr, d_addr = addr(f.src_base, src, pb), addr(f.dst_base, dst, pb)
        lens = np.full(n, pb, dtype=np.uint64)
        c_src, c_dst, nbytes = f.src_base + area * pb, f.dst_base + area * pb, n * pb
        reps = p.repeats
        rooms = ctx.rooms(reps + 1)
        await ctx.arm("sc", "aio", rooms, mgr.endpoint, dst=dst)
        before = dict(mgr.stats())
        await send(mgr, rooms[0], src)
        await ctx.verify("sc", tag_s, dst, what="aiotransfer scattered")
        after = dict(mgr.stats())
        entries = int(after.get("kv_entries_sent", 0)) - int(before.get("kv_entries_sent", 0))
        staged = int(after.get("staged_pieces", 0)) - int(before.get("staged_pieces", 0))
        await ctx.off(raw.batches, s_addr, d_addr, lens)
        await ctx.verify("sc", tag_s, dst, what="raw page-by-page")
        await ctx.off(raw.single, raw.same_call, c_src, c_dst, nbytes)
        await ctx.verify("sc", tag_c, contig, what="raw contiguous")
        t: dict[str, list[float]] = {"aiotransfer": [], "raw_pages": [], "raw_contiguous": []}
        order = list(t)
        for r in range(reps):
            k = r % len(order)
            for v in order[k:] + order[:k]:
                if v == "aiotransfer":
                    t[v].append(await send(mgr, rooms[r + 1], src))
                elif v == "raw_pages":
                    t[v].append(await ctx.off(raw.batches, s_addr, d_addr, lens))
                else:
                    t[v].append(await ctx.off(raw.single, raw.same_call, c_src, c_dst, nbytes))
        col = await ctx.collect("sc", "aio")
        await ctx.verify("sc", tag_s, dst, what="aiotransfer scattered (last timed run)")
        planning = await _planning(mgr, f.endpoint, src, dst, 20)
        med = {k: median(v) for k, v in t.items()}
        res = {
            "pages": n, "page_bytes": pb, "bytes": nbytes, "reps": reps, "pool_pages": area + n,
            "aiotransfer": {**timing(nbytes, t["aiotransfer"]), "entries": entries, "staged_pieces": staged,
                            "staging": "auto"},
            "raw_pages": {**timing(nbytes, t["raw_pages"]), "entries": n, "call": raw.batch_style,
                          "us_per_entry": med["raw_pages"] / n * 1e6},
            "raw_contiguous": {**timing(nbytes, t["raw_contiguous"]), "entries": 1, "call": raw.same_call},
            "speedup_vs_pages": med["raw_pages"] / med["aiotransfer"],
            "ratio_vs_contiguous": med["raw_contiguous"] / med["aiotransfer"],
            "planning": planning,
            "failed": col["failed"],
        }
        await ctx.progress(f"scattered {n} x 4 KiB: aiotransfer {med['aiotransfer'] * 1e3:.1f} ms, raw pages "
                           f"{med['raw_pages'] * 1e3:.1f} ms, raw contiguous {med['raw_contiguous'] * 1e3:.1f} ms")
        return res
    finally:
        await ctx.close(f)


def _est_gbps(ctx: Ctx, size: int) -> float:
    thr = ctx.results.get("throughput", {}).get("sizes", {})
    if not thr:
        return 1.5
    best = min(thr.values(), key=lambda r: abs(np.log(r["bytes"] / size)))
    g = best["aiotransfer"]["gbps"]
    return float(g) if g == g and g > 0 else 1.5


async def phase_lag(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    size, depth = p.lag_size, p.lag_inflight
    page = min(256 * KIB, size)
    per = size // page
    f = await ctx.flat("lag", pages=depth * per, page_bytes=page)
    try:
        mgr, pool = f.mgrs[0], f.pools[0]
        tag = 0x1A6
        all_pages = np.arange(depth * per, dtype=np.int64)
        await ctx.off(fill_pages, pool, tag, all_pages)
        raw = raw_engine(mgr, f.session)
        count = int(min(max(p.lag_seconds * _est_gbps(ctx, size) * 1e9 / size, 4 * depth), 5000))
        count -= count % depth
        slot = [np.arange(j * per, (j + 1) * per, dtype=np.int64) for j in range(depth)]
        rooms = ctx.rooms(count + 1)
        await ctx.arm("lag", "aio", rooms, mgr.endpoint, dsts=[slot[k % depth] for k in range(count)] + [slot[0]])
        await send(mgr, rooms[-1], slot[0])
        idle = LoopLagMonitor(attribute=True)
        async with idle:
            await asyncio.sleep(min(1.0, p.lag_seconds))
        failures: list[str] = []

        async def worker(j: int) -> None:
            for k in range(j, count, depth):
                _, err = await attempt(send(mgr, rooms[k], slot[j]))
                if err:
                    failures.append(err)

        aio = LoopLagMonitor(attribute=True)
        aio.start()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(j) for j in range(depth)))
        aio_s = time.perf_counter() - t0
        await aio.stop()
        col = await ctx.collect("lag", "aio")
        await ctx.verify("lag", tag, all_pages, what="aiotransfer (lag)")
        ks = np.arange(count) % depth
        src = np.concatenate([addr(f.src_base, slot[j], page)[:1] for j in ks])
        dst = np.concatenate([addr(f.dst_base, slot[j], page)[:1] for j in ks])
        lens = np.full(count, size, dtype=np.uint64)
        rawmon = LoopLagMonitor(attribute=True)
        rawmon.start()
        raw_s, _ = await ctx.off(raw.inflight, src, dst, lens, depth)
        await rawmon.stop()
        await ctx.verify("lag", tag, all_pages, what="raw (lag)")
        nbytes = count * size
        res: dict[str, Any] = {
            "request_bytes": size, "in_flight": depth, "requests": count,
            "idle": lag_record(idle),
            "aiotransfer": {**lag_record(aio), "seconds": aio_s, "gbps": gbps(nbytes, aio_s),
                            "failed": len(failures) + col["failed"], "errors": failures[:3]},
            "raw_thread": {**lag_record(rawmon), "seconds": raw_s, "gbps": gbps(nbytes, raw_s),
                           "call": "transfer_submit_write/check_status" if isinstance(raw, RawMooncake)
                           else "xfer per request, check_xfer_state"},
        }
        s = res["aiotransfer"]
        await ctx.progress(f"lag under load: aiotransfer p99 {s['p99_ms']} ms max {s['max_ms']} ms "
                           f"({s['gbps']:.2f} GB/s, late wake-ups waiting for a CPU: "
                           f"{s.get('late_runqueue_share')}); raw thread p99 {res['raw_thread']['p99_ms']} ms")
        return res
    finally:
        await ctx.close(f)


async def phase_concurrency(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    size = p.conc_size
    top = max(p.conc_levels)
    f = await ctx.flat("conc", pages=top, page_bytes=size)
    try:
        mgr, pool = f.mgrs[0], f.pools[0]
        tag = 0xC0C
        await ctx.off(fill_pages, pool, tag, np.arange(top, dtype=np.int64))
        raw = raw_engine(mgr, f.session)
        warm = ctx.rooms(1)
        await ctx.arm("conc", "warm", warm, mgr.endpoint, dst=[0])
        await send(mgr, warm[0], [0])
        await ctx.collect("conc", "warm")
        levels: dict[str, Any] = {}
        clocks = ThreadClocks()
        for li, n in enumerate(sorted(p.conc_levels)):
            total = max(p.conc_requests, 2 * n)
            total -= total % n
            rooms = ctx.rooms(total)
            await ctx.arm("conc", str(n), rooms, mgr.endpoint, dsts=[[k % n] for k in range(total)])
            lat: list[float] = []
            failures: list[str] = []

            async def worker(j: int, rooms: list[int] = rooms, n: int = n, total: int = total,
                             lat: list[float] = lat, failures: list[str] = failures) -> None:
                for k in range(j, total, n):
                    dt, err = await attempt(send(mgr, rooms[k], [j]))
                    if err:
                        failures.append(err)
                    else:
                        lat.append(dt)

            async def run_aio(n: int = n, worker: Callable[[int], Awaitable[None]] = worker) -> tuple[float, int]:
                before = clocks.read()
                c0, t0 = time.thread_time_ns(), time.perf_counter()
                await asyncio.gather(*(worker(j) for j in range(n)))
                wall, loop_ns = time.perf_counter() - t0, time.thread_time_ns() - c0
                d = clocks.delta(before, clocks.read())
                return wall, loop_ns + d["driver"] + d["offload"]

            ks = np.arange(total) % n
            src, dst = addr(f.src_base, ks, size), addr(f.dst_base, ks, size)
            lens = np.full(total, size, dtype=np.uint64)
            if li % 2 == 0:
                aio_s, aio_ns = await run_aio()
                col = await ctx.collect("conc", str(n))
                await ctx.verify("conc", tag, np.arange(n), what=f"aiotransfer {n} in flight")
                (raw_s, raw_lat), raw_ns = await ctx.off(_thread_cpu, raw.inflight, src, dst, lens, n)
                await ctx.verify("conc", tag, np.arange(n), what=f"raw {n} in flight")
            else:
                (raw_s, raw_lat), raw_ns = await ctx.off(_thread_cpu, raw.inflight, src, dst, lens, n)
                await ctx.verify("conc", tag, np.arange(n), what=f"raw {n} in flight")
                aio_s, aio_ns = await run_aio()
                col = await ctx.collect("conc", str(n))
                await ctx.verify("conc", tag, np.arange(n), what=f"aiotransfer {n} in flight")
            nbytes = total * size
            levels[str(n)] = {
                "in_flight": n, "requests": total,
                "aiotransfer": {"seconds": aio_s, "gbps": gbps(nbytes, aio_s), "latency": stats_us(lat),
                                "cpu_us_per_request": round(aio_ns / total / 1e3, 1),
                                "failed": len(failures) + col["failed"], "errors": failures[:3] + col["errors"][:3]},
                "raw": {"seconds": raw_s, "gbps": gbps(nbytes, raw_s), "latency": stats_us(raw_lat),
                        "cpu_us_per_request": round(raw_ns / total / 1e3, 1)},
            }
            await ctx.progress(f"concurrency {n}: aiotransfer {gbps(nbytes, aio_s):.2f} GB/s, "
                               f"raw {gbps(nbytes, raw_s):.2f} GB/s, {len(failures) + col['failed']} failed")
        return {"request_bytes": size, "levels": levels,
                "latency_note": "aiotransfer: prefill-side send_kv call (queueing for engine credit included); "
                                "raw: submit to completion seen by the polling thread",
                "cpu_note": "aiotransfer: the prefill's library CPU per request (event loop thread, engine driver, "
                            "offload executor); raw: the CPU of the thread that posts and polls, per write"}
    finally:
        await ctx.close(f)


def _thread_cpu(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` and the CPU ns the calling thread spent in it."""
    c0 = time.thread_time_ns()
    out = fn(*args)
    return out, time.thread_time_ns() - c0
