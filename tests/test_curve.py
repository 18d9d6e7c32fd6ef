"""``control_curve``: control connections authenticated with CurveZMQ keys derived from the shared secret.

A signature is checked only once ZeroMQ has handed over a whole message, and ZeroMQ assembles a multipart
message (any number of frames, each under the per-frame limit) before that: a host without the key can
make a manager's ZeroMQ hold one such message per connection. With ``control_curve`` such a host cannot
complete the handshake, so none of its frames is buffered. The flood comes from another process, and the
manager's peak resident memory is read from the kernel (ZeroMQ's buffers are outside Python's allocator).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import ConfigError, KVArgs, KVManager, TransferConfig
from tests.peer import make_buffers

KEY = b"a secret every manager of the deployment holds"
FLOOD_FRAMES, FRAME = 96, 1 << 20
"""One multipart message of 96 MiB, every frame under the 2 MiB per-frame limit."""

FLOOD = """
import sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.connect(sys.argv[1])
frame = b"x" * int(sys.argv[3])
sock.send_multipart([frame] * int(sys.argv[2]))
print("sent", flush=True)
time.sleep(float(sys.argv[4]))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for peak memory")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


@contextlib.asynccontextmanager
async def _manager(seed: int | None = 1, **cfg: Any) -> AsyncIterator[tuple[KVManager, list[np.ndarray]]]:
    bufs = make_buffers(2, 64, 1024, seed=seed)
    config = TransferConfig(engine="mooncake_tcp", hmac_key=KEY, max_message_bytes=2 << 20, **cfg)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), config) as mgr:
        yield mgr, bufs


async def _flood_peak(mgr: KVManager, settle: float) -> float:
    """Growth of this process's peak resident memory (MiB) while a host without the key floods ``mgr``."""
    _reset_peak()
    base = _peak_mib()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOOD, mgr.endpoint, str(FLOOD_FRAMES), str(FRAME), str(settle + 5),
        stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"sent"
        loop = asyncio.get_running_loop()
        end = loop.time() + settle
        while loop.time() < end and not mgr.stats()["control_dropped"].get("message too large"):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        return _peak_mib() - base
    finally:
        proc.kill()
        await proc.wait()


async def test_curve_managers_move_kv_and_a_host_without_the_key_gets_no_frame_buffered() -> None:
    async with _manager(control_curve=True) as (pre, src), _manager(None, control_curve=True) as (dec, dst):
        tx = pre.sender(1)
        rx = dec.receiver(1, pre.endpoint)
        await rx.send_metadata([3, 4], timeout=10)
        await tx.wait_ready(timeout=10)
        await tx.send_kv([5, 6], timeout=10)
        await rx.done(timeout=10)
        for s, d in zip(src, dst, strict=True):
            np.testing.assert_array_equal(d[[3, 4]], s[[5, 6]])
        grown = await _flood_peak(pre, settle=2.0)
        assert grown < FLOOD_FRAMES / 3, f"peak memory grew {grown:.0f} MiB under a flood from a host without the key"
        assert pre.stats()["control_dropped"].get("message too large", 0) == 0  # nothing of it arrived


async def test_without_curve_the_same_flood_is_buffered_whole_before_it_is_refused() -> None:
    """The negative control: signatures alone let ZeroMQ assemble the flood (then it is refused)."""
    async with _manager() as (pre, _):
        grown = await _flood_peak(pre, settle=20.0)
        assert pre.stats()["control_dropped"].get("message too large", 0) == 1
        assert grown > FLOOD_FRAMES / 2, f"peak memory grew only {grown:.0f} MiB"


def test_curve_needs_the_shared_secret() -> None:
    with pytest.raises(ConfigError, match="hmac_key"):
        TransferConfig(engine="mooncake_tcp", control_curve=True)
