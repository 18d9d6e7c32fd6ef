"""The page lifecycle across real processes: when a room's pages are safe to reuse on each side, and that
a failed transfer never lands in pages handed to another room."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, KVPoll, PeerEvent, TransferConfig, TransferFailed, TransferTimeout
from aiotransfer._kv.prefill import PrefillSide
from aiotransfer._staging import HostCopier
from tests.peer import digest, make_buffers
from tests.remote import RemoteError, RemotePeer

BIG: dict[str, Any] = {"buffers": 4, "pages": 2048, "item_len": 4096}
SEED = 9
"""The remote prefill's buffers are ``make_buffers(..., seed=SEED)``: the test can compute what must land."""
GONE_BOUND = 7.0
"""peer_timeout (3 s) + a heartbeat to notice + a heartbeat to probe its port, with margin."""


def pages(n: int, seed: int, lo: int = 0, hi: int = BIG["pages"]) -> list[int]:
    return [int(x) + lo for x in np.random.default_rng(seed).permutation(hi - lo)[:n]]


def expected(src: list[int]) -> str:
    return digest(make_buffers(BIG["buffers"], BIG["pages"], BIG["item_len"], seed=SEED), src)


@contextlib.asynccontextmanager
async def local_decode(engine: str, **cfg: Any) -> AsyncIterator[tuple[KVManager, list[np.ndarray]]]:
    bufs = make_buffers(BIG["buffers"], BIG["pages"], BIG["item_len"], None)
    config = TransferConfig(engine=engine, **cfg)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), config) as mgr:
        yield mgr, bufs


@contextlib.asynccontextmanager
async def local_prefill(engine: str, staging: str) -> AsyncIterator[KVManager]:
    bufs = make_buffers(BIG["buffers"], BIG["pages"], BIG["item_len"], seed=SEED)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), TransferConfig(engine=engine, staging=staging)) as mgr:
        yield mgr


async def ready_sender(mgr: KVManager, decode: RemotePeer, room: int, dst: list[int]) -> Any:
    tx = mgr.sender(room)
    await decode.call("receiver", room=room, peer=mgr.endpoint, pages=dst)
    await tx.wait_ready(timeout=10)
    return tx


async def open_room(dec: KVManager, prefill: RemotePeer, room: int, dst: list[int]) -> Any:
    await prefill.call("sender", room=room)
    rx = dec.receiver(room, prefill.endpoint)
    await rx.send_metadata(dst)
    await prefill.call("wait_ready", room=room)
    return rx


async def test_decode_abort_is_released_by_the_drain_ack_and_its_pages_reuse_cleanly(engine: str) -> None:
    prefill = await RemotePeer.start(engine, seed=SEED, **BIG)
    try:
        async with local_decode(engine) as (dec, bufs):
            dst = pages(1500, 1)
            rx = await open_room(dec, prefill, 1, dst)
            send = asyncio.ensure_future(prefill.call("send_kv", room=1, pages=pages(1500, 2)))
            await asyncio.sleep(0.002)
            await rx.abort("client went away")
            t_abort = time.monotonic()
            await rx.released(timeout=10)
            latency = time.monotonic() - t_abort
            print(f"decode abort -> released: {latency * 1e3:.1f} ms ({rx.release_cause})")
            assert rx.release_cause == "drained"  # the prefill's acknowledgement, not a timer
            assert dec.stats()["drains_acknowledged"] == 1
            with pytest.raises(RemoteError, match="aborted by decode: client went away"):
                await send
            assert (await prefill.call("reason", room=1))["reason"] == rx.failure_reason
            # the same pages at once for a new room: they end with exactly that room's bytes
            src2 = pages(1500, 3)
            rx2 = await open_room(dec, prefill, 2, dst)
            await prefill.call("send_kv", room=2, pages=src2)
            await rx2.done(timeout=30)
            await asyncio.sleep(0.2)  # any late write of room 1 would land now
            assert digest(bufs, dst) == expected(src2)
    finally:
        await prefill.close()


