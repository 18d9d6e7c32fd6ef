"""``BackgroundManager``: a ``KVManager`` on its own event loop thread, driven from synchronous code.

Every call crosses into the loop thread with :func:`asyncio.run_coroutine_threadsafe` and waits with a
bound; on expiry the coroutine is cancelled on the loop (its room fails as any cancelled call's would) and
:class:`~aiotransfer.TransferTimeout` is raised. The loop thread never waits on the caller, so a call made
from the loop thread itself is refused instead of deadlocking.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._args import KVArgs
from .._config import TransferConfig
from .._manager import KVManager
from ..errors import ClosedError, TransferTimeout

__all__ = ["BackgroundManager"]

T = TypeVar("T")
log = logging.getLogger("aiotransfer.integrations")


class BackgroundManager:
    """A [`KVManager`][aiotransfer.KVManager] running on an event loop in a daemon thread.

    ```python
    with BackgroundManager(KVArgs(kv_tensors, page_size=16), TransferConfig(engine="mooncake_tcp")) as bg:
        tx = bg.call(lambda m: m.sender(room))                 # a plain function, on the loop thread
        bg.run(lambda m: tx.wait_ready(timeout=10), timeout=11) # a coroutine, awaited with a bound
        fut = bg.submit(lambda m: tx.send_kv(pages))            # not awaited: a concurrent Future
        ...
        fut.result(timeout=30)
        tx.poll()                                               # KVPoll reads are safe from any thread
    ```

    ``close()`` (or leaving the ``with`` block) waits, bounded, for submitted work, then closes the manager
    (failing what is still open, draining the engine, deregistering memory) and stops the thread.

    Args:
        args: The rank's memory, as for [`KVManager`][aiotransfer.KVManager].
        config: As for [`KVManager`][aiotransfer.KVManager]; None reads the environment.
        name: Prefix of the loop thread's name.
        start_timeout: Bound on [`start`][aiotransfer.integrations.BackgroundManager.start].
    """

    def __init__(
        self, args: KVArgs, config: TransferConfig | None = None, *, name: str = "aiotransfer",
        start_timeout: float = 60.0,
    ) -> None:
        self._args = args
        self._config = config
        self._name = name
        self._start_timeout = start_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._manager: KVManager | None = None
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> BackgroundManager:
        """Start the loop thread and the manager (leaving the ``with`` block calls it for you).

        Returns:
            This object.

        Raises:
            TransferTimeout: Not started within ``start_timeout`` seconds.
            ClosedError: Already closed.
            AiotransferError: What [`KVManager.start`][aiotransfer.KVManager.start] raised.
        """
        with self._lock:
            if self._closed:
                raise ClosedError("background manager is closed")
            if self._thread is not None:
                return self
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def main() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

            self._loop = loop
            self._thread = threading.Thread(target=main, name=f"{self._name}-loop", daemon=True)
            self._thread.start()
        if not ready.wait(self._start_timeout):
            raise TransferTimeout(f"event loop thread did not start within {self._start_timeout:.3g}s")
        manager = KVManager(self._args, self._config)
        try:
            self._wait(asyncio.run_coroutine_threadsafe(manager.start(), loop), self._start_timeout,
                       "manager start")
        except BaseException:
            self._stop_loop()
            raise
        self._manager = manager
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Wait for submitted work, close the manager, stop the thread. Idempotent.

        Args:
            timeout: Seconds to wait for submitted work (then cancelled), and for the manager's close.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        loop, manager = self._loop, self._manager
        if loop is None:
            return
        _, not_done = concurrent.futures.wait(pending, timeout=timeout)
        for fut in not_done:
            fut.cancel()  # cancels the coroutine on the loop: its room fails, its memory stays pinned
        if manager is not None:
            with contextlib.suppress(Exception):
                self._wait(asyncio.run_coroutine_threadsafe(manager.aclose(timeout), loop), timeout + 5,
                           "manager close")
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)
            if thread.is_alive():
                log.warning("event loop thread %s did not stop within 10 s", thread.name)

    def __enter__(self) -> BackgroundManager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls ----------------------------------------------------------------------------------
    @property
    def manager(self) -> KVManager:
        """The manager. Use it inside functions given to :meth:`call`, :meth:`run` or :meth:`submit`:
        its methods belong to the loop thread."""
        if self._manager is None or self._closed:
            raise ClosedError("background manager is not running")
        return self._manager

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise ClosedError("background manager is not started")
        return self._loop

    def submit(self, fn: Callable[[KVManager], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run the coroutine ``fn(manager)`` on the loop thread, without waiting for it. ``close()`` waits
        for submitted work, bounded.

        Args:
            fn: Called with the manager on the loop thread; returns the awaitable to run.

        Returns:
            A concurrent Future of its result (cancel it to cancel the coroutine).
        """
        self._check_caller()
        manager = self.manager

        async def call() -> T:
            return await fn(manager)

        fut = asyncio.run_coroutine_threadsafe(call(), self.loop)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def run(self, fn: Callable[[KVManager], Awaitable[T]], timeout: float) -> T:
        """[`submit`][aiotransfer.integrations.BackgroundManager.submit], then wait for the result.

        Args:
            fn: Called with the manager on the loop thread; returns the awaitable to run.
            timeout: Seconds to wait.

        Returns:
            The coroutine's result.

        Raises:
            TransferTimeout: No result within ``timeout``; the coroutine is cancelled.
        """
        return self._wait(self.submit(fn), timeout, "call")

    def call(self, fn: Callable[[KVManager], T], timeout: float = 10.0) -> T:
        """Run the plain function ``fn(manager)`` on the loop thread (``m.sender(room)``, ``m.stats()``...).

        Args:
            fn: Called with the manager on the loop thread.
            timeout: Seconds to wait.

        Returns:
            What ``fn`` returned.

        Raises:
            TransferTimeout: No result within ``timeout``.
        """
        self._check_caller()
        manager = self.manager

        async def call() -> T:
            return fn(manager)

        return self._wait(asyncio.run_coroutine_threadsafe(call(), self.loop), timeout, "call")

    def _check_caller(self) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError("BackgroundManager called from its own event loop thread: await the manager's "
                               "coroutines there instead")

    @staticmethod
    def _wait(fut: concurrent.futures.Future[T], timeout: float, what: str) -> T:
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransferTimeout(f"{what} did not finish within {timeout:.3g}s (cancelled)") from None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._manager is not None else "new")
        return f"<BackgroundManager {state} {self._manager!r}>"
