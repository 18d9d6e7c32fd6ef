"""Sending side of tests/test_engine_conformance.py: ``python tests/_conformance_peer.py <scenario> <target>``.

``<target>`` is the JSON hello of a tests/_engine_peer.py process plus its ``pid``. The scenario runs in this
fresh process so that the engine is created with the environment the test chose (the pytest process may
already hold a native engine made with other settings); it stops the target with SIGSTOP itself (and always
resumes it), then prints one line ``RESULT {json}`` (times in seconds from the stop) and waits for a line on
stdin before leaving, so that the engine keeps delivering while the test reads the destination.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiotransfer._config import TransferConfig
from aiotransfer._plan import Blocks
from aiotransfer.engines._base import MemoryRegion, TransferHandle

MiB = 1 << 20
Out = dict[str, Any]
KEEP: list[Any] = []
"""Every sender, alive until the process leaves: the engine may still read a source after its last answer."""


def u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def crc(a: np.ndarray) -> int:
    return zlib.crc32(a.tobytes())


class Sender:
    """An engine adapter with a registered source buffer, writing into the target at the same offsets."""

    def __init__(self, engine: Any, target: dict[str, Any], nbytes: int) -> None:
        self.engine, self.target = engine, target
        self.src = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
        self.base = int(self.src.ctypes.data)
        engine.register([MemoryRegion(self.base, nbytes)])
        engine.connect(target["session_id"], base64.b64decode(target["info"]), target["probe"])
        self.t0 = 0.0
        KEEP.append(self)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def write(self, *entries: tuple[int, int, int]) -> TransferHandle:
        """Post (source offset, destination offset, length) entries."""
        blocks = Blocks(u64(*(self.base + s for s, _, _ in entries)),
                        u64(*(self.target["addr"] + d for _, d, _ in entries)), u64(*(n for _, _, n in entries)))
        handle: TransferHandle = self.engine.submit_write(self.target["session_id"], blocks)
        return handle

    def rewrite(self, off: int, n: int) -> list[int]:
        """Change the source bytes at [off, off + n): [crc before, crc after] (which of them lands tells
        whether the engine read the source after this moment)."""
        before = crc(self.src[off:off + n])
        self.src[off:off + n] ^= 0xFF
        return [before, crc(self.src[off:off + n])]

    @contextmanager
    def stopped(self) -> Iterator[None]:
        os.kill(self.target["pid"], signal.SIGSTOP)
        self.t0 = time.monotonic()
        try:
            yield
        finally:
            os.kill(self.target["pid"], signal.SIGCONT)


def poll(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def mooncake_stop(target: dict[str, Any]) -> Out:
    """One stop of the target for three writes, laid out MiB after MiB from offset 0 on both sides: W2 (a 16 MiB
    entry, more than the socket buffers take, and a 4 KiB one aimed outside the target's memory), W3 (one 1 MiB
    entry: the kernel buffers it whole), W1 (16 entries of 1 MiB, more than the engine's lanes to a peer take
    at once). The source is rewritten 1 s after the engine's first answers, then the stop lasts past
    ``MC_TRANSFER_TIMEOUT``."""
    from aiotransfer.engines._mooncake import MooncakeEngine

    s = Sender(MooncakeEngine(TransferConfig(engine="mooncake_tcp")), target, 33 * MiB)
    out: Out = {"transfer_timeout_s": float(os.environ["MC_TRANSFER_TIMEOUT"]),
                "status_timeout_s": float(os.environ["MC_TCP_STATUS_TIMEOUT_SEC"])}
    with s.stopped():
        handles = {
            "w2": s.write((0, 0, 16 * MiB), (0, target["nbytes"] + MiB, 4096)),
            "w3": s.write((16 * MiB, 16 * MiB, MiB)),
            "w1": s.write(*((o, o, MiB) for o in range(17 * MiB, 33 * MiB, MiB))),
        }
        seen: dict[str, Out] = {name: {} for name in handles}

        def look() -> bool:
            """Check every handle once; True once W3 ended and W1 and W2 are doomed."""
            for name, h in handles.items():
                if not h.consumed and s.engine.check(h).is_terminal:
                    seen[name]["ended_at"] = s.now()
                if h.doomed is not None:
                    seen[name].setdefault("doomed_at", s.now())
            return handles["w3"].consumed and all(handles[n].doomed for n in ("w1", "w2"))

        poll(look, 20.0)
        time.sleep(1.0)  # what the engine had already sent sits in the socket buffers; the rest is queued
        out["rewritten_at"] = s.now()
        out["crcs"] = [s.rewrite(off, MiB) for off in range(0, 33 * MiB, MiB)]
        poll(lambda: s.now() > out["transfer_timeout_s"] + 0.5, 10.0)
        look()
        for name, h in handles.items():
            seen[name]["past_timeout"] = {"at": s.now(), "status": h.status.value, "doomed": h.doomed}
    out["resumed_at"] = s.now()
    poll(lambda: look() and all(h.consumed for h in handles.values()), 30.0)
    for name, h in handles.items():
        out[name] = {**seen[name], "status": h.status.value, "error": h.error}
    return out


def mooncake_batch(target: dict[str, Any]) -> Out:
    """The native multi-entry batch: its -1 and what the engine still reads afterwards."""
    from aiotransfer.engines._mooncake import MooncakeEngine

    s = Sender(MooncakeEngine(TransferConfig(engine="mooncake_tcp")), target, 16 * MiB)
    raw, rc = s.engine.raw(), 0
    with s.stopped():
        bid = raw.batch_transfer_async_write(target["session_id"], [s.base + i * MiB for i in range(16)],
                                             [target["addr"] + i * MiB for i in range(16)], [MiB] * 16)

        def answered() -> bool:
            nonlocal rc
            rc = raw.get_batch_transfer_status([bid])
            return rc != 0

        poll(answered, 20.0)
        out: Out = {"rc": rc, "answered_at": s.now(), "crcs": [s.rewrite(i * MiB, MiB) for i in range(16)]}
        time.sleep(0.5)
    return out


class SilentPeer:
    """A handshake port that answers the adapter's own metadata request with ``{}`` (its first connection),
    then takes the engine's (the next) without answering and closes it after ``hold`` seconds."""

    def __init__(self, hold: float, clock: Callable[[], float]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held = threading.Event()
        self.hold, self.clock, self.closed_at = hold, clock, 0.0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with self.sock:
            conn, _ = self.sock.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(struct.pack("<QB", 3, 1) + b"{}")
            conn, _ = self.sock.accept()
            self.held.set()  # the engine is inside its handshake, under its mutex
            with conn:
                time.sleep(self.hold)
                self.closed_at = self.clock()


def mooncake_handshake(target: dict[str, Any]) -> Out:
    """A handshake that holds the engine's mutex, and what writes to a healthy peer do meanwhile."""
    from aiotransfer.engines._mooncake import MooncakeEngine

    hold = float(os.environ["CONFORMANCE_HOLD_S"])
    s = Sender(MooncakeEngine(TransferConfig(engine="mooncake_tcp", handshake_timeout=2 * hold)), target, MiB)
    raw, peer, blocks = s.engine.raw(), target["session_id"], Blocks(u64(s.base), u64(target["addr"]), u64(4096))
    s.t0 = time.monotonic()
    silent = SilentPeer(hold, s.now)
    out: Out = {"hold_s": hold}

    def handshake() -> None:
        try:
            s.engine.connect(silent.address, b"", 0)
            out["handshake"] = "ok"
        except Exception as exc:
            out["handshake"] = repr(exc)

    shaker = threading.Thread(target=handshake)
    shaker.start()
    silent.held.wait(30.0)
    started = s.now()
    inline = s.engine.try_submit_inline(peer, blocks)
    out["inline"] = {"posted": inline is not None, "started_at": started, "returned_at": s.now()}
    started = s.now()
    bid = raw.transfer_submit_write(peer, s.base, target["addr"], 4096)
    out["submit"] = {"posted": bid != 0, "started_at": started, "returned_at": s.now()}
    shaker.join()
    out["released_at"] = silent.closed_at
    after = s.engine.try_submit_inline(peer, blocks)
    out["inline_after"] = {"posted": after is not None}
    poll(lambda: bool(bid) and raw.transfer_check_status(bid) != 0, 10.0)
    poll(lambda: after is None or s.engine.check(after).is_terminal, 10.0)
    return out


def nixl_stop(target: dict[str, Any]) -> Out:
    """A large write to a stopped target: the peer removed under it, raw and through the adapter."""
    from aiotransfer.engines._nixl import NixlEngine

    nbytes = target["nbytes"]
    s = Sender(NixlEngine(TransferConfig(engine="nixl")), target, nbytes)
    raw, peer, out = s.engine.raw(), target["session_id"], {}
    with s.stopped():
        h = s.write((0, 0, nbytes))
        out["raw_before"] = raw.check_xfer_state(h.token.native)
        s.engine.forget_peer(peer)  # deferred: the write is live
        out["after_forget"] = {"status": s.engine.check(h).value, "doomed": h.doomed}
        raw.remove_remote_agent(peer)  # what forget_peer would have done at once
        try:
            out["raw_after_remove"] = raw.check_xfer_state(h.token.native)
        except Exception as exc:
            out["raw_after_remove"] = f"raised {type(exc).__name__}: {exc}"
        out["after_remove"] = {"status": s.engine.check(h).value, "doomed": h.doomed}
        out["crcs"] = [s.rewrite(nbytes - MiB, MiB)]
        time.sleep(0.5)
    return out


SCENARIOS = {f.__name__.replace("_", "-"): f for f in (mooncake_stop, mooncake_batch, mooncake_handshake, nixl_stop)}


def main() -> None:
    target = json.loads(sys.argv[2])
    out = SCENARIOS[sys.argv[1]](target)
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdin.readline()
    os._exit(0)  # no native teardown at interpreter exit


if __name__ == "__main__":
    main()
