"""The engine layer's shared pieces: traits and their defaults, vendor-error mapping, the region index,
Mooncake's wheel choice and its start-up log filter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiotransfer._config import TransferConfig
from aiotransfer.engines import _mooncake as mc
from aiotransfer.engines._base import EngineBase, EngineStatus, EngineTraits, TransferEngine, TransferHandle
from aiotransfer.engines._common import RegionIndex, map_errors, quietly
from aiotransfer.engines._mooncake_setup import recommended_wheels
from aiotransfer.engines._mooncake_stderr import without_benign_start_lines
from aiotransfer.errors import ClosedError, ConfigError, EngineError, EngineUnavailable
from tests import fake_mori

ROOT = Path(__file__).resolve().parent.parent

if TYPE_CHECKING:
    from aiotransfer.engines._mori import MoriEngine
    from aiotransfer.engines._nixl import NixlEngine

    def _adapters_satisfy_the_protocol(a: mc.MooncakeEngine, b: NixlEngine, c: MoriEngine) -> list[TransferEngine]:
        return [a, b, c]  # checked by mypy, structurally


# -- traits ------------------------------------------------------------------------------------------


def test_trait_defaults_live_in_one_place() -> None:
    assert EngineTraits() == EngineTraits(
        quiet_threads=False, entry_cost_s=30e-6, bandwidth_bps=2e9, landing_grace_s=0.0, inline_slice=0
    )
    base = EngineBase()
    assert base.traits == EngineTraits() and base.probe_region is None
    assert base.credit_scope is base
    assert base.try_submit_inline("peer", None) is None  # type: ignore[arg-type]
    assert base.try_extend_inline(None, None) is False  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        EngineTraits(bandwidth_bps=0)
    with pytest.raises(ValueError):
        EngineTraits(landing_grace_s=-1)
    with pytest.raises(AttributeError):
        EngineTraits().quiet_threads = True  # type: ignore[misc]
    handle = TransferHandle(token=None, peer="p", entries=1, nbytes=1)
    handle.doom("first")
    handle.doom("second")
    base.abandon(handle)
    assert (handle.status, handle.error, handle.doomed) == (EngineStatus.FAILED, "first", "first")


def test_adapters_declare_their_traits() -> None:
    from aiotransfer.engines._mori import MoriEngine
    from aiotransfer.engines._nixl import NixlEngine

    assert mc.MooncakeEngine.traits == EngineTraits(quiet_threads=True, landing_grace_s=1.0, inline_slice=64)
    assert (NixlEngine.traits.quiet_threads, NixlEngine.traits.landing_grace_s) == (False, 0.0)
    assert NixlEngine.traits.entry_cost_s < mc.MooncakeEngine.traits.entry_cost_s
    assert MoriEngine.traits == EngineTraits(entry_cost_s=5e-6, bandwidth_bps=20e9)


def test_mori_over_the_fake_satisfies_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_mori.install(monkeypatch.setitem)
    from aiotransfer.engines._mori import MoriEngine

    engine = MoriEngine(TransferConfig(engine="mori"))
    try:
        assert isinstance(engine, TransferEngine)
        assert engine.credit_scope is engine and engine.probe_region is None
        assert repr(engine) == f"<MoriEngine {engine.session_id} rdma peers=0 in_flight=0>"
    finally:
        engine.close()
    assert repr(engine).endswith(" closed>")
    with pytest.raises(ClosedError, match="MORI engine is closed"):
        engine.local_info()


def test_registry_refuses_an_engine_without_the_optional_members() -> None:
    from aiotransfer.engines import _registry as registry

    closed: list[bool] = []

    class Old:
        """An adapter written before traits existed."""

        name = "old"
        cheap_submit = True

        def close(self) -> None:
            closed.append(True)

    registry.register_engine("old-style", lambda config: Old())
    registry.register_engine("new-style", lambda config: EngineBase())
    try:
        with pytest.raises(ConfigError, match=r"lacks traits, probe_region, credit_scope, try_submit_inline, try_extend_inline, reach, abandon: inherit"):
            registry.create_engine(TransferConfig(engine="old-style"))
        assert closed == [True]
        assert isinstance(registry.create_engine(TransferConfig(engine="new-style")), EngineBase)
    finally:
        registry._ENGINES.pop("old-style", None)
        registry._ENGINES.pop("new-style", None)


# -- vendor errors -------------------------------------------------------------------------------------


class VendorError(RuntimeError):
    pass


def test_map_errors_chains_a_vendor_exception() -> None:
    cause = VendorError("NIXL_ERR_NOT_FOUND")
    with pytest.raises(EngineError) as info, map_errors("NIXL thing failed", hint=" (try again)"):
        raise cause
    assert str(info.value) == "NIXL thing failed: VendorError: NIXL_ERR_NOT_FOUND (try again)"
    assert info.value.__cause__ is cause


def test_map_errors_lets_ours_and_unmapped_ones_through() -> None:
    ours = ClosedError("closed")
    with pytest.raises(ClosedError) as info, map_errors("x"):
        raise ours
    assert info.value is ours
    with pytest.raises(KeyboardInterrupt), map_errors("x"):
        raise KeyboardInterrupt
    with pytest.raises(ValueError), map_errors("x", mapping={OSError: EngineUnavailable}):
        raise ValueError("not a vendor failure")
    with pytest.raises(EngineUnavailable, match="load failed: FileNotFoundError"), map_errors(
        "load failed", mapping={OSError: EngineUnavailable, Exception: EngineError}
    ):
        raise FileNotFoundError("libamdhip64.so.7")


def test_quietly_logs_and_reports(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    log = logging.getLogger("test.quietly")

    def boom(x: int) -> None:
        raise VendorError(f"bad {x}")

    assert quietly(log, "NIXL release", lambda: None) is True
    with caplog.at_level(logging.WARNING, "test.quietly"):
        assert quietly(log, "NIXL release", boom, 3) is False
    assert "NIXL release failed: VendorError: bad 3" in caplog.text


# -- region index ----------------------------------------------------------------------------------------


def test_region_index_numbers_regions_as_given() -> None:
    index = RegionIndex([(5000, 100), (1000, 50), (3000, 10)])
    assert len(index) == 3
    regions, offsets = index.locate(np.array([1000, 1049, 3009, 5000, 5099], np.uint64), "source")
    assert regions.tolist() == [1, 1, 2, 0, 0]
    assert offsets.tolist() == [0, 49, 9, 0, 99]
    for stray in (999, 1050, 3010, 5100):
        with pytest.raises(EngineError, match=f"source address {stray:#x} is not inside"):
            index.locate(np.array([1000, stray], np.uint64), "source")
    with pytest.raises(EngineError):
        RegionIndex([]).locate(np.array([1], np.uint64), "x")


# -- Mooncake: wheels and start-up log ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cuda", "mooncake", "extra", "nixl", "nixl_extra"),
    [
        (None, "mooncake-transfer-engine-non-cuda==0.3.13.post1", "mooncake-cpu", "nixl-cu12", "nixl"),
        (12, "mooncake-transfer-engine==0.3.13.post1", "mooncake", "nixl-cu12", "nixl"),
        (13, "mooncake-transfer-engine-cuda13==0.3.14", "mooncake-cuda13", "nixl-cu13", "nixl-cu13"),
        (14, "mooncake-transfer-engine-cuda13==0.3.14", "mooncake-cuda13", "nixl-cu13", "nixl-cu13"),
    ],
)
def test_recommended_wheels(cuda: int | None, mooncake: str, extra: str, nixl: str, nixl_extra: str) -> None:
    choice = recommended_wheels(cuda)
    assert (choice.mooncake, choice.mooncake_extra, choice.nixl, choice.nixl_extra) == (
        mooncake, extra, nixl, nixl_extra
    )
    assert f"aiotransfer[{extra}]" in choice.mooncake_pip
    assert choice.nixl_no_deps is (cuda is None)
    if cuda is None:
        assert choice.nixl_pip == "pip install --no-deps nixl-cu12 numpy"


def test_recommended_wheels_extras_exist() -> None:
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    extras = {
        line.split("=", 1)[0].strip(): line.split("=", 1)[1] for line in lines if " = [" in line and line.endswith("]")
    }
    for cuda in (None, 12, 13):
        choice = recommended_wheels(cuda)
        assert f'"{choice.mooncake}"' in extras[choice.mooncake_extra]
        assert f'"{choice.nixl}>=' in extras[choice.nixl_extra]


def test_no_wheel_for_old_cuda() -> None:
    with pytest.raises(ConfigError, match="CUDA 11"):
        recommended_wheels(11)


def test_setup_module_is_pure() -> None:
    code = ("import sys, aiotransfer.engines._mooncake_setup, aiotransfer.engines._mooncake; "
            "assert 'mooncake' not in sys.modules and 'mooncake.engine' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


BENIGN = [b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n",
          b"W1123 22:50:00.856245  4803 transfer_engine_py.cpp:120] Using default malloc/free for protocol: tcp\n",
          b"E1123 22:50:00.856890  4803 transfer_metadata.cpp:1098] Local segment descriptor not found\n"]


def test_init_filter_drops_only_the_benign_start_lines(capfd: pytest.CaptureFixture[str]) -> None:
    others = [b"W1123 22:50:00.856245  4803 transfer_engine_py.cpp:120] Using default malloc\n",
              b"E1123 22:50:00.856999  4803 transfer_metadata.cpp:1100] Failed to retrieve segment descriptor\n"]
    with without_benign_start_lines():
        for line in [*BENIGN, *others]:
            os.write(2, line)
    for line in BENIGN:
        os.write(2, line)  # outside initialize: shown
    err = capfd.readouterr().err
    assert err.encode().splitlines(keepends=True) == [*others, *BENIGN]


def test_a_normal_mooncake_start_prints_nothing_on_stderr() -> None:
    """At the default log level a Mooncake engine's start and close print nothing; at INFO Mooncake's own
    lines still pass, without the start-up lines that say nothing about the engine."""
    code = ("from aiotransfer._config import TransferConfig; from aiotransfer.engines._mooncake import MooncakeEngine; "
            "e = MooncakeEngine(TransferConfig(engine='mooncake_tcp')); print(e.session_id); e.close()")
    for level in ("", "WARNING", "INFO"):
        env: dict[str, Any] = {**os.environ, "MC_LOG_LEVEL": level, "PYTHONPATH": str(ROOT)}
        if not level:
            del env["MC_LOG_LEVEL"]  # the adapter's default: engine_log_level
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0 and "cannot be loaded" in out.stderr:
            pytest.skip("Mooncake is not installed here")
        assert out.returncode == 0, out.stderr
        for line in BENIGN:
            assert line.decode().split("]")[-1].strip() not in out.stderr, (level, out.stderr)
        if level == "INFO":
            assert "TcpTransport: listen on port" in out.stderr  # other lines still pass
        else:
            assert out.stderr == "", (level, out.stderr)


def test_mooncake_registers_gpu_memory_at_its_device() -> None:
    """Regions on a GPU are registered at ``cuda:N`` (Mooncake's location name); host memory at ``*``."""
    assert [mc.memory_location(d) for d in ("cuda:0", "cuda:3", "cuda", "cpu", "npu:1")] == [
        "cuda:0", "cuda:3", "cuda:0", "*", "*"]


# -- NIXL descriptors ----------------------------------------------------------------------------------


def _descriptors_or_error(build: Any) -> Any:
    try:
        kind, arr = build()
    except EngineError as exc:
        return ("error", str(exc))
    return kind, arr.tolist()


@given(
    regions=st.lists(st.tuples(st.integers(1, 64), st.integers(0, 1)), min_size=1, max_size=6),
    picks=st.lists(st.tuples(st.integers(0, 1 << 14), st.integers(1, 4096)), min_size=1, max_size=8),
)
@settings(max_examples=300, deadline=None)
def test_nixl_few_entry_descriptors_equal_the_vectorised_ones(
    regions: list[tuple[int, int]], picks: list[tuple[int, int]]
) -> None:
    """A write of up to eight entries has its descriptors built in plain Python: the same rows, memory type
    and errors (an address outside every region, DRAM mixed with VRAM) as the NumPy path."""
    from aiotransfer.engines import _nixl as nixl

    rows, base = [], 1 << 20
    for pages, vram in regions:  # regions with gaps between them, some of them VRAM
        rows.append((base, pages * 256, vram, 3 if vram else 0))
        base += pages * 256 + 512
    table = nixl._RegionTable(rows)
    addrs = np.array([(1 << 20) + off for off, _ in picks], dtype=np.uint64)
    lengths = np.array([n for _, n in picks], dtype=np.uint64)
    few = _descriptors_or_error(lambda: table.few_descs(addrs.tolist(), lengths.tolist(), "source"))
    assert few == _descriptors_or_error(lambda: nixl._descs_vectorised(table, addrs, lengths, "source"))
