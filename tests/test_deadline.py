"""Bounded waits that never swallow a cancellation: ``within``, the staging arena's wait for space, and the
poller's wait for engine credit. Each race is built deterministically: the awaited thing completes and the
waiter is cancelled in the same loop iteration (``asyncio.wait_for`` before Python 3.12 then returns the result
and the waiter goes on as if never cancelled: an interrupted send waited out its whole deadline)."""

from __future__ import annotations

import asyncio
import sys
import weakref
from typing import cast

import numpy as np
import pytest

from aiotransfer._deadline import reap, within
from aiotransfer._driver import Driver
from aiotransfer._poller import Credits, Poller
from aiotransfer._staging import StagingArena
from aiotransfer.engines._base import TransferEngine
from aiotransfer.errors import TransferTimeout


async def _race(wait: object, complete: object) -> asyncio.Task[str]:
    """Start ``wait`` (a coroutine) in a task, then complete what it waits for and cancel it in one iteration."""

    async def waiter() -> str:
        await wait  # type: ignore[misc]
        return "went on"

    task = asyncio.ensure_future(waiter())
    for _ in range(3):
        await asyncio.sleep(0)  # the waiter is now parked
    complete()  # type: ignore[operator]
    task.cancel()
    return task


async def test_within_is_cancelled_when_the_cancellation_races_the_result() -> None:
    event = asyncio.Event()
    task = await _race(within(event.wait(), 10), event.set)
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps the cancellation from 3.12 on")
async def test_the_same_race_is_lost_by_wait_for_before_3_12() -> None:
    """The control: the race above is real (on this Python, wait_for swallows it)."""
    event = asyncio.Event()
    task = await _race(asyncio.wait_for(event.wait(), 10), event.set)
    assert await task == "went on"


async def test_within_times_out_and_returns_results() -> None:
    with pytest.raises(asyncio.TimeoutError):
        await within(asyncio.Event().wait(), 0.01)
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, fut.set_result, 7)
    assert await within(fut, 5) == 7


async def test_an_arena_wait_cancelled_as_space_frees_is_cancelled_and_takes_nothing() -> None:
    arena = StagingArena(1 << 16)
    off = await arena.acquire(1 << 16, 1)
    task = await _race(arena.acquire(1 << 16, 10), lambda: arena.release(off, 1 << 16))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert arena.in_use == 0


async def test_credits_granted_as_the_wait_is_cancelled_go_back() -> None:
    credits = Credits(4)
    assert credits.try_acquire(4)
    task = await _race(credits.acquire(4, None), lambda: credits.release(4))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert credits.used == 0 and credits.try_acquire(4)


async def test_a_credit_wait_ends_at_its_deadline_and_leaves_no_waiter() -> None:
    credits = Credits(4)
    assert credits.try_acquire(4)
    loop = asyncio.get_running_loop()
    with pytest.raises(TransferTimeout, match="engine credit"):
        await credits.acquire(2, loop.time() + 0.02)
    credits.release(4)
    assert credits.used == 0 and credits.try_acquire(4)  # the expired wait took nothing and blocks no one


async def test_reap_ends_the_task_and_keeps_the_callers_cancellation() -> None:
    ended = asyncio.Event()

    async def background() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await ended.wait()  # a slow goodbye: reap waits for it

    async def closer(task: asyncio.Task[None]) -> str:
        await reap(task, 10)
        return "went on"

    task = asyncio.ensure_future(background())
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(closer(task))
    await asyncio.sleep(0.01)
    closing.cancel()  # the caller is cancelled while it waits for the task's end
    with pytest.raises(asyncio.CancelledError):
        await closing
    ended.set()
    assert await reap(task, 1) and task.cancelled()
    release = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # ignores the cancellation until released

    stuck = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    assert not await reap(stuck, 0.01)  # bounded: a task that does not end in time is reported, not awaited
    release.set()
    assert await reap(stuck, 1)


async def test_a_reaped_task_keeps_nothing_its_frames_referenced() -> None:
    """A cancelled task stores its error, and the error's traceback holds the task's frames: reaped, nothing
    they referenced stays alive (a closed NIXL agent's progress thread span on at 100% CPU when it did)."""

    class Held:
        pass

    async def loop_over(held: Held) -> None:
        await asyncio.Event().wait()

    held = Held()
    alive = weakref.ref(held)
    task = asyncio.ensure_future(loop_over(held))
    await asyncio.sleep(0)
    del held
    assert await reap(task, 1)
    assert alive() is None


async def test_a_peers_credits_are_forgotten_once_none_are_in_use() -> None:
    """A process that writes to many peers over its life keeps credit entries only for peers with writes in
    flight (or waiting for credit): the table is empty again once every write ended. The entries are keyed by
    the engine and loop objects, so a later engine reusing a dead one's id cannot inherit its credit."""
    from aiotransfer import _poller
    from aiotransfer._plan import Blocks
    from aiotransfer.engines._base import MemoryRegion
    from aiotransfer.testing import MemoryEngine, MemoryFabric

    fabric = MemoryFabric()
    src = MemoryEngine(fabric)
    buf = np.zeros(1 << 16, dtype=np.uint8)
    base = int(buf.ctypes.data)
    src.register([MemoryRegion(base, buf.nbytes)])
    peers = []
    for _ in range(20):
        dst = MemoryEngine(fabric)
        into = np.zeros(1 << 16, dtype=np.uint8)
        dst.register([MemoryRegion(int(into.ctypes.data), into.nbytes)])
        src.connect(dst.session_id, b"", 0)
        peers.append((dst, into))
    driver = Driver("deadline-credit-table-test")
    poller = Poller(cast(TransferEngine, src), driver, max_in_flight=64, max_batch=1024, interval_min=0.0001,
                    interval_max=0.001, expire_after=5.0)
    before = len(_poller._SHARED_CREDITS)
    try:
        writes = [poller.write(dst.session_id, Blocks(base + np.arange(2, dtype=np.uint64) * 4096, int(into.ctypes.data) + np.arange(2, dtype=np.uint64) * 4096, np.full(2, 4096, dtype=np.uint64)), timeout=10)
                  for dst, into in peers]
        await asyncio.wait_for(asyncio.gather(*writes), 10)
        assert len(_poller._SHARED_CREDITS) == before
        mine = [k for k in _poller._SHARED_CREDITS if k[0] is src.credit_scope]
        assert mine == []
    finally:
        await poller.aclose(1.0)
        driver.close()
