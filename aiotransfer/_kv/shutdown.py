"""How a rank closes once its rooms failed and its tasks ended: drain the engine's writes, then deregister
memory, close the control port and the engine, in that order.

Engine writes still in flight after the caller's ``timeout`` are waited for in the background, at most the
release quarantine, before the rest: until they are over, the engine stays open with our memory registered,
and the control port stays bound, answering nothing. A decode takes a port that refuses connections for
proof that nothing of ours can land in its pages any more; it must not while our engine may.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from ..engines._base import MemoryRegion
from ..errors import AiotransferError
from .context import RankContext

__all__ = ["close_down"]

log = logging.getLogger("aiotransfer.manager")


async def close_down(ctx: RankContext, regions: Sequence[MemoryRegion], *, registered: bool, own_engine: bool,
                     timeout: float) -> None:
    """Drain, deregister ``regions`` (when ``registered``), close the control port, and close the engine
    (when ``own_engine``); returns after ``timeout`` at most, leaving the rest to a background task when
    engine writes are still in flight."""

    async def finish(draining: asyncio.Task[int] | None) -> None:
        try:
            remaining = await draining if draining is not None else 0  # bounded by the drain's own bound
        except asyncio.CancelledError:
            # the event loop is going away with writes still in the engine: its process normally goes with it
            if ctx.control_or_none is not None and ctx.poller_or_none is not None:
                log.warning("event loop closing with %d engine writes in flight: control port %s closed before "
                            "they are over", ctx.poller_or_none.in_flight, ctx.endpoint)
                await ctx.control_or_none.aclose(linger=0)
            raise
        engine = ctx.engine_or_none
        if engine is not None and registered and remaining == 0:
            with contextlib.suppress(AiotransferError):
                await ctx.driver.run(engine.deregister, regions, timeout=timeout, what="memory deregistration")
        if ctx.control_or_none is not None and remaining == 0:  # else bound until the process exits
            await ctx.control_or_none.aclose()
        if engine is not None and own_engine and remaining == 0:
            with contextlib.suppress(AiotransferError):
                await ctx.driver.run(engine.close, timeout=timeout, what="engine close")
        ctx.offload.shutdown(wait=False)
        ctx.driver.close()

    poller = ctx.poller_or_none
    if poller is None:
        await finish(None)
        return
    # the poll loop keeps running while it waits: the engine reports the writes over as they end
    bound = max(timeout, ctx.config.quarantine_s)
    draining = ctx.spawn(poller.aclose(bound), "close-drain")
    try:
        await asyncio.wait({draining}, timeout=timeout)
    except asyncio.CancelledError:
        ctx.spawn(finish(draining), "close")
        raise
    if not draining.done():
        log.warning("%d engine transfers still in flight after %.3gs: the engine, our registered memory and "
                    "control port %s stay open until they are over (at most %.3gs)", poller.in_flight, timeout,
                    ctx.endpoint, bound)
        ctx.spawn(finish(draining), "close")
        return
    await finish(draining)
