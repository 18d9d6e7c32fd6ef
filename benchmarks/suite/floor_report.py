"""Tables of the ``floor`` phase (:mod:`benchmarks.suite.floor`): the room against its floor, the room's
stages, and thread wake-ups per room. Pure functions of the results dictionary, like
:mod:`benchmarks.suite.report`."""

from __future__ import annotations

from typing import Any

from aiotransfer._cli import console

from . import budget

__all__ = ["markdown", "table", "verdicts"]

_ORDER = ("mooncake_tcp", "nixl_shm", "nixl_tcp")
_LABELS = {"mooncake_tcp": "Mooncake TCP", "nixl_shm": "NIXL UCX shm", "nixl_tcp": "NIXL UCX tcp"}


def _floors(res: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key in _ORDER:
        r = res.get("engines", {}).get(key, {}).get("phases", {}).get("floor")
        if isinstance(r, dict) and not r.get("error") and r.get("sizes"):
            out.append((key, r))
    return out


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 else f"{n // 1024} KiB"


def _us(s: dict[str, Any]) -> str:
    return f"{s['p50_us']:.0f} / {s['p90_us']:.0f}" if s.get("p50_us") is not None else "n/a"


def _rows(res: dict[str, Any]) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    figures = [["engine", "size", "ZMQ round trip p50 / p90 (us)", "raw write p50 / p90 (us)", "floor p50 (us)",
                "room p50 / p90 (us)", "room / floor, p50 (p90)", "ZMQ round trip with yield (us)",
                "room traced p50 (us)"]]
    columns = sorted({int(v["bytes"]) for _, r in _floors(res) for v in r["sizes"].values()})
    """The sizes the trace ran (``floor.SIZES`` of the run), one column each."""
    stages = [["engine", "stage", "where", *(_size(n) for n in columns), "budget (us)"]]
    threads = [["engine", "process", "thread", "voluntary / involuntary switches per room"]]
    for key, r in _floors(res):
        label = _LABELS.get(key, key)
        sizes = sorted(r["sizes"].values(), key=lambda v: v["bytes"])
        figures.extend([label, _size(v["bytes"]), _us(r["zmq_rtt"]), _us(v["raw"]), f"{v['floor_p50_us']:.0f}",
                        _us(v["room"]), f"{v['ratio_p50']:.2f} ({v['ratio_p90']:.2f})", _us(r["zmq_rtt_yield"]),
                        f"{v['room_traced']['p50_us']:.0f}"] for v in sizes)
        segs = [(row["from"], row["to"], row["where"]) for row in sizes[0]["stages"]["path"] + sizes[0]["stages"]["side"]]
        by_size = {str(v["bytes"]): {(row["from"], row["to"]): row for row in v["stages"]["path"] + v["stages"]["side"]}
                   for v in sizes}
        path_len = len(sizes[0]["stages"]["path"])
        for i, (a, b, where) in enumerate(segs):
            name = f"{a} -> {b}" + ("" if i < path_len else " (off the path)")
            cells = [_us(by_size[str(n)][(a, b)]) if str(n) in by_size else "-" for n in columns]
            cap = budget.budget_us((a, b), r, sizes[0]) if i < path_len else None
            stages.append([label, name, where, *cells, _budget((a, b), cap)])
        total = {str(v["bytes"]): _us(v["stages"]["total"]) for v in sizes}
        totals = [total.get(str(n), "-") for n in columns]
        stages.append([label, "total (start -> end)", "", *totals, ""])
        for side in ("decode", "prefill"):
            for name, (vol, inv) in sorted(r.get("switches_per_room", {}).get(side, {}).items()):
                threads.append([label, side, name, f"{vol:.2f} / {inv:.2f}"])
    return figures, stages, threads


def _budget(stage: tuple[str, str], cap: float | None) -> str:
    """A stage's budget as the table shows it: fixed for the library's own, from the run for the others (the
    engine write's at the smallest size; :func:`verdicts` checks each size against its own)."""
    if cap is None:
        return "-"
    return f"{cap:.0f}" if stage in budget.LIBRARY else f"{cap:.0f} (from the run)"


def verdicts(res: dict[str, Any]) -> list[str]:
    """``MISS`` or ``ok`` for every budgeted stage of every engine and size (:func:`budget.check`)."""
    return [v.line() for v in budget.check(res)]


def _text(rows: list[list[str]]) -> list[str]:
    return console.table(rows).split("\n")


def _md(rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return lines + ["| " + " | ".join(r) + " |" for r in rows[1:]]


def table(res: dict[str, Any]) -> str:
    """The three tables as plain text; empty when no floor phase ran."""
    if not _floors(res):
        return ""
    figures, stages, threads = _rows(res)
    gaps = sorted({float(r.get("gap_s", 0.001)) for _, r in _floors(res)})
    gap = "/".join(f"{g * 1e3:g}" for g in gaps)
    return console.wrap("\n".join([f"The floor of a small room (median / p90 in us; floor = ZMQ round trip + raw write, medians; "
                       f"{gap} ms idle before each repetition)",
                      *_text(figures), "", "Stages of the traced rooms (median / p90 in us)", *_text(stages), "",
                      f"Stage budget (p50; the library's own stages add up to {budget.LIBRARY_TOTAL_US:.0f} us)",
                      *verdicts(res), "",
                      "Thread wake-ups per room (untraced rooms, both processes)", *_text(threads)]))


def markdown(res: dict[str, Any]) -> str:
    """The same tables in Markdown; empty when no floor phase ran."""
    if not _floors(res):
        return ""
    figures, stages, threads = _rows(res)
    return "\n".join([*_md(figures), "", *_md(stages), "", "```", *verdicts(res), "```", "", *_md(threads)])
