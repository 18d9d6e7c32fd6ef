"""End-to-end checksums that cannot be verified: a checksum request whose geometry cannot describe our
buffers, and a verification that fails. Each fails the room on both sides with its reason, at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiotransfer import KVPoll, TransferFailed
from aiotransfer._kv import decode as decode_module
from aiotransfer.control.messages import Status, encode
from tests.remote import RemotePeer
from tests.test_lifecycle import BIG, SEED, local_decode, open_room, pages
from tests.zmqtools import push

CHECKSUM = {"AIOTRANSFER_CHECKSUM": "1", "AIOTRANSFER_STAGING": "never"}


BAD_GEOMETRY = {
    # rows, heads, start, count, head_bytes, decode buffer: each describes 4096-byte units, one field negative
    "rows": (-1, 1, 0, 1, -4096, 0),
    "heads": (-1, -1, 0, -1, 4096, 0),
    "start": (1, 1, -1, 1, 4096, 0),
    "count": (1, 1, 1, -1, 4096, 0),
    "head_bytes": (1, -1, 0, -2, -4096, 0),
    "buffer": (1, 1, 0, 1, 4096, -1),
}


async def test_a_checksum_with_negative_geometry_fails_the_room_at_once() -> None:
    """A Success whose checksum slices hold a negative field (a peer no real prefill would be) fails the room
    on both sides with the reason, instead of leaving it open until ``done_timeout``."""
    engine = "mooncake_tcp"
    prefill = await RemotePeer.start(engine, seed=SEED, **BIG)
    try:
        async with local_decode(engine) as (dec, _):
            for room, (field, geometry) in enumerate(BAD_GEOMETRY.items(), start=1):
                rx = await open_room(dec, prefill, room, pages(4, room))
                slices = [*geometry, 1, 1, 0, 1, 4096, 1]  # and a valid second buffer
                msg = Status(room=room, status=int(KVPoll.Success), rank=0, endpoint=prefill.endpoint, checksum=0,
                             slices=slices)
                await push(dec.endpoint, [encode(msg)])
                with pytest.raises(TransferFailed, match="checksum geometry does not match our buffers"):
                    await rx.done(timeout=3)
                for _ in range(200):  # the prefill hears the decode's abort
                    got = await prefill.call("reason", room=room)
                    if got["status"] == "Failed":
                        break
                    await asyncio.sleep(0.01)
                assert got["reason"] == rx.failure_reason, (field, got)
            assert dec.stats()["checksum_mismatches"] == len(BAD_GEOMETRY)
    finally:
        await prefill.close()


async def test_a_verification_that_raises_fails_the_room_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = "mooncake_tcp"

    def broken(*args: Any) -> list[int]:
        raise RuntimeError("checksum reader broke")

    monkeypatch.setattr(decode_module, "region_crcs", broken)
    prefill = await RemotePeer.start(engine, seed=SEED, env=CHECKSUM, **BIG)
    try:
        async with local_decode(engine) as (dec, _):
            rx = await open_room(dec, prefill, 1, pages(16, 73))
            await prefill.call("send_kv", room=1, pages=pages(16, 74))
            with pytest.raises(TransferFailed, match=r"checksum could not be verified: RuntimeError\('checksum "
                                                     r"reader broke'\)"):
                await rx.done(timeout=5)
            await rx.released(timeout=10)
    finally:
        await prefill.close()
