"""Peer liveness: heartbeats, dead-peer detection, blacklisting with probes, restart detection.

Every manager pings each peer it has an open room with, every ``heartbeat_interval``; any message from a
peer counts as a sign of life. A peer silent for ``peer_timeout`` is declared dead (killed, hung or cut
off: all look the same from here), and ``on_dead`` fails its rooms on this side; the other side detects
the same silence on its own, so both sides conclude within the bound. Dead peers stay blacklisted and
are probed at a slower pace until they answer. A ``Pong`` carrying a new incarnation id means the peer
restarted: ``on_restart`` fails the rooms of the old incarnation.

Only peers this manager depends on are tracked: those a room activated (:meth:`Liveness.activate`) or that
``active_peers`` names. A message naming any other endpoint changes nothing here, whoever sent it. At most
``max_peers`` are kept; a peer no room has depended on for ``forget_after`` seconds is forgotten (its
blacklisting and incarnation with it), the least recently needed first when the table is full.

A pass checks every peer's silence at its start, then spreads its pings over the interval: the peers are
pinged in slices of at most :data:`SLICE`, each slice at its own share of the interval, so that the loop is never held for more than one slice's pings however many peers
there are (every send queues without suspending: a pass of a thousand pings in one go held the loop for
tens of milliseconds once a second).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

from ._deadline import reap

__all__ = ["Liveness"]

log = logging.getLogger("aiotransfer.liveness")

_PROBE_EVERY = 5
"""Dead peers are probed every this many heartbeats."""
SLICE = 16
"""Peers pinged (or found silent) in one go before the pass lets the loop run other work."""
FORGET_AFTER = 600.0
"""Seconds after which a peer no room depends on any more is forgotten."""


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
        max_peers: int = 4096,
        forget_after: float = FORGET_AFTER,
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
        self.max_peers = max_peers
        self.forget_after = forget_after
        self._known: OrderedDict[str, float] = OrderedDict()
        """Tracked peers -> when a room last depended on them (monotonic), least recent first."""
        self.ignored = 0
        """Signs of life and incarnations reported for endpoints that are not tracked (ignored)."""
        self.forgotten = 0
        self._task: asyncio.Task[None] | None = None
        self.detections: list[float] = []
        """Seconds between a dead peer's last sign of life and its detection (for reports)."""

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aiotransfer-heartbeat")

    async def aclose(self) -> None:
        if self._task is not None:
            await reap(self._task, 1.0)

    def __len__(self) -> int:
        """Peers tracked now."""
        return len(self._known)

    def seen(self, endpoint: str) -> bool:
        """A message arrived from ``endpoint``; False (and nothing recorded) unless a room depends on it."""
        if endpoint not in self._known:
            self.ignored += 1
            return False
        self.last_seen[endpoint] = time.monotonic()
        if self.dead.pop(endpoint, None) is not None:
            log.info("peer %s is answering again; removed from the blacklist", endpoint)
        return True

    def activate(self, endpoint: str) -> None:
        """A room starts depending on ``endpoint``: its silence clock starts now at the latest."""
        now = time.monotonic()
        self._track(endpoint, now)
        if self.last_seen.get(endpoint, 0.0) < now:
            self.last_seen[endpoint] = now

    def is_dead(self, endpoint: str) -> bool:
        return endpoint in self.dead

    def incarnation(self, endpoint: str, incarnation: int) -> None:
        """Record the incarnation id a peer reported; a change means it restarted."""
        if endpoint not in self._known:
            self.ignored += 1
            return
        old = self.incarnations.get(endpoint)
        self.incarnations[endpoint] = incarnation
        if old is not None and old != incarnation:
            log.warning("peer %s restarted (incarnation changed)", endpoint)
            self._on_restart(endpoint)

    def _track(self, endpoint: str, now: float) -> None:
        self._known[endpoint] = now
        self._known.move_to_end(endpoint)
        if len(self._known) > self.max_peers:
            active = set(self._active_peers())
            for ep in [ep for ep in self._known if ep not in active][: len(self._known) - self.max_peers]:
                self._forget(ep)

    def _forget(self, endpoint: str) -> None:
        self._known.pop(endpoint, None)
        self.last_seen.pop(endpoint, None)
        self.dead.pop(endpoint, None)
        self.incarnations.pop(endpoint, None)
        self.forgotten += 1

    def _forget_idle(self, now: float, active: set[str]) -> None:
        for ep, since in list(self._known.items()):
            if now - since <= self.forget_after:
                break
            if ep not in active:
                self._forget(ep)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        tick = 0
        start = loop.time()
        while True:
            start += self.interval
            await asyncio.sleep(max(start - loop.time(), 0.0))
            if loop.time() - start > self.interval:  # the loop was held past a whole pass: do not catch up
                start = loop.time()
            tick += 1
            now = time.monotonic()
            active = set(self._active_peers())
            for ep in active:
                self._track(ep, now)
            self._forget_idle(now, active)
            todo = [ep for ep in active if ep not in self.dead and not self._silent(ep, now)]
            if tick % _PROBE_EVERY == 0:
                todo += list(self.dead)  # probes
            await self._ping_spread(todo, start)

    def _silent(self, ep: str, now: float) -> bool:
        """Declare ``ep`` dead (and fail its rooms) if it has been silent for ``timeout``."""
        last = self.last_seen.setdefault(ep, now)
        if now - last <= self.timeout:
            return False
        self.dead[ep] = now
        self.detections.append(now - last)
        reason = f"peer {ep} silent for {now - last:.1f}s (dead, hung or cut off)"
        log.warning("%s; failing its rooms", reason)
        self._on_dead(ep, reason)
        return True

    async def _ping_spread(self, peers: list[str], start: float) -> None:
        """Ping ``peers`` in slices spread over the interval that began at ``start`` (loop time)."""
        loop = asyncio.get_running_loop()
        slices = -(-len(peers) // SLICE)
        for i in range(slices):
            if i:  # the slice's share of the interval; always a real yield, even when the pass runs late
                await asyncio.sleep(max(start + i * self.interval / slices - loop.time(), 0.0))
            for ep in peers[i * SLICE:(i + 1) * SLICE]:
                if ep in self._known:  # not forgotten meanwhile
                    await self._ping(ep)
