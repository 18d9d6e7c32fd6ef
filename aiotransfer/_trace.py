"""Opt-in timestamps along a room's path: where the time of one room goes, stage by stage.

Off by default: :data:`recorder` is None, and every mark on the path is written
``_trace.recorder is None or _trace.mark(room, "stage")``, one global load and one comparison when off.
:func:`start` installs a process-wide :class:`Recorder`; :func:`stop` removes it and returns it.

A mark is ``(room, stage, t_ns)`` with ``t_ns`` from :func:`time.perf_counter_ns`: ``CLOCK_MONOTONIC`` on
Linux, one clock for every process of the machine, so the marks of a prefill and a decode on the same
host can be subtracted from each other. Marks are taken on the event loop's thread.

The stages marked by the library, in the order a room meets them (``bench --suite full --phases floor``
adds ``start``, ``ready`` and ``end`` around the calls it makes):

* decode ``request_send`` / ``request_sent``: ``send_metadata`` hands the transfer request to the control
  plane / the hand-off returned;
* prefill ``request_in``: the request is dispatched (``on_request``);
* prefill ``planned``: a direct write's engine entries are built (``write_kv``);
* prefill ``submitted``: the engine submission returned (the poll loop's ``write``);
* prefill ``engine_done``: the poll loop sees the write complete (``_finish``);
* prefill ``success_out``: ``Success`` was handed to the control plane (the sender concludes);
* decode ``status_in``: the status is dispatched (``on_status``);
* decode ``done``: ``done()`` returns.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Mark", "Recorder", "completed", "mark", "recorder", "start", "stop", "submitted"]

Mark = tuple[int, str, int]
"""``(room, stage, t_ns)``."""


class Recorder:
    """The marks taken since it was installed; at most ``limit`` (later ones are counted in ``dropped``)."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self.limit = limit
        self.marks: list[Mark] = []
        self.dropped = 0
        self._handles: dict[Any, int] = {}
        """Engine handle -> room, from its submission until the poll loop sees it complete."""

    def add(self, room: int, stage: str, t_ns: int) -> None:
        if len(self.marks) < self.limit:
            self.marks.append((room, stage, t_ns))
        else:
            self.dropped += 1

    def take(self) -> list[Mark]:
        """The marks so far; the recorder starts over."""
        out, self.marks = self.marks, []
        return out


recorder: Recorder | None = None
"""The process-wide recorder; None (the default) turns every mark into a no-op."""


def start(limit: int = 1_000_000) -> Recorder:
    """Install a fresh recorder for this process and return it."""
    global recorder
    recorder = Recorder(limit)
    return recorder


def stop() -> Recorder | None:
    """Remove the recorder (marks are no-ops again) and return it with what it holds."""
    global recorder
    rec, recorder = recorder, None
    return rec


def mark(room: int, stage: str) -> bool:
    """Record that ``room`` reached ``stage`` now; True when a recorder took it."""
    rec = recorder
    if rec is None:
        return False
    rec.add(room, stage, time.perf_counter_ns())
    return True


def submitted(handle: object, guard: object) -> bool:
    """An engine submission of the room ``guard`` stands for (its ledger) returned ``handle``; True when
    marked (a write that belongs to no room is not)."""
    rec = recorder
    room = getattr(guard, "room", None)
    if rec is None or not isinstance(room, int):
        return False
    rec._handles[handle] = room
    rec.add(room, "submitted", time.perf_counter_ns())
    return True


def completed(handle: object) -> bool:
    """The poll loop sees ``handle`` terminal: marked for the room that submitted it (True), once."""
    rec = recorder
    room = None if rec is None else rec._handles.pop(handle, None)
    if rec is None or room is None:
        return False
    rec.add(room, "engine_done", time.perf_counter_ns())
    return True