async def test_a_stopped_prefill_writes_late_only_into_quarantined_pages(engine: str) -> None:
    stopped = await RemotePeer.start(engine, seed=SEED, **BIG)
    other = await RemotePeer.start(engine, seed=SEED, **BIG)
    try:
        async with local_decode(engine) as (dec, bufs):
            held = pages(1500, 4, 0, 1600)  # room 1's pages; room 2 gets pages outside them
            rx = await open_room(dec, stopped, 1, held)
            late = asyncio.ensure_future(stopped.call("send_kv", room=1, pages=pages(1500, 5), timeout=60))
            await asyncio.sleep(0.002)
            stopped.signal(signal.SIGSTOP)
            with pytest.raises(TransferFailed, match="silent for"):
                await rx.done(timeout=30)
            assert rx.poll() is KVPoll.Failed
            await asyncio.sleep(1.0)
            assert not rx.is_released(), rx.release_cause  # a stopped process is not a gone one
            assert rx.awaiting_drain == [stopped.endpoint]
            free = pages(300, 6, 1600, 2048)
            src2 = pages(300, 7)
            rx2 = await open_room(dec, other, 2, free)
            await other.call("send_kv", room=2, pages=src2)
            await rx2.done(timeout=30)
            stopped.signal(signal.SIGCONT)  # its late writes land now, in room 1's quarantined pages
            await rx.released(timeout=30)
            assert rx.release_cause == "drained"
            assert digest(bufs, free) == expected(src2)
            with pytest.raises(RemoteError):  # the resumed prefill learned of the decode's abort
                await late
    finally:
        stopped.signal(signal.SIGCONT)
        await stopped.close()
        await other.close()


async def test_a_killed_prefill_is_proven_gone_within_the_bound(engine: str) -> None:
    prefill = await RemotePeer.start(engine, seed=SEED, **BIG)
    events: list[PeerEvent] = []
    try:
        async with local_decode(engine) as (dec, _):
            dec.add_peer_listener(events.append)
            rx = await open_room(dec, prefill, 1, pages(100, 8))
            prefill.signal(signal.SIGKILL)
            t0 = time.monotonic()
            await rx.released(timeout=20)
            elapsed = time.monotonic() - t0
            print(f"prefill killed -> released after {elapsed:.2f}s ({rx.release_cause})")
            assert rx.release_cause == "peer-gone"
            assert elapsed < GONE_BOUND
            kinds = [(e.kind, e.peer) for e in events]
            assert ("dead", prefill.endpoint) in kinds and ("gone", prefill.endpoint) in kinds
            assert next(e for e in events if e.kind == "dead").rooms == (1,)
    finally:
        await prefill.close()


async def test_prefill_release_waits_for_the_handles_of_a_cancelled_send(engine: str) -> None:
    """A send cancelled while the engine still has batches of it: the room fails at once, and its pages are
    released only once those batches ended (then the decode hears the drain). NIXL over shared memory can
    move a whole room before the cancellation lands: such a try is made again with the next room, until one
    is cancelled with batches still in the engine."""
    decode = await RemotePeer.start(engine, **BIG)
    try:
        async with local_prefill(engine, "never") as mgr:
            for room in range(1, 11):
                tx = await ready_sender(mgr, decode, room, pages(2000, 9))
                send = asyncio.ensure_future(tx.send_kv(pages(2000, 10), timeout=30))
                landed = mgr.stats()["engine_completed"]
                for _ in range(10_000):  # until the engine has (or had) a batch: the plan is computed on a thread
                    stats = mgr.stats()
                    if stats["in_flight"] or stats["engine_completed"] > landed or send.done():
                        break
                    await asyncio.sleep(0)
                send.cancel()
                with contextlib.suppress(asyncio.CancelledError, TransferFailed):
                    await send
                if tx.poll() is KVPoll.Success:  # the room concluded before the cancellation: try again
                    assert tx.is_released() and (await decode.call("released", room=room))["cause"] == "success"
                    continue
                assert tx.poll() is KVPoll.Failed
                held = not tx.is_released() and tx.engine_holds > 0  # the engine still reads the pages
                await tx.released(timeout=30)
                assert tx.release_cause == "drained" and tx.engine_holds == 0
                assert mgr.stats()["in_flight"] == 0
                # the decode hears the drain too, and releases on it
                assert (await decode.call("released", room=room, timeout=30))["cause"] == "drained"
                if held:
                    break
            assert held, "every room's batches had all ended before its send was cancelled"
    finally:
        await decode.close()


