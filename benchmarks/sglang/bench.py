"""``python -m benchmarks sglang``: SGLang 0.5.23's own transfer layer against aiotransfer, one run.

Four processes per geometry: an SGLang prefill and an SGLang decode (SGLang's unmodified Mooncake classes,
:mod:`benchmarks.sglang.peer`, under the interop venv's Python), and an aiotransfer prefill and
decode (:mod:`benchmarks.sglang.aio_peer`, engine ``mooncake_tcp``). Both pairs hold the same KV
geometry (:data:`GEOMETRIES`, SGLang's MHA layout: 4 KiB and 64 KiB rooms in K and V of one layer, the
fewest entries a room can have; 8 MiB and 32 MiB rooms in the 16 buffers of an 8-layer model; one set of four
processes per geometry) and are driven by the same commands in the same order:

* a room: the decode's receiver asks (metadata) for a contiguous run of pages, the prefill's sender waits
  until it is ready, the decode starts waiting, then the prefill sends the room's pages; the room's latency
  is the decode's first sight of Success minus the prefill's send call (CLOCK_MONOTONIC, taken inside the
  peers: "as the decode sees it"). SGLang's decode is polled every 0.5 ms; aiotransfer's awaits ``done()``;
* per size, ``seq`` rooms one at a time, then ``at_once`` rooms at once (aggregate GB/s = their bytes over
  the first send call to the last Success);
* rounds interleave the stacks: every round runs every size and mode on both, the order of the two stacks
  alternating from block to block, so both see the same machine load;
* in the last round every room's destination pages are zeroed first and compared (sha256) with its source
  pages afterwards, on both stacks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from aiotransfer._cli import console
from aiotransfer._cli.files import write_json

from .. import options
from . import SGLANG_VERSION, PeerProcess, interop_venv_problem, start_peer, start_sglang_peer

__all__ = ["GEOMETRIES", "SIZES", "Plan", "page_bytes", "run_sglang", "table"]

KIB, MIB = 1024, 1024 * 1024
GEOMETRIES: dict[str, dict[str, int]] = {
    # The fewest engine entries a room of SGLang's MHA layout can have (K and V of one layer): the fixed
    # cost of a room. One 16-token page of 1 KV head x 64 dims in bf16 is 2 KiB per buffer, 4 KiB a page.
    "small": {"layers": 1, "page_size": 16, "heads": 1, "head_dim": 64, "dtype_bytes": 2},
    # tests/interop's BASELINE_GEOMETRY: 8 layers x K/V, 8 KV heads x 128 dims in bf16, 16-token pages:
    # 512 KiB a page over 16 buffers; a 1,024-token request is 32 MiB.
    "large": {"layers": 8, "page_size": 16, "heads": 8, "head_dim": 128, "dtype_bytes": 2},
}
SIZES: dict[str, int] = {"4K": 4 * KIB, "64K": 64 * KIB, "8M": 8 * MIB, "32M": 32 * MIB}
SIZE_GEOMETRY = {"4K": "small", "64K": "small", "8M": "large", "32M": "large"}


def page_bytes(geometry: dict[str, int]) -> int:
    """Bytes of one page over every buffer."""
    g = geometry
    return 2 * g["layers"] * g["page_size"] * g["heads"] * g["head_dim"] * g["dtype_bytes"]


SRC_POOL_BYTES = 256 * MIB
"""The prefill pools' size (at least one room): rooms of a batch read the pool's blocks in turn."""
SETTLE = 0.02
"""Seconds between the decode's wait command and the prefill's send (the decode is waiting by then)."""
P99_MIN_SAMPLES = 50
TARGETS = (("4K", "one", 2.0), ("8M", "one", 1.5), ("32M", "at_once", 1.2))
"""(size, mode, ratio): the room latency ratio SGLang/aiotransfer (one at a time), or the aggregate
GB/s ratio aiotransfer/SGLang (at once), that the comparison aims at."""


@dataclass
class Plan:
    sizes: list[str]
    rounds: int
    seq: int
    at_once: int
    quick: bool
    timeout: float = 300.0


@dataclass
class Stack:
    name: str
    prefill: PeerProcess
    decode: PeerProcess
    rooms: itertools.count[int]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parse_size(text: str) -> str:
    key = text.strip().upper().removesuffix("IB").removesuffix("B")
    if key not in SIZES:
        raise ValueError(f"room sizes are {', '.join(SIZES)} (got {text!r})")
    return key


# ----------------------------------------------------------------------------------------------------
# the processes
# ----------------------------------------------------------------------------------------------------
def _pools(plan: Plan, geometry: str) -> tuple[int, int]:
    """Pages of the prefill pools and of the decode pools of a geometry (the same on both stacks)."""
    pb = page_bytes(GEOMETRIES[geometry])
    biggest = max(SIZES[s] for s in plan.sizes if SIZE_GEOMETRY[s] == geometry) // pb
    dst_pages = biggest * plan.at_once
    return max(biggest, min(dst_pages, SRC_POOL_BYTES // pb)), dst_pages


async def _start(plan: Plan, geometry: str) -> tuple[Stack, Stack]:
    src_pages, dst_pages = _pools(plan, geometry)
    geom = GEOMETRIES[geometry]
    port = _free_port()
    sg_geom: dict[str, Any] = {**geom, "aux": "", "aux_slots": 1}
    aio = [
        sys.executable,
        "-m",
        "benchmarks.sglang.aio_peer",
        *itertools.chain.from_iterable(("--" + k.replace("_", "-"), str(v)) for k, v in geom.items()),
    ]
    env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
    started = await asyncio.gather(
        start_sglang_peer("prefill", port, seed=7, pages=src_pages, **sg_geom),
        start_sglang_peer("decode", port, pages=dst_pages, **sg_geom),
        start_peer(
            [*aio, "--role", "prefill", "--pages", str(src_pages), "--seed", "7"],
            env=env,
            what="aiotransfer prefill peer",
        ),
        start_peer(
            [*aio, "--role", "decode", "--pages", str(dst_pages)], env=env, what="aiotransfer decode peer"
        ),
        return_exceptions=True,
    )
    peers = [PeerProcess(*x) for x in started if isinstance(x, tuple)]
    errors = [x for x in started if isinstance(x, BaseException)]
    if errors:
        for p in peers:
            await p.close()
        raise errors[0]
    sp, sd, ap, ad = peers
    return (
        Stack("sglang", sp, sd, itertools.count(2**62)),
        Stack("aiotransfer", ap, ad, itertools.count(1 << 40)),
    )


async def _close(*stacks: Stack) -> None:
    for st in stacks:
        for p in (st.prefill, st.decode):
            with contextlib.suppress(Exception):
                await p.close()


# ----------------------------------------------------------------------------------------------------
# rooms
# ----------------------------------------------------------------------------------------------------
def _layout(size: str, n: int, plan: Plan) -> list[tuple[list[int], list[int]]]:
    """(source pages, destination pages) of ``n`` rooms: contiguous runs, the decode's blocks in reverse
    order (so source and destination offsets differ), the prefill's pool read block after block."""
    tokens = SIZES[size] // page_bytes(GEOMETRIES[SIZE_GEOMETRY[size]])
    src_pages, dst_pages = _pools(plan, SIZE_GEOMETRY[size])
    src_blocks, dst_blocks = src_pages // tokens, dst_pages // tokens
    out = []
    for j in range(n):
        s, d = j % src_blocks, dst_blocks - 1 - (j % dst_blocks)
        out.append((list(range(s * tokens, (s + 1) * tokens)), list(range(d * tokens, (d + 1) * tokens))))
    return out


