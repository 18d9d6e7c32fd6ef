"""Plain ZeroMQ sockets on the loop (``aiotransfer._control.sockets``): sends keep their order when the peer's
queue is full, a bounded send withdraws its message, and an idle control plane does not wake the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import zmq

from aiotransfer._control.endpoint import ControlPlane
from aiotransfer._control.messages import Message, Ping
from aiotransfer._control.sockets import OrderedSender, Watch
from aiotransfer.errors import TransferTimeout


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """A PUSH socket and the PULL socket it feeds, whose pipe holds two messages in all."""
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.rcvhwm = push.sndhwm = 1
    pull.bind("inproc://sockets-test")
    push.connect("inproc://sockets-test")
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


async def _drain(pull: zmq.Socket[Any], n: int, timeout: float = 10.0) -> list[bytes]:
    watch = Watch(pull, zmq.POLLIN)
    out: list[bytes] = []
    while len(out) < n:
        await watch.wait(timeout)
        out.append(pull.recv(zmq.NOBLOCK))
    return out


async def test_sends_that_wait_for_room_keep_their_order_and_a_bounded_one_withdraws_its_message(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    push, pull = pair
    out = OrderedSender(push)
    sent = 0
    while out.try_send([b"m%d" % sent]):  # fill the pipe
        sent += 1
    assert sent >= 1

    first = asyncio.ensure_future(out.send([b"a"], timeout=10))
    await asyncio.sleep(0.01)
    assert not first.done()
    assert not out.try_send([b"b"])  # would overtake "a": refused, nothing queued
    second = asyncio.ensure_future(out.send([b"c"], timeout=10))
    with pytest.raises(asyncio.TimeoutError):
        await out.send([b"x"], timeout=0.05)  # behind the two: it expires and is withdrawn

    got = await _drain(pull, sent + 2)
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert got == [b"m%d" % i for i in range(sent)] + [b"a", b"c"]
    await out.send([b"d"], timeout=10)  # nothing waits any more
    assert await _drain(pull, 1) == [b"d"]
    with pytest.raises(asyncio.TimeoutError):  # "x" never left
        await Watch(pull, zmq.POLLIN).wait(0.05)


async def test_a_cancelled_waiting_send_hands_the_turn_on(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    push, pull = pair
    out = OrderedSender(push)
    sent = 0
    while out.try_send([b"m%d" % sent]):
        sent += 1
    first = asyncio.ensure_future(out.send([b"a"], timeout=10))
    second = asyncio.ensure_future(out.send([b"b"], timeout=10))
    await asyncio.sleep(0.01)
    first.cancel()
    got = await _drain(pull, sent + 1)
    await asyncio.wait_for(second, 10)
    assert got[-1] == b"b" and b"a" not in got


async def test_an_idle_control_plane_does_not_wake_the_loop() -> None:
    """libzmq's descriptor stays readable until its signal is drained: a reader callback that did not drain it
    would run on every loop iteration and spin a CPU, idle or while an asynchronous handler holds the
    messages behind it. The messages that came meanwhile are still handed over, in order."""
    got: list[int] = []
    gate = asyncio.Event()

    async def held(nonce: int) -> None:
        await gate.wait()
        got.append(nonce)

    def handler(msg: Message) -> Awaitable[None] | None:
        assert isinstance(msg, Ping)
        if msg.nonce == 1:
            return held(msg.nonce)  # the messages behind it wait until it is over
        got.append(msg.nonce)
        return None

    async def idle_cpu() -> float:
        # the loop's own thread: the process's time would also count libzmq's I/O threads and whatever
        # native threads earlier tests in this process left behind
        cpu = time.thread_time()
        await asyncio.sleep(0.5)
        return time.thread_time() - cpu

    async def until(cond: Callable[[], bool]) -> None:
        for _ in range(500):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("not reached within 5 s")

    plane = ControlPlane("127.0.0.1", 0, handler, max_sockets=4, max_message_bytes=4096)
    peer = ControlPlane("127.0.0.1", 0, lambda _: None, max_sockets=4, max_message_bytes=4096)
    await plane.start()
    await peer.start()
    try:
        await peer.send(plane.endpoint, Ping(endpoint=peer.endpoint, nonce=1), timeout=5)
        await until(lambda: plane.received == 1)
        for nonce in (2, 3):  # they signal the descriptor while the handler of the first holds them
            await peer.send(plane.endpoint, Ping(endpoint=peer.endpoint, nonce=nonce), timeout=5)
        assert await idle_cpu() < 0.1, "the loop spun on the descriptor while a handler held the messages"
        assert got == [] and plane.received == 1
        gate.set()
        await until(lambda: got == [1, 2, 3])
        assert await idle_cpu() < 0.1, "the loop spun on an idle socket's descriptor"
        await peer.send(plane.endpoint, Ping(endpoint=peer.endpoint, nonce=4), timeout=5)
        await until(lambda: got == [1, 2, 3, 4])  # a message after the idle time is still seen
    finally:
        await peer.aclose(0.0)
        await plane.aclose(0.0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_evicted_socket_still_delivers_what_it_queued_in_order() -> None:
    """A manager caching three outbound sockets talks to more peers than that. A peer that is slow to come up
    (not listening yet) gets a message, its socket is evicted by the next peers, and it gets a second one:
    once it listens it receives both, in order. So do peers whose messages were queued in a burst that
    evicted their sockets before the connections were made. The sockets stay bounded all the while."""
    got: dict[int, list[int]] = {}
    cache = 3

    def recorder(port: int) -> Callable[[Message], None]:
        def handler(msg: Message) -> None:
            assert isinstance(msg, Ping)
            got.setdefault(port, []).append(msg.nonce)
        return handler

    sender = ControlPlane("127.0.0.1", 0, lambda _: None, max_sockets=cache, max_message_bytes=4096)
    await sender.start()
    late_port = _free_port()
    late = f"tcp://127.0.0.1:{late_port}"
    peers = [ControlPlane("127.0.0.1", 0, recorder(i), max_sockets=2, max_message_bytes=4096) for i in range(5)]
    late_peer = ControlPlane("127.0.0.1", late_port, recorder(late_port), max_sockets=2, max_message_bytes=4096)
    try:
        for peer in peers:
            await peer.start()
        assert sender.try_send(late, Ping(endpoint=sender.endpoint, nonce=1))  # queued: nobody listens yet
        for peer in peers:  # a burst: each send evicts a socket whose connection may not be made yet
            assert sender.try_send(peer.endpoint, Ping(endpoint=sender.endpoint, nonce=10))
            assert sender.open_sockets <= 2 * cache + 1
        assert sender.evicted == 3
        await sender.send(late, Ping(endpoint=sender.endpoint, nonce=2), timeout=5)
        await late_peer.start()
        deadline = time.monotonic() + 10
        while len(got.get(late_port, [])) < 2 or sum(len(v) for k, v in got.items() if k != late_port) < 5:
            assert time.monotonic() < deadline, f"messages lost: {got}"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert got[late_port] == [1, 2]
        assert all(got.get(i) == [10] for i in range(5)), got
        assert sender.open_sockets <= 2 * cache + 1
    finally:
        for plane in [sender, late_peer, *peers]:
            await plane.aclose(0.0)


async def test_evicted_sockets_are_bounded_by_the_context_and_a_send_waits_for_room_instead_of_dropping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Peers that never listen: the sockets evicted from the cache stay open a bounded time to deliver what
    they queued; beyond ``max_sockets`` of them the oldest are handed over to libzmq with the rest of their time
    as linger, never closed with what they hold. The context's limit bounds them all however many peers a flood
    of messages names: past it a send waits for room (bounded by its timeout) instead of dropping anything, and
    once the lingers are over sends go through again."""
    from aiotransfer._control import sockets

    monkeypatch.setattr(sockets, "RETIRE_S", 0.3)
    sender = ControlPlane("127.0.0.1", 0, lambda _: None, max_sockets=3, max_message_bytes=4096)
    await sender.start()
    limit = 3 * 3 + 2
    try:
        named = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(40)]
        sent = 0
        for i, peer in enumerate(named):
            if not sender.try_send(peer, Ping(endpoint=sender.endpoint, nonce=i)):
                break
            sent += 1
            assert sender.open_sockets <= limit
        assert 2 * 3 < sent < limit, sent  # the cache, as many retired, then handed over until the limit
        assert sender.evicted == sent - 3
        with pytest.raises(TransferTimeout):  # no room in the context: it waits, and withdraws on expiry
            await sender.send(named[sent], Ping(endpoint=sender.endpoint, nonce=0), timeout=0.05)
        sender.forget(named[sent - 1])  # a peer declared gone: its cached socket closes at once
        assert sender.open_sockets == sent  # the outbound ones left, and the inbound one
        await asyncio.sleep(0.4)  # every linger is over
        for peer in named[sent:]:
            await sender.send(peer, Ping(endpoint=sender.endpoint, nonce=1), timeout=5)
            assert sender.open_sockets <= limit
    finally:
        await sender.aclose(0.0)
