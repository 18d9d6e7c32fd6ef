"""Plain ZeroMQ sockets on the loop (``aiotransfer.control.sockets``): sends keep their order when the peer's
queue is full, a bounded send withdraws its message, and an idle socket does not wake the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from aiotransfer.control.sockets import OrderedSender, Watch


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


async def test_an_idle_watched_socket_does_not_wake_the_loop(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    """libzmq's descriptor stays readable until its signal is drained: a watch that did not drain it would
    run its callback on every loop iteration and spin a CPU."""
    push, pull = pair
    watch = Watch(pull, zmq.POLLIN)
    watch.start()
    try:
        for i in range(2):
            push.send(b"%d" % i)  # signals the descriptor while nobody waits
            await asyncio.sleep(0.01)
            await watch.wait()
            assert pull.recv(zmq.NOBLOCK) == b"%d" % i
        push.send(b"late")
        cpu = time.process_time()
        await asyncio.sleep(0.5)
        assert time.process_time() - cpu < 0.1, "the loop spun on the socket's descriptor"
        await asyncio.wait_for(watch.wait(), 5)  # the message that came while nobody waited is still seen
        assert pull.recv(zmq.NOBLOCK) == b"late"
    finally:
        watch.stop()
