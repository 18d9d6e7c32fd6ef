"""Sleeps on the loop shorter than its millisecond timers (:mod:`aiotransfer._finesleep`)."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from aiotransfer import _finesleep
from aiotransfer._finesleep import FineSleep, fine_sleep

needs_timerfd = pytest.mark.skipif(_finesleep._TIMERFD is None, reason="no timerfd on this platform")


@needs_timerfd
async def test_a_fine_sleep_lasts_at_least_its_time_and_ends_before_the_loops_own() -> None:
    """A timer never fires early; asyncio's rounds its timeout up to a millisecond, the timerfd does not.
    Pairs interleaved, so a busy machine slows both alike."""
    timer = FineSleep(asyncio.get_running_loop())
    fine: list[float] = []
    coarse: list[float] = []
    try:
        for _ in range(30):
            t = time.perf_counter()
            await timer.sleep(0.0002)
            fine.append(time.perf_counter() - t)
            t = time.perf_counter()
            await asyncio.sleep(0.0002)
            coarse.append(time.perf_counter() - t)
    finally:
        timer.close()
    assert min(fine) >= 0.0002
    assert statistics.median(fine) < statistics.median(coarse), (statistics.median(fine), statistics.median(coarse))


@needs_timerfd
def test_both_timerfd_bindings_make_and_arm_a_timer() -> None:
    """The ``ctypes`` binding (Python before 3.13) and ``os``'s own (3.13 on) arm the same one-shot timer."""
    import os
    import select

    for binding in (_finesleep._libc_timerfd(), _finesleep._os_timerfd()):
        if binding is None:
            continue
        make, arm = binding
        fd = make()
        try:
            arm(fd, 1_000_000)
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            assert poller.poll(2000), "the armed timer did not fire"
            assert int.from_bytes(os.read(fd, 8), "little") == 1
        finally:
            os.close(fd)


@needs_timerfd
async def test_one_sleeper_at_a_time_a_cancelled_sleep_leaves_it_usable_and_close_unwatches() -> None:
    loop = asyncio.get_running_loop()
    timer = FineSleep(loop)
    first = asyncio.ensure_future(timer.sleep(5))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one sleeper"):
        await timer.sleep(0.001)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(timer.sleep(0.001), 2)  # re-armed: the cancelled 5 s does not hold it
    timer.close()
    timer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await timer.sleep(0.001)


async def test_without_timerfd_it_falls_back_to_the_loops_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fine_sleep(asyncio.get_running_loop(), enabled=False)[0] is asyncio.sleep  # the knob off
    monkeypatch.setattr(_finesleep, "_TIMERFD", None)
    sleep, close = fine_sleep(asyncio.get_running_loop())
    assert sleep is asyncio.sleep
    close()
    with pytest.raises(OSError, match="no timerfd"):
        FineSleep(asyncio.get_running_loop())
