"""The TP phase: a Llama-8B-shaped request from prefill TP 4 to decode TP 2, head-sliced, direct
(``staging="never"``) against staged (``staging="always"``), and the raw engine's contiguous ceiling."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np

from aiotransfer import KVArgs, KVManager
from aiotransfer._cli.raw import raw_engine
from aiotransfer._cli.workload import I64, KVPool

from .common import TIMEOUT, timing, tp_fill
from .context import Ctx

__all__ = ["phase_tp"]


async def _tp_raw_ceiling(ctx: Ctx, mgrs: list[Any], pools: list[KVPool], info: dict[str, Any], per_buffer: int,
                          reps: int) -> dict[str, Any]:
    """The raw engine moving the same bytes as one contiguous entry per (prefill rank, layer buffer)."""
    p_tp, d_tp = len(mgrs), len(info["sessions"])
    ratio = p_tp // d_tp
    jobs = []
    for r, (m, pool) in enumerate(zip(mgrs, pools, strict=True)):
        d = r // ratio
        src = np.asarray(pool.bases, dtype=np.uint64)
        dst = np.asarray(info["bases"][d], dtype=np.uint64) + np.uint64((r % ratio) * per_buffer)
        jobs.append((raw_engine(m, info["sessions"][d]), src, dst, np.full(src.size, per_buffer, dtype=np.uint64)))

    def run() -> float:
        return sum(raw.batches(s, d, n) for raw, s, d, n in jobs)

    await ctx.off(run)
    times = [await ctx.off(run) for _ in range(max(reps, 1))]
    return {**timing(per_buffer * sum(j[1].size for j in jobs), times),
            "entries": sum(int(j[1].size) for j in jobs), "call": jobs[0][0].batch_style}


async def phase_tp(ctx: Ctx) -> dict[str, Any]:
    p = ctx.params
    layers, rows, heads, hdim = p.tp_layers, 16, 8, 128
    p_tp, d_tp = 4, 2
    hp, hw = heads // p_tp, hdim * 2 // 8
    nbuf = 2 * layers
    npages = -(-p.tp_tokens // rows)
    pool_pages = npages + npages // 4 + 2
    rng = np.random.default_rng([p.seed, 0x7B42])
    src = rng.choice(pool_pages, size=npages, replace=False).astype(np.int64)
    dst = rng.choice(pool_pages, size=npages, replace=False).astype(np.int64)
    tag = 0x7B4
    page_bytes_p = rows * hp * hdim * 2
    nbytes = npages * nbuf * page_bytes_p * p_tp
    pools = []
    for r in range(p_tp):
        pool = KVPool(nbuf, pool_pages, (rows, hp, hdim), layer_ids=[b % layers for b in range(nbuf)])
        await ctx.off(pool.prefault)
        await ctx.off(tp_fill, pool, tag, src, rows, heads, hw, r * hp, hp)
        pools.append(pool)
    out: dict[str, Any] = {
        "geometry": {"tokens": p.tp_tokens, "pages": npages, "layers": layers, "buffers": nbuf, "rows_per_page": rows,
                     "kv_heads": heads, "head_dim": hdim, "elem_bytes": 2, "prefill_tp": p_tp, "decode_tp": d_tp,
                     "bytes_per_prefill_rank": nbytes // p_tp, "bytes": nbytes},
        "modes": {},
    }
    credits = {"max_entries_in_flight": 1024 // p_tp} if p.tp_split_credits else {}
    out["config"] = {"per_manager": credits or "library defaults",
                     "note": "the 4 prefill managers share this process's Mooncake engine"}
    for mode in ("never", "always"):
        reps = p.tp_never_repeats if mode == "never" else p.tp_always_repeats
        name = f"tp-{mode}"
        mgrs: list[Any] = []
        try:
            leader = await asyncio.wait_for(KVManager(
                KVArgs(pools[0].buffers, page_size=rows, dtype="uint16", kv_layer_ids=pools[0].layer_ids,
                       tp_size=p_tp, tp_rank=0, kv_heads=hp, total_kv_heads=heads),
                ctx.config(staging=mode, **credits)).start(), 60.0)
            mgrs.append(leader)
            for r in range(1, p_tp):
                follower = await asyncio.wait_for(KVManager(
                    KVArgs(pools[r].buffers, page_size=rows, dtype="uint16", kv_layer_ids=pools[r].layer_ids,
                           tp_size=p_tp, tp_rank=r, kv_heads=hp, total_kv_heads=heads),
                    ctx.config(staging=mode, bootstrap=leader.endpoint, **credits)).start(), 60.0)
                mgrs.append(follower)
            info = await ctx.dec.call("setup", name=name, kind="tp", ranks=d_tp, layers=layers, pages=pool_pages,
                                      rows=rows, heads=heads, head_dim=hdim)

            async def one(room: int, pages_src: I64, mgrs: list[Any] = mgrs) -> float:
                txs = [m.sender(room) for m in mgrs]
                await asyncio.gather(*(tx.wait_ready(timeout=TIMEOUT) for tx in txs))
                t0 = time.perf_counter()
                await asyncio.gather(*(tx.send_kv(pages_src, timeout=3 * TIMEOUT) for tx in txs))
                dt = time.perf_counter() - t0
                await asyncio.gather(*(tx.done(timeout=TIMEOUT) for tx in txs))
                return dt

            warm = ctx.rooms(1)
            await ctx.arm(name, "warm", warm, leader.endpoint, dst=dst[:2])
            await one(warm[0], src[:2])
            wc = await ctx.collect(name, "warm")
            if wc["failed"]:
                raise RuntimeError(f"TP warm-up failed on decode: {wc['errors']}")
            before = [dict(m.stats()) for m in mgrs]
            rooms = ctx.rooms(reps)
            times = []
            bad = 0
            for i, room in enumerate(rooms):
                await ctx.arm(name, str(i), [room], leader.endpoint, dst=dst)
                await ctx.progress(f"TP 4->2 staging={mode}: request {i + 1}/{reps} ...")
                times.append(await one(room, src))
                col = await ctx.collect(name, str(i))
                if col["failed"]:
                    raise RuntimeError(f"TP staging={mode}: decode failed: {col['errors']}")
                if i == 0:
                    bad = (await ctx.dec.call("verify", name=name, tag=tag, pages=dst.tolist(), poison=False))["bad"]
                    if bad:
                        raise RuntimeError(f"TP staging={mode}: {bad} mismatched pages on decode")
            after = [dict(m.stats()) for m in mgrs]

            def delta(key: str, before: list[dict[str, Any]] = before, after: list[dict[str, Any]] = after) -> int:
                return sum(int(a.get(key, 0)) - int(b.get(key, 0)) for a, b in zip(after, before, strict=True))

            rec: dict[str, Any] = {
                **timing(nbytes, times),
                "entries": delta("kv_entries_sent") // reps,
                "staged_pieces": delta("staged_pieces") // reps,
                "reps": reps, "verified": bad == 0,
            }
            if mode == "always":
                out["raw_contiguous"] = await _tp_raw_ceiling(ctx, mgrs, pools, info, npages * page_bytes_p, reps)
            out["modes"][mode] = rec
            await ctx.progress(f"TP 4->2 staging={mode}: {rec['median_s'] * 1e3:.1f} ms, {rec['entries']} entries")
        finally:
            for m in reversed(mgrs):
                with contextlib.suppress(Exception):
                    await m.aclose()
            with contextlib.suppress(Exception):
                await ctx.dec.call("teardown", name=name)
    nv, al = out["modes"].get("never"), out["modes"].get("always")
    if nv and al:
        out["speedup_always_vs_never"] = nv["median_s"] / al["median_s"]
    return out
