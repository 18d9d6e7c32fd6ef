"""The memory engine (aiotransfer.testing) pinned against the real engines, behaviour by behaviour.

The interleaving and lifecycle tests, and users' own tests, trust the memory engine to answer as Mooncake and
NIXL do; an engine that drifts from them makes those tests prove the wrong thing. So each behaviour the
fabric's docstring lists is shown here twice, with the same assertion function: ``test_X[mooncake]`` (or
``[nixl]``) on the real engine, across OS processes, and ``test_X[memory]`` on the memory engine, both told
by bytes at the destination. Each real scenario would fail against an engine model in which an engine
timeout ends the write, or a FAILED write lands nothing.

The real side runs in a fresh process (tests/_conformance_peer.py) so the engine gets this module's
settings (``MC_TRANSFER_TIMEOUT=5``, ``MC_TCP_STATUS_TIMEOUT_SEC=3``; the pytest process may already hold a
native engine made with others); the destination is tests/_engine_peer.py, stopped with SIGSTOP. Whether the
engine still read a write's source after an answer is told by bytes: the sender rewrites its source after
the answer, and each MiB found at the destination holds the bytes from before (``O``) or after (``N``) the
rewrite, zeros (``Z``: nothing landed) or a mix (``M``).

What the real engines did here (Mooncake 0.3.13 over TCP, NIXL 1.5 over UCX tcp):

* Mooncake, entry by entry (the adapter's way): a peer takes a few entries at a time (one per lane); an
  entry the kernel buffered whole answers -1 once ``MC_TCP_STATUS_TIMEOUT_SEC`` passed after it was sent,
  and its bytes, as sent, land when the peer resumes; an entry larger than the socket buffers, or still
  queued, answers 0 for as long as the peer is stopped, past ``MC_TRANSFER_TIMEOUT``, and is read from the
  source after the others failed. No -2 (timeout) answer was seen.
* Mooncake's batch status (``get_batch_transfer_status``) answers -1 at the same deadline while most of the
  batch is still to be read from the source.
* A handshake holds Mooncake's engine-wide mutex: another thread's submit to a healthy peer waits for it.
* NIXL: a peer removed under a live write makes ``check_xfer_state`` raise NIXL_ERR_NOT_FOUND, and UCX still
  delivers the write, source bytes rewritten after the error included.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from aiotransfer._plan import Blocks
from aiotransfer.engines._base import EngineStatus, MemoryRegion, TransferHandle
from aiotransfer.errors import EngineError
from aiotransfer.testing import MemoryEngine, MemoryFabric, Write
from tests.conftest import nixl_available

HELPER = Path(__file__).with_name("_conformance_peer.py")
TARGET = Path(__file__).with_name("_engine_peer.py")
MiB = 1 << 20
MOONCAKE_ENV = {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "3"}
"""The sender's engine settings (read when its engine starts)."""
HOLD_S = 2.0
"""How long the silent peer holds Mooncake's handshake."""


# -- processes ---------------------------------------------------------------------------------------


