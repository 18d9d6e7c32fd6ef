"""Figures, targets, table and plots of ``python -m benchmarks full``.

Pure functions of the results dictionary written by :mod:`benchmarks.suite`, so a saved JSON can
be re-plotted (``--replot results.json``) without running anything. Plotting imports matplotlib lazily
(Agg backend); everything else needs only the standard library.
"""

from __future__ import annotations

import math
import os
from typing import Any

from aiotransfer._cli import console

__all__ = ["derive", "evaluate", "plot_all", "table"]

MIB = 1024 * 1024
ENGINE_ORDER = ("mooncake_tcp", "nixl_shm", "nixl_tcp")
LABELS = {"mooncake_tcp": "Mooncake TCP", "nixl_shm": "NIXL UCX shm", "nixl_tcp": "NIXL UCX tcp"}
COLORS = {"mooncake_tcp": "tab:blue", "nixl_shm": "tab:orange", "nixl_tcp": "tab:green"}
TARGET_ENGINES = ("mooncake_tcp", "nixl_shm")
"""Engines the targets are evaluated on (NIXL over UCX tcp is reported, not targeted)."""


def _phase(res: dict[str, Any], engine: str, phase: str) -> dict[str, Any] | None:
    e = res.get("engines", {}).get(engine)
    if not e:
        return None
    r = e.get("phases", {}).get(phase)
    if not isinstance(r, dict) or r.get("error"):
        return None
    return r


def _engines(res: dict[str, Any]) -> list[str]:
    return [k for k in ENGINE_ORDER if k in res.get("engines", {})]


