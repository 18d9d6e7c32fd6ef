"""Where the library's CPU time of one call goes: the call run under :mod:`cProfile` on every thread that works
for it (the event loop's, the engine's driver, the offload executor's), each profiler timed by its own
thread's CPU clock (so a thread waiting for work costs nothing), and each function's own time put into one of
a few categories.

A function of the library has its category by module (and for a few modules by name); any other function
(NumPy, asyncio, builtins) takes the categories of the functions that called it, in proportion to the time
spent under each caller, up the call graph. Calls into the engine's package (Mooncake's binding, NIXL's Python
API and bindings) are the category ``engine calls``. The profiler's own switching on and off (the harness) is
kept apart and left out of the shares.

cProfile adds a fixed cost to every Python call, so code that makes many small calls looks more expensive than
it is: shares are indicative, and the phase reports them next to the unprofiled CPU time of the same call.
"""

from __future__ import annotations

import cProfile
import pstats
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["CATEGORIES", "categorize", "profile_call"]

PLANNING = "checks and planning"
POSTING = "descriptors and posting"
ENGINE = "engine calls"
COMPLETION = "completion handling"
LIBRARY = "other library"
ROOT = "event loop and thread hand-offs"
HARNESS = "harness"
CATEGORIES = (PLANNING, POSTING, ENGINE, COMPLETION, LIBRARY, ROOT)
"""The categories of the library's time (:data:`HARNESS` is not the library's)."""

_COMPLETION_ENGINE = frozenset({"check", "_terminal", "_release", "abandon", "ensure_pending", "finish", "consumed",
                                "_forget_if_idle"})
_POSTING_POLLER = frozenset({"write", "_submit", "_adopt", "_track", "_credits_for", "try_acquire", "acquire",
                             "_ensure_started"})
_COMPLETION_SENDER = frozenset({"_finish", "_maybe_conclude", "_succeed", "_conclude_on_completion", "update",
                                "_changed", "_extras_delivered"})
_RULES: tuple[tuple[str, frozenset[str] | None, str], ...] = (
    ("_cli/", None, HARNESS),  # the raw-engine drivers and channels the benchmarks share with the CLI
    ("engines/", _COMPLETION_ENGINE, COMPLETION),
    ("engines/", None, POSTING),
    ("_poller.py", _POSTING_POLLER, POSTING),
    ("_poller.py", None, COMPLETION),
    ("_driver.py", None, ROOT),
    ("_offload.py", None, ROOT),
    ("_plan.py", frozenset({"split_blocks"}), POSTING),
    ("_plan.py", None, PLANNING),
    ("_staging.py", None, PLANNING),
    ("_sender.py", _COMPLETION_SENDER, COMPLETION),
    ("_sender.py", None, PLANNING),
    ("_stream.py", None, PLANNING),
    ("_kv/push.py", None, PLANNING),
    ("_kv/notify.py", None, COMPLETION),
    ("_control/", None, COMPLETION),
)
"""(module path under ``aiotransfer/``, function names or None for all, category), first match wins."""
_NATIVE = ("mooncake", "nixl", "transfer_submit_write", "transfer_check_status", "batch_transfer")
"""A builtin whose description names one of these is the engine's."""

Key = tuple[str, int, str]


def _own(key: Key) -> str | None:
    """The category of a function by where it lives; None for code that is neither the library's nor the
    engine's (its callers decide)."""
    file, _, func = key
    if file == "~":
        return ENGINE if any(n in func for n in _NATIVE) else None
    path = file.replace("\\", "/")
    if "/benchmarks/" in path:
        return HARNESS
    if "/aiotransfer/" not in path:
        return ENGINE if ("/nixl" in path or "/mooncake" in path) else None
    mod = path.rsplit("/aiotransfer/", 1)[1]
    for prefix, names, category in _RULES:
        if mod.startswith(prefix) and (names is None or func in names):
            return category
    return LIBRARY


def _name(key: Key) -> str:
    file, line, func = key
    if file == "~":
        return func
    path = file.replace("\\", "/")
    for cut in ("/aiotransfer/", "/site-packages/", "/lib/python"):
        if cut in path:
            path = path.rsplit(cut, 1)[1]
            break
    return f"{path}:{line}({func})"


def categorize(stats: dict[Key, Any], top: int = 12) -> dict[str, Any]:
    """``stats``: :attr:`pstats.Stats.stats`. Seconds per category, and the ``top`` functions by own time."""
    memo: dict[Key, dict[str, float]] = {}

    def share(key: Key, seen: frozenset[Key]) -> dict[str, float]:
        own = _own(key)
        if own is not None:
            return {own: 1.0}
        if key in memo:
            return memo[key]
        callers = stats[key][4] if key in stats else {}
        weights = {c: float(v[2]) for c, v in callers.items()}
        total = sum(weights.values())
        if not total:
            weights = {c: float(v[0]) for c, v in callers.items()}
            total = sum(weights.values())
        out: dict[str, float] = {}
        if key in seen or not total:
            out = {ROOT: 1.0}
        else:
            for caller, w in weights.items():
                for category, f in share(caller, seen | {key}).items():
                    out[category] = out.get(category, 0.0) + f * w / total
        memo[key] = out
        return out

    seconds = dict.fromkeys((*CATEGORIES, HARNESS), 0.0)
    rows = []
    for key, (_, _, tt, _, _) in stats.items():
        if tt <= 0:
            continue
        parts = share(key, frozenset())
        for category, f in parts.items():
            seconds[category] += tt * f
        rows.append((tt, _name(key), max(parts, key=lambda c: parts[c])))
    rows.sort(reverse=True)
    return {"seconds": seconds, "top": [[name, round(tt * 1e3, 3), cat] for tt, name, cat in rows[:top]]}


async def profile_call(mgr: Any, run: Callable[[], Awaitable[None]], timeout: float = 30.0) -> dict[str, Any]:
    """Run ``run()`` (one call of ``mgr``) with a CPU-time profiler on the loop's thread, the engine's driver
    thread and every offload thread of ``mgr`` (:meth:`~aiotransfer.KVManager.run_on_worker_threads`); the
    categories of each thread's time. An offload thread's profile also holds its wait at the hook's barrier
    while the other threads stop theirs: time off its CPU clock, so it costs nothing in the figures."""
    on: dict[int, tuple[str, cProfile.Profile]] = {}

    def start(where: str) -> None:
        prof = cProfile.Profile(time.thread_time)
        on[threading.get_ident()] = (where, prof)
        prof.enable()

    def stop(where: str = "loop") -> None:
        on[threading.get_ident()][1].disable()

    await mgr.run_on_worker_threads(start, timeout=timeout)
    start("loop")
    try:
        await run()
    finally:
        stop()
        await mgr.run_on_worker_threads(stop, timeout=timeout)
    by_thread: dict[str, list[cProfile.Profile]] = {"loop": [], "driver": [], "offload": []}
    for where, prof in on.values():
        if prof.getstats():
            by_thread[where].append(prof)
    out: dict[str, Any] = {}
    for where, profs in by_thread.items():
        cats: dict[str, Any] = (categorize(pstats.Stats(*profs).stats) if profs  # type: ignore[attr-defined]
                                else {"seconds": dict.fromkeys((*CATEGORIES, HARNESS), 0.0), "top": []})
        out[where] = {"cpu_ms": round(sum(cats["seconds"][c] for c in CATEGORIES) * 1e3, 3), **cats}
    return out
