"""``Tombstones``: rooms a prefill rank saw end in failure, remembered for a while with their reason.

A transfer request can reach a prefill after the room failed there or was aborted by its decode (it was
on its way, or its decode was still routing). Without a record the prefill would stash the late request
and serve it when a sender for the room opens, writing into pages the decode has already handed back. A
tombstone makes the prefill refuse the late request with the reason the room failed. A sender opened for
a room its decode aborted before this prefill opened it fails at once with that reason; a sender asked for
a room number that already had a sender here (a retry of the same request) is refused (``opened``).
Bounded in count and in time: the oldest go first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

__all__ = ["Tombstone", "Tombstones"]


class Tombstone(NamedTuple):
    since: float
    """``time.monotonic()`` when it was laid."""
    reason: str
    opened: bool
    """A sender of the room existed here (it failed here), not only a decode's abort or request."""


class Tombstones:
    def __init__(self, ttl: float, cap: int) -> None:
        self.ttl = ttl
        self.cap = cap
        self._rooms: OrderedDict[int, Tombstone] = OrderedDict()
        self.buried = 0
        """Tombstones ever laid (for stats)."""

    def bury(self, room: int, reason: str, *, opened: bool = False) -> None:
        """Remember that ``room`` failed here, and why (the first reason stays); ``opened``: a sender of it
        existed here."""
        old = self._rooms.get(room)
        if old is not None:
            if opened and not old.opened:
                self._rooms[room] = old._replace(opened=True)
            return
        self._expire()
        while len(self._rooms) >= self.cap:
            self._rooms.popitem(last=False)
        self._rooms[room] = Tombstone(time.monotonic(), reason, opened)
        self.buried += 1

    def get(self, room: int) -> Tombstone | None:
        """``room``'s tombstone, while it lasts; None otherwise."""
        entry = self._rooms.get(room)
        if entry is None:
            return None
        if time.monotonic() - entry.since > self.ttl:
            self._expire()
            return None
        return entry

    def reason(self, room: int) -> str | None:
        """Why ``room`` failed here, while its tombstone lasts; None otherwise."""
        entry = self.get(room)
        return entry.reason if entry is not None else None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._rooms:
            first = next(iter(self._rooms.values()))
            if now - first.since <= self.ttl:
                break
            self._rooms.popitem(last=False)

    def __len__(self) -> int:
        self._expire()
        return len(self._rooms)
