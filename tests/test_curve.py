"""``control_curve``: control connections authenticated with CurveZMQ keys derived from the shared secret,
on by default whenever there is one.

A signature is checked only once ZeroMQ has handed over a whole message, and ZeroMQ assembles a multipart
message (any number of frames, each under the per-frame limit) before that: a host without the key can
make a manager's ZeroMQ hold one such message per connection, for as long as it keeps the connection open
if it never sends the last frame. With ``control_curve`` such a host cannot complete the handshake, so none
of its frames is buffered. The floods come from another process, and the manager's peak resident memory is
read from the kernel (ZeroMQ's buffers are outside Python's allocator).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import ConfigError, KVArgs, KVManager, PeerError, TransferConfig, TransferTimeout
from aiotransfer._control.endpoint import ControlPlane, signed_frames
from aiotransfer._control.messages import Ping, encode
from tests.peer import make_buffers
from tests.zmqtools import peak_rss_mib, push, reset_peak_rss, wait_until

KEY = b"a secret every manager of the deployment holds"
FLOOD_FRAMES, FRAME = 96, 1 << 20
"""One multipart message of 96 MiB, every frame under the 2 MiB per-frame limit."""

FLOOD = """
import sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.setsockopt(zmq.SNDTIMEO, 2000)
sock.connect(sys.argv[1])
frame = b"x" * int(sys.argv[3])
try:
    sock.send_multipart([frame] * int(sys.argv[2]))
except zmq.Again:
    pass
print("sent", flush=True)
time.sleep(float(sys.argv[4]))
"""
"""A PUSH socket whose handshake fails has no peer to queue for once libzmq dropped the connection: the send
then waits for one, so it is bounded (what it could not queue never reaches the manager anyway)."""

RAW_FLOOD = """
import socket, struct, sys, time
host, port = sys.argv[1][len("tcp://"):].rsplit(":", 1)
greeting = b"\\xff" + bytes(8) + b"\\x7f\\x03\\x00" + b"NULL".ljust(20, b"\\x00") + bytes(32)
ready = b"\\x05READY\\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
frame = b"x" * int(sys.argv[3])
sock = socket.create_connection((host, int(port)))
try:
    sock.sendall(greeting)
    sock.recv(64)
    sock.sendall(bytes((4, len(ready))) + ready)
    for _ in range(int(sys.argv[2])):
        sock.sendall(b"\\x03" + struct.pack(">Q", len(frame)) + frame)
except OSError:
    pass
print("sent", flush=True)
time.sleep(float(sys.argv[4]))
"""
"""ZMTP 3.0 spoken over a plain TCP socket, as any host can: the NULL-mechanism greeting, READY, then frames
that all say more follows. libzmq itself never sends an unfinished message; a host that speaks the protocol
can keep one open as long as it holds the connection."""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for peak memory")


@contextlib.asynccontextmanager
async def _manager(seed: int | None = 1, **cfg: Any) -> AsyncIterator[tuple[KVManager, list[np.ndarray]]]:
    bufs = make_buffers(2, 64, 1024, seed=seed)
    config = TransferConfig(engine="mooncake_tcp", hmac_key=KEY, max_message_bytes=2 << 20, **cfg)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), config) as mgr:
        yield mgr, bufs


async def _flood_peak(mgr: KVManager, settle: float, script: str = FLOOD) -> float:
    """Growth of this process's peak resident memory (MiB) while a host without the key floods ``mgr``."""
    reset_peak_rss()
    base = peak_rss_mib()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, mgr.endpoint, str(FLOOD_FRAMES), str(FRAME), str(settle + 5),
        stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"sent"
        loop = asyncio.get_running_loop()
        end = loop.time() + settle
        while loop.time() < end and not mgr.stats()["control_dropped"].get("message too large"):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        return peak_rss_mib() - base
    finally:
        proc.kill()
        await proc.wait()


async def _move_kv(pre: KVManager, src: list[np.ndarray], dec: KVManager, dst: list[np.ndarray], room: int) -> None:
    tx = pre.sender(room)
    rx = dec.receiver(room, pre.endpoint)
    await rx.send_metadata([3, 4], timeout=10)
    await tx.wait_ready(timeout=10)
    await tx.send_kv([5, 6], timeout=10)
    await rx.done(timeout=10)
    for s, d in zip(src, dst, strict=True):
        np.testing.assert_array_equal(d[[3, 4]], s[[5, 6]])


