"""The stage budget of a small room: what each stage of the ``floor`` phase's traced rooms may take (p50, µs).

The library's own stages have fixed budgets that add up to the 120 µs its work on a room's path may take
(decode ``start -> request_send``, prefill ``request_in -> submitted``, decode ``status_in -> done``). The
stages that hold a ZeroMQ leg or the engine's write are budgeted from what the same run measured without
the library: half the plain ZeroMQ round trip per leg, and the raw engine write, each plus a small margin
for the dispatch on the far side. :func:`check` compares a run's medians with the budget and says ``MISS``
for every stage over it. A benchmark's verdict, never a timed test: the figures move with the machine's load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LIBRARY", "LIBRARY_TOTAL_US", "Verdict", "budget_us", "check"]

LIBRARY: dict[tuple[str, str], float] = {
    ("start", "request_send"): 25.0,
    ("request_in", "ready"): 15.0,
    ("ready", "planned"): 25.0,
    ("planned", "submitted"): 40.0,
    ("status_in", "done"): 15.0,
}
"""The library's own stages on a room's path, µs at the median."""
LIBRARY_TOTAL_US = sum(LIBRARY.values())
"""120 µs: the library's whole share of a room's path."""
LEG_MARGIN_US = 40.0
"""Over half the plain ZeroMQ round trip, per leg: the far side's dispatch."""
WRITE_MARGIN_US = 30.0
"""Over the raw engine write: the poll loop noticing that it ended."""
_LEGS = {("request_send", "request_in"), ("engine_done", "status_in")}
_WRITE = ("submitted", "engine_done")


def budget_us(stage: tuple[str, str], floor: dict[str, Any], size: dict[str, Any]) -> float | None:
    """The budget of ``stage`` in a run's ``floor`` result at one of its sizes, or None (not budgeted)."""
    if stage in LIBRARY:
        return LIBRARY[stage]
    if stage in _LEGS:
        return float(floor["zmq_rtt"]["p50_us"]) / 2 + LEG_MARGIN_US
    if stage == _WRITE:
        return float(size["raw"]["p50_us"]) + WRITE_MARGIN_US
    return None


@dataclass(frozen=True)
class Verdict:
    engine: str
    size: int
    stage: str
    p50_us: float
    budget_us: float

    @property
    def miss(self) -> bool:
        return self.p50_us > self.budget_us

    def line(self) -> str:
        word = "MISS" if self.miss else "ok"
        return (f"{word:4}  {self.engine:13} {self.size // 1024:>5} KiB  {self.stage:32} "
                f"{self.p50_us:7.0f} us  budget {self.budget_us:5.0f} us")


def check(res: dict[str, Any]) -> list[Verdict]:
    """Every budgeted stage of every engine and size of a run, and the library's stages added up."""
    out = []
    for engine, er in sorted(res.get("engines", {}).items()):
        floor = er.get("phases", {}).get("floor")
        if not isinstance(floor, dict) or floor.get("error") or not floor.get("sizes"):
            continue
        for size in sorted(floor["sizes"].values(), key=lambda v: v["bytes"]):
            library = 0.0
            for row in size["stages"]["path"]:
                stage = (row["from"], row["to"])
                budget = budget_us(stage, floor, size)
                if budget is None or row.get("p50_us") is None:
                    continue
                out.append(Verdict(engine, int(size["bytes"]), f"{stage[0]} -> {stage[1]}", float(row["p50_us"]), budget))
                if stage in LIBRARY:
                    library += float(row["p50_us"])
            out.append(Verdict(engine, int(size["bytes"]), "library's own stages, added", library, LIBRARY_TOTAL_US))
    return out
