"""A bounded first contact with a Mooncake peer, before the engine makes its own.

Mooncake opens a peer's segment (``openSegment``) the first time a transfer names it. In P2P handshake mode
that is a metadata request to the peer's handshake port, and the binding makes it while holding its
engine-wide mutex (``TransferEnginePy::mutex_``, transfer_engine_py.cpp: ``transferSync``,
``batchTransferAsync``, ``transferSubmitWrite``), with a receive timeout of 60 s fixed in the source
(``SocketHandShakePlugin::doConnect``, transfer_metadata_plugin.cpp: ``timeout.tv_sec = 60``). Every
submit to every peer takes the same mutex, so a peer that accepts the connection and never answers holds
all of the process's writes for a minute.

:func:`fetch_descriptor` makes the same metadata request from Python with a bound of our choosing, without
the engine's mutex; the adapter lets the engine open a segment only for a peer that just answered it. The
request is the one the engine makes (transfer_metadata.cpp, ``getSegmentDesc``): an 8-byte little-endian
length, one type byte (``HandShakeRequestType::Metadata`` = 1, common.h) and a JSON body, which the peer
parses and ignores (``receivePeerMetadata``); the answer has the same framing and carries the peer's segment
descriptor as JSON (``encodeSegmentDesc``). A peer's listener serves one connection at a time
(``SocketHandShakePlugin::startDaemon``), so a peer that answers this request answers the engine's own
identical one a moment later, unless it is built to tell them apart.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

from ..errors import EngineError

__all__ = ["METADATA_REQUEST", "fetch_descriptor"]

METADATA_REQUEST = 1
"""``HandShakeRequestType::Metadata`` (Mooncake common.h)."""
_MAX_ANSWER = 1 << 20
"""Mooncake's own bound on a handshake message (``kDefaultHandshakeMaxLength``, common.h)."""
_BODY = b"{}"


def _frame(kind: int, body: bytes) -> bytes:
    return struct.pack("<QB", len(body) + 1, kind) + body


def _read_exactly(sock: socket.socket, n: int, deadline: float, peer: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise EngineError(f"Mooncake peer {peer} did not answer its metadata request in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(out))
        except TimeoutError:
            raise EngineError(f"Mooncake peer {peer} did not answer its metadata request in time") from None
        if not chunk:
            raise EngineError(f"Mooncake peer {peer} closed the connection before answering its metadata request")
        out += chunk
    return bytes(out)


def fetch_descriptor(peer: str, timeout: float) -> dict[str, Any]:
    """The segment descriptor ``peer`` (``host:port`` of its handshake listener) answers with, within
    ``timeout`` seconds; raises :class:`EngineError` naming what went wrong. Blocking: call off the loop."""
    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit():
        raise EngineError(f"Mooncake peer {peer!r} is not host:port")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=max(timeout, 1e-3)) as sock:
            sock.sendall(_frame(METADATA_REQUEST, _BODY))
            (length,) = struct.unpack("<Q", _read_exactly(sock, 8, deadline, peer))
            if not 1 <= length <= _MAX_ANSWER:
                raise EngineError(f"Mooncake peer {peer} answered its metadata request with a {length}-byte frame")
            answer = _read_exactly(sock, length, deadline, peer)
    except OSError as exc:
        raise EngineError(f"Mooncake peer {peer} is unreachable: {exc}") from exc
    if answer[0] != METADATA_REQUEST:
        raise EngineError(f"Mooncake peer {peer} answered its metadata request with message type {answer[0]}")
    try:
        desc = json.loads(answer[1:])
    except ValueError as exc:
        raise EngineError(f"Mooncake peer {peer} answered its metadata request with malformed JSON") from exc
    if not isinstance(desc, dict):
        raise EngineError(f"Mooncake peer {peer} answered its metadata request with {type(desc).__name__}")
    return desc
