"""The poll loop's spin-or-sleep policy, on an engine whose transfers finish only when the test says so.

Spinning (``sleep(0)`` between polls) answers a completion at once but keeps a core busy; timed polls leave
the cores to the engine. The loop spins while at most two transfers, or at most ``_SPIN_BYTES``, of at most
``_SPIN_ENTRIES`` entries are in flight, and polls on timed sleeps when more work is queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest

from aiotransfer import _finesleep, _poller
from aiotransfer._driver import Driver
from aiotransfer._plan import Blocks
from aiotransfer._poller import Poller
from aiotransfer.engines._base import (
    EngineBase,
    EngineStatus,
    EngineTraits,
    TransferEngine,
    TransferHandle,
)
from aiotransfer.errors import EngineError, TransferTimeout

WATCH_S = 0.1


class HeldEngine(EngineBase):
    """Transfers posted from the loop that stay pending until ``released``; counts ``check`` calls."""

    name = "held"
    traits = EngineTraits()

    def __init__(self) -> None:
        self.checks = 0
        self.released = False

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        return self.submit_write(peer, blocks)

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        return TransferHandle(token=object(), peer=peer, entries=len(blocks), nbytes=blocks.nbytes)

    def check(self, handle: TransferHandle) -> EngineStatus:
        self.checks += 1
        return handle.finish(EngineStatus.DONE) if self.released else EngineStatus.PENDING


async def _until(condition: Callable[[], object], seconds: float = 5.0) -> None:
    """Poll ``condition`` every millisecond for at most ``seconds``."""
    for _ in range(int(seconds * 1000)):
        if condition():
            return
        await asyncio.sleep(0.001)


def _one_entry(nbytes: int, entry: int = 32768) -> Blocks:
    """One entry of ``nbytes``; ``-n``: ``n`` entries of ``entry`` bytes."""
    if nbytes < 0:
        n = -nbytes
        return Blocks(np.arange(n, dtype=np.uint64) * entry, np.arange(n, dtype=np.uint64) * entry,
                      np.full(n, entry, dtype=np.uint64))
    return Blocks(np.array([4096], np.uint64), np.array([8192], np.uint64), np.array([nbytes], np.uint64))


async def _checks_per_handle(count: int, nbytes: int, entry: int = 32768) -> tuple[float, int]:
    """Poll-loop ``check`` calls per in-flight handle during WATCH_S with ``count`` transfers of ``nbytes``,
    and the loop iterations in that time (a task that yields at every iteration counts them)."""
    engine = HeldEngine()
    driver = Driver("poller-test")
    poller = _held_poller(engine, driver)
    writes = [asyncio.ensure_future(poller.write("peer", _one_entry(nbytes, entry), timeout=10)) for _ in range(count)]
    try:
        while poller.in_flight < count:
            await asyncio.sleep(0)
        ticks = 0
        watching = True

        async def ticker() -> None:
            nonlocal ticks
            while watching:
                ticks += 1
                await asyncio.sleep(0)

        before = engine.checks
        counting = asyncio.ensure_future(ticker())
        await asyncio.sleep(WATCH_S)
        per_handle = (engine.checks - before) / count
        watching = False
        await counting
        engine.released = True
        await asyncio.wait_for(asyncio.gather(*writes), 5)
        assert poller.in_flight == 0 and poller.completed == count
        return per_handle, ticks
    finally:
        await poller.aclose(1.0)
        driver.close()


@pytest.mark.parametrize(
    ("count", "nbytes", "entry", "spins"),
    [
        (1, 256 << 20, 0, True),  # one large write: spinning is what matches a raw thread
        (2, 64 << 20, 0, True),
        (8, 4096, 0, True),  # many small requests, 32 KiB queued: completions are imminent
        (1, -16, 2048, True),  # one write of 16 small entries
        (3, 8 << 20, 0, False),  # the engine has work queued: leave it the cores
        (8, 8 << 20, 0, False),
        (1, -64, 32768, False),  # one write of 64 entries (a room over 64 KV buffers), 2 MiB: work queued too
        (1, -64, 2048, False),  # ... however small: 128 KiB in 64 entries is 64 entries of work for the engine
        (1, -512, 2048, False),  # one streamed layer of 256 pages over 2 buffers
    ],
)
async def test_spins_only_while_little_is_queued(count: int, nbytes: int, entry: int, spins: bool) -> None:
    per_handle, ticks = await _checks_per_handle(count, nbytes, entry or 32768)
    # timed polls: one check per poll_interval_min (0.1 ms) until _BACKOFF_AFTER without progress, then
    # doubling to one per poll_interval_max (1 ms); with slack
    timed_max = (_poller._BACKOFF_AFTER / 0.0001 + WATCH_S / 0.001) * 1.5
    if spins:
        # spinning polls at every loop iteration, however fast the machine runs them; timed polls check
        # once a millisecond while the ticker alone keeps the loop turning
        assert per_handle > 0.5 * ticks, (per_handle, ticks)
    else:
        assert per_handle <= timed_max and per_handle < 0.5 * ticks, (per_handle, ticks)


@pytest.mark.skipif(_finesleep._TIMERFD is None, reason="no timerfd on this platform")
async def test_a_fine_timer_polls_few_entries_below_the_loops_millisecond() -> None:
    """The loop's own timers wake in whole milliseconds, so timed polls of a 64-entry write ask the engine about
    once a millisecond; with ``fine_timer`` they ask at ``interval_min`` (0.1 ms, plus the wake-up). A write of
    more than ``_FINE_ENTRIES`` keeps the loop's timers."""

    async def checks(entries: int, fine: bool) -> int:
        """``check`` calls on one held write before the back-off, the loop otherwise idle (a task that kept it turning
        would have its timers looked at on every iteration, precisely)."""
        engine, driver = HeldEngine(), Driver("poller-test")
        poller = _held_poller(engine, driver, fine=fine)
        write = asyncio.ensure_future(poller.write("peer", _one_entry(-entries, 2048), timeout=10))
        try:
            await _until(lambda: poller.in_flight == 1)
            before = engine.checks
            await asyncio.sleep(0.8 * _poller._BACKOFF_AFTER)  # before timed polls back off
            counted = engine.checks - before
            engine.released = True
            await asyncio.wait_for(write, 5)
            return counted
        finally:
            await poller.aclose(1.0)
            driver.close()

    coarse, fine = await checks(64, False), await checks(64, True)
    assert fine > 2 * coarse, (fine, coarse)
    many_coarse, many_fine = await checks(512, False), await checks(512, True)
    assert many_fine < 2 * many_coarse + 3 and many_fine < fine / 2, (many_fine, many_coarse, fine)


