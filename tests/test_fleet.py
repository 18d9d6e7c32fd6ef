"""A fleet, not a pair: a manager serving many peers keeps its costs flat. A heartbeat pass over many peers never
holds the loop; the control plane's sockets stay inside ZeroMQ's own limit; a send that fails is not swallowed;
evicted sockets deliver what they queued; and the registrations of decodes that left are forgotten."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from aiotransfer._liveness import Liveness


async def test_a_heartbeat_pass_over_many_peers_never_holds_the_loop() -> None:
    """2,000 peers with a room open, each ping costing the CPU of one signed send: the pass is spread over its
    interval in slices, so the loop is held for a slice's pings at a time (about a millisecond; a few slices
    when a busy machine delays the loop), not for the whole pass (100 ms in one go), and every peer is still
    pinged once per interval."""
    peers = [f"tcp://10.0.0.1:{port}" for port in range(20000, 22000)]
    pinged: Counter[str] = Counter()

    async def ping(endpoint: str) -> None:
        spin = time.thread_time()
        while time.thread_time() - spin < 50e-6:
            pass
        pinged[endpoint] += 1

    live = Liveness(interval=0.5, timeout=60.0, active_peers=lambda: peers, ping=ping,
                    on_dead=lambda ep, why: None, on_restart=lambda ep: None)
    loop = asyncio.get_running_loop()
    live.start()
    worst = 0.0
    try:
        end = loop.time() + 1.6
        while loop.time() < end:
            # the loop thread's own CPU while this waits for a millisecond: what other callbacks held it for
            # (a busy machine's preemption does not count)
            cpu = time.thread_time()
            await asyncio.sleep(0.001)
            worst = max(worst, time.thread_time() - cpu)
    finally:
        await live.aclose()
    print(f"longest hold of the loop over three passes of {len(peers)} pings: {worst * 1000:.1f} ms of CPU")
    assert min(pinged[ep] for ep in peers) >= 2, "a pass did not reach every peer within its interval"
    assert worst < 0.04, f"a heartbeat pass held the loop for {worst * 1000:.0f} ms"
