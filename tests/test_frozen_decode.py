"""A decode frozen past the release quarantine, on the real engines, in two processes.

A decode stopped (SIGSTOP) with a prefill's write to it in flight: over Mooncake TCP that write never ends
while the decode is stopped (its body cannot enter the full socket, so no deadline of the engine is armed).
The prefill's room fails (its send gave up), and once the release quarantine has passed the prefill gives the
write up. Its pages then go back to its scheduler, which at once fills them with the next request's bytes.
When the decode runs again, no byte of that next request may reach it: the engine's path to the decode must
be over before the pages are released, or the pages must stay held.

Both sides are real managers (tests/peer.py); the quarantine is short (``QUARANTINE_S``) and the decode is
stopped for twice that. Mooncake over TCP cuts the path (the pages come back while the decode is stopped);
NIXL over UCX's TCP transport holds the pages until the write ends. The last test is the decode's side: a
decode whose own quarantine fell due while it was stopped lets what was sent to it land before it releases.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import pytest

from tests.conftest import nixl_available
from tests.remote import RemoteError, RemotePeer

QUARANTINE_S = 3.0
GIVE_UP_S = 1.0
STOP_S = 2 * QUARANTINE_S
"""The decode stays stopped at least this long: the write gives up after ``GIVE_UP_S`` and the quarantine
ends ``QUARANTINE_S`` later. It stays stopped until the prefill has released the pages, at most ``HOLD_S``."""
HOLD_S = 30.0
OLD, NEXT = 0x11, 0xEE
"""The room's bytes, and the next request's, which the prefill's scheduler writes into the same pages."""
PAGES = [0, 1, 2, 3]
GEOMETRIES = {"4x8MiB": (4, 2 << 20), "16x2MiB": (16, 512 << 10)}
"""Entries (KV buffers) and page bytes: 32 MiB in all, far more than the loopback sockets hold while the
decode is stopped. Four entries run on one connection each; of sixteen, Mooncake runs four at a time and
starts the next ones on new connections after a cooldown of about a second, so they end over several cuts."""
ENV = {"AIOTRANSFER_RELEASE_QUARANTINE_S": str(QUARANTINE_S), "AIOTRANSFER_STAGING": "never"}
NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl not installed")
CASES = [
    pytest.param("mooncake_tcp", "4x8MiB", {}, id="mooncake_tcp-4x8MiB"),
    pytest.param("mooncake_tcp", "16x2MiB", {}, id="mooncake_tcp-16x2MiB"),
    pytest.param("nixl", "4x8MiB", {"UCX_TLS": "tcp"}, id="nixl-ucx_tcp-4x8MiB", marks=NIXL),
]
"""NIXL over UCX's TCP transport: over shared memory (UCX's choice on one host) a stopped decode does not stop
the write, which completes."""
CUTS = {"mooncake_tcp": True, "nixl": False}
"""Whether the adapter cuts the engine's path to the peer (the pages come back while the decode is stopped),
or holds the pages until the engine ends the write (after the decode ran again)."""