def test_spin_thresholds_are_the_documented_ones() -> None:
    assert _poller._SPIN_DEPTH == 2 and _poller._SPIN_BYTES == 1 << 20 and _poller._SPIN_ENTRIES == 16
    assert _poller._BACKOFF_AFTER == 0.01


def _held_poller(engine: HeldEngine, driver: Driver, max_batch: int = 1024, expire_after: float = 60.0,
                 fine: bool = False) -> Poller:
    return Poller(cast(TransferEngine, engine), driver, max_in_flight=1024, max_batch=max_batch,
                  interval_min=0.0001, interval_max=0.001, expire_after=expire_after, fine_timer=fine)


async def test_on_done_runs_at_completion_before_the_writer_resumes() -> None:
    engine, driver = HeldEngine(), Driver("poller-test")
    poller = _held_poller(engine, driver)
    order: list[str] = []

    async def writer() -> None:
        await poller.write("peer", _one_entry(4096), timeout=5, on_done=lambda: order.append("on_done"))
        order.append("resumed")

    task = asyncio.ensure_future(writer())
    try:
        while poller.in_flight < 1:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert order == []  # nothing before the engine reports the write done
        engine.released = True
        await asyncio.wait_for(task, 5)
        assert order == ["on_done", "resumed"]
    finally:
        await poller.aclose(1.0)
        driver.close()


