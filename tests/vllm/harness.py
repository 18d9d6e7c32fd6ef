"""Running the vLLM harness (``python -m aiotransfer._cli.vllm_pd``) from the tests, and what they check on
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
    cmd = [python, "-m", "aiotransfer._cli.vllm_pd", *args, "--workdir", str(workdir), "--json", str(out)]
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
