"""The page-lifecycle promise against the real Mooncake engine as it really behaves: a write is over only when
the engine says so.

A decode stopped (SIGSTOP: a GC pause, swap, a congested link) for longer than Mooncake's own timeouts: the
prefill's writes into it fail or time out in the engine while they still run, and bytes the engine had sent
are still applied when the decode runs again (docs/engines.md, "What each engine answer means"). The room
fails on both sides, but:

* the prefill releases the room's pages (``tx.released()``) only once the engine ended every entry; a
  scheduler that reuses them at once for its next request (here: fills them with another value) must never
  see that request's bytes land in the decode's pages;
* the decode releases its pages only once nothing more lands in them: their bytes at the release are their
  bytes for good.

Both processes are real (a prefill and a decode, tests/peer.py), with ``MC_TRANSFER_TIMEOUT=5`` and
``MC_TCP_STATUS_TIMEOUT_SEC=3`` in the prefill. Sixteen 1 MiB entries go through the driver thread; four
4 MiB entries are posted from the loop and polled there.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest

from aiotransfer import KVArgs, KVManager, TransferConfig
from tests.peer import make_buffers
from tests.remote import RemoteError, RemotePeer

ENV = {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "3", "AIOTRANSFER_ENGINE_TIMEOUT_S": "5",
       "AIOTRANSFER_STAGING": "never", "AIOTRANSFER_RELEASE_QUARANTINE_S": "120"}
OLD, NEXT = 0x11, 0xEE
"""The room's bytes, and the bytes of the next request the prefill's scheduler puts in the same pages."""
STOP_S = 8.0
"""Longer than the prefill engine's transfer timeout (5 s) and status deadline (3 s)."""
PAGES = [0, 1, 2, 3]


@pytest.mark.parametrize(("buffers", "item_len"), [(16, 256 << 10), (4, 1 << 20)], ids=["driver-16x1MiB", "loop-4x4MiB"])
async def test_a_write_that_outlives_the_engine_timeout_lands_nothing_in_released_pages(buffers: int,
                                                                                        item_len: int) -> None:
    geometry: dict[str, Any] = {"buffers": buffers, "pages": 8, "item_len": item_len}
    prefill = await RemotePeer.start("mooncake_tcp", env=ENV, seed=1, **geometry)
    decode = await RemotePeer.start("mooncake_tcp", env={"AIOTRANSFER_STAGING": "never"}, **geometry)
    try:
        await prefill.call("fill", pages=PAGES, value=OLD)
        await prefill.call("sender", room=1)
        await decode.call("receiver", room=1, peer=prefill.endpoint, pages=PAGES)
        await prefill.call("wait_ready", room=1)
        decode.signal(signal.SIGSTOP)
        stopped = asyncio.get_running_loop().time()

        with pytest.raises(RemoteError) as failed:  # the room fails in the engine's time, not the peer's
            await prefill.call("send_kv", room=1, pages=PAGES, timeout=STOP_S - 2.0, call_timeout=60)
        reuse = asyncio.ensure_future(prefill.call("refill_when_released", room=1, pages=PAGES, value=NEXT,
                                                   call_timeout=120))
        await asyncio.sleep(max(0.0, STOP_S - (asyncio.get_running_loop().time() - stopped)))
        assert not reuse.done(), (
            f"the prefill released the room's pages while its writes still ran in the stopped decode "
            f"(send_kv failed with {failed.value})")
        stats = (await prefill.call("stats"))["stats"]
        assert stats["in_flight"] > 0 and stats["engine_holds_pending"] > 0

        decode.signal(signal.SIGCONT)
        released = asyncio.ensure_future(decode.call("released_counts", room=1, pages=PAGES, timeout=60,
                                                     call_timeout=120))
        assert (await asyncio.wait_for(reuse, 60))["cause"] == "drained"
        seen = await asyncio.wait_for(released, 90)
        later = (await decode.call("byte_counts", pages=PAGES))["counts"]
        assert str(NEXT) not in later, f"the next request's bytes landed in the decode's pages: {later}"
        assert seen["at_release"] == seen["later"] == later, (
            f"bytes landed in the decode's pages after it released them ({seen['cause']}): {seen}")
        assert seen["cause"] in ("drained", "peer-gone"), seen
        stats = (await prefill.call("stats"))["stats"]
        assert (stats["in_flight"], stats["engine_expired"]) == (0, 0)
    finally:
        decode.signal(signal.SIGCONT)
        await decode.close()
        await prefill.close()


# ---------------------------------------------------------------------------------------------------
# A peer whose handshake hangs: the loop never waits on the engine's mutex
# ---------------------------------------------------------------------------------------------------

HOLD = 4.0
"""How long the hostile decode leaves the engine's metadata requests unanswered."""
SMALL: dict[str, Any] = {"buffers": 2, "pages": 64, "item_len": 4096}


async def _one_room(prefill: KVManager, decode: RemotePeer, room: int) -> None:
    tx = prefill.sender(room)
    pages = [4 * (room % 16) + i for i in range(4)]
    await decode.call("receiver", room=room, peer=prefill.endpoint, pages=pages)
    await tx.wait_ready(timeout=30)
    await tx.send_kv(pages, timeout=30)  # two entries: posted from the loop while no handshake runs
    await decode.call("done", room=room)


HOSTILE_ROOM = 1 << 40


@pytest.mark.parametrize("mode", ["once", "silent"])
async def test_a_decode_whose_handshake_hangs_never_stalls_the_prefills_loop(mode: str) -> None:
    """A decode registers and then leaves Mooncake's handshake hanging: ``once``, it answers the bounded first
    contact and then holds the engine's own identical request (the engine's mutex with it) for ``HOLD``
    seconds; ``silent``, it answers nothing. Meanwhile the prefill keeps serving a healthy decode with small
    rooms, whose writes the loop posts itself when it can. The loop never waits for the handshake (its
    longest stall stays far below the hold), and every healthy room completes."""
    bufs = make_buffers(SMALL["buffers"], SMALL["pages"], SMALL["item_len"], seed=5)
    cfg = TransferConfig(engine="mooncake_tcp", handshake_timeout=3.0, staging="never")
    healthy = await RemotePeer.start("mooncake_tcp", **SMALL)
    hostile = await RemotePeer.start("mooncake_tcp", hostile_handshake=HOLD, hostile_mode=mode, **SMALL)
    try:
        async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), cfg) as prefill:
            await _one_room(prefill, healthy, 1)
            loop = asyncio.get_running_loop()
            lags: list[float] = []
            watching = True

            async def monitor() -> None:
                while watching:
                    t = loop.time()
                    await asyncio.sleep(0.001)
                    lags.append(loop.time() - t - 0.001)

            watch = asyncio.ensure_future(monitor())
            # the hostile decode's room is far above the healthy rooms' numbers, which a fast machine takes
            # into the hundreds during the hold
            registering = asyncio.ensure_future(hostile.call("receiver", room=HOSTILE_ROOM, peer=prefill.endpoint,
                                                             pages=[0, 1], timeout=HOLD + 10, call_timeout=60))
            started, room = loop.time(), 2
            while loop.time() - started < HOLD + 1.0:
                await _one_room(prefill, healthy, room)
                room += 1
            with pytest.raises(RemoteError, match="cannot reach"):  # refused: its engine never answered ours
                await asyncio.wait_for(registering, 60)
            watching = False
            await watch
            assert max(lags) < HOLD / 2, f"the prefill's loop stalled {max(lags):.3f}s behind the handshake"
            stats = prefill.stats()
            assert stats["peers_refused"] >= 1 and room > 3
    finally:
        await hostile.close()
        await healthy.close()
