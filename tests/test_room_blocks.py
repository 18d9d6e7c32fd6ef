"""A room is a resource, and a bound has one meaning.

``async with mgr.sender(room)`` / ``async with mgr.receiver(room, peer)``: leaving the block without success (an
exception, a cancellation, a block that simply ended first) aborts the room with the cause as its reason, which
the other side learns, and the block exits once the room's pages are released; the exception propagates as it
was. ``timeout=`` and an outer cancellation (``asyncio.timeout``, ``asyncio.wait_for``, ``task.cancel()``, anyio's
``fail_after``) of ``done()`` / ``wait_ready()`` end the room the same way: aborted on both sides. ``timeout=None``
is no bound of the call's own; ``DEFAULT`` is the configuration's.

The blocks run against a peer in another OS process on a real engine; the bound forms use two managers in this
process on the same engine (what they check is which messages leave, and in what order)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from aiotransfer import (
    DEFAULT,
    InvalidArgument,
    KVArgs,
    KVManager,
    KVPoll,
    TransferConfig,
    TransferFailed,
    TransferTimeout,
)
from aiotransfer._kv.notify import Notifier
from tests.peer import digest, make_buffers
from tests.remote import RemoteError, RemotePeer

try:
    anyio: Any = importlib.import_module("anyio")
except ImportError:  # not a dependency of aiotransfer: its cancel scopes are checked where it is installed
    anyio = None

GEO: dict[str, Any] = {"buffers": 4, "pages": 2048, "item_len": 4096}
SEED = 11
"""The remote prefill's buffers are ``make_buffers(..., seed=SEED)``."""

FORMS = [
    "timeout=",
    pytest.param("asyncio.timeout", marks=pytest.mark.skipif(sys.version_info < (3, 11),
                                                             reason="asyncio.timeout is Python 3.11+")),
    "wait_for",
    "task.cancel",
    pytest.param("anyio.fail_after", marks=pytest.mark.skipif(
        anyio is None, reason="anyio is not installed (pip install anyio): its cancel scopes are not checked here")),
]


def pages(n: int, seed: int, hi: int = GEO["pages"]) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).permutation(hi)[:n]]


@contextlib.asynccontextmanager
async def local(engine: str, seed: int | None, **cfg: Any) -> AsyncIterator[tuple[KVManager, list[np.ndarray]]]:
    bufs = make_buffers(GEO["buffers"], GEO["pages"], GEO["item_len"], seed)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), TransferConfig(engine=engine, **cfg)) as mgr:
        yield mgr, bufs


@contextlib.asynccontextmanager
async def pair(engine: str, **cfg: Any) -> AsyncIterator[tuple[KVManager, KVManager]]:
    """A prefill and a decode in this process, on a real engine."""
    src = make_buffers(2, 64, 1024, seed=SEED)
    dst = make_buffers(2, 64, 1024, None)
    config = TransferConfig(engine=engine, **cfg)
    async with (
        KVManager(KVArgs(src, page_size=16, dtype="uint8"), config) as pre,
        KVManager(KVArgs(dst, page_size=16, dtype="uint8"), config) as dec,
    ):
        yield pre, dec


async def give_up(form: str, call: Callable[..., Awaitable[None]], seconds: float) -> BaseException:
    """Bound ``call`` (a room's wait that cannot end by itself) in one of the ways a user does; the exception it
    ended with."""
    try:
        if form == "timeout=":
            await call(timeout=seconds)
        elif form == "asyncio.timeout":
            async with asyncio.timeout(seconds):  # type: ignore[attr-defined,unused-ignore]
                await call()
        elif form == "wait_for":
            await asyncio.wait_for(call(), seconds)
        elif form == "task.cancel":
            task = asyncio.ensure_future(call())
            await asyncio.sleep(seconds)
            task.cancel()
            await task
        else:
            assert anyio is not None
            with anyio.fail_after(seconds):
                await call()
    except BaseException as exc:
        return exc
    raise AssertionError(f"{form}: the call returned")


def assert_ended_as(form: str, exc: BaseException) -> None:
    """``timeout=`` raises our TransferTimeout; a timeout outside raises the builtin one; a cancellation stays a
    cancellation."""
    if form == "timeout=":
        assert isinstance(exc, TransferTimeout), repr(exc)
    elif form == "task.cancel":
        assert isinstance(exc, asyncio.CancelledError), repr(exc)
    else:
        assert isinstance(exc, TimeoutError) and not isinstance(exc, TransferTimeout), repr(exc)


