"""Caps on the requests a peer can make a manager hold: staging requests on the decode (per prefill rank and
room, and per prefill rank) and transfer requests stashed on the prefill (per decode rank). Beyond a cap a
request is refused at once with the reason and counted, so a flood costs neither tasks nor memory, and
legitimate transfers still go through."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from aiotransfer import TransferConfig
from aiotransfer._control.messages import StageGrant, StageRequest, Status, TransferRequest, encode
from aiotransfer._kv.peers import PendingRequests, Stashed
from aiotransfer.errors import ConfigError
from tests.peer import digest
from tests.test_room_reuse import STAGED, managers
from tests.zmqtools import wait_until

CAPS: dict[str, Any] = {"max_staging_requests_per_room": 8, "max_staging_requests_per_peer": 12,
                        "max_staging_share_per_room": 1.0}
FLOOD = 3000
"""Hand-made staging requests per room, in the name of the room's own prefill rank."""


async def _send_all(endpoint: str, messages: list[bytes]) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(endpoint)
    try:
        for m in messages:
            await asyncio.wait_for(sock.send_multipart([m]), 10)
    finally:
        sock.close()
        ctx.term()


async def test_a_flood_of_staging_requests_is_refused_beyond_the_caps_at_once(engine: str) -> None:
    """Two open rooms, each flooded with requests for the whole arena in the name of its own prefill rank: one
    is granted, the ones within the caps wait for space, every other one is refused at once with the cap it
    hit. The decode holds no more requests, nor tasks, than the caps allow; once the rooms end everything
    held is let go, and a real staged transfer still goes through."""
    async with managers(engine, 2, **STAGED, **CAPS) as [(dec, dst), (pre, src)]:
        answers: list[Any] = []
        writer = pre._handlers[StageGrant]
        pre._handlers[StageGrant] = answers.append  # what the decode answers the flood
        rooms = []
        for room in (1, 2):
            tx = pre.sender(room)
            rx = dec.receiver(room, pre.endpoint)
            await rx.send_metadata([room], timeout=10)
            await tx.wait_ready(timeout=10)
            rooms.append(rx)
        tasks = len(dec._ctx._tasks)
        arena = STAGED["staging_bytes"]
        flood = [encode(StageRequest(room=room, endpoint=pre.endpoint, req_id=i, nbytes=arena))
                 for room in (1, 2) for i in range(1, FLOOD + 1)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await _send_all(dec.endpoint, flood)
        refused = 2 * FLOOD - CAPS["max_staging_requests_per_peer"]
        await wait_until(lambda: len(answers) == refused + 1, timeout=20)
        elapsed = loop.time() - t0
        print(f"{2 * FLOOD} staging requests answered in {elapsed:.2f}s")
        assert elapsed < 10.0 < dec.config.transfer_timeout  # at once, not when the waits for space end
        stats = dec.stats()
        assert stats["dropped_staging-over-cap"] == refused
        assert stats["staging_requests_held"] == CAPS["max_staging_requests_per_peer"]
        assert stats["staging_bytes_in_use"] == arena  # the first request; the others within the caps wait
        assert len(dec._ctx._tasks) <= tasks + CAPS["max_staging_requests_per_peer"]
        granted = [a for a in answers if a.granted]
        assert [(a.room, a.req_id) for a in granted] == [(1, 1)]
        by_room = [a for a in answers if not a.granted and "max_staging_requests_per_room" in a.reason]
        by_peer = [a for a in answers if not a.granted and "max_staging_requests_per_peer" in a.reason]
        assert len(by_room) == FLOOD - CAPS["max_staging_requests_per_room"]
        assert {a.room for a in by_room} == {1}
        assert len(by_peer) == FLOOD - (CAPS["max_staging_requests_per_peer"] - CAPS["max_staging_requests_per_room"])
        assert {a.room for a in by_peer} == {2}

        for rx in rooms:
            await rx.abort("cancelled by the scheduler")
        for rx in rooms:
            await rx.released(timeout=10)
        await wait_until(lambda: dec.stats()["staging_requests_held"] == 0 and len(dec._ctx._tasks) <= tasks)
        assert dec.stats()["staging_bytes_in_use"] == 0

        pre._handlers[StageGrant] = writer
        tx = pre.sender(3)  # a real staged transfer: its pieces are within the caps
        rx = dec.receiver(3, pre.endpoint)
        pages, theirs = list(range(10, 60)), list(range(5, 55))
        await rx.send_metadata(pages, timeout=10)
        await tx.wait_ready(timeout=10)
        await tx.send_kv(theirs, timeout=10)
        await rx.done(timeout=10)
        assert digest(dst, pages) == digest(src, theirs)
        assert dec.stats()["dropped_staging-over-cap"] == refused


def _stash(endpoint: str) -> Stashed:
    req = TransferRequest(room=0, endpoint=endpoint, generation=1, kv_indices=b"\0" * 8)
    peer: Any = SimpleNamespace(endpoint=endpoint)
    return Stashed(peer, req, np.zeros(2, dtype=np.int64))


def test_the_stash_holds_at_most_max_pending_per_peer_requests_of_one_decode_rank() -> None:
    """One decode rank asking for rooms the prefill has not opened fills no more than its share of the stash;
    other ranks still get in, and a room served gives the rank its slot back."""
    stash = PendingRequests(600.0, 1000, per_peer=2)
    assert stash.add(1, _stash("a")) == [] and stash.add(2, _stash("a")) == []
    (full,) = stash.add(3, _stash("a"))
    assert full.counter == "pending_refused" and "too many requests from decode a" in full.reason
    assert [s.peer.endpoint for s in full.items] == ["a"]  # the decode refused is the one told
    assert stash.add(3, _stash("b")) == [] and len(stash) == 3
    assert stash.pop(1) is not None
    assert stash.add(4, _stash("a")) == []
    (again,) = stash.add(5, _stash("a"))
    assert again.counter == "pending_refused"


async def test_requests_waiting_for_a_registration_are_capped_per_decode_rank() -> None:
    """Requests from a decode rank whose registration is still being checked wait for it, at most
    ``max_pending_per_peer`` of them; the rest are refused at once, and the decode told."""
    async with managers("mooncake_tcp", 2, max_pending_per_peer=3) as [(pre, _), (dec, _)]:
        side = pre._prefill
        hello: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        side._hellos[dec.endpoint] = hello  # type: ignore[assignment]  # a registration that never ends
        told: list[Any] = []
        dec._handlers[Status] = told.append
        for room in range(10):
            side.on_request(TransferRequest(room=room, endpoint=dec.endpoint, generation=1, kv_indices=b""))
        assert side._after == {dec.endpoint: 3}
        assert pre.stats()["pending_refused"] == 7
        await wait_until(lambda: len(told) == 7)
        assert all("too many requests from decode" in m.reason and "waiting for its registration" in m.reason
                   for m in told)
        del side._hellos[dec.endpoint]
        hello.set_result(None)
        await wait_until(lambda: not side._after)


def test_the_caps_are_validated() -> None:
    for name in ("max_staging_requests_per_room", "max_staging_requests_per_peer", "max_pending_per_peer"):
        zero: dict[str, Any] = {name: 0}
        with pytest.raises(ConfigError, match=f"{name} must be an integer >= 1"):
            TransferConfig(**zero)
    with pytest.raises(ConfigError, match="must not exceed max_staging_requests_per_peer"):
        TransferConfig(max_staging_requests_per_room=65, max_staging_requests_per_peer=64)
    for share in (0.2, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=r"max_staging_share_per_room must be between 0\.25 and 1"):
            TransferConfig(max_staging_share_per_room=share)
    assert TransferConfig.from_env({"AIOTRANSFER_MAX_STAGING_SHARE_PER_ROOM": "0.25"}).max_staging_share_per_room == 0.25
    cfg = TransferConfig()
    assert (cfg.max_staging_requests_per_room, cfg.max_staging_requests_per_peer, cfg.max_pending_per_peer) == (
        64, 1024, 4096)
    assert TransferConfig.from_env({"AIOTRANSFER_MAX_STAGING_REQUESTS_PER_PEER": "2048"}).max_staging_requests_per_peer == 2048