async def _run_rooms(
    st: Stack, layout: Sequence[tuple[list[int], list[int]]], timeout: float
) -> dict[str, Any]:
    """SGLang's PD sequence for these rooms (at once); returns per-room latency and the batch's span."""
    rooms = [next(st.rooms) for _ in layout]
    pre, dec = st.prefill, st.decode
    await pre.call(
        "senders",
        rooms=[
            {"room": r, "num_pages": len(d), "aux_index": 0} for r, (_, d) in zip(rooms, layout, strict=True)
        ],
    )
    await dec.call("receivers", bootstrap_addr=pre.endpoint, rooms=rooms, call_timeout=timeout)
    await dec.call(
        "metadata",
        rooms=[{"room": r, "pages": d, "aux_index": 0} for r, (_, d) in zip(rooms, layout, strict=True)],
        call_timeout=timeout,
    )
    ready = await pre.call(
        "wait_status", rooms=rooms, at_least="WaitingForInput", timeout=timeout, call_timeout=timeout + 30
    )
    if set(ready["status"].values()) != {"WaitingForInput"}:
        raise RuntimeError(f"{st.name}: prefill not ready: {ready['status']}")
    done = asyncio.ensure_future(
        dec.call("wait_done", rooms=rooms, timeout=timeout, call_timeout=timeout + 30)
    )
    try:
        await asyncio.sleep(SETTLE)
        sent = await pre.call(
            "send", rooms=[{"room": r, "pages": s} for r, (s, _) in zip(rooms, layout, strict=True)]
        )
        pdone = await pre.call("wait_done", rooms=rooms, timeout=timeout, call_timeout=timeout + 30)
    finally:
        ddone = await done
    for side, rep in (("prefill", pdone), ("decode", ddone)):
        if set(rep["status"].values()) != {"Success"}:
            raise RuntimeError(f"{st.name} {side}: {rep['status']} {rep.get('reasons')}")
    await pre.call("clear", rooms=rooms)
    await dec.call("clear", rooms=rooms)
    t_send = [sent["t_send"][str(r)] for r in rooms]
    t_done = [ddone["t_done"][str(r)] for r in rooms]
    return {
        "latency": [b - a for a, b in zip(t_send, t_done, strict=True)],
        "span": max(t_done) - min(t_send),
    }


