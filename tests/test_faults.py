"""Faults with real processes: killed, hung (SIGSTOP) and restarted peers. Each asserts which rooms fail,
with what reason, within what bound, and which keep working."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, KVPoll, TransferConfig, TransferFailed
from tests.peer import make_buffers
from tests.remote import RemoteError, RemotePeer

BIG: dict[str, Any] = {"buffers": 4, "pages": 2048, "item_len": 4096}
BOUND = 5.0  # seconds: the configured detection bound (peer_timeout 3 s + one heartbeat)


@pytest.fixture
async def big_prefill(engine: str) -> AsyncIterator[KVManager]:
    bufs = make_buffers(BIG["buffers"], BIG["pages"], BIG["item_len"], seed=5)
    cfg = TransferConfig(engine=engine, staging="never", engine_timeout_s=30)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), cfg) as mgr:
        yield mgr


async def _open(mgr: KVManager, peer: RemotePeer, room: int, pages: list[int]):
    tx = mgr.sender(room)
    await peer.call("receiver", room=room, peer=mgr.endpoint, pages=pages)
    await tx.wait_ready(timeout=10)
    return tx


def _scattered(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).permutation(BIG["pages"])[:n]]


async def _healthy_room(mgr: KVManager, peer: RemotePeer, room: int) -> None:
    tx = await _open(mgr, peer, room, [1, 2, 3])
    await tx.send_kv([4, 5, 6])
    await peer.call("done", room=room)


async def _until_in_flight(mgr: KVManager, send: asyncio.Future[None]) -> None:
    """Return once the first engine batch of ``send`` is in flight, or has landed while others remain (a kill
    then lands mid-transfer): NIXL over shared memory copies a batch as it posts it, so its handle is over
    as soon as it is seen."""
    deadline = time.monotonic() + 10
    landed = mgr.stats()["engine_completed"]  # before ``send`` took its first step
    while not mgr.stats()["in_flight"] and mgr.stats()["engine_completed"] == landed:
        assert not send.done(), "the transfer finished before any batch was seen in flight"
        assert time.monotonic() < deadline, "no engine batch in flight after 10 s"
        await asyncio.sleep(0)


async def test_receiver_killed_mid_transfer(big_prefill: KVManager, engine: str) -> None:
    victim = await RemotePeer.start(engine, **BIG)
    other = await RemotePeer.start(engine, **BIG)
    try:
        tx = await _open(big_prefill, victim, 1, _scattered(2000, 1))
        await _healthy_room(big_prefill, other, 2)
        send = asyncio.ensure_future(tx.send_kv(_scattered(2000, 2), timeout=30))
        await _until_in_flight(big_prefill, send)  # NIXL over shared memory moves all 8,000 entries in ~40 ms
        victim.signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed) as info:
            await send
        elapsed = time.monotonic() - t0
        print(f"receiver killed: prefill room failed after {elapsed:.2f}s ({info.value.reason})")
        assert elapsed < BOUND, elapsed
        assert tx.poll() is KVPoll.Failed
        assert any(w in info.value.reason for w in ("engine", "silent")), info.value.reason
        await _healthy_room(big_prefill, other, 3)  # the other decode keeps working
    finally:
        await victim.close()
        await other.close()


async def test_receiver_hung_sigstop(big_prefill: KVManager, engine: str) -> None:
    victim = await RemotePeer.start(engine, **BIG)
    other = await RemotePeer.start(engine, **BIG)
    try:
        tx = await _open(big_prefill, victim, 1, _scattered(2000, 3))
        victim.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="silent for") as info:
            await tx.send_kv(_scattered(2000, 4), timeout=30)
        elapsed = time.monotonic() - t0
        print(f"receiver hung: prefill room failed after {elapsed:.2f}s ({info.value.reason})")
        assert elapsed < BOUND, elapsed
        assert "dead, hung or cut off" in info.value.reason
        # transfers with another peer keep flowing while the hung one is blacklisted
        await _healthy_room(big_prefill, other, 2)
        assert big_prefill.stats()["peers_declared_dead"] == 1
        victim.signal(signal.SIGCONT)
        # once it answers again it leaves the blacklist
        for _ in range(100):
            if not big_prefill.stats()["dead_peers"]:
                break
            await asyncio.sleep(0.1)
    finally:
        victim.signal(signal.SIGCONT)
        await victim.close()
        await other.close()


async def test_prefill_killed_decode_learns(engine: str) -> None:
    prefill = await RemotePeer.start(engine, seed=9, **BIG)
    try:
        dst = make_buffers(BIG["buffers"], BIG["pages"], BIG["item_len"], None)
        async with KVManager(KVArgs(dst, page_size=16, dtype="uint8"), TransferConfig(engine=engine)) as dec:
            await prefill.call("sender", room=5)
            rx = dec.receiver(5, prefill.endpoint)
            await rx.send_metadata([1, 2, 3])
            await prefill.call("wait_ready", room=5)
            prefill.signal(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(TransferFailed, match="silent for"):
                await rx.done(timeout=30)
            print(f"prefill killed: decode room failed after {time.monotonic() - t0:.2f}s")
            assert time.monotonic() - t0 < BOUND
            assert rx.poll() is KVPoll.Failed
            # blacklisted: a new room to the dead peer fails at once, with the reason
            rx2 = dec.receiver(6, prefill.endpoint)
            with pytest.raises(Exception, match="declared dead"):
                await rx2.send_metadata([1])
    finally:
        await prefill.close()


async def test_decode_restart_on_same_endpoint(big_prefill: KVManager, engine: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AIOTRANSFER_CONTROL_PORT": str(port)}
    first = await RemotePeer.start(engine, env=env, **BIG)
    try:
        tx = await _open(big_prefill, first, 1, [1, 2])
        first.signal(signal.SIGKILL)
        await first.close()
        second = await RemotePeer.start(engine, env=env, **BIG)
        try:
            assert second.endpoint == first.endpoint
            # the new incarnation registers again: the old incarnation's room fails with that reason
            await _healthy_room(big_prefill, second, 2)
            with pytest.raises(TransferFailed, match=r"registered again|restarted|silent"):
                await tx.done(timeout=10)
            # stale metadata (old registration generation) is not accepted for the new incarnation
            assert big_prefill.stats()["decode_peer_reregistered"] == 1
        finally:
            await second.close()
    finally:
        await first.close()


async def test_cancelled_send_returns_promptly_and_keeps_buffers_pinned(big_prefill: KVManager, engine: str) -> None:
    peer = await RemotePeer.start(engine, **BIG)
    try:
        tx = await _open(big_prefill, peer, 1, list(range(2000)))
        peer.signal(signal.SIGSTOP)  # the engine cannot finish while the receiver is stopped
        send = asyncio.ensure_future(tx.send_kv(list(range(2000)), timeout=30))
        for _ in range(1000):
            if big_prefill.stats()["in_flight"] > 0:
                break
            await asyncio.sleep(0.001)
        assert big_prefill.stats()["in_flight"] > 0
        t0 = time.monotonic()
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        assert time.monotonic() - t0 < 3.0  # promptly: not when the stopped engine gives up (30 s)
        assert tx.poll() is KVPoll.Failed
        assert "cancelled" in (tx.failure_reason or "")
        await asyncio.sleep(0.2)
        assert big_prefill.stats()["in_flight"] > 0  # the engine still owns those entries: nothing freed
        peer.signal(signal.SIGCONT)
        for _ in range(500):
            if big_prefill.stats()["in_flight"] == 0:
                break
            await asyncio.sleep(0.02)
        assert big_prefill.stats()["in_flight"] == 0  # released only once the engine reported them done
        with pytest.raises(RemoteError, match="cancelled"):
            await peer.call("done", room=1, timeout=5)
    finally:
        peer.signal(signal.SIGCONT)
        await peer.close()
