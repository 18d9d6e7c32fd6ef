"""Lifetimes across a deadline: arena bytes a worker thread still uses are never handed to another piece,
and one public call spends one deadline budget. Prefill in this process, decode in another OS process."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from aiotransfer import TransferTimeout
from aiotransfer import _staging as staging_module
from aiotransfer._staging import gather_pages
from tests.conftest import expected_digest
from tests.remote import RemotePeer
from tests.test_transfer import scattered, scattered_room

PIECE_PAGES = 16
"""Pages of one staged piece here: 4 buffers x 4 KiB x 16 = 256 KiB, a quarter of the 1 MiB arena."""


async def test_a_gather_past_its_deadline_keeps_its_arena_bytes_until_its_thread_returns(
    engine: str, decode: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room A's gather is held past A's deadline; meanwhile room B wants arena space. Were A's slice freed
    when A stopped waiting, B would be granted the same bytes and A's late copy would land in the middle of
    B's piece: B's pages would end with A's bytes. They must not."""
    b_gathered, a_copied = threading.Event(), threading.Event()
    calls: list[int] = []

    def gather(views: Any, counts: Any, pages: Any, sl: Any, out: Any) -> None:
        calls.append(1)
        if len(calls) == 1:  # room A: still copying long after its deadline
            b_gathered.wait(3.0)
            gather_pages(views, counts, pages, sl, out)
            a_copied.set()
        else:  # room B: gathered; its engine write waits until A's late copy has happened
            gather_pages(views, counts, pages, sl, out)
            b_gathered.set()
            a_copied.wait(1.0)

    monkeypatch.setattr(staging_module, "gather_pages", gather)
    async with scattered_room(engine, decode, 21, PIECE_PAGES, "always", seed=91) as (mgr, tx_a, bufs, src_a, _):
        with pytest.raises(TransferTimeout) as info:
            await tx_a.send_kv(src_a, timeout=0.3)
        assert info.value.room == 21
        rng = np.random.default_rng(92)
        dst_b, src_b = scattered(rng, PIECE_PAGES), scattered(rng, PIECE_PAGES)
        tx_b = mgr.sender(22)
        await decode.call("receiver", room=22, peer=mgr.endpoint, pages=dst_b)
        await tx_b.wait_ready(timeout=10)
        await tx_b.send_kv(src_b, timeout=10)
        await decode.call("done", room=22)
        assert (await decode.call("digest", pages=dst_b))["digest"] == expected_digest(bufs, src_b)
        assert a_copied.is_set()
        for _ in range(100):  # A's slice goes back once its thread has returned
            if mgr.stats()["staging_bytes_in_use"] == 0:
                break
            await asyncio.sleep(0.02)
        assert mgr.stats()["staging_bytes_in_use"] == 0


async def test_last_chunk_spends_one_deadline_budget(
    engine: str, decode: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``send_kv(last=True, timeout=T)`` gives up within T even when its own chunk took most of T and an
    earlier chunk is still in flight: waiting for that chunk does not start a fresh budget."""
    release = threading.Event()
    calls: list[int] = []

    def gather(views: Any, counts: Any, pages: Any, sl: Any, out: Any) -> None:
        calls.append(1)
        if len(calls) == 1:  # the earlier chunk: stuck
            release.wait(10.0)
        else:  # the last chunk: slow, but within its budget
            threading.Event().wait(0.7 * budget)
        gather_pages(views, counts, pages, sl, out)

    budget = 2.0
    monkeypatch.setattr(staging_module, "gather_pages", gather)
    async with scattered_room(engine, decode, 23, 2 * PIECE_PAGES, "always", seed=93) as (_, tx, _, src, _):
        first = asyncio.ensure_future(tx.send_kv(src[:PIECE_PAGES], last=False, timeout=30))
        while not calls:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            with pytest.raises(TransferTimeout) as info:
                await tx.send_kv(src[PIECE_PAGES:], timeout=budget)
            elapsed = loop.time() - t0
        finally:
            release.set()
            with pytest.raises(Exception):  # noqa: B017 -- the room failed: the earlier chunk ends with it
                await first
        # one budget (plus the time to notice it), not a fresh one after the 0.7 budget the chunk took (1.7x)
        assert elapsed < budget * 1.35, elapsed
        assert info.value.room == 23
        assert info.value.peer == decode.endpoint
