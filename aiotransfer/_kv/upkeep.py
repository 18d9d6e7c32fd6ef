"""Background upkeep of a rank: engine threads kept at idle priority, and the loop-lag probe."""

from __future__ import annotations

import asyncio
import contextlib
import time

from .. import _threads
from ..errors import AiotransferError
from .context import RankContext

__all__ = ["background_engine_threads", "keep_engine_threads_background", "probe_loop_lag"]


async def background_engine_threads(ctx: RankContext) -> None:
    """Move the engine's native threads to ``SCHED_IDLE`` (on the executor: it reads /proc)."""
    moved = await ctx.offload.run(_threads.background_engine_threads, timeout=ctx.config.handshake_timeout,
                                  what="engine thread priority")
    if moved:
        ctx.counters["engine_threads_background"] += moved


async def keep_engine_threads_background(ctx: RankContext) -> None:
    """Move the engine's threads 0.2 s after start (a second look), then catch threads the engine starts
    later (a new peer...) at the second heartbeat that sees them."""
    delay = min(0.2, ctx.config.heartbeat_interval)
    while True:
        await asyncio.sleep(delay)
        delay = ctx.config.heartbeat_interval
        with contextlib.suppress(AiotransferError):
            await background_engine_threads(ctx)


async def probe_loop_lag(ctx: RankContext, interval: float) -> None:
    """How late the event loop wakes a sleeper: the library's own responsiveness, as a histogram."""
    clock = time.perf_counter
    while True:
        t0 = clock()
        await asyncio.sleep(interval)
        ctx.metrics.observe("loop_lag", max(clock() - t0 - interval, 0.0))
