"""What a sender and a receiver share: one room's status as seen from one side."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .status import KVPoll, PollLatch

__all__ = ["RoomSide"]


class RoomSide:
    """Status, latch, failure reason and change notification of one room on one side."""

    def __init__(self, room: int) -> None:
        self.room = room
        self._latch = PollLatch()
        self._status = KVPoll.Bootstrapping
        self._reason: str | None = None
        self._created = time.monotonic()
        self._waiters: set[asyncio.Future[None]] = set()

    def poll(self) -> KVPoll:
        """Current status; the first terminal status is latched and returned forever after."""
        return self._latch.observe(self._status)

    @property
    def failure_reason(self) -> str | None:
        """Why the room failed (the same reason the other side receives), or None."""
        return self._reason

    def _set_status(self, status: KVPoll, reason: str | None = None) -> None:
        """Called by the manager's status table whenever this room's status changes."""
        self._status = status
        if status is KVPoll.Failed and self._reason is None:
            self._reason = reason or "failed"
        for fut in self._waiters:
            _wake(fut)

    async def _wait_until(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Wait (without creating tasks) until ``predicate()`` holds or the loop time reaches ``deadline``.

        Each wait awaits a future of its own, resolved directly by the status change or by one timer: the
        waiting task resumes in the loop iteration right after the change, and cancelling it touches no other
        waiter (``asyncio.wait`` / ``wait_for`` would add a callback round through a helper future)."""
        loop = asyncio.get_running_loop()
        while not predicate():
            if loop.time() >= deadline:
                return False
            fut = loop.create_future()
            timer = loop.call_at(deadline, _wake, fut)
            self._waiters.add(fut)
            try:
                await fut
            finally:
                self._waiters.discard(fut)
                timer.cancel()
        return True


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
