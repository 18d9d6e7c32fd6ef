"""End-to-end checksums when they do not match: a corrupted page, a decode abort that reports a mismatch, a
checksum request whose geometry cannot describe our buffers, and a verification that fails. Each fails the
room on both sides with its reason, at once, and the prefill counts the mismatches reported to it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiotransfer import KVPoll, TransferFailed
from aiotransfer._control.messages import Status, encode
from aiotransfer._integrity import region_crcs
from aiotransfer._kv import decode as decode_module
from tests.remote import RemotePeer
from tests.test_lifecycle import BIG, SEED, local_decode, local_prefill, open_room, pages, ready_sender
from tests.zmqtools import push

CHECKSUM = {"AIOTRANSFER_CHECKSUM": "1", "AIOTRANSFER_STAGING": "never"}


async def _reported(prefill: RemotePeer) -> int:
    return int((await prefill.call("stats"))["stats"].get("checksum_mismatches_reported", 0))


async def test_a_corrupted_page_fails_the_room_and_the_prefill_counts_the_report(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte of the room flips after it landed: the decode's CRC differs, the room fails on both sides, the
    prefill (whose room had already succeeded) counts the report and acknowledges the drain."""
    prefill = await RemotePeer.start(engine, seed=SEED, env=CHECKSUM, **BIG)
    try:
        async with local_decode(engine) as (dec, bufs):
            dst = pages(64, 70)

            def corrupted(*args: Any) -> list[int]:
                bufs[0][dst[0], 0] ^= 0xFF  # one bit pattern flipped in the landed bytes
                return region_crcs(*args)

            monkeypatch.setattr(decode_module, "region_crcs", corrupted)
            rx = await open_room(dec, prefill, 1, dst)
            await prefill.call("send_kv", room=1, pages=pages(64, 71))
            with pytest.raises(TransferFailed, match="checksum mismatch for data from prefill rank 0"):
                await rx.done(timeout=10)
            assert dec.stats()["checksum_mismatches"] == 1
            for _ in range(200):
                if await _reported(prefill):
                    break
                await asyncio.sleep(0.02)
            assert await _reported(prefill) == 1
            await rx.released(timeout=10)  # the prefill's writes had all landed before its Success
            assert rx.release_cause == "drained"
    finally:
        await prefill.close()


async def test_a_mismatch_reported_while_the_room_is_open_on_the_prefill_is_counted() -> None:
    engine = "mooncake_tcp"
    decode = await RemotePeer.start(engine, **BIG)
    try:
        async with local_prefill(engine, "never") as mgr:
            tx = await ready_sender(mgr, decode, 1, pages(16, 72))
            reason = "checksum mismatch for data from prefill rank 0: sent 0x00000001, got 0x00000002"
            await decode.call("abort", room=1, reason=reason)
            with pytest.raises(TransferFailed, match=f"aborted by decode: {reason}"):
                await tx.done(timeout=5)
            assert mgr.stats().get("checksum_mismatches_reported", 0) == 1
    finally:
        await decode.close()


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
