"""The ``scale`` suite's figures: per-peer slopes, the targets, the progress lines and the Markdown table."""

from __future__ import annotations

from typing import Any

import numpy as np

from aiotransfer._cli.console import table

__all__ = ["churn_line", "level_line", "markdown", "storm_line", "summary", "targets", "text"]

LAG_P99_MS, LAG_MAX_MS, CPU_RATIO, REG_RATIO = 20.0, 50.0, 1.2, 2.0
TARGET_PEERS, TARGET_CHURN, TARGET_ALIVE = 1000, 5000, 200


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``xs`` (None with fewer than two distinct x)."""
    if len(set(xs)) < 2:
        return None
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """What one peer costs the prefill (slopes over the levels, the fleet-less baseline included)."""
    points = [(0, res["baseline"])] + [(lv["peers"], lv["idle"]) for lv in res["levels"]]
    ns = [float(n) for n, _ in points]
    return {
        "rss_kib_per_peer": _r(_slope(ns, [p["rss_kib"] for _, p in points]), 1),
        "fds_per_peer": _r(_slope(ns, [p["fds"] for _, p in points])),
        "threads_per_peer": _r(_slope(ns, [p["threads"] for _, p in points])),
        "idle_process_cpu_ms_per_s_per_peer": _r(_slope(ns, [p["process_cpu_ms_per_s"] for _, p in points]), 4),
        "idle_loop_cpu_ms_per_s_per_peer": _r(_slope(ns, [p["loop_cpu_ms_per_s"] for _, p in points]), 4),
        **_decode_cost(res["levels"]),
    }


def _decode_cost(levels: list[dict[str, Any]]) -> dict[str, float | None]:
    """What one more decode manager costs its process, between the two largest levels (the first manager of a
    process also creates its native engine)."""
    if len(levels) < 2 or levels[-1]["peers"] == levels[-2]["peers"]:
        return {}
    a, b = levels[-2], levels[-1]
    dn = b["peers"] - a["peers"]
    da, db = a["idle"]["decode_processes"], b["idle"]["decode_processes"]
    return {f"decode_{k}_per_manager": _r((db[k] - da[k]) / dn, 1) for k in ("rss_kib", "fds", "threads")}


def _level_near(levels: list[dict[str, Any]], n: int) -> dict[str, Any] | None:
    return min(levels, key=lambda lv: (abs(lv["peers"] - n), lv["peers"])) if levels else None


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against what this run measured; ``at`` says at which size (the targets' own sizes
    are 1,000 peers and 5,000 endpoints with 200 alive)."""
    out: list[dict[str, Any]] = []
    levels = res["levels"]

    def row(name: str, value: str, ok: bool | None, at: str) -> None:
        out.append({"target": name, "value": value, "at": at,
                    "status": "n/a" if ok is None else ("PASS" if ok else "MISS")})

    top = levels[-1] if levels else None
    if top is not None:
        h = top["held"]
        at = f"N = {top['peers']}" + ("" if top["peers"] >= TARGET_PEERS else f" (target at {TARGET_PEERS:,})")
        row(f"held rooms: loop lag p99 <= {LAG_P99_MS:g} ms", f"{h['p99_ms']:.1f} ms",
            h["p99_ms"] is not None and h["p99_ms"] <= LAG_P99_MS, at)
        row(f"held rooms: loop lag max <= {LAG_MAX_MS:g} ms", f"{h['max_ms']:.1f} ms",
            h["max_ms"] is not None and h["max_ms"] <= LAG_MAX_MS, at)
        row("no room fails", f"{top['rooms_failed']} failed", top["rooms_failed"] == 0, at)
        ref = _level_near(levels, 8)
        if ref is not None and ref is not top:
            key = "loop_cpu_net_us" if "loop_cpu_net_us" in top["per_room"] else "loop_cpu_us"
            ratio = top["per_room"][key] / ref["per_room"][key]
            row(f"per-room loop CPU <= {CPU_RATIO:g}x that at N = {ref['peers']}", f"{ratio:.2f}x",
                ratio <= CPU_RATIO, at)
    c = res.get("churn")
    if c:
        at = f"{c['endpoints']:,} endpoints, {c['alive_at_once']} alive"
        row("churn: every endpoint accepted", f"{c['accepted']:,} of {c['endpoints']:,}",
            c["accepted"] == c["endpoints"], at)
        peak = c["registrations_peak"].get("registrations", c["registrations_peak"].get("decode_peers"))
        if peak is not None:
            row(f"churn: registrations held <= {REG_RATIO:g}x alive", f"{peak:,} held at most",
                peak <= REG_RATIO * c["alive_at_once"], at)
    return out


def level_line(lv: dict[str, Any]) -> str:
    i, pr, h = lv["idle"], lv["per_room"], lv["held"]
    return (f"N={lv['peers']}: idle {i['process_cpu_ms_per_s']:.1f} ms/s, RSS {i['rss_kib'] / 1024:.0f} MiB, "
            f"{i['fds']} fds; {pr['loop_cpu_us']:.0f} us loop CPU per room; held: lag p99 {h['p99_ms']:.1f} ms, "
            f"max {h['max_ms']:.1f} ms; {lv['rooms_failed']} failed")


def storm_line(s: dict[str, Any]) -> str:
    k, sv, nw = s["killed_rooms"], s["surviving_rooms"], s["new_decodes"]
    return (f"{k['failed']}/{k['rooms']} killed rooms failed (max {k['fail_after_gone_s']['max']} s after), "
            f"{sv['failed']} of {sv['rooms']} others failed, "
            f"{nw['failed']} of {nw['decodes']} new decodes' first rooms failed; "
            f"lag max {s['loop_lag']['max_ms']} ms")