class LandedEngine(HeldEngine):
    """Writes the engine reports complete when they are posted (NIXL's inline copies over shared memory)."""

    def __init__(self, landed: bool, outcome: EngineStatus = EngineStatus.DONE) -> None:
        super().__init__()
        self.landed, self.outcome = landed, outcome

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        handle = super().submit_write(peer, blocks)
        handle.landed = self.landed
        return handle

    def check(self, handle: TransferHandle) -> EngineStatus:
        self.checks += 1
        return handle.finish(self.outcome, "refused" if self.outcome is EngineStatus.FAILED else None)


@pytest.mark.parametrize("landed", [True, False])
async def test_a_write_that_landed_at_post_completes_in_the_submitting_step(landed: bool) -> None:
    """The handle is asked once right after its submission: the write, and its ``on_done`` (where Success
    leaves), end without waiting for the poll loop's next round. Without ``landed`` (the control) the writer
    suspends, and only the poll loop asks."""
    engine, driver = LandedEngine(landed), Driver("poller-test")
    poller = _held_poller(engine, driver)
    done: list[str] = []
    coro = poller.write("peer", _one_entry(4096), timeout=5, on_done=lambda: done.append("on_done"))
    try:
        try:
            coro.send(None)  # the writer's first step: it submits, then returns or suspends
        except StopIteration:
            finished = True
        else:
            finished = False
        assert finished is landed
        assert done == (["on_done"] if landed else [])
        assert engine.checks == (1 if landed else 0)
        coro.close()  # the control's writer gives up; its handle stays with the poll loop until it ends
        await _until(lambda: poller.completed == 1)
        assert poller.in_flight == 0 and poller.completed == 1
    finally:
        coro.close()
        await poller.aclose(1.0)
        driver.close()


async def test_a_landed_write_the_engine_reports_failed_raises_at_once() -> None:
    engine, driver = LandedEngine(True, EngineStatus.FAILED), Driver("poller-test")
    poller = _held_poller(engine, driver)
    try:
        with pytest.raises(EngineError, match="refused"):
            await poller.write("peer", _one_entry(4096), timeout=5)
        assert poller.in_flight == 0 and poller.failed == 1
    finally:
        await poller.aclose(1.0)
        driver.close()


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_on_done_is_not_called_once_the_writer_gave_up(how: str) -> None:
    engine, driver = HeldEngine(), Driver("poller-test")
    poller = _held_poller(engine, driver)
    calls: list[int] = []
    task = asyncio.ensure_future(
        poller.write("peer", _one_entry(4096), timeout=0.05 if how == "timeout" else 5, on_done=lambda: calls.append(1))
    )
    try:
        while poller.in_flight < 1:
            await asyncio.sleep(0)
        if how == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(TransferTimeout):
                await task
        assert poller.pinned == 1  # the engine still owns the transfer
        engine.released = True
        while poller.in_flight:
            await asyncio.sleep(0.001)
        assert calls == [] and poller.completed == 1
    finally:
        await poller.aclose(1.0)
        driver.close()


async def test_on_done_is_ignored_for_writes_split_into_several_handles() -> None:
    engine, driver = HeldEngine(), Driver("poller-test")
    poller = _held_poller(engine, driver, max_batch=1)
    calls: list[int] = []
    two = Blocks(np.array([0, 8192], np.uint64), np.array([0, 8192], np.uint64), np.array([4096, 4096], np.uint64))
    engine.released = True
    try:
        await asyncio.wait_for(poller.write("peer", two, timeout=5, on_done=lambda: calls.append(1)), 5)
        assert calls == [] and poller.completed == 2
    finally:
        await poller.aclose(1.0)
        driver.close()