async def test_aborted_staged_rooms_give_all_staging_space_back_on_both_sides(engine: str) -> None:
    env = {"AIOTRANSFER_STAGING": "always", "AIOTRANSFER_STAGING_BYTES": str(8 << 20)}
    prefill = await RemotePeer.start(engine, seed=SEED, env=env, **BIG)
    try:
        async with local_decode(engine, staging="always", staging_bytes=8 << 20) as (dec, bufs):
            rooms, sends = [], []
            for room in range(1, 6):
                rx = await open_room(dec, prefill, room, pages(128, 20 + room))
                sends.append(asyncio.ensure_future(prefill.call("send_kv", room=room, pages=pages(128, 30 + room))))
                rooms.append(rx)
            await asyncio.sleep(0.005)
            for rx in rooms:
                await rx.abort("cancelled by the scheduler")
            for rx in rooms:
                await rx.released(timeout=30)
            await asyncio.gather(*sends, return_exceptions=True)
            assert dec.stats()["staging_bytes_in_use"] == 0
            for _ in range(200):
                if (await prefill.call("stats"))["stats"]["staging_bytes_in_use"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await prefill.call("stats"))["stats"]["staging_bytes_in_use"] == 0
            dst, src = pages(128, 40), pages(128, 41)  # a later staged room still goes through
            rx = await open_room(dec, prefill, 9, dst)
            await prefill.call("send_kv", room=9, pages=src)
            await rx.done(timeout=30)
            assert digest(bufs, dst) == expected(src)
    finally:
        await prefill.close()


