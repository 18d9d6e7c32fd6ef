"""The ceilings: a NumPy copy of the same bytes (memcpy) and Python ``sendall``/``recv_into`` between the
two worker processes over loopback TCP (8-byte header + 1-byte ack). Both block: they run on a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import MIB, TIMEOUT, rep_count, stats_us, timing

__all__ = ["TcpSink", "memcpy_ceiling", "tcp_ceiling"]


def memcpy_ceiling(sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    big = max(sizes)
    src = np.ones(big, dtype=np.uint8)
    dst = np.zeros(big, dtype=np.uint8)
    dst.fill(1)
    out: dict[str, Any] = {}
    for s in sorted(sizes):
        inner = max(1, min(64, (4 * MIB) // s))  # several copies per sample for tiny sizes (timer resolution)
        np.copyto(dst[:s], src[:s])
        times = []
        for _ in range(rep_count(s, repeats)):
            t0 = time.perf_counter()
            for _ in range(inner):
                np.copyto(dst[:s], src[:s])
            times.append((time.perf_counter() - t0) / inner)
        out[str(s)] = timing(s, times)
    return out


class TcpSink(threading.Thread):
    """Decode side of the TCP ceiling: 8-byte length header, ``recv_into`` a buffer, 1-byte ack."""

    def __init__(self, host: str, bufsize: int) -> None:
        super().__init__(name="bench-tcp-sink", daemon=True)
        self.sock = socket.create_server((host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.buf = np.ones(bufsize, dtype=np.uint8)
        self.error: str | None = None

    def run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mv = self.buf.data
            size = len(self.buf)
            hdr = bytearray(8)
            try:
                while True:
                    got = 0
                    while got < 8:
                        k = conn.recv_into(memoryview(hdr)[got:])
                        if k == 0:
                            return
                        got += k
                    n = int.from_bytes(hdr, "little")
                    if n == 0:
                        return
                    off = 0
                    while n:
                        k = conn.recv_into(mv[off : off + min(n, size - off)])
                        if k == 0:
                            return
                        n -= k
                        off = (off + k) % size
                    conn.sendall(b"\x01")
            except OSError as exc:
                self.error = repr(exc)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def tcp_ceiling(host: str, port: int, sizes: Sequence[int], repeats: int, rtt_reps: int) -> dict[str, Any]:
    sock = socket.create_connection((host, port), timeout=TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.ones(min(max(sizes), 64 * MIB), dtype=np.uint8)
    mv = payload.data
    ack = bytearray(1)

    def send(n: int) -> float:
        t0 = time.perf_counter()
        sock.sendall(n.to_bytes(8, "little"))
        left = n
        while left:
            k = min(left, len(payload))
            sock.sendall(mv[:k])
            left -= k
        if sock.recv_into(ack) != 1:
            raise RuntimeError("TCP sink closed the connection")
        return time.perf_counter() - t0

    out: dict[str, Any] = {}
    try:
        for s in sorted(sizes):
            send(s)
            out[str(s)] = timing(s, [send(s) for _ in range(rep_count(s, repeats))])
        for _ in range(10):
            send(4096)
        rtt = [send(4096) for _ in range(rtt_reps)]
        sock.sendall((0).to_bytes(8, "little"))
    finally:
        sock.close()
    return {"sizes": out, "rtt_4k": stats_us(rtt)}