async def test_a_raising_on_done_still_completes_the_write(caplog: pytest.LogCaptureFixture) -> None:
    engine, driver = HeldEngine(), Driver("poller-test")
    poller = _held_poller(engine, driver)
    engine.released = True

    def boom() -> None:
        raise RuntimeError("boom")

    try:
        await asyncio.wait_for(poller.write("peer", _one_entry(4096), timeout=5, on_done=boom), 5)
        assert poller.completed == 1 and "completion callback failed" in caplog.text
    finally:
        await poller.aclose(1.0)
        driver.close()


# ---------------------------------------------------------------------------------------------------
# Terminal means terminal: a doomed handle fails its write at once and pins its memory until it ends
# ---------------------------------------------------------------------------------------------------


class DoomingEngine(HeldEngine):
    """Writes the engine dooms (a timeout that is not an end) and ends only when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome = EngineStatus.DONE
        self.abandoned: list[TransferHandle] = []

    def check(self, handle: TransferHandle) -> EngineStatus:
        self.checks += 1
        if not self.released:
            handle.doom("engine timeout (still in flight)")
            return EngineStatus.PENDING
        return handle.finish(self.outcome, "failed" if self.outcome is EngineStatus.FAILED else None)

    def abandon(self, handle: TransferHandle) -> None:
        self.abandoned.append(handle)
        super().abandon(handle)


def _counted_hold(held: list[int]) -> _poller.Hold:
    def take() -> Callable[[], None]:
        held[0] += 1

        def give_back() -> None:
            held[0] -= 1

        return give_back

    return take


@pytest.mark.parametrize("late", [EngineStatus.DONE, EngineStatus.FAILED])
async def test_a_doomed_write_fails_at_once_and_holds_its_memory_until_the_engine_ends_it(late: EngineStatus) -> None:
    """The write raises as soon as the engine dooms it; the hold on its memory, its credit and the pinned
    bytes stay until the engine answers terminally, whatever that answer is (a late completion included)."""
    engine, driver = DoomingEngine(), Driver("poller-test")
    engine.outcome = late
    poller = _held_poller(engine, driver)
    held = [0]
    try:
        with pytest.raises(EngineError, match="still in flight"):
            await asyncio.wait_for(poller.write("peer", _one_entry(4096), timeout=5, hold=_counted_hold(held)), 5)
        await asyncio.sleep(0.02)
        assert (held[0], poller.in_flight, poller.doomed, poller.overdue) == (1, 1, 1, 1)
        engine.released = True
        await _until(lambda: not poller.in_flight)
        assert (held[0], poller.in_flight, poller.overdue, poller.expired, engine.abandoned) == (0, 0, 0, 0, [])
    finally:
        await poller.aclose(1.0)
        driver.close()


async def test_a_handle_the_engine_never_ends_is_abandoned_after_the_bound() -> None:
    """Bounded by ``expire_after`` (the release quarantine), counted, and handed to ``abandon``."""
    engine, driver = DoomingEngine(), Driver("poller-test")
    poller = _held_poller(engine, driver, expire_after=0.05)
    held = [0]
    try:
        with pytest.raises(EngineError):
            await asyncio.wait_for(poller.write("peer", _one_entry(4096), timeout=5, hold=_counted_hold(held)), 5)
        assert held[0] == 1
        await _until(lambda: not poller.in_flight)
        assert (held[0], poller.in_flight, poller.expired, len(engine.abandoned)) == (0, 0, 1, 1)
    finally:
        await poller.aclose(1.0)
        driver.close()


async def test_a_write_that_timed_out_counts_towards_the_bound_from_then() -> None:
    """A write whose caller gave up (its timeout) and that the engine never ends is abandoned too."""
    engine, driver = HeldEngine(), Driver("poller-test")
    poller = _held_poller(engine, driver, expire_after=0.05)
    try:
        with pytest.raises(TransferTimeout):
            await poller.write("peer", _one_entry(4096), timeout=0.01)
        assert poller.overdue == 1
        await _until(lambda: not poller.in_flight)
        assert (poller.in_flight, poller.expired) == (0, 1)
    finally:
        await poller.aclose(1.0)
        driver.close()


class DriverEngine(HeldEngine):
    """Never posts from the loop: every write goes to the driver thread, whose post takes ``delay``."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.threads: set[int] = set()

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        return None

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        import threading
        import time

        self.threads.add(threading.get_ident())
        time.sleep(self.delay)
        return super().submit_write(peer, blocks)