def _ceiling(res: dict[str, Any], kind: str, nbytes: int) -> float | None:
    """Seconds for ``nbytes`` by memcpy / tcp: measured at that size, else scaled from the largest size."""
    c = (res.get("ceilings") or {}).get(kind)
    if not c:
        return None
    if str(nbytes) in c:
        return float(c[str(nbytes)]["median_s"])
    big = max(c, key=int)
    return float(c[big]["median_s"]) * nbytes / int(big)


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# ----------------------------------------------------------------------------------------------------
# derived figures
# ----------------------------------------------------------------------------------------------------
def derive(res: dict[str, Any]) -> dict[str, Any]:
    """One compact record per figure (what the plots and the table use)."""
    figs: dict[str, Any] = {}
    thr: dict[str, Any] = {}
    for e in _engines(res):
        r = _phase(res, e, "throughput")
        if r:
            thr[e] = [{
                "bytes": v["bytes"],
                "aiotransfer_gbps": v["aiotransfer"]["gbps"],
                "raw_gbps": v["raw"][v["raw_best"]]["gbps"],
                "raw_same_call_gbps": v["raw"][v["raw_same_call"]]["gbps"],
                "ratio": v["ratio"],
                "ratio_same_call": v["ratio_same_call"],
            } for v in sorted(r["sizes"].values(), key=lambda v: v["bytes"])]
    c = res.get("ceilings") or {}
    figs["throughput"] = {
        "engines": thr,
        "memcpy_gbps": {k: v["gbps"] for k, v in (c.get("memcpy") or {}).items()},
        "tcp_gbps": {k: v["gbps"] for k, v in (c.get("tcp") or {}).items()},
    }
    sc: dict[str, Any] = {}
    for e in _engines(res):
        r = _phase(res, e, "scattered")
        if r:
            sc[e] = {
                "pages": r["pages"], "bytes": r["bytes"],
                "aiotransfer_ms": r["aiotransfer"]["median_s"] * 1e3,
                "aiotransfer_entries": r["aiotransfer"]["entries"],
                "raw_pages_ms": r["raw_pages"]["median_s"] * 1e3,
                "raw_pages_entries": r["raw_pages"]["entries"],
                "raw_us_per_entry": r["raw_pages"]["us_per_entry"],
                "raw_contiguous_ms": r["raw_contiguous"]["median_s"] * 1e3,
                "speedup_vs_pages": r["speedup_vs_pages"],
                "ratio_vs_contiguous": r["ratio_vs_contiguous"],
                "planning": r.get("planning", {}),
                "memcpy_ms": (_ceiling(res, "memcpy", r["bytes"]) or math.nan) * 1e3,
                "tcp_ms": (_ceiling(res, "tcp", r["bytes"]) or math.nan) * 1e3,
            }
    figs["scattered"] = sc
    lag: dict[str, Any] = {}
    for e in _engines(res):
        r = _phase(res, e, "lag")
        if r:
            lag[e] = {k: {x: r[k].get(x) for x in ("p50_ms", "p99_ms", "max_ms", "samples", "gbps", "loop_cpu_share",
                                                  "runqueue_ms_per_s", "late_runqueue_share", "steal_ms_per_s",
                                                  "late_steal_share", "worst")}
                      for k in ("idle", "aiotransfer", "raw_thread")}
            lag[e]["requests"] = r["requests"]
            lag[e]["in_flight"] = r["in_flight"]
            lag[e]["request_bytes"] = r["request_bytes"]
    figs["loop_lag"] = lag
    conc: dict[str, Any] = {}
    for e in _engines(res):
        r = _phase(res, e, "concurrency")
        if r:
            rows = []
            for v in sorted(r["levels"].values(), key=lambda v: v["in_flight"]):
                a, w = v["aiotransfer"], v["raw"]
                rows.append({"in_flight": v["in_flight"], "requests": v["requests"],
                             "aiotransfer_gbps": a["gbps"], "raw_gbps": w["gbps"],
                             "aiotransfer_p50_us": a["latency"]["p50_us"], "aiotransfer_p99_us": a["latency"]["p99_us"],
                             "raw_p50_us": w["latency"]["p50_us"], "raw_p99_us": w["latency"]["p99_us"],
                             "aiotransfer_cpu_us": a.get("cpu_us_per_request"), "raw_cpu_us": w.get("cpu_us_per_request"),
                             "failed": a["failed"]})
            conc[e] = {"request_bytes": r["request_bytes"], "levels": rows}
    figs["concurrency"] = conc
    lat: dict[str, Any] = {}
    for e in _engines(res):
        r = _phase(res, e, "e2e")
        if r:
            lat[e] = {"e2e": r["aiotransfer"]["e2e"], "send_kv": r["aiotransfer"]["send_kv"],
                      "raw": {k: r["raw"][k] for k in ("p50_us", "p99_us", "n")},
                      "failed": r["aiotransfer"]["failed"], "clock_consistent": r["clock"]["consistent"]}
    figs["latency_4k"] = {"engines": lat, "tcp_rtt_4k": (c.get("tcp_rtt_4k") or {})}
    aux: dict[str, Any] = {}
    for e in _engines(res):
        r = _phase(res, e, "aux")
        if r:
            aux[e] = {x: {"e2e": v["e2e"], "send_aux_call": v["send_aux_call"], "paths_used": v["paths_used"],
                          "failed": v["failed"], "bad_aux_slots": v["bad_aux_slots"]}
                      for x, v in r["paths"].items()}
    figs["aux"] = aux
    tp: dict[str, Any] = {}
    for e in _engines(res):
        r = _phase(res, e, "tp")
        if r:
            g = r["geometry"]
            modes = {m: {"ms": v["median_s"] * 1e3, "gbps": v["gbps"], "entries": v["entries"],
                         "staged_pieces": v["staged_pieces"], "reps": v["reps"]} for m, v in r["modes"].items()}
            rec: dict[str, Any] = {"geometry": g, "modes": modes, "speedup": r.get("speedup_always_vs_never")}
            if "raw_contiguous" in r:
                rec["raw_contiguous_ms"] = r["raw_contiguous"]["median_s"] * 1e3
                rec["raw_contiguous_entries"] = r["raw_contiguous"]["entries"]
            sc_e = sc.get(e)
            if sc_e and "never" in modes:
                rec["raw_per_token_ms_extrapolated"] = modes["never"]["entries"] * sc_e["raw_us_per_entry"] / 1e3
            rec["memcpy_ms"] = (_ceiling(res, "memcpy", g["bytes"]) or math.nan) * 1e3
            rec["tcp_ms"] = (_ceiling(res, "tcp", g["bytes"]) or math.nan) * 1e3
            tp[e] = rec
    figs["tp"] = tp
    eng: dict[str, Any] = {}
    for e in _engines(res):
        rec = {}
        r = _phase(res, e, "throughput")
        if r and str(64 * MIB) in r["sizes"]:
            v = r["sizes"][str(64 * MIB)]
            rec["contiguous_64MiB"] = {"aiotransfer_gbps": v["aiotransfer"]["gbps"],
                                       "raw_gbps": v["raw"][v["raw_best"]]["gbps"], "ratio": v["ratio"]}
        s = sc.get(e)
        if s:
            rec["scattered"] = {"aiotransfer_ms": s["aiotransfer_ms"], "raw_pages_ms": s["raw_pages_ms"],
                                "raw_contiguous_ms": s["raw_contiguous_ms"],
                                "ratio_vs_raw_pages": s["speedup_vs_pages"],
                                "ratio_vs_raw_contiguous": s["ratio_vs_contiguous"]}
        d = (res["engines"][e].get("describe") or {}).get("prefill") or {}
        rec["transport"] = d.get("transport")
        eng[e] = rec
    figs["engines"] = eng
    return figs


