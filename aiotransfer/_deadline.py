"""One deadline budget per public call, passed down to every step it takes (as asyncpg does).

A public coroutine turns its ``timeout`` into a :class:`Deadline` once; each step it awaits (a write, a
control message, a wait for another chunk) asks the deadline how much time is left, so the call as a
whole never outlives its timeout, however many steps it takes.

A ``timeout`` argument is seconds, :data:`DEFAULT` (the configuration's bound for that call) or, where a call
allows it, ``None`` (no bound of the call's own): :func:`seconds` tells them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
from collections.abc import Awaitable
from typing import Any, Final, TypeVar

from .errors import InvalidArgument

__all__ = ["DEFAULT", "Deadline", "Default", "reap", "seconds", "within"]

T = TypeVar("T")

_FLOOR = 0.001
"""The least time a step is given, so that a step whose result is already there can still be collected."""


class Default(enum.Enum):
    """The type of :data:`DEFAULT` (one value), for annotations: ``timeout: float | Default | None``."""

    DEFAULT = "DEFAULT"

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Final = Default.DEFAULT
"""``timeout=DEFAULT`` (every call's default): the matching bound of the manager's
:class:`~aiotransfer.TransferConfig`. ``timeout=None`` is no bound of the call's own, where the call takes it."""


def seconds(timeout: float | Default | None, default: float, *, what: str = "") -> float:
    """The budget of a call, in seconds: ``default`` for :data:`DEFAULT`, infinity for ``None``.

    ``what`` names a call that moves data and must stay bounded: ``None`` is then refused
    (:class:`~aiotransfer.InvalidArgument`, saying what to pass instead)."""
    if timeout is DEFAULT:
        return default
    if timeout is None:
        if what:
            raise InvalidArgument(
                f"{what} moves data and needs a bound: pass timeout=<seconds>, or leave it out for the "
                "configured default; timeout=None (no bound) is for the waits (wait_ready, done, released) only"
            )
        return math.inf
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout):
        raise InvalidArgument(f"timeout must be seconds, None or DEFAULT, got {timeout!r}")
    return float(timeout)


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


async def within(aw: Awaitable[T], timeout: float) -> T:
    """``await aw`` for at most ``timeout`` seconds, then raise :class:`asyncio.TimeoutError` (``aw`` is
    cancelled, as it is when the caller is).

    Unlike ``asyncio.wait_for`` before Python 3.12, a cancellation of the caller is never swallowed: when it
    comes in the same loop iteration as ``aw``'s result, ``wait_for`` returns the result and the caller goes
    on as if never cancelled (an interrupted send would wait out its whole deadline). Here the caller is
    cancelled and the result is dropped, so ``aw`` must be something whose result may be lost: an event, a
    shielded future whose owner adopts it, a wait that takes nothing."""
    loop = asyncio.get_running_loop()
    inner = asyncio.ensure_future(aw)
    if not inner.done():
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        timer = loop.call_later(max(timeout, 0.0), wake)
        inner.add_done_callback(wake)
        try:
            await waiter
        except asyncio.CancelledError:
            _drop(inner)
            raise
        finally:
            timer.cancel()
            inner.remove_done_callback(wake)
        if not inner.done():
            _drop(inner)
            raise asyncio.TimeoutError
    return inner.result()


def _drop(fut: asyncio.Future[Any]) -> None:
    """Cancel what nobody waits for any more; its outcome, whatever it is, is collected, never reported."""
    fut.cancel()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())


async def reap(task: asyncio.Task[Any], timeout: float) -> bool:
    """Cancel a background task and wait at most ``timeout`` seconds for it to end; True when it did.

    A cancellation of the caller is not swallowed (``suppress(CancelledError): await task`` would swallow
    it), and the task's own outcome is collected, never reported as unretrieved, nor kept."""
    task.cancel()
    await asyncio.wait({task}, timeout=max(timeout, 0.0))
    if not task.done():
        return False
    # Collected, and not kept: a cancelled task stores its CancelledError until it is read, and that error's
    # traceback holds the task's last frames and all they referenced (an engine handle there kept a closed
    # NIXL agent, and its progress thread, alive).
    with contextlib.suppress(Exception, asyncio.CancelledError):
        task.result()
    return True