async def test_writes_the_loop_cannot_post_go_to_one_driver_thread() -> None:
    import threading

    engine, driver = DriverEngine(0.002), Driver("poller-test")
    engine.released = True
    poller = _held_poller(engine, driver)
    try:
        await asyncio.wait_for(asyncio.gather(*(poller.write("peer", _one_entry(4096), timeout=5) for _ in range(20))), 10)
        assert poller.completed == 20
        assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
    finally:
        await poller.aclose(1.0)
        driver.close()


async def test_results_the_driver_finishes_together_wake_the_loop_once() -> None:
    """Twenty calls finished while the loop was busy come back in one batch: one wake-up, not twenty."""
    import time

    driver = Driver("batch-test")
    try:
        await driver.call(int)  # the thread is up
        before = driver.batches
        futs = [driver.call(int, str(i)) for i in range(20)]
        time.sleep(0.2)  # noqa: ASYNC251 (the loop is kept busy on purpose while the driver finishes them all)
        assert await asyncio.wait_for(asyncio.gather(*futs), 5) == list(range(20))
        assert driver.batches - before == 1
    finally:
        driver.close()


async def test_a_submit_abandoned_while_the_driver_posts_it_is_adopted_and_pins_until_it_ends() -> None:
    engine, driver = DriverEngine(0.2), Driver("poller-test")
    poller = _held_poller(engine, driver)
    held = [0]
    try:
        with pytest.raises(TransferTimeout):
            await poller.write("peer", _one_entry(4096), timeout=0.01, hold=_counted_hold(held))
        assert held[0] == 1  # the submission still runs on the driver
        await _until(lambda: poller.in_flight)
        assert poller.in_flight == 1 and held[0] == 1  # adopted: the handle holds now
        engine.released = True
        await _until(lambda: not poller.in_flight)
        assert (held[0], poller.in_flight, poller.completed) == (0, 0, 1)
    finally:
        await poller.aclose(1.0)
        driver.close()


class SlicedEngine(HeldEngine):
    """Takes at most four entries per post from the loop (``inline_slice``), like Mooncake's one call an entry."""

    traits = EngineTraits(inline_slice=4)

    def __init__(self) -> None:
        super().__init__()
        self.posts: list[int] = []
        self.released = True

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        assert len(blocks) <= 4, "a post larger than the engine's slice"
        self.posts.append(len(blocks))
        return self.submit_write(peer, blocks)


async def test_a_write_larger_than_the_engines_slice_is_posted_in_slices_from_the_loop() -> None:
    """Ten entries go as 4 + 4 + 2, each posted by the loop itself, other tasks running between the posts."""
    engine, driver = SlicedEngine(), Driver("poller-test")
    poller = _held_poller(engine, driver)
    ten = Blocks(np.arange(10, dtype=np.uint64) * 4096, np.arange(10, dtype=np.uint64) * 4096,
                 np.full(10, 4096, dtype=np.uint64))
    seen: list[int] = []

    async def ticker() -> None:
        while True:
            seen.append(len(engine.posts))
            await asyncio.sleep(0)

    tick = asyncio.ensure_future(ticker())
    try:
        await asyncio.sleep(0)
        await asyncio.wait_for(poller.write("peer", ten, timeout=5), 5)
        assert engine.posts == [4, 4, 2] and poller.completed == 3 and driver.queued == 0
        assert {1, 2} <= set(seen), f"no task ran between the slices: {seen}"
    finally:
        tick.cancel()
        await poller.aclose(1.0)
        driver.close()


