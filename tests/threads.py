"""Scheduling policy of every thread of this process, for the engine_threads tests."""

from __future__ import annotations

import os
import threading
from typing import Any


def thread_policies() -> list[dict[str, Any]]:
    python = {t.native_id for t in threading.enumerate()}
    out = []
    for t in sorted(int(x) for x in os.listdir("/proc/self/task")):
        try:
            policy = os.sched_getscheduler(t)
            with open(f"/proc/self/task/{t}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        out.append({"tid": t, "name": name, "idle": policy == os.SCHED_IDLE, "python": t in python,
                    "main": t == threading.main_thread().native_id})
    return out
