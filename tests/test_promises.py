"""The orderings that used to break "a failed room never writes into pages handed back": each test drives
one unlucky interleaving by hand, on a real engine, and checks the pages the decode released stay as they
were. (tests/test_interleavings.py explores such orderings; these pin the ones found.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, KVPoll, TransferConfig, TransferFailed
from aiotransfer._control.messages import Status, encode
from tests.peer import make_buffers
from tests.zmqtools import push

PAGES, ITEM, LAYERS = 64, 1024, 2
SEED = 5


def kv_args(bufs: list[np.ndarray]) -> KVArgs:
    return KVArgs(bufs, page_size=16, dtype="uint8", num_layers=LAYERS)


@contextlib.asynccontextmanager
async def pair(engine: str, **cfg: Any) -> AsyncIterator[tuple[KVManager, KVManager, list[np.ndarray]]]:
    """A prefill with seeded pages and a decode with zeroed ones, in this process, on a real engine."""
    src = make_buffers(2 * LAYERS, PAGES, ITEM, seed=SEED)
    dst = make_buffers(2 * LAYERS, PAGES, ITEM, None)
    config = TransferConfig(engine=engine, **cfg)
    async with KVManager(kv_args(src), config) as pre, KVManager(kv_args(dst), config) as dec:
        yield pre, dec, dst


async def until(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_a_layer_batch_waiting_for_credit_posts_nothing_once_its_room_was_aborted(engine: str) -> None:
    """A streamed layer waits for engine credit; the decode aborts meanwhile. The prefill must neither
    acknowledge the drain while the batch may still post, nor post it afterwards."""
    async with pair(engine) as (pre, dec, dst):
        tx = pre.sender(1)
        rx = dec.receiver(1, pre.endpoint)
        await rx.send_metadata([3, 4, 5, 6])
        await tx.wait_ready(timeout=10)
        peer = pre._prefill.decode_peers[dec.endpoint]
        credits = pre._ctx.poller._credits_for(peer.session_id, asyncio.get_running_loop())
        taken = credits.cap - credits.used
        assert credits.try_acquire(taken)  # the engine queue is full: the batch waits for credit
        stream = tx.stream([10, 11, 12, 13])
        layer = asyncio.ensure_future(stream.send_layers(0))
        for _ in range(20):
            await asyncio.sleep(0)
        await rx.abort("scheduler gave up")
        with pytest.raises(TransferFailed, match="scheduler gave up"):
            await layer
        await asyncio.sleep(0.2)
        assert not rx.is_released(), "the decode released pages a waiting layer batch could still write"
        credits.release(taken)
        await rx.released(timeout=10)
        await tx.released(timeout=10)
        await asyncio.sleep(0.2)
        assert all(not b.any() for b in dst), "a layer batch landed in pages the decode released"
        assert pre.stats().get("layer_writes", 0) == 0


async def test_an_abort_while_the_metadata_is_routed_sends_no_request(engine: str) -> None:
    """The decode aborts while ``send_metadata`` still resolves and registers: no request may leave after
    the abort, and a sender the prefill opens for the room afterwards fails at once with the abort's reason
    (it never writes into the pages the decode released as nothing-sent)."""
    async with pair(engine) as (pre, dec, dst):
        rx = dec.receiver(2, pre.endpoint)
        meta = asyncio.ensure_future(rx.send_metadata([3, 4, 5, 6]))
        await asyncio.sleep(0)  # first contact is under way
        await rx.abort("client disconnected")
        with pytest.raises(TransferFailed, match="client disconnected"):
            await meta
        assert rx.is_released() and rx.release_cause == "nothing-sent"
        await asyncio.sleep(0.3)  # a request that left late would be stashed by now
        assert pre.stats()["pending_requests"] == 0
        tx = pre.sender(2)
        assert tx.poll() is KVPoll.Failed and "client disconnected" in (tx.failure_reason or "")
        assert pre.stats()["tombstones"] >= 1
        assert all(not b.any() for b in dst)


async def test_a_late_request_for_an_aborted_room_is_refused_with_the_reason(engine: str) -> None:
    async with pair(engine) as (pre, dec, _):
        tx = pre.sender(3)
        rx = dec.receiver(3, pre.endpoint)
        await rx.send_metadata([1, 2])
        await tx.wait_ready(timeout=10)
        await rx.abort("first try abandoned")
        await until(lambda: tx.is_released())
        await rx.released(timeout=10)  # the decode reuses a room number only once its room let go of it
        refused_before = pre.stats().get("late_requests_refused", 0)
        again = dec.receiver(3, pre.endpoint)  # the same room asked again after it failed on the prefill
        await again.send_metadata([7, 8])
        with pytest.raises(TransferFailed, match="first try abandoned"):
            await again.done(timeout=10)
        assert pre.stats()["late_requests_refused"] == refused_before + 1
        assert pre.stats()["pending_requests"] == 0


async def test_success_is_counted_per_source_not_per_rank_number(engine: str) -> None:
    """One prefill source that reports Success twice, once under another rank's number, does not complete
    a room that waits for two sources."""
    from aiotransfer._kv.client import Route

    async with pair(engine) as (_, dec, _):
        rx = dec.receiver(4, "127.0.0.1:1")
        a, b = "127.0.0.1:2", "127.0.0.1:3"
        rx._route = Route(sources={a: 0, b: 1}, endpoints=[a, b], required=2, requests=[])
        rx.update(KVPoll.WaitingForInput)
        for rank in (0, 1):
            await push(dec.endpoint, [encode(Status(room=4, status=int(KVPoll.Success), rank=rank, endpoint=a))])
        await asyncio.sleep(0.3)
        assert rx.poll() is KVPoll.WaitingForInput
        assert dec.stats()["dropped_wrong-peer"] >= 1
        await push(dec.endpoint, [encode(Status(room=4, status=int(KVPoll.Success), rank=1, endpoint=b))])
        await until(lambda: rx.poll() is KVPoll.Success)


@pytest.mark.parametrize("sender_first", [True, False], ids=["sender-then-abort", "abort-then-sender"])
async def test_an_abort_without_metadata_reaches_a_prefill_restarted_on_the_same_endpoint(
    engine: str, sender_first: bool
) -> None:
    """The decode knows the prefill's endpoint from an earlier room; the prefill restarts there. A room
    whose metadata the decode refused (its own pages out of range: nothing sent) and then aborted fails
    on the new prefill at once, whichever of the sender and the abort comes first, not after wait_ready."""
    from aiotransfer import InvalidArgument

    src = make_buffers(2 * LAYERS, PAGES, ITEM, seed=SEED)
    dst = make_buffers(2 * LAYERS, PAGES, ITEM, None)
    config = TransferConfig(engine=engine)
    async with KVManager(kv_args(dst), config) as dec:
        async with KVManager(kv_args(src), config) as old:
            endpoint = old.endpoint
            tx = old.sender(1)
            rx = dec.receiver(1, endpoint)
            await rx.send_metadata([1, 2])
            await tx.wait_ready(timeout=10)
            await tx.send_kv([5, 6])
            await rx.done(timeout=10)
        port = int(endpoint.rsplit(":", 1)[1])
        async with KVManager(kv_args(src), config.replace(control_port=port)) as new:
            assert new.endpoint == endpoint
            late: Any = new.sender(2) if sender_first else None
            rx = dec.receiver(2, endpoint)
            with pytest.raises(InvalidArgument):
                await rx.send_metadata([PAGES + 1])
            received = new.stats()["control_received"]
            await rx.abort("scheduler gave up")
            await until(lambda: new.stats()["control_received"] > received)  # the abort came first
            if late is None:
                late = new.sender(2)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(TransferFailed, match="scheduler gave up"):
                await late.wait_ready(timeout=20)
            assert loop.time() - t0 < 5.0, "the new prefill waited out wait_ready"


def test_a_sender_for_a_tombstoned_room_fails_at_once_from_synchronous_code() -> None:
    """A scheduler that opens rooms from a thread without a running loop gets a failed room, not an
    error from asyncio."""
    from aiotransfer._kv.tombstones import Tombstones

    tombs = Tombstones(ttl=60.0, cap=2)
    tombs.bury(7, "aborted by decode: gone")
    tombs.bury(8, "aborted by decode: gone too")
    tombs.bury(9, "aborted by decode: and this")
    assert tombs.reason(7) is None and tombs.reason(9) == "aborted by decode: and this" and len(tombs) == 2

    async def opened() -> Any:
        mgr = KVManager(kv_args(make_buffers(2 * LAYERS, PAGES, ITEM, None)), TransferConfig(engine="mooncake_tcp"))
        await mgr.start()
        return mgr

    loop = asyncio.new_event_loop()
    try:
        mgr = loop.run_until_complete(opened())
        mgr._prefill.tombstones.bury(5, "aborted by decode: client went away")
        tx = mgr.sender(5)  # outside the loop
        assert tx.poll() is KVPoll.Failed and tx.failure_reason == "aborted by decode: client went away"
        loop.run_until_complete(mgr.aclose())
    finally:
        loop.close()
