"""Peer events: a scheduler learns which peer died or restarted, and which of its rooms that failed.

Subscribe with :meth:`aiotransfer.KVManager.add_peer_listener` (a callback, for synchronous schedulers)
or iterate :meth:`aiotransfer.KVManager.peer_events` (an async iterator)::

    async for event in mgr.peer_events():
        print(event.kind, event.peer, event.rooms, event.reason)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

__all__ = ["PeerEvent", "PeerEvents"]

log = logging.getLogger("aiotransfer.manager")


@dataclass(frozen=True)
class PeerEvent:
    """Something happened to a peer, and to the rooms this manager had with it."""

    kind: str
    """``dead`` (silent for ``peer_timeout``: killed, hung or cut off), ``restarted`` (a new incarnation
    answered on its endpoint) or ``gone`` (proven gone: its control port refuses connections)."""
    peer: str
    """The peer's control endpoint."""
    rooms: tuple[int, ...]
    """The rooms this event failed on this manager (empty for ``gone``, whose rooms had failed already)."""
    reason: str
    """The failure reason those rooms carry."""
    at: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when it was noticed."""


class PeerEvents:
    """Fan-out of peer events to callbacks and bounded async iterators."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[PeerEvent], None]] = []
        self._queues: set[asyncio.Queue[PeerEvent]] = set()
        self.dropped = 0
        """Events an async iterator missed because it fell ``maxsize`` events behind."""

    def publish(self, event: PeerEvent) -> None:
        for listener in list(self._listeners):
            _notify(listener, event)
        for q in self._queues:
            if q.full():
                q.get_nowait()
                self.dropped += 1
            q.put_nowait(event)

    def add_listener(self, callback: Callable[[PeerEvent], None]) -> Callable[[], None]:
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    async def stream(self, maxsize: int) -> AsyncIterator[PeerEvent]:
        q: asyncio.Queue[PeerEvent] = asyncio.Queue(maxsize)
        self._queues.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._queues.discard(q)


def _notify(listener: Callable[[PeerEvent], None], event: PeerEvent) -> None:
    try:
        listener(event)
    except Exception:
        log.exception("peer event listener failed")
