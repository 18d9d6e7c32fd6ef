"""Peer liveness: heartbeats, dead-peer detection, blacklisting with probes, restart detection.

Every manager pings each peer it has an open room with, every ``heartbeat_interval``; any message from a
peer counts as a sign of life. A peer silent for ``peer_timeout`` is declared dead (killed, hung or cut
off: all look the same from here), and ``on_dead`` fails its rooms on this side; the other side detects
the same silence on its own, so both sides conclude within the bound. Dead peers stay blacklisted and
are probed at a slower pace until they answer. A ``Pong`` carrying a new incarnation id means the peer
restarted: ``on_restart`` fails the rooms of the old incarnation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from ._deadline import reap

__all__ = ["Liveness"]

log = logging.getLogger("aiotransfer.liveness")

_PROBE_EVERY = 5
"""Dead peers are probed every this many heartbeats."""


class Liveness:
    def __init__(
        self,
        *,
        interval: float,
        timeout: float,
        active_peers: Callable[[], Iterable[str]],
        ping: Callable[[str], Awaitable[None]],
        on_dead: Callable[[str, str], None],
        on_restart: Callable[[str], None],
    ) -> None:
        self.interval = interval
        self.timeout = timeout
        self._active_peers = active_peers
        self._ping = ping
        self._on_dead = on_dead
        self._on_restart = on_restart
        self.last_seen: dict[str, float] = {}
        self.dead: dict[str, float] = {}
        self.incarnations: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self.detections: list[float] = []
        """Seconds between a dead peer's last sign of life and its detection (for reports)."""

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aiotransfer-heartbeat")

    async def aclose(self) -> None:
        if self._task is not None:
            await reap(self._task, 1.0)

    def seen(self, endpoint: str) -> None:
        """A message arrived from ``endpoint``."""
        self.last_seen[endpoint] = time.monotonic()
        if self.dead.pop(endpoint, None) is not None:
            log.info("peer %s is answering again; removed from the blacklist", endpoint)

    def activate(self, endpoint: str) -> None:
        """A room starts depending on ``endpoint``: its silence clock starts now at the latest."""
        now = time.monotonic()
        if self.last_seen.get(endpoint, 0.0) < now:
            self.last_seen[endpoint] = now

    def is_dead(self, endpoint: str) -> bool:
        return endpoint in self.dead

    def incarnation(self, endpoint: str, incarnation: int) -> None:
        """Record the incarnation id a peer reported; a change means it restarted."""
        old = self.incarnations.get(endpoint)
        self.incarnations[endpoint] = incarnation
        if old is not None and old != incarnation:
            log.warning("peer %s restarted (incarnation changed)", endpoint)
            self._on_restart(endpoint)

    async def _run(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self.interval)
            tick += 1
            now = time.monotonic()
            for ep in set(self._active_peers()):
                if ep in self.dead:
                    continue
                last = self.last_seen.setdefault(ep, now)
                if now - last > self.timeout:
                    self.dead[ep] = now
                    self.detections.append(now - last)
                    reason = f"peer {ep} silent for {now - last:.1f}s (dead, hung or cut off)"
                    log.warning("%s; failing its rooms", reason)
                    self._on_dead(ep, reason)
                else:
                    await self._ping(ep)
            if tick % _PROBE_EVERY == 0:
                for ep in list(self.dead):
                    await self._ping(ep)