# ----------------------------------------------------------------------------------------------------
# targets
# ----------------------------------------------------------------------------------------------------
def _row(fig: str, engine: str, metric: str, value: float | None, fmt: str, target: str,
         ok: bool | None) -> dict[str, Any]:
    shown = "n/a" if value is None else fmt.format(value)
    status = "INFO" if ok is None and target == "-" else ("n/a" if value is None else ("PASS" if ok else "MISS"))
    return {"figure": fig, "engine": engine, "metric": metric, "value": value, "shown": shown, "target": target,
            "status": status}


def evaluate(res: dict[str, Any]) -> list[dict[str, Any]]:
    figs = res.get("figures") or derive(res)
    rows: list[dict[str, Any]] = []
    for e, pts in figs["throughput"]["engines"].items():
        big = [p for p in pts if p["bytes"] >= 64 * MIB]
        small = min(pts, key=lambda p: p["bytes"])
        rows.append(_row("1 throughput", e, f"aiotransfer/raw at {small['bytes'] // 1024} KiB (per-request overhead)",
                         small["ratio"], "{:.2f}", "-", None))
        if not big:
            continue
        worst = min(big, key=lambda p: p["ratio"])
        target = e in TARGET_ENGINES
        rows.append(_row("1 throughput", e, f"aiotransfer/raw, >=64 MiB (worst: {worst['bytes'] // MIB} MiB)",
                         worst["ratio"], "{:.2f}", ">= 0.95" if target else "-",
                         worst["ratio"] >= 0.95 if target else None))
    for e, s in figs["scattered"].items():
        target = e == "mooncake_tcp"
        n = f"{s['pages']:,} x 4 KiB"
        rows.append(_row("2 scattered", e, f"{n}: speedup vs raw page-by-page", s["speedup_vs_pages"], "{:.1f}x",
                         ">= 8x" if target else "-", s["speedup_vs_pages"] >= 8 if target else None))
        rows.append(_row("2 scattered", e, f"{n}: vs raw contiguous single write", s["ratio_vs_contiguous"],
                         "{:.2f}", ">= 0.60" if target else "-", s["ratio_vs_contiguous"] >= 0.6 if target else None))
        ceiling = s["raw_pages_ms"] / s["raw_contiguous_ms"]
        rows.append(_row("2 scattered", e, f"(ceiling: raw contiguous vs raw page-by-page; "
                         f"{s['raw_us_per_entry']:.1f} us/entry)", ceiling, "{:.1f}x", "-", None))
        pl = s.get("planning") or {}
        if pl.get("plan_kv_us") is not None:
            rows.append(_row("2 scattered", e, "planning: plan_transfer direct / auto (us)", pl["plan_kv_us"],
                             "{:.0f} / " + f"{pl.get('staging_plan_us', float('nan')):.0f}", "-", None))
    for e, lag in figs["loop_lag"].items():
        a = lag["aiotransfer"]
        target = e in TARGET_ENGINES
        rows.append(_row("3 loop lag", e, "p99 while saturating (ms)", _num(a["p99_ms"]), "{:.2f}",
                         "<= 1 ms" if target else "-", (a["p99_ms"] or 1e9) <= 1.0 if target else None))
        rows.append(_row("3 loop lag", e, "max while saturating (ms)", _num(a["max_ms"]), "{:.2f}",
                         "<= 10 ms" if target else "-", (a["max_ms"] or 1e9) <= 10.0 if target else None))
        r = lag["raw_thread"]
        rows.append(_row("3 loop lag", e, "raw engine on a thread: p99 / max (ms)", _num(r["p99_ms"]),
                         "{:.2f} / " + f"{r['max_ms']:.2f}", "-", None))
        if a.get("late_runqueue_share") is not None:
            raw_share = _num(r.get("late_runqueue_share"))
            rows.append(_row("3 loop lag", e, "wake-ups > 1 ms late: share waiting for a CPU (raw thread)",
                             _num(a["late_runqueue_share"]),
                             "{:.2f} (" + ("n/a" if raw_share is None else f"{raw_share:.2f}") + ")", "-", None))
        w = a.get("worst")
        if w:
            rows.append(_row("3 loop lag", e, "worst wake-up: ms late / run-queue wait ms / hypervisor steal ms",
                             _num(w["overshoot_ms"]),
                             "{:.1f} / " + f"{w['runqueue_ms']:.1f} / {w['steal_ms']:.0f}", "-", None))
        if a.get("loop_cpu_share") is not None:
            rows.append(_row("3 loop lag", e, "loop thread CPU / run-queue wait / steal (ms per s)",
                             _num(a["loop_cpu_share"]), "{:.2f} / " + f"{a.get('runqueue_ms_per_s', 0):.0f} / "
                             f"{a.get('steal_ms_per_s', 0):.1f}", "-", None))
    for e, cc in figs["concurrency"].items():
        lv = cc["levels"]
        one = next((x for x in lv if x["in_flight"] == 1), None)
        top = max(lv, key=lambda x: x["in_flight"])
        target = e in TARGET_ENGINES
        if one and top["in_flight"] > 1:
            ratio = top["aiotransfer_gbps"] / one["aiotransfer_gbps"]
            rows.append(_row("4 concurrency", e, f"{top['in_flight']} in flight / 1 in flight (aggregate GB/s)", ratio,
                             "{:.2f}", ">= 0.90" if target else "-", ratio >= 0.9 if target else None))
        if one and top["in_flight"] > 1 and one["raw_gbps"]:
            rows.append(_row("4 concurrency", e, f"{top['in_flight']} in flight vs raw engine, 1 in flight",
                             top["aiotransfer_gbps"] / one["raw_gbps"], "{:.2f}", "-", None))
        for x in lv:
            if x["in_flight"] > 1 and x["raw_gbps"]:
                lib_us, raw_us = x.get("aiotransfer_cpu_us"), x.get("raw_cpu_us")
                extra = ("" if lib_us is None or raw_us is None
                         else f" (CPU per request: library {lib_us:.0f} us, raw {raw_us:.0f} us)")
                rows.append(_row("4 concurrency", e, f"{x['in_flight']} in flight vs raw engine, {x['in_flight']} in "
                                 "flight", x["aiotransfer_gbps"] / x["raw_gbps"], "{:.2f}" + extra, "-", None))
        failed = sum(x["failed"] for x in lv)
        rows.append(_row("4 concurrency", e, "failed requests (all levels)", float(failed), "{:.0f}", "0",
                         failed == 0))
    for e, v in figs["latency_4k"]["engines"].items():
        p50 = _num(v["e2e"]["p50_us"])
        target = e in TARGET_ENGINES
        rows.append(_row("5 4 KiB e2e", e, "p50 send_kv -> done on both sides (us)", p50, "{:.0f}",
                         "<= 400 us" if target else "-", (p50 or 1e9) <= 400 if target else None))
        rows.append(_row("5 4 KiB e2e", e, "p99 (us)", _num(v["e2e"]["p99_us"]), "{:.0f}", "-", None))
    for e, paths in figs["aux"].items():
        for path, v in paths.items():
            rows.append(_row("6 send_aux", e, f"path={path}: e2e p50 / p99 (us)", _num(v["e2e"]["p50_us"]),
                             "{:.0f} / " + f"{v['e2e']['p99_us']:.0f}", "-", None))
    for e, t in figs["tp"].items():
        for m, v in t["modes"].items():
            rows.append(_row("7 TP 4->2", e, f"staging={m}: time (ms), entries", v["ms"],
                             "{:.0f} ms, " + f"{v['entries']:,} entries", "-", None))
        if t.get("speedup") is not None:
            rows.append(_row("7 TP 4->2", e, "staging always vs never: speedup", t["speedup"], "{:.1f}x", "-", None))
    for e, v in figs["engines"].items():
        c, s = v.get("contiguous_64MiB"), v.get("scattered")
        if c:
            rows.append(_row("8 engines", e, "64 MiB contiguous: aiotransfer/raw", c["ratio"],
                             "{:.2f} " + f"({c['aiotransfer_gbps']:.2f} vs {c['raw_gbps']:.2f} GB/s)", "-", None))
        if s:
            rows.append(_row("8 engines", e, "scattered: aiotransfer vs raw page-by-page / vs raw contiguous",
                             s["ratio_vs_raw_pages"], "{:.1f}x / " + f"{s['ratio_vs_raw_contiguous']:.2f}", "-", None))
    for e in _engines(res):
        cpu = _phase(res, e, "cpu")
        for c in (cpu or {}).get("calls", {}).values():
            pages = f"{c['pages']:,} page{'s' if c['pages'] != 1 else ''}"
            what = f"send_kv {pages}" if c["call"] == "send_kv" else f"send_layers, 1 layer of {pages}"
            rows.append(_row("9 library CPU", e, f"{what} ({c['entries']:,} entries): library / raw CPU per call",
                             _num(c["ratio"]), "{:.2f} " + f"({c['library']['library_us']:,.0f} vs "
                             f"{c['raw']['raw_us']:,.0f} us)", "-", None))
    for e, eres in res.get("engines", {}).items():
        if eres.get("error"):
            rows.append({"figure": "-", "engine": e, "metric": f"engine pair failed: {eres['error']}"[:160],
                         "value": None, "shown": "-", "target": "-", "status": "ERROR"})
        for ph, r in eres.get("phases", {}).items():
            if isinstance(r, dict) and r.get("error"):
                rows.append({"figure": ph, "engine": e, "metric": f"phase failed: {r['error']}"[:160], "value": None,
                             "shown": "-", "target": "-", "status": "ERROR"})
    return rows


