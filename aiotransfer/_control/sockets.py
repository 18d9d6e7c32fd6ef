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
import errno
import logging
import resource
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, cast

import zmq

from .._deadline import within

__all__ = ["KEEP_S", "RETIRE_S", "OrderedSender", "SocketCache", "Watch", "socket_budget"]

log = logging.getLogger("aiotransfer.control")


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


RETIRE_S = 5.0
"""Seconds an outbound socket evicted from the cache (``max_sockets``) stays open, so that what it queued still
leaves (a peer slow to connect, a burst that evicted sockets before their connections were made): closing it
at once would drop those messages, a ``Success`` among them. A message to its peer meanwhile takes it back into
the cache, so nothing overtakes what it queued."""
KEEP_S = 60.0
"""Seconds an evicted socket is kept open at most while fewer than ``max_sockets`` evicted ones are: a peer
used again meanwhile takes its connection back, with no new TCP connection or CurveZMQ handshake (a fleet
larger than the cache, each peer used every few seconds, kept reconnecting when evicted sockets closed after
:data:`RETIRE_S`)."""
_FD_RESERVE = 256
"""File descriptors left to the rest of the process (engines, files, the loop) when sizing the cache."""
_FDS_PER_PEER = 9
"""Descriptors one cached peer may need at worst: three sockets (cached, retired, handed over to libzmq), each
with its mailbox and its connection, and the connection the peer makes to our inbound socket."""
_SOCKET_WAIT_S = 0.005
"""While libzmq has no room for another socket (handed-over sockets still delivering), a send looks again this
often."""