# -- async with, across two processes ----------------------------------------------------------------------
async def test_a_sender_block_that_raises_mid_send_exits_once_the_engine_let_go_of_its_pages(engine: str) -> None:
    """The block raises while the engine still reads the room's pages: the room fails on both sides with the
    exception as its reason, and the block exits only once the engine's handles ended. The engine can move a
    whole room before the block raises (NIXL over shared memory): such a try is made again with the next room,
    until one raises with batches still in the engine."""
    decode = await RemotePeer.start(engine, **GEO)
    try:
        async with local(engine, SEED) as (mgr, _):
            held = False
            for room in range(1, 11):
                error = RuntimeError("scheduler crashed")
                with pytest.raises(RuntimeError) as raised:
                    async with mgr.sender(room) as tx:
                        await decode.call("receiver", room=room, peer=mgr.endpoint, pages=pages(1500, 1))
                        await tx.wait_ready(timeout=10)
                        send = asyncio.ensure_future(tx.send_kv(pages(1500, 2), timeout=30))
                        landed = mgr.stats()["engine_completed"]
                        for _ in range(10_000):  # until the engine has (or had) a batch: planning runs on a thread
                            stats = mgr.stats()
                            if stats["in_flight"] or stats["engine_completed"] > landed or send.done():
                                break
                            await asyncio.sleep(0)
                        assert mgr.stats()["senders_active"] == 1
                        held = tx.engine_holds > 0 and not send.done()
                        raise error
                assert raised.value is error  # the exception propagates as it was
                with contextlib.suppress(TransferFailed):
                    await send
                assert tx.is_released(), "the block exited before the room's pages were released"
                assert tx.engine_holds == 0 and mgr.stats()["in_flight"] == 0
                assert mgr.stats()["senders_active"] == 0
                if tx.poll() is KVPoll.Success:  # the send concluded the room before the block raised
                    assert (await decode.call("done", room=room, timeout=10))["status"] == "Success"
                    continue
                reason = "aborted by prefill: RuntimeError: scheduler crashed"
                assert tx.failure_reason == reason
                with pytest.raises(RemoteError) as seen:
                    await decode.call("done", room=room, timeout=10)
                assert seen.value.reason == reason
                if held:
                    break
            assert held, "every room's batches had all ended before its block raised"
    finally:
        await decode.close()


async def test_a_sender_block_that_raises_before_any_send_tells_the_decode_why(engine: str) -> None:
    decode = await RemotePeer.start(engine, **GEO)
    try:
        async with local(engine, SEED) as (mgr, _):
            with pytest.raises(KeyError):
                async with mgr.sender(1) as tx:
                    await decode.call("receiver", room=1, peer=mgr.endpoint, pages=[1, 2, 3])
                    await tx.wait_ready(timeout=10)
                    raise KeyError("no such request")
            reason = "aborted by prefill: KeyError: 'no such request'"
            assert tx.poll() is KVPoll.Failed and tx.failure_reason == reason
            assert tx.is_released() and mgr.stats()["senders_active"] == 0
            with pytest.raises(RemoteError) as seen:
                await decode.call("done", room=1, timeout=10)
            assert seen.value.reason == reason  # the same words on both sides
    finally:
        await decode.close()


async def test_a_receiver_block_that_raises_mid_transfer_exits_once_the_prefill_drained(engine: str) -> None:
    """The prefill is writing into the room's pages when the decode's block raises: the block exits only once
    the prefill acknowledged its drain, so the pages may go back to the pool as it exits."""
    prefill = await RemotePeer.start(engine, seed=SEED, **GEO)
    try:
        async with local(engine, None) as (dec, _):
            await prefill.call("sender", room=1)
            error = ValueError("client went away")
            with pytest.raises(ValueError) as raised:
                async with dec.receiver(1, prefill.endpoint) as rx:
                    await rx.send_metadata(pages(1500, 3), timeout=10)
                    await prefill.call("wait_ready", room=1)
                    send = asyncio.ensure_future(prefill.call("send_kv", room=1, pages=pages(1500, 4)))
                    await asyncio.sleep(0.002)
                    raise error
            assert raised.value is error
            assert rx.is_released() and rx.release_cause == "drained"  # the prefill's acknowledgement
            assert rx.failure_reason == "aborted by decode: ValueError: client went away"
            assert dec.stats()["receivers_active"] == 0
            with pytest.raises(RemoteError, match="aborted by decode: ValueError: client went away"):
                await send
            assert (await prefill.call("reason", room=1))["reason"] == rx.failure_reason
    finally:
        await prefill.close()


