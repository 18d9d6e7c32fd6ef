"""The command line: ``python -m aiotransfer doctor | demo | bench`` and ``python -m benchmarks``
(subprocesses), plus the helpers they are built on (loop-lag monitor, byte pattern, page allocator,
console) in-process."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aiotransfer import _lag as lag_module
from aiotransfer._cli import console
from aiotransfer._cli.workload import KVPool, PageAllocator, count_bad_pages, fill_pages, make_requests
from aiotransfer._lag import LoopLagMonitor

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float, module: str = "aiotransfer", own_log_level: bool = False,
         ) -> subprocess.CompletedProcess[str]:
    """``python -m module args``; ``own_log_level``: with no ``MC_LOG_LEVEL``, as a user runs it."""
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    if own_log_level:
        del env["MC_LOG_LEVEL"]
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )


def _narrow(text: str) -> bool:
    return all(len(line) <= console.WIDTH for line in text.splitlines())


# ----------------------------------------------------------------------------------------------------
# subcommands
# ----------------------------------------------------------------------------------------------------
def test_doctor_runs_and_mentions_mooncake() -> None:
    proc = _run("doctor", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "mooncake" in proc.stdout
    assert "transport" in proc.stdout
    assert "libibverbs.so.1" in proc.stdout


def test_doctor_json() -> None:
    proc = _run("doctor", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    topics = {f["topic"] for f in report["findings"]}
    assert {"python", "system", "mooncake", "transport", "nixl", "mori"} <= topics
    assert report["facts"]["mooncake_transport"]
    assert report["problems"] == sum(f["level"] in ("warn", "error") for f in report["findings"])
    for f in report["findings"]:
        if f["level"] in ("warn", "error"):
            assert f["fix"], f  # every problem comes with a fix line


def test_doctor_names_the_log_level_the_config_sets() -> None:
    """Without MC_LOG_LEVEL, doctor says what aiotransfer sets: the config's ``engine_log_level``."""
    from aiotransfer import TransferConfig

    level = TransferConfig().engine_log_level
    proc = _run("doctor", "--json", timeout=120, own_log_level=True)
    assert proc.returncode == 0, proc.stderr
    (finding,) = [f for f in json.loads(proc.stdout)["findings"] if "MC_LOG_LEVEL unset" in f["message"]]
    assert f"engine_log_level ({level} by default)" in finding["message"], finding
    assert finding["fix"] == f"export MC_LOG_LEVEL={level}", finding


