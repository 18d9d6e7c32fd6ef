"""One deadline budget per public call, passed down to every step it takes (as asyncpg does).

A public coroutine turns its ``timeout`` into a :class:`Deadline` once; each step it awaits (a write, a
control message, a wait for another chunk) asks the deadline how much time is left, so the call as a
whole never outlives its timeout, however many steps it takes.
"""

from __future__ import annotations

import asyncio

__all__ = ["Deadline"]

_FLOOR = 0.001
"""The least time a step is given, so that a step whose result is already there can still be collected."""


class Deadline:
    """A point on the event loop's clock."""

    __slots__ = ("_loop", "at", "budget")

    def __init__(self, timeout: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self.budget = timeout
        """The whole budget, in seconds (for messages)."""
        self.at = self._loop.time() + timeout

    def remaining(self, floor: float = _FLOOR) -> float:
        """Seconds left, at least ``floor``."""
        return max(self.at - self._loop.time(), floor)

    @property
    def expired(self) -> bool:
        return self._loop.time() >= self.at

    def __repr__(self) -> str:
        return f"<Deadline {self.at - self._loop.time():.3g}s left of {self.budget:.3g}s>"