async def test_a_sender_block_that_succeeds_leaves_the_room_as_it_is(engine: str) -> None:
    decode = await RemotePeer.start(engine, **GEO)
    try:
        async with local(engine, SEED) as (mgr, bufs):
            dst, src = pages(300, 5), pages(300, 6)
            async with mgr.sender(2) as tx:
                await decode.call("receiver", room=2, peer=mgr.endpoint, pages=dst)
                await tx.wait_ready(timeout=10)
                await tx.send_kv(src, timeout=30)
                await tx.done(timeout=10)
            assert tx.poll() is KVPoll.Success and tx.failure_reason is None
            assert tx.is_released() and tx.release_cause == "success"
            assert (await decode.call("done", room=2, timeout=10))["status"] == "Success"
            assert (await decode.call("digest", pages=dst))["digest"] == digest(bufs, src)
            assert mgr.stats()["senders_active"] == 0
    finally:
        await decode.close()


async def test_a_cancellation_inside_a_sender_block_aborts_the_room_and_stays_a_cancellation(engine: str) -> None:
    decode = await RemotePeer.start(engine, **GEO)
    try:
        async with local(engine, SEED) as (mgr, _):
            inside = asyncio.Event()
            rooms: list[Any] = []

            async def serve() -> None:
                async with mgr.sender(3) as tx:
                    rooms.append(tx)
                    await decode.call("receiver", room=3, peer=mgr.endpoint, pages=[4, 5])
                    await tx.wait_ready(timeout=10)
                    inside.set()
                    await asyncio.Event().wait()  # the scheduler's own work, cancelled from outside

            task = asyncio.ensure_future(serve())
            await asyncio.wait_for(inside.wait(), 20)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            (tx,) = rooms
            assert tx.failure_reason == "aborted by prefill: cancelled"
            assert tx.is_released() and mgr.stats()["senders_active"] == 0
            with pytest.raises(RemoteError) as seen:
                await decode.call("done", room=3, timeout=10)
            assert seen.value.reason == tx.failure_reason
    finally:
        await decode.close()


# -- async with, ordering (two managers in this process) ---------------------------------------------------
async def test_a_receiver_block_left_unfinished_is_aborted_with_that_reason(engine: str) -> None:
    async with pair(engine) as (pre, dec):
        tx = pre.sender(1)
        async with dec.receiver(1, pre.endpoint) as rx:
            await rx.send_metadata([1, 2], timeout=10)
            await tx.wait_ready(timeout=10)
        reason = "aborted by decode: left unfinished (WaitingForInput)"
        assert rx.failure_reason == reason and rx.is_released()
        with pytest.raises(TransferFailed) as seen:
            await tx.done(timeout=10)
        assert seen.value.reason == reason
        await tx.released(timeout=10)


async def test_both_blocks_succeeding_leave_both_rooms_released(engine: str) -> None:
    async with pair(engine) as (pre, dec):
        async with pre.sender(2) as tx, dec.receiver(2, pre.endpoint) as rx:
            await rx.send_metadata([7, 8], timeout=10)
            await tx.wait_ready(timeout=10)
            await tx.send_kv([3, 4], timeout=10)
            await rx.done(timeout=10)
        assert tx.poll() is KVPoll.Success and rx.poll() is KVPoll.Success
        assert tx.is_released() and rx.is_released()
        assert pre.stats()["senders_active"] == 0 and dec.stats()["receivers_active"] == 0


async def test_a_room_is_entered_once() -> None:
    """A second ``async with`` on the same room, nested or after the first block, is refused: one block owns
    the room's end. The first block still ends the room as it would have."""
    async with pair("memory") as (pre, dec):
        tx, rx = pre.sender(3), dec.receiver(3, pre.endpoint)
        async with tx, rx:
            with pytest.raises(InvalidArgument, match="room 3 is already used in an async with block"):
                async with tx:
                    pass
            await rx.send_metadata([7], timeout=10)
            await tx.wait_ready(timeout=10)
            await tx.send_kv([3], timeout=10)
            await rx.done(timeout=10)
        assert tx.poll() is KVPoll.Success and rx.poll() is KVPoll.Success
        for room in (tx, rx):
            with pytest.raises(InvalidArgument, match="already used in an async with block"):
                async with room:
                    pass


