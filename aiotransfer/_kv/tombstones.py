"""``Tombstones``: rooms a prefill rank saw end in failure, remembered for a while with their reason.

A transfer request can reach a prefill after the room failed there or was aborted by its decode (it was
on its way, or its decode was still routing). Without a record the prefill would stash the late request
and serve it when a sender for the room opens, writing into pages the decode has already handed back. A
tombstone makes the prefill refuse the late request, and fail a sender opened for the room, with the
reason the room failed. Bounded in count and in time: the oldest go first.
"""

from __future__ import annotations

import time
from collections import OrderedDict

__all__ = ["Tombstones"]


class Tombstones:
    def __init__(self, ttl: float, cap: int) -> None:
        self.ttl = ttl
        self.cap = cap
        self._rooms: OrderedDict[int, tuple[float, str]] = OrderedDict()
        self.buried = 0
        """Tombstones ever laid (for stats)."""

    def bury(self, room: int, reason: str) -> None:
        """Remember that ``room`` failed here, and why (the first reason stays)."""
        if room in self._rooms:
            return
        self._expire()
        while len(self._rooms) >= self.cap:
            self._rooms.popitem(last=False)
        self._rooms[room] = (time.monotonic(), reason)
        self.buried += 1

    def reason(self, room: int) -> str | None:
        """Why ``room`` failed here, while its tombstone lasts; None otherwise."""
        entry = self._rooms.get(room)
        if entry is None:
            return None
        if time.monotonic() - entry[0] > self.ttl:
            self._expire()
            return None
        return entry[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._rooms:
            since, _ = next(iter(self._rooms.values()))
            if now - since <= self.ttl:
                break
            self._rooms.popitem(last=False)

    def __len__(self) -> int:
        self._expire()
        return len(self._rooms)
