"""Testing a scheduler without a transfer engine: ``engine="memory"`` from :mod:`aiotransfer.testing`.

A prefill and a decode manager run in this one process on the in-memory engine: a room moves and the test
checks the decode's pages byte for byte; the fabric fails the next write and the test checks that both
sides report the failure; in manual mode, the test decides when a write lands. Run it as a script, or collect it with pytest (each test runs its own event
loop, so no pytest plugin is needed)::

    python examples/test_with_memory_engine.py
    pytest examples/test_with_memory_engine.py
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

import numpy as np

from aiotransfer import KVArgs, KVManager, TransferConfig, TransferFailed
from aiotransfer.testing import MemoryFabric

BUFFERS, PAGES, PAGE_BYTES = 2, 16, 256  # K and V of one layer, 16 pages of 256 bytes each
CONFIG = TransferConfig(engine="memory", transfer_timeout=5.0, done_timeout=5.0)


def kv_cache(fill: int | None = None) -> list[np.ndarray]:
    """One (pages, page_bytes) buffer per K/V; page p of buffer b holds ``b * 64 + p`` (or ``fill``)."""
    if fill is not None:
        return [np.full((PAGES, PAGE_BYTES), fill, dtype=np.uint8) for _ in range(BUFFERS)]
    return [np.repeat(np.arange(PAGES, dtype=np.uint8)[:, None] + b * 64, PAGE_BYTES, axis=1) for b in range(BUFFERS)]


@contextlib.asynccontextmanager
async def prefill_and_decode(fabric: MemoryFabric) -> AsyncIterator[tuple[KVManager, KVManager, list[np.ndarray]]]:
    """Both managers in this process, on ``fabric``; yields them and the decode's KV buffers."""
    decode_kv = kv_cache(fill=0)
    with fabric:  # engines created inside join this fabric
        async with (KVManager(KVArgs(kv_cache(), page_size=16, dtype="uint8"), CONFIG) as prefill,
                    KVManager(KVArgs(decode_kv, page_size=16, dtype="uint8"), CONFIG) as decode):
            yield prefill, decode, decode_kv


async def move_room(prefill: KVManager, decode: KVManager, room: int, src: list[int], dst: list[int]) -> None:
    """What a scheduler does for one request: decode asks for pages, prefill sends them, both wait."""
    rx = decode.receiver(room, peer=prefill.endpoint)
    tx = prefill.sender(room)
    await rx.send_metadata(dst)
    await tx.wait_ready()
    await tx.send_kv(src)
    await tx.done()
    await rx.done()


async def failure_of(call: Awaitable[None]) -> TransferFailed:
    try:
        await call
    except TransferFailed as exc:
        return exc
    raise AssertionError("the call should have raised TransferFailed")


async def a_room_moves() -> None:
    async with prefill_and_decode(MemoryFabric()) as (prefill, decode, decode_kv):
        await move_room(prefill, decode, room=1, src=[3, 4, 5], dst=[10, 0, 7])
    expected = kv_cache()
    for b in range(BUFFERS):
        assert np.array_equal(decode_kv[b][[10, 0, 7]], expected[b][[3, 4, 5]])
        assert not decode_kv[b][[1, 2]].any()  # pages nobody asked for stay untouched


async def an_injected_failure_fails_the_room() -> None:
    fabric = MemoryFabric()
    async with prefill_and_decode(fabric) as (prefill, decode, decode_kv):
        rx, tx = decode.receiver(2, peer=prefill.endpoint), prefill.sender(2)
        await rx.send_metadata([1])
        await tx.wait_ready()
        fabric.fail_next(reason="link down")  # the next write ends FAILED and lands nothing
        for side in (tx.send_kv([1]), rx.done()):  # both sides learn why
            assert "link down" in (await failure_of(side)).reason
        assert [w.outcome for w in fabric.writes] == ["failed"]
        assert not any(buf.any() for buf in decode_kv)  # nothing landed
        await move_room(prefill, decode, room=3, src=[2], dst=[2])  # the next room is not affected
        assert decode_kv[0][2, 0] == 2


async def a_room_waits_for_its_write() -> None:
    fabric = MemoryFabric(auto_complete=False)  # manual mode: each write waits for the test
    async with prefill_and_decode(fabric) as (prefill, decode, decode_kv):
        moving = asyncio.ensure_future(move_room(prefill, decode, room=4, src=[5], dst=[6]))
        (write,) = await fabric.wait_for_writes(1)
        await asyncio.sleep(0.05)
        assert not moving.done() and not decode_kv[0][6].any()  # posted, not landed: the room waits
        fabric.complete(write)  # the bytes land now
        await asyncio.wait_for(moving, 5)
        assert decode_kv[0][6, 0] == 5


def test_a_room_moves() -> None:
    asyncio.run(a_room_moves())


def test_an_injected_failure_fails_the_room() -> None:
    asyncio.run(an_injected_failure_fails_the_room())


def test_a_room_waits_for_its_write() -> None:
    asyncio.run(a_room_waits_for_its_write())


if __name__ == "__main__":
    test_a_room_moves()
    print("a room moved: the decode's pages hold the prefill's bytes")
    test_an_injected_failure_fails_the_room()
    print("an injected failure failed the room on both sides")
    test_a_room_waits_for_its_write()
    print("in manual mode, a room waited for the test to complete its write")
