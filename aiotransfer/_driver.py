"""The engine's driver: one thread that makes every engine call that may wait, in the order asked.

A native call that may wait on a lock held across network I/O never runs on the event loop. Mooncake's
submits take an engine-wide mutex that its handshake holds across a metadata round trip to the peer; NIXL
serialises an agent's calls, one of which may be a large inline copy. Such calls (writes the loop could not
post inline, handshakes, registration, the engine's creation and close) are handed to the driver, which runs
them one after another on its own thread, so a hung handshake holds up the engine's other calls (which would
wait for the same lock anyway) but never the loop, and never the offload executor's copies and planning.

The loop hands a call over without blocking (a queue put; the driver is woken only when it sleeps) and gets
results back in batches: the driver collects what it finished and wakes the loop once per batch, not once
per call. Calls that the engine declares cannot wait (``check``, ``try_submit_inline``) stay on the loop.

Threads cannot be interrupted. A bounded ``run`` that times out or is cancelled returns at once, but the call
goes on running on the driver; ``on_done`` tells its caller when it is over, and memory the call may touch is
released from there, never by the coroutine that gave up.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import ClosedError, ConfigError, TransferTimeout

__all__ = ["Driver"]

T = TypeVar("T")
log = logging.getLogger("aiotransfer.driver")

_Job = tuple[asyncio.Future[Any], Callable[..., Any], tuple[Any, ...]]


class Driver:
    """One named thread, started on first use, running blocking engine calls in order."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self.name = name
        self.initializer = initializer
        """Runs first on the driver thread (device binding), as on the offload executor's threads."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._out: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self._out_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._broken: BaseException | None = None
        self.queued = 0
        """Calls handed over and not yet delivered back (for stats and tests)."""
        self.batches = 0
        """Times the loop was woken to take results (each with one or more)."""
        self.current: str | None = None
        """What the driver is running now (its function's name), or None when idle."""

    # -- the loop's side ------------------------------------------------------------------------
    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Hand ``fn(*args)`` to the driver; the future resolves on the loop once it returned or raised."""
        if self._closed:
            raise ClosedError(f"engine driver {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._run, name=f"aiotransfer-driver-{self.name}", daemon=True)
            self._thread.start()
        fut: asyncio.Future[T] = loop.create_future()
        self.queued += 1
        self._jobs.put((fut, fn, args))
        return fut

    async def run(
        self, fn: Callable[..., T], *args: Any, timeout: float | None, what: str,
        on_done: Callable[[], None] | None = None,
    ) -> T:
        """``fn(*args)`` on the driver, awaited for at most ``timeout`` seconds (then :class:`TransferTimeout`).

        ``on_done`` runs on the loop exactly once, when the call can no longer touch anything: after it
        returned or raised, or at once if it was never handed over."""
        try:
            fut = self.call(fn, *args)
        except BaseException:
            if on_done is not None:
                on_done()
            raise
        if on_done is not None:
            fut.add_done_callback(lambda _: on_done())
        try:
            done, _ = await asyncio.wait({fut}, timeout=timeout)
        except asyncio.CancelledError:
            fut.add_done_callback(_discard)
            raise
        if not done:
            fut.add_done_callback(_discard)
            running = f" (the driver is in {self.current})" if self.current else ""
            raise TransferTimeout(f"{what} did not finish within {timeout:.3g}s{running}; it goes on in the background")
        return fut.result()

    def close(self) -> None:
        """No new calls; the thread ends once those already handed over are done."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    @property
    def busy(self) -> bool:
        return self.queued > 0

    # -- the driver's side ----------------------------------------------------------------------
    def _run(self) -> None:
        if self.initializer is not None:
            try:
                self.initializer()
            except BaseException as exc:  # every call fails with why (a device that cannot be bound)
                self._broken = exc
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            result: Any = None
            error: BaseException | None = None
            if self._broken is not None:
                error = ConfigError(
                    f"engine driver {self.name!r} cannot run: its thread initializer (device binding) failed "
                    f"({self._broken!r}); check TransferConfig.device_id"
                )
            else:
                self.current = getattr(fn, "__qualname__", repr(fn))
                try:
                    result = fn(*args)
                except BaseException as exc:
                    error = exc
                finally:
                    self.current = None
            self._deliver(fut, result, error)

    def _deliver(self, fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
        with self._out_lock:
            self._out.append((fut, result, error))
            first = len(self._out) == 1
        if first:  # the loop is woken once per batch: later results join the batch until it is taken
            loop = self._loop
            if loop is None or loop.is_closed():
                return
            try:
                loop.call_soon_threadsafe(self._take)
            except RuntimeError:
                log.debug("event loop closed; results of engine driver %r dropped", self.name)

    def _take(self) -> None:
        with self._out_lock:
            batch, self._out = self._out, []
        self.batches += 1
        self.queued -= len(batch)
        for fut, result, error in batch:
            if fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)


def _discard(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("abandoned engine call finished with %r", fut.exception())
