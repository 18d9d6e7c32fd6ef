"""The async poll loop: owns every in-flight engine handle and turns it into an awaitable.

* Handles are polled from the event loop (``check`` never waits for a lock): yielding (``sleep(0)``)
  between polls while one or two transfers (or at most 1 MiB) of at most 16 entries progress, timed sleeps
  (``poll_interval_min``, doubling up to ``max`` after 10 ms without a completion; on a timerfd with
  ``fine_poll_timer``, see :mod:`._finesleep`) when more is queued
  (``_SPIN_DEPTH``, ``_SPIN_ENTRIES``, ``_SPIN_BYTES``) or after
  ``_SPIN_WINDOW`` without any completion (a hung peer), idle when nothing is in flight. A handle the engine
  reports complete at once (:attr:`TransferHandle.landed`) is asked right after its submission. (Polling once per
  ``poll_interval_max`` with work queued was tried: NIXL over shared memory, whose ``check`` answers
  PENDING while a submit holds the agent lock, fell from 0.63 to 0.31 GB/s with 256 in flight.)
* Writes are posted from the loop when the engine says that cannot wait (``try_submit_inline``), else by the
  engine's driver thread (:mod:`aiotransfer._driver`), whose results come back in batches.
* Entries in flight are capped per peer (engines reject or stall beyond a queue limit); callers wait for
  credit instead of being rejected.
* Terminal means terminal. A handle is over when ``check`` answers DONE or FAILED: the engine can no longer
  touch its memory. A handle the engine dooms (:attr:`TransferHandle.doomed`: a timeout that is not an end,
  one entry failed while others run) fails its write at once, so the room fails without delay, but it stays
  here, pinning its memory, until the engine ends it. A handle whose write gave up (doomed, timed out or
  cancelled) and that the engine has still not ended after ``expire_after`` seconds is abandoned
  (:mod:`._expiry`), counted in ``expired`` and logged; a handle the engine does not let go of stays here,
  its memory held (``held``), until the engine ends it.
* A cancelled or timed-out ``write`` returns promptly, but its handles stay registered until one of those
  ends: the memory they reference stays pinned (see :attr:`Poller.pinned`). A caller that must know when
  that is over passes ``hold``: one hold is taken per submission and per handle, and given back only once
  the submission returned and the handle is over.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeAlias

from . import _trace
from ._deadline import reap, within
from ._driver import Driver
from ._expiry import Expiry
from ._finesleep import fine_sleep
from ._plan import Blocks, split_blocks
from .engines._base import EngineStatus, TransferEngine, TransferHandle
from .errors import ClosedError, EngineError, TransferTimeout

__all__ = ["Credits", "Hold", "Poller", "WriteGuard", "joint"]

Hold: TypeAlias = Callable[[], Callable[[], None]]
"""Takes one hold on something (a room's pages, an arena slice) and returns the function that gives it back."""


class WriteGuard(Protocol):
    """The room a write belongs to, as the poll loop sees it (:class:`aiotransfer._kv.ledger.Ledger`)."""

    def take(self) -> Callable[[], None]:
        """One hold on the room's pages; raises once they were released."""

    def admit(self) -> None:
        """Raises when the room may post no new engine write (terminal or released)."""

    def write_failed(self) -> None:
        """One of the room's engine writes ended without completing (FAILED, or abandoned)."""

log = logging.getLogger("aiotransfer.poller")

_SPIN_WINDOW = 0.25
"""While transfers are in flight the loop polls between every other callback (``sleep(0)``) for up to this
long without progress, then backs off to timed sleeps. Measured on Mooncake TCP: polling every iteration
completes a 256 MiB write as fast as a thread spinning on the status (0.99x), polling every 0.5-1 ms is
10-20 % slower, and other tasks keep running between polls, so the loop stays responsive."""
_SPIN_DEPTH = 2
"""Spin (``sleep(0)``) only while at most this many polled transfers are in flight. Deeper, the engine has
work queued and a completion noticed up to 1 ms late costs no throughput, while the spinning loop takes a
core from the engine's own threads. Measured on Mooncake TCP, 2 vCPUs, 8 x 8 MiB in flight (``bench --suite
full --phases lag,concurrency``): timed polls instead of spinning raised throughput from 0.80x to 1.00x of a
raw thread (1.67-1.73 GB/s spinning, 1.74-2.05 GB/s timed, over several runs); 256 requests in flight went
from 0.60x to 0.76x of the raw single stream. Loop-lag p99 varies more between runs than between the two."""
_SPIN_ENTRIES = 16
"""...and only while those transfers have at most this many engine entries between them, whatever their
size: a write of many entries (a room over dozens of KV buffers, a streamed layer of hundreds of pages) is
work queued in the engine too, and a loop spinning on its statuses takes the CPU its lanes need. Measured on
2 vCPUs (``bench --suite full --phases cpu``: 64 buffers of 2 KiB pages): a one-page room (64 entries) cost
3.3 ms of library CPU on Mooncake TCP spinning against 0.7 ms on timed polls (the raw engine's own: 0.45 ms),
and one streamed layer of 256 pages (512 entries) 15.7 ms against 3.8 ms (raw 2.7 ms)."""
_SPIN_BYTES = 1 << 20
"""...and while at most :data:`_SPIN_DEPTH` transfers are in flight, or they add up to at most this many bytes
(about 0.5 ms of Mooncake TCP): then completions are imminent, and small concurrent requests keep their
latency. Measured with 4 x 256 KiB in flight (``--phases concurrency``, two runs each): 1.20-1.25 GB/s
spinning against 0.86-1.14 GB/s timed."""
_FINE_ENTRIES = 128
"""With ``fine_poll_timer``, timed polls of at most this many entries in flight sleep on a :mod:`timerfd
<aiotransfer._finesleep>` (``poll_interval_min`` as configured); more entries sleep on the loop's own timers
(1 ms at least): each poll round costs the loop about 30 µs, and a streamed layer of 512 entries polled every
130 µs cost 2 ms more CPU than polled every 1.1 ms, for no earlier end."""
_BACKOFF_AFTER = 0.01
"""Timed polls stay at ``poll_interval_min`` (as a thread polling the raw engine does) until this long has
passed without a completion, then double up to ``poll_interval_max`` (a write of many entries completes
only at its end: doubling from the first poll noticed a 1.7 ms room up to 0.8 ms late)."""
_AHEAD = 4
"""With more than :data:`_DEEP` handles in flight, at most this many still running are asked about per peer
and poll round: handles are asked oldest first, and a peer's writes end about in the order they were
posted, so asking about the ones behind them is wasted (a 4,096-handle write asked about every handle 25
times over). A doomed or landed handle is asked about whatever its place."""
_DEEP = 64
_SHARED_CREDITS: dict[tuple[object, str, asyncio.AbstractEventLoop], Credits] = {}
"""(engine scope, peer, event loop) -> that peer's credits, while any are in use or waited for; see
:meth:`Poller._credits_for`. Keyed by the objects, not their ids: an entry can never be taken for another
engine or loop that reuses a dead one's id. A peer's entry goes once nothing is in use or waited for, so a
process that talks to many peers over its life holds entries only for those with writes in flight."""


class Credits:
    """Per-peer entry credits: ``acquire(n)`` waits until ``used + n <= cap``. ``on_idle`` is called each
    time nothing is in use, nobody waits and no write holds these credits (``users``) any more."""

    def __init__(self, cap: int, on_idle: Callable[[Credits], None] | None = None) -> None:
        self.cap = cap
        self.used = 0
        self.users = 0
        """Writes under way that took these credits, and may take more for their next slices."""
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._on_idle = on_idle

    def idle(self) -> None:
        """Call ``on_idle`` if nothing holds these credits any more."""
        if self.used <= 0 and not self._waiters and self.users <= 0 and self._on_idle is not None:
            self._on_idle(self)

    def try_acquire(self, n: int) -> bool:
        n = min(n, self.cap)
        if not self._waiters and self.used + n <= self.cap:
            self.used += n
            return True
        return False

    async def acquire(self, n: int, deadline: float | None) -> None:
        """Wait for ``n`` credits until the loop time ``deadline`` (None: no bound), then raise
        :class:`TransferTimeout`. Credits granted just as the wait is cancelled go back at once."""
        if self.try_acquire(n):
            return
        n = min(n, self.cap)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append((n, fut))
        timer = None if deadline is None else loop.call_at(deadline, _expire, fut, "waiting for engine credit")
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(n)  # granted just as we were cancelled
            elif (n, fut) in self._waiters:
                self._waiters.remove((n, fut))
                self.idle()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def release(self, n: int) -> None:
        self.used -= min(n, self.cap)
        while self._waiters:
            want, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + want > self.cap:
                break
            self._waiters.popleft()
            self.used += want
            fut.set_result(None)
        self.idle()


class Poller:
    """Owns in-flight handles of one engine; see the module docstring."""

    def __init__(
        self,
        engine: TransferEngine,
        driver: Driver,
        *,
        max_in_flight: int,
        max_batch: int,
        interval_min: float,
        interval_max: float,
        expire_after: float,
        fine_timer: bool = False,
    ) -> None:
        self.engine = engine
        self.fine_timer = fine_timer
        self.driver = driver
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self.interval_min = interval_min
        self.interval_max = interval_max
        self.expire_after = expire_after
        self._loop: asyncio.AbstractEventLoop | None = None
        self._polled: dict[TransferHandle, asyncio.Future[None]] = {}
        self._polled_bytes = 0
        self._polled_entries = 0
        self._on_done: dict[TransferHandle, Callable[[], None]] = {}
        self._holds: dict[TransferHandle, list[Callable[[], None]]] = {}
        self._guards: dict[TransferHandle, WriteGuard] = {}
        self._expiry = Expiry(engine, driver, expire_after, end=self._finish, wake=self._wake_up,
                              clock=lambda: self._loop.time() if self._loop is not None else 0.0)
        """Handles whose write gave up on them (doomed, timed out, cancelled), and their quarantine."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.pinned_bytes = 0
        self.completed = 0
        self.failed = 0
        self.doomed = 0
        """Handles the engine doomed before it ended them (their write failed at once)."""

    # -- public ---------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._polled)

    @property
    def pinned(self) -> int:
        """Handles still owned by the engine (including those whose awaiter gave up)."""
        return self.in_flight

    @property
    def overdue(self) -> int:
        """Handles whose write gave up on them while the engine has not ended them yet."""
        return self._expiry.overdue

    @property
    def expired(self) -> int:
        """Handles abandoned after ``expire_after``: the engine had not ended them."""
        return self._expiry.expired

    @property
    def held(self) -> int:
        """Handles abandoned that the engine has still not ended: their memory stays held."""
        return self._expiry.held

    async def write(
        self, peer: str, blocks: Blocks, *, timeout: float | None, on_done: Callable[[], None] | None = None,
        guard: WriteGuard | None = None, hold: Hold | None = None,
    ) -> None:
        """Write ``blocks`` to ``peer``; returns when every entry landed, raises on failure/timeout.

        ``on_done``: called on the loop the moment the engine reports a write of one handle (at most
        ``max_batch`` entries, or the engine's ``inline_slice``) done, before this coroutine resumes, and only
        while it is still waiting (not after a timeout or cancellation). It must not raise or block. Ignored
        for larger writes.

        A write of more entries than the engine's ``traits.inline_slice`` is posted in slices of that size,
        each from the loop when the engine takes it there, yielding to other tasks between them: an engine
        whose native post takes one call per entry (Mooncake) would otherwise make its driver thread take the
        GIL back once per entry, each time behind a turn of the (busy) event loop. The slices after the first
        join its handle while the engine takes them (``try_extend_inline``) and the peer's credit lasts, so one
        handle is polled for the write; a slice that must wait for credit first lets that handle end.

        ``guard``: the room the write belongs to. Right before each engine submission ``guard.admit()`` is
        asked (a room that failed or was released while this write waited for planning or credit posts
        nothing more), and each submission and handle holds the room (``guard.take``) until it is over.

        ``hold``: taken while each submission runs and while each handle is in the engine, and given back
        once it is over there, whether or not this coroutine still waits (see the module docstring).
        """
        if guard is not None:
            hold = joint(guard.take, hold)
        if self._closed:
            raise ClosedError("poller is closed")
        if len(blocks) == 0:
            return
        self._ensure_started()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        tracked: list[tuple[TransferHandle, asyncio.Future[None]]] = []
        failures: list[asyncio.Future[None]] = []
        """Slices that failed while later ones were posted (filled by their done callbacks: one look per
        slice, not a scan of every slice posted so far)."""
        ok = False
        size = self.max_batch
        if self.engine.traits.inline_slice:
            size = min(size, self.engine.traits.inline_slice)
        if on_done is not None and len(blocks) > size:
            on_done = None
        grow: TransferHandle | None = None
        """The handle the write's later slices join, while the engine takes them into it (``try_extend_inline``)."""
        credits = self._credits_for(peer, loop)
        credits.users += 1  # its handles' credits go back to this entry: it stays while the write runs
        try:
            pieces = split_blocks(blocks, size)
            for i, piece in enumerate(pieces):
                if i and tracked and tracked[-1][0].inline:
                    await asyncio.sleep(0)  # the loop posted the last slice itself: let other tasks run
                if not credits.try_acquire(len(piece)):
                    if grow is not None:  # its credits come back only once it ends: it must stop growing
                        self._stop_growing(grow, tracked[-1][1], failures)
                        grow = None
                    await credits.acquire(len(piece), deadline)
                if grow is not None:
                    try:
                        if guard is not None:
                            guard.admit()  # the one gate, as for a submission
                        grown = self._extend(grow, piece, credits)
                    except BaseException:
                        credits.release(len(piece))
                        raise
                    if grown:
                        handle, fut = tracked[-1]
                        self._check_posted(handle, fut, failures)
                        continue
                    grow.growing = False  # the engine would not take it: this slice is a write of its own
                    grow = None
                try:
                    if guard is not None:
                        guard.admit()  # the one gate: checked in the same loop iteration as the submission
                    submitting = hold() if hold is not None else None
                except BaseException:
                    credits.release(len(piece))
                    raise
                # the credit goes back with the post: at once if it failed, when its handle ends if it was
                # adopted (see _submit)
                handle = await self._submit(peer, piece, deadline, submitting, hold,
                                            functools.partial(credits.release, len(piece)))
                if handle.inline and i + 1 < len(pieces) and handle.doomed is None:
                    grow = handle  # set in the iteration that posted it: never polled before
                    handle.growing = True
                _trace.recorder is None or _trace.submitted(handle, guard)
                fut = self._track(handle, hold)
                tracked.append((handle, fut))
                fut.add_done_callback(functools.partial(_note_failure, failures))
                if guard is not None:
                    self._guards[handle] = guard
                if submitting is not None:
                    submitting()
                if on_done is not None:
                    self._on_done[handle] = on_done
                self._check_posted(handle, fut, failures)
            if grow is not None:
                self._stop_growing(grow, tracked[-1][1], failures)
                grow = None
            await _wait_all([f for _, f in tracked], deadline, loop)
            ok = True
        finally:
            credits.users -= 1
            credits.idle()
            if grow is not None:
                grow.growing = False  # no slice joins it any more: it may end
            if not ok:
                now = loop.time()
                for handle, f in tracked:
                    f.add_done_callback(_swallow)
                    if handle in self._polled:
                        self._expiry.give_up(handle, now)

    def _stop_growing(self, handle: TransferHandle, fut: asyncio.Future[None],
                      failures: list[asyncio.Future[None]]) -> None:
        """No more slices join ``handle``: it may end, and is asked at once (every entry posted may have ended
        while it was growing), then the write's first failure is raised."""
        handle.growing = False
        self._poll_one(handle)
        self._check_posted(handle, fut, failures)

    def _check_posted(self, handle: TransferHandle, fut: asyncio.Future[None],
                      failures: list[asyncio.Future[None]]) -> None:
        """Right after a post: ask a handle the engine says landed or doomed at once, and raise the first
        failure of the write's slices."""
        if handle.landed or handle.doomed:
            self._poll_one(handle)
        if not failures and fut.done():
            _note_failure(failures, fut)  # ended in this iteration: its callback has not run yet
        if failures:
            raise failures[0].exception()  # type: ignore[misc]

    def _extend(self, handle: TransferHandle, piece: Blocks, credits: Credits) -> bool:
        """``piece`` posted from the loop into the growing ``handle``, which is polled; True when the engine
        took it. Its credit goes back when the handle ends, except for entries the engine refused."""
        entries, nbytes = handle.entries, handle.nbytes
        if not self.engine.try_extend_inline(handle, piece):
            return False
        added, more = handle.entries - entries, handle.nbytes - nbytes
        if added < len(piece):
            credits.release(len(piece) - added)
        self.pinned_bytes += more
        self._polled_bytes += more
        self._polled_entries += added
        return True

    async def aclose(self, timeout: float) -> int:
        """Stop accepting work, wait up to ``timeout`` for in-flight handles; returns how many remain."""
        self._closed = True
        if self.in_flight:
            self._idle.clear()
            try:
                await within(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("%d engine transfers still in flight at close; their memory stays pinned", self.in_flight)
        if self._task is not None:
            await reap(self._task, 1.0)
        return self.in_flight

    # -- internals ------------------------------------------------------------------------------
    def _credits_for(self, peer: str, loop: asyncio.AbstractEventLoop) -> Credits:
        """Credits are shared by every poller driving the same native engine on this loop: the per-peer
        queue limit belongs to the engine (Mooncake's is process-wide), not to one manager. A handle's
        entries stay counted in the entry until it ends, so the entry a write finds is the one its peer's
        handles in flight count against."""
        key = (self.engine.credit_scope, peer, loop)
        credits = _SHARED_CREDITS.get(key)
        if credits is None:  # managers of one engine with other caps share the first one's
            credits = _SHARED_CREDITS[key] = Credits(self.max_in_flight, functools.partial(_forget_credits, key))
        return credits

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._poll_loop(), name="aiotransfer-poller")

    async def _submit(
        self, peer: str, piece: Blocks, deadline: float | None,
        submitting: Callable[[], None] | None = None, hold: Hold | None = None,
        uncredit: Callable[[], None] | None = None,
    ) -> TransferHandle:
        """The submission's handle: posted from the loop when the engine says that cannot wait, else by the
        driver. Abandoned (timeout, cancellation) while the driver still posts it: the handle it produces is
        adopted and polled to its end, and ``submitting`` is given back only after that.

        ``uncredit`` gives the submission's credit back; it is called once, when no handle came of it (refused
        on the spot, or the abandoned post failed). A handle's credit goes back when it ends (``_finish``): the
        entries of a post still on the driver stay counted, so the engine never holds more than the cap."""
        try:
            inline = self.engine.try_submit_inline(peer, piece)
            fut = self.driver.call(self.engine.submit_write, peer, piece) if inline is None else None
        except BaseException:
            if submitting is not None:
                submitting()  # refused on the spot: nothing was posted
            if uncredit is not None:
                uncredit()
            raise
        if fut is None:
            assert inline is not None
            inline.inline = True
            return inline
        try:
            handle: TransferHandle = await _bounded(asyncio.shield(fut), deadline, "engine submit")
            return handle
        except BaseException:
            # Abandoned (or the post failed): if the post still produces a handle, adopt it so it is polled to
            # its end; if it does not, its credit goes back then.
            fut.add_done_callback(lambda f: self._adopt(f, submitting, hold, uncredit))
            raise

    def _adopt(
        self, f: asyncio.Future[TransferHandle], submitting: Callable[[], None] | None, hold: Hold | None,
        uncredit: Callable[[], None] | None = None,
    ) -> None:
        handle = None if f.cancelled() or f.exception() is not None else f.result()
        if handle is not None:
            self._track(handle, hold).add_done_callback(_swallow)
            self._expiry.give_up(handle, asyncio.get_running_loop().time())
        elif uncredit is not None:
            uncredit()  # nothing was posted after all
        if submitting is not None:
            submitting()  # after the handle took its own hold

    def _track(self, handle: TransferHandle, hold: Hold | None = None) -> asyncio.Future[None]:
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        if hold is not None:
            self._holds.setdefault(handle, []).append(hold())
        self.pinned_bytes += handle.nbytes
        self._idle.clear()
        self._polled[handle] = fut
        self._polled_bytes += handle.nbytes
        self._polled_entries += handle.entries
        self._wake.set()
        return fut

    def _finish(self, handle: TransferHandle) -> None:
        _trace.recorder is None or _trace.completed(handle)
        fut = self._polled.pop(handle, None)
        if fut is None:
            return
        self._polled_bytes -= handle.nbytes
        self._polled_entries -= handle.entries
        self._expiry.forget(handle)
        self.pinned_bytes -= handle.nbytes
        assert self._loop is not None
        credits = _SHARED_CREDITS.get((self.engine.credit_scope, handle.peer, self._loop))
        if credits is not None:
            credits.release(handle.entries)
        on_done = self._on_done.pop(handle, None)
        guard = self._guards.pop(handle, None)
        if guard is not None and handle.status is not EngineStatus.DONE:
            guard.write_failed()  # before the holds go back: the room's release reads it
        for give_back in self._holds.pop(handle, ()):
            give_back()
        if handle.status is EngineStatus.DONE:
            self.completed += 1
            if not fut.done():
                if on_done is not None:
                    try:
                        on_done()
                    except Exception:
                        log.exception("completion callback failed")
                fut.set_result(None)
        else:
            self.failed += 1
            if not fut.done():
                fut.set_exception(EngineError(handle.error or "engine transfer failed"))
        if not self._polled:
            self._idle.set()

    def _doom(self, handle: TransferHandle) -> None:
        """The engine says the write will not succeed but has not ended it: the write fails now, the handle
        (and every hold on its memory) stays until the engine ends it."""
        fut = self._polled.get(handle)
        if fut is None or self._expiry.gave_up(handle):
            return
        self.doomed += 1
        assert self._loop is not None
        self._expiry.give_up(handle, self._loop.time())
        self._on_done.pop(handle, None)
        if not fut.done():
            fut.set_exception(EngineError(handle.doomed or "engine transfer failed"))

    def _poll_one(self, handle: TransferHandle, check: Callable[[TransferHandle], EngineStatus] | None = None) -> bool:
        """Ask the engine about one handle; finish it when it is over, fail its write when it is doomed.
        True when it ended."""
        try:
            status = (check or self.engine.check)(handle)
        except Exception as exc:
            # the adapter broke its contract (a check raises): nothing says the engine let go of the memory
            if not handle.consumed:
                handle.doom(f"engine check raised {exc!r}")
            status = handle.status
        if not status.is_terminal:
            if handle.doomed is not None:
                self._doom(handle)
            return False
        self._finish(handle)
        return True

    def _wake_up(self) -> None:
        self._wake.set()

    async def _poll_loop(self) -> None:
        nap, close_nap = fine_sleep(asyncio.get_running_loop(), self.fine_timer)
        try:
            await self._polling(nap)
        finally:
            close_nap()

    async def _polling(self, nap: Callable[[float], Awaitable[Any]]) -> None:
        interval = self.interval_min
        last_progress = time.perf_counter()
        check = self.engine.check
        loop = asyncio.get_running_loop()
        while True:
            if not self._polled:
                self._wake.clear()
                await self._wake.wait()
                last_progress = time.perf_counter()
                interval = self.interval_min
                continue
            progressed = False
            running: dict[str, int] = {}
            ahead = _AHEAD if len(self._polled) > _DEEP else len(self._polled)
            for handle in list(self._polled):
                if self._expiry.busy(handle):
                    continue
                seen = running.get(handle.peer, 0)
                if seen >= ahead and handle.doomed is None and not handle.landed:
                    continue
                if self._poll_one(handle, check):
                    progressed = True
                else:
                    running[handle.peer] = seen + 1
            if self._expiry:
                self._expiry.tick(loop.time())
            now = time.perf_counter()
            if progressed:
                last_progress = now
                interval = self.interval_min
            shallow = self._polled_entries <= _SPIN_ENTRIES and (
                len(self._polled) <= _SPIN_DEPTH or self._polled_bytes <= _SPIN_BYTES)
            if shallow and now - last_progress < _SPIN_WINDOW:
                await asyncio.sleep(0)
            else:
                await (nap if self._polled_entries <= _FINE_ENTRIES else asyncio.sleep)(interval)
                if now - last_progress >= _BACKOFF_AFTER:
                    interval = min(interval * 2, self.interval_max)


def _forget_credits(key: tuple[object, str, asyncio.AbstractEventLoop], credits: Credits) -> None:
    if _SHARED_CREDITS.get(key) is credits:
        del _SHARED_CREDITS[key]


async def _wait_all(
    futures: list[asyncio.Future[None]], deadline: float | None, loop: asyncio.AbstractEventLoop
) -> None:
    """Every future done, or the first error, or :class:`TransferTimeout` at ``deadline`` (no extra tasks)."""
    pending = {f for f in futures if not f.done()}
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    if len(pending) == 1:
        # One handle (the common small write): await its future itself, so this task resumes in the loop
        # iteration right after completion; ``asyncio.wait`` adds a callback round through a helper future.
        (only,) = pending
        timer = None if deadline is None else loop.call_at(deadline, _expire, only)
        try:
            await only
        finally:
            if timer is not None:
                timer.cancel()
        return
    while pending:
        timeout = None if deadline is None else max(deadline - loop.time(), 0.0)
        done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            exc = f.exception()
            if exc is not None:
                raise exc
        if pending and deadline is not None and loop.time() >= deadline:
            raise TransferTimeout("engine transfer exceeded its deadline")


async def _bounded(aw: Any, deadline: float | None, what: str) -> Any:
    if deadline is None:
        return await aw
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        return await within(aw, max(remaining, 0.0))
    except asyncio.TimeoutError:
        raise TransferTimeout(f"{what} exceeded its deadline") from None


def joint(*holds: Hold | None) -> Hold:
    """One hold that takes every given hold (None ones skipped) and gives them all back together."""
    parts = [h for h in holds if h is not None]

    def take() -> Callable[[], None]:
        backs: list[Callable[[], None]] = []
        try:
            for h in parts:
                backs.append(h())  # noqa: PERF401 (those taken before a refusal are given back)
        except BaseException:
            for back in backs:
                back()
            raise

        def give_back() -> None:
            for back in backs:
                back()

        return give_back

    return take


def _note_failure(failures: list[asyncio.Future[None]], fut: asyncio.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None and fut not in failures:
        failures.append(fut)


def _swallow(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _expire(fut: asyncio.Future[None], what: str = "engine transfer") -> None:
    if not fut.done():
        fut.set_exception(TransferTimeout(f"{what} exceeded its deadline"))
