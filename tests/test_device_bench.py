"""``python -m benchmarks device`` on host tensors (``--device cpu``): the same code that
measures GPU memory, end to end in two processes, with its bytes checked and its stage marks read."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.device_bench import STAGES, _stage_medians
from tests.conftest import nixl_available

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    return subprocess.run([sys.executable, "-m", "benchmarks", "device", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.timeout(150)
def test_device_suite_on_host_tensors_checks_bytes_and_reports_against_the_raw_engine(tmp_path: Path) -> None:
    engine = "nixl" if nixl_available() else "mooncake_tcp"  # NIXL: its raw driver takes the memory kind
    out = tmp_path / "device.json"
    proc = _bench("--device", "cpu", "--quick", "--engines", engine, "--out", str(out), timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["copies"]["gather_bps"] > 0 and res["copies"]["scatter_bps"] > 0
    (eng,) = res["engines"]
    assert eng["engine"] == engine
    (room,) = eng["rooms"].values()
    assert room["raw_gbps"] > 0 and room["ratio"] == pytest.approx(room["aiotransfer_gbps"] / room["raw_gbps"])
    assert list(room["stages_us"]) == [f"{a}->{b}" for a, b in itertools.pairwise(STAGES)]
    assert set(eng["aux"]) == {"host"} and eng["aux"]["host"]["path"] == "tcp"  # device aux needs CUDA
    assert room["loop_lag"]["samples"] > 0 and room["loop_lag"]["max_ms"] >= 0
    assert "room:\n  aiotransfer" in proc.stdout and "engine and worker logs:" in proc.stderr


def test_a_device_this_host_lacks_is_a_usage_error() -> None:
    pytest.importorskip("torch")
    proc = _bench("--device", "cuda:0", "--quick", timeout=60)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    assert proc.returncode == 2 and "cuda:0 is not available here" in proc.stderr


def test_stage_medians_skip_marks_a_room_lacks() -> None:
    rooms = [{"start": 0, "planned": 1000, "call_start": 3000, "end": 9000},
             {"start": 0, "planned": 3000, "end": 5000}]
    assert _stage_medians(rooms) == {"start->planned": 2.0, "planned->call_start": 2.0}
