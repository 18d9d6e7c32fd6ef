"""The raw-engine baselines: the manager's own native engine driven directly, as an expert would
hand-code it, to compare aiotransfer against on the same engine, memory and connection.

This is the one module that calls ``engine.raw()``. Every function here blocks: it runs on a plain thread
and is timed inside that thread, around the native calls.

* the default ``bench`` (figures (a)-(c), Mooncake only): :data:`RAW_STYLES`, one function per native call
  style, over batches of (src, dst, length) lists; :func:`native_engine` hands out the native object;
* ``python -m benchmarks full`` (Mooncake and NIXL): :class:`RawEngine` and its drivers, from :func:`raw_engine`.
  :meth:`RawEngine.drain` also measures the calling thread's CPU time (the ``cpu`` phase).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .workload import U64

__all__ = [
    "MAX_BATCH",
    "RAW_STYLES",
    "SAME_CALL",
    "Batch",
    "RawEngine",
    "RawFn",
    "RawMooncake",
    "RawNixl",
    "native_engine",
    "raw_engine",
]

MAX_BATCH = 1024
"""Largest raw batch: Mooncake rejects beyond ~2,048 entries queued per peer."""

Batch = tuple[list[int], list[int], list[int]]
"""(source addresses, destination addresses, lengths) of one native batch call."""


# ----------------------------------------------------------------------------------------------------
# default bench: raw Mooncake call styles over lists of entries
# ----------------------------------------------------------------------------------------------------
def native_engine(mgr: Any) -> Any:
    """``mgr``'s native engine object (Mooncake's ``TransferEngine``), or None if its engine has none."""
    return getattr(mgr.engine, "raw", lambda: None)()


def _raw_sync_write(e: Any, target: str, batches: list[Batch]) -> float:
    t0 = time.perf_counter()
    for s, d, n in batches:
        for k in range(len(s)):
            if e.transfer_sync_write(target, s[k], d[k], n[k]) != 0:
                raise RuntimeError("transfer_sync_write failed")
    return time.perf_counter() - t0


def _raw_batch_sync(e: Any, target: str, batches: list[Batch]) -> float:
    t0 = time.perf_counter()
    for s, d, n in batches:
        if e.batch_transfer_sync_write(target, s, d, n) != 0:
            raise RuntimeError(f"batch_transfer_sync_write of {len(s)} entries failed")
    return time.perf_counter() - t0


def _raw_submit(
    e: Any, target: str, batches: list[Batch], pause: float = 0.0
) -> float:
    """``transfer_submit_write`` per entry, then ``transfer_check_status`` until done: spinning when
    ``pause`` is 0, else sleeping ``pause`` seconds between checks (no spinning core)."""
    t0 = time.perf_counter()
    for s, d, n in batches:
        for k in range(len(s)):
            bid = e.transfer_submit_write(target, s[k], d[k], n[k])
            if not bid:
                raise RuntimeError("transfer_submit_write refused")
            while (rc := e.transfer_check_status(bid)) == 0:
                if pause:
                    time.sleep(pause)
            if rc != 1:
                raise RuntimeError(f"transfer_check_status -> {rc}")
    return time.perf_counter() - t0


def _raw_batch_async(e: Any, target: str, batches: list[Batch]) -> float:
    t0 = time.perf_counter()
    for s, d, n in batches:
        bid = e.batch_transfer_async_write(target, s, d, n)
        if not bid:
            raise RuntimeError("batch_transfer_async_write refused")
        if e.get_batch_transfer_status([bid]) != 0:  # exactly once per id (it frees the id)
            raise RuntimeError(f"batch of {len(s)} entries failed")
    return time.perf_counter() - t0


RawFn = Callable[[Any, str, list[Batch]], float]
SAME_CALL = {
    "single": "transfer_submit_write+check_status every 0.5 ms",
    "runs": "batch_transfer_async_write+get_batch_transfer_status",
    "pages": "batch_transfer_async_write+get_batch_transfer_status (<=1024/batch)",
}
"""The raw style matching what aiotransfer's Mooncake adapter calls (a like-for-like ratio, free of the
upward bias of picking the best of several noisy raw medians)."""

RAW_STYLES: dict[str, dict[str, RawFn]] = {
    "single": {
        "transfer_sync_write": _raw_sync_write,
        "batch_transfer_sync_write": _raw_batch_sync,
        "transfer_submit_write+check_status spin": _raw_submit,
        "transfer_submit_write+check_status every 0.5 ms": functools.partial(_raw_submit, pause=0.0005),
        "batch_transfer_async_write+get_batch_transfer_status": _raw_batch_async,
    },
    "runs": {
        "batch_transfer_sync_write": _raw_batch_sync,
        "batch_transfer_async_write+get_batch_transfer_status": _raw_batch_async,
    },
    "pages": {
        "batch_transfer_sync_write (<=1024/batch)": _raw_batch_sync,
        "batch_transfer_async_write+get_batch_transfer_status (<=1024/batch)": _raw_batch_async,
    },
}


# ----------------------------------------------------------------------------------------------------
# python -m benchmarks full: drivers per engine (Mooncake, NIXL)
# ----------------------------------------------------------------------------------------------------
class RawEngine:
    """The native engine driven directly, as an expert would hand-code it."""

    single_styles: tuple[str, ...] = ()
    same_call: str = ""
    batch_style: str = ""
    drain_style: str = ""

    def single(self, style: str, src: int, dst: int, n: int) -> float:
        raise NotImplementedError

    def latency(self, src: int, dst: int, n: int) -> float:
        raise NotImplementedError

    def batches(self, src: U64, dst: U64, length: U64) -> float:
        raise NotImplementedError

    def inflight(self, src: U64, dst: U64, length: U64, depth: int) -> tuple[float, list[float]]:
        raise NotImplementedError

    def drain(self, src: U64, dst: U64, length: U64, window: int, pause: float) -> tuple[float, float]:
        """Every entry posted, at most ``window`` in flight, and polled to completion, sleeping ``pause``
        seconds after a poll that completed nothing (no spinning): ``(wall seconds, CPU seconds of this
        thread)``, both from the arrays given to the end of the last entry."""
        raise NotImplementedError


class RawMooncake(RawEngine):
    single_styles = ("transfer_submit_write+check_status every 0.5 ms", "batch_transfer_sync_write")
    same_call = "transfer_submit_write+check_status every 0.5 ms"
    batch_style = "batch_transfer_async_write+get_batch_transfer_status, <=1024 entries per batch"
    drain_style = "transfer_submit_write per entry, transfer_check_status oldest first"

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
        for i in range(0, len(s), MAX_BATCH):
            bid = e.batch_transfer_async_write(t, s[i : i + MAX_BATCH], d[i : i + MAX_BATCH], n[i : i + MAX_BATCH])
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

    def drain(self, src: U64, dst: U64, length: U64, window: int, pause: float) -> tuple[float, float]:
        """Entry by entry (``transfer_submit_write``, the adapter's call; the binding's batch status spins),
        each polled with ``transfer_check_status`` oldest first, a poll stopping at the first still running."""
        e, t = self.e, self.target
        submit, status = e.transfer_submit_write, e.transfer_check_status
        c0, w0 = time.thread_time(), time.perf_counter()
        s, d, n = src.tolist(), dst.tolist(), length.tolist()
        pending: deque[int] = deque()
        nxt, total = 0, len(s)
        while nxt < total or pending:
            while nxt < total and len(pending) < window:
                bid = submit(t, s[nxt], d[nxt], n[nxt])
                if not bid:
                    raise RuntimeError("transfer_submit_write refused")
                pending.append(bid)
                nxt += 1
            progressed = False
            while pending:
                rc = status(pending[0])
                if rc == 0:
                    break
                pending.popleft()  # 1 and -1 free the id: never asked again
                if rc != 1:
                    raise RuntimeError(f"transfer_check_status -> {rc}")
                progressed = True
            if pending and not progressed:
                time.sleep(pause)
        return time.perf_counter() - w0, time.thread_time() - c0


class RawNixl(RawEngine):
    single_styles = ("initialize_xfer+transfer+check_xfer_state spin",
                     "initialize_xfer+transfer+check_xfer_state every 0.5 ms")
    same_call = "initialize_xfer+transfer+check_xfer_state spin"
    batch_style = "one xfer per batch of <=1024 descriptors"
    drain_style = "one xfer per window of entries (get_xfer_descs, initialize_xfer, transfer), check_xfer_state"

    def __init__(self, agent: Any, remote: str, device_id: int | None = None) -> None:
        self.a = agent
        self.remote = remote
        self.mem = "DRAM" if device_id is None else "VRAM"  # both sides' memory (the suites use one kind)
        self.dev = device_id or 0

    def _post(self, src: U64, dst: U64, length: U64) -> tuple[Any, str]:
        a = self.a
        devs = np.full_like(src, self.dev)
        lx = a.get_xfer_descs(np.ascontiguousarray(np.stack([src, length, devs], axis=1), dtype=np.uint64), self.mem)
        rx = a.get_xfer_descs(np.ascontiguousarray(np.stack([dst, length, devs], axis=1), dtype=np.uint64), self.mem)
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
        for i in range(0, src.size, MAX_BATCH):
            sl = slice(i, i + MAX_BATCH)
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

    def drain(self, src: U64, dst: U64, length: U64, window: int, pause: float) -> tuple[float, float]:
        """One xfer per ``window`` entries (descriptors, ``initialize_xfer``, ``transfer``), one after the
        other, each polled with ``check_xfer_state`` and released."""
        c0, w0 = time.thread_time(), time.perf_counter()
        for i in range(0, src.size, window):
            sl = slice(i, i + window)
            self._finish(*self._post(src[sl], dst[sl], length[sl]), pause)
        return time.perf_counter() - w0, time.thread_time() - c0


def raw_engine(mgr: Any, target: str, device_id: int | None = None) -> RawEngine:
    """The driver for ``mgr``'s own native engine, writing to the peer ``target`` (its session id);
    ``device_id``: both sides' memory is on that device (NIXL names it in its descriptors)."""
    native = mgr.engine.raw()
    if mgr.engine.name == "mooncake":
        return RawMooncake(native, target)
    if mgr.engine.name == "nixl":
        return RawNixl(native, target, device_id)
    raise RuntimeError(f"no raw driver for engine {mgr.engine.name!r}")
