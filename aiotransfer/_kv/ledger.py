"""``Ledger``: what may still touch one room's pages on this side.

Every engine submission and handle of the room, and every worker-thread copy of its pages, holds the
ledger until it is over (terminal in the engine, returned on its thread). Holds are taken and given back
on the event loop only.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Ledger", "joint"]


class Ledger:
    __slots__ = ("_on_empty", "held", "taken")

    def __init__(self, on_empty: Callable[[], None] | None = None) -> None:
        self.held = 0
        """Holds outstanding now."""
        self.taken = 0
        """Holds ever taken (for tests and stats)."""
        self._on_empty = on_empty

    def take(self) -> Callable[[], None]:
        """One hold; the returned function gives it back (a second call does nothing)."""
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

    def __repr__(self) -> str:
        return f"<Ledger held={self.held} taken={self.taken}>"


def joint(*holds: Callable[[], Callable[[], None]] | None) -> Callable[[], Callable[[], None]]:
    """One hold that takes every given hold (None ones skipped) and gives them all back together."""
    parts = [h for h in holds if h is not None]

    def take() -> Callable[[], None]:
        backs = [h() for h in parts]

        def give_back() -> None:
            for back in backs:
                back()

        return give_back

    return take
