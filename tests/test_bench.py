"""``python -m benchmarks full``: a tiny configuration end to end (JSON keys, PNGs, lines within 100
columns, engine logs in their own file), the re-plot path, and the pure pieces (targets, byte patterns)
in-process."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiotransfer._cli.console import WIDTH
from aiotransfer._cli.workload import KVPool
from benchmarks.suite import report
from benchmarks.suite.common import (
    ALL_PHASES,
    ENGINES,
    OPT_IN_PHASES,
    aux_pattern,
    make_params,
    tp_bad_pages,
    tp_fill,
)
from tests.conftest import nixl_available

ROOT = Path(__file__).resolve().parent.parent
PLOTS = {"bench-throughput.png", "bench-scattered.png", "bench-loop-lag.png", "bench-concurrency.png",
         "bench-latency-4k.png", "bench-aux.png", "bench-tp.png", "bench-engines.png"}
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)
"""A glog line (Mooncake's own log)."""
FIGURES = {"throughput", "scattered", "loop_lag", "concurrency", "latency_4k", "aux", "tp", "engines"}


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    return subprocess.run([sys.executable, "-m", "benchmarks", "full", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    d = tmp_path_factory.mktemp("bench")
    proc = _bench("--tiny", "--out", str(d / "full.json"), "--img-dir", str(d / "img"), timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(len(line) <= WIDTH for line in (proc.stdout + proc.stderr).splitlines()), proc.stdout
    assert f"engine and worker logs: {d / 'full.log'}" in proc.stderr
    assert not GLOG.search(proc.stdout + proc.stderr) and (d / "full.log").exists()  # engine logs: in the file
    return d, json.loads((d / "full.json").read_text()), proc.stdout


@pytest.mark.timeout(300)
def test_full_suite_tiny_writes_json_and_plots(tiny_run: tuple[Path, dict[str, Any], str]) -> None:
    d, res, stdout = tiny_run
    assert {"suite", "params", "machine", "ceilings", "engines", "figures", "targets", "images"} <= set(res)
    assert res["suite"] == "full" and res["params"]["scale"] == "tiny"
    expected = {"mooncake_tcp"} | ({"nixl_shm", "nixl_tcp"} if nixl_available() else set())
    assert set(res["engines"]) == expected
    for key, eng in res["engines"].items():
        assert set(eng["phases"]) == set(ENGINES[key].phases) - set(OPT_IN_PHASES), key  # opt-in phases: when named
        for phase, r in eng["phases"].items():
            assert "error" not in r, (key, phase, r.get("error"))
    if nixl_available():
        assert res["engines"]["nixl_tcp"]["ucx_tls"] == "tcp"
        assert res["engines"]["nixl_shm"]["ucx_tls"] is None
    c = res["ceilings"]
    assert c["measured_by"] == "mooncake_tcp"
    for kind in ("memcpy", "tcp"):
        assert all(v["gbps"] > 0 for v in c[kind].values())
    assert c["tcp_rtt_4k"]["p50_us"] > 0

    assert set(res["figures"]) == FIGURES
    mc = res["engines"]["mooncake_tcp"]["phases"]
    for point in mc["throughput"]["sizes"].values():
        assert point["ratio"] > 0 and point["raw_best"] in point["raw"] and point["failed"] == 0
    sc = mc["scattered"]
    assert sc["aiotransfer"]["staged_pieces"] >= 1 and sc["raw_pages"]["entries"] == sc["pages"]
    assert sc["planning"]["staged"] is True and sc["planning"]["plan_kv_us"] > 0
    lag = mc["lag"]
    assert lag["aiotransfer"]["samples"] == len(lag["aiotransfer"]["samples_ms"]) > 0
    assert lag["raw_thread"]["samples"] > 0 and lag["aiotransfer"]["failed"] == 0
    assert all(v["aiotransfer"]["failed"] == 0 for v in mc["concurrency"]["levels"].values())
    assert all(v["aiotransfer"]["cpu_us_per_request"] > 0 and v["raw"]["cpu_us_per_request"] > 0
               for v in mc["concurrency"]["levels"].values())
    assert mc["e2e"]["clock"]["consistent"] is True and mc["e2e"]["aiotransfer"]["failed"] == 0
    assert {"engine", "tcp"} == set(mc["aux"]["paths"])
    for path, v in mc["aux"]["paths"].items():
        assert v["paths_used"] == [path] and v["bad_aux_slots"] == 0 and v["failed"] == 0
    tp = mc["tp"]
    assert tp["modes"]["never"]["entries"] > tp["modes"]["always"]["entries"] >= 1
    assert tp["modes"]["always"]["staged_pieces"] >= 1 and tp["modes"]["never"]["staged_pieces"] == 0
    assert tp["raw_contiguous"]["entries"] == 4 * 2 * tp["geometry"]["layers"]

    statuses = {r["status"] for r in res["targets"]}
    assert statuses <= {"PASS", "MISS", "INFO", "n/a"}
    assert {r["figure"] for r in res["targets"]} >= {"1 throughput", "2 scattered", "3 loop lag", "4 concurrency",
                                                      "5 4 KiB e2e", "6 send_aux", "7 TP 4->2", "8 engines"}
    img = d / "img"
    assert {p.name for p in img.iterdir()} == PLOTS
    for p in img.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    assert "status" in stdout and ("PASS" in stdout or "MISS" in stdout)


@pytest.mark.timeout(300)
def test_replot_from_saved_json(tiny_run: tuple[Path, dict[str, Any], str], tmp_path: Path) -> None:
    d, res, _ = tiny_run
    proc = _bench("--replot", str(d / "full.json"), "--img-dir", str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in tmp_path.iterdir()} == PLOTS
    assert json.loads((d / "full.json").read_text())["wall_s"] == res["wall_s"]  # not rewritten


def test_unknown_engine_or_phase_is_a_usage_error(tmp_path: Path) -> None:
    for args in (("--engines", "bogus"), ("--phases", "nope")):
        proc = _bench(*args, "--out", str(tmp_path / "x.json"), "--img-dir", "", timeout=60)
        assert proc.returncode == 2
        assert "phases are" in proc.stderr
    assert not (tmp_path / "x.json").exists()


# ----------------------------------------------------------------------------------------------------
# pure pieces
# ----------------------------------------------------------------------------------------------------
def _synthetic(ratio: float, speedup: float, p99: float, conc: float, p50: float) -> dict[str, Any]:
    gb = 64 * 2**20
    timing = {"median_s": 0.01, "gbps": 1.0, "times_s": [0.01]}
    sizes = {str(gb): {"bytes": gb, "aiotransfer": {**timing, "gbps": ratio}, "raw": {"s": timing},
                       "raw_best": "s", "raw_same_call": "s", "ratio": ratio, "ratio_same_call": ratio, "failed": 0}}
    lagrec = {"p50_ms": 0.1, "p99_ms": p99, "max_ms": 2.0, "samples": 10, "samples_ms": [0.1] * 10, "gbps": 1.0}
    level = {"aiotransfer": {"gbps": 1.0, "latency": {"p50_us": 1.0, "p99_us": 2.0}, "failed": 0, "seconds": 1},
             "raw": {"gbps": 1.0, "latency": {"p50_us": 1.0, "p99_us": 2.0}, "seconds": 1}}
    top = copy.deepcopy(level)
    top["aiotransfer"]["gbps"] = conc
    return {"engines": {"mooncake_tcp": {"phases": {
        "throughput": {"sizes": sizes},
        "scattered": {"pages": 100, "bytes": 409600, "aiotransfer": {"median_s": 0.01, "entries": 1},
                      "raw_pages": {"median_s": 0.01 * speedup, "entries": 100, "us_per_entry": 30.0},
                      "raw_contiguous": {"median_s": 0.006}, "speedup_vs_pages": speedup,
                      "ratio_vs_contiguous": 0.6, "planning": {"plan_kv_us": 5.0, "staging_plan_us": 1.0}},
        "lag": {"idle": lagrec, "aiotransfer": lagrec, "raw_thread": lagrec, "requests": 1, "in_flight": 1,
                "request_bytes": 1},
        "concurrency": {"request_bytes": 1, "levels": {"1": {"in_flight": 1, "requests": 2, **level},
                                                       "256": {"in_flight": 256, "requests": 512, **top}}},
        "e2e": {"aiotransfer": {"e2e": {"p50_us": p50, "p99_us": 2 * p50}, "send_kv": {}, "failed": 0},
                "raw": {"p50_us": 50.0, "p99_us": 90.0, "n": 10}, "clock": {"consistent": True}},
    }}}}


@pytest.mark.parametrize(("ratio", "speedup", "p99", "conc", "p50", "want"), [
    (0.96, 8.5, 0.9, 0.95, 390.0, "PASS"),
    (0.94, 7.5, 1.1, 0.85, 410.0, "MISS"),
])
def test_targets_pass_and_miss(ratio: float, speedup: float, p99: float, conc: float, p50: float,
                               want: str) -> None:
    res = _synthetic(ratio, speedup, p99, conc, p50)
    res["figures"] = report.derive(res)
    rows = {(r["figure"], r["metric"].split(" (")[0].split(":")[-1].strip()): r["status"] for r in report.evaluate(res)}
    assert rows[("1 throughput", "aiotransfer/raw, >=64 MiB")] == want
    assert rows[("2 scattered", "speedup vs raw page-by-page")] == want
    assert rows[("2 scattered", "vs raw contiguous single write")] == "PASS"  # 0.6 is the bound, inclusive
    assert rows[("3 loop lag", "p99 while saturating")] == want
    assert rows[("3 loop lag", "max while saturating")] == "PASS"
    assert rows[("4 concurrency", "256 in flight / 1 in flight")] == want
    assert rows[("4 concurrency", "failed requests")] == "PASS"
    assert rows[("5 4 KiB e2e", "p50 send_kv -> done on both sides")] == want
    text = report.table(res)
    assert want in text and "status" in text.splitlines()[0]
    assert "| figure |" in report.markdown_table(res)


def test_requests_in_flight_against_raw_at_the_same_depth() -> None:
    """Each depth above one is compared with the raw engine at that depth, with the CPU each spent per request
    where the run measured it (results saved before it was measured still evaluate)."""
    res = _synthetic(0.96, 8.5, 0.9, 0.4, 390.0)
    top = res["engines"]["mooncake_tcp"]["phases"]["concurrency"]["levels"]["256"]
    top["raw"]["gbps"] = 2.0
    rows = {r["metric"]: r for r in report.evaluate({**res, "figures": report.derive(res)})}
    row = rows["256 in flight vs raw engine, 256 in flight"]
    assert row["value"] == pytest.approx(0.2) and row["status"] == "INFO" and row["shown"] == "0.20"
    top["aiotransfer"]["cpu_us_per_request"], top["raw"]["cpu_us_per_request"] = 412.4, 61.0
    rows = {r["metric"]: r for r in report.evaluate({**res, "figures": report.derive(res)})}
    assert rows["256 in flight vs raw engine, 256 in flight"]["shown"] == (
        "0.20 (CPU per request: library 412 us, raw 61 us)")
    assert "1 in flight vs raw engine, 1 in flight" not in rows


def test_tp_pattern_is_head_sliced_consistently() -> None:
    """Prefill ranks 0 and 1 (2 heads each) fill what decode rank 0 (4 heads) checks."""
    rows, heads, hdim, layers = 4, 8, 16, 2
    hw = hdim * 2 // 8
    pages = np.array([3, 0, 5], dtype=np.int64)
    prefill = [KVPool(2 * layers, 8, (rows, 2, hdim)) for _ in range(2)]
    decode = KVPool(2 * layers, 8, (rows, 4, hdim))
    for r, pool in enumerate(prefill):
        tp_fill(pool, 77, pages, rows, heads, hw, 2 * r, 2)
    assert tp_bad_pages(decode, 77, pages, rows, heads, hw, 0, 4) == 3 * 2 * layers
    for b in range(2 * layers):  # what the transfer does: each prefill rank's heads into its slot of the row
        for r, pool in enumerate(prefill):
            src = pool.words[b, pages].reshape(3, rows, 2, hw)
            view = decode.words[b].reshape(-1, rows, 4, hw)
            view[pages, :, 2 * r : 2 * r + 2, :] = src
    assert tp_bad_pages(decode, 77, pages, rows, heads, hw, 0, 4) == 0
    assert tp_bad_pages(decode, 78, pages, rows, heads, hw, 0, 4) == 3 * 2 * layers
    assert np.array_equal(aux_pattern(5, 300), aux_pattern(5, 300)) and not np.array_equal(
        aux_pattern(5, 300), aux_pattern(6, 300))


@pytest.mark.timeout(120)
def test_engine_threads_background_reaches_both_sides(tmp_path: Path) -> None:
    """``--engine-threads background`` configures the managers of both processes, and the lag figure runs."""
    out = tmp_path / "lag.json"
    proc = _bench("--tiny", "--engines", "mooncake_tcp", "--phases", "lag", "--engine-threads", "background",
                  "--out", str(out), "--img-dir", "", timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["params"]["engine_threads"] == "background"
    eng = res["engines"]["mooncake_tcp"]
    assert eng["describe"]["prefill"]["engine_threads"] == eng["describe"]["decode"]["engine_threads"] == "background"
    lag = eng["phases"]["lag"]
    assert "error" not in lag and lag["aiotransfer"]["failed"] == 0 and lag["aiotransfer"]["samples"] > 0


def test_params_scales() -> None:
    full = make_params(quick=False, tiny=False, repeats=None, seed=0, host="127.0.0.1", phases=None)
    quick = make_params(quick=True, tiny=False, repeats=None, seed=0, host="127.0.0.1", phases=None)
    tiny = make_params(quick=False, tiny=True, repeats=3, seed=1, host="127.0.0.1", phases=["tp"])
    assert full.scattered_pages == 10_000 and full.tp_tokens == 4096 and full.tp_layers == 32
    assert max(full.conc_levels) == 256 and 256 * 2**20 in full.sizes and 64 * 2**20 in full.sizes
    assert 64 * 2**20 in quick.sizes and max(quick.conc_levels) == 256
    assert tiny.repeats == 3 and tiny.phases == ["tp"] and tiny.seed == 1
    assert set(ALL_PHASES) == {"ceilings"} | {p for e in ENGINES.values() for p in e.phases}
    assert type(full).from_json(full.to_json()) == full
    assert full.engine_threads == "normal"
    assert full.cpu_buffers == 64 and full.cpu_pages == [1, 64, 4096] and full.cpu_reps == [200, 200, 30]
    assert full.cpu_layer_pages == 256 and len(tiny.cpu_pages) == len(tiny.cpu_reps)
    bg = make_params(quick=True, tiny=False, repeats=None, seed=0, host="127.0.0.1", phases=["lag"],
                     engine_threads="background")
    assert type(bg).from_json(bg.to_json()).engine_threads == "background"
    assert full.nixl_progress_delay_us == 0
    slow = make_params(quick=True, tiny=False, repeats=None, seed=0, host="127.0.0.1", phases=["lag"],
                       nixl_progress_delay_us=1000)
    assert type(slow).from_json(slow.to_json()).nixl_progress_delay_us == 1000


_LAST_WORDS = """
import asyncio
from aiotransfer._cli.channel import open_parent_channel

async def main() -> None:
    chan = await open_parent_channel()
    await chan.send({"event": "result", "blob": "x" * 100_000}, timeout=30.0)

asyncio.run(main())
"""


def test_child_last_message_arrives_whole_before_it_exits() -> None:
    """A worker sends its (large) result and exits at once: the pipe must have taken every byte first."""
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", _LAST_WORDS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT
    )
    time.sleep(1.0)  # nothing reads the pipe meanwhile: the child must wait for us, not exit early
    out, _ = proc.communicate(timeout=30)
    line = out.decode().splitlines()[-1]
    msg = json.loads(line[len("@aiotransfer "):])
    assert msg["event"] == "result" and len(msg["blob"]) == 100_000


# ----------------------------------------------------------------------------------------------------
# the floor of a small room, and the trace hook it reads
# ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_floor_phase_tiny_on_mooncake(tmp_path: Path) -> None:
    """ZMQ round trip, raw writes and rooms in the same two processes; every traced room has every mark."""
    from benchmarks.suite.floor import PATH, SIDE, SIZES

    out = tmp_path / "floor.json"
    proc = _bench("--tiny", "--engines", "mooncake_tcp", "--phases", "floor", "--out", str(out), "--img-dir", "",
                  timeout=50)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    fl = res["engines"]["mooncake_tcp"]["phases"]["floor"]
    assert "error" not in fl, fl.get("error")
    assert fl["clock"]["consistent"] is True and "CLOCK_MONOTONIC" in fl["clock"]["prefill"]
    reps = fl["rounds"] * fl["reps_per_round"]
    assert fl["zmq_rtt"]["n"] == fl["zmq_rtt_yield"]["n"] == reps and fl["zmq_rtt"]["p50_us"] > 0
    assert set(fl["sizes"]) == {str(s) for s in SIZES}
    for v in fl["sizes"].values():
        assert v["raw"]["n"] == v["room"]["n"] == v["room_traced"]["n"] == reps
        assert v["floor_p50_us"] == pytest.approx(fl["zmq_rtt"]["p50_us"] + v["raw"]["p50_us"], abs=0.02)
        assert v["ratio_p50"] == pytest.approx(v["room"]["p50_us"] / v["floor_p50_us"], rel=0.01, abs=0.005)  # 2 decimals
        st = v["stages"]
        assert st["rooms"] == st["complete"] == reps  # the library's marks fire on the path while tracing is on
        assert [(r["from"], r["to"]) for r in st["path"]] == [(a, b) for a, b, _, _ in PATH]
        assert [(r["from"], r["to"]) for r in st["side"]] == [(a, b) for a, b, _, _ in SIDE]
        assert all(r["n"] == reps and r["p50_us"] >= 0 for r in st["path"])
        assert st["total"]["n"] == reps and st["total"]["p50_us"] > 0
    assert fl["switches_rooms"] == 3 * reps and "loop" in fl["switches_per_room"]["decode"]
    text = (tmp_path / "floor.md").read_text()
    assert "room / floor" in text and "request_in -> ready" in text
    assert "The floor of a small room" in proc.stdout
    # a trace run with other sizes (``SIZES`` widened to 8 MiB) gets a column per size it ran
    from benchmarks.suite import floor_report

    first = str(min(SIZES))
    fl["sizes"] = {"8388608": {**fl["sizes"][first], "bytes": 8388608}, first: fl["sizes"][first]}
    md = floor_report.markdown(res).splitlines()
    header = next(line for line in md if line.startswith("| engine | stage | where"))
    assert header == f"| engine | stage | where | {min(SIZES) // 1024} KiB | 8 MiB | budget (us) |", header
    assert any(line.startswith(("MISS ", "ok ")) for line in md)


def test_trace_records_only_while_on() -> None:
    from aiotransfer import _trace

    class Guard:
        room = 7

    handle = object()
    assert _trace.recorder is None  # off by default, and no test leaves it on
    _trace.mark(1, "start")
    _trace.submitted(handle, Guard())
    _trace.completed(handle)
    rec = _trace.start()
    try:
        _trace.mark(1, "start")
        _trace.recorder is None or _trace.mark(1, "end")  # the form the library's path uses
        _trace.submitted(handle, Guard())
        _trace.submitted(object(), object())  # a write without a room is not marked
        _trace.completed(handle)
        _trace.completed(handle)  # seen once
    finally:
        assert _trace.stop() is rec
    assert _trace.recorder is None
    _trace.mark(2, "start")  # off again: nothing more
    marks = rec.take()
    assert [(r, s) for r, s, _ in marks] == [(1, "start"), (1, "end"), (7, "submitted"), (7, "engine_done")]
    assert all(isinstance(t, int) for _, _, t in marks) and [t for _, _, t in marks] == sorted(t for _, _, t in marks)
    assert rec.take() == [] and rec.dropped == 0
    small = _trace.Recorder(limit=1)
    small.add(1, "a", 1)
    small.add(1, "b", 2)
    assert small.marks == [(1, "a", 1)] and small.dropped == 1


def test_floor_breakdown_from_marks() -> None:
    from benchmarks.suite.floor import PATH, breakdown

    stages = [a for a, _, _, _ in PATH] + ["end"]
    marks = [(r, s, 1000 * (i + 1) * (r - 9)) for r in (10, 11) for i, s in enumerate(stages)]
    marks += [(10, "request_sent", 9_000), (10, "start", 10**9), (99, "start", 0)]  # a room's first mark counts
    bd = breakdown(marks, [10, 11])
    assert bd["rooms"] == 2 and bd["complete"] == 0  # no success_out, request_sent only in one
    assert [r["p50_us"] for r in bd["path"]] == [1.5] * len(PATH)
    assert bd["total"]["p50_us"] == 1.5 * len(PATH) and bd["total"]["n"] == 2
    side = {(r["from"], r["to"]): r for r in bd["side"]}
    assert side[("request_send", "request_sent")]["n"] == 1 and side[("request_send", "request_sent")]["p50_us"] == 7.0
    assert side[("engine_done", "success_out")]["n"] == 0


# ----------------------------------------------------------------------------------------------------
# library CPU per call
# ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_cpu_phase_tiny_on_both_engines(tmp_path: Path) -> None:
    """The library's CPU per call next to the raw engine's for the same entries, on every engine that runs here;
    the profiled call's breakdown; the tables."""
    from benchmarks.suite.cpu_profile import CATEGORIES

    engines = ["mooncake_tcp", *(["nixl_shm"] if nixl_available() else [])]
    out = tmp_path / "cpu.json"
    proc = _bench("--tiny", "--engines", ",".join(engines), "--phases", "cpu", "--out", str(out), "--img-dir", "",
                  timeout=50)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    p = res["params"]
    assert set(res["engines"]) == set(engines)
    for key in engines:
        cpu = res["engines"][key]["phases"]["cpu"]
        assert set(res["engines"][key]["phases"]) == {"cpu"} and "error" not in cpu, cpu.get("error")
        calls = cpu["calls"]
        assert set(calls) == {f"send_kv:{n}" for n in p["cpu_pages"]} | {"send_layers", "send_layers_contiguous"}
        for n, reps in zip(p["cpu_pages"], p["cpu_reps"], strict=True):
            c = calls[f"send_kv:{n}"]
            assert c["entries"] == n * p["cpu_buffers"] and c["library"]["n"] == c["raw"]["n"] == reps
        lay, run = calls["send_layers"], calls["send_layers_contiguous"]
        assert lay["entries"] == 2 * p["cpu_layer_pages"] and lay["library"]["n"] >= p["cpu_layer_reps"]
        assert run["entries"] == 2 and run["contiguous"] and run["library"]["n"] >= p["cpu_layer_reps"]
        for c in calls.values():
            lib, raw = c["library"], c["raw"]
            assert lib["library_us"] > 0 and lib["loop_us"] > 0 and lib["wall_us"] > 0
            assert raw["raw_us"] > 0 and raw["wall_us"] > 0 and len(raw["samples_us"]) == raw["n"]
            assert c["diff_us"] == pytest.approx(lib["library_us"] - raw["raw_us"], abs=0.2)
            assert c["ratio"] == pytest.approx(lib["library_us"] / raw["raw_us"], abs=0.01)
        biggest = calls[f"send_kv:{max(p['cpu_pages'])}"]
        conv = biggest["library_list"]["conversion"]
        assert biggest["library_list"]["library_us"] > 0 and conv["list_us"] > 0 and conv["array_us"] > 0
        bd = cpu["breakdown"]
        assert set(bd["estimate_us"]) == set(CATEGORIES) and sum(bd["estimate_us"].values()) > 0
        assert sum(bd["threads"]["loop"]["shares"].values()) == pytest.approx(1.0, abs=0.01)
    assert "9 library CPU" in proc.stdout and "Library CPU per call" in proc.stdout
    assert "Where the library's CPU goes" in proc.stdout
    md = (tmp_path / "cpu.md").read_text()
    assert "| library CPU | raw CPU |" in md and "| checks and planning |" in md


def test_thread_clocks_group_by_thread() -> None:
    """CPU time of a thread named like the engine's driver lands in the driver group, and only there."""
    import threading
    import time

    from benchmarks.suite.cpu import GROUPS, ThreadClocks

    clocks = ThreadClocks()
    go, stop = threading.Event(), threading.Event()

    def spin() -> None:
        go.wait(5)
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.03:
            pass
        stop.wait(5)

    t = threading.Thread(target=spin, name="aiotransfer-driver-test")
    t.start()
    try:
        before = clocks.read()
        go.set()
        time.sleep(0.1)
        d = clocks.delta(before, clocks.read())
    finally:
        stop.set()
        t.join(5)
    assert set(d) == set(GROUPS)
    assert d["driver"] >= 25_000_000 and d["offload"] < 5_000_000


def test_cpu_profile_categories_follow_callers() -> None:
    """A function outside the library takes the category of its callers; the engine's calls and the harness
    are told apart by where they live."""
    from benchmarks.suite.cpu_profile import COMPLETION, ENGINE, HARNESS, PLANNING, ROOT, categorize

    lib = "/x/aiotransfer/"
    harness = "/x/benchmarks/"
    send = (lib + "_sender.py", 1, "send_kv")
    plan = (lib + "_plan.py", 2, "plan_blocks")
    check = (lib + "engines/_mooncake.py", 3, "check")
    submit = ("~", 0, "<built-in method mooncake.engine.transfer_submit_write>")
    astype = ("~", 0, "<method 'astype' of 'numpy.ndarray' objects>")
    loop = ("/usr/lib/python3.11/asyncio/base_events.py", 4, "_run_once")
    stop = (harness + "suite/cpu_profile.py", 5, "stop")
    stats = {
        send: (1, 1, 0.001, 0.01, {loop: (1, 1, 0.001, 0.01)}),
        plan: (1, 1, 0.002, 0.003, {send: (1, 1, 0.002, 0.003)}),
        astype: (2, 2, 0.004, 0.004, {plan: (1, 1, 0.001, 0.001), check: (1, 1, 0.003, 0.003)}),
        check: (1, 1, 0.005, 0.008, {loop: (1, 1, 0.005, 0.008)}),
        submit: (9, 9, 0.007, 0.007, {send: (9, 9, 0.007, 0.007)}),
        loop: (1, 1, 0.0005, 0.02, {}),
        stop: (1, 1, 0.0002, 0.0002, {}),
    }
    out = categorize(stats, top=3)
    sec = out["seconds"]
    assert sec[PLANNING] == pytest.approx(0.001 + 0.002 + 0.001)
    assert sec[COMPLETION] == pytest.approx(0.005 + 0.003)
    assert sec[ENGINE] == pytest.approx(0.007)
    assert sec[ROOT] == pytest.approx(0.0005) and sec[HARNESS] == pytest.approx(0.0002)
    assert [row[0] for row in out["top"]] == [submit[2], "engines/_mooncake.py:3(check)", astype[2]]
    assert [row[2] for row in out["top"]] == [ENGINE, COMPLETION, COMPLETION]  # astype: mostly under check


def test_the_stage_budget_says_miss_for_a_stage_over_it() -> None:
    """The budget check on a made-up run: a library stage over its fixed budget, a ZeroMQ leg over half the
    round trip plus its margin, and the library's stages added up are each a MISS; the others are ok."""
    from benchmarks.suite import budget, floor_report
    from benchmarks.suite.floor import PATH

    p50 = {("start", "request_send"): 20.0, ("request_send", "request_in"): 191.0, ("request_in", "ready"): 16.0,
           ("ready", "planned"): 20.0, ("planned", "submitted"): 30.0, ("submitted", "engine_done"): 140.0,
           ("engine_done", "status_in"): 150.0, ("status_in", "done"): 10.0, ("done", "end"): 2.0}
    path = [{"from": a, "to": b, "p50_us": p50[(a, b)]} for a, b, _, _ in PATH]
    floor = {"zmq_rtt": {"p50_us": 300.0}, "sizes": {"4096": {"bytes": 4096, "raw": {"p50_us": 100.0},
                                                               "stages": {"path": path}}}}
    verdicts = {v.stage: v for v in budget.check({"engines": {"mooncake_tcp": {"phases": {"floor": floor}}}})}
    missed = sorted(stage for stage, v in verdicts.items() if v.miss)
    assert missed == ["request_in -> ready", "request_send -> request_in", "submitted -> engine_done"]
    assert verdicts["library's own stages, added"].p50_us == 96.0 and not verdicts["library's own stages, added"].miss
    assert "done -> end" not in verdicts  # the caller's own resumption is not budgeted
    lines = floor_report.verdicts({"engines": {"mooncake_tcp": {"phases": {"floor": floor}}}})
    assert sum(line.startswith("MISS") for line in lines) == 3 and len(lines) == len(verdicts)


# ----------------------------------------------------------------------------------------------------
# python -m benchmarks scale
# ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_scale_suite_tiny(tmp_path: Path) -> None:
    """One prefill, decodes in two processes: every room at every level succeeds with the right bytes, the
    storm fails exactly the rooms of the killed decodes, and the churn's endpoints are all accepted."""
    out = tmp_path / "scale.json"
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "scale", "--peers", "1,4", "--processes", "2",
                           "--churn", "20", "--churn-alive", "4", "--idle", "0.5", "--hold", "2.2",
                           "--min-rooms", "8", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=230, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {"suite", "settings", "baseline", "levels", "storm", "churn", "summary", "targets", "machine"} <= set(res)
    assert [lv["peers"] for lv in res["levels"]] == [1, 4]
    for lv in res["levels"]:
        assert lv["rooms_failed"] == 0, lv["errors"]
        assert lv["per_room"]["rooms"] >= 8 and lv["per_room"]["loop_cpu_us"] > 0 and "loop_cpu_net_us" in lv["per_room"]
        assert lv["held"]["rooms"] == lv["peers"] and lv["held"]["samples"] > 0 and lv["held"]["max_ms"] >= 0
        assert lv["idle"]["rss_kib"] > 0 and lv["idle"]["fds"] > 0
        assert lv["registrations"]["decode_peers"] == lv["peers"]
    s = res["storm"]
    assert s["decodes_killed"] == 2 and s["killed_rooms"]["failed"] == 2
    assert s["surviving_rooms"]["rooms"] == 2 and s["surviving_rooms"]["failed"] == 0
    assert s["new_decodes"]["decodes"] == 2 and s["new_decodes"]["failed"] == 0
    c = res["churn"]
    assert c["accepted"] == c["endpoints"] == 20 and c["failed"] == 0 and c["alive_at_once"] == 4
    assert c["registrations_peak"]["decode_peers"] >= 4
    assert {t["status"] for t in res["targets"]} <= {"PASS", "MISS"}
    assert "| decodes |" in (tmp_path / "scale.md").read_text()


def test_scale_targets_compare_the_top_level_with_eight_peers() -> None:
    from benchmarks.scale import report as scale_report

    def lv(n: int, us: float, p99: float, mx: float, failed: int = 0) -> dict[str, Any]:
        return {"peers": n, "per_room": {"loop_cpu_us": us}, "rooms_failed": failed,
                "held": {"p99_ms": p99, "max_ms": mx}}

    churn = {"endpoints": 5000, "alive_at_once": 200, "accepted": 4096,
             "registrations_peak": {"decode_peers": 4096, "registrations": 380}}
    res: dict[str, Any] = {"levels": [lv(1, 900, 1, 2), lv(8, 300, 1, 2), lv(1000, 350, 19.9, 50)], "churn": churn}
    rows = {r["target"]: r for r in scale_report.targets(res)}
    assert rows["per-room loop CPU <= 1.2x that at N = 8"]["status"] == "PASS"
    assert rows["held rooms: loop lag p99 <= 20 ms"]["status"] == "PASS"
    assert rows["held rooms: loop lag max <= 50 ms"]["at"] == "N = 1000"
    assert rows["churn: every endpoint accepted"]["status"] == "MISS"
    assert rows["churn: registrations held <= 2x alive"]["status"] == "PASS"  # the dedicated count wins
    res["levels"][-1] = lv(1000, 361, 20.1, 51, failed=1)
    rows = {r["target"]: r for r in scale_report.targets(res)}
    assert {rows[k]["status"] for k in rows if not k.startswith("churn")} == {"MISS"}
