"""Multi-rank transfers over a real engine: prefill ranks in this process, each decode rank in its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, KVPoll, TransferConfig
from aiotransfer._topology import held_heads
from tests.conftest import expected_digest
from tests.remote import RemoteError, RemotePeer

H, HB, PS, LAYERS, PAGES = 8, 32, 4, 2, 32


def global_kv(seed: int, heads: int = H) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(PAGES, PS, heads, HB), dtype=np.uint8) for _ in range(2 * LAYERS)]


def shard(g: list[np.ndarray], rank: int, tp: int) -> list[np.ndarray]:
    start, count = held_heads(rank, tp, g[0].shape[2])
    return [np.ascontiguousarray(b[:, :, start : start + count, :]).reshape(PAGES, -1) for b in g]


@contextlib.asynccontextmanager
async def prefill_ranks(
    per_rank: list[KVArgs], engine: str, **cfg: Any
) -> AsyncIterator[list[KVManager]]:
    async with contextlib.AsyncExitStack() as stack:
        leader = await stack.enter_async_context(KVManager(per_rank[0], TransferConfig(engine=engine, **cfg)))
        mgrs = [leader]
        for args in per_rank[1:]:
            mgrs.append(await stack.enter_async_context(
                KVManager(args, TransferConfig(engine=engine, bootstrap=leader.endpoint, **cfg))
            ))
        yield mgrs


@contextlib.asynccontextmanager
async def decode_ranks(engine: str, n: int, **opts: Any) -> AsyncIterator[list[RemotePeer]]:
    peers = await asyncio.gather(*(RemotePeer.start(engine, tp_size=n, tp_rank=d, **opts) for d in range(n)))
    try:
        yield list(peers)
    finally:
        await asyncio.gather(*(p.close() for p in peers))


async def run_room(prefill: list[KVManager], decode: list[RemotePeer], room: int,
                   src: list[int], dst: list[int]) -> None:
    senders = [m.sender(room) for m in prefill]
    await asyncio.gather(*(d.call("receiver", room=room, peer=prefill[0].endpoint, pages=dst) for d in decode))
    await asyncio.gather(*(tx.wait_ready(timeout=10) for tx in senders))

    async def send(tx: Any) -> None:
        await tx.send_kv(src[: len(src) // 2], last=False)
        await tx.send_kv(src[len(src) // 2 :])
        await tx.done(timeout=10)

    await asyncio.gather(*(send(tx) for tx in senders))
    assert all(tx.poll() is KVPoll.Success for tx in senders)
    results = await asyncio.gather(*(d.call("done", room=room) for d in decode))
    assert all(r["status"] == "Success" for r in results)


@pytest.mark.parametrize("staging", ["always", "never"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(4, 2), (2, 4), (1, 2), (2, 1)])
async def test_tp_mismatch_head_slices_byte_exact(engine: str, p_tp: int, d_tp: int, staging: str) -> None:
    g = global_kv(seed=10 * p_tp + d_tp)
    per_rank = [
        KVArgs(shard(g, r, p_tp), page_size=PS, dtype="uint8", tp_size=p_tp, tp_rank=r,
               kv_heads=H // p_tp, total_kv_heads=H)
        for r in range(p_tp)
    ]
    rng = np.random.default_rng(p_tp * 7 + d_tp)
    async with prefill_ranks(per_rank, engine, staging=staging) as prefill, decode_ranks(
        engine, d_tp, buffers=2 * LAYERS, pages=PAGES, item_len=PS * (H // d_tp) * HB, page_size=PS,
        kv_heads=H // d_tp, total_kv_heads=H,
    ) as decode:
        for room in (1, 2):
            src = [int(x) for x in rng.permutation(PAGES)[:12]]
            dst = [int(x) for x in rng.permutation(PAGES)[:12]]
            await run_room(prefill, decode, room, src, dst)
            for d, peer in enumerate(decode):
                got = (await peer.call("digest", pages=dst))["digest"]
                assert got == expected_digest(shard(g, d, d_tp), src), f"decode rank {d} room {room}"
        staged = sum(m.stats().get("staged_pieces", 0) for m in prefill)
        assert (staged > 0) == (staging == "always")


async def test_gqa_replicated_heads_8_to_1(engine: str) -> None:
    """2 KV heads over prefill TP 8: ranks 0-3 and 4-7 hold replicas; only one replica per head sends."""
    g = global_kv(seed=3, heads=2)
    per_rank = [
        KVArgs(shard(g, r, 8), page_size=PS, dtype="uint8", tp_size=8, tp_rank=r, kv_heads=1, total_kv_heads=2)
        for r in range(8)
    ]
    async with prefill_ranks(per_rank, engine) as prefill, decode_ranks(
        engine, 1, buffers=2 * LAYERS, pages=PAGES, item_len=PS * 2 * HB, page_size=PS, kv_heads=2,
        total_kv_heads=2,
    ) as decode:
        src, dst = list(range(5, 15)), list(range(20, 30))
        await run_room(prefill, decode, 1, src, dst)
        assert (await decode[0].call("digest", pages=dst))["digest"] == expected_digest(shard(g, 0, 1), src)
        sent = [m.stats().get("kv_bytes_sent", 0) for m in prefill]
        assert [s > 0 for s in sent] == [True, False, False, False, True, False, False, False]


async def test_mla_4_to_2_dummies_conclude(engine: str) -> None:
    rng = np.random.default_rng(4)
    latent = [rng.integers(0, 256, size=(PAGES, 576), dtype=np.uint8) for _ in range(LAYERS)]
    per_rank = [KVArgs([b.copy() for b in latent], page_size=PS, dtype="uint8", layout="mla", tp_size=4, tp_rank=r)
                for r in range(4)]
    async with prefill_ranks(per_rank, engine) as prefill, decode_ranks(
        engine, 2, buffers=LAYERS, pages=PAGES, item_len=576, page_size=PS, layout="mla",
    ) as decode:
        src, dst = [3, 4, 9], [1, 2, 30]
        await run_room(prefill, decode, 5, src, dst)
        for peer in decode:
            assert (await peer.call("digest", pages=dst))["digest"] == expected_digest(latent, src)
        sent = [m.stats().get("kv_bytes_sent", 0) > 0 for m in prefill]
        assert sent == [True, False, True, False]  # ranks 1 and 3 were dummies, yet concluded Success


async def test_pp_2_to_1_pairs_layers_by_id(engine: str) -> None:
    g = global_kv(seed=5)  # buffers K0, V0, K1, V1
    whole = [b.reshape(PAGES, -1) for b in g]
    per_stage = [
        KVArgs([whole[2 * q], whole[2 * q + 1]], page_size=PS, dtype="uint8", pp_size=2, pp_rank=q,
               kv_layer_ids=[q, q], kv_heads=H, total_kv_heads=H)
        for q in range(2)
    ]
    async with prefill_ranks(per_stage, engine) as prefill, decode_ranks(
        engine, 1, buffers=4, pages=PAGES, item_len=PS * H * HB, page_size=PS, layer_ids="0,0,1,1",
        kv_heads=H, total_kv_heads=H,
    ) as decode:
        src, dst = [0, 1, 2, 7], [8, 9, 10, 3]
        await run_room(prefill, decode, 6, src, dst)
        assert (await decode[0].call("digest", pages=dst))["digest"] == expected_digest(whole, src)


@pytest.mark.parametrize("opened", [False, True], ids=["stashed", "open"])
async def test_one_decode_ranks_abort_ends_the_room_on_every_rank_with_its_reason(engine: str, opened: bool) -> None:
    """Decode TP 2 from prefill TP 1: both decode ranks ask for the room (kept until its sender opens, or
    taken by an open sender), then rank 0 aborts. Rank 1 learns at once that the room failed, with rank 0's
    reason, and that nothing of it can write into its pages (released as drained, not at the quarantine);
    the prefill's sender, opened before or after, fails with the same reason. One room, one reason, both
    sides, every rank."""
    g = global_kv(seed=21)
    per_rank = [KVArgs(shard(g, 0, 1), page_size=PS, dtype="uint8", kv_heads=H, total_kv_heads=H)]
    loop = asyncio.get_running_loop()
    async with prefill_ranks(per_rank, engine) as prefill, decode_ranks(
        engine, 2, buffers=2 * LAYERS, pages=PAGES, item_len=PS * (H // 2) * HB, page_size=PS, kv_heads=H // 2,
        total_kv_heads=H,
    ) as decode:
        pre = prefill[0]
        tx = pre.sender(9) if opened else None
        await asyncio.gather(*(d.call("receiver", room=9, peer=pre.endpoint, pages=[1, 2, 3]) for d in decode))
        if tx is not None:
            await tx.wait_ready(timeout=10)
        else:
            stash = pre._prefill.pending._rooms
            for _ in range(1000):
                if 9 in stash and len(stash[9].items) == 2:
                    break
                await asyncio.sleep(0.01)
            assert 9 in stash and len(stash[9].items) == 2, "both ranks' requests wait for the room's sender"
        await decode[0].call("abort", room=9, reason="rank 0 gave up")
        start = loop.time()
        with pytest.raises(RemoteError) as failed:
            await decode[1].call("done", room=9, timeout=5)
        assert failed.value.error == "TransferFailed" and loop.time() - start < 3, failed.value
        for d in decode:
            assert (await d.call("released", room=9, timeout=5))["cause"] == "drained"
        if tx is None:
            tx = pre.sender(9)
        assert tx.poll() is KVPoll.Failed and tx.failure_reason == "aborted by decode: rank 0 gave up"
        for d in decode:
            assert (await d.call("reason", room=9))["reason"] == tx.failure_reason
        assert pre.stats()["pending_requests"] == 0
