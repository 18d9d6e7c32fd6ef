"""The release quarantine of engine handles: when the poll loop gives up a write the engine never ended.

A handle whose write gave up on it (doomed, timed out, cancelled) and that the engine has still not ended
``expire_after`` seconds later (the release quarantine) is abandoned: :meth:`TransferEngine.abandon` runs on the
engine's driver (it may take the engine's lock) while the handle is not polled. Abandoning asks the engine to
let go. An adapter whose engine can drop the write consumes the handle there, and it ends at once. One that
can only cut the engine's path to the peer (Mooncake over TCP) leaves it PENDING: the handle is then *held*,
polled on, its memory kept, until the engine answers terminally, and it is abandoned again every ``RECUT_S``
meanwhile (an engine that queued more of the write behind what the cut ended opens new connections for it). A
held handle still not ended ``expire_after`` after its first abandon is logged once as a warning. Memory the
engine may still read is never given back here: only a terminal answer, or an adapter that consumed the
handle, ends it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ._driver import Driver
from .engines._base import EngineStatus, TransferEngine, TransferHandle

__all__ = ["RECUT_S", "Expiry"]

log = logging.getLogger("aiotransfer.poller")

RECUT_S = 0.2
"""How often a held handle is abandoned again. Mooncake TCP runs a few entries of a write to one peer at a
time, one connection each, and starts the next queued entry on a new connection as soon as one fails: each
abandon ends those running (measured: 32 entries of 1 MiB to a stopped decode ended over a few rounds)."""


@dataclass
class _Held:
    first: float
    last: float
    warned: bool = False


class Expiry:
    """The handles whose write gave up on them, and what becomes of them past ``expire_after``."""

    def __init__(self, engine: TransferEngine, driver: Driver, expire_after: float, *,
                 end: Callable[[TransferHandle], None], wake: Callable[[], None],
                 clock: Callable[[], float]) -> None:
        self.engine = engine
        self.driver = driver
        self.expire_after = expire_after
        self._end = end
        """Ends a handle the engine consumed (the poll loop's own finish: holds, credit, counters)."""
        self._wake = wake
        self._clock = clock
        self._given_up: dict[TransferHandle, float] = {}
        """Handles whose write gave up on them -> loop time it did."""
        self._abandoning: set[TransferHandle] = set()
        """Handles the driver is abandoning now (not polled meanwhile)."""
        self._held: dict[TransferHandle, _Held] = {}
        self.expired = 0
        """Handles abandoned after ``expire_after``, counted when the first ``abandon`` returned (each once,
        however often it is abandoned again)."""

    def __bool__(self) -> bool:
        return bool(self._given_up)

    @property
    def overdue(self) -> int:
        """Handles whose write gave up on them while the engine has not ended them yet."""
        return len(self._given_up)

    @property
    def held(self) -> int:
        """Handles abandoned that the engine has not ended: their memory stays held."""
        return len(self._held)

    def gave_up(self, handle: TransferHandle) -> bool:
        return handle in self._given_up

    def give_up(self, handle: TransferHandle, now: float) -> None:
        """The handle's write gave up on it at ``now`` (a later call keeps the first time)."""
        self._given_up.setdefault(handle, now)

    def busy(self, handle: TransferHandle) -> bool:
        """The driver is abandoning the handle: it must not be polled meanwhile."""
        return handle in self._abandoning

    def forget(self, handle: TransferHandle) -> None:
        """The handle ended."""
        self._given_up.pop(handle, None)
        self._held.pop(handle, None)

    def tick(self, now: float) -> None:
        """Abandon what passed ``expire_after``, abandon held handles again, warn of those still held."""
        for handle, held in self._held.items():
            if not held.warned and now - held.first >= self.expire_after:
                held.warned = True
                log.warning("engine write to %s (%d entries, %d bytes) still not ended %.3gs after it was abandoned: "
                            "its memory stays held until the engine ends it", handle.peer, handle.entries,
                            handle.nbytes, now - held.first)
        again = [h for h, held in self._held.items() if now - held.last >= RECUT_S and h not in self._abandoning]
        old = [h for h, since in self._given_up.items()
               if now - since >= self.expire_after and h not in self._abandoning and h not in self._held]
        for handle in old:
            log.warning("engine write to %s (%d entries, %d bytes) still not ended %.3gs after it failed (%s): "
                        "abandoned; its memory is released once the engine lets go of it", handle.peer,
                        handle.entries, handle.nbytes, now - self._given_up[handle], handle.doomed or "its caller gave up")
        for handle in again + old:
            self._abandon(handle)

    def _abandon(self, handle: TransferHandle) -> None:
        self._abandoning.add(handle)
        try:
            fut = self.driver.call(self.engine.abandon, handle)
        except Exception as exc:  # the driver is closed: the process is going away
            log.debug("abandon of %r not made: %r", handle, exc)
            self._abandoned(handle)
            return
        fut.add_done_callback(functools.partial(self._abandoned, handle))

    def _abandoned(self, handle: TransferHandle, f: asyncio.Future[None] | None = None) -> None:
        """``abandon`` returned: the handle ends if the engine consumed it, else it is held and polled on (a
        closed driver, the process going away, ends it at once)."""
        self._abandoning.discard(handle)
        held = self._held.get(handle)
        if held is None:
            self.expired += 1
        if f is not None and not f.cancelled() and f.exception() is not None:
            log.warning("engine abandon of %r raised %r", handle, f.exception())
        if f is None and not handle.consumed:
            handle.finish(EngineStatus.FAILED, handle.doomed or "abandoned after the release quarantine")
        if handle.consumed:
            self._end(handle)
            return
        now = self._clock()
        if held is None:
            self._held[handle] = _Held(now, now)
        else:
            held.last = now
        self._wake()
