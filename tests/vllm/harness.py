"""Running the vLLM harness (``python -m benchmarks.vllm_pd``) from the tests, and what they check on
its results alike."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_harness(python: str, workdir: Path, *args: str, timeout: float = 600.0) -> dict[str, Any]:
    """Run one harness scenario; returns its JSON plus ``_wall_s`` (the subprocess's wall time)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "result.json"
    log = workdir / "harness.log"
    cmd = [python, "-m", "benchmarks.vllm_pd", *args, "--workdir", str(workdir), "--json", str(out)]
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the harness tears its engines down on SIGTERM
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pytest.fail(f"harness {args[0]} ran past {timeout:.0f} s; log {log}:\n{_tail(log)}")
    if rc != 0 or not out.exists():
        pytest.fail(f"harness {args[0]} exited {rc}; log {log}:\n{_tail(log)}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["_wall_s"] = time.monotonic() - t0
    print(f"[vllm] {' '.join(args)}: {result['_wall_s']:.0f} s; engine peaks (MiB): {_peaks(result)}",
          file=sys.stderr)
    return result


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _peaks(result: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS per engine process, from the engines' own stats."""
    found: dict[str, Any] = {}
    if "reference" in result:
        found["reference"] = result["reference"].get("peak_rss_mib")
    for kind, run in result.get("runs", {}).items():
        found[kind] = run.get("peak_rss_mib")
    if "peak_rss_mib" in result:
        found["pair"] = result["peak_rss_mib"]
    return found


def assert_no_leak(settle: dict[str, Any], side: str) -> None:
    """Every block came back to vLLM's pool and no request is left on that side."""
    assert settle["settled"], f"{side}: {settle['free_idle'] - settle['free']} blocks never came back: {settle}"
    assert settle["free"] == settle["free_idle"] and settle["requests"] == 0, settle


def assert_within_budget(result: dict[str, Any], kinds: list[str], factor: float = 3.5) -> None:
    """A ``pd`` run started one reference engine and one pair per kind, and spent at most ``factor`` times
    their start-up time in all.

    Start-up is the bulk of such a run (about 10 s an engine or pair here; the requests take seconds), and
    it slows down with the machine as the rest does, so the bound holds on a busy or slower machine and
    still catches a run whose work grew (a wait that ran into a timeout, a request run twice). Measured
    here: 1.6 times for the PD run, 1.3 for the hybrid one."""
    assert sorted(result["runs"]) == sorted(kinds), list(result["runs"])
    starts = result["reference"]["start_s"] + sum(run.get("start_s", 0.0) for run in result["runs"].values())
    wall = result["_wall_s"]
    assert wall < factor * starts, (f"the run took {wall:.0f} s, {wall / starts:.1f} times its {len(kinds) + 1} "
                                    f"engine start-ups ({starts:.0f} s)")
