"""What the ``scale`` suite's processes share: the sizes, the parameters on the workers' command lines, the
byte pattern of a room, and the probes of a process (CPU, memory, descriptors, threads)."""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["DECODE_PAGES", "PAGE_BYTES", "PREFILL_PAGES", "Params", "page_value", "pct", "process_probe",
           "raise_fd_limit", "room_number"]

PAGE_BYTES = 4096
"""One room: one page of one buffer, 4 KiB."""
DECODE_PAGES = 4
"""Pages of a decode manager's one buffer: a few, so that a thousand managers stay small."""
PREFILL_PAGES = 64


@dataclass
class Params:
    """What a fleet process needs; serialised on its command line."""

    prefill: str = ""
    """The prefill's control endpoint."""
    host: str = "127.0.0.1"
    decode_config: dict[str, Any] = field(default_factory=dict)
    """``TransferConfig`` fields of every decode manager, beyond the suite's own."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Params:
        return cls(**json.loads(text))


def room_number(base: int, index: int, slot: int = 0) -> int:
    """Room ``slot`` (``< DECODE_PAGES``) of decode ``index`` in the batch of ``base`` (a multiple of
    ``DECODE_PAGES``); it lands in the decode's page ``slot``."""
    return base + index * DECODE_PAGES + slot


def page_value(room: int) -> int:
    """The byte that fills a room's page: the prefill's source page ``room % PREFILL_PAGES`` holds it."""
    return room % PREFILL_PAGES + 1


def pct(xs: Any, q: float) -> float | None:
    a = np.asarray(xs, dtype=np.float64)
    return round(float(np.percentile(a, q)), 4) if a.size else None


def raise_fd_limit() -> None:
    """The soft limit on descriptors up to the hard one: a process of a thousand managers needs thousands."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def process_probe() -> dict[str, Any]:
    """This process: CPU seconds (all threads), RSS (KiB), open descriptors, threads, and the wall clock."""
    rss = 0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
    return {"cpu_s": time.process_time(), "rss_kib": rss, "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")), "wall_s": time.perf_counter()}
