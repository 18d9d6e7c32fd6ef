"""ZMQ endpoint of one manager: one PULL socket in, a capped LRU cache of PUSH sockets out.

Each message is one multipart ZMQ message: ``[payload]``, or ``[payload, header, mac]`` when a shared
secret is configured: ``header`` = (counter, send time, sender incarnation, destination incarnation, sender
endpoint, destination endpoint) and ``mac`` = HMAC-SHA256 over header and payload. A receiver rejects bad
signatures, messages addressed to another endpoint, messages older than the replay window, any counter not
above the last one seen from that sender endpoint (replays), and a payload naming another sender than the
signed one.

Replays die with the process: every process has its own incarnation id, and a signed message names the
incarnation of the destination it was written for (the one its sender last heard from that endpoint; 0 when
it has heard none). A message for an earlier incarnation, or for none, is refused, except the few that open
contact (:data:`CONTACT`), which carry nothing a stranger could not ask for; a transfer request for another
incarnation goes to ``on_stranger``, which answers that the decode must register again (never served). Inbound messages are read
frame by frame and a message over the whole-message bound (frame count, total bytes) is discarded as it is
read, never assembled. Inbound messages that are too large, unauthenticated, or fail decoding/validation
are counted by cause, logged (rate-limited) and dropped; bad input never stops the receiving. Messages are
taken in the inbound socket's reader callback, one per callback, and handed to the handler right there.
Per-peer ordering is ZMQ's per-pipe FIFO: aux bytes sent before a status arrive before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, cast

import zmq
from zmq.utils import z85

from .._deadline import reap, within
from ..errors import ClosedError, PeerError, ProtocolError, TransferTimeout
from .messages import Hello, Message, Ping, RankRegister, TopologyQuery, TransferRequest, decode, encode
from .sockets import SocketCache, socket_budget

__all__ = ["ControlPlane", "ReplayGuard", "curve_keys", "normalize_endpoint", "signed_frames"]

log = logging.getLogger("aiotransfer.control")

Handler = Callable[[Message], Awaitable[None] | None]

_HEADER = struct.Struct("<QdQQ")
"""Signed header, fixed part: counter, send time, sender incarnation, destination incarnation; then the sender
and destination endpoints."""
_MAC_DOMAIN = b"aiotransfer-control-v3\x00"
CONTACT = (Hello, TopologyQuery, Ping, RankRegister)
"""Messages accepted whatever incarnation of ours they name: they open contact with a process whose
incarnation the sender cannot know yet (its first message, or ours after a restart). A replayed one asks only
what its signer may ask anyway: a registration (answered to the signer), a topology or a ``Pong``."""
_MAX_ENDPOINT = 255
REPLAY_WINDOW = 30.0
"""Seconds a signed message stays acceptable (clock skew between hosts must stay below this)."""
MAX_SENDERS = 4096
"""Sender endpoints whose replay state is kept at once; a sender silent for two replay windows is forgotten
first (none of its old messages can pass the window any more)."""
MAX_FRAMES = 64
"""Frames in one inbound message (the native wire uses at most 3; SGLang's registration 20)."""
FRAME_OVERHEAD = 1024
"""Bytes a message may carry beyond ``max_message_bytes``: the signed header and the MAC."""
_MAX_CAUSES = 64
"""Distinct drop causes counted by name; any further cause is counted as ``other``."""
_ERROR_RETRY_S = 0.01
"""After a receive that failed (a socket error, or nothing to read where ``ZMQ_EVENTS`` said a message was in),
the next one is tried this much later: the descriptor's signal was taken, and no new one may come."""
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
"""Plain ints: ``int & IntFlag`` goes through the enum machinery on every message."""


_sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


def normalize_endpoint(peer: str) -> str:
    """``"host:port"`` or ``"tcp://host:port"`` -> ``"tcp://host:port"``."""
    peer = peer.strip()
    if not peer.startswith("tcp://"):
        peer = "tcp://" + peer
    host, sep, port = peer[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer must be 'host:port', got {peer!r}")
    return peer


def _mac(key: bytes, header: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, _MAC_DOMAIN, hashlib.sha256)
    mac.update(header)
    mac.update(payload)
    return mac.digest()


def signed_frames(key: bytes, payload: bytes, *, sender: str, destination: str, counter: int, sent: float,
                  incarnation: int = 0, to_incarnation: int = 0) -> list[bytes]:
    """``[payload, header, mac]``: ``payload`` signed by ``sender`` (of ``incarnation``) for ``destination``
    (of ``to_incarnation``; 0: not known to the sender) only."""
    src, dst = sender.encode(), destination.encode()
    if len(src) > _MAX_ENDPOINT or len(dst) > _MAX_ENDPOINT:
        raise ValueError("control endpoints are at most 255 bytes long")
    header = _HEADER.pack(counter, sent, incarnation, to_incarnation) + bytes((len(src), len(dst))) + src + dst
    return [payload, header, _mac(key, header, payload)]


def curve_keys(key: bytes) -> tuple[bytes, bytes]:
    """The CurveZMQ key pair (public, secret; Z85) that every manager sharing ``key`` derives from it: each
    control socket serves and connects with it, so a host that does not hold the secret cannot complete a
    handshake (it would need the server's public key, which only the secret gives)."""
    secret = z85.encode(hashlib.sha256(b"aiotransfer-curve-v1\x00" + key).digest())
    return zmq.curve_public(secret), secret


def _claimed_sender(msg: Message) -> str | None:
    """The endpoint a message says it comes from (None for answers that name none)."""
    if isinstance(msg, RankRegister):
        return msg.rank.endpoint
    claimed = getattr(msg, "endpoint", None)
    return claimed if isinstance(claimed, str) else None


class ReplayGuard:
    """Replay state per sender endpoint: the last counter accepted from each, bounded in count and time.

    A sender silent for two replay windows is forgotten: every message it sent before is outside the window
    by then. Past ``max_senders`` the least recently heard sender is forgotten first."""

    def __init__(self, window: float, max_senders: int) -> None:
        self.window = window
        self.max_senders = max_senders
        self._last: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.evicted = 0
        """Senders forgotten while still inside the window (the table was full)."""

    def accept(self, sender: str, counter: int) -> bool:
        """True (and remembered) when ``counter`` is above the last one accepted from ``sender``."""
        now = time.monotonic()
        while self._last:
            oldest, (_, heard) = next(iter(self._last.items()))
            if now - heard <= 2 * self.window:
                break
            del self._last[oldest]
        last = self._last.get(sender)
        if last is not None and counter <= last[0]:
            return False
        self._last[sender] = (counter, now)
        self._last.move_to_end(sender)
        if len(self._last) > self.max_senders:
            self._last.popitem(last=False)
            self.evicted += 1
        return True

    def __len__(self) -> int:
        return len(self._last)


class ControlPlane:
    """Inbound PULL + outbound PUSH cache; delivers decoded messages to ``handler`` in arrival order.

    With ``hmac_key``, every connection is also authenticated with CurveZMQ keys derived from it unless
    ``curve`` is False (see :func:`curve_keys`)."""

    def __init__(
        self,
        hostname: str,
        port: int,
        handler: Handler,
        *,
        max_sockets: int,
        max_message_bytes: int,
        hmac_key: bytes | None = None,
        curve: bool | None = None,
        incarnation: int = 0,
        on_stranger: Callable[[TransferRequest], None] | None = None,
    ) -> None:
        if curve and hmac_key is None:
            raise ValueError("connection authentication (curve) derives its keys from the shared secret: set hmac_key")
        self._curve = curve_keys(hmac_key) if curve is not False and hmac_key is not None else None
        """(public, secret) CurveZMQ keys of every manager sharing the secret, or None. ``curve=None``: on
        whenever there is a secret."""
        self._ctx: zmq.Context[Any] | None = None
        self._hostname = hostname
        self._port = port
        self._handler = handler
        self._max_sockets = max_sockets
        self._max_bytes = max_message_bytes
        self._key = hmac_key
        self._pull: zmq.Socket[Any] | None = None
        self._out: SocketCache | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading: int | None = None
        """The inbound socket's descriptor, while the loop watches it."""
        self._awaiting: asyncio.Future[None] | None = None
        """An asynchronous handler's result being awaited; the messages behind it wait."""
        self._closed = False
        self.dropped: Counter[str] = Counter()
        self.received = 0
        self.sent = 0
        self._last_warn = 0.0
        self.endpoint = ""
        self._counter = 0
        self._replay = ReplayGuard(REPLAY_WINDOW, MAX_SENDERS)
        self.incarnation = incarnation or int.from_bytes(os.urandom(8), "little") >> 2 or 1
        """This process's incarnation id, in every message it signs; a successor on the same endpoint has
        another, so what was signed for this one is refused there."""
        self._peers: OrderedDict[str, int] = OrderedDict()
        """The incarnation each sender endpoint last signed with (bounded like the replay state)."""
        self._on_stranger = on_stranger
        self.whole_message_bound = True
        """Refuse a message over ``max_message_bytes`` (and :data:`MAX_FRAMES`) while reading it, before it is
        assembled; False only to show what the bound prevents."""

    async def start(self) -> None:
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)
        size, limit = socket_budget(self._max_sockets)
        self._ctx.set(zmq.MAX_SOCKETS, limit)  # ZeroMQ's default (1,023) is below what the cache may open
        self._out = SocketCache(self._ctx, size, self._configure)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.MAXMSGSIZE, self._max_bytes + FRAME_OVERHEAD)  # per frame: see _recv_message
        if self._curve is not None:  # a host without the secret cannot complete the handshake: no frame gets in
            pull.curve_server = True
            pull.curve_publickey, pull.curve_secretkey = self._curve
        addr = f"tcp://{self._hostname}"
        if self._port:
            pull.bind(f"{addr}:{self._port}")
            port = self._port
        else:
            port = pull.bind_to_random_port(addr)
        self._pull = pull
        self.endpoint = f"{addr}:{port}"
        self._loop = loop = asyncio.get_running_loop()
        self._reading = int(pull.getsockopt(zmq.FD))
        loop.add_reader(self._reading, self._on_readable)
        loop.call_soon(self._on_readable)

    # -- outbound -------------------------------------------------------------------------------
    def _configure(self, sock: zmq.Socket[Any]) -> None:
        """Options of a new outbound socket (before it connects)."""
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
        if self._curve is not None:
            sock.curve_serverkey = self._curve[0]
            sock.curve_publickey, sock.curve_secretkey = self._curve

    @property
    def _sockets(self) -> SocketCache:
        if self._out is None:
            raise ClosedError("control plane is not started")
        return self._out

    @property
    def sockets_opened(self) -> int:
        """Outbound sockets opened so far: each a new connection (and a CurveZMQ handshake with curve on)."""
        return self._out.opened if self._out is not None else 0

    @property
    def evicted(self) -> int:
        """Outbound sockets evicted from the cache so far."""
        return self._out.evicted if self._out is not None else 0

    def frames(self, msg: Message, destination: str) -> list[bytes]:
        """The frames of ``msg`` for ``destination``; signed for that destination only when a key is set."""
        payload = encode(msg)
        if self._key is None:
            return [payload]
        # Wall-clock nanoseconds, and strictly increasing: a restarted process on the same endpoint starts
        # above anything its previous incarnation sent.
        self._counter = max(self._counter + 1, time.time_ns())
        return signed_frames(self._key, payload, sender=self.endpoint, destination=destination,
                             counter=self._counter, sent=time.time(), incarnation=self.incarnation,
                             to_incarnation=self._peers.get(destination, 0))

    async def send(self, endpoint: str, msg: Message, *, timeout: float, yield_cpu: bool = False) -> None:
        """Queue ``msg`` to ``endpoint``; waits (bounded) only if the peer's queue is full. ``yield_cpu``:
        as in :meth:`try_send`, when the message was queued at once."""
        await self.send_frames(endpoint, self.frames(msg, endpoint), timeout=timeout, yield_cpu=yield_cpu)

    async def send_frames(
        self, endpoint: str, frames: list[bytes], *, timeout: float, yield_cpu: bool = False
    ) -> None:
        """Queue one multipart message without waiting when it can; only a full peer queue (or earlier
        messages to the same peer still waiting for room) makes this wait, bounded by ``timeout``, and the
        message is withdrawn on expiry."""
        if self._closed:
            raise ClosedError("control plane is closed")
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            out = await self._sockets.get(endpoint, timeout)
            if await out.send(frames, max(deadline - loop.time(), 0.0)) and yield_cpu:
                _sched_yield()
        except asyncio.TimeoutError:
            raise TransferTimeout(f"control message to {endpoint} not accepted within {timeout}s") from None
        except zmq.ZMQError as exc:
            raise PeerError(f"cannot send to {endpoint}: {exc}") from exc
        self.sent += 1

    def try_send(self, endpoint: str, msg: Message, *, yield_cpu: bool = False) -> bool:
        """Hand ``msg`` to ZMQ without waiting, from synchronous code; False (nothing sent) when the
        message would have to queue behind earlier ones or the peer's queue is full.

        ``yield_cpu``: once the message is queued, yield this thread's CPU (``sched_yield``) so ZMQ's I/O
        thread, just woken to put the message on the wire, runs now instead of when the event loop next
        sleeps. On a host with few cores the woken thread is often queued on this very CPU."""
        if self._closed:
            return False
        try:
            out = self._sockets.now(endpoint)
            if out is None or not out.try_send(self.frames(msg, endpoint)):
                return False  # the caller sends it the ordinary way
        except zmq.ZMQError:
            return False
        self.sent += 1
        if yield_cpu:
            _sched_yield()
        return True

    def forget(self, endpoint: str) -> None:
        """The peer at ``endpoint`` is gone: its socket closes, and what it still queued is dropped."""
        if self._out is not None:
            self._out.forget(endpoint)

    @property
    def open_sockets(self) -> int:
        """Sockets open: cached outbound ones, evicted ones still delivering (see :class:`SocketCache`), and the
        inbound one."""
        return (len(self._out) if self._out is not None else 0) + (1 if self._pull is not None else 0)

    # -- inbound --------------------------------------------------------------------------------
    def parse(self, frames: list[bytes]) -> Message | None:
        """Authenticate and decode one multipart message (raises :class:`ProtocolError`)."""
        if not frames or len(frames) > 3:
            raise ProtocolError("bad frame count")
        payload = frames[0]
        if len(payload) > self._max_bytes:
            raise ProtocolError("message too large")
        if self._key is None:
            if len(frames) != 1:
                raise ProtocolError("unexpected authentication frames (this endpoint has no shared secret)")
            return decode(payload)
        if len(frames) != 3:
            raise ProtocolError("unauthenticated message")
        header = frames[1]
        fixed = _HEADER.size + 2
        if len(header) < fixed or len(header) != fixed + header[_HEADER.size] + header[_HEADER.size + 1]:
            raise ProtocolError("unauthenticated message")
        if not hmac.compare_digest(_mac(self._key, header, payload), frames[2]):
            raise ProtocolError("bad signature")
        counter, sent, incarnation, to_incarnation = _HEADER.unpack_from(header)
        split = fixed + header[_HEADER.size]
        sender, destination = header[fixed:split].decode("utf-8", "replace"), header[split:].decode("utf-8", "replace")
        if destination != self.endpoint:
            raise ProtocolError(f"wrong destination: signed for {destination}")
        if abs(time.time() - sent) > REPLAY_WINDOW:
            raise ProtocolError("stale signed message (outside the replay window)")
        msg = decode(payload)
        claimed = _claimed_sender(msg)
        if claimed is not None and claimed != sender:
            raise ProtocolError(f"sender mismatch: signed by {sender}, names {claimed}")
        if not self._replay.accept(sender, counter):
            raise ProtocolError("replayed message")
        self._learn(sender, incarnation)
        if to_incarnation == self.incarnation or isinstance(msg, CONTACT):
            return msg
        if isinstance(msg, TransferRequest) and self._on_stranger is not None:
            self._on_stranger(msg)  # counted there, never served: the decode registers again
            return None
        if to_incarnation == 0:
            raise ProtocolError("addressed to no incarnation (the sender has not heard from this process)")
        raise ProtocolError("addressed to an earlier incarnation of this endpoint")

    def _learn(self, sender: str, incarnation: int) -> None:
        """Remember the incarnation ``sender`` signs with, to address what we send it (bounded)."""
        if not incarnation:
            return
        self._peers[sender] = incarnation
        self._peers.move_to_end(sender)
        if len(self._peers) > MAX_SENDERS:
            self._peers.popitem(last=False)

    def _take(self, pull: zmq.Socket[Any]) -> list[bytes] | None:
        """The frames of the message whose first frame is in, or None when it broke the whole-message bound
        (counted).

        libzmq hands a multipart message over only once all its frames are in; the rest of the frames are
        therefore read without waiting, and past the bound they are released one by one, never copied."""
        first: bytes = pull.recv(zmq.NOBLOCK)
        frames, total, cause = [first], len(first), ""
        budget, bounded = self._max_bytes + FRAME_OVERHEAD, self.whole_message_bound
        while pull.get(zmq.RCVMORE):
            if cause:
                total += len(pull.recv(zmq.NOBLOCK, copy=False))
                continue
            frame: bytes = pull.recv(zmq.NOBLOCK)
            total += len(frame)
            frames.append(frame)
            if bounded and (len(frames) > MAX_FRAMES or total > budget):
                cause = "too many frames" if len(frames) > MAX_FRAMES else "message too large"
                frames.clear()
        if not cause:
            return frames
        self._drop(cause, ProtocolError(f"{cause}: {total} bytes, bound {budget} bytes in {MAX_FRAMES} frames"))
        return None

    def _on_readable(self) -> None:
        """Take one message and hand it to the handler, right here in the socket's reader callback (and in
        its own follow-up): no task to wake, so a message reaches its handler in the loop iteration that saw
        it arrive. While messages remain, the next one is taken in a callback scheduled after whatever this
        one woke (a ``done()`` waiter runs before the next receive). A handler that returns an awaitable
        holds the messages behind it until it is over, as in order delivery requires (:meth:`_after`)."""
        pull, loop = self._pull, self._loop
        if pull is None or loop is None or self._closed:
            return
        try:
            # reading EVENTS also clears the descriptor's signal: the callback is not called again for it
            if not cast(int, pull.getsockopt(_EVENTS)) & _POLLIN or self._awaiting is not None:
                return
            frames = self._take(pull)
        except zmq.ZMQError as exc:
            if not self._closed:
                if not isinstance(exc, zmq.Again):
                    self._drop("socket-error", exc)
                loop.call_later(_ERROR_RETRY_S, self._on_readable)
            return
        if frames is not None:
            result = self._hand_over(frames)
            if result is not None:
                self._awaiting = asyncio.ensure_future(self._after(result))
                return
        loop.call_soon(self._on_readable)

    def _hand_over(self, frames: list[bytes]) -> Awaitable[None] | None:
        """Parse and deliver one message; the handler's awaitable, if it returned one."""
        try:
            msg = self.parse(frames)
        except ProtocolError as exc:
            self._drop(str(exc).split(":")[0], exc)
            return None
        except Exception as exc:  # a parser's own bug must not stop the messages behind this one
            self._drop("malformed", exc)
            return None
        if msg is None:
            return None  # consumed by the protocol layer itself
        self.received += 1
        try:
            return self._handler(msg)
        except Exception:
            self._handler_failed(msg)
            return None

    async def _after(self, result: Awaitable[None]) -> None:
        """Await an asynchronous handler; the messages behind it are taken once it is over."""
        try:
            await result
        except asyncio.CancelledError:
            raise
        except Exception:
            self._handler_failed(None)
        finally:
            self._awaiting = None
            if not self._closed:
                asyncio.get_running_loop().call_soon(self._on_readable)

    def _handler_failed(self, msg: Message | None) -> None:
        self.dropped["handler-error"] += 1
        log.exception("control handler failed on %s", type(msg).__name__ if msg is not None else "a message")

    def _drop(self, cause: str, exc: BaseException) -> None:
        if cause not in self.dropped and len(self.dropped) >= _MAX_CAUSES:
            cause = "other"
        self.dropped[cause] += 1
        now = time.monotonic()
        if now - self._last_warn > 1.0:
            self._last_warn = now
            log.warning("dropped control message (%s): %s [total dropped %d]", cause, exc, sum(self.dropped.values()))

    async def aclose(self, linger: float = 0.5) -> None:
        """Stop receiving; give queued outbound messages (a last Success status...) up to ``linger``
        seconds to leave, on a helper thread so the event loop never blocks on it."""
        self._closed = True
        if self._reading is not None and self._loop is not None:
            self._loop.remove_reader(self._reading)
            self._reading = None
        if self._awaiting is not None:
            awaiting, self._awaiting = self._awaiting, None
            if isinstance(awaiting, asyncio.Task):
                await reap(awaiting, 1.0)
        if self._out is not None:
            self._out.close_all(linger)
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def term() -> None:
            ctx.term()
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done.set)

        threading.Thread(target=term, name="aiotransfer-zmq-term", daemon=True).start()
        try:
            await within(done.wait(), linger + 1.0)
        except asyncio.TimeoutError:
            log.warning("control sockets still draining after %.1fs; leaving them to a helper thread", linger)