async def test_a_done_cancelled_inside_a_block_aborts_once_with_its_own_reason(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``done()`` cancelled inside the block aborts the room; the block's exit, which sees the same
    cancellation, finds the room failed and sends nothing more."""
    notices: list[tuple[int, str]] = []
    abort = Notifier.abort

    async def counted(self: Notifier, room: int, endpoints: Any, reason: str) -> None:
        notices.append((room, reason))
        await abort(self, room, endpoints, reason)

    monkeypatch.setattr(Notifier, "abort", counted)
    async with pair(engine) as (pre, dec):
        tx = pre.sender(4)
        with pytest.raises(TimeoutError):
            async with dec.receiver(4, pre.endpoint) as rx:
                await rx.send_metadata([1], timeout=10)
                await tx.wait_ready(timeout=10)
                await asyncio.wait_for(rx.done(), 0.2)
        reason = "aborted by decode: done() cancelled"
        assert rx.failure_reason == reason and rx.is_released()
        with pytest.raises(TransferFailed) as seen:
            await tx.done(timeout=10)
        assert seen.value.reason == reason
        await asyncio.sleep(0.1)  # a second notice, were one spawned, would be counted by now
        assert notices == [(4, reason)]


@pytest.mark.parametrize("form", [f for f in FORMS if f not in ("timeout=", "wait_for")])
async def test_a_block_cancelled_from_outside_exits_released_and_stays_cancelled(engine: str, form: Any) -> None:
    """The bound is armed once the block is inside (the room asked the prefill to write): the exit aborts the
    room, waits through the cancellation (anyio delivers it again at every loop iteration) until the prefill
    acknowledged the drain, then lets the cancellation, or the timeout it became, go on."""
    async with pair(engine) as (pre, dec):
        tx = pre.sender(1)
        rooms: list[Any] = []
        loop = asyncio.get_running_loop()

        async def block(arm: Callable[[], object]) -> None:
            async with dec.receiver(1, pre.endpoint) as rx:
                rooms.append(rx)
                await rx.send_metadata([1, 2], timeout=10)
                await tx.wait_ready(timeout=10)
                arm()
                await asyncio.Event().wait()

        with pytest.raises(BaseException) as raised:  # which one: checked below
            if form == "asyncio.timeout":
                async with asyncio.timeout(None) as scope:  # type: ignore[attr-defined,unused-ignore]
                    await block(lambda: scope.reschedule(loop.time() + 0.05))
            elif form == "task.cancel":
                task = asyncio.ensure_future(block(lambda: loop.call_soon(task.cancel)))
                await task
            else:
                assert anyio is not None
                with anyio.fail_after(None) as cancel_scope:
                    await block(lambda: setattr(cancel_scope, "deadline", anyio.current_time() + 0.05))
        assert_ended_as(form, raised.value)
        (rx,) = rooms
        assert rx.failure_reason == "aborted by decode: cancelled"
        assert rx.is_released() and rx.release_cause == "drained"
        with pytest.raises(TransferFailed) as seen:
            await tx.done(timeout=10)
        assert seen.value.reason == rx.failure_reason
        assert dec.stats()["receivers_active"] == 0


async def test_a_block_whose_manager_closed_under_it_exits_at_once(engine: str) -> None:
    """Nothing proves a closed manager's pages released (the decode's quarantine would run 63 s): the block's
    exit does not wait for it."""
    async with pair(engine) as (pre, dec):
        tx = pre.sender(5)
        loop = asyncio.get_running_loop()
        async with dec.receiver(5, pre.endpoint) as rx:
            await rx.send_metadata([1, 2], timeout=10)
            await tx.wait_ready(timeout=10)
            await dec.aclose()
            t0 = loop.time()
        assert loop.time() - t0 < 20.0
        assert rx.failure_reason == "manager closed" and not rx.is_released()


# -- one meaning for a bound -------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
async def test_each_bound_on_the_decode_done_aborts_the_room_on_both_sides(engine: str, form: str) -> None:
    async with pair(engine) as (pre, dec):
        tx = pre.sender(1)
        rx = dec.receiver(1, pre.endpoint)
        await rx.send_metadata([1, 2], timeout=10)
        await tx.wait_ready(timeout=10)
        assert_ended_as(form, await give_up(form, rx.done, 0.2))
        expected = ("aborted by decode: decode gave up waiting after 0.2s" if form == "timeout=" else
                    "aborted by decode: done() cancelled")
        assert rx.poll() is KVPoll.Failed and rx.failure_reason == expected
        with pytest.raises(TransferFailed) as seen:
            await tx.done(timeout=10)
        assert seen.value.reason == expected
        await rx.released(timeout=10)
        await tx.released(timeout=10)


@pytest.mark.parametrize("form", FORMS)
async def test_each_bound_on_the_prefill_done_aborts_the_room_on_both_sides(engine: str, form: str) -> None:
    async with pair(engine) as (pre, dec):
        tx = pre.sender(1)
        rx = dec.receiver(1, pre.endpoint)
        await rx.send_metadata([1, 2], timeout=10)
        await tx.wait_ready(timeout=10)
        assert_ended_as(form, await give_up(form, tx.done, 0.2))
        expected = ("aborted by prefill: prefill gave up waiting after 0.2s" if form == "timeout=" else
                    "aborted by prefill: done() cancelled")
        assert tx.poll() is KVPoll.Failed and tx.failure_reason == expected
        with pytest.raises(TransferFailed) as seen:
            await rx.done(timeout=10)
        assert seen.value.reason == expected
        await tx.released(timeout=10)
        await rx.released(timeout=10)


@pytest.mark.parametrize("form", FORMS)
async def test_each_bound_on_wait_ready_fails_the_room_and_a_late_decode_learns_why(engine: str, form: str) -> None:
    async with pair(engine) as (pre, dec):
        tx = pre.sender(1)
        assert_ended_as(form, await give_up(form, tx.wait_ready, 0.2))
        expected = ("decode metadata did not arrive within 0.2s" if form == "timeout=" else
                    "aborted by prefill: wait_ready() cancelled")
        assert tx.poll() is KVPoll.Failed and tx.failure_reason == expected
        assert pre.stats()["senders_active"] == 0
        rx = dec.receiver(1, pre.endpoint)  # the decode speaks only now
        await rx.send_metadata([1, 2], timeout=10)
        with pytest.raises(TransferFailed) as seen:
            await rx.done(timeout=10)
        assert seen.value.reason == expected


# -- the sentinel ------------------------------------------------------------------------------------------
async def test_none_waits_past_the_configured_default_and_default_does_not(engine: str) -> None:
    """With ``done_timeout`` and ``ready_timeout`` at 0.3 s: ``DEFAULT`` gives up after them, ``None`` still
    waits three times as long later, and returns once the room gets there."""
    async with pair(engine, done_timeout=0.3, ready_timeout=0.3) as (pre, dec):
        tx = pre.sender(1)
        with pytest.raises(TransferTimeout, match=r"within 0\.3s"):
            await tx.wait_ready(timeout=DEFAULT)
        tx = pre.sender(2)
        ready = asyncio.ensure_future(tx.wait_ready(timeout=None))
        await asyncio.sleep(1.0)
        assert not ready.done() and tx.poll() is KVPoll.Bootstrapping
        rx = dec.receiver(2, pre.endpoint)
        await rx.send_metadata([1, 2], timeout=10)
        await asyncio.wait_for(ready, 10)

        with pytest.raises(TransferTimeout, match=r"within 0\.3s"):
            await dec.receiver(3, pre.endpoint).done()  # DEFAULT: the config's done_timeout
        done = asyncio.ensure_future(rx.done(timeout=None))
        await asyncio.sleep(1.0)
        assert not done.done() and rx.poll() is KVPoll.WaitingForInput
        with pytest.raises(InvalidArgument, match="needs a bound"):
            await tx.send_kv([5, 6], timeout=None)  # type: ignore[arg-type]
        await tx.send_kv([5, 6], timeout=10)  # the refused call reserved nothing
        await asyncio.wait_for(done, 10)
        assert rx.poll() is KVPoll.Success
