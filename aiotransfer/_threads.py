"""``engine_threads="background"``: run the native engine's own threads under ``SCHED_IDLE`` (Linux).

A transfer engine moves bytes on threads of its own (Mooncake's TCP workers copy every byte through the
socket; UCX has progress threads). On a host with few cores those threads compete with the event loop for
CPU, and the loop's wake-ups wait behind them. Under ``SCHED_IDLE`` they get every cycle nobody else wants,
and any normal thread that becomes runnable (the event loop, ZMQ's I/O thread, your own threads) runs
first. The cost: when every core is busy with normal-priority work, the engine's threads get almost
nothing and transfers slow down. Only for engines whose threads sleep while idle (``quiet_threads``): a
thread that polls without pause while holding the engine's lock (UCX's progress thread under NIXL) would be
preempted with the lock held, and every call of ours would wait behind it; the manager declines there.

Which threads: those that appeared in this process after the first engine-owning manager started to create
its engine (``mark_foreign`` snapshot), except Python threads (the library's executor and waiter threads run
Python code and take the GIL: running them at idle priority could stall the loop behind them) and ZMQ's.
Threads that other native libraries start at the same time would be caught as well. A thread is moved only
once two sweeps in a row have seen it (see :func:`background_engine_threads`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["background_engine_threads", "mark_foreign", "supported", "thread_policy"]

log = logging.getLogger("aiotransfer.threads")

_TASKS = "/proc/self/task"
_foreign: set[int] | None = None
_pending: set[int] = set()
"""Candidates seen by the last call of :func:`background_engine_threads`, not moved yet."""
_lock = threading.Lock()


def supported() -> bool:
    """True where per-thread ``SCHED_IDLE`` exists (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "SCHED_IDLE") and os.path.isdir(_TASKS)


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except OSError:
        return set()


def mark_foreign() -> None:
    """Record the threads that exist before the first native engine is created (once per process)."""
    global _foreign
    with _lock:
        if _foreign is None and supported():
            _foreign = _thread_ids()


def _name(tid: int) -> str:
    try:
        with open(f"{_TASKS}/{tid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def thread_policy(tid: int) -> int | None:
    """The scheduling policy of thread ``tid`` of this process, or None if it is gone."""
    try:
        return os.sched_getscheduler(tid)
    except OSError:
        return None


def background_engine_threads() -> int:
    """Move the engine's native threads (see the module docstring) to ``SCHED_IDLE``; returns how many moved
    now. Cheap enough to call periodically (one directory listing and a few small reads).

    A thread moves only once two calls in a row have seen it as a candidate: a thread that was just created
    may not carry its name yet (ZMQ names its threads from inside them) or may not be registered as a
    Python thread yet; by the next call it is.
    """
    global _pending
    if not supported() or _foreign is None:
        return 0
    candidates = set()
    for tid in _thread_ids() - _foreign:
        if thread_policy(tid) in (None, os.SCHED_IDLE) or _name(tid).startswith("ZMQbg"):
            continue
        candidates.add(tid)
    candidates -= _python_threads()  # listed after the directory: a thread registered meanwhile is excluded
    with _lock:
        ready = candidates & _pending
        _pending = candidates - ready
    return sum(_to_idle(tid) for tid in ready - _python_threads())


def _python_threads() -> set[int]:
    """Threads started by Python's ``threading`` (not native threads that merely called into Python)."""
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def _to_idle(tid: int) -> bool:
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # gone meanwhile, or not permitted
        log.debug("thread %d stays at its priority: %s", tid, exc)
        return False
    return True
