"""Small helpers for control-plane tests: a raw PUSH to a manager, a bounded wait, this process's peak RSS."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

import zmq
import zmq.asyncio


async def push(endpoint: str, frames: list[bytes]) -> None:
    """Send one multipart message to ``endpoint`` from a throwaway socket (as any peer could)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    await sock.send_multipart(frames)
    sock.close()
    ctx.term()


async def wait_until(pred: Callable[[], object], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


def reset_peak_rss() -> None:
    """Set this process's peak resident memory (``VmHWM``) to its resident size now. Memory freed earlier in
    the process (another test's) stays resident in the allocator's heap, where new allocations could reuse
    it without growing the peak: it is given back to the system first, so that a growth measured from here
    shows what was allocated."""
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (``VmHWM``), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")
