"""``python -m aiotransfer demo``: a prefill process moves a Llama-3-8B-shaped KV cache to a decode process.

The CLI process is the prefill; it spawns the decode as ``python -m aiotransfer._cli.demo --role decode`` and
talks to it with JSON lines on the child's stdin/stdout. Both sides derive the same request list from
the seed (room, tokens, chunking), so nothing but page indices (sent by aiotransfer itself) crosses
between them:

* geometry: ``--layers`` x (K, V) buffers, layer-first (all K layers, then all V layers), pages of
  ``--page-tokens`` tokens x ``--kv-heads`` x ``--head-dim`` uint16 elements (Llama-3-8B: 64 buffers of
  32 KiB pages); ``--pool-pages`` pages per buffer on each side;
* each side has a free-list allocator handing out pages at random (scattered), returned after the request;
* the prefill fills its pages with a pattern derived from (room, buffer, page position in the request),
  so the decode checks every byte of every buffer of every request without extra communication;
* ``--concurrency`` requests are in flight at once; each is sent in 1..``--max-chunks`` ``send_kv`` chunks.

Filling and verifying are vectorised NumPy (one operation per buffer, never per page) and run on a
worker thread, so neither event loop is blocked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from aiotransfer import AiotransferError, KVArgs, KVManager, LoopLagMonitor, TransferConfig

from . import console
from .channel import Child, open_parent_channel, watch_eof
from .files import write_json
from .workload import (
    DemoRequest,
    Geometry,
    KVPool,
    PageAllocator,
    Worker,
    count_bad_pages,
    fill_pages,
    make_requests,
)

__all__ = ["add_arguments", "main", "run"]


# ----------------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="mooncake_tcp", help="transfer engine (mooncake_tcp, mooncake, nixl)")
    p.add_argument("--host", default="127.0.0.1", help="address both processes bind (default 127.0.0.1)")
    p.add_argument("--requests", type=int, default=64, help="requests to move (default 64)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    p.add_argument("--min-tokens", type=int, default=256, help="shortest request in tokens (default 256)")
    p.add_argument("--max-tokens", type=int, default=4096, help="longest request in tokens (default 4096)")
    p.add_argument("--max-chunks", type=int, default=3, help="send_kv calls per request: 1..N (default 3)")
    p.add_argument("--pool-pages", type=int, default=1024, help="pages per buffer on each side (default 1024)")
    p.add_argument("--layers", type=int, default=32, help="transformer layers; 2 buffers each (default 32)")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request list and page scatter")
    p.add_argument("--staging", choices=("auto", "always", "never"), default="auto",
                   help="aiotransfer's gather/scatter staging (TransferConfig.staging; default auto)")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on the whole run in seconds")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: only when stderr is a terminal)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--role", choices=("prefill", "decode"), default="prefill", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--corrupt", type=int, default=None, help=argparse.SUPPRESS)  # self-test of the checker


def _geometry(ns: argparse.Namespace) -> Geometry:
    geo = Geometry(ns.layers, ns.page_tokens, ns.kv_heads, ns.head_dim, ns.pool_pages)
    geo.validate()
    return geo


def _requests(ns: argparse.Namespace, geo: Geometry) -> list[DemoRequest]:
    if ns.requests < 1 or ns.concurrency < 1:
        raise ValueError("--requests and --concurrency must be >= 1")
    reqs = make_requests(ns.seed, ns.requests, ns.min_tokens, ns.max_tokens, geo.page_tokens, ns.max_chunks)
    biggest = max(r.pages for r in reqs)
    if biggest > geo.pool_pages:
        raise ValueError(f"a request needs {biggest} pages but --pool-pages is {geo.pool_pages}")
    return reqs


def _child_argv(ns: argparse.Namespace, peer: str) -> list[str]:
    keys = ("engine", "host", "staging", "requests", "concurrency", "min_tokens", "max_tokens", "max_chunks",
            "pool_pages", "layers", "page_tokens", "kv_heads", "head_dim", "seed", "timeout")
    argv = ["--peer", peer]
    for k in keys:
        argv += [f"--{k.replace('_', '-')}", str(getattr(ns, k))]
    if ns.corrupt is not None:
        argv += ["--corrupt", str(ns.corrupt)]
    return argv


def _kv_args(pool: KVPool, geo: Geometry) -> KVArgs:
    return pool.kv_args(geo.page_tokens, "uint16", geo.kv_heads)


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None, "mean": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p99 = np.percentile(a, [50, 99])
    return {"p50": round(float(p50), 3), "p99": round(float(p99), 3), "max": round(float(a.max()), 3),
            "mean": round(float(a.mean()), 3)}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------------------
# decode side (child process)
# ----------------------------------------------------------------------------------------------------
def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()


async def _decode_main(ns: argparse.Namespace) -> int:
    chan = await open_parent_channel()
    try:
        geo = _geometry(ns)
        reqs = _requests(ns, geo)
        pool = KVPool.for_geometry(geo)
        await asyncio.wait_for(asyncio.to_thread(pool.prefault), 120.0)
        cfg = TransferConfig(engine=ns.engine, hostname=ns.host, staging=ns.staging)
        mgr = await asyncio.wait_for(KVManager(_kv_args(pool, geo), cfg).start(), 60.0)
    except Exception as exc:
        await chan.send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 2
    alloc = PageAllocator(geo.pool_pages, np.random.default_rng([ns.seed, 2]))
    worker = Worker("demo-verify")
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    eof = loop.create_task(watch_eof(chan, lambda: _cancel(main_task)))
    latencies: list[float] = []
    stats = {"bad_pages": 0, "failed": 0, "bytes": 0}
    span = [math.inf, 0.0]  # first send_metadata, last done
    per_req_timeout = max(30.0, ns.timeout / 2)
    t_origin = time.perf_counter()

    async def one(req: DemoRequest) -> None:
        pages = await alloc.alloc(req.pages, per_req_timeout)
        event: dict[str, Any] = {"event": "request", "room": req.room, "pages": req.pages}
        try:
            rx = mgr.receiver(req.room, ns.peer)
            t0 = time.perf_counter()
            span[0] = min(span[0], t0)
            await rx.send_metadata(pages, timeout=per_req_timeout)
            await rx.done(timeout=per_req_timeout)
            t1 = time.perf_counter()
            span[1] = max(span[1], t1)
            nbytes = req.pages * geo.buffers * geo.page_bytes
            if ns.corrupt is not None and req.room == reqs[ns.corrupt % len(reqs)].room:
                pool.words[-1, pages[-1], -1] ^= np.uint64(1 << 63)  # self-test: one flipped bit
            bad = await worker.run(count_bad_pages, pool, req.room, pages, timeout=per_req_timeout)
            latencies.append((t1 - t0) * 1e3)
            stats["bytes"] += nbytes
            stats["bad_pages"] += bad
            event.update(ok=bad == 0, bad_pages=bad, latency_ms=round((t1 - t0) * 1e3, 3), bytes=nbytes,
                         at_s=round(t0 - t_origin, 3))
        except Exception as exc:
            stats["failed"] += 1
            event.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        finally:
            await alloc.release(pages)
        await chan.send(event)

    queue = iter(reqs)

    async def drain() -> None:
        for req in queue:
            await one(req)

    await chan.send({"event": "ready", "engine": mgr.describe()})
    rc = 0
    try:
        await asyncio.wait_for(asyncio.gather(*(drain() for _ in range(ns.concurrency))), ns.timeout)
    except (asyncio.CancelledError, asyncio.TimeoutError):
        rc = 1
    finally:
        elapsed = span[1] - span[0] if latencies else 0.0
        result = {
            "event": "result",
            "received_bytes": stats["bytes"],
            "elapsed_s": round(elapsed, 4),
            "throughput_gbps": round(stats["bytes"] / elapsed / 1e9, 4) if elapsed > 0 else None,
            "latency_ms": _pcts(latencies),
            "bad_pages": stats["bad_pages"],
            "failed": stats["failed"],
            "completed": len(latencies),
            "stats": {k: v for k, v in mgr.stats().items() if isinstance(v, int)},
        }
        eof.cancel()
        with contextlib.suppress(Exception):
            await chan.send(result)
        worker.close()
        await mgr.aclose()
    return rc


# ----------------------------------------------------------------------------------------------------
# prefill side (this process)
# ----------------------------------------------------------------------------------------------------
async def _prefill_main(ns: argparse.Namespace) -> dict[str, Any]:
    geo = _geometry(ns)
    reqs = _requests(ns, geo)
    total_bytes = sum(r.pages for r in reqs) * geo.buffers * geo.page_bytes
    print(
        f"aiotransfer demo: {ns.engine}, {console.count(len(reqs), 'request')} of {ns.min_tokens}-{ns.max_tokens} "
        "tokens, "
        f"{ns.concurrency} in flight, 1-{ns.max_chunks} send_kv chunks each\n"
        f"  KV: {geo.layers} layers x (K, V) = {geo.buffers} buffers, layer-first; pages of {geo.page_tokens} "
        f"tokens x {geo.kv_heads} heads x {geo.head_dim} dims x {geo.elem_bytes} B = {geo.page_bytes // 1024} KiB "
        f"per buffer\n"
        f"  pools: {geo.pool_pages} pages per buffer = {_gib(geo.pool_bytes)} per side, pages scattered at "
        f"random on both sides; {_gib(total_bytes)} of KV to move",
        flush=True,
    )
    pool = KVPool.for_geometry(geo)
    await asyncio.wait_for(asyncio.to_thread(pool.prefault), 120.0)
    cfg = TransferConfig(engine=ns.engine, hostname=ns.host, staging=ns.staging)
    alloc = PageAllocator(geo.pool_pages, np.random.default_rng([ns.seed, 1]))
    worker = Worker("demo-fill")
    failures: list[str] = []
    per_req_timeout = max(30.0, ns.timeout / 2)
    t_start = time.perf_counter()
    async with KVManager(_kv_args(pool, geo), cfg) as mgr:
        info = mgr.describe()
        child = await Child.spawn("aiotransfer._cli.demo", _child_argv(ns, mgr.endpoint))
        try:
            ready = await child.expect("ready", 60.0)
            print(f"  prefill {mgr.endpoint} (session {info.get('session_id')}, transport "
                  f"{info.get('transport')}) -> decode pid {child.proc.pid} "
                  f"(session {ready['engine'].get('session_id')})", flush=True)

            async def one(req: DemoRequest) -> None:
                t = [time.perf_counter()]
                pages = await alloc.alloc(req.pages, per_req_timeout)
                try:
                    tx = mgr.sender(req.room)
                    t.append(time.perf_counter())
                    await worker.run(fill_pages, pool, req.room, pages, timeout=per_req_timeout)
                    t.append(time.perf_counter())
                    await tx.wait_ready(timeout=per_req_timeout)
                    t.append(time.perf_counter())
                    start = 0
                    for i, n in enumerate(req.chunks):
                        last = i == len(req.chunks) - 1
                        await tx.send_kv(pages[start : start + n], last=last, timeout=per_req_timeout)
                        start += n
                    await tx.done(timeout=per_req_timeout)
                    t.append(time.perf_counter())
                    phases[req.room] = {
                        k: round((b - a) * 1e3, 2)
                        for k, a, b in zip(("alloc_ms", "fill_ms", "ready_ms", "send_ms"), t, t[1:], strict=False)
                    }
                except Exception as exc:
                    failures.append(f"room {req.room}: {type(exc).__name__}: {exc}")
                finally:
                    await alloc.release(pages)

            queue = iter(reqs)

            async def drain() -> None:
                for req in queue:
                    await one(req)

            per_request: list[dict[str, Any]] = []
            phases: dict[int, dict[str, float]] = {}

            async def collect() -> dict[str, Any]:
                bar = _progress_bar(ns, len(reqs))
                moved = 0
                t0 = time.perf_counter()
                try:
                    while True:
                        msg = await child.channel.recv(ns.timeout)
                        if msg is None:
                            raise RuntimeError("decode process exited before reporting its result")
                        ev = msg.get("event")
                        if ev == "request":
                            per_request.append(msg)
                            if not msg.get("ok"):
                                failures.append(
                                    f"room {msg['room']}: decode: "
                                    + (msg.get("error") or f"{msg.get('bad_pages')} mismatched pages")
                                )
                            moved += int(msg.get("bytes", 0))
                            if bar is not None:
                                bar.update(1)
                                dt = time.perf_counter() - t0
                                bar.set_postfix_str(f"{moved / dt / 1e9:.2f} GB/s", refresh=False)
                        elif ev == "result":
                            return msg
                        elif ev == "error":
                            raise RuntimeError(f"decode process failed: {msg.get('message')}")
                finally:
                    if bar is not None:
                        bar.close()

            async with LoopLagMonitor() as lag:
                senders = asyncio.gather(*(drain() for _ in range(ns.concurrency)))
                try:
                    decode_result, _ = await asyncio.wait_for(asyncio.gather(collect(), senders), ns.timeout)
                except BaseException:
                    senders.cancel()
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(senders, 5.0)
                    raise
        finally:
            rc = await child.close()
        stats = mgr.stats()
    worker.close()
    if rc != 0:
        failures.append(f"decode process exited with {rc}")
    return {
        "engine": ns.engine,
        "staging": ns.staging,
        "transport": info.get("transport"),
        "geometry": {**asdict(geo), "buffers": geo.buffers, "page_bytes": geo.page_bytes},
        "requests": len(reqs),
        "concurrency": ns.concurrency,
        "tokens": {"min": ns.min_tokens, "max": ns.max_tokens, "total": sum(r.tokens for r in reqs)},
        "pages": sum(r.pages for r in reqs),
        "total_bytes": total_bytes,
        "engine_entries": stats.get("kv_entries_sent"),
        "elapsed_s": decode_result["elapsed_s"],
        "throughput_gbps": decode_result["throughput_gbps"],
        "latency_ms": decode_result["latency_ms"],
        "verified_requests": decode_result["completed"],
        "mismatched_pages": decode_result["bad_pages"],
        "failed_requests": len({f.split(":")[0] for f in failures
                                if f.startswith("room ") and not f.endswith("mismatched pages")}),
        "errors": failures,
        "prefill_loop_lag": lag.summary(),
        "wall_s": round(time.perf_counter() - t_start, 3),
        "per_request": [
            {k: m.get(k) for k in ("room", "pages", "at_s", "latency_ms", "bad_pages", "error") if k in m}
            | {"prefill": phases.get(m["room"], {})}
            for m in per_request
        ],
    }


def _progress_bar(ns: argparse.Namespace, total: int) -> Any:
    show = ns.progress if ns.progress is not None else sys.stderr.isatty()
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", file=sys.stderr, desc="requests", dynamic_ncols=True)


def _report(res: dict[str, Any]) -> None:
    lat = res["latency_ms"]
    lag = res["prefill_loop_lag"]
    gbps = res["throughput_gbps"]
    print(
        f"moved {_gib(res['total_bytes'])} in {res['elapsed_s']:.2f} s: "
        f"{gbps if gbps is not None else float('nan'):.3f} GB/s of KV "
        f"({res['engine_entries']} engine entries; {res['pages']} pages x {res['geometry']['buffers']} buffers)"
    )
    if lat["p50"] is not None:
        print(f"latency per request (decode, send_metadata -> done): p50 {lat['p50']:.1f} ms, "
              f"p99 {lat['p99']:.1f} ms, max {lat['max']:.1f} ms")
    if lag["p50_ms"] is not None:
        print(f"prefill event-loop lag: p50 {lag['p50_ms']:.3f} ms, p99 {lag['p99_ms']:.3f} ms, "
              f"max {lag['max_ms']:.3f} ms")
    print(f"verified {res['verified_requests']}/{res['requests']} requests, every byte of every buffer: "
          f"{console.count(res['mismatched_pages'], 'mismatched page')}, "
          f"{console.count(res['failed_requests'], 'failed request')}")
    for err in res["errors"][:10]:
        print(f"  error: {err}", file=sys.stderr)
    print("OK" if _ok(res) else "FAILED", f"(wall {res['wall_s']:.1f} s)")


def _ok(res: dict[str, Any]) -> bool:
    return (not res["errors"] and res["mismatched_pages"] == 0
            and res["verified_requests"] == res["requests"])


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m aiotransfer demo`` (parsed arguments); returns the exit code."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    if ns.role == "decode":
        if not ns.peer:
            print("--role decode needs --peer", file=sys.stderr)
            return 2
        try:
            return asyncio.run(_decode_main(ns))
        except KeyboardInterrupt:
            return 130
    if ns.engine == "memory":
        print("aiotransfer demo: engine 'memory' (aiotransfer.testing) is for tests and works within one process; "
              "the demo's decode runs in a second process: use mooncake_tcp or nixl", file=sys.stderr)
        return 2
    try:
        res = asyncio.run(_prefill_main(ns))
    except ValueError as exc:
        print(f"aiotransfer demo: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if isinstance(exc, AiotransferError | RuntimeError | ImportError | asyncio.TimeoutError):
            print(f"aiotransfer demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2 if not isinstance(exc, asyncio.TimeoutError) else 1
        raise
    _report(res)
    if ns.json:
        write_json(ns.json, res, indent=2)
        print(f"results written to {ns.json}")
    return 0 if _ok(res) else 1




def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiotransfer._cli.demo", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
