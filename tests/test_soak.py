"""Soak: thousands of requests with random failures injected; nothing lost, stuck or leaked."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections import Counter

import numpy as np

from aiotransfer import InvalidArgument, KVArgs, KVManager, KVPoll, TransferConfig, TransferFailed
from tests.conftest import GEOMETRY, expected_digest
from tests.peer import make_buffers
from tests.remote import RemoteError, RemotePeer

ROOMS = int(os.environ.get("AIOTRANSFER_SOAK_ROOMS", "5000"))
CONCURRENCY = 32
PAGES = GEOMETRY["pages"]


async def test_soak_random_faults(engine: str) -> None:
    threads_before = threading.active_count()
    bufs = make_buffers(GEOMETRY["buffers"], PAGES, GEOMETRY["item_len"], seed=11)
    cfg = TransferConfig(engine=engine, max_sockets=8)
    decode = await RemotePeer.start(engine, **GEOMETRY)
    outcomes: Counter[str] = Counter()
    verified = 0
    try:
        async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), cfg) as mgr:
            rng = random.Random(1234)
            lanes = asyncio.Semaphore(CONCURRENCY)
            # each lane owns a disjoint slice of decode pages, so concurrent rooms never overlap
            free_slices = list(range(CONCURRENCY))
            width = PAGES // CONCURRENCY

            async def one(room: int, fault: str, n: int) -> None:
                nonlocal verified
                async with lanes:
                    lane = free_slices.pop()
                    try:
                        dst = list(range(lane * width, lane * width + n))
                        src = [int(x) for x in np.random.default_rng(room).permutation(PAGES)[:n]]
                        tx = mgr.sender(room)
                        await decode.call("receiver", room=room, peer=mgr.endpoint, pages=dst)
                        await tx.wait_ready(timeout=10)
                        if fault == "decode-abort":
                            await decode.call("abort", room=room, reason="soak abort")
                            try:
                                await tx.done(timeout=5)
                            except TransferFailed as exc:
                                assert "soak abort" in exc.reason
                        elif fault == "prefill-abort":
                            await tx.abort("soak prefill abort")
                            try:
                                await decode.call("done", room=room, timeout=5)
                            except RemoteError as exc:
                                assert "soak prefill abort" in exc.reason
                        elif fault == "decode-timeout":
                            try:
                                await decode.call("done", room=room, timeout=0.001)
                            except RemoteError as exc:
                                assert exc.error == "TransferTimeout"
                            try:
                                await tx.done(timeout=5)
                            except TransferFailed as exc:
                                assert "decode gave up" in exc.reason
                        else:
                            if fault == "bad-input":
                                try:
                                    await tx.send_kv(src[:-1])
                                except InvalidArgument:
                                    pass
                            if fault == "chunked" and n > 1:
                                await tx.send_kv(src[: n // 2], last=False)
                                await tx.send_kv(src[n // 2 :])
                            else:
                                await tx.send_kv(src)
                            await decode.call("done", room=room)
                            if room % 97 == 0:
                                got = (await decode.call("digest", pages=dst))["digest"]
                                assert got == expected_digest(bufs, src)
                                verified += 1
                        assert tx.poll().is_terminal
                        status = (await decode.call("poll", room=room))["status"]
                        assert status in ("Success", "Failed")
                        assert (status == "Success") == (tx.poll() is KVPoll.Success), (room, fault, status, tx.poll())
                        outcomes[f"{fault}:{status}"] += 1
                    finally:
                        free_slices.append(lane)

            faults = ["ok"] * 70 + ["decode-abort"] * 8 + ["prefill-abort"] * 7 + ["bad-input"] * 5 + [
                "decode-timeout"] * 5 + ["chunked"] * 5
            plan = [(room, rng.choice(faults), rng.randint(1, width)) for room in range(ROOMS)]
            results = await asyncio.gather(*(one(*p) for p in plan), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, errors[:3]
            assert sum(outcomes.values()) == ROOMS
            stats = mgr.stats()
            assert stats["senders_active"] == 0
            assert stats["pending_requests"] == 0
            assert stats["in_flight"] == 0 and stats["pinned_bytes"] == 0
            assert stats["open_sockets"] <= cfg.max_sockets + 1
            dstats = (await decode.call("stats"))["stats"]
            assert dstats["receivers_active"] == 0
            assert dstats["in_flight"] == 0
        print(f"soak: {ROOMS} rooms, lost 0, outcomes {dict(outcomes)}, verified {verified}")
    finally:
        await decode.close()
    for _ in range(100):
        if threading.active_count() <= threads_before:
            break
        await asyncio.sleep(0.05)
    assert threading.active_count() <= threads_before, threading.enumerate()