# ---------------------------------------------------------------------------------------------------
# Credit: every way a write can give up on its entries gives their credit back exactly once
# ---------------------------------------------------------------------------------------------------


class _Room:
    """A room as the poll loop sees it (:class:`_poller.WriteGuard`); ``failed`` refuses new writes."""

    def __init__(self) -> None:
        self.failed = False
        self.write_failures = 0

    def take(self) -> Callable[[], None]:
        return lambda: None

    def admit(self) -> None:
        if self.failed:
            raise EngineError("room failed")

    def write_failed(self) -> None:
        self.write_failures += 1


def _entries(n: int, base: int, dst: int) -> Blocks:
    pages = np.arange(n, dtype=np.uint64) * 4096
    return Blocks(base + pages, dst + pages, np.full(n, 4096, dtype=np.uint64))


async def test_an_abandoned_write_gives_its_credit_back_exactly_once() -> None:
    """Writes give up in every way there is, on the memory engine (aiotransfer.testing, in manual mode: submits wait behind
    a hanging handshake on the driver, timeouts doom without ending): a write that times out while the driver
    still posts it (the post is adopted when it comes), one cancelled there, one the engine dooms and never
    ends (abandoned after ``expire_after``), one whose room failed before its post. Throughout, the entries
    the engine holds never exceed the credit taken, nor the credit the cap; once all is over the credit is
    back to zero, not below (a credit given back twice lets the next writes past the cap)."""
    from types import SimpleNamespace

    from aiotransfer.engines._base import MemoryRegion
    from aiotransfer.testing import MemoryEngine, MemoryFabric

    cap = 4
    clock = SimpleNamespace(t=0.0)
    fabric = MemoryFabric(auto_complete=False, clock=lambda: float(clock.t), engine_timeout_s=5.0, landing_grace_s=1.0)
    src, dst, other = MemoryEngine(fabric), MemoryEngine(fabric), MemoryEngine(fabric)
    buf, into = np.zeros(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
    base, dst_base = int(buf.ctypes.data), int(into.ctypes.data)
    src.register([MemoryRegion(base, buf.nbytes)])
    dst.register([MemoryRegion(dst_base, into.nbytes)])
    src.connect(dst.session_id, b"", 0)
    driver = Driver("poller-credit-test")
    poller = Poller(cast(TransferEngine, src), driver, max_in_flight=cap, max_batch=1024, interval_min=0.0001,
                    interval_max=0.001, expire_after=0.5)
    peer = dst.session_id
    loop = asyncio.get_running_loop()
    seen: list[tuple[int, int]] = []  # (credit used, entries the engine holds) at every loop iteration
    watching = True

    def held() -> int:
        return sum(len(w.entries) for w in fabric.writes if w.outcome == "pending" and not w.abandoned)

    def check() -> None:
        used, engine = poller._credits_for(peer, loop).used, held()
        seen.append((used, engine))
        assert 0 <= used <= cap and engine <= used, f"credit {used} (cap {cap}) with {engine} entries in the engine"

    async def watch() -> None:
        while watching:
            check()
            await asyncio.sleep(0)

    watcher = asyncio.ensure_future(watch())
    try:
        # 1. Posts that wait on the driver behind a hanging handshake: one times out, one is cancelled.
        fabric.hang_handshakes(True)
        shaking = driver.call(src.connect, other.session_id, b"", 0)
        await _until(lambda: fabric.handshakes)
        with pytest.raises(TransferTimeout):
            await poller.write(peer, _entries(2, base, dst_base), timeout=0.05)
        cancelled = asyncio.ensure_future(poller.write(peer, _entries(2, base, dst_base), timeout=10))
        await _until(lambda: driver.queued >= 3)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        check()
        # both posts are still coming: their credit is still taken, so a third write waits for credit
        late = asyncio.ensure_future(poller.write(peer, _entries(2, base, dst_base), timeout=10))
        await asyncio.sleep(0.05)
        check()
        fabric.hang_handshakes(False)
        await asyncio.wait_for(shaking, 5)
        await _until(lambda: poller.in_flight == 2)  # both adopted, polled to their end
        assert not late.done() and poller.in_flight == 2
        for w in fabric.pending():
            fabric.complete(w)
        await _until(lambda: len(fabric.pending()) == 1)  # served once the adopted posts ended
        fabric.complete(fabric.pending()[0])
        await asyncio.wait_for(late, 5)
        # 2. A write the engine dooms (its timeout) and never ends: it fails at once, its credit stays taken
        # until the quarantine abandons it.
        doomed = asyncio.ensure_future(poller.write(peer, _entries(3, base, dst_base), timeout=10))
        await _until(lambda: poller.in_flight == 1)
        clock.t += 10.0
        with pytest.raises(EngineError, match="engine timeout"):
            await asyncio.wait_for(doomed, 5)
        assert poller._credits_for(peer, loop).used == 3
        await _until(lambda: poller.expired == 1)
        # 3. A write whose room failed while it waited for credit posts nothing and gives its credit back.
        room = _Room()
        blocker = asyncio.ensure_future(poller.write(peer, _entries(cap, base, dst_base), timeout=10))
        await _until(lambda: poller.in_flight == 1)
        refused = asyncio.ensure_future(poller.write(peer, _entries(2, base, dst_base), timeout=10, guard=room))
        await asyncio.sleep(0.01)
        room.failed = True
        fabric.complete(fabric.pending()[-1])
        await asyncio.wait_for(blocker, 5)
        with pytest.raises(EngineError, match="room failed"):
            await asyncio.wait_for(refused, 5)
        await _until(lambda: not poller.in_flight and not driver.queued)
        await asyncio.sleep(0.01)
        check()
        assert poller._credits_for(peer, loop).used == 0 and held() == 0
        assert max(used for used, _ in seen) <= cap and min(used for used, _ in seen) >= 0
        assert (poller.completed, poller.expired) == (4, 1)
    finally:
        watching = False
        await watcher
        fabric.hang_handshakes(False)
        await poller.aclose(1.0)
        driver.close()


async def test_a_write_of_thousands_of_slices_costs_linear_work() -> None:
    """A write of 2,048 slices (one handle each, posted from the loop) to one peer: while they run, each poll
    round asks about a few of the oldest only, so a round costs the same however deep the queue (2,048
    handles asked about each round would cost 2,048 checks). The negative control asks about every handle."""
    slices = 2048

    async def per_round(ahead: int) -> float:
        engine, driver = HeldEngine(), Driver("poller-test")
        poller = Poller(cast(TransferEngine, engine), driver, max_in_flight=1 << 20, max_batch=1,
                        interval_min=0.0001, interval_max=0.001, expire_after=60.0)
        saved = _poller._AHEAD
        _poller._AHEAD = ahead
        try:
            write = asyncio.ensure_future(poller.write("peer", _one_entry(-slices), timeout=30))
            await _until(lambda: poller.in_flight == slices, 20)
            before = engine.checks
            await asyncio.sleep(WATCH_S)  # timed rounds, about one a millisecond
            rounds = WATCH_S / 0.001
            asked = engine.checks - before
            engine.released = True
            await asyncio.wait_for(write, 20)
            assert poller.completed == slices
            return asked / rounds
        finally:
            _poller._AHEAD = saved
            await poller.aclose(1.0)
            driver.close()

    bounded, unbounded = await per_round(_poller._AHEAD), await per_round(1 << 30)
    assert unbounded > 20 * bounded, (bounded, unbounded)

