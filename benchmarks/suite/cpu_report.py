"""Tables of the ``cpu`` phase (:mod:`benchmarks.suite.cpu`): the library's CPU per call against the raw
engine's, and where the library's CPU of the largest ``send_kv`` goes. Pure functions of the results
dictionary, like :mod:`benchmarks.suite.report`."""

from __future__ import annotations

from typing import Any

from aiotransfer._cli import console

from .cpu_profile import CATEGORIES

__all__ = ["markdown", "table"]

_ORDER = ("mooncake_tcp", "nixl_shm", "nixl_tcp")
_LABELS = {"mooncake_tcp": "Mooncake TCP", "nixl_shm": "NIXL UCX shm", "nixl_tcp": "NIXL UCX tcp"}
_THREADS = ("loop", "driver", "offload")


def _cpus(res: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key in _ORDER:
        r = res.get("engines", {}).get(key, {}).get("phases", {}).get("cpu")
        if isinstance(r, dict) and not r.get("error") and r.get("calls"):
            out.append((key, r))
    return out


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _label(c: dict[str, Any], listed: bool = False) -> str:
    if c["call"] == "send_layers":
        return f"send_layers, 1 layer of {c['pages']:,}{' contiguous' if c.get('contiguous') else ''} pages"
    pages = f"{c['pages']:,} page{'s' if c['pages'] != 1 else ''}"
    return f"send_kv {pages}" + (", as a list" if listed else "")


def _row(label: str, lib: dict[str, Any], c: dict[str, Any], raw: dict[str, Any], cmp: dict[str, Any]) -> list[str]:
    ratio = f"{cmp['ratio']:.2f}" if cmp.get("ratio") is not None else "n/a"
    return [label, _n(c["entries"]), _n(lib["library_us"]), _n(raw["raw_us"]), _n(cmp["diff_us"]), ratio,
            " / ".join(_n(lib[f"{t}_us"]) for t in _THREADS), f"{_n(lib['wall_us'])} / {_n(raw['wall_us'])}",
            f"{_n(lib['native_us'])} / {_n(raw['native_us'])}", str(lib["n"])]


def _rows(res: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    figures = [["engine", "call", "entries", "library CPU", "raw CPU", "lib - raw", "lib / raw",
                "lib: loop / driver / offload", "wall lib / raw", "engine threads lib / raw", "n"]]
    where = [["engine", "call", "category", *(f"{t} (us)" for t in _THREADS), "total (us)", "share"]]
    for key, r in _cpus(res):
        label = _LABELS.get(key, key)
        for c in r["calls"].values():
            figures.append([label, *_row(_label(c), c["library"], c, c["raw"], c)])
            if "library_list" in c:
                figures.append([label, *_row(_label(c, True), c["library_list"], c, c["raw"], c["library_list"])])
        for bd in (r.get("breakdown"), r.get("layer_breakdown")):
            if not bd:
                continue
            th = bd["threads"]
            total = sum(bd["estimate_us"].values()) or 1.0
            for cat in CATEGORIES:
                per = [th[t]["shares"].get(cat, 0.0) * th[t]["unprofiled_us"] for t in _THREADS]
                if sum(per) < 0.5:
                    continue
                where.append([label, bd["call"], cat, *(_n(x) for x in per), _n(sum(per)),
                              f"{bd['estimate_us'][cat] / total:.0%}"])
    return figures, where


def _notes(res: dict[str, Any]) -> list[str]:
    """One line per engine on the pages given as a list."""
    out = []
    for key, r in _cpus(res):
        for c in r["calls"].values():
            ls = c.get("library_list")
            if ls and ls.get("conversion"):
                conv = ls["conversion"]
                out.append(f"{_LABELS.get(key, key)}: send_kv of {c['pages']:,} pages given as a list: "
                           f"{ls['list_minus_array_us']:+,.0f} us of library CPU against a NumPy array (medians); "
                           f"the conversion alone (as_index_array): {conv['list_us']:,.1f} us for the list, "
                           f"{conv['array_us']:,.1f} us for the array")
    return out


def _text(rows: list[list[str]]) -> list[str]:
    return console.table(rows).split("\n")


def _md(rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return lines + ["| " + " | ".join(r) + " |" for r in rows[1:]]


def _title(res: dict[str, Any]) -> str:
    r = _cpus(res)[0][1]
    return (f"Library CPU per call on the prefill side against the raw engine's, same entries, alternating (medians, "
            f"us; {r['buffers']} buffers, {r['page_bytes']:,}-byte pages, every other page on both sides; engine "
            f"threads counted on neither side)")


def table(res: dict[str, Any]) -> str:
    """The two tables as plain text; empty when no cpu phase ran."""
    if not _cpus(res):
        return ""
    figures, where = _rows(res)
    return console.wrap("\n".join([_title(res), *_text(figures), *_notes(res), "",
                                   "Where the library's CPU goes (one profiled call's shares x the unprofiled "
                                   "medians, us)", *_text(where)]))


def markdown(res: dict[str, Any]) -> str:
    """The same tables in Markdown; empty when no cpu phase ran."""
    if not _cpus(res):
        return ""
    figures, where = _rows(res)
    notes = _notes(res)
    return "\n".join([*_md(figures), *(["", *notes] if notes else []), "", *_md(where)])
