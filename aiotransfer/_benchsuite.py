"""``python -m aiotransfer bench --suite full``: the performance suite (issue 7) plus the benchmark figures
of issues 3 (send_aux by path), 4 (TP 4->2 head slicing) and 5 (engines), in one command and one run.

Process layout. The orchestrator (the CLI process) imports no engine. For each engine configuration
(``mooncake_tcp``, ``nixl_shm``, ``nixl_tcp``) it spawns a *prefill worker*
(``python -m aiotransfer._benchsuite --role prefill``) with that configuration's environment (``UCX_TLS``
must be set before a NIXL agent exists, so each configuration gets its own pair of processes), and the
prefill worker spawns its *decode worker* (``--role decode``), a command server driven over JSON lines.

Every phase builds fresh managers on both sides over its own buffers. *Raw* numbers call the prefill
manager's own native engine (``mgr.engine.raw()``: Mooncake's ``TransferEngine`` or NIXL's
``nixl_agent``) on a plain thread, writing into the decode manager's registered memory: raw and
aiotransfer share the engine, the memory and the connection, and their repetitions alternate. The
ceilings (a NumPy copy of the same bytes; Python ``sendall``/``recv_into`` between the two worker
processes over loopback TCP, 8-byte header + 1-byte ack) are measured by the first pair, in the same
run. Bytes are verified on the decode side after the warm-up of every variant (and after the timed
runs where cheap); a mismatch fails the phase.

Phases (per engine configuration; see ``ENGINES`` for which run where):

* ``ceilings``: memcpy and loopback-TCP time per size, TCP 4 KiB round trip.
* ``throughput``: one contiguous request per size; raw single entry vs ``send_kv``.
* ``scattered``: N x 4 KiB pages scattered at random on both sides; raw page by page (batches of
  <= 1,024 entries), raw one contiguous write of the same bytes, ``send_kv`` (staging auto), and the
  planning time (``_plan_kv`` / ``_staging_plan`` on that input, and the gather copy).
* ``lag``: 1 ms sleep probe on the prefill loop, idle, while ``send_kv`` keeps the engine saturated
  (many contiguous requests in flight), and while the raw engine does the same on a thread.
* ``concurrency``: 1..256 requests in flight; aggregate throughput and latency, raw and aiotransfer.
* ``e2e``: 4 KiB ``send_kv`` through ``done()`` on both sides; timestamps from ``time.monotonic``
  (``CLOCK_MONOTONIC``: one clock for every process on Linux, checked in the run).
* ``aux``: ``send_aux`` latency by path (``aux_path="engine"`` vs ``"tcp"``).
* ``tp``: a Llama-8B-shaped request moved from prefill TP 4 (4 managers in the prefill worker: one
  Mooncake engine per process is shared) to decode TP 2 (2 managers in the decode worker), head-sliced,
  ``staging="never"`` (one entry per token per layer buffer per head slice) vs ``staging="always"``.

The orchestrator merges the results, evaluates the targets and draws the plots
(:mod:`aiotransfer._benchreport`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import importlib.util
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ._lag import LoopLagMonitor
from .demo import (
    Channel,
    Child,
    KVPool,
    count_bad_pages,
    fill_pages,
    open_parent_channel,
    page_seeds,
    word_ramp,
)

__all__ = ["ENGINES", "Params", "make_params", "run_suite"]

KIB = 1024
MIB = 1024 * 1024
_TIMEOUT = 300.0
"""Bound on one step (one transfer, one decode command)."""
_MAX_BATCH = 1024
"""Largest raw batch: Mooncake rejects beyond ~2,048 entries queued per peer."""
_ROOM0 = 7_000_000

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


# ----------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    key: str
    engine: str
    label: str
    env: dict[str, str]
    unset: tuple[str, ...]
    phases: tuple[str, ...]


ALL_PHASES = ("ceilings", "throughput", "scattered", "lag", "concurrency", "e2e", "aux", "tp")

ENGINES: dict[str, EngineSpec] = {
    "mooncake_tcp": EngineSpec(
        "mooncake_tcp", "mooncake_tcp", "Mooncake TCP", {}, (),
        ("throughput", "scattered", "lag", "concurrency", "e2e", "aux", "tp"),
    ),
    "nixl_shm": EngineSpec(
        "nixl_shm", "nixl", "NIXL UCX (default TLS: shm)", {}, ("UCX_TLS",),
        ("throughput", "scattered", "lag", "concurrency", "e2e", "aux"),
    ),
    "nixl_tcp": EngineSpec(
        "nixl_tcp", "nixl", "NIXL UCX_TLS=tcp", {"UCX_TLS": "tcp"}, (),
        ("throughput", "scattered"),
    ),
}


@dataclass
class Params:
    """Everything both workers need; serialised on their command lines."""

    scale: str = "full"
    repeats: int = 5
    seed: int = 0
    host: str = "127.0.0.1"
    sizes: list[int] = field(default_factory=lambda: [64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB])
    sizes_nixl_tcp: list[int] = field(default_factory=lambda: [MIB, 64 * MIB])
    scattered_pages: int = 10_000
    lag_seconds: float = 3.0
    lag_inflight: int = 8
    lag_size: int = 8 * MIB
    conc_levels: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 256])
    conc_size: int = 256 * KIB
    conc_requests: int = 512
    e2e_reps: int = 300
    aux_reps: int = 300
    aux_bytes: int = 4 * KIB
    tp_tokens: int = 4096
    tp_layers: int = 32
    tp_never_repeats: int = 1
    tp_always_repeats: int = 3
    tp_split_credits: bool = True
    """Give each of the P prefill managers max_entries_in_flight = 1024 // P: they share one Mooncake
    engine, and the library's default (1,024 per manager and peer) lets P x 1,024 entries queue to the
    same decode segment, which Mooncake fails (-1). False reproduces that."""
    phases: list[str] | None = None
    engine_threads: str = "normal"
    """``TransferConfig.engine_threads`` of every manager of the run, on both sides."""
    nixl_progress_delay_us: int = 0
    """``TransferConfig.nixl_progress_delay_us`` of every manager of the run, on both sides."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    def manager_config(self) -> dict[str, Any]:
        """``TransferConfig`` fields every manager of the run gets, on both sides."""
        return {"engine_threads": self.engine_threads, "nixl_progress_delay_us": self.nixl_progress_delay_us}

    @classmethod
    def from_json(cls, text: str) -> Params:
        return cls(**json.loads(text))