async def test_an_aborted_room_is_not_released_while_its_own_scatter_still_writes_its_pages(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill's drain proves none of its writes can land; a staged piece the decode is still copying from
    its arena into the room's pages holds the release until that copy is over."""
    entered, go = threading.Event(), threading.Event()
    scatter = HostCopier.scatter

    def held_scatter(self: HostCopier, *args: Any) -> None:
        entered.set()
        go.wait(30)
        scatter(self, *args)

    monkeypatch.setattr(HostCopier, "scatter", held_scatter)  # the decode runs here; the prefill is its own process
    env = {"AIOTRANSFER_STAGING": "always", "AIOTRANSFER_STAGING_BYTES": str(8 << 20)}
    prefill = await RemotePeer.start(engine, seed=SEED, env=env, **BIG)
    try:
        async with local_decode(engine, staging="always", staging_bytes=8 << 20) as (dec, _):
            rx = await open_room(dec, prefill, 1, pages(128, 50))
            send = asyncio.ensure_future(prefill.call("send_kv", room=1, pages=pages(128, 51)))
            try:
                assert await asyncio.to_thread(entered.wait, 30)  # a piece is being copied into the pages
                await rx.abort("cancelled by the scheduler")
                with contextlib.suppress(RemoteError):
                    await send
                for _ in range(500):
                    if dec.stats()["drains_acknowledged"]:
                        break
                    await asyncio.sleep(0.01)
                assert dec.stats()["drains_acknowledged"] == 1  # the prefill can write nothing more...
                await asyncio.sleep(0.1)
                assert not rx.is_released() and rx.local_holds == 1  # ...but our own copy still writes
                with pytest.raises(TransferTimeout, match="local copies"):
                    await rx.released(timeout=0.05)
            finally:
                go.set()
            await rx.released(timeout=30)
            assert rx.release_cause == "drained" and rx.local_holds == 0
            assert dec.stats()["staging_bytes_in_use"] == 0
    finally:
        await prefill.close()


async def test_a_prefill_that_missed_the_abort_learns_it_from_its_next_staging_request(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode's abort is lost on its way; the prefill asks for staging space for the ended room and is
    refused at once with the decode's reason, instead of waiting out its deadline for an answer."""
    monkeypatch.setattr(PrefillSide, "on_abort", lambda self, msg: True)  # the abort never arrives here
    decode = await RemotePeer.start(engine, env={"AIOTRANSFER_STAGING": "always"}, **BIG)
    try:
        async with local_prefill(engine, "always") as mgr:
            tx = await ready_sender(mgr, decode, 1, pages(64, 60))
            await decode.call("abort", room=1, reason="client went away")
            t0 = time.monotonic()
            with pytest.raises(TransferFailed, match="refused staging space: room 1 has ended here: "
                                                     "aborted by decode: client went away"):
                await tx.send_kv(pages(64, 61), timeout=20)
            assert time.monotonic() - t0 < 5.0
            assert (await decode.call("stats"))["stats"]["staging_refused_ended"] >= 1
    finally:
        await decode.close()


async def test_an_abort_before_the_metadata_reaches_the_prefill(engine: str) -> None:
    prefill = await RemotePeer.start(engine, seed=SEED, **BIG)
    try:
        async with local_decode(engine) as (dec, _):
            await prefill.call("sender", room=3)
            rx = dec.receiver(3, prefill.endpoint)
            meta = asyncio.ensure_future(rx.send_metadata([1, 2]))
            await asyncio.sleep(0)
            meta.cancel()  # during first contact
            with contextlib.suppress(asyncio.CancelledError):
                await meta
            assert rx.poll() is KVPoll.Failed
            reason = rx.failure_reason or ""
            assert reason.startswith("aborted by decode: metadata not delivered: ") and not reason.endswith(": ")
            t0 = time.monotonic()
            with pytest.raises(RemoteError, match="metadata not delivered"):
                await prefill.call("wait_ready", room=3, timeout=10)
            assert time.monotonic() - t0 < 5.0  # not wait_ready's bound (10 s)
            assert (await prefill.call("reason", room=3))["reason"] == reason  # the same words on both sides
            assert rx.is_released() and rx.release_cause == "nothing-sent"
    finally:
        await prefill.close()


async def test_a_killed_prefill_leaves_no_staging_space_held_on_the_decode(engine: str) -> None:
    """Space the decode granted a prefill's staged pieces comes back once that prefill is proven gone, and
    later staged rooms (from another prefill) go through."""
    env = {"AIOTRANSFER_STAGING": "always", "AIOTRANSFER_STAGING_BYTES": str(8 << 20)}
    victim = await RemotePeer.start(engine, seed=SEED, env=env, **BIG)
    other = await RemotePeer.start(engine, seed=SEED, env=env, **BIG)
    try:
        async with local_decode(engine, staging="always", staging_bytes=8 << 20) as (dec, bufs):
            rx = await open_room(dec, victim, 1, pages(1500, 50))
            send = asyncio.ensure_future(victim.call("send_kv", room=1, pages=pages(1500, 51)))
            for _ in range(5000):  # until the decode has granted space to a piece in flight
                if dec.stats()["staging_bytes_in_use"]:
                    break
                await asyncio.sleep(0.001)
            assert dec.stats()["staging_bytes_in_use"] > 0
            victim.signal(signal.SIGKILL)
            await rx.released(timeout=20)
            assert rx.release_cause == "peer-gone"
            assert dec.stats()["staging_bytes_in_use"] == 0
            dst, src = pages(200, 52), pages(200, 53)
            rx2 = await open_room(dec, other, 2, dst)
            await other.call("send_kv", room=2, pages=src)
            await rx2.done(timeout=30)
            assert digest(bufs, dst) == expected(src)
            await asyncio.gather(send, return_exceptions=True)
    finally:
        await victim.close()
        await other.close()


@pytest.mark.parametrize("acknowledged", [True, False])
async def test_an_abort_that_crosses_the_success_is_acknowledged_at_once(
    monkeypatch: pytest.MonkeyPatch, acknowledged: bool
) -> None:
    """The decode aborts a room while the prefill concludes it: the prefill reads the abort after its
    ``Success`` left but before the ``send_kv`` that sent it returned (the room ended, not yet released).
    Every write of the room had landed, so the prefill acknowledges the drain at once, and the decode's
    pages are released without waiting out the quarantine. Two managers in this process on the memory engine,
    whose completion the test gives; the loop is held while the abort travels, so the prefill reads the
    abort in the loop iteration that sees the write complete. Negative control (``acknowledged=False``): the
    acknowledgement for an ended Success room withheld, as before; the decode's pages then wait for the
    quarantine."""
    from aiotransfer.testing import MemoryFabric

    fabric = MemoryFabric(auto_complete=False, engine_timeout_s=5.0, landing_grace_s=1.0)
    seen: list[tuple[KVPoll, bool]] = []
    on_abort = PrefillSide.on_abort

    def watched(self: PrefillSide, msg: Any) -> bool:
        ended = self._draining.get(msg.room)
        if ended is not None:
            seen.append((ended.status, ended.is_released()))
            if not acknowledged:
                return True  # the code before the fix
        return on_abort(self, msg)

    monkeypatch.setattr(PrefillSide, "on_abort", watched)
    cfg = TransferConfig(engine="memory", staging="never", release_quarantine_s=30.0,
                         yield_after_notify=False, heartbeat_interval=1e5, peer_timeout=1e5)
    src = make_buffers(2, 16, 4096, seed=1)
    dst = make_buffers(2, 16, 4096, None)
    async with (
        fabric,
        KVManager(KVArgs(src, page_size=16, dtype="uint8"), cfg) as prefill,
        KVManager(KVArgs(dst, page_size=16, dtype="uint8"), cfg) as decode,
    ):
        fabric.label(prefill.engine.session_id, "P", prefill.args.kv)
        fabric.label(decode.engine.session_id, "D", decode.args.kv)
        rx = decode.receiver(1, prefill.endpoint)
        await rx.send_metadata([3], timeout=5)
        tx = prefill.sender(1)
        await tx.wait_ready(timeout=5)
        send = asyncio.ensure_future(tx.send_kv([5], timeout=5))
        for _ in range(5000):
            if fabric.live():
                break
            await asyncio.sleep(0.001)
        (write,) = fabric.live()
        fabric.complete(write)  # the prefill's poll loop sees it at its next round...
        await rx.abort("the client went away")  # ...and the abort is on its way: the two cross
        time.sleep(0.3)  # noqa: ASYNC251 (the loop is held on purpose while the abort reaches the prefill)
        await send
        assert tx.poll() is KVPoll.Success and rx.poll() is KVPoll.Failed
        assert seen == [(KVPoll.Success, False)]  # read after Success, before the room was released
        if acknowledged:
            await rx.released(timeout=2)
            assert rx.release_cause == "drained"
        else:
            with pytest.raises(TransferTimeout):
                await rx.released(timeout=1)


async def test_a_diagnostic_call_runs_once_on_the_driver_and_once_on_each_offload_thread() -> None:
    """``run_on_worker_threads``: the hook a per-thread profiler uses. The driver first, then each offload
    thread exactly once (never the loop's thread), bounded; refused once the manager is closed."""
    from aiotransfer.errors import ClosedError

    cfg = TransferConfig(engine="memory", executor_threads=3)
    seen: list[tuple[str, str, int]] = []
    async with KVManager(KVArgs(make_buffers(1, 4, 64, None), page_size=4, dtype="uint8"), cfg) as mgr:
        await mgr.run_on_worker_threads(
            lambda where: seen.append((where, threading.current_thread().name, threading.get_ident())), timeout=5)
        assert [w for w, _, _ in seen] == ["driver", "offload", "offload", "offload"]
        assert seen[0][1].startswith("aiotransfer-driver-")
        offload = {ident for where, _, ident in seen if where == "offload"}
        assert len(offload) == 3 and seen[0][2] not in offload
        assert threading.get_ident() not in {ident for _, _, ident in seen}
        assert all(name.startswith("aiotransfer-") for _, name, _ in seen)
    with pytest.raises(ClosedError):
        await mgr.run_on_worker_threads(lambda where: None)


async def test_a_diagnostic_call_that_cannot_reach_every_offload_thread_times_out_and_runs_nowhere_there() -> None:
    """One offload thread busy: the others wait at the hook's barrier, which breaks at the bound; the call
    raises TransferTimeout and ``fn`` runs on no offload thread."""
    cfg = TransferConfig(engine="memory", executor_threads=2)
    seen: list[str] = []
    release = threading.Event()
    async with KVManager(KVArgs(make_buffers(1, 4, 64, None), page_size=4, dtype="uint8"), cfg) as mgr:
        busy = asyncio.ensure_future(mgr._ctx.offload.run(release.wait, 10, timeout=10, what="busy"))
        try:
            with pytest.raises(TransferTimeout):
                await mgr.run_on_worker_threads(seen.append, timeout=0.3)
            assert seen == ["driver"]
        finally:
            release.set()
            await busy