def table(res: dict[str, Any]) -> str:
    rows = res.get("targets") or evaluate(res)
    head = ("figure", "engine", "metric", "value", "target", "status")
    cells = [head] + [(r["figure"], LABELS.get(r["engine"], r["engine"]), r["metric"], r["shown"], r["target"],
                       r["status"]) for r in rows]
    lines = [console.table(cells)]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "MISS", "ERROR")}
    lines.append(f"{counts['PASS']} PASS, {counts['MISS']} MISS, {counts['ERROR']} ERROR; medians of "
                 f"{res.get('params', {}).get('repeats')} repeats (more for small sizes); machine noise +-20 %; "
                 f"load average (1/5/15 min) at start {_load(res, 'start')}, at end {_load(res, 'end')}; "
                 f"wall {res.get('wall_s')} s")
    return console.wrap("\n".join(lines))


def _load(res: dict[str, Any], when: str) -> str:
    la = res.get("machine", {}).get(f"load_avg_at_{when}")
    return "/".join(f"{x:.1f}" for x in la) if la else "n/a"


def markdown_table(res: dict[str, Any]) -> str:
    rows = res.get("targets") or evaluate(res)
    out = ["| figure | engine | metric | value | target | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        status = {"PASS": "**PASS**", "MISS": "**MISS**"}.get(r["status"], r["status"])
        metric = r["metric"].replace("_", "\\_").replace("|", "/")
        out.append(f"| {r['figure']} | {LABELS.get(r['engine'], r['engine'])} | {metric} | {r['shown']} | "
                   f"{r['target'].replace('>=', '≥').replace('<=', '≤')} | {status} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------
# plots
# ----------------------------------------------------------------------------------------------------
def _size_label(n: float) -> str:
    if n >= MIB:
        return f"{n / MIB:g} MiB"
    return f"{n / 1024:g} KiB"


def plot_all(res: dict[str, Any], img_dir: str) -> list[str]:
    """Write every plot that has data to ``img_dir``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(img_dir, exist_ok=True)
    figs = res.get("figures") or derive(res)
    written: list[str] = []
    stamp = (f"{res.get('timestamp', '')}  {res.get('machine', {}).get('cpus')} CPUs  "
             f"{'quick' if res.get('quick') else 'full'} run  (medians; +-20 % machine noise)")

    def save(fig: Any, name: str, bottom: float = 0.02) -> None:
        fig.text(0.99, 0.005, stamp, ha="right", va="bottom", fontsize=7, color="grey")
        fig.tight_layout(rect=(0, bottom, 1, 1))
        path = os.path.join(img_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def ceiling_lines(ax: Any, data: dict[str, float], label: str, style: str) -> None:
        if data:
            xs = sorted(int(k) for k in data)
            ax.plot(xs, [data[str(x)] for x in xs], style, color="grey", label=label, linewidth=1.2)

    # 1. throughput vs size
    t = figs["throughput"]
    if t["engines"]:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
        for e, pts in t["engines"].items():
            xs = [p["bytes"] for p in pts]
            a1.plot(xs, [p["aiotransfer_gbps"] for p in pts], "o-", color=COLORS[e], label=f"{LABELS[e]} aiotransfer")
            a1.plot(xs, [p["raw_gbps"] for p in pts], "s--", color=COLORS[e], alpha=0.6, label=f"{LABELS[e]} raw")
            a2.plot(xs, [p["ratio"] for p in pts], "o-", color=COLORS[e], label=LABELS[e])
        ceiling_lines(a1, t["memcpy_gbps"], "memcpy (numpy copy)", ":")
        ceiling_lines(a1, t["tcp_gbps"], "loopback TCP (Python sockets)", "-.")
        a1.set(xscale="log", yscale="log", xlabel="request size (contiguous, one entry)", ylabel="GB/s",
               title="Throughput vs request size")
        a2.axhline(0.95, color="red", linestyle="--", linewidth=1, label="target 0.95 (>= 64 MiB)")
        a2.axvspan(64 * MIB, max(max(p["bytes"] for p in pts) for pts in t["engines"].values()) * 1.5,
                   color="red", alpha=0.05)
        a2.axhline(1.0, color="grey", linewidth=0.8)
        a2.set(xscale="log", xlabel="request size", ylabel="aiotransfer / raw (same run)",
               title="aiotransfer relative to its own raw engine")
        for ax in (a1, a2):
            ticks = sorted({p["bytes"] for pts in t["engines"].values() for p in pts})
            ax.set_xticks(ticks)
            ax.set_xticklabels([_size_label(x) for x in ticks], rotation=30)
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
        a1.legend(fontsize=7, loc="lower right")
        a2.legend(fontsize=8)
        save(fig, "bench-throughput.png")

    # 2. scattered vs contiguous
    sc = figs["scattered"]
    if sc:
        fig, ax = plt.subplots(figsize=(11, 1.2 + 1.6 * len(sc)))
        labels, vals, colors = [], [], []
        for e, s in sc.items():
            for lab, v, col in (
                (f"{LABELS[e]}: raw page-by-page ({s['raw_pages_entries']:,} entries)", s["raw_pages_ms"], "lightgrey"),
                (f"{LABELS[e]}: aiotransfer, staging auto ({s['aiotransfer_entries']} "
                 f"entr{'y' if s['aiotransfer_entries'] == 1 else 'ies'})", s["aiotransfer_ms"], COLORS[e]),
                (f"{LABELS[e]}: raw one contiguous write (ceiling)", s["raw_contiguous_ms"], "dimgrey"),
            ):
                labels.append(lab)
                vals.append(v)
                colors.append(col)
        any_s = next(iter(sc.values()))
        for lab, v in ((f"loopback TCP, same bytes ({any_s['bytes'] / 1e6:.1f} MB)", any_s["tcp_ms"]),
                       ("memcpy, same bytes", any_s["memcpy_ms"])):
            if math.isfinite(v):
                labels.append(lab)
                vals.append(v)
                colors.append("white")
        y = list(range(len(labels)))[::-1]
        ax.barh(y, vals, color=colors, edgecolor="black", linewidth=0.6)
        for yy, v in zip(y, vals, strict=True):
            ax.text(v * 1.05, yy, f"{v:.1f} ms", va="center", fontsize=8)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(right=max(vals) * 4)
        ax.set_xlabel("time (ms, log scale; lower is better)")
        notes = []
        for e, s in sc.items():
            pl = s.get("planning") or {}
            notes.append(f"{LABELS[e]}: {s['speedup_vs_pages']:.1f}x vs page-by-page, "
                         f"{s['ratio_vs_contiguous']:.2f}x contiguous; planning: direct "
                         f"{pl.get('plan_kv_us', float('nan')):.0f} us, auto "
                         f"{pl.get('staging_plan_us', float('nan')):.0f} us, gather {pl.get('gather_ms', float('nan')):.1f} ms")
        ax.set_title(f"{any_s['pages']:,} x 4 KiB pages scattered at random on both sides\n"
                     "(targets, Mooncake: >= 8x faster than page-by-page, >= 0.6x the contiguous write)", fontsize=10)
        fig.text(0.01, 0.03, "\n".join(notes), fontsize=7, va="bottom")
        save(fig, "bench-scattered.png", bottom=0.04 + 0.12 * len(notes) / (1.2 + 1.6 * len(sc)))

    # 3. loop-lag CDF
    lag_res: dict[str, dict[str, Any]] = {}
    for e in _engines(res):
        r = _phase(res, e, "lag")
        if r:
            lag_res[e] = r
    if lag_res:
        fig, ax = plt.subplots(figsize=(9, 4.8))
        first = True
        for e, r in lag_res.items():
            for key, style, lab in (("aiotransfer", "-", "aiotransfer saturating"),
                                    ("raw_thread", "--", "raw engine on a thread"), ("idle", ":", "idle")):
                if key == "idle" and not first:
                    continue
                xs = sorted(r[key]["samples_ms"])
                if not xs:
                    continue
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                color = "black" if key == "idle" else COLORS[e]
                name = lab if key == "idle" else f"{LABELS[e]}: {lab} (p99 {r[key]['p99_ms']:.2f}, max {r[key]['max_ms']:.1f} ms)"
                ax.plot([max(x, 1e-3) for x in xs], ys, style, color=color, label=name)
            first = False
        ax.axvline(1.0, color="red", linestyle="--", linewidth=1, label="targets: p99 <= 1 ms, max <= 10 ms")
        ax.axvline(10.0, color="red", linestyle=":", linewidth=1)
        ax.axhline(0.99, color="grey", linewidth=0.6)
        ax.set(xscale="log", xlabel="event-loop lag: overshoot of a 1 ms sleep (ms)", ylabel="fraction of wake-ups",
               title="Prefill event-loop lag (CDF) while the engine is saturated", ylim=(0, 1.01))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        save(fig, "bench-loop-lag.png")

    # 4. concurrency
    cc = figs["concurrency"]
    if cc:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
        size = next(iter(cc.values()))["request_bytes"]
        for e, v in cc.items():
            xs = [x["in_flight"] for x in v["levels"]]
            a1.plot(xs, [x["aiotransfer_gbps"] for x in v["levels"]], "o-", color=COLORS[e],
                    label=f"{LABELS[e]} aiotransfer")
            a1.plot(xs, [x["raw_gbps"] for x in v["levels"]], "s--", color=COLORS[e], alpha=0.6,
                    label=f"{LABELS[e]} raw")
            a2.plot(xs, [x["aiotransfer_p50_us"] / 1e3 for x in v["levels"]], "o-", color=COLORS[e],
                    label=f"{LABELS[e]} aiotransfer p50")
            a2.plot(xs, [x["aiotransfer_p99_us"] / 1e3 for x in v["levels"]], "^:", color=COLORS[e],
                    label=f"{LABELS[e]} aiotransfer p99")
            a2.plot(xs, [x["raw_p50_us"] / 1e3 for x in v["levels"]], "s--", color=COLORS[e], alpha=0.5,
                    label=f"{LABELS[e]} raw p50")
        for kind, style, lab in (("tcp", "-.", "loopback TCP, one stream"), ("memcpy", ":", "memcpy")):
            s = _ceiling(res, kind, size)
            if s:
                a1.axhline(size / s / 1e9, color="grey", linestyle=style, label=f"{lab} ({_size_label(size)})")
        a1.set(xscale="log", yscale="log", xlabel="requests in flight", ylabel="aggregate GB/s",
               title=f"Aggregate throughput, {_size_label(size)} requests")
        a2.set(xscale="log", yscale="log", xlabel="requests in flight", ylabel="latency per request (ms)",
               title="Latency under concurrency")
        for ax in (a1, a2):
            ticks = sorted({x["in_flight"] for v in cc.values() for x in v["levels"]})
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(x) for x in ticks])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        save(fig, "bench-concurrency.png")

    # 5. 4 KiB end to end
    lt = figs["latency_4k"]
    if lt["engines"]:
        fig, ax = plt.subplots(figsize=(9, 4.4))
        labels, p50, p99 = [], [], []
        for e, v in lt["engines"].items():
            labels.append(f"{LABELS[e]}\naiotransfer e2e")
            p50.append(v["e2e"]["p50_us"])
            p99.append(v["e2e"]["p99_us"])
            labels.append(f"{LABELS[e]}\nraw write only")
            p50.append(v["raw"]["p50_us"])
            p99.append(v["raw"]["p99_us"])
        if lt["tcp_rtt_4k"].get("p50_us"):
            labels.append("loopback TCP\n4 KiB + ack")
            p50.append(lt["tcp_rtt_4k"]["p50_us"])
            p99.append(lt["tcp_rtt_4k"]["p99_us"])
        xs = list(range(len(labels)))
        ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50", color="tab:blue")
        ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99", color="tab:grey")
        for x, a, b in zip(xs, p50, p99, strict=True):
            ax.text(x - 0.2, a, f"{a:.0f}", ha="center", va="bottom", fontsize=7)
            ax.text(x + 0.2, b, f"{b:.0f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(400, color="red", linestyle="--", linewidth=1, label="target p50 <= 400 us (e2e)")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set(ylabel="microseconds", yscale="log",
               title="4 KiB request: send_kv -> done() on both sides (CLOCK_MONOTONIC, two processes)")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        save(fig, "bench-latency-4k.png")

    # 6. aux by path
    ax_data = figs["aux"]
    if ax_data:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        labels, p50, p99 = [], [], []
        for e, paths in ax_data.items():
            for path, v in paths.items():
                labels.append(f"{LABELS[e]}\naux_path={path}")
                p50.append(v["e2e"]["p50_us"])
                p99.append(v["e2e"]["p99_us"])
        xs = list(range(len(labels)))
        ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50", color="tab:purple")
        ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99", color="tab:grey")
        for x, a, b in zip(xs, p50, p99, strict=True):
            ax.text(x - 0.2, a, f"{a:.0f}", ha="center", va="bottom", fontsize=7)
            ax.text(x + 0.2, b, f"{b:.0f}", ha="center", va="bottom", fontsize=7)
        tcp = lt.get("tcp_rtt_4k", {}).get("p50_us")
        if tcp:
            ax.axhline(tcp, color="grey", linestyle="-.", linewidth=1, label=f"loopback TCP 4 KiB + ack p50 ({tcp:.0f} us)")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set(ylabel="microseconds (log scale)", yscale="log",
               title="send_aux (one slot): start -> decode done(), by path")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        save(fig, "bench-aux.png")

    # 7. TP 4 -> 2
    tp = figs["tp"]
    if tp:
        e, v = next(iter(tp.items()))
        g = v["geometry"]
        items: list[tuple[str, float, str]] = []
        if "never" in v["modes"]:
            m = v["modes"]["never"]
            items.append((f"aiotransfer staging=never\n({m['entries']:,} entries)", m["ms"], "lightgrey"))
        if v.get("raw_per_token_ms_extrapolated"):
            items.append(("raw, one entry per token\n(extrapolated: per-entry cost of fig. 2)",
                          v["raw_per_token_ms_extrapolated"], "white"))
        if "always" in v["modes"]:
            m = v["modes"]["always"]
            items.append((f"aiotransfer staging=always\n({m['entries']:,} entries)", m["ms"], COLORS[e]))
        if v.get("raw_contiguous_ms"):
            items.append((f"raw, same bytes contiguous\n({v['raw_contiguous_entries']} entries: ceiling)",
                          v["raw_contiguous_ms"], "dimgrey"))
        for lab, key in (("loopback TCP, same bytes", "tcp_ms"), ("memcpy, same bytes", "memcpy_ms")):
            if math.isfinite(v.get(key, math.nan)):
                items.append((lab, v[key], "white"))
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(items)))
        y = list(range(len(items)))[::-1]
        ax.barh(y, [i[1] for i in items], color=[i[2] for i in items], edgecolor="black", linewidth=0.6)
        for yy, (_lab, val, _c) in zip(y, items, strict=True):
            ax.text(val * 1.05, yy, f"{val:,.0f} ms", va="center", fontsize=8)
        ax.set_yticks(y)
        ax.set_yticklabels([i[0] for i in items], fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(right=max(i[1] for i in items) * 4)
        ax.set_xlabel("time for the request (ms, log scale)")
        ax.set_title(f"TP {g['prefill_tp']} -> {g['decode_tp']} head-sliced, {g['tokens']:,} tokens, {g['layers']} "
                     f"layers x K/V, {g['kv_heads']} KV heads x {g['head_dim']} x 2 B ({g['bytes'] / 2**20:.0f} MiB), "
                     f"{LABELS[e]}", fontsize=9)
        save(fig, "bench-tp.png")

    # 8. engines
    eng = {e: v for e, v in figs["engines"].items() if v.get("contiguous_64MiB") or v.get("scattered")}
    if eng:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4))
        keys = list(eng)
        xs = list(range(len(keys)))
        c_ratio = [(eng[k].get("contiguous_64MiB") or {}).get("ratio", math.nan) for k in keys]
        s_ratio = [(eng[k].get("scattered") or {}).get("ratio_vs_raw_contiguous", math.nan) for k in keys]
        a1.bar([x - 0.2 for x in xs], c_ratio, 0.4, label="64 MiB contiguous: aiotransfer / raw single write",
               color=[COLORS[k] for k in keys], edgecolor="black")
        a1.bar([x + 0.2 for x in xs], s_ratio, 0.4, label="scattered: aiotransfer / raw contiguous ceiling",
               color=[COLORS[k] for k in keys], edgecolor="black", hatch="//", alpha=0.6)
        for x, a, b in zip(xs, c_ratio, s_ratio, strict=True):
            for dx, val in ((-0.2, a), (0.2, b)):
                if math.isfinite(val):
                    a1.text(x + dx, val, f"{val:.2f}", ha="center", va="bottom", fontsize=8)
        a1.axhline(1.0, color="grey", linewidth=0.8)
        a1.set_xticks(xs)
        a1.set_xticklabels([LABELS[k] for k in keys])
        a1.set(ylabel="ratio to its own raw engine (same run)", title="aiotransfer / raw, per engine")
        a1.legend(fontsize=7)
        sp = [(eng[k].get("scattered") or {}).get("ratio_vs_raw_pages", math.nan) for k in keys]
        a2.bar(xs, sp, 0.5, color=[COLORS[k] for k in keys], edgecolor="black")
        for x, val in zip(xs, sp, strict=True):
            if math.isfinite(val):
                a2.text(x, val, f"{val:.1f}x", ha="center", va="bottom", fontsize=8)
        a2.set_xticks(xs)
        a2.set_xticklabels([LABELS[k] for k in keys])
        n = next((v["scattered"] for v in eng.values() if v.get("scattered")), None)
        a2.set(ylabel="speedup", title="scattered 4 KiB pages: aiotransfer vs raw page-by-page" if n else "")
        for ax in (a1, a2):
            ax.grid(True, axis="y", alpha=0.3)
        save(fig, "bench-engines.png")
    return written

