"""The pytest plugin users get with aiotransfer: a user's test file, in a directory of its own, uses the
``memory_fabric`` and ``kv_pair`` fixtures with no helper of its own and no import of the plugin, under
pytest-asyncio's auto mode and its strict mode."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

AUTO = '''
import pytest
from aiotransfer import TransferFailed
from aiotransfer.testing import WriteOutcome, current_fabric


async def test_a_room_moves(kv_pair):
    await kv_pair.move(room=1, src=[3, 4], dst=[10, 11])
    assert kv_pair.landed([10, 11], [3, 4])
    assert not kv_pair.landed([12], [5])
    assert [w.outcome for w in kv_pair.fabric.writes] == [WriteOutcome.DONE]


async def test_a_failure_reaches_both_sides(kv_pair):
    kv_pair.fabric.fail_next(reason="link down")
    with pytest.raises(TransferFailed, match="link down"):
        await kv_pair.move(room=2, src=[1], dst=[1])
    assert [w.outcome for w in kv_pair.fabric.writes] == [WriteOutcome.FAILED]


def test_the_fabric_is_the_tests_own(memory_fabric):
    assert current_fabric() is memory_fabric


class TestOtherShapes:
    @pytest.fixture
    def kv_pair_options(self):
        from aiotransfer.testing.pytest_plugin import KVPairOptions

        return KVPairOptions(buffers=4, pages=8, page_bytes=64)

    async def test_the_options_fixture_shapes_the_pair(self, kv_pair):
        assert len(kv_pair.decode_kv) == 4 and kv_pair.decode_kv[0].shape == (8, 64)
        await kv_pair.move(room=1, src=[7], dst=[0])
        assert kv_pair.landed([0], [7])
'''

STRICT = '''
import pytest


@pytest.mark.asyncio
async def test_a_room_moves(kv_pair):
    await kv_pair.move(room=1, src=[0], dst=[5])
    assert kv_pair.landed([5], [0])
'''

def _run(tmp_path: Path, source: str, ini: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(source))
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n" + ini)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_user.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_the_plugin_is_registered_for_pytest() -> None:
    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="pytest11")}
    assert plugins.get("aiotransfer") == "aiotransfer.testing.pytest_plugin"


@pytest.mark.parametrize(("source", "ini", "passed"), [(AUTO, "asyncio_mode = auto\n", 4),
                                                       (STRICT, "asyncio_mode = strict\n", 1)],
                         ids=["asyncio-auto", "asyncio-strict"])
def test_a_users_tests_run_on_the_shipped_fixtures(tmp_path: Path, source: str, ini: str, passed: int) -> None:
    run = _run(tmp_path, source, ini)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{passed} passed" in run.stdout


def test_without_the_plugin_the_fixtures_are_unknown(tmp_path: Path) -> None:
    """The negative control: the same tests with the plugin turned off cannot find their fixtures."""
    run = _run(tmp_path, STRICT, "asyncio_mode = strict\n", "-p", "no:aiotransfer")
    assert run.returncode != 0 and "fixture 'kv_pair' not found" in run.stdout
