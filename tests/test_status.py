from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiotransfer._status import KVPoll, PollLatch, StatusTable, apply_status

F = KVPoll.Failed
B = KVPoll.Bootstrapping
W = KVPoll.WaitingForInput
T = KVPoll.Transferring
S = KVPoll.Success

UPDATES = (F, B, W, T, S)

# Hand-written from the rules. Row = current status, columns = update in UPDATES order.
EXPECTED: dict[KVPoll | None, tuple[KVPoll | None, ...]] = {
    #      F     B     W     T     S
    None: (None, B, W, None, None),
    F: (F, F, F, F, F),
    B: (F, B, W, T, S),
    W: (F, W, W, T, S),
    T: (F, T, T, T, S),
    S: (F, S, S, S, S),
}


def test_enum_values() -> None:
    assert [int(s) for s in UPDATES] == [0, 1, 2, 3, 4]
    assert [s.name for s in UPDATES] == [
        "Failed",
        "Bootstrapping",
        "WaitingForInput",
        "Transferring",
        "Success",
    ]


def test_is_terminal() -> None:
    assert {s for s in KVPoll if s.is_terminal} == {F, S}


def test_expected_table_covers_everything() -> None:
    assert set(EXPECTED) == {None, *KVPoll}
    assert len(UPDATES) == len(KVPoll)


@pytest.mark.parametrize("current", list(EXPECTED))
@pytest.mark.parametrize("column", range(len(UPDATES)))
def test_apply_status_table(current: KVPoll | None, column: int) -> None:
    update = UPDATES[column]
    assert apply_status(current, update) == EXPECTED[current][column]


# ---------------------------------------------------------------- StatusTable


def test_table_creation_only_by_bootstrap_or_waiting() -> None:
    table = StatusTable()
    assert not table.update(1, T)
    assert not table.update(2, S)
    assert not table.update(3, F, "late")
    assert len(table) == 0
    assert table.get(1) is None
    assert table.reason(3) is None
    assert table.update(4, B)
    assert table.update(5, W)
    assert table.get(4) is B
    assert table.get(5) is W
    assert 4 in table and 5 in table and 1 not in table
    assert table.rooms() == [4, 5]
    assert len(table) == 2


def test_table_progress_is_monotone() -> None:
    table = StatusTable()
    assert table.update(1, B)
    assert table.update(1, T)
    assert not table.update(1, W)
    assert not table.update(1, T)
    assert table.get(1) is T
    assert table.update(1, S)
    assert not table.update(1, T)
    assert table.get(1) is S


def test_table_failed_sticks_with_first_reason() -> None:
    table = StatusTable()
    table.update(7, W)
    assert table.reason(7) is None
    assert table.update(7, F, "peer died")
    assert not table.update(7, F, "second reason")
    assert not table.update(7, S)
    assert not table.update(7, B, "ignored")
    assert table.get(7) is F
    assert table.reason(7) == "peer died"


def test_table_failed_after_success_wins() -> None:
    table = StatusTable()
    table.update(1, B)
    table.update(1, S)
    assert table.update(1, F, "checksum")
    assert table.get(1) is F
    assert table.reason(1) == "checksum"


def test_table_reason_ignored_for_non_failed() -> None:
    table = StatusTable()
    table.update(1, B, "hello")
    table.update(1, T, "world")
    assert table.reason(1) is None


def test_table_failed_without_reason_then_with_reason() -> None:
    table = StatusTable()
    table.update(1, B)
    assert table.update(1, F)
    assert not table.update(1, F, "too late")
    assert table.reason(1) is None


def test_table_clear_and_late_updates() -> None:
    table = StatusTable()
    table.update(1, B)
    table.update(1, F, "boom")
    table.clear(1)
    table.clear(1)  # no-op
    table.clear(99)  # absent: no-op
    assert 1 not in table
    assert table.get(1) is None
    assert table.reason(1) is None
    assert not table.update(1, F, "late failure")
    assert not table.update(1, S)
    assert not table.update(1, T)
    assert 1 not in table
    assert table.reason(1) is None
    # a room id can be reused after clear
    assert table.update(1, B)
    assert table.get(1) is B
    assert table.reason(1) is None


def test_table_on_change() -> None:
    calls: list[tuple[int, KVPoll | None, KVPoll, str | None]] = []

    def record(room: int, old: KVPoll | None, new: KVPoll, reason: str | None) -> None:
        calls.append((room, old, new, reason))

    table = StatusTable(on_change=record)
    table.update(3, T)  # absent: no change, no call
    table.update(3, B)
    table.update(3, B)  # unchanged
    table.update(3, W)
    table.update(3, B)  # lower: unchanged
    table.update(3, F, "bad")
    table.update(3, F, "worse")
    table.clear(3)
    table.update(3, S)
    assert calls == [
        (3, None, B, None),
        (3, B, W, None),
        (3, W, F, "bad"),
    ]