def make_params(*, quick: bool, tiny: bool, repeats: int | None, seed: int, host: str,
                phases: Sequence[str] | None, tp_split_credits: bool = True, engine_threads: str = "normal",
                nixl_progress_delay_us: int = 0) -> Params:
    if tiny:
        p = Params(
            scale="tiny", repeats=1, sizes=[64 * KIB, MIB], sizes_nixl_tcp=[MIB], scattered_pages=512,
            lag_seconds=0.25, lag_inflight=4, lag_size=MIB, conc_levels=[1, 8], conc_size=64 * KIB,
            conc_requests=16, e2e_reps=10, aux_reps=10, tp_tokens=64, tp_layers=2, tp_always_repeats=1,
        )
    elif quick:
        p = Params(
            scale="quick", repeats=2, sizes=[64 * KIB, MIB, 16 * MIB, 64 * MIB], sizes_nixl_tcp=[MIB, 64 * MIB],
            scattered_pages=2_000, lag_seconds=0.6, lag_inflight=8, lag_size=4 * MIB, conc_levels=[1, 16, 256],
            conc_size=256 * KIB, conc_requests=256, e2e_reps=40, aux_reps=40, tp_tokens=512, tp_layers=4,
            tp_always_repeats=1,
        )
    else:
        p = Params()
    if repeats is not None:
        p.repeats = repeats
    p.seed, p.host = seed, host
    p.phases = list(phases) if phases else None
    p.engine_threads = engine_threads
    p.nixl_progress_delay_us = nixl_progress_delay_us
    p.tp_split_credits = tp_split_credits
    return p


def _reps(nbytes: int, repeats: int) -> int:
    """More repetitions for small transfers (they are cheap and noisier)."""
    if nbytes <= MIB:
        return repeats * 8
    if nbytes <= 16 * MIB:
        return repeats * 4
    return repeats * 2


def _stats_us(xs: Sequence[float]) -> dict[str, Any]:
    """Percentiles of durations given in seconds, reported in microseconds."""
    if not xs:
        return {"n": 0, "p50_us": None, "p99_us": None, "max_us": None, "mean_us": None}
    a = np.asarray(xs, dtype=np.float64) * 1e6
    p50, p99 = np.percentile(a, [50, 99])
    return {"n": int(a.size), "p50_us": round(float(p50), 2), "p99_us": round(float(p99), 2),
            "max_us": round(float(a.max()), 2), "mean_us": round(float(a.mean()), 2)}


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _timing(nbytes: int, times: Sequence[float]) -> dict[str, Any]:
    med = _median(times)
    return {"median_s": med, "gbps": _gbps(nbytes, med), "times_s": [round(t, 7) for t in times]}


def _lag_record(mon: LoopLagMonitor) -> dict[str, Any]:
    out = mon.summary()
    out["samples_ms"] = [round(float(x), 4) for x in mon.samples]
    return out


# ----------------------------------------------------------------------------------------------------
# byte patterns shared by both workers
# ----------------------------------------------------------------------------------------------------
def aux_pattern(room: int, nbytes: int) -> npt.NDArray[np.uint8]:
    out: npt.NDArray[np.uint8] = ((np.arange(nbytes, dtype=np.int64) + room * 131) % 251).astype(np.uint8)
    return out


def _tp_head_values(tag: int, nbuf: int, npages: int, rows: int, heads: int, head_words: int,
                    b: int, h0: int, hc: int) -> U64:
    """Expected words of heads ``[h0, h0+hc)`` of the request's pages in buffer ``b``:
    shape (npages, rows, hc, head_words); the same global pattern on every TP rank."""
    seeds = page_seeds(tag, nbuf, npages)[b]
    ramp = word_ramp(rows * heads * head_words).reshape(rows, heads, head_words)[:, h0 : h0 + hc, :]
    out: U64 = seeds[:, None, None, None] + ramp[None]
    return out


def tp_fill(pool: KVPool, tag: int, pages: I64, rows: int, heads: int, head_words: int, h0: int, hc: int) -> None:
    for b in range(pool.nbuf):
        vals = _tp_head_values(tag, pool.nbuf, pages.size, rows, heads, head_words, b, h0, hc)
        pool.words[b, pages] = vals.reshape(pages.size, -1)


def tp_bad_pages(pool: KVPool, tag: int, pages: I64, rows: int, heads: int, head_words: int, h0: int,
                 hc: int) -> int:
    bad = 0
    for b in range(pool.nbuf):
        vals = _tp_head_values(tag, pool.nbuf, pages.size, rows, heads, head_words, b, h0, hc)
        got = pool.words[b, pages].reshape(vals.shape)
        bad += int(np.count_nonzero((got != vals).reshape(pages.size, -1).any(axis=1)))
    return bad