async def _verify(st: Stack, layout: Sequence[tuple[list[int], list[int]]]) -> int:
    """Rooms whose destination pages differ from their source pages."""
    bad = 0
    want: dict[int, str] = {}
    for src, dst in layout:
        if src[0] not in want:
            want[src[0]] = (await st.prefill.call("digest", pages=src))["digest"]
        bad += (await st.decode.call("digest", pages=dst))["digest"] != want[src[0]]
    return bad


async def _block(st: Stack, size: str, mode: str, plan: Plan, verify: bool) -> dict[str, Any]:
    n = plan.seq if mode == "one" else plan.at_once
    layout = _layout(size, n, plan)
    if verify:
        await st.decode.call(
            "zero", pages=sorted({p for _, d in layout for p in d}), call_timeout=plan.timeout
        )
    if mode == "one":
        runs = [await _run_rooms(st, [room], plan.timeout) for room in layout]
        res: dict[str, Any] = {"latency": [r["latency"][0] for r in runs]}
    else:
        run = await _run_rooms(st, layout, plan.timeout)
        res = {"latency": run["latency"], "gbps": n * SIZES[size] / run["span"] / 1e9, "span_s": run["span"]}
    if verify:
        res["verified_rooms"] = n
        res["bad_rooms"] = await _verify(st, layout)
    return res


# ----------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------
def _ms(xs: Sequence[float]) -> dict[str, Any]:
    a = np.asarray(xs, dtype=np.float64) * 1e3
    p99 = float(np.percentile(a, 99)) if a.size >= P99_MIN_SAMPLES else None
    return {
        "n": int(a.size),
        "p50_ms": round(float(np.median(a)), 4),
        "p99_ms": None if p99 is None else round(p99, 4),
        "min_ms": round(float(a.min()), 4),
        "max_ms": round(float(a.max()), 4),
    }


