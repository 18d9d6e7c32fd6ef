"""Room status values and the pure rules that move a room between them.

Nothing here does I/O: managers feed status updates (local or from the peer)
through :func:`apply_status` / :class:`StatusTable`, and ``poll()`` callers
wrap what they see in a :class:`PollLatch`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeAlias

__all__ = ["KVPoll", "OnStatusChange", "PollLatch", "StatusTable", "apply_status"]


class KVPoll(enum.IntEnum):
    """Status of one room; the numeric order is the order of progress (``Failed`` aside)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_terminal(self) -> bool:
        """True for ``Failed`` and ``Success``: the room will not change any more."""
        return self is KVPoll.Failed or self is KVPoll.Success


_CREATING = frozenset({KVPoll.Bootstrapping, KVPoll.WaitingForInput})


def apply_status(current: KVPoll | None, update: KVPoll) -> KVPoll | None:
    """Return the status a room has after ``update``; ``None`` means "no room".

    * An absent room (``current is None``) is created only by ``Bootstrapping``
      or ``WaitingForInput``; any other update leaves it absent, so a late
      update for a cleared room does nothing.
    * ``Failed`` always wins and sticks.
    * Otherwise progress is monotone: ``max(current, update)``.
    """
    if current is None:
        return update if update in _CREATING else None
    if current is KVPoll.Failed or update is KVPoll.Failed:
        return KVPoll.Failed
    return max(current, update)


OnStatusChange: TypeAlias = Callable[[int, KVPoll | None, KVPoll, str | None], None]
"""``on_change(room, old, new, reason)``; ``old`` is ``None`` when the room was just created."""


class StatusTable:
    """Per-manager ``room -> status`` table applying :func:`apply_status`.

    Not thread-safe: it is owned by one event loop.
    """

    __slots__ = ("_on_change", "_reasons", "_status")

    def __init__(self, on_change: OnStatusChange | None = None) -> None:
        self._status: dict[int, KVPoll] = {}
        self._reasons: dict[int, str] = {}
        self._on_change = on_change

    def update(self, room: int, status: KVPoll, reason: str | None = None) -> bool:
        """Apply ``status`` to ``room``; return True if the stored status changed.

        ``reason`` is recorded only on the first transition to ``Failed``. When the
        status changed, ``on_change(room, old, new, reason)`` is called afterwards
        (with the ``reason`` given here).
        """
        old = self._status.get(room)
        new = apply_status(old, status)
        if new is None or new is old:
            return False
        self._status[room] = new
        if new is KVPoll.Failed and reason is not None:
            self._reasons[room] = reason
        if self._on_change is not None:
            self._on_change(room, old, new, reason)
        return True

    def get(self, room: int) -> KVPoll | None:
        """The room's status, or ``None`` if the room is absent."""
        return self._status.get(room)

    def reason(self, room: int) -> str | None:
        """The reason given when the room failed, if any."""
        return self._reasons.get(room)

    def clear(self, room: int) -> None:
        """Forget the room (status and reason); no-op if absent."""
        self._status.pop(room, None)
        self._reasons.pop(room, None)

    def rooms(self) -> list[int]:
        """The rooms present, in insertion order."""
        return list(self._status)

    def __contains__(self, room: object) -> bool:
        return room in self._status

    def __len__(self) -> int:
        return len(self._status)

    def __repr__(self) -> str:
        return f"StatusTable({len(self._status)} rooms)"


class PollLatch:
    """Latches the first terminal status seen, so ``poll()`` never goes back."""

    __slots__ = ("_latched",)

    def __init__(self) -> None:
        self._latched: KVPoll | None = None

    def observe(self, status: KVPoll) -> KVPoll:
        """Return ``status``, or the latched terminal status once one was observed."""
        if self._latched is not None:
            return self._latched
        if status.is_terminal:
            self._latched = status
        return status

    @property
    def latched(self) -> KVPoll | None:
        """The terminal status latched so far, or ``None``."""
        return self._latched
