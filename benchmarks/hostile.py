"""A decode whose Mooncake handshake hangs: a listener in front of its engine's handshake port (tools and
tests only).

Mooncake opens a new peer's segment with a metadata request to that peer's handshake port, holding its
engine-wide mutex until the answer comes (60 s at most, fixed in its source). :func:`front_handshake` makes
a manager advertise, as its engine's address, a listener that answers one request (forwarded to the engine)
and holds the next one ``hold`` seconds before closing it unanswered, and so on alternately
(``mode="once"``: each time a prefill contacts it, a peer that stops answering right after its first
answer), or holds every request (``mode="silent"``).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

__all__ = ["front_handshake"]


def _read_frame(conn: socket.socket) -> bytes:
    head = conn.recv(8, socket.MSG_WAITALL)
    if len(head) < 8:
        return b""
    (n,) = struct.unpack("<Q", head)
    return head + conn.recv(n, socket.MSG_WAITALL)


def front_handshake(mgr: Any, hold: float, mode: str) -> str:
    """Front ``mgr``'s Mooncake engine (a started :class:`~aiotransfer.KVManager` of this process) with the
    listener described above; returns the address it advertises from now on. Patches the adapter class:
    every Mooncake manager of this process advertises it."""
    from aiotransfer.engines._mooncake import MooncakeEngine

    real = mgr.engine.session_id
    host, _, port = real.rpartition(":")
    listener = socket.create_server((host, 0))
    front = f"{host}:{listener.getsockname()[1]}"
    answered = [0]

    def serve(conn: socket.socket) -> None:
        with conn:
            request = _read_frame(conn)
            answered[0] += 1
            if mode == "once" and answered[0] % 2 == 1 and request:
                with socket.create_connection((host, int(port))) as up:
                    up.sendall(request)
                    conn.sendall(_read_frame(up))
                return
            time.sleep(hold)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, name="aiotransfer-hostile-front", daemon=True).start()
    MooncakeEngine.session_id = property(lambda self: front)  # type: ignore[method-assign, assignment]
    return front
