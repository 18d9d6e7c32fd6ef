"""Accelerator device binding: set this rank's device before the engine exists, and on every executor
thread (device selection is per thread in CUDA and CANN).

Order, for a manager with ``config.device_id`` set: the offload executor is created with
:func:`device_initializer` as its thread initializer, so each executor thread runs
``set_device(device_id)`` when it starts, before any work item; the engine factory is the first work
item, so it runs on a thread whose device is already set. Every later executor thread binds the same
device. Without ``device_id`` nothing is bound.

A "backend" is any object with ``set_device(i)`` and ``is_available()``: ``torch.cuda`` and
``torch.npu`` (torch_npu) when present. :func:`use_backends` replaces them, for stacks with their own
device module and for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._config import TransferConfig
from ._deadline import Deadline
from .errors import InvalidArgument, TransferTimeout

__all__ = ["bind_device", "check_ready", "device_initializer", "use_backends", "wait_device_work"]

log = logging.getLogger("aiotransfer.device")

_override: list[Any] | None = None
_override_lock = threading.Lock()


def _available(mod: Any) -> bool:
    probe = getattr(mod, "is_available", None)
    return bool(probe()) if callable(probe) else False


def _backends() -> list[Any]:
    """The backends to bind: the :func:`use_backends` override if any, else torch.cuda and torch.npu when
    present and usable (torch is never required)."""
    if _override is not None:
        return list(_override)
    out: list[Any] = []
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return out
    for name in ("cuda", "npu"):
        mod = getattr(torch, name, None)
        if mod is not None and _available(mod):
            out.append(mod)
    return out


@contextlib.contextmanager
def use_backends(backends: Sequence[Any]) -> Iterator[None]:
    """Bind devices through ``backends`` instead of torch while the block runs (process-wide: it reaches
    managers and executor threads created inside the block, whose initializers read it at thread start)."""
    global _override
    with _override_lock:
        previous, _override = _override, list(backends)
    try:
        yield
    finally:
        with _override_lock:
            _override = previous


def bind_device(device_id: int | None, backends: Sequence[Any] | None = None) -> str | None:
    """Set ``device_id`` as the current device on this thread with the first available backend; returns
    that backend's name (None when there is nothing to bind or no backend is available)."""
    if device_id is None:
        return None
    for mod in _backends() if backends is None else backends:
        if not _available(mod):
            continue
        mod.set_device(device_id)
        name = str(getattr(mod, "__name__", type(mod).__name__))
        log.debug("device %d bound on thread %s via %s", device_id, threading.current_thread().name, name)
        return name
    return None


def device_initializer(
    config: TransferConfig, backends: Sequence[Any] | None = None
) -> Callable[[], None] | None:
    """An executor-thread initializer binding ``config.device_id`` (None when there is nothing to bind).

    With ``backends=None`` the backends are looked up when each thread starts (torch, or the
    :func:`use_backends` override in force then)."""
    if config.device_id is None:
        return None
    device_id = config.device_id
    chosen = None if backends is None else list(backends)

    def init() -> None:
        bind_device(device_id, chosen)

    return init


_READY_POLL_MIN = 20e-6
_READY_POLL_MAX = 1e-3
"""Polls of a device event back off from 20 µs to 1 ms: a layer's kernels are usually done within a few
hundred µs of being queued, and a poll costs the loop one non-blocking driver call."""


def check_ready(ready: Any, what: str) -> None:
    """Refuse a ``ready=`` that is neither None nor an object with a ``query()`` method."""
    if ready is not None and not callable(getattr(ready, "query", None)):
        raise InvalidArgument(f"{what}: ready= needs an object with a query() method (a CUDA event), "
                              f"got {type(ready).__name__}")


async def wait_device_work(ready: Any, deadline: Deadline, what: str) -> None:
    """Until ``ready.query()`` is true (a ``torch.cuda.Event`` recorded after the kernels that write the
    KV, or anything with that method), polling from the loop without ever blocking it; raises
    :class:`TransferTimeout` at ``deadline``. ``what`` names the work in the error."""
    check_ready(ready, what)
    query = ready.query
    interval = _READY_POLL_MIN
    while not query():
        if deadline.expired:
            raise TransferTimeout(f"{what}: the device work it waits for was not done within "
                                  f"{deadline.budget:.3g} s")
        await asyncio.sleep(min(interval, deadline.remaining()))
        interval = min(interval * 2, _READY_POLL_MAX)
