"""What ships: the wheel holds the library, ``doctor``, ``demo`` and the small ``bench``; the benchmark
suites, the SGLang and vLLM harnesses and their stubs stay in the repository (``benchmarks/``)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
WORKSHOP = ("_cli/suite/", "_cli/sglang/", "_cli/vllm/", "stubs/", "IPython/", "sitecustomize.py",
            "interop_stubs.py", "tiny-llama/", "vllm_pd.py", "device_bench.py", "hostile.py", "benchmarks/")
"""Path parts no file of the wheel may have."""


def _workshop(paths: list[str]) -> list[str]:
    return [p for p in paths if any(w in p for w in WORKSHOP)]


def test_the_package_config_ships_the_library_only() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["aiotransfer"]
    files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "aiotransfer").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    assert files and _workshop(files) == []
    cli = {p.name for p in (ROOT / "aiotransfer" / "_cli").iterdir() if p.suffix == ".py"}
    assert {"doctor.py", "demo.py", "bench.py"} <= cli and not {p for p in cli if "sglang" in p or "vllm" in p}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_holds_no_suites_harnesses_or_stubs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=280, check=False)
    if proc.returncode != 0 and "hatchling" in proc.stdout + proc.stderr:
        pytest.skip(f"the build backend cannot be installed here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("aiotransfer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "aiotransfer/_cli/bench.py" in names and "aiotransfer/_cli/doctor.py" in names
    assert "aiotransfer/py.typed" in names
    license_file = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert license_file, names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata, metadata[:2000]
    assert _workshop(names) == [], _workshop(names)
    assert all(n.startswith(("aiotransfer/", "aiotransfer-")) for n in names), names


def test_mypy_checks_the_examples_too() -> None:
    """Code copied from examples/ type-checks as strictly as the library, for the oldest Python it supports."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mypy = config["tool"]["mypy"]
    assert {"aiotransfer", "examples"} <= set(mypy["files"]) and mypy["strict"] is True
    assert mypy["python_version"] == config["project"]["requires-python"].removeprefix(">=")


def test_the_license_file_is_the_one_pyproject_names() -> None:
    """pyproject says Apache-2.0; LICENSE holds that license's text and ships in both distributions."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"], text[:200]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert "/LICENSE" in config["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]


def test_the_package_description_reads_on_its_own() -> None:
    """The README is the wheel's description, shown where no checkout is: its links are absolute, the files
    it names ship in the source distribution, and its quick start begins with an install from the index."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["readme"] == "README.md"
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    assert targets and [t for t in targets if not t.startswith("https://")] == []
    shipped = config["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    for path in set(re.findall(r"`((?:docs|examples)/[\w./-]+|[A-Z]+\.md|LICENSE)`", text)):
        assert (ROOT / path).exists(), path
        assert "/" + path.split("/")[0] in shipped, path
    quick = text[text.index("## Quick start"):]
    first_block = quick[quick.index("```bash"):quick.index("```", quick.index("```bash") + 7)]
    assert "pip install" in first_block and "make " not in first_block and ".venv" not in first_block
    for url in config["project"].get("urls", {}).values():
        assert url.startswith("https://"), url
