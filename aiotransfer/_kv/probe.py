"""Is anything listening at a control endpoint? A refused TCP connection proves a peer's process gone."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

__all__ = ["port_refuses"]

_PROBE_TIMEOUT = 0.5


async def port_refuses(endpoint: str) -> bool:
    """True when a TCP connection to ``endpoint`` (``tcp://host:port``) is refused: nothing listens there."""
    parts = urlsplit(endpoint if "://" in endpoint else f"tcp://{endpoint}")
    if parts.hostname is None or parts.port is None:
        return False
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    connecting = asyncio.ensure_future(loop.sock_connect(sock, addr))
    try:
        # asyncio.wait, not wait_for: on Python < 3.12 wait_for can swallow a cancellation
        done, _ = await asyncio.wait({connecting}, timeout=_PROBE_TIMEOUT)
        if not done:
            return False
        exc = connecting.exception()
        return isinstance(exc, ConnectionRefusedError)
    finally:
        connecting.cancel()
        sock.close()