# ----------------------------------------------------------------------------------------------------
# ceilings: memcpy and loopback TCP
# ----------------------------------------------------------------------------------------------------
def memcpy_ceiling(sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    big = max(sizes)
    src = np.ones(big, dtype=np.uint8)
    dst = np.zeros(big, dtype=np.uint8)
    dst.fill(1)
    out: dict[str, Any] = {}
    for s in sorted(sizes):
        inner = max(1, min(64, (4 * MIB) // s))  # several copies per sample for tiny sizes (timer resolution)
        np.copyto(dst[:s], src[:s])
        times = []
        for _ in range(_reps(s, repeats)):
            t0 = time.perf_counter()
            for _ in range(inner):
                np.copyto(dst[:s], src[:s])
            times.append((time.perf_counter() - t0) / inner)
        out[str(s)] = _timing(s, times)
    return out


class TcpSink(threading.Thread):
    """Decode side of the TCP ceiling: 8-byte length header, ``recv_into`` a buffer, 1-byte ack."""

    def __init__(self, host: str, bufsize: int) -> None:
        super().__init__(name="bench-tcp-sink", daemon=True)
        self.sock = socket.create_server((host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.buf = np.ones(bufsize, dtype=np.uint8)
        self.error: str | None = None

    def run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mv = self.buf.data
            size = len(self.buf)
            hdr = bytearray(8)
            try:
                while True:
                    got = 0
                    while got < 8:
                        k = conn.recv_into(memoryview(hdr)[got:])
                        if k == 0:
                            return
                        got += k
                    n = int.from_bytes(hdr, "little")
                    if n == 0:
                        return
                    off = 0
                    while n:
                        k = conn.recv_into(mv[off : off + min(n, size - off)])
                        if k == 0:
                            return
                        n -= k
                        off = (off + k) % size
                    conn.sendall(b"\x01")
            except OSError as exc:
                self.error = repr(exc)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def tcp_ceiling(host: str, port: int, sizes: Sequence[int], repeats: int, rtt_reps: int) -> dict[str, Any]:
    sock = socket.create_connection((host, port), timeout=_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.ones(min(max(sizes), 64 * MIB), dtype=np.uint8)
    mv = payload.data
    ack = bytearray(1)

    def send(n: int) -> float:
        t0 = time.perf_counter()
        sock.sendall(n.to_bytes(8, "little"))
        left = n
        while left:
            k = min(left, len(payload))
            sock.sendall(mv[:k])
            left -= k
        if sock.recv_into(ack) != 1:
            raise RuntimeError("TCP sink closed the connection")
        return time.perf_counter() - t0

    out: dict[str, Any] = {}
    try:
        for s in sorted(sizes):
            send(s)
            out[str(s)] = _timing(s, [send(s) for _ in range(_reps(s, repeats))])
        for _ in range(10):
            send(4096)
        rtt = [send(4096) for _ in range(rtt_reps)]
        sock.sendall((0).to_bytes(8, "little"))
    finally:
        sock.close()
    return {"sizes": out, "rtt_4k": _stats_us(rtt)}


# ----------------------------------------------------------------------------------------------------
# raw engines (blocking; run on the bench thread, timed inside the thread)
# ----------------------------------------------------------------------------------------------------
class RawEngine:
    """The native engine driven directly, as an expert would hand-code it."""

    single_styles: tuple[str, ...] = ()
    same_call: str = ""
    batch_style: str = ""

    def single(self, style: str, src: int, dst: int, n: int) -> float:
        raise NotImplementedError

    def latency(self, src: int, dst: int, n: int) -> float:
        raise NotImplementedError

    def batches(self, src: U64, dst: U64, length: U64) -> float:
        raise NotImplementedError

    def inflight(self, src: U64, dst: U64, length: U64, depth: int) -> tuple[float, list[float]]:
        raise NotImplementedError


class RawMooncake(RawEngine):
    single_styles = ("transfer_submit_write+check_status every 0.5 ms", "batch_transfer_sync_write")
    same_call = "transfer_submit_write+check_status every 0.5 ms"
    batch_style = "batch_transfer_async_write+get_batch_transfer_status, <=1024 entries per batch"

    def __init__(self, native: Any, target: str) -> None:
        self.e = native
        self.target = target

    def single(self, style: str, src: int, dst: int, n: int) -> float:
        e, t = self.e, self.target
        t0 = time.perf_counter()
        if style == "batch_transfer_sync_write":
            if e.batch_transfer_sync_write(t, [src], [dst], [n]) != 0:
                raise RuntimeError("batch_transfer_sync_write failed")
        else:
            bid = e.transfer_submit_write(t, src, dst, n)
            if not bid:
                raise RuntimeError("transfer_submit_write refused")
            while (rc := e.transfer_check_status(bid)) == 0:
                time.sleep(0.0005)
            if rc != 1:
                raise RuntimeError(f"transfer_check_status -> {rc}")
        return time.perf_counter() - t0

    def latency(self, src: int, dst: int, n: int) -> float:
        e, t = self.e, self.target
        t0 = time.perf_counter()
        bid = e.transfer_submit_write(t, src, dst, n)
        if not bid:
            raise RuntimeError("transfer_submit_write refused")
        while (rc := e.transfer_check_status(bid)) == 0:
            pass
        if rc != 1:
            raise RuntimeError(f"transfer_check_status -> {rc}")
        return time.perf_counter() - t0

    def batches(self, src: U64, dst: U64, length: U64) -> float:
        e, t = self.e, self.target
        s, d, n = src.tolist(), dst.tolist(), length.tolist()
        t0 = time.perf_counter()
        for i in range(0, len(s), _MAX_BATCH):
            bid = e.batch_transfer_async_write(t, s[i : i + _MAX_BATCH], d[i : i + _MAX_BATCH], n[i : i + _MAX_BATCH])
            if not bid:
                raise RuntimeError("batch_transfer_async_write refused")
            if e.get_batch_transfer_status([bid]) != 0:  # exactly once per id (it frees the id)
                raise RuntimeError("raw batch failed")
        return time.perf_counter() - t0

    def inflight(self, src: U64, dst: U64, length: U64, depth: int) -> tuple[float, list[float]]:
        e, t = self.e, self.target
        s, d, n = src.tolist(), dst.tolist(), length.tolist()
        lat: list[float] = []
        pending: list[tuple[int, float]] = []
        nxt, total = 0, len(s)
        clock = time.perf_counter
        t_start = clock()
        while nxt < total or pending:
            while nxt < total and len(pending) < depth:
                t0 = clock()
                bid = e.transfer_submit_write(t, s[nxt], d[nxt], n[nxt])
                if not bid:
                    raise RuntimeError("transfer_submit_write refused")
                pending.append((bid, t0))
                nxt += 1
            still = []
            for bid, t0 in pending:
                rc = e.transfer_check_status(bid)
                if rc == 0:
                    still.append((bid, t0))
                elif rc == 1:
                    lat.append(clock() - t0)
                else:
                    raise RuntimeError(f"transfer_check_status -> {rc}")
            if len(still) == len(pending):
                time.sleep(0)
            pending = still
        return clock() - t_start, lat


class RawNixl(RawEngine):
    single_styles = ("initialize_xfer+transfer+check_xfer_state spin",
                     "initialize_xfer+transfer+check_xfer_state every 0.5 ms")
    same_call = "initialize_xfer+transfer+check_xfer_state spin"
    batch_style = "one xfer per batch of <=1024 descriptors"

    def __init__(self, agent: Any, remote: str) -> None:
        self.a = agent
        self.remote = remote

    def _post(self, src: U64, dst: U64, length: U64) -> tuple[Any, str]:
        a = self.a
        zeros = np.zeros_like(src)
        lx = a.get_xfer_descs(np.ascontiguousarray(np.stack([src, length, zeros], axis=1), dtype=np.uint64), "DRAM")
        rx = a.get_xfer_descs(np.ascontiguousarray(np.stack([dst, length, zeros], axis=1), dtype=np.uint64), "DRAM")
        h = a.initialize_xfer("WRITE", lx, rx, self.remote)
        state = a.transfer(h)
        if state == "ERR":
            a.release_xfer_handle(h)
            raise RuntimeError("NIXL transfer -> ERR")
        return h, str(state)

    def _finish(self, h: Any, state: str, pause: float = 0.0) -> None:
        a = self.a
        while state == "PROC":
            if pause:
                time.sleep(pause)
            state = a.check_xfer_state(h)
        a.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL xfer -> {state}")

    def _one(self, src: int, dst: int, n: int, pause: float = 0.0) -> float:
        t0 = time.perf_counter()
        h, state = self._post(np.array([src], np.uint64), np.array([dst], np.uint64), np.array([n], np.uint64))
        self._finish(h, state, pause)
        return time.perf_counter() - t0

    def single(self, style: str, src: int, dst: int, n: int) -> float:
        return self._one(src, dst, n, 0.0005 if style.endswith("0.5 ms") else 0.0)

    def latency(self, src: int, dst: int, n: int) -> float:
        return self._one(src, dst, n)

    def batches(self, src: U64, dst: U64, length: U64) -> float:
        t0 = time.perf_counter()
        for i in range(0, src.size, _MAX_BATCH):
            sl = slice(i, i + _MAX_BATCH)
            self._finish(*self._post(src[sl], dst[sl], length[sl]))
        return time.perf_counter() - t0

    def inflight(self, src: U64, dst: U64, length: U64, depth: int) -> tuple[float, list[float]]:
        a = self.a
        lat: list[float] = []
        pending: list[tuple[Any, float]] = []
        nxt, total = 0, int(src.size)
        clock = time.perf_counter
        t_start = clock()
        while nxt < total or pending:
            while nxt < total and len(pending) < depth:
                t0 = clock()
                h, state = self._post(src[nxt : nxt + 1], dst[nxt : nxt + 1], length[nxt : nxt + 1])
                nxt += 1
                if state == "DONE":
                    a.release_xfer_handle(h)
                    lat.append(clock() - t0)
                else:
                    pending.append((h, t0))
            still = []
            for h, t0 in pending:
                state = a.check_xfer_state(h)
                if state == "PROC":
                    still.append((h, t0))
                    continue
                a.release_xfer_handle(h)
                if state != "DONE":
                    raise RuntimeError(f"NIXL xfer -> {state}")
                lat.append(clock() - t0)
            if still and len(still) == len(pending):
                time.sleep(0)
            pending = still
        return clock() - t_start, lat


def raw_engine(mgr: Any, target: str) -> RawEngine:
    native = mgr.engine.raw()
    if mgr.engine.name == "mooncake":
        return RawMooncake(native, target)
    if mgr.engine.name == "nixl":
        return RawNixl(native, target)
    raise RuntimeError(f"no raw driver for engine {mgr.engine.name!r}")


# ----------------------------------------------------------------------------------------------------
# decode worker: a command server
# ----------------------------------------------------------------------------------------------------
@dataclass
class _DSetup:
    kind: str
    pools: list[KVPool]
    mgrs: list[Any]
    auxes: list[npt.NDArray[np.uint8]]
    geo: dict[str, Any]
    batches: dict[str, asyncio.Future[list[Any]]] = field(default_factory=dict)


async def _decode_worker(ns: argparse.Namespace) -> int:
    from . import KVArgs, KVManager, TransferConfig

    chan = await open_parent_channel()
    spec = ENGINES[ns.engine_key]
    params = Params.from_json(ns.params)
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-decode")
    loop = asyncio.get_running_loop()
    setups: dict[str, _DSetup] = {}
    sink: list[TcpSink] = []

    async def off(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wait_for(loop.run_in_executor(worker, fn, *args), _TIMEOUT)

    async def close_setup(name: str) -> None:
        s = setups.pop(name, None)
        if s is None:
            return
        for m in s.mgrs:
            with contextlib.suppress(Exception):
                await m.aclose()
        for fut in s.batches.values():
            fut.cancel()
            with contextlib.suppress(BaseException):
                await fut

    async def setup(cmd: dict[str, Any]) -> dict[str, Any]:
        name = cmd["name"]
        await close_setup(name)
        cfg = TransferConfig(engine=spec.engine, hostname=params.host,
                             **{**params.manager_config(), **cmd.get("cfg", {})})
        pools: list[KVPool] = []
        auxes: list[npt.NDArray[np.uint8]] = []
        mgrs: list[Any] = []
        geo: dict[str, Any] = dict(cmd)
        try:
            if cmd["kind"] == "flat":
                pool = KVPool(1, cmd["pages"], (cmd["page_bytes"] // 2,))
                await off(pool.prefault)
                aux = (np.zeros((cmd["aux_slots"], cmd["aux_bytes"]), dtype=np.uint8) if cmd.get("aux_slots")
                       else None)
                args = KVArgs(pool.buffers, page_size=1, dtype="uint16",
                              aux_buffers=[aux] if aux is not None else ())
                mgrs.append(await asyncio.wait_for(KVManager(args, cfg).start(), 60.0))
                pools.append(pool)
                if aux is not None:
                    auxes.append(aux)
            elif cmd["kind"] == "tp":
                ranks, heads = cmd["ranks"], cmd["heads"] // cmd["ranks"]
                for d in range(ranks):
                    pool = KVPool(2 * cmd["layers"], cmd["pages"], (cmd["rows"], heads, cmd["head_dim"]),
                                  layer_ids=[b % cmd["layers"] for b in range(2 * cmd["layers"])])
                    await off(pool.prefault)
                    args = KVArgs(pool.buffers, page_size=cmd["rows"], dtype="uint16", kv_layer_ids=pool.layer_ids,
                                  tp_size=ranks, tp_rank=d, kv_heads=heads, total_kv_heads=cmd["heads"])
                    mgrs.append(await asyncio.wait_for(KVManager(args, cfg).start(), 60.0))
                    pools.append(pool)
            else:
                raise ValueError(f"unknown setup kind {cmd['kind']!r}")
        except BaseException:
            for m in mgrs:
                with contextlib.suppress(Exception):
                    await m.aclose()
            raise
        setups[name] = _DSetup(cmd["kind"], pools, mgrs, auxes, geo)
        return {
            "endpoints": [m.endpoint for m in mgrs],
            "sessions": [m.engine.session_id for m in mgrs],
            "bases": [p.bases for p in pools],
            "aux_bases": [int(a.ctypes.data) for a in auxes],
            "describe": mgrs[0].describe(),
        }

    async def arm(cmd: dict[str, Any]) -> dict[str, Any]:
        s = setups[cmd["name"]]
        rooms: list[int] = cmd["rooms"]
        dsts: list[list[int]] = cmd.get("dsts") or [cmd["dst"]] * len(rooms)
        auxs: list[int | None] = cmd.get("aux") or [None] * len(rooms)
        timeout = float(cmd.get("timeout", _TIMEOUT))
        rxs = [m.receiver(room, cmd["peer"]) for m in s.mgrs for room in rooms]
        pairs = [(rx, np.asarray(dsts[i % len(rooms)], dtype=np.int64), auxs[i % len(rooms)])
                 for i, rx in enumerate(rxs)]
        await asyncio.gather(*(rx.send_metadata(d, aux_index=a, timeout=timeout) for rx, d, a in pairs))

        async def wait_one(rx: Any) -> list[Any]:
            try:
                await rx.done(timeout=timeout)
                return [time.monotonic(), None, rx.aux_path]
            except Exception as exc:
                return [time.monotonic(), f"{type(exc).__name__}: {exc}", None]

        s.batches[cmd["batch"]] = asyncio.ensure_future(asyncio.gather(*(wait_one(rx) for rx in rxs)))
        return {"armed": len(rxs)}

    async def collect(cmd: dict[str, Any]) -> dict[str, Any]:
        s = setups[cmd["name"]]
        fut = s.batches.pop(cmd["batch"])
        rows = await asyncio.wait_for(fut, float(cmd.get("timeout", _TIMEOUT)))
        errors = [r[1] for r in rows if r[1]]
        return {"done_ts": [r[0] for r in rows], "aux_paths": [r[2] for r in rows], "failed": len(errors),
                "errors": errors[:5]}

    def verify_flat(s: _DSetup, tag: int, pages: I64, poison: bool) -> int:
        pool = s.pools[0]
        bad = count_bad_pages(pool, tag, pages)
        if poison:
            pool.poison(pages)
        return bad

    def verify_tp(s: _DSetup, tag: int, pages: I64, poison: bool) -> int:
        g = s.geo
        ranks = g["ranks"]
        hc = g["heads"] // ranks
        bad = 0
        for d, pool in enumerate(s.pools):
            bad += tp_bad_pages(pool, tag, pages, g["rows"], g["heads"], g["head_dim"] * 2 // 8, d * hc, hc)
            if poison:
                pool.poison(pages)
        return bad

    def verify_aux(s: _DSetup, rooms: list[int], slots: list[int]) -> int:
        aux = s.auxes[0]
        return sum(int(not np.array_equal(aux[slot], aux_pattern(room, aux.shape[1])))
                   for room, slot in zip(rooms, slots, strict=True))

    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "setup":
            return await setup(cmd)
        if op == "teardown":
            await close_setup(cmd["name"])
            return {}
        if op == "arm":
            return await arm(cmd)
        if op == "collect":
            return await collect(cmd)
        if op == "verify":
            s = setups[cmd["name"]]
            pages = np.asarray(cmd["pages"], dtype=np.int64)
            fn = verify_tp if s.kind == "tp" else verify_flat
            return {"bad": await off(fn, s, int(cmd["tag"]), pages, bool(cmd.get("poison", True)))}
        if op == "poison":
            s = setups[cmd["name"]]
            pages = np.asarray(cmd["pages"], dtype=np.int64)
            for pool in s.pools:
                await off(pool.poison, pages)
            return {}
        if op == "verify_aux":
            return {"bad": await off(verify_aux, setups[cmd["name"]], cmd["rooms"], cmd["slots"])}
        if op == "tcp_sink":
            t = TcpSink(params.host, int(cmd["bufsize"]))
            await off(t.buf.fill, 1)
            t.start()
            sink.append(t)
            return {"port": t.port}
        if op == "tcp_sink_stop":
            while sink:
                t = sink.pop()
                t.close()
                await off(t.join, 10.0)
            return {}
        if op == "clock":
            return {"t": time.monotonic()}
        if op == "stats":
            s = setups[cmd["name"]]
            return {"stats": [{k: v for k, v in m.stats().items() if isinstance(v, int)} for m in s.mgrs]}
        raise ValueError(f"unknown command {op!r}")

    try:
        await chan.serve(handle, idle_timeout=7200.0, send_timeout=60.0, trace=True)
    finally:
        for name in list(setups):
            await close_setup(name)
        for t in sink:
            t.close()
        worker.shutdown(wait=False, cancel_futures=True)
    return 0


# ----------------------------------------------------------------------------------------------------
# prefill worker: runs the phases
# ----------------------------------------------------------------------------------------------------
class _Decode:
    def __init__(self, child: Child) -> None:
        self.child = child

    async def call(self, op: str, timeout: float = _TIMEOUT, **kw: Any) -> dict[str, Any]:
        await self.child.channel.send({"cmd": op, **kw}, timeout=60.0)
        msg = await self.child.channel.recv(timeout)
        if msg is None:
            raise RuntimeError(f"decode worker exited during {op!r}")
        if msg.get("event") == "error":
            raise RuntimeError(f"decode: {op}: {msg.get('message')}")
        return msg


@dataclass
class _Flat:
    """Prefill side of a one-buffer setup (one or more managers) and what the decode reported."""

    name: str
    pools: list[KVPool]
    mgrs: list[Any]
    auxes: list[npt.NDArray[np.uint8]]
    page_bytes: int
    pages: int
    session: str
    endpoint: str
    dst_base: int

    @property
    def src_base(self) -> int:
        return self.pools[0].bases[0]


class _Ctx:
    def __init__(self, spec: EngineSpec, params: Params, dec: _Decode, chan: Channel) -> None:
        self.spec = spec
        self.params = params
        self.dec = dec
        self.chan = chan
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-raw")
        self._rooms = itertools.count(_ROOM0)
        self.results: dict[str, Any] = {}
        self.describe: dict[str, Any] | None = None

    def rooms(self, n: int) -> list[int]:
        return [next(self._rooms) for _ in range(n)]

    async def off(self, fn: Callable[..., Any], *args: Any, timeout: float = _TIMEOUT) -> Any:
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self.thread, fn, *args), timeout)

    async def progress(self, message: str) -> None:
        await self.chan.send({"event": "progress", "message": f"[{self.spec.key}] {message}"})

    async def verify(self, name: str, tag: int, pages: Any, *, what: str, poison: bool = True) -> None:
        bad = (await self.dec.call("verify", name=name, tag=tag, pages=np.asarray(pages).tolist(),
                                   poison=poison))["bad"]
        if bad:
            raise RuntimeError(f"{what}: {bad} mismatched pages on the decode side")

    def config(self, **overrides: Any) -> Any:
        from . import TransferConfig

        return TransferConfig(engine=self.spec.engine, hostname=self.params.host,
                              **{**self.params.manager_config(), **overrides})

    async def flat(self, name: str, *, pages: int, page_bytes: int, n: int = 1,
                   cfgs: Sequence[dict[str, Any]] | None = None, aux_slots: int = 0,
                   aux_bytes: int = 0) -> _Flat:
        from . import KVArgs, KVManager

        pools: list[KVPool] = []
        mgrs: list[Any] = []
        auxes: list[npt.NDArray[np.uint8]] = []
        try:
            for i in range(n):
                pool = KVPool(1, pages, (page_bytes // 2,))
                await self.off(pool.prefault)
                aux = np.zeros((aux_slots, aux_bytes), dtype=np.uint8) if aux_slots else None
                args = KVArgs(pool.buffers, page_size=1, dtype="uint16", aux_buffers=[aux] if aux is not None else ())
                cfg = self.config(**(cfgs[i] if cfgs else {}))
                mgrs.append(await asyncio.wait_for(KVManager(args, cfg).start(), 60.0))
                pools.append(pool)
                if aux is not None:
                    auxes.append(aux)
            info = await self.dec.call("setup", name=name, kind="flat", pages=pages, page_bytes=page_bytes,
                                       aux_slots=aux_slots, aux_bytes=aux_bytes)
        except BaseException:
            for m in mgrs:
                with contextlib.suppress(Exception):
                    await m.aclose()
            raise
        if self.describe is None:
            self.describe = {"prefill": mgrs[0].describe(), "decode": info["describe"]}
        return _Flat(name, pools, mgrs, auxes, page_bytes, pages, info["sessions"][0], info["endpoints"][0],
                     info["bases"][0][0])

    async def close(self, f: _Flat) -> None:
        for m in f.mgrs:
            with contextlib.suppress(Exception):
                await m.aclose()
        with contextlib.suppress(Exception):
            await self.dec.call("teardown", name=f.name)

    async def arm(self, name: str, batch: str, rooms: list[int], peer: str, *, dst: Any = None,
                  dsts: Sequence[Any] | None = None, aux: list[int] | None = None) -> None:
        kw: dict[str, Any] = {}
        if dsts is not None:
            kw["dsts"] = [np.asarray(d).tolist() for d in dsts]
        else:
            kw["dst"] = np.asarray(dst).tolist()
        if aux is not None:
            kw["aux"] = aux
        await self.dec.call("arm", name=name, batch=batch, rooms=rooms, peer=peer, **kw)

    async def collect(self, name: str, batch: str) -> dict[str, Any]:
        return await self.dec.call("collect", name=name, batch=batch)


async def _attempt(aw: Awaitable[float]) -> tuple[float, str | None]:
    """``(result, None)`` or ``(nan, "Error: reason")``: failures are counted, not raised."""
    try:
        return await aw, None
    except Exception as exc:
        return float("nan"), f"{type(exc).__name__}: {exc}"


async def _send(mgr: Any, room: int, src: Any, timeout: float = _TIMEOUT) -> float:
    """Prefill-side time of ``await send_kv`` (decode already armed: ``wait_ready`` returns at once)."""
    tx = mgr.sender(room)
    await tx.wait_ready(timeout=timeout)
    t0 = time.perf_counter()
    await tx.send_kv(src, timeout=timeout)
    return time.perf_counter() - t0


def _addr(base: int, pages: Any, page_bytes: int) -> U64:
    out: U64 = np.uint64(base) + np.asarray(pages, dtype=np.uint64) * np.uint64(page_bytes)
    return out


# -- phases ----------------------------------------------------------------------------------------
async def phase_ceilings(ctx: _Ctx) -> dict[str, Any]:
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


async def phase_throughput(ctx: _Ctx) -> dict[str, Any]:
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
            reps = _reps(s, p.repeats)
            rooms = ctx.rooms(reps + 1)
            await ctx.arm("thr", str(s), rooms, mgr.endpoint, dst=idx)
            await _send(mgr, rooms[0], idx)
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
                        aio_t.append(await _send(mgr, rooms[r + 1], idx))
                    else:
                        raw_t[st].append(await ctx.off(raw.single, st, f.src_base, f.dst_base, s))
            col = await ctx.collect("thr", str(s))
            raw_med = {st: _median(ts) for st, ts in raw_t.items()}
            best = min(raw_med, key=lambda k: raw_med[k])
            aio_med = _median(aio_t)
            out[str(s)] = {
                "bytes": s, "reps": reps,
                "aiotransfer": _timing(s, aio_t),
                "raw": {st: _timing(s, ts) for st, ts in raw_t.items()},
                "raw_best": best,
                "raw_same_call": raw.same_call,
                "ratio": raw_med[best] / aio_med,
                "ratio_same_call": raw_med[raw.same_call] / aio_med,
                "failed": col["failed"],
            }
            await ctx.progress(f"throughput {s // KIB} KiB: aiotransfer {_gbps(s, aio_med):.2f} GB/s, "
                               f"raw {_gbps(s, raw_med[best]):.2f} GB/s")
        return {"page_bytes": page, "sizes": out}
    finally:
        await ctx.close(f)


async def _planning(mgr: Any, endpoint: str, src: I64, dst: I64, reps: int) -> dict[str, Any]:
    """Planning time on the scattered input, measured on the loop thread where the library runs it."""
    from .staging import gather_pages

    peer = mgr._decode_peers.get(endpoint)
    if peer is None:
        return {"error": "decode peer not registered"}
    plan_t, stage_t = [], []
    blocks = None
    decision = None
    for _ in range(reps):
        t0 = time.perf_counter()
        blocks = mgr._plan_kv(peer, src, dst)
        plan_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decision = mgr._staging_plan(peer, src, dst)
        stage_t.append(time.perf_counter() - t0)
        await asyncio.sleep(0)
    out: dict[str, Any] = {
        "plan_kv_us": _median(plan_t) * 1e6,
        "staging_plan_us": _median(stage_t) * 1e6,
        "direct_entries": len(blocks) if blocks is not None else None,
        "staged": decision is not None,
    }
    if decision is not None and mgr._kv_views is not None:
        s_sl = decision[0]
        views = [mgr._kv_views[i] for i in peer.pairing.src]
        counts = [mgr.args.kv[i].num_items for i in peer.pairing.src]
        scratch = np.empty(src.size * s_sl.bytes_per_page * len(views), dtype=np.uint8)
        gather_t = []
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            gather_pages(views, counts, src, s_sl, scratch)
            gather_t.append(time.perf_counter() - t0)
            await asyncio.sleep(0)
        out["gather_ms"] = _median(gather_t) * 1e3
    return out


async def phase_scattered(ctx: _Ctx) -> dict[str, Any]:
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
        s_addr, d_addr = _addr(f.src_base, src, pb), _addr(f.dst_base, dst, pb)
        lens = np.full(n, pb, dtype=np.uint64)
        c_src, c_dst, nbytes = f.src_base + area * pb, f.dst_base + area * pb, n * pb
        reps = p.repeats
        rooms = ctx.rooms(reps + 1)
        await ctx.arm("sc", "aio", rooms, mgr.endpoint, dst=dst)
        before = dict(mgr.stats())
        await _send(mgr, rooms[0], src)
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
                    t[v].append(await _send(mgr, rooms[r + 1], src))
                elif v == "raw_pages":
                    t[v].append(await ctx.off(raw.batches, s_addr, d_addr, lens))
                else:
                    t[v].append(await ctx.off(raw.single, raw.same_call, c_src, c_dst, nbytes))
        col = await ctx.collect("sc", "aio")
        await ctx.verify("sc", tag_s, dst, what="aiotransfer scattered (last timed run)")
        planning = await _planning(mgr, f.endpoint, src, dst, 20)
        med = {k: _median(v) for k, v in t.items()}
        res = {
            "pages": n, "page_bytes": pb, "bytes": nbytes, "reps": reps, "pool_pages": area + n,
            "aiotransfer": {**_timing(nbytes, t["aiotransfer"]), "entries": entries, "staged_pieces": staged,
                            "staging": "auto"},
            "raw_pages": {**_timing(nbytes, t["raw_pages"]), "entries": n, "call": raw.batch_style,
                          "us_per_entry": med["raw_pages"] / n * 1e6},
            "raw_contiguous": {**_timing(nbytes, t["raw_contiguous"]), "entries": 1, "call": raw.same_call},
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


def _est_gbps(ctx: _Ctx, size: int) -> float:
    thr = ctx.results.get("throughput", {}).get("sizes", {})
    if not thr:
        return 1.5
    best = min(thr.values(), key=lambda r: abs(np.log(r["bytes"] / size)))
    g = best["aiotransfer"]["gbps"]
    return float(g) if g == g and g > 0 else 1.5


async def phase_lag(ctx: _Ctx) -> dict[str, Any]:
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
        await _send(mgr, rooms[-1], slot[0])
        idle = LoopLagMonitor(attribute=True)
        async with idle:
            await asyncio.sleep(min(1.0, p.lag_seconds))
        failures: list[str] = []

        async def worker(j: int) -> None:
            for k in range(j, count, depth):
                _, err = await _attempt(_send(mgr, rooms[k], slot[j]))
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
        src = np.concatenate([_addr(f.src_base, slot[j], page)[:1] for j in ks])
        dst = np.concatenate([_addr(f.dst_base, slot[j], page)[:1] for j in ks])
        lens = np.full(count, size, dtype=np.uint64)
        rawmon = LoopLagMonitor(attribute=True)
        rawmon.start()
        raw_s, _ = await ctx.off(raw.inflight, src, dst, lens, depth)
        await rawmon.stop()
        await ctx.verify("lag", tag, all_pages, what="raw (lag)")
        nbytes = count * size
        res: dict[str, Any] = {
            "request_bytes": size, "in_flight": depth, "requests": count,
            "idle": _lag_record(idle),
            "aiotransfer": {**_lag_record(aio), "seconds": aio_s, "gbps": _gbps(nbytes, aio_s),
                            "failed": len(failures) + col["failed"], "errors": failures[:3]},
            "raw_thread": {**_lag_record(rawmon), "seconds": raw_s, "gbps": _gbps(nbytes, raw_s),
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


async def phase_concurrency(ctx: _Ctx) -> dict[str, Any]:
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
        await _send(mgr, warm[0], [0])
        await ctx.collect("conc", "warm")
        levels: dict[str, Any] = {}
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
                    dt, err = await _attempt(_send(mgr, rooms[k], [j]))
                    if err:
                        failures.append(err)
                    else:
                        lat.append(dt)

            async def run_aio(n: int = n, worker: Callable[[int], Awaitable[None]] = worker) -> float:
                t0 = time.perf_counter()
                await asyncio.gather(*(worker(j) for j in range(n)))
                return time.perf_counter() - t0

            ks = np.arange(total) % n
            src, dst = _addr(f.src_base, ks, size), _addr(f.dst_base, ks, size)
            lens = np.full(total, size, dtype=np.uint64)
            if li % 2 == 0:
                aio_s = await run_aio()
                col = await ctx.collect("conc", str(n))
                await ctx.verify("conc", tag, np.arange(n), what=f"aiotransfer {n} in flight")
                raw_s, raw_lat = await ctx.off(raw.inflight, src, dst, lens, n)
                await ctx.verify("conc", tag, np.arange(n), what=f"raw {n} in flight")
            else:
                raw_s, raw_lat = await ctx.off(raw.inflight, src, dst, lens, n)
                await ctx.verify("conc", tag, np.arange(n), what=f"raw {n} in flight")
                aio_s = await run_aio()
                col = await ctx.collect("conc", str(n))
                await ctx.verify("conc", tag, np.arange(n), what=f"aiotransfer {n} in flight")
            nbytes = total * size
            levels[str(n)] = {
                "in_flight": n, "requests": total,
                "aiotransfer": {"seconds": aio_s, "gbps": _gbps(nbytes, aio_s), "latency": _stats_us(lat),
                                "failed": len(failures) + col["failed"], "errors": failures[:3] + col["errors"][:3]},
                "raw": {"seconds": raw_s, "gbps": _gbps(nbytes, raw_s), "latency": _stats_us(raw_lat)},
            }
            await ctx.progress(f"concurrency {n}: aiotransfer {_gbps(nbytes, aio_s):.2f} GB/s, "
                               f"raw {_gbps(nbytes, raw_s):.2f} GB/s, {len(failures) + col['failed']} failed")
        return {"request_bytes": size, "levels": levels,
                "latency_note": "aiotransfer: prefill-side send_kv call (queueing for engine credit included); "
                                "raw: submit to completion seen by the polling thread"}
    finally:
        await ctx.close(f)


async def _clock_check(ctx: _Ctx, n: int = 20) -> dict[str, Any]:
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
            "consistent": ok, "decode_minus_before_us": _stats_us(before), "after_minus_decode_us": _stats_us(after)}


async def phase_e2e(ctx: _Ctx) -> dict[str, Any]:
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
                await tx.wait_ready(timeout=_TIMEOUT)
                t0 = time.monotonic()
                await tx.send_kv([k % slots], timeout=_TIMEOUT)
                t1 = time.monotonic()
                await tx.done(timeout=_TIMEOUT)
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
                "e2e": _stats_us(e2e[ok].tolist()),
                "send_kv": _stats_us((ts1 - ts0)[ok].tolist()),
                "decode_done": _stats_us((td - ts0)[ok].tolist()),
                "prefill_done": _stats_us((ts2 - ts0)[ok].tolist()),
                "failed": len(failures) + col["failed"],
                "definition": "max(prefill done(), decode done()) - start of send_kv, CLOCK_MONOTONIC in both",
            },
            "raw": {**_stats_us(raw_lat), "call": "single 4 KiB write, submit to completion (spin); no "
                    "notification to the decode"},
        }
        await ctx.progress(f"4 KiB end to end: p50 {res['aiotransfer']['e2e']['p50_us']} us, "
                           f"p99 {res['aiotransfer']['e2e']['p99_us']} us (raw write p50 {res['raw']['p50_us']} us)")
        return res
    finally:
        await ctx.close(f)


async def phase_aux(ctx: _Ctx) -> dict[str, Any]:
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
                    await tx.wait_ready(timeout=_TIMEOUT)
                    await tx.send_kv([j % 64], timeout=_TIMEOUT)
                    t0 = time.monotonic()
                    await tx.send_aux(j, timeout=_TIMEOUT)
                    t1 = time.monotonic()
                    await tx.done(timeout=_TIMEOUT)
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
                "e2e": _stats_us(e2e[ok].tolist()),
                "send_aux_call": _stats_us(np.asarray(t_call[x][warm:])[ok].tolist()),
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


async def _tp_raw_ceiling(ctx: _Ctx, mgrs: list[Any], pools: list[KVPool], info: dict[str, Any], per_buffer: int,
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
    return {**_timing(per_buffer * sum(j[1].size for j in jobs), times),
            "entries": sum(int(j[1].size) for j in jobs), "call": jobs[0][0].batch_style}


async def phase_tp(ctx: _Ctx) -> dict[str, Any]:
    from . import KVArgs, KVManager

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
                await asyncio.gather(*(tx.wait_ready(timeout=_TIMEOUT) for tx in txs))
                t0 = time.perf_counter()
                await asyncio.gather(*(tx.send_kv(pages_src, timeout=3 * _TIMEOUT) for tx in txs))
                dt = time.perf_counter() - t0
                await asyncio.gather(*(tx.done(timeout=_TIMEOUT) for tx in txs))
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
                **_timing(nbytes, times),
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


PHASES: dict[str, Callable[[_Ctx], Awaitable[dict[str, Any]]]] = {
    "ceilings": phase_ceilings,
    "throughput": phase_throughput,
    "scattered": phase_scattered,
    "lag": phase_lag,
    "concurrency": phase_concurrency,
    "e2e": phase_e2e,
    "aux": phase_aux,
    "tp": phase_tp,
}


async def _prefill_worker(ns: argparse.Namespace) -> int:
    chan = await open_parent_channel()
    spec = ENGINES[ns.engine_key]
    params = Params.from_json(ns.params)
    phases = [x for x in (("ceilings",) if ns.ceilings else ()) + spec.phases
              if params.phases is None or x in params.phases]
    child = await Child.spawn("aiotransfer._benchsuite", ["--engine-key", spec.key, "--params", ns.params])
    ctx = _Ctx(spec, params, _Decode(child), chan)
    results: dict[str, Any] = {"engine": spec.engine, "label": spec.label, "ucx_tls": os.environ.get("UCX_TLS"),
                               "phases": {}}
    try:
        for name in phases:
            await ctx.progress(f"{name} ...")
            t0 = time.perf_counter()
            try:
                res = await PHASES[name](ctx)
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                res = {"error": f"{type(exc).__name__}: {exc}"}
            res["seconds"] = round(time.perf_counter() - t0, 2)
            results["phases"][name] = res
            ctx.results[name] = res
        results["describe"] = ctx.describe
    finally:
        results["decode_exit"] = await child.close(30.0)
        ctx.thread.shutdown(wait=False, cancel_futures=True)
    await chan.send({"event": "result", "result": results}, timeout=60.0)
    return 0


# ----------------------------------------------------------------------------------------------------
# orchestrator
# ----------------------------------------------------------------------------------------------------
def _dist_version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nixl_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl_cu12", "nixl_cu13", "nixl"))


async def _run_pair(spec: EngineSpec, params: Params, ceilings: bool, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    for k in spec.unset:
        env.pop(k, None)
    env.update(spec.env)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    argv = [sys.executable, "-m", "aiotransfer._benchsuite", "--role", "prefill", "--engine-key", spec.key,
            "--params", params.to_json()]
    if ceilings:
        argv.append("--ceilings")
    proc = await asyncio.wait_for(asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, limit=64 * MIB,
    ), 30.0)
    child = Child(proc)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            msg = await child.channel.recv(max(deadline - loop.time(), 0.001))
            if msg is None:
                raise RuntimeError(f"{spec.key} prefill worker exited (rc={await child.wait(5.0)}) without a result")
            if msg.get("event") == "progress":
                print(f"  {msg['message']}", file=sys.stderr, flush=True)
            elif msg.get("event") == "result":
                res: dict[str, Any] = msg["result"]
                return res
    finally:
        await child.close(30.0)


async def _suite_main(params: Params, engines: Sequence[str], quick: bool) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_at_start = list(os.getloadavg())
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    ceilings: dict[str, Any] | None = None
    timeout = 900.0 if params.scale != "full" else 3600.0
    want_ceilings = params.phases is None or "ceilings" in params.phases
    for key in engines:
        spec = ENGINES[key]
        if spec.engine == "nixl" and not _nixl_available():
            skipped[key] = "NIXL is not installed (pip install --no-deps nixl-cu12)"
            continue
        print(f"{spec.label} ({key}) ...", file=sys.stderr, flush=True)
        try:
            res = await _run_pair(spec, params, want_ceilings and ceilings is None, timeout)
        except (RuntimeError, asyncio.TimeoutError) as exc:
            results[key] = {"label": spec.label, "phases": {}, "error": f"{type(exc).__name__}: {exc}"}
            continue
        if "ceilings" in res["phases"]:
            ceilings = res["phases"].pop("ceilings")
            ceilings["measured_by"] = key
        results[key] = res
    versions = {d: _dist_version(d) for d in ("mooncake-transfer-engine-non-cuda", "nixl-cu12", "numpy", "pyzmq")}
    return {
        "suite": "full",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_start": load_at_start, "load_avg_at_end": list(os.getloadavg()),
                    "versions": versions},
        "quick": quick,
        "params": asdict(params),
        "note": "GB/s = 1e9 B/s; medians of the repeats; raw and aiotransfer alternate in the same pair of "
                "processes; ratio = aiotransfer GB/s / raw GB/s (> 1: aiotransfer faster). This machine kind is "
                "noisy: +-20 % between runs.",
        "ceilings": ceilings,
        "engines": results,
        "skipped": skipped,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }


def run_suite(ns: argparse.Namespace) -> int:
    """``python -m aiotransfer bench --suite full``: run, write JSON + PNGs, print the table."""
    from . import _benchreport as report

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    out = ns.out or "bench-results/full.json"
    if ns.replot:
        with open(ns.replot) as fh:
            res = json.load(fh)
    else:
        engines = [e.strip() for e in (ns.engines or ",".join(ENGINES)).split(",") if e.strip()]
        unknown = [e for e in engines if e not in ENGINES]
        phases = [x.strip() for x in ns.phases.split(",")] if ns.phases else None
        if unknown or (phases and any(x not in ALL_PHASES for x in phases)):
            print(f"aiotransfer bench: engines are {', '.join(ENGINES)}; phases are {', '.join(ALL_PHASES)}",
                  file=sys.stderr)
            return 2
        params = make_params(quick=ns.quick, tiny=ns.tiny, repeats=ns.repeats_given, seed=ns.seed, host=ns.host,
                             phases=phases, tp_split_credits=not ns.tp_library_credits,
                             engine_threads=ns.engine_threads,
                             nixl_progress_delay_us=ns.nixl_progress_delay_us)
        try:
            res = asyncio.run(_suite_main(params, engines, ns.quick or ns.tiny))
        except KeyboardInterrupt:
            return 130
    res["figures"] = report.derive(res)
    res["targets"] = report.evaluate(res)
    res["images"] = []
    if ns.img_dir:
        try:
            res["images"] = report.plot_all(res, ns.img_dir)
        except ImportError as exc:
            print(f"plots skipped: {exc} (pip install matplotlib)", file=sys.stderr)
    print(report.table(res))
    if not ns.replot or ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out + ".tmp", "w") as fh:
            json.dump(res, fh, indent=1)
            fh.write("\n")
        os.replace(out + ".tmp", out)
        md = os.path.splitext(out)[0] + ".md"
        with open(md, "w") as fh:
            fh.write(report.markdown_table(res) + "\n")
        print(f"results written to {out} (table for the docs: {md})")
    if ns.img_dir and res.get("images"):
        print(f"plots written to {ns.img_dir}: {', '.join(os.path.basename(x) for x in res['images'])}")
    errors = [f"{k}.{ph}" for k, e in res["engines"].items() for ph, r in e.get("phases", {}).items()
              if isinstance(r, dict) and r.get("error")]
    errors += [k for k, e in res["engines"].items() if e.get("error")]
    if errors:
        print(f"aiotransfer bench: phases failed: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------------
# worker entry point
# ----------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiotransfer._benchsuite", description="benchmark suite worker")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--engine-key", choices=tuple(ENGINES), required=True)
    p.add_argument("--params", required=True)
    p.add_argument("--ceilings", action="store_true")
    ns = p.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        return asyncio.run(_decode_worker(ns) if ns.role == "decode" else _prefill_worker(ns))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
