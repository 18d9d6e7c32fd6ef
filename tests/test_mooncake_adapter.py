"""The Mooncake adapter over a scripted native engine: entries posted one call each, polled entry by entry,
and a large write's slices growing one handle, alone and through the poll loop."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiotransfer.engines import _mooncake as mc
from aiotransfer.engines._base import EngineStatus, EngineTraits, TransferHandle
from aiotransfer.engines._common import LoopGate
from aiotransfer.errors import EngineError


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


class _Room:
    """A room as the poll loop sees it; ``admit`` refuses from its ``fail_at``-th call on (never with None)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.admitted = 0

    def take(self) -> Any:
        return lambda: None

    def admit(self) -> None:
        self.admitted += 1
        if self.fail_at is not None and self.admitted >= self.fail_at:
            raise EngineError("room failed")

    def write_failed(self) -> None:
        pass


def _poller_over(engine: mc.MooncakeEngine, cap: int) -> tuple[Any, Any]:
    from aiotransfer._driver import Driver
    from aiotransfer._poller import Poller

    driver = Driver("grow-test")
    return Poller(engine, driver, max_in_flight=cap, max_batch=1024, interval_min=0.0001, interval_max=0.001,
                  expire_after=60.0), driver


async def _write_through_poller(engine: mc.MooncakeEngine, n: int, cap: int, guard: Any = None) -> Any:
    poller, driver = _poller_over(engine, cap)
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
    poller, driver = _poller_over(engine, 1024)
    try:
        with pytest.raises(EngineError, match="room failed"):
            await poller.write("peer", _blocks(10), timeout=5, guard=_Room(fail_at=3))
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


def _asked(native: _Native) -> list[int]:
    """The ids ``native`` is asked about from now on, in order."""
    asked: list[int] = []
    check = native.transfer_check_status

    def counting(bid: int) -> int:
        asked.append(bid)
        return check(bid)

    native.transfer_check_status = counting  # type: ignore[method-assign]
    return asked


def test_a_mooncake_write_of_many_entries_asks_only_its_oldest_running_ones() -> None:
    """A round asks entries in posting order and stops at ``_CHECK_WINDOW`` still running (a write of a thousand
    entries must not cost a thousand status calls per poll); ended entries are never asked again."""
    native = _Native()
    engine = _mooncake_over(native)
    asked = _asked(native)
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
    native = _Native()
    engine = _mooncake_over(native)
    asked = _asked(native)
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


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), slice_entries=st.integers(1, 9), cap=st.integers(1, 24),
       refuse=st.sets(st.integers(0, 45), max_size=2), fail=st.frozensets(st.integers(0, 40), max_size=2),
       fail_room_at=st.one_of(st.none(), st.integers(1, 8)))
def test_growing_writes_keep_the_credit_cap_and_end_every_entry_in_any_order_of_faults(
    n: int, slice_entries: int, cap: int, refuse: set[int], fail: frozenset[int], fail_room_at: int | None,
) -> None:
    """Any write size against any slice and credit cap, with entries refused at the post, entries that fail,
    and the room failing before any slice: the engine never holds more entries than the cap (or one slice
    larger than it), the write succeeds exactly when every entry was posted and none failed, and once it is
    over every posted entry is asked until it ended and never after, with every credit back."""
    native = _CountingNative(refuse=tuple(sorted(refuse)), fail=fail)
    saved = mc._INLINE_ENTRIES
    mc._INLINE_ENTRIES = slice_entries

    async def run() -> tuple[bool, int]:
        engine = _mooncake_over(native)
        engine.traits = EngineTraits(inline_slice=slice_entries)
        poller, driver = _poller_over(engine, cap)
        try:
            try:
                await poller.write("peer", _blocks(n), timeout=5, guard=_Room(fail_at=fail_room_at))
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