def _summarise(raw: dict[str, dict[str, dict[str, list[dict[str, Any]]]]], plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in plan.sizes:
        geometry = SIZE_GEOMETRY[size]
        pages = SIZES[size] // page_bytes(GEOMETRIES[geometry])
        row: dict[str, Any] = {"bytes": SIZES[size], "geometry": geometry, "pages": pages}
        for mode in ("one", "at_once"):
            m: dict[str, Any] = {}
            for name in ("sglang", "aiotransfer"):
                blocks = raw[size][mode][name]
                s = {
                    "latency": _ms([x for b in blocks for x in b["latency"]]),
                    "verified_rooms": sum(b.get("verified_rooms", 0) for b in blocks),
                    "bad_rooms": sum(b.get("bad_rooms", 0) for b in blocks),
                }
                if mode == "at_once":
                    rounds = [b["gbps"] for b in blocks]
                    s.update(
                        gbps=round(statistics.median(rounds), 4), gbps_rounds=[round(g, 4) for g in rounds]
                    )
                m[name] = s
            m["latency_ratio_p50"] = round(
                m["sglang"]["latency"]["p50_ms"] / m["aiotransfer"]["latency"]["p50_ms"], 3
            )
            if mode == "at_once":
                m["gbps_ratio"] = round(m["aiotransfer"]["gbps"] / m["sglang"]["gbps"], 3)
            row[mode] = m
        out[size] = row
    return out


def _targets(figures: dict[str, Any], at_once: int) -> list[dict[str, Any]]:
    out = []
    for size, mode, want in TARGETS:
        if size not in figures:
            continue
        m = figures[size][mode]
        value = m["latency_ratio_p50"] if mode == "one" else m["gbps_ratio"]
        what = (
            f"{size} room, one at a time: SGLang p50 / aiotransfer p50"
            if mode == "one"
            else f"{size} rooms, {at_once} at once: aiotransfer GB/s / SGLang GB/s"
        )
        out.append({"what": what, "value": value, "target": want, "met": value >= want})
    return out


async def _bench(plan: Plan) -> dict[str, Any]:
    t0 = time.perf_counter()
    load0 = list(os.getloadavg())
    names = ("sglang", "aiotransfer")
    raw: dict[str, Any] = {s: {m: {n: [] for n in names} for m in ("one", "at_once")} for s in plan.sizes}
    for geometry in dict.fromkeys(SIZE_GEOMETRY[s] for s in plan.sizes):
        sizes = [s for s in plan.sizes if SIZE_GEOMETRY[s] == geometry]
        print(
            f"{geometry} geometry ({', '.join(sizes)}): starting SGLang {SGLANG_VERSION} and aiotransfer peers ...",
            file=sys.stderr,
            flush=True,
        )
        stacks = await _start(plan, geometry)
        try:
            for size in sizes:  # warm-up: one room of each size on each stack, not counted
                for st in stacks:
                    await _run_rooms(st, _layout(size, 1, plan), plan.timeout)
            blocks = itertools.count()
            for r in range(plan.rounds):
                last = r == plan.rounds - 1
                for size in sizes:
                    for mode in ("one", "at_once"):
                        order = stacks if next(blocks) % 2 == 0 else stacks[::-1]
                        for st in order:
                            raw[size][mode][st.name].append(await _block(st, size, mode, plan, last))
                console.note(f"  round {r + 1}/{plan.rounds} done")
        finally:
            await _close(*stacks)
    figures = _summarise(raw, plan)
    return {
        "suite": "sglang",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_at_start": load0,
            "load_avg_at_end": list(os.getloadavg()),
        },
        "stacks": {
            "sglang": f"SGLang {SGLANG_VERSION} prefill -> SGLang decode (Mooncake TCP, 127.0.0.1)",
            "aiotransfer": "aiotransfer prefill -> aiotransfer decode (engine mooncake_tcp, 127.0.0.1)",
        },
        "geometries": {
            k: {**g, "page_bytes": page_bytes(g), "buffers": 2 * g["layers"]} for k, g in GEOMETRIES.items()
        },
        "plan": asdict(plan),
        "definition": "room latency: the decode's first sight of Success minus the prefill's send call, "
        "CLOCK_MONOTONIC in both peers; at once: rooms x bytes / (last Success - first send), "
        "GB/s = 1e9 B/s, median of the rounds; latency ratio = SGLang / aiotransfer, GB/s ratio = "
        "aiotransfer / SGLang (> 1: aiotransfer faster)",
        "figures": figures,
        "targets": _targets(figures, plan.at_once),
        "raw": raw,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def table(res: dict[str, Any]) -> str:
    def lat(s: dict[str, Any]) -> str:
        p99 = s["latency"]["p99_ms"]
        return f"{s['latency']['p50_ms']:.3f}" + (f" / {p99:.3f}" if p99 is not None else "")

    rows = [
        (
            "size",
            "rooms",
            "SGLang ms",
            "aiotransfer ms",
            "ratio",
            "SGLang GB/s",
            "aio GB/s",
            "ratio",
        )
    ]
    for size, row in res["figures"].items():
        one, many = row["one"], row["at_once"]
        rows.append(
            (
                size,
                "1 at a time",
                lat(one["sglang"]),
                lat(one["aiotransfer"]),
                f"{one['latency_ratio_p50']:.2f}",
                "",
                "",
                "",
            )
        )
        rows.append(
            (
                size,
                f"{res['plan']['at_once']} at once",
                lat(many["sglang"]),
                lat(many["aiotransfer"]),
                f"{many['latency_ratio_p50']:.2f}",
                f"{many['sglang']['gbps']:.3f}",
                f"{many['aiotransfer']['gbps']:.3f}",
                f"{many['gbps_ratio']:.2f}",
            )
        )
    lines = [
        "latency p50 / p99 (p99 where there are enough rooms)",
    ]
    lines += [
        f"target {t['what']} >= {t['target']}: {t['value']:.2f} {'met' if t['met'] else 'NOT met'}"
        for t in res["targets"]
    ]
    bad = {
        f"{s}/{m}/{n}": row[m][n]["bad_rooms"]
        for s, row in res["figures"].items()
        for m in ("one", "at_once")
        for n in ("sglang", "aiotransfer")
    }
    checked = sum(
        row[m][n]["verified_rooms"]
        for row in res["figures"].values()
        for m in ("one", "at_once")
        for n in ("sglang", "aiotransfer")
    )
    lines.append(
        f"bytes verified (sha256) in {checked} rooms of the last round: "
        + ("all match" if not any(bad.values()) else f"MISMATCHES {bad}")
    )
    load = res["machine"]
    lines.append(
        f"ratios > 1: aiotransfer faster; latency = decode's Success - prefill's send call; "
        f"{res['plan']['rounds']} interleaved rounds; load {load['load_avg_at_start'][0]:.1f} -> "
        f"{load['load_avg_at_end'][0]:.1f} on {load['cpus']} CPUs; wall {res['wall_s']:.0f} s"
    )
    return console.table(rows) + "\n" + console.wrap("\n".join(lines))


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "sglang", repeats="interleaved rounds; default 5, 2 with --quick",
                   quick="2 rounds, 4 rooms one at a time and 16 at once")
    p.add_argument("--sizes", default=None,
                   help="room sizes, comma-separated, of 4K,64K,8M,32M (default all)")
    p.add_argument("--at-once", type=int, default=None,
                   help="rooms in flight together in the 'at once' figure (default 64; 16 with --quick)")


