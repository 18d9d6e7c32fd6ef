"""The one door for blocking calls: a named, bounded executor per engine.

Threads cannot be interrupted. A timed-out or cancelled ``await`` returns promptly, but the call keeps
running on its thread until it returns by itself; its result is then discarded (and an exception logged
at debug level). Callers must therefore never free memory that a still-running call may touch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import ClosedError, ConfigError, TransferTimeout

__all__ = ["Offloader"]

T = TypeVar("T")
log = logging.getLogger("aiotransfer.offload")


class Offloader:
    """A named thread pool with a device-binding initializer and an explicit bound."""

    def __init__(
        self,
        name: str,
        threads: int,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.threads = threads
        """The pool's threads (each started when a call first needs it)."""
        self.initializer = initializer
        """Runs first on every executor thread (device binding); the poller's waiter threads run it too."""
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=f"aiotransfer-{name}", initializer=initializer
        )
        self._closed = False
        self._running = 0
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """Calls currently executing or queued (including abandoned ones still running)."""
        return self._running

    def _track(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running -= 1

    async def run(
        self, fn: Callable[..., T], *args: Any, timeout: float | None, what: str,
        on_done: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the executor and await it for at most ``timeout`` seconds.

        ``on_done`` runs on the event loop exactly once, when the call can no longer touch anything: after it
        returned or raised on its thread, or at once if it was never started. When the wait ends early
        (timeout or cancellation) the call goes on running on its thread, and ``on_done`` waits for it: memory
        the call reads or writes is freed from ``on_done``, never by the awaiting coroutine."""
        if self._closed:
            if on_done is not None:
                on_done()
            raise ClosedError(f"offload executor {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        with self._lock:
            self._running += 1
        try:
            fut = loop.run_in_executor(self._executor, functools.partial(self._track, fn, *args))
        except concurrent.futures.BrokenExecutor as exc:
            with self._lock:
                self._running -= 1
            if on_done is not None:
                on_done()
            raise ConfigError(
                f"offload executor {self.name!r} is broken: its thread initializer (device binding) failed; "
                "check TransferConfig.device_id"
            ) from exc
        except RuntimeError:
            with self._lock:
                self._running -= 1
            if on_done is not None:
                on_done()
            raise ClosedError(f"offload executor {self.name!r} is shut down") from None
        try:
            done, _ = await asyncio.wait({fut}, timeout=timeout)
        except asyncio.CancelledError:
            _abandon(fut, on_done)
            raise
        if not done:
            _abandon(fut, on_done)
            raise TransferTimeout(f"{what} did not finish within {timeout:.3g}s (still running on its thread)")
        if on_done is not None:
            on_done()
        try:
            return fut.result()
        except concurrent.futures.BrokenExecutor as exc:
            raise ConfigError(
                f"offload executor {self.name!r} is broken: its thread initializer (device binding) failed; "
                "check TransferConfig.device_id"
            ) from exc

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Fire-and-track for callers that manage the result themselves."""
        if self._closed:
            raise ClosedError(f"offload executor {self.name!r} is closed")
        with self._lock:
            self._running += 1
        return self._executor.submit(self._track, fn, *args)

    def shutdown(self, *, wait: bool) -> None:
        self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)


def _abandon(fut: asyncio.Future[Any], on_done: Callable[[], None] | None) -> None:
    fut.add_done_callback(_discard_result)
    if on_done is not None:
        fut.add_done_callback(lambda _: on_done())


def _discard_result(fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.debug("abandoned offloaded call finished with %r", exc)
