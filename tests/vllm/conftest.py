"""What the vLLM tests share: the vLLM venv's Python, built (or checked) once per session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM venv's Python (built on first use, about 2 minutes; then checked in seconds). Skips the
    test, with the script's last lines, where the venv cannot be built."""
    try:
        proc = subprocess.run(["bash", "scripts/vllm-venv.sh"], cwd=ROOT, capture_output=True, text=True,
                              timeout=1800)
    except subprocess.TimeoutExpired as exc:
        pytest.skip(f"scripts/vllm-venv.sh did not finish in {exc.timeout:.0f} s")
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        pytest.skip(f"the vLLM venv could not be built (scripts/vllm-venv.sh exit {proc.returncode}):\n{tail}")
    return proc.stdout.strip().splitlines()[-1]
