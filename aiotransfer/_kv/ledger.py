"""``Ledger``: what may still touch one room's pages on this side, and the gate every engine write passes.

Every engine submission and handle of the room, every worker-thread copy of its pages, and every write path
from its first await to its end, holds the ledger until it is over (terminal in the engine, returned on its
thread, returned to its caller). Holds are taken and given back on the event loop only.

The ledger is the room's one choke point for writes:

* :meth:`Ledger.take` refuses once the ledger is closed, and the room closes it when it releases its pages
  (which it does only once nothing holds it): nothing can start touching released pages;
* :meth:`Ledger.admit` runs right before each engine submission (:meth:`aiotransfer._poller.Poller.write`
  calls it) and refuses a room that is terminal or released: a write that waited (planning, credit, a
  worker thread) while its room failed posts nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import TransferFailed

__all__ = ["Ledger"]


class Ledger:
    __slots__ = ("_on_empty", "_refusal", "closed", "failed_writes", "held", "room", "taken")

    def __init__(self, room: int = -1, on_empty: Callable[[], None] | None = None,
                 refusal: Callable[[], str | None] | None = None) -> None:
        self.room = room
        self.held = 0
        """Holds outstanding now."""
        self.taken = 0
        """Holds ever taken (for tests and stats)."""
        self.closed = False
        """Closed when the room's pages were released: no hold can be taken any more."""
        self.failed_writes = 0
        """Engine writes of the room that ended FAILED (or were abandoned): bytes they had sent may still
        land on an engine with ``landing_grace_s``."""
        self._on_empty = on_empty
        self._refusal = refusal
        """Why the room may post no new engine write (it is terminal), or None."""

    def take(self) -> Callable[[], None]:
        """One hold; the returned function gives it back (a second call does nothing). Raises
        :class:`TransferFailed` once the ledger is closed: the room's pages were released."""
        if self.closed:
            raise TransferFailed(f"room {self.room}: its pages were released; nothing may touch them any more",
                                 room=self.room)
        self.held += 1
        self.taken += 1
        given = False

        def give_back() -> None:
            nonlocal given
            if given:
                return
            given = True
            self.held -= 1
            if self.held == 0 and self._on_empty is not None:
                self._on_empty()

        return give_back

    def admit(self) -> None:
        """Called right before every engine submission of the room: raises :class:`TransferFailed` with the
        room's reason when it may post nothing more (terminal or released)."""
        reason = self._refusal() if self._refusal is not None else None
        if self.closed and reason is None:
            reason = "its pages were released"
        if reason is not None:
            raise TransferFailed(reason, room=self.room)
        assert self.held > 0, "a room's write holds its ledger from its first await to its end"

    def write_failed(self) -> None:
        """An engine write holding this ledger ended without completing (:meth:`Poller.write` calls it)."""
        self.failed_writes += 1

    def close(self) -> None:
        """The room's pages are released: no hold can be taken after this."""
        assert self.held == 0, "a room is released only once nothing holds its ledger"
        self.closed = True

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<Ledger room={self.room} held={self.held} taken={self.taken}{state}>"