def test_doctor_strict_fails_on_a_problem() -> None:
    env = dict(os.environ, MC_FORCE_HCA="1", MC_LOG_LEVEL="ERROR")
    env.pop("MC_FORCE_TCP", None)
    env.pop("AIOTRANSFER_ENGINE", None)
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices: MC_FORCE_HCA is not a problem here")
    proc = subprocess.run(
        [sys.executable, "-m", "aiotransfer", "doctor", "--strict"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 1, proc.stdout
    assert "unset MC_FORCE_HCA" in proc.stdout
    relaxed = subprocess.run(
        [sys.executable, "-m", "aiotransfer", "doctor"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert relaxed.returncode == 0


def test_demo_small_geometry(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    t0 = time.monotonic()
    proc = _run(
        "demo", "--requests", "64", "--layers", "2", "--kv-heads", "2", "--pool-pages", "384",
        "--concurrency", "4", "--json", str(out), "--timeout", "90", timeout=120, own_log_level=True,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr  # neither process prints the engine's start-up lines
    res = json.loads(out.read_text())
    assert res["requests"] == 64
    assert res["verified_requests"] == 64
    assert res["mismatched_pages"] == 0
    assert res["errors"] == []
    assert res["geometry"]["buffers"] == 4
    assert res["throughput_gbps"] > 0
    assert res["latency_ms"]["p50"] <= res["latency_ms"]["p99"]
    assert len(res["per_request"]) == 64
    assert "GB/s" in proc.stdout and "p99" in proc.stdout
    assert elapsed < 60, f"demo with a tiny geometry took {elapsed:.1f}s"


def test_demo_fails_on_a_mismatch(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    proc = _run(
        "demo", "--requests", "6", "--layers", "1", "--kv-heads", "1", "--pool-pages", "512", "--corrupt", "3",
        "--json", str(out), "--timeout", "60", timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["mismatched_pages"] == 1
    assert len(res["errors"]) == 1 and "1 mismatched pages" in res["errors"][0]
    assert "FAILED" in proc.stdout


def test_demo_rejects_a_pool_too_small() -> None:
    proc = _run("demo", "--pool-pages", "8", "--layers", "1", timeout=60)
    assert proc.returncode == 2
    assert "pool-pages" in proc.stderr


def test_demo_refuses_the_in_process_test_engine() -> None:
    from aiotransfer._cli import demo

    assert demo.main(["--engine", "memory"]) == 2


def test_bench_quick_writes_three_figures(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run("bench", "--quick", "--out", str(out), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert set(res["figures"]) == {"a", "b", "c"}
    for fig in res["figures"].values():
        assert fig["verified"] is True
        assert fig["raw"]["gbps"] > 0 and fig["aiotransfer"]["gbps"] > 0
        assert fig["ratio"] == pytest.approx(fig["aiotransfer"]["gbps"] / fig["raw"]["gbps"], rel=1e-6)
        assert fig["raw"]["call"] in fig["raw"]["styles"]
        assert fig["same_call"]["call"] in fig["raw"]["styles"]
        assert fig["same_call"]["ratio"] >= fig["ratio"] * (1 - 1e-9)  # best raw >= any raw style
    assert res["figures"]["b"]["raw"]["entries"] == res["figures"]["b"]["params"]["runs"]
    lag = res["loop_lag"]["a_aiotransfer"]
    assert lag["samples"] > 0 and lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
    assert "ratio" in proc.stdout
    assert _narrow(proc.stdout) and _narrow(proc.stderr), proc.stdout + proc.stderr
    assert "Using default malloc/free" not in proc.stdout + proc.stderr  # Mooncake's log: its own file
    assert (tmp_path / "bench.log").exists() and str(tmp_path / "bench.log") in proc.stdout


def _bench_result(best: float, same: float, requests: int) -> dict[str, object]:
    """A ``bench`` result of figure (c) alone, where the best raw style and the adapter's own one differ."""
    from argparse import Namespace

    from aiotransfer._cli import bench

    (fig,) = bench.build_figures(Namespace(seed=0, figures="c", c_requests=requests))
    styles = {"sync": {"gbps": best, "median_s": 1 / best}, "async": {"gbps": same, "median_s": 1 / same}}
    return {"repeats": 1, "wall_s": 1.0, "loop_lag": {}, "figures": {"c": {
        "title": fig.title, "ratio": 1.0 / best, "same_call": {"call": "async", "ratio": 1.0 / same},
        "raw": {"call": "sync", "gbps": best, "median_s": 1 / best, "entries": 9, "styles": styles},
        "aiotransfer": {"gbps": 1.0, "median_s": 1.0, "entries": 9}}}}


def test_bench_table_shows_each_ratio_once_under_its_own_heading() -> None:
    """Figure (c)'s two ratios (against the best raw call style, and against the one the adapter makes)
    stand side by side in the table, each named; the lines under it give the raw styles' GB/s only."""
    from aiotransfer._cli import bench

    text = bench._table(_bench_result(best=0.86, same=0.61, requests=1))
    lines = text.splitlines()
    first, rule = lines.index(next(ln for ln in lines if ln.startswith("figure"))), lines.index(
        next(ln for ln in lines if ln.startswith("------")))
    header = "\n".join(lines[first:rule])
    (row,) = [ln for ln in lines[rule:lines.index("", rule)] if ln.startswith("(c) ")]
    assert row.split()[-2:] == ["1.16", "1.64"], text
    assert header.count("ratio vs") == 2 and "best raw" in header and "same call" in header, text
    (styles,) = [ln for ln in text.splitlines() if ln.startswith("(c) raw")]
    assert "ratio" not in styles and "sync 0.860 (best)" in styles and "async 0.610 (same call)" in styles
    assert "1 request," in text and "1 requests" not in text
    assert "medians of 1 repeat;" in text


def test_bench_help_says_what_each_figure_and_ratio_is_and_every_option_has_help() -> None:
    proc = _run("bench", "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for key in "abc":
        assert f"\n  ({key})  " in text, text
    assert "ratio vs best raw" in text and "ratio vs same call" in text
    options = text[text.index("options:"):text.index("\nfigures")].splitlines()[1:]
    for n, line in enumerate(options):
        if line.startswith("  -"):
            described = len(line.split("  ")) > 2 or (n + 1 < len(options) and options[n + 1].startswith(" " * 8))
            assert described, f"no help for {line.strip()}"
    assert _narrow(text), text


def test_bench_suites_moved_to_the_repository() -> None:
    proc = _run("bench", "--suite", "full", timeout=60)
    assert proc.returncode == 2
    assert "python -m benchmarks full" in proc.stderr


def test_benchmarks_lists_every_suite_and_each_suite_has_its_entry_point() -> None:
    import importlib

    from benchmarks.cli import SUITES

    proc = _run("--help", timeout=60, module="benchmarks")
    assert proc.returncode == 0, proc.stderr
    for name, suite in SUITES.items():
        assert name in proc.stdout
        module = importlib.import_module(suite.module)
        assert callable(module.add_arguments) and callable(getattr(module, suite.entry)), name
    assert {"figures", "full", "lifecycle", "handshake", "scale", "streaming", "conversion", "vllm", "sglang",
            "device"} == set(SUITES)
    bad = _run("nope", timeout=60, module="benchmarks")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_bench_sglang_without_the_interop_venv_says_how_to_build_it(tmp_path: Path) -> None:
    env = dict(os.environ, MC_LOG_LEVEL="ERROR", AIOTRANSFER_INTEROP_VENV=str(tmp_path / "missing"))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "sglang", "--quick", "--out", str(tmp_path / "sglang.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "bash scripts/interop-venv.sh" in proc.stderr


def test_bench_sglang_rejects_an_unknown_size(tmp_path: Path) -> None:
    proc = _run("sglang", "--sizes", "3K", "--out", str(tmp_path / "sglang.json"), timeout=60, module="benchmarks")
    assert proc.returncode == 2
    assert "4K, 64K, 8M, 32M" in proc.stderr


_SESSION = r"""
import os, sys, time
from aiotransfer._cli import console

with console.session(sys.argv[1]):
    console.note("working on it")
    os.write(2, b"E1128 12:00:00.000000 1 native.cpp:1] a native log line\n")
    os.write(1, b"native stdout\n")
    time.sleep(4.5)
    print("result " + "x" * 150)
print("after")
"""


def test_session_keeps_native_output_in_the_log_and_reports_progress(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    proc = subprocess.run([sys.executable, "-c", _SESSION, str(log)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "native" not in proc.stdout + proc.stderr
    assert "a native log line" in log.read_text() and "native stdout" in log.read_text()
    assert proc.stderr.startswith("working on it\n")
    beats = [line for line in proc.stderr.splitlines() if line.startswith("  ... ")]
    assert len(beats) >= 1 and all("working on it" in b for b in beats)  # not a terminal: plain lines
    assert proc.stdout.splitlines()[0].startswith("result xxx") and proc.stdout.splitlines()[-1] == "after"
    assert _narrow(proc.stdout) and len(proc.stdout.splitlines()) == 3  # the long line wrapped in two


def test_table_fits_the_width_by_wrapping_the_widest_cells() -> None:
    rows = [("figure", "metric", "value"), ("1", "a metric with a long description " * 4, "0.95"),
            ("2", "short", "1.00")]
    text = console.table(rows)
    lines = text.splitlines()
    assert all(len(line) <= console.WIDTH for line in lines) and len(lines) > 4
    assert lines[0].startswith("figure") and set(lines[1]) <= {"-", " "}
    assert "0.95" in text and lines[-1].split() == ["2", "short", "1.00"]
    assert console.table([("a", "b"), ("1", "2")]) == "a  b\n-  -\n1  2"
    many = [tuple(f"a long header number {i} (us)" for i in range(9)), tuple("1234 / 5678" for _ in range(9))]
    lines = console.table(many).splitlines()  # headers wider than the width together: they wrap too
    assert all(len(line) <= console.WIDTH for line in lines) and lines[0].startswith("a")
    wrapped = console.wrap("  " + "word " * 40)
    assert all(len(line) <= console.WIDTH for line in wrapped.splitlines())
    assert wrapped.splitlines()[1].startswith("      word")  # the line's indent plus the hanging indent


# ----------------------------------------------------------------------------------------------------
# helpers, in-process
# ----------------------------------------------------------------------------------------------------
async def test_loop_lag_monitor_sees_a_blocked_loop() -> None:
    mon = LoopLagMonitor(interval=0.001)
    async with mon:
        await asyncio.sleep(0.05)
        time.sleep(0.03)  # noqa: ASYNC251 -- blocks the loop on purpose
        await asyncio.sleep(0.02)
    s = mon.summary()
    assert s["samples"] >= 10
    assert s["max_ms"] >= 25
    assert s["p50_ms"] < 20  # most samples are on time: the block shows in the tail only
    samples = mon.samples
    assert samples.dtype == np.float64 and samples.size == s["samples"]
    assert not mon.running
    assert "stopped" in repr(mon)


async def test_loop_lag_monitor_empty_and_restart() -> None:
    mon = LoopLagMonitor()
    assert mon.summary()["samples"] == 0 and mon.summary()["p99_ms"] is None
    mon.start()
    await asyncio.sleep(0.02)
    await mon.stop()
    n = mon.summary()["samples"]
    mon.start()
    await asyncio.sleep(0.02)
    await mon.stop()
    assert mon.summary()["samples"] > n
    mon.reset()
    assert mon.summary()["samples"] == 0
    with pytest.raises(ValueError):
        LoopLagMonitor(interval=0)


_SCHEDSTAT = os.path.exists("/proc/thread-self/schedstat")


@pytest.mark.skipif(not _SCHEDSTAT, reason="per-thread scheduler statistics are Linux-only")
async def test_loop_lag_attribution_blocked_loop_is_not_runqueue_wait() -> None:
    """A loop blocked by its own code (a sleep on the loop thread) is late, and none of it is CPU wait."""
    mon = LoopLagMonitor(attribute=True, late_ms=2.0)
    async with mon:
        for _ in range(5):
            await asyncio.sleep(0.01)
            time.sleep(0.01)  # noqa: ASYNC251 -- blocks the loop on purpose
    s = mon.summary()
    assert s["late_overshoot_ms"] >= 25
    assert s["late_runqueue_share"] < 0.5
    assert s["worst"]["overshoot_ms"] >= 5 and s["worst"]["runqueue_ms"] < s["worst"]["overshoot_ms"]
    assert 0 < s["loop_cpu_share"] < 1 and s["runqueue_ms_per_s"] >= 0


_STARVED = """
import asyncio, json, os, sys
from aiotransfer._lag import LoopLagMonitor
print("ready", flush=True)
sys.stdin.readline()  # the busy processes run
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread: the loop
async def main():
    mon = LoopLagMonitor(attribute=True)
    async with mon:
        await asyncio.sleep(0.5)
    print(json.dumps(mon.summary()), flush=True)
asyncio.run(main())
"""


@pytest.mark.skipif(not (_SCHEDSTAT and hasattr(os, "SCHED_IDLE")), reason="Linux scheduler statistics")
def test_loop_lag_attribution_starved_loop_is_runqueue_wait() -> None:
    """A loop thread at idle priority behind busy processes on every core is late because it waits for a
    CPU: the attribution says so."""
    with subprocess.Popen([sys.executable, "-c", _STARVED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        spin = "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass"
        busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range((os.cpu_count() or 1) + 1)]
        try:
            time.sleep(0.1)
            child.stdin.write("go\n")
            child.stdin.flush()
            line = child.stdout.readline()  # written once the busy processes are gone and the loop runs again
        finally:
            for b in busy:
                b.kill()
                b.wait()
        assert child.wait(60) == 0 and line
    s = json.loads(line)
    assert s["late_overshoot_ms"] > 50, s
    assert s["late_runqueue_share"] > 0.8, s
    assert s["runqueue_ms_per_s"] > 50, s
    assert s["worst"]["runqueue_ms"] > 0.5 * s["worst"]["overshoot_ms"], s


async def test_loop_lag_attribution_absent_without_scheduler_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the scheduler statistics cannot be read the summary leaves the CPU figures out."""
    monkeypatch.setattr(lag_module, "_open_schedstat", lambda: None)
    monkeypatch.setattr(lag_module, "_open_stat", lambda: None)
    mon = LoopLagMonitor(attribute=True)
    async with mon:
        await asyncio.sleep(0.01)
    s = mon.summary()
    assert s["samples"] > 0
    assert "loop_cpu_share" not in s and "steal_ms_per_s" not in s
    assert s["late_runqueue_share"] is None and s["late_steal_share"] is None and s["worst"] is None
    with pytest.raises(ValueError):
        LoopLagMonitor(late_ms=-1)


def test_steal_reads_the_hypervisor_column(tmp_path: Path) -> None:
    """Steal time is the eighth number of /proc/stat's first line; other layouts give None."""
    f = tmp_path / "stat"
    f.write_text("cpu  1505316 252 926109 2735678 16827 0 61657 8534 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    fd = os.open(f, os.O_RDONLY)
    try:
        assert lag_module._steal(fd) == 8534
    finally:
        os.close(fd)
    f.write_text("intr 1 2 3\n")
    fd = os.open(f, os.O_RDONLY)
    try:
        assert lag_module._steal(fd) is None
    finally:
        os.close(fd)
    assert lag_module._steal(None) is None


def test_pattern_detects_every_corrupted_byte() -> None:
    pool = KVPool(3, 16, (4, 8), np.uint16)
    pages = np.array([5, 1, 9], dtype=np.int64)
    fill_pages(pool, 42, pages)
    assert count_bad_pages(pool, 42, pages) == 0
    assert count_bad_pages(pool, 43, pages) == 3 * 3  # another room's pattern differs everywhere
    raw = pool.slab.view(np.uint8)
    raw[2, 9, 3, 7] ^= 0x01  # one bit in the last byte of buffer 2's page 9
    assert count_bad_pages(pool, 42, pages) == 1
    # regions registered with the engine never touch: one spare page between buffers
    assert all(b.ctypes.data + b.nbytes < nb.ctypes.data for b, nb in itertools.pairwise(pool.buffers))


def test_requests_are_deterministic_and_chunked() -> None:
    a = make_requests(7, 64, 256, 4096, 16, 3)
    assert a == make_requests(7, 64, 256, 4096, 16, 3)
    assert len({r.room for r in a}) == 64
    for r in a:
        assert 256 <= r.tokens <= 4096
        assert r.pages == -(-r.tokens // 16)
        assert sum(r.chunks) == r.pages and 1 <= len(r.chunks) <= 3 and min(r.chunks) >= 1


async def test_page_allocator_is_fifo_and_scattered() -> None:
    alloc = PageAllocator(10, np.random.default_rng(0))
    first = await alloc.alloc(6, timeout=1)
    assert len(set(first.tolist())) == 6
    big = asyncio.ensure_future(alloc.alloc(8, timeout=1))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(alloc.alloc(2, timeout=1))  # fits now, but must not overtake `big`
    await asyncio.sleep(0.01)
    assert not big.done() and not small.done()
    await alloc.release(first)
    got_big = await big
    assert got_big.size == 8
    await asyncio.sleep(0)
    assert small.done()
    await alloc.release(got_big)
    await alloc.release(small.result())
    assert alloc.free_pages == 10
    with pytest.raises(asyncio.TimeoutError):
        await _exhaust(alloc)
    assert alloc.free_pages == 10


async def _exhaust(alloc: PageAllocator) -> None:
    held = await alloc.alloc(10, timeout=1)
    try:
        await alloc.alloc(1, timeout=0.01)
    finally:
        await alloc.release(held)