def test_table_on_change_sees_stored_state() -> None:
    seen: list[KVPoll | None] = []
    table: StatusTable

    def record(room: int, old: KVPoll | None, new: KVPoll, reason: str | None) -> None:
        seen.append(table.get(room))

    table = StatusTable(on_change=record)
    table.update(1, W)
    assert seen == [W]


# ------------------------------------------------------------------ PollLatch


def test_poll_latch_success() -> None:
    latch = PollLatch()
    assert latch.latched is None
    assert latch.observe(B) is B
    assert latch.observe(T) is T
    assert latch.observe(W) is W  # non-terminal values pass through
    assert latch.latched is None
    assert latch.observe(S) is S
    assert latch.latched is S
    for status in KVPoll:
        assert latch.observe(status) is S


def test_poll_latch_failed() -> None:
    latch = PollLatch()
    assert latch.observe(F) is F
    for status in KVPoll:
        assert latch.observe(status) is F
    assert latch.latched is F


# ------------------------------------------------------------------ properties


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(UPDATES)), max_size=60))
def test_property_sticky_failed_and_monotone(events: list[tuple[int, KVPoll]]) -> None:
    table = StatusTable()
    failed: set[int] = set()
    for room, update in events:
        before = table.get(room)
        changed = table.update(room, update)
        after = table.get(room)
        assert changed == (after is not before)
        assert after == apply_status(before, update)
        if before is not None:
            assert after is not None  # updates never remove a room
        if room in failed:
            assert after is F
        elif after is F:
            failed.add(room)
        elif before is not None:
            assert after is not None and after >= before


@given(st.lists(st.sampled_from(UPDATES), max_size=40))
def test_property_latch_is_first_terminal(statuses: list[KVPoll]) -> None:
    latch = PollLatch()
    seen = [latch.observe(s) for s in statuses]
    first = next((i for i, s in enumerate(statuses) if s.is_terminal), None)
    if first is None:
        assert seen == statuses
        assert latch.latched is None
    else:
        assert seen[:first] == statuses[:first]
        assert all(s is statuses[first] for s in seen[first:])
        assert latch.latched is statuses[first]


# -- waiting for a status change (RoomSide._wait_until) ------------------------------------------------


async def test_room_waiters_wake_on_change_and_time_out_without_leftovers() -> None:
    import asyncio

    from aiotransfer._kv.room import RoomSide

    room = RoomSide(7)
    loop = asyncio.get_running_loop()
    terminal = lambda: room._status.is_terminal  # noqa: E731
    a = asyncio.ensure_future(room._wait_until(terminal, loop.time() + 5))
    b = asyncio.ensure_future(room._wait_until(terminal, loop.time() + 5))
    await asyncio.sleep(0)
    assert len(room._waiters) == 2
    b.cancel()  # one waiter giving up leaves the other waiting
    await asyncio.sleep(0)
    assert not a.done() and len(room._waiters) == 1
    room.update(KVPoll.Transferring)  # not what ``a`` waits for: it re-arms
    await asyncio.sleep(0)
    assert not a.done()
    room.update(KVPoll.Success)
    assert await asyncio.wait_for(a, 1) is True
    assert room._waiters == set()
    t0 = loop.time()
    assert await RoomSide(8)._wait_until(lambda: False, t0 + 0.02) is False
    assert 0.015 < loop.time() - t0 < 1.0
    live = [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
    assert live == []  # no timer left behind


def test_room_owns_its_status_and_reports_the_end_once() -> None:
    """A room applies apply_status itself: Failed wins and sticks, progress is monotone, and its
    on-terminal callback runs exactly once, with the first reason."""
    from aiotransfer._kv.room import RoomSide

    ended: list[tuple[KVPoll, str | None]] = []
    room = RoomSide(9, on_terminal=lambda r: ended.append((r.status, r.failure_reason)))
    assert room.update(KVPoll.Transferring) is True
    assert room.update(KVPoll.WaitingForInput) is False  # no going back
    assert room.status is KVPoll.Transferring
    assert room.update(KVPoll.Failed, "first") is True
    assert room.update(KVPoll.Failed, "second") is False
    assert room.update(KVPoll.Success) is False  # Failed sticks
    assert ended == [(KVPoll.Failed, "first")]
    assert room.poll() is KVPoll.Failed and room.failure_reason == "first"