class Target:
    """The destination engine and its zeroed buffer in another OS process (tests/_engine_peer.py)."""

    def __init__(self, engine: str, nbytes: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TARGET), engine, str(nbytes)], cwd=HELPER.parent.parent,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
        )
        self.hello: dict[str, Any] = json.loads(self._line("PEER "))
        self.hello["pid"] = self.proc.pid

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # UCX logs to stdout too
            if line.startswith(prefix):
                return line[len(prefix):]
        raise RuntimeError(f"target exited with {self.proc.wait()}")

    def crc(self, off: int, n: int) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"crc {off} {n}\n")
        self.proc.stdin.flush()
        return int(self._line("CRC "))

    def landed(self, crcs: list[list[int]], base: int = 0, timeout: float = 10.0) -> str:
        """What each MiB at ``base + i MiB`` holds (see the module docstring), once nothing more lands (no Z,
        the same twice in a row) or ``timeout`` has passed."""
        zero = zlib.crc32(bytes(MiB))
        deadline, last = time.monotonic() + timeout, ""
        while True:
            found = [self.crc(base + i * MiB, MiB) for i in range(len(crcs))]
            marks = "".join("O" if f == old else "N" if f == new else "Z" if f == zero else "M"
                            for f, (old, new) in zip(found, crcs, strict=True))
            if ("Z" not in marks and marks == last) or time.monotonic() > deadline:
                return marks
            last = marks
            time.sleep(0.05)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.proc.communicate("exit\n", timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def scenario(name: str, engine: str, nbytes: int, env: dict[str, str],
             target_env: dict[str, str] | None = None) -> Iterator[tuple[Target, dict[str, Any]]]:
    """Run ``name`` of tests/_conformance_peer.py against a fresh target; yields (target, its results) while
    the sender still runs (its engine keeps delivering), then ends both processes."""
    target = Target(engine, nbytes, target_env if target_env is not None else env)
    sender = None
    try:
        sender = subprocess.Popen(
            [sys.executable, str(HELPER), name, json.dumps(target.hello)], cwd=HELPER.parent.parent,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
        )
        assert sender.stdout is not None
        for line in sender.stdout:
            if line.startswith("RESULT "):
                break
        else:
            raise RuntimeError(f"{name} sender exited with {sender.wait()}")
        yield target, json.loads(line[len("RESULT "):])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target.proc.pid, signal.SIGCONT)
        if sender is not None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                sender.communicate("\n", timeout=10)
            if sender.poll() is None:
                sender.kill()
                sender.wait()
        target.close()


@pytest.fixture(scope="module")
def mooncake_stop() -> dict[str, Any]:
    """One stop of a Mooncake target for three behaviours (W2, W3, W1 of ``mooncake_stop`` in the helper);
    ``marks`` holds what landed of each MiB written: W2's 16, then W3's, then W1's 16."""
    with scenario("mooncake-stop", "mooncake_tcp", 33 * MiB, MOONCAKE_ENV, target_env={}) as (target, out):
        out["marks"] = target.landed(out["crcs"])
    return out


# -- the memory engine's side ---------------------------------------------------------------------------

PAGE = 4096


@dataclass
class MemoryRig:
    clock: SimpleNamespace
    """The fabric's clock: ``clock.t``."""
    fabric: MemoryFabric
    src: MemoryEngine
    dst: MemoryEngine
    buf: np.ndarray
    """The source's registered memory."""
    into: np.ndarray
    """The destination's registered memory (its KV buffer)."""

    def blocks(self, entries: int = 2) -> Blocks:
        """``entries`` pages from the source buffer into the destination's KV buffer."""
        pages = np.arange(entries, dtype=np.uint64) * PAGE
        return Blocks(int(self.buf.ctypes.data) + pages, int(self.into.ctypes.data) + pages,
                      np.full(entries, PAGE, dtype=np.uint64))

    def write(self, entries: int = 2) -> tuple[TransferHandle, Write]:
        self.buf[:] = ord("O")  # the bytes before the engine's answer
        handle = self.src.submit_write(self.dst.session_id, self.blocks(entries))
        return handle, self.fabric.writes[-1]

    def rewrite(self) -> None:
        """The sender rewrites its source after the engine's answer."""
        self.buf[:] = ord("N")

    def marks(self, entries: int = 2) -> str:
        """What each destination page holds: O, N, Z (nothing landed) or M (a mix), as on the real side."""
        out = ""
        for i in range(entries):
            page = self.into[i * PAGE:(i + 1) * PAGE]
            out += next((m for m, v in (("O", ord("O")), ("N", ord("N")), ("Z", 0)) if (page == v).all()), "M")
        return out


