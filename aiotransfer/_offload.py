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

    async def run(self, fn: Callable[..., T], *args: Any, timeout: float | None, what: str) -> T:
        """Run ``fn(*args)`` on the executor and await it for at most ``timeout`` seconds."""
        if self._closed:
            raise ClosedError(f"offload executor {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        with self._lock:
            self._running += 1
        try:
            fut = loop.run_in_executor(self._executor, functools.partial(self._track, fn, *args))
        except concurrent.futures.BrokenExecutor as exc:
            with self._lock:
                self._running -= 1
            raise ConfigError(
                f"offload executor {self.name!r} is broken: its thread initializer (device binding) failed; "
                "check TransferConfig.device_id"
            ) from exc
        except RuntimeError:
            with self._lock:
                self._running -= 1
            raise ClosedError(f"offload executor {self.name!r} is shut down") from None
        try:
            done, _ = await asyncio.wait({fut}, timeout=timeout)
        except asyncio.CancelledError:
            fut.add_done_callback(_discard_result)
            raise
        if not done:
            fut.add_done_callback(_discard_result)
            raise TransferTimeout(f"{what} did not finish within {timeout:.3g}s (still running on its thread)")
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


def _discard_result(fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.debug("abandoned offloaded call finished with %r", exc)
