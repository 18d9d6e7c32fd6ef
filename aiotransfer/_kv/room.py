"""What a sender and a receiver share: one room's status as seen from one side; and what the parts of a
rank (:mod:`aiotransfer._kv`) need of each, as Protocols, so that they never import the public room objects
(``KVSender``, ``KVReceiver``) that are built on top of them."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TypeVar

from .._status import KVPoll, PollLatch, apply_status
from ..errors import InvalidArgument, TransferTimeout

if TYPE_CHECKING:
    import numpy as np

    from .._control.messages import TransferRequest
    from .peers import DecodePeer

__all__ = ["ReceiverRoom", "RoomSide", "SenderRoom", "StagingRoom", "decode_reason", "left_because", "prefill_reason"]

log = logging.getLogger("aiotransfer.manager")

_R = TypeVar("_R", bound="RoomSide")


def decode_reason(reason: str) -> str:
    """A failure that started on the decode, worded the same on both sides."""
    return reason if reason.startswith("aborted by decode") else f"aborted by decode: {reason or 'no reason given'}"


def prefill_reason(reason: str) -> str:
    """A failure that started on the prefill, worded the same on both sides."""
    return reason if reason.startswith("aborted by prefill") else f"aborted by prefill: {reason or 'no reason given'}"


def left_because(exc: BaseException | None, status: KVPoll) -> str:
    """Why a room's ``async with`` block ended before the room concluded: the exception's type and message, a
    cancellation, or a block that simply ended first."""
    if exc is None:
        return f"left unfinished ({status.name})"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Room(Protocol):
    room: int

    @property
    def status(self) -> KVPoll: ...

    @property
    def failure_reason(self) -> str | None: ...

    def update(self, status: KVPoll, reason: str | None = None) -> bool: ...

    def is_released(self) -> bool: ...

    async def abort(self, reason: str = ...) -> None: ...


class SenderRoom(_Room, Protocol):
    """What the prefill side of a rank needs of one of its rooms (a ``KVSender``)."""

    @property
    def decode_endpoints(self) -> list[str]: ...

    @property
    def num_pages(self) -> int | None: ...

    @property
    def engine_holds(self) -> int: ...

    def admit(self, peer: DecodePeer, req: TransferRequest, kv_indices: np.ndarray) -> str | None: ...


class StagingRoom(Protocol):
    """What the staging grantor needs of a decode room: the prefill ranks that send it data, and its pages."""

    @property
    def sources(self) -> Mapping[str, int]: ...

    @property
    def pages(self) -> np.ndarray | None: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def failure_reason(self) -> str | None: ...

    def hold(self) -> Callable[[], None]: ...


class ReceiverRoom(_Room, StagingRoom, Protocol):
    """What the decode side of a rank needs of one of its rooms (a ``KVReceiver``)."""

    aux_index: int | None

    @property
    def awaiting_drain(self) -> list[str]: ...

    def on_drained(self, endpoint: str, cause: str = ..., settle: float = ...) -> bool: ...

    def on_prefill_status(self, endpoint: str, rank: int, status: KVPoll, reason: str, aux_path: str = ...) -> bool: ...

    def ask_again(self, endpoint: str, generation: int, forget: Callable[[str], None]) -> bool: ...


class RoomSide:
    """Status, latch, failure reason, waiters and terminal notification of one room on one side.

    The room owns its status: every change goes through :meth:`update`, which applies
    :func:`~aiotransfer._status.apply_status` (Failed wins and sticks, progress is monotone), wakes the
    waiters, and on the first terminal status calls ``on_terminal(room_side)`` once."""

    def __init__(
        self, room: int, on_terminal: Callable[[RoomSide], None] | None = None,
        on_released: Callable[[RoomSide, str], None] | None = None,
    ) -> None:
        self.room = room
        self._latch = PollLatch()
        self._status = KVPoll.Bootstrapping
        self._reason: str | None = None
        self.created = time.monotonic()
        """``time.monotonic()`` when the room was opened on this side."""
        self._waiters: set[asyncio.Future[None]] = set()
        self._on_terminal = on_terminal
        self._on_released = on_released
        self._released: str | None = None
        self._entered = False

    def poll(self) -> KVPoll:
        """Current status; the first terminal status is latched and returned forever after."""
        return self._latch.observe(self._status)

    @property
    def status(self) -> KVPoll:
        """The room's status right now (unlatched)."""
        return self._status

    @property
    def failure_reason(self) -> str | None:
        """Why the room failed (the same reason the other side receives), or None."""
        return self._reason

    def update(self, status: KVPoll, reason: str | None = None) -> bool:
        """Apply ``status`` (with ``reason`` when it is ``Failed``); True if the status changed."""
        new = apply_status(self._status, status)
        if new is None or new is self._status:
            return False
        self._status = new
        if new is KVPoll.Failed and self._reason is None:
            self._reason = reason or "failed"
        self._changed(new)
        for fut in self._waiters:
            _wake(fut)
        if new.is_terminal and self._on_terminal is not None:
            self._on_terminal(self)
        return True

    def _changed(self, status: KVPoll) -> None:
        """Hook for subclasses: runs on every change, before the waiters wake."""

    # -- a room as a resource -----------------------------------------------------------------------
    async def __aenter__(self: _R) -> _R:
        """Enter the room's block: once per room. A second ``async with`` on the same room (nested, or after
        the first block left) is refused with :class:`~aiotransfer.InvalidArgument`: one block owns the
        room's end, and the first one's exit already aborted or released it."""
        if self._entered:
            raise InvalidArgument(f"room {self.room} is already used in an async with block: a room is entered "
                                  "once (open a new room for a new request)")
        self._entered = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leave the room's block. A room that has not concluded Success is aborted here, on both sides,
        with the cause as its reason (:func:`left_because`); a room that already failed keeps its reason.
        Then, whatever the outcome, wait for the release of its pages, bounded by :meth:`_exit_bound` and
        through cancellations (clean-up is shielded: a cancellation that comes meanwhile is raised once the
        wait is over). The exception that ended the block propagates unchanged; without one, pages not
        released within the bound raise :class:`~aiotransfer.TransferTimeout`. A closed manager's room
        exits at once."""
        if self._status is not KVPoll.Success:
            self._abandon(left_because(exc, self._status))
        bound = self._exit_bound()
        if bound is None:
            return
        deadline = asyncio.get_running_loop().time() + bound
        cancelled = False
        while True:
            try:
                released = await self._wait_released(deadline)
                break
            except asyncio.CancelledError:
                cancelled = True
        if not released:
            if exc is None:
                raise self._unreleased(bound)
            log.warning("%s", self._unreleased(bound), extra={"room": self.room})
        if cancelled and not isinstance(exc, asyncio.CancelledError):
            raise asyncio.CancelledError

    def _abandon(self, reason: str) -> None:
        """Abort without awaiting (hook): the room fails here at once, the other side is told in the
        background; nothing when the room is already terminal."""
        raise NotImplementedError

    def _exit_bound(self) -> float | None:
        """Seconds the exit of the room's block waits for the release (hook); None: no wait (the manager is
        closed: nothing is proven any more, its memory stays registered while the engine holds any of it)."""
        raise NotImplementedError

    def _unreleased(self, budget: float) -> TransferTimeout:
        """The error for pages not released within ``budget`` seconds (hook)."""
        raise NotImplementedError

    # -- page lifecycle ---------------------------------------------------------------------------
    def is_released(self) -> bool:
        """True once this side can prove that no engine operation of this room will touch its pages (KV,
        staging space) again: the pages may go back to the free list. Never before the room is terminal."""
        return self._released is not None

    @property
    def release_cause(self) -> str | None:
        """How the release was proven (``success``, ``drained``, ``peer-gone``, ``quarantine``...), or None."""
        return self._released

    def _release(self, cause: str) -> None:
        if self._released is not None or not self._status.is_terminal:
            return
        self._released = cause
        for fut in self._waiters:
            _wake(fut)
        if self._on_released is not None:
            self._on_released(self, cause)

    async def _wait_released(self, deadline: float) -> bool:
        return await self._wait_until(lambda: self._released is not None, deadline)

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
            timer = loop.call_at(deadline, _wake, fut) if deadline != math.inf else None
            self._waiters.add(fut)
            try:
                await fut
            finally:
                self._waiters.discard(fut)
                if timer is not None:
                    timer.cancel()
        return True


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
