"""Event-loop lag probe: how late does ``await asyncio.sleep(interval)`` wake up?

A task sleeps ``interval`` seconds in a loop and records the overshoot of each wake-up (ms). While the
loop is healthy the overshoot is ~0.1 ms; anything blocking the loop (a native call run inline, a long
NumPy operation, GIL contention) shows up directly as lag::

    async with LoopLagMonitor() as lag:
        await do_transfers()
    print(lag.summary())          # {'p50_ms': 0.11, 'p99_ms': 0.4, 'max_ms': 2.3, 'samples': 2817}

On Linux the summary also says where the time went, from the loop thread's scheduler statistics
(``/proc/thread-self/schedstat``): ``loop_cpu_share`` (CPU the loop thread used, per second of wall time)
and ``runqueue_ms_per_s`` (time it was runnable but waited for a CPU, per second). With
``attribute=True`` each late wake-up is split too: ``late_runqueue_share`` is the part of the overshoot of
wake-ups later than ``late_ms`` that the loop thread spent waiting for a CPU. Near 1, the loop was starved
by other threads on its cores (the remedy is fewer or lower-priority busy threads); near 0, something ran
on the loop, or it waited for a lock or the GIL, or the whole machine stopped: on a virtual machine the
hypervisor may take the CPUs away (``steal`` in ``/proc/stat``). ``steal_ms_per_s`` is that stolen time per
second and CPU over the sampling, and ``late_steal_share`` the part of the late overshoot in wake-ups during
which steal time grew (the counter ticks in 10 ms steps: short thefts go unseen). ``worst`` breaks down the
wake-up that came latest the same way.

No dependency beyond NumPy (already a core dependency).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from ._deadline import reap

__all__ = ["LoopLagMonitor"]


class LoopLagMonitor:
    """Measures event-loop wake-up lag while running (``start``/``stop`` or ``async with``).

    Args:
        interval: Seconds between wake-ups asked for; the lag is how late each one comes.
        attribute: Split each late wake-up into run-queue wait and the rest (two small reads per sample).
        late_ms: With ``attribute``, a wake-up this late (milliseconds) counts as late.

    Raises:
        ValueError: ``interval`` not positive, or ``late_ms`` negative.
    """

    def __init__(self, interval: float = 0.001, *, attribute: bool = False, late_ms: float = 1.0) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        if not late_ms >= 0:
            raise ValueError(f"late_ms must be >= 0, got {late_ms!r}")
        self.interval = interval
        self.attribute = attribute
        """Split each late wake-up into run-queue wait and the rest (two small reads per sample)."""
        self.late_ms = late_ms
        self._lags: list[float] = []
        self._sched = [0, 0]
        """Loop thread's CPU and run-queue wait (ns) summed over the sampling periods."""
        self._late = [0.0, 0.0, 0.0]
        """attribute=True: overshoot of the late wake-ups, the run-queue wait within it, and the overshoot of
        those during which the hypervisor stole CPU time (ms)."""
        self._steal: int | None = None
        """Steal time of all CPUs over the sampling periods (clock ticks); None where it cannot be read."""
        self._worst: tuple[float, float, int] | None = None
        """attribute=True: the latest of the late wake-ups: (overshoot ms, run-queue wait ms, steal ticks)."""
        self._task: asyncio.Task[None] | None = None
        self._started_at: float | None = None
        self._elapsed = 0.0

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<LoopLagMonitor {state} interval={self.interval * 1e3:g}ms samples={len(self._lags)}>"

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> LoopLagMonitor:
        """Start sampling on the running loop (idempotent)."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="aiotransfer-loop-lag")
            self._started_at = time.perf_counter()
        return self

    async def stop(self, timeout: float = 1.0) -> None:
        """Stop sampling; the samples collected so far are kept (idempotent).

        Args:
            timeout: Seconds to wait for the sampling task to end.
        """
        task, self._task = self._task, None
        if task is None:
            return
        await reap(task, timeout)
        if self._started_at is not None:
            self._elapsed += time.perf_counter() - self._started_at
            self._started_at = None

    def reset(self) -> None:
        """Forget the samples collected so far."""
        self._lags.clear()
        self._elapsed = 0.0
        self._sched = [0, 0]
        self._late = [0.0, 0.0, 0.0]
        self._steal = None
        self._worst = None

    async def __aenter__(self) -> LoopLagMonitor:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        fd = _open_schedstat()  # opened on the loop thread: thread-self is the loop thread
        stat = _open_stat()
        start, steal0 = _schedstat(fd), _steal(stat)
        try:
            if self.attribute and fd is not None:
                await self._sample_attributed(fd, stat)
            else:
                await self._sample()
        finally:
            end, steal1 = _schedstat(fd), _steal(stat)
            if start is not None and end is not None:
                self._sched[0] += end[0] - start[0]
                self._sched[1] += end[1] - start[1]
            if steal0 is not None and steal1 is not None:
                self._steal = (self._steal or 0) + steal1 - steal0
            for f in (fd, stat):
                if f is not None:
                    os.close(f)

    async def _sample(self) -> None:
        interval = self.interval
        append = self._lags.append
        clock = time.perf_counter
        while True:
            t0 = clock()
            await asyncio.sleep(interval)
            append(max(clock() - t0 - interval, 0.0) * 1e3)

    async def _sample_attributed(self, fd: int, stat: int | None) -> None:
        interval, late_ms, late = self.interval, self.late_ms, self._late
        append = self._lags.append
        clock = time.perf_counter
        while True:
            before, steal0 = _schedstat(fd), _steal(stat)
            t0 = clock()
            await asyncio.sleep(interval)
            lag = max(clock() - t0 - interval, 0.0) * 1e3
            append(lag)
            if lag > late_ms:
                after, steal1 = _schedstat(fd), _steal(stat)
                if before is not None and after is not None:
                    queued = min((after[1] - before[1]) / 1e6, lag)
                    stolen = steal1 - steal0 if steal0 is not None and steal1 is not None else 0
                    late[0] += lag
                    late[1] += queued
                    if stolen > 0:
                        late[2] += lag
                    if self._worst is None or lag > self._worst[0]:
                        self._worst = (lag, queued, stolen)

    @property
    def samples(self) -> npt.NDArray[np.float64]:
        """Overshoot of each wake-up in milliseconds, in order (a copy; e.g. for a CDF plot)."""
        return np.asarray(self._lags, dtype=np.float64)

    def summary(self) -> dict[str, Any]:
        """``p50_ms``, ``p99_ms``, ``max_ms`` (None without samples), ``mean_ms``, ``samples``, ``seconds``."""
        s = self.samples
        elapsed = self._elapsed + (time.perf_counter() - self._started_at if self._started_at else 0.0)
        if s.size == 0:
            return {"p50_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None,
                    "samples": 0, "seconds": round(elapsed, 3)}
        p50, p99 = np.percentile(s, [50, 99])
        out: dict[str, Any] = {
            "p50_ms": round(float(p50), 4),
            "p99_ms": round(float(p99), 4),
            "max_ms": round(float(s.max()), 4),
            "mean_ms": round(float(s.mean()), 4),
            "samples": int(s.size),
            "seconds": round(elapsed, 3),
        }
        if elapsed > 0 and any(self._sched):
            out["loop_cpu_share"] = round(self._sched[0] / 1e9 / elapsed, 4)
            out["runqueue_ms_per_s"] = round(self._sched[1] / 1e6 / elapsed, 3)
        if elapsed > 0 and self._steal is not None:
            out["steal_ms_per_s"] = round(self._steal * 1e3 / _CLK_TCK / (os.cpu_count() or 1) / elapsed, 3)
        if self.attribute:
            late = self._late
            out["late_ms"] = self.late_ms
            out["late_overshoot_ms"] = round(late[0], 3)
            out["late_runqueue_share"] = round(late[1] / late[0], 4) if late[0] else None
            out["late_steal_share"] = round(late[2] / late[0], 4) if late[0] else None
            w = self._worst
            out["worst"] = None if w is None else {
                "overshoot_ms": round(w[0], 4), "runqueue_ms": round(w[1], 4),
                "steal_ms": round(w[2] * 1e3 / _CLK_TCK, 1),
            }
        return out


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _open_stat() -> int | None:
    """A descriptor on the kernel's CPU accounting (Linux ``/proc/stat``), or None."""
    try:
        return os.open("/proc/stat", os.O_RDONLY)
    except OSError:
        return None


def _steal(fd: int | None) -> int | None:
    """Steal time of all CPUs so far (clock ticks): time the hypervisor ran something else."""
    if fd is None:
        return None
    try:
        fields = os.pread(fd, 256, 0).split(b"\n", 1)[0].split()
        return int(fields[8]) if fields[0] == b"cpu" and len(fields) > 8 else None
    except (OSError, ValueError):
        return None


def _open_schedstat() -> int | None:
    """A descriptor on the calling thread's scheduler statistics (Linux), or None where there are none."""
    try:
        return os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return None


def _schedstat(fd: int | None) -> tuple[int, int] | None:
    """(CPU time, run-queue wait) of the thread ``fd`` was opened on, in ns."""
    if fd is None:
        return None
    try:
        fields = os.pread(fd, 128, 0).split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
