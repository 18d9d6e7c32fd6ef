"""Event-loop lag probe: how late does ``await asyncio.sleep(interval)`` wake up?

A task sleeps ``interval`` seconds in a loop and records the overshoot of each wake-up (ms). While the
loop is healthy the overshoot is ~0.1 ms; anything blocking the loop (a native call run inline, a long
NumPy operation, GIL contention) shows up directly as lag::

    async with LoopLagMonitor() as lag:
        await do_transfers()
    print(lag.summary())          # {'p50_ms': 0.11, 'p99_ms': 0.4, 'max_ms': 2.3, 'samples': 2817}

No dependency beyond NumPy (already a core dependency).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["LoopLagMonitor"]


class LoopLagMonitor:
    """Measures event-loop wake-up lag while running (``start``/``stop`` or ``async with``)."""

    def __init__(self, interval: float = 0.001) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self.interval = interval
        self._lags: list[float] = []
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
        """Stop sampling; the samples collected so far are kept (idempotent)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(task, timeout)
        if self._started_at is not None:
            self._elapsed += time.perf_counter() - self._started_at
            self._started_at = None

    def reset(self) -> None:
        """Forget the samples collected so far."""
        self._lags.clear()
        self._elapsed = 0.0

    async def __aenter__(self) -> LoopLagMonitor:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        interval = self.interval
        append = self._lags.append
        clock = time.perf_counter
        while True:
            t0 = clock()
            await asyncio.sleep(interval)
            append(max(clock() - t0 - interval, 0.0) * 1e3)

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
        return {
            "p50_ms": round(float(p50), 4),
            "p99_ms": round(float(p99), 4),
            "max_ms": round(float(s.max()), 4),
            "mean_ms": round(float(s.mean()), 4),
            "samples": int(s.size),
            "seconds": round(elapsed, 3),
        }