@pytest.mark.parametrize(("engine", "geometry", "env"), CASES)
async def test_a_write_abandoned_past_the_quarantine_sends_nothing_of_the_next_request(
        engine: str, geometry: str, env: dict[str, str]) -> None:
    buffers, item_len = GEOMETRIES[geometry]
    shape: dict[str, Any] = {"buffers": buffers, "pages": 8, "item_len": item_len}
    prefill = await RemotePeer.start(engine, env={**ENV, **env}, seed=1, **shape)
    decode = await RemotePeer.start(engine, env={**ENV, **env}, **shape)
    loop = asyncio.get_running_loop()
    try:
        await prefill.call("fill", pages=PAGES, value=OLD)
        await prefill.call("sender", room=1)
        await decode.call("receiver", room=1, peer=prefill.endpoint, pages=PAGES)
        await prefill.call("wait_ready", room=1)
        decode.signal(signal.SIGSTOP)
        stopped = loop.time()
        with pytest.raises(RemoteError):  # the send gives up; the write stays in the engine
            await prefill.call("send_kv", room=1, pages=PAGES, timeout=GIVE_UP_S, call_timeout=60)
        reuse = asyncio.ensure_future(prefill.call("refill_when_released", room=1, pages=PAGES, value=NEXT,
                                                   timeout=120, call_timeout=150))
        await asyncio.sleep(max(0.0, STOP_S - (loop.time() - stopped)))
        if CUTS[engine]:  # a write of many entries ends over several cuts: the decode stays stopped meanwhile
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(reuse), HOLD_S - (loop.time() - stopped))
        released_while_stopped = reuse.done()
        stats = (await prefill.call("stats"))["stats"]
        decode.signal(signal.SIGCONT)

        cause = (await asyncio.wait_for(reuse, 120))["cause"]
        seen = await decode.call("released_counts", room=1, pages=PAGES, timeout=60, after=1.0, call_timeout=90)
        counts = (await decode.call("byte_counts", pages=PAGES))["counts"]
        print(f"{engine} {geometry}: decode pages {counts}; prefill released ({cause}) while the decode was stopped: "
              f"{released_while_stopped}; prefill then: {_engine_stats(stats)}")
        assert str(NEXT) not in counts, (
            f"{counts.get(str(NEXT), 0)} bytes of the next request reached the decode (the prefill released its "
            f"pages ({cause}) {'while the decode was stopped' if released_while_stopped else 'after it ran'}; "
            f"then: {_engine_stats(stats)})")
        assert seen["at_release"] == seen["later"] == counts, seen
        assert stats["engine_expired"] == 1, _engine_stats(stats)
        if CUTS[engine]:  # the path was cut: the pages came back while the decode was still stopped
            assert released_while_stopped and stats["engine_held"] == 0, _engine_stats(stats)
        else:  # held past the quarantine, visibly, until the engine ended the write
            assert not released_while_stopped and stats["engine_held"] == 1, _engine_stats(stats)
    finally:
        decode.signal(signal.SIGCONT)
        await decode.close()
        await prefill.close()


def _engine_stats(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if k.startswith("engine_") or k in ("in_flight", "pinned_bytes")}


async def test_a_decode_frozen_past_its_own_quarantine_releases_its_pages_after_what_was_sent_landed() -> None:
    """The decode aborts a room while the prefill's write into it runs, and stops at once, for twice the
    quarantine; the prefill's send gives up after ``GIVE_UP_S``, and past its quarantine the prefill cuts the
    write's path. The decode's own quarantine is long due when it runs again, and so is the prefill's drain,
    but bytes the prefill's engine had sent before the cut still wait in the decode's kernel: the decode notices
    that it did not run (its timer fires late) and releases the pages only once they have landed. Its pages
    hold the same bytes at the release and a second later. The write (64 MiB) takes far longer than the
    round trips between the prefill's first post and the decode's stop."""
    shape: dict[str, Any] = {"buffers": 4, "pages": 8, "item_len": 2 << 20}
    pages = list(range(8))
    prefill = await RemotePeer.start("mooncake_tcp", env=ENV, seed=1, **shape)
    decode = await RemotePeer.start("mooncake_tcp", env=ENV, **shape)
    try:
        await prefill.call("fill", pages=pages, value=OLD)
        await prefill.call("sender", room=1)
        await decode.call("receiver", room=1, peer=prefill.endpoint, pages=pages)
        await prefill.call("wait_ready", room=1)
        seen = asyncio.ensure_future(decode.call("released_counts", room=1, pages=pages, timeout=60, after=1.0,
                                                 call_timeout=120))
        send = asyncio.ensure_future(prefill.call("send_kv", room=1, pages=pages, timeout=GIVE_UP_S, call_timeout=60))
        while not (await prefill.call("stats"))["stats"]["in_flight"]:
            await asyncio.sleep(0)
        stop = asyncio.ensure_future(decode.call("abort_then_stop", room=1, call_timeout=120))
        await asyncio.sleep(STOP_S)
        sent = _engine_stats((await prefill.call("stats"))["stats"])
        decode.signal(signal.SIGCONT)
        # the write ran into the stop, and was abandoned (its path cut) past the prefill's quarantine
        assert sent["engine_expired"] == 1, f"the write ended before the stop, or still runs: {sent}"
        await asyncio.wait_for(stop, 30)
        with pytest.raises(RemoteError):  # the decode aborted, or the prefill found it silent first
            await asyncio.wait_for(send, 30)
        released = await asyncio.wait_for(seen, 60)
        stats = (await decode.call("stats"))["stats"]
        print(f"decode: {released}; froze {stats['freezes_settled']}x; prefill at the resume: {sent}")
        assert released["at_release"] == released["later"], f"bytes landed after the decode released its pages: {released}"
        assert stats["freezes_settled"] >= 1
    finally:
        decode.signal(signal.SIGCONT)
        await decode.close()
        await prefill.close()
