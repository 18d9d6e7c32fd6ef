"""``python -m benchmarks sglang`` end to end, smallest run: SGLang's own layer and aiotransfer, both
timed and both verified. Skipped when .interop-venv is missing (``bash scripts/interop-venv.sh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interop import ROOT, interop_venv_problem

_problem = interop_venv_problem()
pytestmark = [
    pytest.mark.interop,
    pytest.mark.slow,
    pytest.mark.skipif(_problem is not None, reason=_problem or ""),
    pytest.mark.timeout(180),
]


def test_quick_suite_reports_both_stacks(tmp_path: Path) -> None:
    out = tmp_path / "sglang.json"
    argv = [
        sys.executable,
        "-m",
        "benchmarks",
        "sglang",
        "--quick",
        "--sizes",
        "4K",
        "--at-once",
        "4",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SGLang ms" in proc.stdout and "aiotransfer ms" in proc.stdout and "all match" in proc.stdout, proc.stdout
    assert max(map(len, proc.stdout.splitlines())) <= 100, proc.stdout
    res = json.loads(out.read_text())
    row = res["figures"]["4K"]
    assert row["geometry"] == "small" and row["pages"] == 1
    for mode, rooms in (("one", 4), ("at_once", 4)):
        for name in ("sglang", "aiotransfer"):
            side = row[mode][name]
            assert side["latency"]["n"] == rooms and side["latency"]["p50_ms"] > 0
            assert side["verified_rooms"] == rooms and side["bad_rooms"] == 0
        assert row[mode]["latency_ratio_p50"] > 0
    assert row["at_once"]["sglang"]["gbps"] > 0 and row["at_once"]["aiotransfer"]["gbps"] > 0
    assert row["at_once"]["gbps_ratio"] > 0
    assert [t["target"] for t in res["targets"]] == [2.0]