def socket_budget(max_sockets: int) -> tuple[int, int]:
    """``(cache size, the context's MAX_SOCKETS)`` for ``max_sockets``: the cache, as many retired sockets and
    as many handed over to libzmq (see :class:`SocketCache`), the inbound socket and one spare. ZeroMQ's own
    default (1,023) is below what a cache of 512 needs. The cache is made smaller, with a warning, when this
    process's limit on file descriptors (``ulimit -n``) could not carry it."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    size = max_sockets
    if soft != resource.RLIM_INFINITY:
        fit = max((soft - _FD_RESERVE) // _FDS_PER_PEER, 1)
        if fit < size:
            log.warning("max_sockets=%d needs about %d file descriptors and this process may open %d (ulimit -n): "
                        "caching %d outbound control sockets instead", max_sockets, max_sockets * _FDS_PER_PEER
                        + _FD_RESERVE, soft, fit)
            size = fit
    return size, 3 * size + 2


class SocketCache:
    """Outbound PUSH sockets by peer endpoint, within the context's socket limit, never dropping what one queued.

    At most ``size`` are cached; the least recently used beyond that is evicted, not closed: it stays open
    (retired) for :data:`KEEP_S`, and a message to its peer meanwhile takes it back with its connection. Beyond
    ``size`` retired sockets, the oldest is closed: when it was retired less than :data:`RETIRE_S` ago, it is
    handed over to libzmq with the rest of that time as linger, so that libzmq still delivers what it queued
    (and frees it as soon as it has). A message to that peer waits until
    the linger is over, so that nothing overtakes what the old socket may still hold. When libzmq has no room
    for a new socket (handed-over sockets still delivering), a send waits for one. Only :meth:`forget` (the peer
    is gone) closes a socket with what it holds."""

    def __init__(self, ctx: zmq.Context[Any], size: int, configure: Callable[[zmq.Socket[Any]], None]) -> None:
        self._ctx = ctx
        self.size = size
        self._configure = configure
        self._out: OrderedDict[str, OrderedSender] = OrderedDict()
        self._retired: OrderedDict[str, tuple[float, OrderedSender]] = OrderedDict()
        """Sockets evicted from :attr:`_out`, oldest first, with when each was."""
        self._handed: OrderedDict[str, float] = OrderedDict()
        """Peers whose socket was handed over to libzmq, with when its linger ends (oldest first)."""
        self.evicted = 0
        self.handed_over = 0
        """Retired sockets handed over to libzmq early (too many retired at once)."""
        self.opened = 0
        """Sockets opened so far (each a new connection, and a CurveZMQ handshake when curve is on)."""
        self.waited = 0
        """Sends that waited for a socket (a handed-over one's linger, or room in the context)."""

    def __len__(self) -> int:
        """Outbound sockets open: cached, retired, and handed over ones whose linger is not over (libzmq frees
        those as soon as they have delivered: this counts them until the latest)."""
        self._expire(time.monotonic())
        return len(self._out) + len(self._retired) + len(self._handed)

    def now(self, endpoint: str) -> OrderedSender | None:
        """The socket to ``endpoint`` if one can be had without waiting; None otherwise."""
        out = self._out.get(endpoint)
        if out is not None:
            self._out.move_to_end(endpoint)
            return out
        now = time.monotonic()
        self._expire(now)
        if endpoint in self._handed:
            return None
        retired = self._retired.pop(endpoint, None)
        if retired is not None:
            out = retired[1]
        else:
            try:
                sock = self._ctx.socket(zmq.PUSH)
            except zmq.ZMQError as exc:
                if exc.errno == errno.EMFILE:
                    return None
                raise
            try:
                self._configure(sock)
                sock.connect(endpoint)
            except BaseException:
                sock.close(linger=0)
                raise
            out = OrderedSender(sock)
            self.opened += 1
        while len(self._out) >= self.size:
            old_endpoint, old = self._out.popitem(last=False)
            self._retired[old_endpoint] = (now, old)
            self.evicted += 1
        self._out[endpoint] = out
        self._expire(now)
        return out

    async def get(self, endpoint: str, timeout: float) -> OrderedSender:
        """The socket to ``endpoint``, waiting at most ``timeout`` seconds for one (:class:`asyncio.TimeoutError`)."""
        out = self.now(endpoint)
        if out is not None:
            return out
        self.waited += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (out := self.now(endpoint)) is None:
            left = deadline - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            until = self._handed.get(endpoint)
            wait = until - time.monotonic() if until is not None else _SOCKET_WAIT_S
            await asyncio.sleep(min(max(wait, 0.0), left))
        return out

    def _expire(self, now: float) -> None:
        """Close the retired sockets kept for :data:`KEEP_S`, and the oldest beyond ``size`` retired ones: handed
        over to libzmq with the rest of their :data:`RETIRE_S` as linger when they were retired more recently
        than that. A socket that sends still wait on stays."""
        while self._handed and next(iter(self._handed.values())) <= now:
            self._handed.popitem(last=False)
        over = len(self._retired) - self.size
        for endpoint, (since, out) in list(self._retired.items()):
            if now - since <= KEEP_S and over <= 0:
                return
            if out.waiting:
                continue  # sends wait for room on it: it stays, and is closed once they are done
            del self._retired[endpoint]
            over -= 1
            until = since + RETIRE_S
            if until > now:
                out.sock.close(linger=max(int((until - now) * 1000), 1))  # libzmq delivers, then frees it
                self._handed[endpoint] = until
                self.handed_over += 1
            else:
                out.sock.close(linger=0)  # had its time to deliver: what is left has nobody to go to

    def forget(self, endpoint: str) -> None:
        """The peer at ``endpoint`` is gone: its socket closes, and what it still queued is dropped."""
        out = self._out.pop(endpoint, None)
        if out is not None:
            out.sock.close(linger=0)
        retired = self._retired.pop(endpoint, None)
        if retired is not None:
            retired[1].sock.close(linger=0)

    def close_all(self, linger: float) -> None:
        for out in [*self._out.values(), *(out for _, out in self._retired.values())]:
            out.sock.close(linger=int(linger * 1000))
        self._out.clear()
        self._retired.clear()
        self._handed.clear()
