"""The engine layer's shared pieces: traits and their defaults, vendor-error mapping, the region index,
Mooncake's wheel choice and its start-up log filter."""

from __future__ import annotations

import asyncio
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
from aiotransfer.engines._common import LoopGate, RegionIndex, map_errors, quietly
from aiotransfer.engines._mooncake_setup import recommended_wheels
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


BENIGN = b"E1123 22:50:00.856890  4803 transfer_metadata.cpp:1098] Local segment descriptor not found\n"


def test_init_filter_drops_only_the_benign_line(capfd: pytest.CaptureFixture[str]) -> None:
    other = b"E1123 22:50:00.856999  4803 transfer_metadata.cpp:1100] Failed to retrieve segment descriptor\n"
    with mc._without_benign_init_error():
        os.write(2, b"W1123 22:50:00.856245  4803 transfer_engine_py.cpp:120] Using default malloc\n")
        os.write(2, BENIGN)
        os.write(2, other)
    os.write(2, BENIGN)  # outside initialize: a real fault, shown
    err = capfd.readouterr().err
    assert err.splitlines() == [
        "W1123 22:50:00.856245  4803 transfer_engine_py.cpp:120] Using default malloc",
        other.decode().strip(),
        BENIGN.decode().strip(),
    ]


def test_a_normal_mooncake_start_logs_no_error() -> None:
    code = ("from aiotransfer._config import TransferConfig; from aiotransfer.engines._mooncake import MooncakeEngine; "
            "e = MooncakeEngine(TransferConfig(engine='mooncake_tcp')); print(e.session_id); e.close()")
    env: dict[str, Any] = {**os.environ, "MC_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0 and "cannot be loaded" in out.stderr:
        pytest.skip("Mooncake is not installed here")
    assert out.returncode == 0, out.stderr
    assert "Local segment descriptor not found" not in out.stderr
    assert not [line for line in out.stderr.splitlines() if line.startswith("E")], out.stderr
    assert "Using default malloc/free for protocol: tcp" in out.stderr  # other lines still pass


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


# -- Mooncake's few-entry writes ---------------------------------------------------------------------
class _Native:
    """Mooncake's one-entry calls as a script: ``transfer_submit_write`` refuses the entries in ``refuse``;
    each posted entry stays pending until :meth:`end` gives its status, and its id is freed when
    ``transfer_check_status`` reports it over (asking again is the use-after-free the adapter must avoid)."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.refuse = frozenset(refuse)
        self.posted: list[int] = []
        self.ended: dict[int, int] = {}
        self.freed: set[int] = set()

    def transfer_submit_write(self, name: str, src: int, dst: int, length: int) -> int:
        if len(self.posted) + len(self.freed) in self.refuse:
            self.refuse = self.refuse - {len(self.posted) + len(self.freed)}
            return 0
        bid = 100 + len(self.posted)
        self.posted.append(bid)
        return bid

    def transfer_check_status(self, bid: int) -> int:
        assert bid not in self.freed, f"entry {bid} asked after it was freed"
        rc = self.ended.get(bid, 0)
        if rc in (1, -1):  # completed or failed: the binding frees the id; -2 (timeout) does not
            self.freed.add(bid)
        return rc

    def end(self, bid: int, rc: int = 1) -> None:
        self.ended[bid] = rc


def _mooncake_over(native: _Native) -> mc.MooncakeEngine:
    engine = object.__new__(mc.MooncakeEngine)
    engine._shared = type("Shared", (), {"native": native, "names": {}, "opened": {"peer"}, "gate": LoopGate()})()
    return engine


def _blocks(n: int) -> Any:
    from aiotransfer._plan import Blocks

    return Blocks(np.arange(n, dtype=np.uint64) * 4096 + 4096, np.arange(n, dtype=np.uint64) * 4096 + 65536,
                  np.full(n, 4096, dtype=np.uint64))


def test_a_mooncake_write_of_a_few_entries_is_done_once_every_entry_is() -> None:
    from aiotransfer.engines._base import EngineStatus

    native = _Native()
    engine = _mooncake_over(native)
    handle = engine.submit_write("peer", _blocks(3))
    assert (handle.entries, native.posted) == (3, [100, 101, 102])
    assert engine.check(handle) is EngineStatus.PENDING
    native.end(101)
    native.end(100)
    assert engine.check(handle) is EngineStatus.PENDING, "an entry is still in flight"
    native.end(102)
    assert engine.check(handle) is EngineStatus.DONE and native.freed == {100, 101, 102}


def test_a_mooncake_entry_refused_after_others_were_posted_fails_the_write_only_once_they_are_over() -> None:
    from aiotransfer.engines._base import EngineStatus

    native = _Native(refuse=(2,))
    engine = _mooncake_over(native)
    handle = engine.submit_write("peer", _blocks(4))  # entries 0 and 1 are posted: it must not raise
    assert native.posted == [100, 101] and handle.doomed is not None and "refused entry 2" in handle.doomed
    assert engine.check(handle) is EngineStatus.PENDING, "posted entries may still read the memory"
    native.end(100)
    native.end(101, rc=-1)
    assert engine.check(handle) is EngineStatus.FAILED and "refused entry 2" in str(handle.error)
    first = _Native(refuse=(0,))
    with pytest.raises(EngineError, match="refused entry 0"):  # nothing posted: the submission itself fails
        _mooncake_over(first).submit_write("peer", _blocks(2))
    assert first.posted == []


def test_a_mooncake_entry_that_fails_fails_the_write_once_every_entry_is_over() -> None:
    from aiotransfer.engines._base import EngineStatus

    native = _Native()
    engine = _mooncake_over(native)
    handle = engine.submit_write("peer", _blocks(2))
    native.end(100, rc=-1)
    assert engine.check(handle) is EngineStatus.PENDING and "failure (-1)" in str(handle.doomed)
    native.end(101)
    assert engine.check(handle) is EngineStatus.FAILED and "failure (-1)" in str(handle.error)


def test_a_mooncake_timeout_is_not_an_end() -> None:
    """-2 (TIMEOUT): the entry still runs and its id stays valid. The handle is doomed at once and asked again;
    it ends only when the entry does, here by completing late (a stopped peer resumed)."""
    from aiotransfer.engines._base import EngineStatus

    native = _Native()
    engine = _mooncake_over(native)
    handle = engine.submit_write("peer", _blocks(2))
    native.end(101)
    native.end(100, rc=-2)
    for _ in range(3):
        assert engine.check(handle) is EngineStatus.PENDING
    assert "engine timeout" in str(handle.doomed) and native.freed == {101}
    native.end(100, rc=1)
    assert engine.check(handle) is EngineStatus.FAILED and native.freed == {100, 101}
    assert "engine timeout" in str(handle.error)


# ---------------------------------------------------------------------------------------------------
# A write's slices grow one handle (``try_extend_inline``), posted from the loop 64 entries at a time
# ---------------------------------------------------------------------------------------------------


def test_a_growing_mooncake_write_is_not_over_before_its_last_slice_joined() -> None:
    """Later slices join the handle's ids; while ``growing`` is set, ``check`` answers PENDING even once every
    entry posted so far has ended, and the handle ends only after the poll loop clears it."""
    native = _Native()
    engine = _mooncake_over(native)
    handle = engine.try_submit_inline("peer", _blocks(2))
    assert handle is not None
    assert not engine.try_extend_inline(handle, _blocks(2)), "a handle not growing took more entries"
    handle.growing = True
    for bid in (100, 101):
        native.end(bid)
    assert engine.check(handle) is EngineStatus.PENDING, "a growing write ended"
    assert engine.try_extend_inline(handle, _blocks(3))
    assert (handle.entries, handle.nbytes, native.posted) == (5, 5 * 4096, [100, 101, 102, 103, 104])
    for bid in (102, 103, 104):
        native.end(bid)
    assert engine.check(handle) is EngineStatus.PENDING
    handle.growing = False
    assert engine.check(handle) is EngineStatus.DONE and native.freed == set(range(100, 105))


def test_a_growing_mooncake_write_takes_no_slice_the_loop_could_wait_on_or_that_cannot_succeed() -> None:
    """Declined, nothing posted: while a handshake holds the engine, for a slice larger than the loop posts,
    and once the handle is doomed. An entry refused inside a slice dooms the handle; those posted stay."""
    native = _Native(refuse=(3,))
    engine = _mooncake_over(native)
    handle = engine.try_submit_inline("peer", _blocks(2))
    assert handle is not None
    handle.growing = True
    with engine._shared.gate.handshake():
        assert not engine.try_extend_inline(handle, _blocks(2))
    assert not engine.try_extend_inline(handle, _blocks(mc._INLINE_ENTRIES + 1))
    assert native.posted == [100, 101]
    assert engine.try_extend_inline(handle, _blocks(3))  # the second entry of this slice is refused
    assert handle.entries == 3 and handle.nbytes == 3 * 4096 and "refused entry 3" in str(handle.doomed)
    assert not engine.try_extend_inline(handle, _blocks(1)) and native.posted == [100, 101, 102]
    for bid in native.posted:
        native.end(bid)
    handle.growing = False
    assert engine.check(handle) is EngineStatus.FAILED and native.freed == {100, 101, 102}


class _EndingNative(_Native):
    """Every posted entry has completed by the time it is first asked about."""

    def transfer_check_status(self, bid: int) -> int:
        self.ended.setdefault(bid, 1)
        return super().transfer_check_status(bid)


def _sliced_mooncake(monkeypatch: pytest.MonkeyPatch, native: _Native, slice_entries: int) -> mc.MooncakeEngine:
    monkeypatch.setattr(mc, "_INLINE_ENTRIES", slice_entries)
    engine = _mooncake_over(native)
    engine.traits = EngineTraits(inline_slice=slice_entries)
    return engine


async def _write_through_poller(engine: mc.MooncakeEngine, n: int, cap: int, guard: Any = None) -> Any:
    from aiotransfer._driver import Driver
    from aiotransfer._poller import Poller

    driver = Driver("grow-test")
    poller = Poller(engine, driver, max_in_flight=cap, max_batch=1024, interval_min=0.0001, interval_max=0.001,
                    expire_after=60.0)
    try:
        await poller.write("peer", _blocks(n), timeout=5, guard=guard)
        return poller
    finally:
        await poller.aclose(2.0)
        driver.close()


async def test_a_write_of_many_slices_is_one_handle_posted_from_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten entries in slices of four: one post and two slices joining it, all from the loop, one handle
    polled to its end, every entry asked until it ended and never after."""
    native = _EndingNative()
    engine = _sliced_mooncake(monkeypatch, native, 4)
    posts: list[int] = []
    submit = engine._submit_entries

    def counting(peer: str, name: str, blocks: Any) -> TransferHandle:
        posts.append(len(blocks))
        return submit(peer, name, blocks)

    monkeypatch.setattr(engine, "_submit_entries", counting)
    poller = await _write_through_poller(engine, 10, cap=1024)
    assert posts == [4] and native.posted == list(range(100, 110)) and native.freed == set(native.posted)
    assert (poller.completed, poller.failed, poller.in_flight) == (1, 0, 0)


async def test_a_write_larger_than_the_credit_cap_stops_growing_to_give_credit_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The credit of a growing handle comes back only when it ends: a slice that finds no credit stops the
    growth, so the write goes on as several handles instead of waiting on itself."""
    native = _EndingNative()
    engine = _sliced_mooncake(monkeypatch, native, 4)
    poller = await _write_through_poller(engine, 10, cap=6)
    assert native.posted == list(range(100, 110)) and native.freed == set(native.posted)
    assert poller.completed >= 2 and poller.in_flight == 0


async def test_a_room_that_fails_between_slices_stops_the_growth_and_its_entries_still_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The room is asked before every slice; once it refuses, nothing more is posted, the write fails, and
    the handle (with what it posted) is polled until the engine ends it."""
    native = _Native()
    engine = _sliced_mooncake(monkeypatch, native, 4)
    admitted = 0

    class Room:
        def take(self) -> Any:
            return lambda: None

        def admit(self) -> None:
            nonlocal admitted
            admitted += 1
            if admitted > 2:
                raise EngineError("room failed")

        def write_failed(self) -> None:
            pass

    from aiotransfer._driver import Driver
    from aiotransfer._poller import Poller

    driver = Driver("grow-test")
    poller = Poller(engine, driver, max_in_flight=1024, max_batch=1024, interval_min=0.0001, interval_max=0.001,
                    expire_after=60.0)
    try:
        with pytest.raises(EngineError, match="room failed"):
            await poller.write("peer", _blocks(10), timeout=5, guard=Room())
        assert native.posted == list(range(100, 108)) and poller.in_flight == 1
        for bid in native.posted:
            native.end(bid)
        for _ in range(2000):
            if poller.in_flight == 0:
                break
            await asyncio.sleep(0.001)
        assert poller.in_flight == 0 and native.freed == set(native.posted)
    finally:
        await poller.aclose(2.0)
        driver.close()


def test_mooncake_posts_from_the_loop_only_while_no_handshake_can_hold_the_engine() -> None:
    """``try_submit_inline`` declines (nothing posted) while a handshake is in progress, for a peer whose
    segment the engine has not opened, and for writes too large to post inline; a handshake waits for the
    loop's posts already inside the engine to leave."""
    import threading

    native = _Native()
    engine = _mooncake_over(native)
    gate = engine._shared.gate
    assert engine.try_submit_inline("peer", _blocks(2)) is not None
    assert engine.try_submit_inline("stranger", _blocks(2)) is None
    assert engine.try_submit_inline("peer", _blocks(mc._INLINE_ENTRIES + 1)) is None
    entered, release = threading.Event(), threading.Event()

    def handshake() -> None:
        with gate.handshake():
            entered.set()
            release.wait(5)

    assert gate.enter()  # a post from the loop is inside the engine
    t = threading.Thread(target=handshake)
    t.start()
    assert not entered.wait(0.05), "the handshake went in while a post was inside the engine"
    gate.leave()
    assert entered.wait(5)
    posted = len(native.posted)
    assert engine.try_submit_inline("peer", _blocks(2)) is None and len(native.posted) == posted
    release.set()
    t.join(5)
    assert engine.try_submit_inline("peer", _blocks(2)) is not None


def test_a_mooncake_write_of_many_entries_asks_only_its_oldest_running_ones() -> None:
    """A round asks entries in posting order and stops at ``_CHECK_WINDOW`` still running (a write of a thousand
    entries must not cost a thousand status calls per poll); ended entries are never asked again."""
    from aiotransfer.engines._base import EngineStatus

    native = _Native()
    engine = _mooncake_over(native)
    asked: list[int] = []
    check = native.transfer_check_status

    def counting(bid: int) -> int:
        asked.append(bid)
        return check(bid)

    native.transfer_check_status = counting  # type: ignore[method-assign]
    n, window = 40, mc._CHECK_WINDOW
    handle = engine.submit_write("peer", _blocks(n))
    assert engine.check(handle) is EngineStatus.PENDING and len(asked) == window
    for bid in range(100, 100 + n - 1):
        native.end(bid)
    asked.clear()
    assert engine.check(handle) is EngineStatus.PENDING  # the last entry still runs
    assert len(asked) == n and native.freed == set(range(100, 100 + n - 1))
    native.end(100 + n - 1)
    asked.clear()
    assert engine.check(handle) is EngineStatus.DONE and asked == [100 + n - 1]


def test_a_mooncake_round_costs_the_window_whatever_the_length_of_the_write() -> None:
    """Entries that end out of order are never asked again, and a round over a write of 2,000 entries asks
    the window of running entries plus those that ended since the last round, not every entry before them."""
    from aiotransfer.engines._base import EngineStatus

    native = _Native()
    engine = _mooncake_over(native)
    asked: list[int] = []
    check = native.transfer_check_status

    def counting(bid: int) -> int:
        asked.append(bid)
        return check(bid)

    native.transfer_check_status = counting  # type: ignore[method-assign]
    n, window = 2000, mc._CHECK_WINDOW
    handle = engine.submit_write("peer", _blocks(n))
    native.end(101)  # ends out of order, inside the window
    assert engine.check(handle) is EngineStatus.PENDING and len(asked) == window + 1
    for k in range(0, 1500):
        if k != 1:
            native.end(100 + k)
    asked.clear()
    assert engine.check(handle) is EngineStatus.PENDING
    assert 101 not in asked and len(asked) == 1499 + window  # each ended entry once, then the window
    asked.clear()
    assert engine.check(handle) is EngineStatus.PENDING and len(asked) == window
    for k in range(1500, n):
        native.end(100 + k)
    assert engine.check(handle) is EngineStatus.DONE and native.freed == set(range(100, 100 + n))


class _CountingNative(_Native):
    """Completes each entry when first asked, except those in ``fail`` (-1); counts entries the engine holds
    (posted, not yet reported over) at their peak."""

    def __init__(self, refuse: tuple[int, ...] = (), fail: frozenset[int] = frozenset()) -> None:
        super().__init__(refuse)
        self.fail = fail
        self.peak = 0

    def transfer_submit_write(self, name: str, src: int, dst: int, length: int) -> int:
        bid = super().transfer_submit_write(name, src, dst, length)
        self.peak = max(self.peak, len(self.posted) - len(self.freed))
        return bid

    def transfer_check_status(self, bid: int) -> int:
        self.ended.setdefault(bid, -1 if bid - 100 in self.fail else 1)
        return super().transfer_check_status(bid)


@settings(max_examples=int(os.environ.get('GROW_EXAMPLES', '60')), deadline=None)
@given(n=st.integers(1, 40), slice_entries=st.integers(1, 9), cap=st.integers(1, 24),
       refuse=st.sets(st.integers(0, 45), max_size=2), fail=st.frozensets(st.integers(0, 40), max_size=2),
       fail_room_at=st.one_of(st.none(), st.integers(1, 8)))
def test_growing_writes_keep_the_credit_cap_and_end_every_entry_in_any_order_of_faults(
    n: int, slice_entries: int, cap: int, refuse: set[int], fail: frozenset[int], fail_room_at: int | None,
) -> None:
    """Any write size against any slice and credit cap, with entries refused at the post, entries that fail,
    and the room failing before any slice: the engine never holds more entries than the cap (or one slice
    larger than it), the write
    succeeds exactly when every entry was posted and none failed, and once it is over every posted entry is
    asked until it ended and never after, with every credit back."""
    from aiotransfer._driver import Driver
    from aiotransfer._poller import Poller

    native = _CountingNative(refuse=tuple(sorted(refuse)), fail=fail)
    saved = mc._INLINE_ENTRIES
    mc._INLINE_ENTRIES = slice_entries
    admitted = 0

    class Room:
        def take(self) -> Any:
            return lambda: None

        def admit(self) -> None:
            nonlocal admitted
            admitted += 1
            if fail_room_at is not None and admitted >= fail_room_at:
                raise EngineError("room failed")

        def write_failed(self) -> None:
            pass

    async def run() -> tuple[bool, int]:
        engine = _mooncake_over(native)
        engine.traits = EngineTraits(inline_slice=slice_entries)
        driver = Driver("grow-property")
        poller = Poller(engine, driver, max_in_flight=cap, max_batch=1024, interval_min=0.0001,
                        interval_max=0.001, expire_after=60.0)
        try:
            try:
                await poller.write("peer", _blocks(n), timeout=5, guard=Room())
                ok = True
            except EngineError:
                ok = False
            for _ in range(5000):
                if poller.in_flight == 0:
                    break
                await asyncio.sleep(0.0005)
            credit = poller._credits_for("peer", asyncio.get_running_loop()).used
            return ok, poller.in_flight + credit
        finally:
            await poller.aclose(2.0)
            driver.close()

    try:
        ok, left = asyncio.run(run())
    finally:
        mc._INLINE_ENTRIES = saved
    # a slice larger than the cap is let through alone (Credits clamps a request to the cap)
    assert native.peak <= max(cap, slice_entries), f"the engine held {native.peak} entries, cap {cap}"
    assert left == 0, "a handle or its credit outlived the write"
    assert native.freed == set(native.posted), "an entry was left unasked"
    posted_all = len(native.posted) == n
    failed = any(bid - 100 in fail for bid in native.posted)
    assert ok == (posted_all and not failed), (ok, native.posted, fail)
