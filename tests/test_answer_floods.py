"""A flood of messages that each ask for an answer (a ``Ping``, a transfer request from a decode the prefill
does not know), in the name of endpoints nobody reads: the answers that cannot leave at once wait in at most
``ANSWERS_PER_PEER`` tasks per destination and ``ANSWERS_TOTAL`` in all; the rest are dropped and counted,
and the manager still serves a room afterwards."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import zmq
import zmq.asyncio

from aiotransfer._control.messages import PROTOCOL_VERSION, Ping, TopologyQuery, TransferRequest, encode
from aiotransfer._kv.context import ANSWERS_PER_PEER, ANSWERS_TOTAL
from aiotransfer.errors import TransferTimeout
from tests.peer import digest
from tests.test_room_reuse import managers
from tests.zmqtools import wait_until


def _closed_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _flood(endpoint: str, messages: list[bytes]) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 10_000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    try:
        for m in messages:
            await asyncio.wait_for(sock.send(m), 10)
    finally:
        sock.close()
        ctx.term()


def _dropped(stats: Any) -> int:
    return int(dict(stats).get("dropped_answer-over-cap", 0))


async def _settled(mgr: Any, expected: int) -> None:
    """Every flooded message handled: answered, waiting in a task, or dropped."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    last, still = -1, 0
    while loop.time() < end:
        now = _dropped(mgr.stats())
        still = still + 1 if now == last else 0
        if now >= expected and still >= 20:
            return
        last = now
        await asyncio.sleep(0.05)
    raise AssertionError(f"{_dropped(mgr.stats())} answers dropped, {expected} expected")


async def test_answers_to_one_unread_endpoint_wait_in_a_bounded_number_of_tasks() -> None:
    """12,000 Pings in the name of one endpoint nobody reads: ZeroMQ queues what its high-water mark takes
    (10,000), at most ``ANSWERS_PER_PEER`` more wait in tasks, and the rest are dropped and counted."""
    nobody = f"tcp://127.0.0.1:{_closed_port()}"
    flood = [encode(Ping(endpoint=nobody, nonce=i)) for i in range(12_000)]
    async with managers("memory", 2, handshake_timeout=2.0) as [(dec, dst), (pre, src)]:
        tasks = len(pre._ctx._tasks)
        await _flood(pre.endpoint, flood)
        await _settled(pre, 12_000 - 10_000 - ANSWERS_PER_PEER - 2)
        assert len(pre._ctx._tasks) <= tasks + ANSWERS_PER_PEER
        await _room_still_moves(dec, dst, pre, src)


async def test_every_kind_of_answer_to_an_unread_endpoint_is_capped() -> None:
    """Topology queries and transfer requests from a decode the prefill does not know ("register again")
    in the name of an endpoint nobody reads, past what ZeroMQ queues: each kind's answers beyond it wait in
    the same bounded number of tasks, and the rest are dropped."""
    nobody = f"tcp://127.0.0.1:{_closed_port()}"
    flood = [encode(TopologyQuery(version=PROTOCOL_VERSION, endpoint=nobody, nonce=i)) for i in range(6000)]
    flood += [encode(TransferRequest(room=i, endpoint=nobody, generation=1, kv_indices=b"")) for i in range(6000)]
    async with managers("memory", 2, handshake_timeout=2.0) as [(dec, dst), (pre, src)]:
        tasks = len(pre._ctx._tasks)
        await _flood(pre.endpoint, flood)
        await _settled(pre, 12_000 - 10_000 - ANSWERS_PER_PEER - 2)
        assert len(pre._ctx._tasks) <= tasks + ANSWERS_PER_PEER
        assert pre.stats()["requests_register_again"] == 6000
        await _room_still_moves(dec, dst, pre, src)


async def test_answers_waiting_for_many_endpoints_are_capped_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """3,000 Pings in the names of 3,000 endpoints, while no answer can leave at once and each waits out
    its bound (every queue full): at most ``ANSWERS_TOTAL`` wait in tasks, the rest are dropped."""
    names = [f"tcp://127.0.0.{2 + i // 1000}:{20_000 + i % 1000}" for i in range(3000)]
    flood = [encode(Ping(endpoint=name, nonce=i)) for i, name in enumerate(names)]
    async with managers("memory", 2, handshake_timeout=2.0) as [(dec, dst), (pre, src)]:
        control = pre._ctx.control

        async def stuck(endpoint: str, msg: Any, timeout: float | None = None, **_: Any) -> None:
            await asyncio.sleep(timeout or 0)
            raise TransferTimeout("the peer's queue stayed full")

        tasks = len(pre._ctx._tasks)
        with monkeypatch.context() as patch:
            patch.setattr(control, "try_send", lambda *a, **k: False)
            patch.setattr(control, "send", stuck)
            await _flood(pre.endpoint, flood)
            await _settled(pre, 3000 - ANSWERS_TOTAL)
            assert len(pre._ctx._tasks) <= tasks + ANSWERS_TOTAL
        await wait_until(lambda: len(pre._ctx._tasks) <= tasks + 2, timeout=20)  # the waits end with their bound
        await _room_still_moves(dec, dst, pre, src)


async def _room_still_moves(dec: Any, dst: Any, pre: Any, src: Any) -> None:
    tx, rx = pre.sender(1), dec.receiver(1, pre.endpoint)
    await rx.send_metadata([4, 5], timeout=10)
    await tx.wait_ready(timeout=10)
    await tx.send_kv([6, 7], timeout=10)
    await rx.done(timeout=10)
    assert digest(dst, [4, 5]) == digest(src, [6, 7])