@pytest.mark.parametrize("curve", [None, True], ids=["default", "explicit"])
async def test_curve_managers_move_kv_and_a_host_without_the_key_gets_no_frame_buffered(curve: bool | None) -> None:
    """With a key, curve is on unless turned off: a flood of one whole message, and one that never ends, from a
    host without the key leave the manager's memory alone, and nothing of them reaches it."""
    async with _manager(control_curve=curve) as (pre, src), _manager(None, control_curve=curve) as (dec, dst):
        assert pre._ctx.control._curve is not None
        await _move_kv(pre, src, dec, dst, 1)
        for script in (FLOOD, RAW_FLOOD):
            grown = await _flood_peak(pre, settle=2.0, script=script)
            assert grown < FLOOD_FRAMES / 3, f"peak memory grew {grown:.0f} MiB under a flood from a host without the key"
        assert not pre.stats()["control_dropped"]  # nothing of either arrived


async def test_without_curve_the_same_floods_are_buffered_whole() -> None:
    """The negative control: with curve turned off, signatures alone let ZeroMQ assemble the whole message (then
    it is refused), and hold the one that never ends for as long as its connection stays open (never seen)."""
    async with _manager(control_curve=False) as (pre, _):
        grown = await _flood_peak(pre, settle=20.0)
        assert pre.stats()["control_dropped"].get("message too large", 0) == 1
        assert grown > FLOOD_FRAMES / 2, f"peak memory grew only {grown:.0f} MiB"
        grown = await _flood_peak(pre, settle=3.0, script=RAW_FLOOD)
        assert grown > FLOOD_FRAMES / 2, f"peak memory grew only {grown:.0f} MiB"
        assert pre.stats()["control_dropped"] == {"message too large": 1}


async def test_with_a_key_an_unauthenticated_push_gets_nothing_through_unless_curve_is_off() -> None:
    """A plain PUSH socket, without curve keys: an unsigned message and one signed with the key both stay out
    by default (no handshake); with curve turned off both arrive and are judged by their signatures."""
    for curve, seen in ((None, {}), (False, {"unauthenticated message": 1, "sender mismatch": 1})):
        async with _manager(control_curve=curve) as (mgr, _):
            ping = Ping(endpoint="tcp://127.0.0.1:9", nonce=1)
            await push(mgr.endpoint, [encode(ping)])
            await push(mgr.endpoint, signed_frames(KEY, encode(ping), sender="tcp://127.0.0.1:8",
                                                   destination=mgr.endpoint, counter=time.time_ns(), sent=time.time()))
            if seen:
                await wait_until(lambda m=mgr: sum(m.stats()["control_dropped"].values()) == 2)  # type: ignore[misc]
            else:
                await asyncio.sleep(0.5)
            assert mgr.stats()["control_dropped"] == seen and mgr.stats()["control_received"] == 0


async def test_curve_turned_off_on_both_sides_still_moves_kv() -> None:
    async with _manager(control_curve=False) as (pre, src), _manager(None, control_curve=False) as (dec, dst):
        assert pre._ctx.control._curve is None
        await _move_kv(pre, src, dec, dst, 1)


async def test_a_manager_without_curve_cannot_register_with_one_that_has_it() -> None:
    """What an upgrade meets: a peer of an earlier version (signing without curve) and a new one with the same
    key and the default cannot talk until curve is turned off on the new side."""
    async with _manager() as (pre, _), _manager(None, control_curve=False, handshake_timeout=1.0) as (dec, _):
        rx = dec.receiver(1, pre.endpoint)
        # the registration is refused, or (on a loaded host, when the bound runs out first) the query that
        # precedes it is never taken by the peer: either way they cannot talk
        with pytest.raises((PeerError, TransferTimeout), match=r"registration|not accepted"):
            await rx.send_metadata([3], timeout=2)


def test_curve_needs_the_shared_secret() -> None:
    with pytest.raises(ConfigError, match="hmac_key"):
        TransferConfig(engine="mooncake_tcp", control_curve=True)
    assert TransferConfig().control_curve is None and TransferConfig(hmac_key=KEY).control_curve is None
    assert TransferConfig.from_env({"AIOTRANSFER_CONTROL_CURVE": "0"}, hmac_key=KEY).control_curve is False


@pytest.mark.parametrize(("key", "curve", "on"), [(KEY, None, True), (KEY, True, True), (KEY, False, False),
                                                  (None, None, False), (None, False, False)])
def test_curve_is_on_with_a_key_unless_turned_off(key: bytes | None, curve: bool | None, on: bool) -> None:
    plane = ControlPlane("127.0.0.1", 0, lambda _: None, max_sockets=4, max_message_bytes=1024, hmac_key=key,
                         curve=curve)
    assert (plane._curve is not None) is on
