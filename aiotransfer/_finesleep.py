"""Sleeps on the event loop shorter than a millisecond.

asyncio's timers wake the loop through the selector's timeout, and ``epoll_wait`` takes whole milliseconds,
rounded up: ``asyncio.sleep(0.0001)`` returns after 1.1 ms (median of 200 on this project's CPU machine). A
poll loop that means to ask the engine every 100 µs therefore asked it every 1.1 ms, and noticed a write's end
up to a millisecond after a thread sleeping 100 µs would.

:class:`FineSleep` arms a Linux ``timerfd`` and lets the loop watch it like any socket: the selector wakes when
the timer fires, with the kernel's timer precision. Measured on the same machine: 100 µs sleeps returned after
128 µs (median), 300 µs after 349 µs, at 30-50 µs of the loop thread's CPU per sleep. Python 3.13 has
``os.timerfd_create``; on 3.11 and 3.12 the two libc calls are made through :mod:`ctypes` (a few µs, no lock,
no wait: arming a timer does not block). Where neither is available (not Linux), :func:`fine_sleep` falls back
to :func:`asyncio.sleep`.

One :class:`FineSleep` serves one task on one loop: a second sleep while one is pending is a programming error.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["FineSleep", "fine_sleep"]

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    """``timerfd_create`` and a one-shot ``timerfd_settime`` (relative, in ns), or None where libc lacks them."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    settime.restype = ctypes.c_int
    spec = _Itimerspec()
    value = spec.it_value
    ref = ctypes.byref(spec)

    def make() -> int:
        fd = int(create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return fd

    def arm(fd: int, ns: int) -> None:
        value.tv_sec, value.tv_nsec = divmod(ns, 1_000_000_000)
        if settime(fd, 0, ref, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return make, arm


def _os_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    create: Any = getattr(os, "timerfd_create", None)
    settime: Any = getattr(os, "timerfd_settime_ns", None)
    if create is None or settime is None:
        return None

    def make() -> int:
        return int(create(os.CLOCK_MONOTONIC, flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC))  # type: ignore[attr-defined]

    def arm(fd: int, ns: int) -> None:
        settime(fd, initial=ns)

    return make, arm


_TIMERFD = _os_timerfd() or _libc_timerfd()


class FineSleep:
    """A one-shot ``timerfd`` the loop watches: :meth:`sleep` arms it and awaits its firing."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if _TIMERFD is None:
            raise OSError("no timerfd on this platform")
        make, self._arm = _TIMERFD
        self._loop = loop
        self._fd: int | None = make()
        self._waiter: asyncio.Future[None] | None = None
        try:
            loop.add_reader(self._fd, self._fired)
        except BaseException:
            os.close(self._fd)
            raise

    def _fired(self) -> None:
        if self._fd is None:
            return
        try:
            os.read(self._fd, 8)  # the expiry count: reading it re-arms the descriptor's readiness
        except (BlockingIOError, InterruptedError):
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def sleep(self, seconds: float) -> None:
        """Return after ``seconds`` (at least 1 ns: a zero would disarm the timer)."""
        if self._fd is None:
            raise RuntimeError("FineSleep is closed")
        if self._waiter is not None:
            raise RuntimeError("FineSleep serves one sleeper at a time")
        self._waiter = waiter = self._loop.create_future()
        try:
            self._arm(self._fd, max(int(seconds * 1e9), 1))
            await waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._loop.remove_reader(fd)
        os.close(fd)


def fine_sleep(loop: asyncio.AbstractEventLoop, enabled: bool = True) -> tuple[Callable[[float], Any], Callable[[], None]]:
    """``(sleep, close)``: a :class:`FineSleep`'s where ``enabled`` and the platform has timerfd, else
    :func:`asyncio.sleep` (and a ``close`` that does nothing)."""
    if not enabled:
        return asyncio.sleep, lambda: None
    try:
        timer = FineSleep(loop)
    except (OSError, NotImplementedError):  # no timerfd, or a loop that cannot watch descriptors
        return asyncio.sleep, lambda: None
    return timer.sleep, timer.close