def churn_line(c: dict[str, Any]) -> str:
    return (f"{c['accepted']} of {c['endpoints']} accepted, registrations at most {c['registrations_peak']} "
            f"({c['alive_at_once']} alive), {c['seconds']} s")


def _cell(x: Any) -> str:
    return "-" if x is None else f"{x:,}" if isinstance(x, int) else str(x)


HEADER = ("decodes", "idle CPU ms/s (loop)", "RSS MiB", "fds", "loop CPU/room us (net)", "held: lag p50/p99/max ms",
          "held: late waiting for CPU", "held: loop ms/s", "failed")


def _rows(res: dict[str, Any]) -> list[tuple[str, ...]]:
    b = res["baseline"]
    p = b["probed"]
    rows: list[tuple[str, ...]] = [("0", f"{b['process_cpu_ms_per_s']:.1f} ({b['loop_cpu_ms_per_s']:.1f})", f"{b['rss_kib'] / 1024:.1f}",
             str(b["fds"]), "-", f"({p['p50_ms']:.2f} / {p['p99_ms']:.1f} / {p['max_ms']:.1f})", _share(p),
             f"({p['loop_cpu_ms_per_s']:.0f})", "-")]
    for lv in res["levels"]:
        i, pr, h = lv["idle"], lv["per_room"], lv["held"]
        rows.append((f"{lv['peers']:,}", f"{i['process_cpu_ms_per_s']:.1f} ({i['loop_cpu_ms_per_s']:.1f})",
                     f"{i['rss_kib'] / 1024:.1f}", f"{i['fds']:,}", f"{pr['loop_cpu_us']:.0f} ({pr['loop_cpu_net_us']:.0f})",
                     f"{h['p50_ms']:.2f} / {h['p99_ms']:.1f} / {h['max_ms']:.1f}", _share(h),
                     f"{h['loop_cpu_ms_per_s']:.0f}", str(lv["rooms_failed"])))
    return rows


def _share(lag: dict[str, Any]) -> str:
    """The part of the late wake-ups' lag that the loop thread spent runnable, waiting for a CPU."""
    x = lag.get("late_runqueue_share")
    return "-" if x is None else f"{x:.0%}"


def text(res: dict[str, Any]) -> str:
    """The console's version of :func:`markdown`: the levels' table and the targets."""
    out = [table([HEADER, *_rows(res)])]
    if res["targets"]:
        out += ["", table([("target", "at", "measured", "status"),
                           *[(t["target"], t["at"], t["value"], t["status"]) for t in res["targets"]]])]
    return "\n".join(out)


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"`{res['command']}` ({res['timestamp']}; {m['cpus']} CPUs, load {m['load_avg_at_start'][0]:.1f} at "
             f"start, {m['load_avg_at_end'][0]:.1f} at end; {res['wall_s']} s)", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---:|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in _rows(res)]
    s = res["summary"]
    lines += ["", "Row 0: no decode yet; in brackets, the 1 ms lag probe alone (the held rooms' figures include "
                  "its own loop CPU). Late waiting for CPU: the part of the wake-ups' lag over 1 ms that the loop "
                  "thread spent runnable but off a CPU (the machine's other load, not the loop's work). Loop CPU per "
                  "room: the loop thread's CPU over rounds of rooms (one per decode, up to 4 where the fleet is "
                  "small) over the rooms; net: less the same commands to the fleet with no room, and less the "
                  "loop's idle CPU over the rest of the time."]
    lines += ["", f"Per peer: {_cell(s['rss_kib_per_peer'])} KiB of RSS, {_cell(s['fds_per_peer'])} descriptors, "
                  f"{_cell(s['threads_per_peer'])} threads, {_cell(s['idle_process_cpu_ms_per_s_per_peer'])} ms/s of "
                  "idle CPU on the prefill (slopes over the levels)."]
    st = res.get("storm")
    if st:
        k, sv, nw = st["killed_rooms"], st["surviving_rooms"], st["new_decodes"]
        lines += ["", f"Restart storm ({st['peers']} decodes, {st['decodes_killed']} killed with their "
                      f"{st['processes_killed']} processes): {k['failed']} of {k['rooms']} rooms on killed decodes "
                      f"failed, {_cell(k['fail_after_gone_s']['max'])} s at most after the processes were gone; "
                      f"{sv['failed']} of {sv['rooms']} rooms on the others failed; "
                      f"{nw['decodes'] - nw['failed']} of {nw['decodes']} new decodes' "
                      f"first rooms succeeded, {_cell(nw['first_room_after_up_s']['p50'])} s (median) to "
                      f"{_cell(nw['first_room_after_up_s']['max'])} s after they were up; the prefill's loop lag "
                      f"p99 {st['loop_lag']['p99_ms']} ms, max {st['loop_lag']['max_ms']} ms."]
    c = res.get("churn")
    if c:
        distinct = f" ({c['distinct_endpoints']:,} distinct)" if "distinct_endpoints" in c else ""
        lines += ["", f"Registration churn: {c['endpoints']:,} endpoints{distinct}, at most {c['alive_at_once']} alive: "
                      f"{c['accepted']:,} accepted, {c['failed']:,} failed; registrations held at most "
                      f"{c['registrations_peak']}, at the end {c['registrations_final']}; {c['seconds']} s."]
    lines += ["", "| target | at | measured | status |", "|---|---|---:|---|"]
    lines += [f"| {t['target']} | {t['at']} | {t['value']} | {t['status']} |" for t in res["targets"]]
    return "\n".join(lines)