def memory_rig() -> MemoryRig:
    clock = SimpleNamespace(t=0.0)
    fabric = MemoryFabric(auto_complete=False, clock=lambda: float(clock.t), engine_timeout_s=5.0,
                          landing_grace_s=1.0)
    src, dst = MemoryEngine(fabric), MemoryEngine(fabric)
    buf, into = np.zeros(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
    src.register([MemoryRegion(int(buf.ctypes.data), buf.nbytes)])
    dst.register([MemoryRegion(int(into.ctypes.data), into.nbytes)])
    fabric.label(dst.session_id, "decode", [SimpleNamespace(ptr=int(into.ctypes.data), nbytes=into.nbytes,
                                                            item_len=PAGE)])
    fabric.owner = lambda page: "room-1"
    return MemoryRig(clock, fabric, src, dst, buf, into)


def drive(engine: Any, handle: TransferHandle) -> EngineStatus:
    for _ in range(1000):
        if (status := engine.check(handle)).is_terminal:
            return status
    raise AssertionError(f"{handle!r} did not end")


# -- 1. A timeout is not an end; late completion -------------------------------------------------------


@dataclass
class LateCompletion:
    doomed: bool
    """The engine's answer past its own timeout doomed the handle..."""
    terminal: bool
    """...or ended it (the old model)."""
    landed_after: bool
    """Bytes the engine took after that answer reached the destination."""
    ended: EngineStatus
    """What the handle ended with once the peer resumed (the test completed the write)."""


def assert_timeout_is_not_an_end(r: LateCompletion) -> None:
    assert r.doomed and not r.terminal, "an engine timeout ended the handle"
    assert r.landed_after, "nothing the engine took after its timeout landed: the timeout was an end"
    assert r.ended.is_terminal


@pytest.mark.parametrize("engine", ["mooncake", "memory"])
def test_timeout_is_not_an_end(engine: str, request: pytest.FixtureRequest) -> None:
    if engine == "mooncake":
        out = request.getfixturevalue("mooncake_stop")
        w1, marks = out["w1"], out["marks"][17:]
        # doomed by the engine's own deadline, never before it, and still PENDING past MC_TRANSFER_TIMEOUT
        assert w1["doomed_at"] >= out["status_timeout_s"] * 0.9, w1
        assert w1["past_timeout"]["at"] > out["transfer_timeout_s"], w1
        record = LateCompletion(w1["past_timeout"]["doomed"] is not None, w1["past_timeout"]["status"] != "pending",
                                "N" in marks, EngineStatus(w1["status"]))
        assert "Z" not in marks, marks  # every entry, failed or not, landed
    else:
        rig = memory_rig()
        handle, write = rig.write()
        rig.clock.t = rig.fabric.engine_timeout_s + 0.5
        status = rig.src.check(handle)
        rig.rewrite()
        rig.fabric.complete(write)  # the peer resumed
        record = LateCompletion(handle.doomed is not None, status.is_terminal, "N" in rig.marks(),
                                drive(rig.src, handle))
    assert_timeout_is_not_an_end(record)


def test_mooncake_batch_status_is_not_an_end() -> None:
    """Mooncake's batch answer (why the adapter posts entry by entry): -1 at the status deadline, after which
    the engine still reads most of the batch from the source."""
    with scenario("mooncake-batch", "mooncake_tcp", 16 * MiB, MOONCAKE_ENV, target_env={}) as (target, out):
        marks = target.landed(out["crcs"])
    assert out["rc"] == -1 and out["answered_at"] >= float(MOONCAKE_ENV["MC_TCP_STATUS_TIMEOUT_SEC"]) * 0.9, out
    assert "N" in marks and "Z" not in marks, marks


# -- 2. Partial failure ----------------------------------------------------------------------------------


@dataclass
class PartialFailure:
    doomed: bool
    """One entry ended failed: the handle is doomed..."""
    status: EngineStatus
    """...and answers this while another entry still runs..."""
    still_running: bool
    """...which it does (bytes taken after the doom landed)."""
    ended: EngineStatus
    """What the handle ended with once every entry ended."""


def assert_partial_failure(r: PartialFailure) -> None:
    assert r.doomed and r.status is EngineStatus.PENDING, "a failed entry ended a write whose others still ran"
    assert r.still_running
    assert r.ended is EngineStatus.FAILED


@pytest.mark.parametrize("engine", ["mooncake", "memory"])
def test_partial_failure(engine: str, request: pytest.FixtureRequest) -> None:
    if engine == "mooncake":
        # W2: a 4 KiB entry aimed outside the target's memory (on a stopped target the engine fails it at the
        # status deadline; a running one rejects it within a millisecond) and a 16 MiB entry, too large for
        # the socket buffers, so it is still being sent when the small one fails.
        out = request.getfixturevalue("mooncake_stop")
        w2, marks = out["w2"], out["marks"][:16]
        assert w2["doomed_at"] < out["rewritten_at"], w2  # the 16 MiB rewritten after the doom...
        record = PartialFailure(w2["past_timeout"]["doomed"] is not None, EngineStatus(w2["past_timeout"]["status"]),
                                "N" in marks, EngineStatus(w2["status"]))
        assert "Z" not in marks, marks  # ...landed whole, its tail as rewritten (M: rewritten mid-send)
    else:
        rig = memory_rig()
        handle, write = rig.write()
        rig.fabric.fail_entry(write, 0)
        status = rig.src.check(handle)
        rig.rewrite()
        rig.fabric.complete(write)  # entry 1 was still running
        marks = rig.marks()
        record = PartialFailure(handle.doomed is not None, status, marks[1] == "N", drive(rig.src, handle))
        assert marks[0] == "Z", marks  # the failed entry landed nothing
    assert_partial_failure(record)


# -- 3. A failed write's bytes may still land -----------------------------------------------------------


@dataclass
class FailedMayLand:
    status: EngineStatus
    """The engine's answer."""
    landed_after: bool
    """Bytes of the write landed after that answer."""
    read_after: bool
    """The engine read the source after that answer (what landed had been sent before it)."""


def assert_failed_write_may_land(r: FailedMayLand) -> None:
    assert r.status is EngineStatus.FAILED
    assert r.landed_after, "nothing landed after FAILED: the memory engine's landing grace would be unfounded"
    assert not r.read_after, "the engine read the source after FAILED: FAILED would not prove it quiesced"


@pytest.mark.parametrize("engine", ["mooncake", "memory"])
def test_failed_write_may_still_land(engine: str, request: pytest.FixtureRequest) -> None:
    if engine == "mooncake":
        # W3: one 1 MiB entry; the target was stopped from before the post until after the FAILED answer, so
        # whatever is at the destination arrived after that answer.
        out = request.getfixturevalue("mooncake_stop")
        w3, mark = out["w3"], out["marks"][16]
        assert w3["ended_at"] >= out["status_timeout_s"] * 0.9 and w3["ended_at"] < out["rewritten_at"], w3
        record = FailedMayLand(EngineStatus(w3["status"]), mark in "OMN", mark in "MN")
    else:
        rig = memory_rig()
        handle, write = rig.write()
        rig.clock.t = 1.0
        rig.fabric.fail(write)
        status = drive(rig.src, handle)
        rig.rewrite()
        rig.clock.t += rig.fabric.landing_grace_s / 2
        assert rig.marks() == "ZZ"
        rig.fabric.land_late(write)
        marks = rig.marks()
        record = FailedMayLand(status, "O" in marks, "N" in marks or "M" in marks)
        rig.into[:] = 0
        rig.clock.t += rig.fabric.landing_grace_s
        rig.fabric.land_late(write)
        assert write not in rig.fabric.live() and rig.marks() == "ZZ"  # the grace is over
    assert_failed_write_may_land(record)


# -- 4. A submit waits while a handshake holds the engine ------------------------------------------------


@dataclass
class HandshakeHold:
    hold_s: float
    """How long the handshake held the engine after the submits started."""
    submit_waited_s: float
    """How long a submit to a healthy peer, from another thread, took meanwhile."""
    submit_after_release: bool
    """It returned only once the handshake had let the engine go."""
    inline_declined: bool
    """``try_submit_inline`` to that peer returned None (nothing posted)..."""
    inline_waited: bool
    """...after waiting for the handshake."""
    inline_after: bool
    """Once the handshake is over, it posts again."""


def assert_submit_waits_for_handshake(r: HandshakeHold) -> None:
    assert r.submit_after_release and r.submit_waited_s >= 0.5 * r.hold_s, r
    assert r.inline_declined and not r.inline_waited, r
    assert r.inline_after


@pytest.mark.parametrize("engine", ["mooncake", "memory"])
def test_submit_waits_for_handshake(engine: str) -> None:
    if engine == "mooncake":
        # A peer whose handshake port takes the engine's metadata request and never answers (the adapter's
        # own bounded request, made first, got an answer); the connection closes after HOLD_S.
        env = {**MOONCAKE_ENV, "CONFORMANCE_HOLD_S": str(HOLD_S)}
        with scenario("mooncake-handshake", "mooncake_tcp", MiB, env, target_env={}) as (_target, out):
            pass
        assert out["handshake"].startswith("EngineError"), out  # the silent peer failed it, after the hold
        submit, inline, released = out["submit"], out["inline"], out["released_at"]
        record = HandshakeHold(released - submit["started_at"], submit["returned_at"] - submit["started_at"],
                               submit["posted"] and submit["returned_at"] >= released, not inline["posted"],
                               inline["returned_at"] >= released, out["inline_after"]["posted"])
    else:
        rig, hold, times = memory_rig(), 0.3, dict[str, float]()
        rig.fabric.hang_handshakes(True)
        shaker = threading.Thread(target=rig.src.connect, args=(rig.dst.session_id, b"", 0))
        shaker.start()
        while not rig.fabric.mutex.locked():
            time.sleep(0.001)

        def submit() -> None:
            times["started"] = time.monotonic()
            rig.write()
            times["returned"] = time.monotonic()

        submitter = threading.Thread(target=submit)
        submitter.start()
        while "started" not in times:
            time.sleep(0.001)
        t0 = time.monotonic()
        declined = rig.src.try_submit_inline(rig.dst.session_id, rig.blocks()) is None
        inline_at = time.monotonic()
        rig.fabric.loop_thread = threading.get_ident()  # this thread plays the event loop
        with pytest.raises(EngineError, match="event loop"):
            rig.write()
        assert len(rig.fabric.loop_waits) == 1  # the real engine would have blocked the loop
        time.sleep(max(0.0, hold - (time.monotonic() - t0)))
        released = time.monotonic()
        rig.fabric.hang_handshakes(False)
        shaker.join()
        submitter.join()
        after = rig.src.try_submit_inline(rig.dst.session_id, rig.blocks())
        record = HandshakeHold(released - times["started"], times["returned"] - times["started"],
                               times["returned"] >= released, declined, inline_at >= released, after is not None)
    assert_submit_waits_for_handshake(record)


# -- 5. NIXL: an error answer that is not an end ---------------------------------------------------------


@dataclass
class ErrorNotEnd:
    forgotten: EngineStatus
    """``check`` after ``forget_peer`` while the write is live (the removal waits for the write)..."""
    forgotten_doomed: bool
    errored: EngineStatus
    """``check`` after the engine answered the write with an error..."""
    errored_doomed: bool
    landed_after: bool
    """Bytes the engine took after that error landed."""


def assert_error_answer_is_not_an_end(r: ErrorNotEnd) -> None:
    assert r.forgotten is EngineStatus.PENDING and not r.forgotten_doomed, r
    assert r.errored is EngineStatus.PENDING and r.errored_doomed, "an error answer ended a live write"
    assert r.landed_after, "nothing the engine took after its error landed: the error was an end"


@pytest.mark.parametrize(
    "engine", [pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed")),
               "memory"]
)
def test_error_answer_is_not_an_end(engine: str) -> None:
    if engine == "nixl":
        # A 64 MiB write over UCX tcp to a stopped target; the peer is forgotten (the adapter defers it), then
        # removed from the agent under the write, as forget_peer would do at once.
        nbytes, env = 64 * MiB, {"UCX_TLS": "tcp"}
        with scenario("nixl-stop", "nixl", nbytes, env) as (target, out):
            mark = target.landed(out["crcs"], base=nbytes - MiB)
        assert out["raw_before"] == "PROC", out
        assert "NIXL_ERR_NOT_FOUND" in out["raw_after_remove"], out  # check_xfer_state raised
        forgotten, errored = out["after_forget"], out["after_remove"]
        record = ErrorNotEnd(EngineStatus(forgotten["status"]), forgotten["doomed"] is not None,
                             EngineStatus(errored["status"]), errored["doomed"] is not None, mark == "N")
    else:
        rig = memory_rig()
        handle, write = rig.write()
        rig.src.forget_peer(rig.dst.session_id)
        forgotten = rig.src.check(handle)
        forgotten_doomed = handle.doomed is not None
        rig.fabric.fail_entry(write, 0)
        errored = rig.src.check(handle)
        rig.rewrite()
        rig.fabric.complete(write)
        record = ErrorNotEnd(forgotten, forgotten_doomed, errored, handle.doomed is not None, "N" in rig.marks())
        assert drive(rig.src, handle) is EngineStatus.FAILED
    assert_error_answer_is_not_an_end(record)
