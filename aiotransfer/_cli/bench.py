"""``python -m aiotransfer bench``: raw Mooncake against aiotransfer, same engine, same buffers, same run.

The other suites (every engine, JSON and PNG plots, a table of targets; SGLang, vLLM, GPU memory) live
in the repository, outside the installed package: ``python -m benchmarks SUITE`` from a checkout.

The CLI process is the prefill; it spawns the decode as ``python -m aiotransfer._cli.bench --role decode`` and
drives it with JSON lines. For each figure both sides build a :class:`~aiotransfer.KVManager` over the
figure's buffers; the *raw* numbers call the prefill manager's own native engine (``mgr.engine.raw()``,
a ``mooncake.engine.TransferEngine``) on a plain thread, writing into the decode manager's registered
buffers, so raw and aiotransfer share the engine, the memory and the TCP connection. Repetitions
alternate raw and aiotransfer (machine noise is +-20 %: medians are reported, and the ratio comes from
the same run). Every write is verified byte for byte on the decode side between timed sections.

Figures (GB/s = 1e9 bytes/s):

* (a) one contiguous region (default 256 MiB: one buffer of 256 x 1 MiB pages). raw: the best median of
  five native call styles (``transfer_sync_write``, ``batch_transfer_sync_write``, ``transfer_submit_write``
  + ``transfer_check_status`` spinning or every 0.5 ms, ``batch_transfer_async_write`` +
  ``get_batch_transfer_status``).
  aiotransfer: prefill-side time of ``await tx.send_kv(pages)`` (data landed and engine-acked, Success
  notified). The prefill's event-loop lag is sampled during it.
* (b) 10,000 x 4 KiB pages in runs of 64 at random offsets on both sides. raw: one batch entry per run
  (what an expert hand-codes), best of ``batch_transfer_sync_write`` and async + status. aiotransfer:
  ``send_kv`` of the 10,000 page indices (it coalesces the runs itself).
* (c) the demo's scattered workload: Llama-3-8B geometry (64 buffers of 32 KiB pages), a few requests of
  256-4,096 tokens on pages scattered at random. raw: one entry per page per buffer in batches of <=1,024
  entries, one after the other, best of sync and async + status. aiotransfer: one ``send_kv`` per request.

``ratio`` = aiotransfer GB/s / best raw GB/s (> 1: aiotransfer faster). Picking the best of several noisy
raw medians biases raw upwards, so ``same_call.ratio`` also compares against the raw call style that
aiotransfer's Mooncake adapter itself uses. The table shows both ratios, each under its own heading.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiotransfer import AiotransferError, KVManager, LoopLagMonitor, TransferConfig

from . import console
from .channel import Child, open_parent_channel
from .files import write_json
from .raw import MAX_BATCH, RAW_STYLES, SAME_CALL, Batch, RawFn, native_engine
from .workload import I64, KVPool, count_bad_pages, fill_pages, make_requests

__all__ = ["add_arguments", "main", "run"]

EPILOG = """\
figures (GB/s = 1e9 bytes/s; raw: the prefill manager's own Mooncake engine, called from a thread):
  (a)  one contiguous region of --size-mib MiB (default 256): a single engine entry
  (b)  --pages 4 KiB pages (default 10,000) in runs of --run pages (default 64) at random offsets on
       both sides: one raw entry per run
  (c)  the demo's scattered workload: Llama-3-8B geometry (64 buffers of 32 KiB pages), --c-requests
       requests of 256-4,096 tokens on pages scattered at random: one raw entry per page and buffer
ratios (> 1: aiotransfer faster), both in the table:
  ratio vs best raw   aiotransfer GB/s / GB/s of the fastest raw call style tried
  ratio vs same call  aiotransfer GB/s / GB/s of the raw call style aiotransfer's adapter makes
"""
"""What ``aiotransfer bench --help`` says after the options: what each figure moves, and the two ratios."""

_TIMEOUT = 120.0
"""Bound on any single step (one transfer, one decode command)."""


# ----------------------------------------------------------------------------------------------------
# figure definitions (both sides build the same from the same parameters)
# ----------------------------------------------------------------------------------------------------
@dataclass
class Transfer:
    """Source pages -> destination pages (same positions), in every buffer of the figure."""

    src: I64
    dst: I64
    tag: int
    """Pattern seed (the ``room`` of :func:`~aiotransfer._cli.workload.fill_pages`)."""


@dataclass
class Figure:
    key: str
    title: str
    nbuf: int
    pages: int
    page_shape: tuple[int, ...]
    page_size: int
    """Tokens per page (only for the compatibility hash)."""
    transfers: list[Transfer]
    raw_kind: str
    """``single`` (one contiguous entry), ``runs`` (one entry per run) or ``pages`` (one per page)."""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.page_shape)) * 2

    @property
    def nbytes(self) -> int:
        return sum(int(t.src.size) for t in self.transfers) * self.nbuf * self.page_bytes


def _random_runs(rng: np.random.Generator, pool: int, total: int, run: int) -> tuple[I64, list[int]]:
    """Pages of ``ceil(total / run)`` runs at random offsets (non-overlapping, random order)."""
    lens = [run] * (total // run) + ([total % run] if total % run else [])
    slot = 2 * run
    slots = pool // slot
    if len(lens) > slots:
        raise ValueError(f"{total} pages in runs of {run} do not fit a pool of {pool} pages")
    chosen = rng.choice(slots, size=len(lens), replace=False)
    starts = chosen * slot + rng.integers(0, run + 1, size=len(lens))
    pages = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lens, strict=True)])
    return pages, lens


def build_figures(ns: argparse.Namespace) -> list[Figure]:
    rng = np.random.default_rng([ns.seed, 0xBE7C])
    figs: list[Figure] = []
    keys = set(ns.figures.split(","))
    if "a" in keys:
        mib = ns.size_mib
        pages = np.arange(mib, dtype=np.int64)
        figs.append(Figure(
            "a", f"{mib} MiB contiguous (1 region, 1 entry)", 1, mib, (512, 1024), 1,
            [Transfer(pages, pages.copy(), 0xA)], "single", {"size_mib": mib},
        ))
    if "b" in keys:
        n, run = ns.pages, ns.run
        pool = max(4 * n, 2 * run * (-(-n // run)))
        src, lens = _random_runs(rng, pool, n, run)
        dst, _ = _random_runs(rng, pool, n, run)
        figs.append(Figure(
            "b", f"{n:,} x 4 KiB pages, runs of {run} at random offsets ({len(lens)} runs)", 1, pool, (2048,),
            1, [Transfer(src, dst, 0xB)], "runs", {"pages": n, "run": run, "runs": len(lens), "pool_pages": pool},
        ))
    if "c" in keys:
        reqs = make_requests(ns.seed, ns.c_requests, 256, 4096, 16, 1)
        total = sum(r.pages for r in reqs)
        pool = max(512, total + total // 4)
        src_perm, dst_perm = rng.permutation(pool), rng.permutation(pool)
        transfers = []
        at = 0
        for i, r in enumerate(reqs):  # disjoint page sets, scattered over the whole pool on both sides
            transfers.append(Transfer(
                src_perm[at : at + r.pages].astype(np.int64), dst_perm[at : at + r.pages].astype(np.int64), 0xC0 + i
            ))
            at += r.pages
        figs.append(Figure(
            "c", f"scattered Llama-3-8B KV: {console.count(len(reqs), 'request')}, "
            f"{console.count(total, 'page')} x 64 buffers x 32 KiB", 64, pool, (16, 8, 128), 16, transfers, "pages",
            {"requests": len(reqs), "tokens": [r.tokens for r in reqs], "pool_pages": pool},
        ))
    return figs


def _figure_by_key(ns: argparse.Namespace, key: str) -> Figure:
    return next(f for f in build_figures(ns) if f.key == key)


# ----------------------------------------------------------------------------------------------------
# raw entries (what an expert hand-codes; the calls are in .raw)
# ----------------------------------------------------------------------------------------------------
def _entries(fig: Figure, t: Transfer, src_bases: Sequence[int], dst_bases: Sequence[int]) -> tuple[
    list[int], list[int], list[int]
]:
    """What an expert hand-codes: one entry per region / run / page, per buffer."""
    pb = fig.page_bytes
    if fig.raw_kind == "single":
        n = int(t.src.size) * pb
        return [src_bases[0] + int(t.src[0]) * pb], [dst_bases[0] + int(t.dst[0]) * pb], [n]
    if fig.raw_kind == "runs":
        brk = np.flatnonzero((np.diff(t.src) != 1) | (np.diff(t.dst) != 1)) + 1
        starts = np.concatenate([[0], brk])
        lens = np.diff(np.concatenate([starts, [t.src.size]]))
        s0, d0 = t.src[starts], t.dst[starts]
    else:
        s0, d0, lens = t.src, t.dst, np.ones(t.src.size, dtype=np.int64)
    src: list[int] = []
    dst: list[int] = []
    length: list[int] = []
    for b in range(fig.nbuf):
        src += (src_bases[b] + s0 * pb).tolist()
        dst += (dst_bases[b] + d0 * pb).tolist()
        length += (lens * pb).tolist()
    return src, dst, length


def _chunks(src: list[int], dst: list[int], length: list[int]) -> list[Batch]:
    return [(src[i : i + MAX_BATCH], dst[i : i + MAX_BATCH], length[i : i + MAX_BATCH])
            for i in range(0, len(src), MAX_BATCH)]


# ----------------------------------------------------------------------------------------------------
# decode side (child process)
# ----------------------------------------------------------------------------------------------------
async def _decode_main(ns: argparse.Namespace) -> int:
    chan = await open_parent_channel()
    cfg = TransferConfig(engine=ns.engine, hostname=ns.host, staging=ns.staging)
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-verify")
    loop = asyncio.get_running_loop()
    state: dict[str, Any] = {}

    async def off(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wait_for(loop.run_in_executor(worker, fn, *args), _TIMEOUT)

    def check(pool: KVPool, transfers: list[Transfer], poison: bool) -> int:
        bad = 0
        for t in transfers:
            bad += count_bad_pages(pool, t.tag, t.dst)
            if poison:
                pool.poison(t.dst)
        return bad

    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "setup":
            fig = _figure_by_key(ns, cmd["figure"])
            pool = KVPool(fig.nbuf, fig.pages, fig.page_shape)
            await off(pool.prefault)
            mgr = await asyncio.wait_for(KVManager(pool.kv_args(fig.page_size, "uint16"), cfg).start(), 60.0)
            state.update(fig=fig, pool=pool, mgr=mgr, peer=cmd["peer"])
            return {"session_id": mgr.engine.session_id, "bases": pool.bases, "endpoint": mgr.endpoint}
        fig, pool, mgr = state["fig"], state["pool"], state["mgr"]
        if op == "check":  # verify the raw writes of transfer(s) landed, then poison them
            ts = fig.transfers if cmd.get("index") is None else [fig.transfers[cmd["index"]]]
            return {"bad": await off(check, pool, ts, True)}
        if op == "poison":
            ts = fig.transfers if cmd.get("index") is None else [fig.transfers[cmd["index"]]]
            for t in ts:
                await off(pool.poison, t.dst)
            return {}
        if op == "recv":  # one aiotransfer request: metadata, done, verify (+ poison)
            t = fig.transfers[cmd["index"]]
            rx = mgr.receiver(cmd["room"], state["peer"])
            await rx.send_metadata(t.dst, timeout=_TIMEOUT)
            await chan.send({"event": "armed"})
            await rx.done(timeout=_TIMEOUT)
            bad = await off(check, pool, [t], bool(cmd.get("poison", True))) if cmd.get("verify", True) else 0
            return {"bad": bad}
        if op == "teardown":
            await mgr.aclose()
            state.clear()
            return {}
        raise ValueError(f"unknown command {op!r}")

    rc = 0
    try:
        await chan.serve(handle, idle_timeout=3600.0)
    finally:
        if "mgr" in state:
            await state["mgr"].aclose()
        worker.shutdown(wait=False, cancel_futures=True)
    return rc


# ----------------------------------------------------------------------------------------------------
# prefill side (this process)
# ----------------------------------------------------------------------------------------------------
class _Decode:
    def __init__(self, child: Child) -> None:
        self.child = child

    async def call(self, cmd: dict[str, Any], timeout: float = _TIMEOUT) -> dict[str, Any]:
        await self.child.channel.send(cmd)
        return await self.reply(cmd["cmd"], timeout)

    async def reply(self, what: str, timeout: float = _TIMEOUT) -> dict[str, Any]:
        msg = await self.child.channel.recv(timeout)
        if msg is None:
            raise RuntimeError(f"decode process exited during {what!r}")
        if msg.get("event") == "error":
            raise RuntimeError(f"decode: {what}: {msg.get('message')}")
        return msg


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


async def _run_figure(
    ns: argparse.Namespace, fig: Figure, decode: _Decode, rooms: list[int], raw_pool: concurrent.futures.Executor,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    pool = KVPool(fig.nbuf, fig.pages, fig.page_shape)

    def prepare() -> None:
        pool.prefault()
        for t in fig.transfers:
            fill_pages(pool, t.tag, t.src)

    await asyncio.wait_for(loop.run_in_executor(raw_pool, prepare), _TIMEOUT)
    cfg = TransferConfig(engine=ns.engine, hostname=ns.host, staging=ns.staging)
    lag_aio = LoopLagMonitor()
    lag_raw = LoopLagMonitor()
    async with KVManager(pool.kv_args(fig.page_size, "uint16"), cfg) as mgr:
        native = native_engine(mgr)
        if native is None:
            raise RuntimeError(f"bench compares against raw Mooncake; engine {ns.engine!r} has no raw() handle")
        info = await decode.call({"cmd": "setup", "figure": fig.key, "peer": mgr.endpoint})
        target, dst_bases = info["session_id"], info["bases"]

        def plan() -> list[list[Batch]]:
            return [_chunks(*_entries(fig, t, pool.bases, dst_bases)) for t in fig.transfers]

        batches = await asyncio.wait_for(loop.run_in_executor(raw_pool, plan), _TIMEOUT)
        styles = RAW_STYLES[fig.raw_kind]

        async def raw_once(fn: RawFn) -> float:
            def job() -> float:
                return sum(fn(native, target, b) for b in batches)

            return await asyncio.wait_for(loop.run_in_executor(raw_pool, job), _TIMEOUT)

        async def aio_once(lag: LoopLagMonitor | None, verify: bool = True) -> float:
            total = 0.0
            for i, t in enumerate(fig.transfers):
                room = rooms.pop()
                tx = mgr.sender(room)
                await decode.child.channel.send({"cmd": "recv", "index": i, "room": room, "verify": verify})
                await decode.reply("recv armed")
                await tx.wait_ready(timeout=_TIMEOUT)
                if lag is not None:
                    lag.start()
                t0 = time.perf_counter()
                await tx.send_kv(t.src, timeout=_TIMEOUT)
                total += time.perf_counter() - t0
                if lag is not None:
                    await lag.stop()
                await tx.done(timeout=_TIMEOUT)
                res = await decode.reply("recv")
                if res.get("bad"):
                    raise RuntimeError(f"({fig.key}) aiotransfer: {res['bad']} mismatched (buffer, page) pairs")
            return total

        # warm-up (connection, lanes, page cache), untimed; checks the raw data path once per style.
        await aio_once(None)
        for name, fn in styles.items():
            await raw_once(fn)
            bad = (await decode.call({"cmd": "check"}))["bad"]
            if bad:
                raise RuntimeError(f"({fig.key}) raw {name}: {bad} mismatched (buffer, page) pairs")
        raw_times: dict[str, list[float]] = {name: [] for name in styles}
        aio_times: list[float] = []
        order: list[str | None] = [*styles, None]  # None: aiotransfer
        for rep in range(ns.repeats):
            k = rep % len(order)  # rotate, so no variant always runs first or right after another
            for style in order[k:] + order[:k]:
                if style is None:
                    await decode.call({"cmd": "poison"})  # the decode must see aiotransfer's own bytes
                    aio_times.append(await aio_once(lag_aio))
                else:
                    lag_raw.start()
                    raw_times[style].append(await raw_once(styles[style]))
                    await lag_raw.stop()
        await decode.call({"cmd": "teardown"})
        entries_sent = mgr.stats().get("kv_entries_sent", 0)

    nbytes = fig.nbytes
    raw_medians = {name: _median(ts) for name, ts in raw_times.items()}
    best = min(raw_medians, key=lambda k: raw_medians[k])
    raw_s, aio_s = raw_medians[best], _median(aio_times)
    raw_entries = sum(len(s) for b in batches for s, _, _ in b)
    return {
        "title": fig.title,
        "bytes": nbytes,
        "params": fig.params,
        "repeats": ns.repeats,
        "raw": {
            "call": best,
            "median_s": raw_s,
            "gbps": _gbps(nbytes, raw_s),
            "entries": raw_entries,
            "styles": {n: {"median_s": m, "gbps": _gbps(nbytes, m), "times_s": raw_times[n]}
                       for n, m in raw_medians.items()},
            "loop_lag": lag_raw.summary(),
        },
        "aiotransfer": {
            "median_s": aio_s,
            "gbps": _gbps(nbytes, aio_s),
            "times_s": aio_times,
            "entries": entries_sent // (ns.repeats + 1),
            "loop_lag": lag_aio.summary(),
        },
        "ratio": raw_s / aio_s if aio_s > 0 else float("nan"),
        "same_call": {
            "call": SAME_CALL[fig.raw_kind],
            "raw_gbps": _gbps(nbytes, raw_medians[SAME_CALL[fig.raw_kind]]),
            "ratio": raw_medians[SAME_CALL[fig.raw_kind]] / aio_s if aio_s > 0 else float("nan"),
        },
        "verified": True,
    }


async def _bench_main(ns: argparse.Namespace) -> dict[str, Any]:
    figs = build_figures(ns)
    if not figs:
        raise ValueError("--figures selects nothing (use a,b,c)")
    argv = ["--engine", ns.engine, "--host", ns.host, "--staging", ns.staging, "--seed", str(ns.seed),
            "--figures", ns.figures,
            "--size-mib", str(ns.size_mib), "--pages", str(ns.pages), "--run", str(ns.run),
            "--c-requests", str(ns.c_requests)]
    rooms = list(range(9_000_000 + 10_000, 9_000_000, -1))
    raw_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-raw")
    results: dict[str, Any] = {}
    idle = LoopLagMonitor()
    t_start = time.perf_counter()
    child = await Child.spawn("aiotransfer._cli.bench", argv)
    try:
        decode = _Decode(child)
        async with idle:
            await asyncio.sleep(0.5)
        for fig in figs:
            t0 = time.perf_counter()
            console.note(f"({fig.key}) {fig.title} ...")
            results[fig.key] = await _run_figure(ns, fig, decode, rooms, raw_pool)
            results[fig.key]["seconds"] = round(time.perf_counter() - t0, 2)
    finally:
        rc = await child.close()
        raw_pool.shutdown(wait=False, cancel_futures=True)
    mooncake_version = None
    with contextlib.suppress(Exception):
        import importlib.metadata

        mooncake_version = importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "mooncake": mooncake_version},
        "engine": ns.engine,
        "staging": ns.staging,
        "repeats": ns.repeats,
        "quick": ns.quick,
        "note": "GB/s = 1e9 B/s; medians of the repeats; ratio = aiotransfer GB/s / raw GB/s measured in this "
                "run (this machine is noisy: +-20 % between runs)",
        "figures": results,
        "loop_lag": {
            "idle": idle.summary(),
            "a_aiotransfer": results["a"]["aiotransfer"]["loop_lag"] if "a" in results else None,
            "a_raw_thread": results["a"]["raw"]["loop_lag"] if "a" in results else None,
        },
        "decode_exit": rc,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }


def _table(res: dict[str, Any]) -> str:
    """The figures as text within :data:`~aiotransfer._cli.console.WIDTH` columns (the JSON has everything)."""
    rows = [("figure", "best raw GB/s", "ms", "entries", "aiotransfer GB/s", "ms", "entries",
             "ratio vs best raw", "ratio vs same call")]
    for key, f in res["figures"].items():
        raw, aio = f["raw"], f["aiotransfer"]
        rows.append((f"({key})", f"{raw['gbps']:.3f}", f"{raw['median_s'] * 1e3:.1f}",
                     f"{raw['entries']:,}", f"{aio['gbps']:.3f}", f"{aio['median_s'] * 1e3:.1f}",
                     f"{aio['entries']:,}", f"{f['ratio']:.2f}", f"{f['same_call']['ratio']:.2f}"))
    lines = [f"({key}) {f['title']}" for key, f in res["figures"].items()]
    lines += ["", console.table(rows), ""]
    for key, f in res["figures"].items():
        marks = {f["raw"]["call"]: "best", f["same_call"]["call"]: "same call"}
        if f["raw"]["call"] == f["same_call"]["call"]:
            marks[f["raw"]["call"]] = "best, same call"
        lines.append(f"({key}) raw GB/s by call style: " + ", ".join(
            f"{n} {s['gbps']:.3f}" + (f" ({marks[n]})" if n in marks else "")
            for n, s in f["raw"]["styles"].items()))
    lag = res["loop_lag"]

    def fmt(s: dict[str, Any] | None) -> str:
        if not s or s.get("p50_ms") is None:
            return "n/a"
        return f"p50 {s['p50_ms']:.3f} / p99 {s['p99_ms']:.3f} / max {s['max_ms']:.3f} ms ({s['samples']} samples)"

    lines.append("prefill event-loop lag:")
    lines.append(f"  during (a) aiotransfer send_kv: {fmt(lag.get('a_aiotransfer'))}")
    lines.append(f"  during (a) raw (thread):        {fmt(lag.get('a_raw_thread'))}")
    lines.append(f"  idle:                           {fmt(lag.get('idle'))}")
    lines.append("ratio = aiotransfer GB/s / raw GB/s (>1: aiotransfer faster), against the best raw call style "
                 "and against the one aiotransfer's adapter makes (same call); "
                 f"medians of {console.count(res['repeats'], 'repeat')}; wall {res['wall_s']:.1f} s")
    return console.wrap("\n".join(lines))


# ----------------------------------------------------------------------------------------------------
# arguments / entry points
# ----------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog keeps its lines
    p.add_argument("--engine", default="mooncake_tcp", help="Mooncake flavour (default mooncake_tcp)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address both processes (this prefill and its decode child) bind (default 127.0.0.1)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per figure (default 5; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="CI mode: 2 repeats, 1 request in (c)")
    p.add_argument("--figures", default="a,b,c", help="which figures to run, comma-separated (default a,b,c; "
                                                        "see figures below)")
    p.add_argument("--size-mib", type=int, default=256, help="(a) contiguous size in MiB (default 256)")
    p.add_argument("--pages", type=int, default=10_000, help="(b) number of 4 KiB pages (default 10000)")
    p.add_argument("--run", type=int, default=64, help="(b) pages per contiguous run (default 64)")
    p.add_argument("--c-requests", type=int, default=None, help="(c) requests (default 4; 1 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of (b)'s runs and (c)'s pages (default 0)")
    p.add_argument("--staging", choices=("auto", "always", "never"), default="auto",
                   help="aiotransfer's gather/scatter staging (TransferConfig.staging; default auto)")
    p.add_argument("--out", default="bench-results/bench.json", metavar="JSON",
                   help="JSON results (default %(default)s)")
    p.add_argument("--log", default=None, metavar="PATH",
                   help="where Mooncake's own log lines go, this process's and the decode's (default: --out "
                        "with .log)")
    p.add_argument("--suite", default=None, help=argparse.SUPPRESS)  # moved: says where to
    p.add_argument("--role", choices=("prefill", "decode"), default="prefill", help=argparse.SUPPRESS)


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m aiotransfer bench``; returns the exit code."""
    if ns.suite is not None and ns.suite != "default":
        print(f"aiotransfer bench: the suites live in the repository, outside the installed package.\n"
              f"From a checkout: python -m benchmarks {ns.suite} --help", file=sys.stderr)
        return 2
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    if ns.repeats is None:
        ns.repeats = 2 if ns.quick else 5
    if ns.c_requests is None:
        ns.c_requests = 1 if ns.quick else 4
    if ns.repeats < 1 or ns.size_mib < 1 or ns.pages < 1 or ns.run < 1 or ns.c_requests < 1:
        print("aiotransfer bench: --repeats, --size-mib, --pages, --run and --c-requests must be >= 1",
              file=sys.stderr)
        return 2
    if ns.role == "decode":
        try:
            return asyncio.run(_decode_main(ns))
        except KeyboardInterrupt:
            return 130
    log = ns.log or os.path.splitext(ns.out)[0] + ".log"
    with console.session(log):
        try:
            res = asyncio.run(_bench_main(ns))
        except (AiotransferError, RuntimeError, ValueError, ImportError, asyncio.TimeoutError) as exc:
            print(f"aiotransfer bench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            tail = console.log_tail(log)
            if tail:
                print(f"last lines of {log}:\n{tail}", file=sys.stderr, end="")
            return 1
        print(_table(res))
        write_json(ns.out, res, indent=2)
        print(f"results written to {ns.out}; Mooncake's log: {log}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiotransfer._cli.bench", description=(__doc__ or "").split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
