"""Soak of the page lifecycle: thousands of rooms from two prefills through one decode page pool, with
aborts, timeouts and a stopped prefill injected. Every page goes back to the pool the moment its room's
``released()`` resolves, and is handed to the next room at once (last freed, first reused). A late write of
a failed room lands in pages another room owns by then: the final check of every page against the last
room that succeeded with it catches it (the negative control in the docstring of ``_free_at``)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from typing import Any

import pytest

from aiotransfer import AiotransferError, KVArgs, KVManager, TransferConfig
from tests.peer import make_buffers
from tests.remote import RemoteError, RemotePeer

ROOMS = 2000
CONCURRENCY = 16
GEOM: dict[str, Any] = {"buffers": 2, "pages": 1024, "item_len": 65536}
SEEDS = (17, 18)
BIG_ROOM = 600
"""Pages of the room in flight when one prefill is stopped."""


async def _free_at(rx: object, hung: list[int]) -> bool:
    """Wait until the room's pages may be reused. (Returning True at once here instead is the negative
    control: the final page check then finds pages holding a stopped prefill's late writes.)"""
    try:
        await rx.released(timeout=40)  # type: ignore[attr-defined]
    except AiotransferError:
        hung.append(1)
        return False  # never proven safe: the pages stay out of the pool
    return True


@pytest.mark.slow
async def test_two_thousand_rooms_with_faults_reuse_pages_only_when_released() -> None:
    engine = "mooncake_tcp"
    prefills = [await RemotePeer.start(engine, seed=s, **GEOM) for s in SEEDS]
    srcs = [make_buffers(GEOM["buffers"], GEOM["pages"], GEOM["item_len"], seed=s) for s in SEEDS]
    dst_bufs = make_buffers(GEOM["buffers"], GEOM["pages"], GEOM["item_len"], None)
    rng = random.Random(5)
    free = list(range(GEOM["pages"]))
    rng.shuffle(free)
    owner: dict[int, tuple[int, int]] = {}
    """page -> (prefill, source page) of the last room that succeeded with it"""
    outcomes: Counter[str] = Counter()
    hung: list[int] = []
    stop_failed, reuse_window = asyncio.Event(), asyncio.Event()
    kept: list[int] = []
    cfg = TransferConfig(engine=engine, release_quarantine_s=30.0)
    t0 = time.monotonic()
    try:
        async with KVManager(KVArgs(dst_bufs, page_size=16, dtype="uint8"), cfg) as dec:

            async def take(n: int) -> list[int]:
                while len(free) < n:
                    await asyncio.sleep(0.001)
                taken = [free.pop() for _ in range(n)]
                for d in taken:
                    owner.pop(d, None)  # undefined until the new room succeeds
                return taken

            async def give_back(rx: object, dst: list[int]) -> None:
                if await _free_at(rx, hung):
                    free.extend(dst)  # back at once, for the next room

            async def room(r: int, p: int, n: int, stop: bool = False, keep: bool = False) -> None:
                prefill = prefills[p]
                dst = await take(n)
                src = rng.sample(range(GEOM["pages"]), n)
                fault = -1.0 if stop else rng.random()
                rx = dec.receiver(r, prefill.endpoint)
                try:
                    await prefill.call("sender", room=r)
                    await rx.send_metadata(dst, timeout=10)
                    await prefill.call("wait_ready", room=r)
                    if stop:  # stopped mid-transfer: the decode gives up on it by liveness
                        before = dst_bufs[0][dst, :8].copy()
                        send = asyncio.ensure_future(prefill.call("send_kv", room=r, pages=src, timeout=60))
                        deadline = time.monotonic() + 5
                        while (dst_bufs[0][dst, :8] == before).all() and time.monotonic() < deadline:
                            await asyncio.sleep(0)  # until its first writes land
                        prefill.signal(signal.SIGSTOP)  # the rest is still in the engine
                        await asyncio.gather(rx.done(timeout=30), return_exceptions=True)
                        freeing = asyncio.ensure_future(give_back(rx, dst))  # as soon as it is released
                        stop_failed.set()
                        await asyncio.wait_for(reuse_window.wait(), 60)  # the other prefill's rooms reuse pages
                        prefill.signal(signal.SIGCONT)
                        await asyncio.gather(send, return_exceptions=True)
                        await freeing
                        outcomes["stopped"] += 1
                        return
                    elif fault < 0.15:  # the decode aborts while the prefill sends
                        send = asyncio.ensure_future(prefill.call("send_kv", room=r, pages=src))
                        await asyncio.sleep(rng.random() * 0.002)
                        await rx.abort("scheduler cancelled the request")
                        await asyncio.gather(send, return_exceptions=True)
                        outcomes["aborted"] += 1
                    elif fault < 0.25:  # the prefill's send times out
                        await asyncio.gather(prefill.call("send_kv", room=r, pages=src, timeout=1e-4),
                                             rx.done(timeout=10), return_exceptions=True)
                        outcomes["timed_out"] += 1
                    else:
                        await prefill.call("send_kv", room=r, pages=src)
                        await rx.done(timeout=30)
                        for d, s in zip(dst, src, strict=True):
                            owner[d] = (p, s)
                        outcomes["ok"] += 1
                except (AiotransferError, RemoteError):
                    outcomes["failed"] += 1
                if keep:  # held to the end, for the final check
                    kept.extend(dst)
                    return
                await give_back(rx, dst)

            async def worker(w: int) -> None:
                for r in range(w, ROOMS, CONCURRENCY):
                    await room(r, rng.randrange(2), rng.randint(1, 24))

            await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
            # Last, a stop: prefill 0 is stopped with a big room's writes in flight, the decode fails the
            # room by liveness, prefill 1's rooms take pages from the pool, then prefill 0 resumes.
            stopped = asyncio.ensure_future(room(ROOMS, 0, BIG_ROOM, stop=True))
            await asyncio.wait_for(stop_failed.wait(), 30)
            for r in range(ROOMS + 1, ROOMS + 1 + 24):  # ~380 pages: what the pool has left
                await room(r, 1, rng.randint(8, 24), keep=True)
            reuse_window.set()
            await stopped
            stats = dec.stats()
    finally:
        for prefill in prefills:
            prefill.signal(signal.SIGCONT)
            await prefill.close()
    wrong = [d for d, (p, s) in owner.items()
             if any((dst_bufs[b][d] != srcs[p][b][s]).any() for b in range(GEOM["buffers"]))]
    print(f"soak: {ROOMS} rooms in {time.monotonic() - t0:.1f}s, {dict(outcomes)}, pages checked {len(owner)}, "
          f"wrong {len(wrong)}, releases "
          f"{ {k[len('rooms_released_'):]: v for k, v in stats.items() if k.startswith('rooms_released_')} }")
    assert wrong == []  # no late write of a failed room landed in a page another room owned
    assert hung == []  # every signal resolved
    assert len(free) + len(kept) == GEOM["pages"]  # no page held forever
    assert outcomes["ok"] > ROOMS // 2 and outcomes["aborted"] > 100 and outcomes["stopped"] == 1
    assert stats["rooms_awaiting_release"] == 0
