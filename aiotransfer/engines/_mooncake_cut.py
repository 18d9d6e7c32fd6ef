"""Cutting the Mooncake TCP transport's connections to one peer, from outside the engine.

Mooncake's Python binding has no call that ends a write or closes the connections to a peer (no
``closeSegment``, no cancel: 0.3.13's ``TransferEngine`` offers submits, status queries and memory
registration only). Over TCP a write whose peer is stopped (SIGSTOP, a frozen VM) never ends: its body cannot
enter the full socket, and Mooncake arms its acknowledgement deadline only once the whole body has
(docs/engines.md, "What each engine answer means"). Its entries answer 0 for as long as the peer is stopped,
and when it runs again the engine reads the rest of the source and sends it.

:func:`cut_connections` ends that path from outside: it shuts down (``shutdown(SHUT_RDWR)``) every TCP socket
of this process connected to the peer's data address, which only the engine's lanes to that peer are. The
engine's pending socket operations then fail, the engine closes the sockets itself (the file descriptors stay
the engine's: a shutdown closes none, so no number is freed under it), and it answers -1 for the entries that
were on them, which it does only after the body write that reads their source ended (docs/engines.md). What
the kernel had already taken from the source before the cut still reaches the peer when it runs again (a
shutdown sends queued bytes before its FIN): those are the write's own bytes, read while its pages were still
held, and the decode's landing grace covers them. Measured (tests/test_frozen_decode.py): with 32 MiB in four
entries to a stopped decode, the entries answered -1 within milliseconds of the cut, and no byte written into
the source after it reached the decode.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

__all__ = ["cut_connections"]

log = logging.getLogger("aiotransfer.engines.mooncake")

_FDS = "/proc/self/fd"


def _addresses(host: str, port: int) -> set[tuple[str, int]]:
    """``host`` (an address, or a name resolved here) as normalised (address, port) pairs."""
    try:
        return {(str(ipaddress.ip_address(host.strip("[]"))), port)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {(str(ipaddress.ip_address(info[4][0])), port) for info in infos}


def _peer_of(sock: socket.socket) -> tuple[str, int] | None:
    try:
        addr = sock.getpeername()
    except OSError:
        return None
    if not isinstance(addr, tuple):
        return None
    ip = ipaddress.ip_address(addr[0].split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(addr[1])


def cut_connections(host: str, port: int) -> int:
    """Shut down every TCP socket of this process connected to ``host:port``; returns how many. Blocking only
    for a name lookup when ``host`` is not an address (the engine's descriptors carry addresses)."""
    targets = _addresses(host, port)
    if not targets:
        return 0
    try:
        fds = os.listdir(_FDS)
    except OSError:
        return 0
    cut = 0
    for name in fds:
        try:
            if not os.readlink(f"{_FDS}/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))  # the engine may close its number meanwhile: we work on our own copy
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if _peer_of(sock) not in targets:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError as exc:  # already shut or reset: nothing of it is left to cut
                log.debug("shutdown of a connection to %s:%d: %r", host, port, exc)
                continue
            cut += 1
    return cut
