"""Plain ZeroMQ sockets on an asyncio loop, without pyzmq's asyncio layer.

pyzmq's ``zmq.asyncio`` turns every receive into a future and re-reads the socket's event flags through
Python enums around it: measured on this project's CPU machine, 12-20 us per message received, where a
non-blocking receive on the plain socket takes 1.6 us, and 4-6 us per message sent against 2 us. A room
receives two control messages on its path (the request on the prefill, ``Success`` on the decode), so the
layer was a share of a small room's time that the floor does not have.

Here a socket is read and written with non-blocking calls, and the loop waits only when one says there is
nothing to read (or no room to write): then it watches the socket's file descriptor. That descriptor is
libzmq's mailbox signal, not the data: it turns readable when the socket's state may have changed, and only
``ZMQ_EVENTS`` (or a send or receive) drains it. So a waiter checks ``ZMQ_EVENTS`` before it sleeps, and
the reader callback reads them too, or a signal already taken by a send or receive would be waited for in
vain, and an undrained one would wake the loop on every iteration.

The inbound socket is read in its reader callback itself (``ControlPlane._on_readable`` in ``endpoint.py``), which reads
``ZMQ_EVENTS`` first for the same reason; :class:`Watch` serves outbound sockets waiting for room.

Every socket here belongs to the loop's thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, cast

import zmq

from .._deadline import within

__all__ = ["Watch", "OrderedSender"]


class Watch:
    """Waits, on the loop, until a socket has ``event`` (``zmq.POLLIN`` or ``zmq.POLLOUT``) pending."""

    def __init__(self, sock: zmq.Socket[Any], event: int) -> None:
        self._sock = sock
        self._event = int(event)
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None

    def _signalled(self) -> None:
        try:
            ready = self._pending()  # drains libzmq's signal
        except zmq.ZMQError:  # closed under us: whoever waits finds out on its next call
            ready = True
        waiter = self._waiter
        if ready and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pending(self) -> bool:
        return bool(int(cast(int, self._sock.getsockopt(zmq.EVENTS))) & self._event)

    async def wait(self, timeout: float | None = None) -> None:
        """Return once the event is pending (at once if it is); :class:`asyncio.TimeoutError` after
        ``timeout`` seconds (None: no bound). The descriptor is watched only while this waits."""
        if self._pending():
            return
        self._loop.add_reader(self._fd, self._signalled)
        self._waiter = waiter = self._loop.create_future()
        try:
            if timeout is None:
                await waiter
            else:
                await within(waiter, timeout)
        finally:
            self._waiter = None
            self._loop.remove_reader(self._fd)


class OrderedSender:
    """Sends on one socket in call order: a send that finds the peer's queue full waits for room, and every
    later send queues behind it (a send that went through at once would overtake it)."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self._queue: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> bool:
        """Sends wait for room on this socket (closing it now would fail them)."""
        return bool(self._queue)

    def try_send(self, frames: list[bytes]) -> bool:
        """Queue ``frames`` in libzmq now; False (nothing sent) when earlier sends wait or the queue is full.
        Raises :class:`zmq.ZMQError` for any other failure."""
        return not self._queue and self._send_now(frames)

    def _send_now(self, frames: list[bytes]) -> bool:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)  # a message is queued whole or not at all
        except zmq.Again:
            return False
        return True

    async def send(self, frames: list[bytes], timeout: float) -> bool:
        """Queue ``frames``, waiting at most ``timeout`` seconds for room behind earlier messages; on expiry
        :class:`asyncio.TimeoutError`, and nothing of the message was queued. True when it went at once."""
        if self.try_send(frames):
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        turn: asyncio.Future[None] = loop.create_future()
        self._queue.append(turn)
        try:
            if self._queue[0] is not turn:
                await within(turn, max(deadline - loop.time(), 0.0))  # set by the send before it
            watch = Watch(self.sock, zmq.POLLOUT)
            while not self._send_now(frames):
                await watch.wait(max(deadline - loop.time(), 0.0))
            return False
        finally:
            first = self._queue[0] is turn
            self._queue.remove(turn)
            if first and self._queue and not self._queue[0].done():
                self._queue[0].set_result(None)  # the next waiter's turn