def run_sglang(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m benchmarks sglang``; returns the exit code."""
    try:
        sizes = [_parse_size(x) for x in (ns.sizes or ",".join(SIZES)).split(",") if x.strip()]
    except ValueError as exc:
        print(f"benchmarks sglang: {exc}", file=sys.stderr)
        return 2
    at_once = ns.at_once if ns.at_once is not None else (16 if ns.quick else 64)
    plan = Plan(
        sizes=sizes,
        rounds=ns.repeats or (2 if ns.quick else 5),
        seq=min(at_once, 4 if ns.quick else 20),
        at_once=at_once,
        quick=ns.quick,
    )
    if plan.rounds < 1 or plan.at_once < 1 or not sizes:
        print("benchmarks sglang: --repeats, --at-once and --sizes must be >= 1", file=sys.stderr)
        return 2
    problem = interop_venv_problem()
    if problem is not None:
        print(f"benchmarks sglang: {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        res = asyncio.run(_bench(plan))
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, ConnectionError, asyncio.TimeoutError) as exc:
        print(f"benchmarks sglang failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(table(res))
    out = ns.out or options.default_out("sglang")
    write_json(out, res)
    print(f"results written to {out}")
    bad = any(
        row[m][n]["bad_rooms"]
        for row in res["figures"].values()
        for m in ("one", "at_once")
        for n in ("sglang", "aiotransfer")
    )
    return 1 if bad else 0
