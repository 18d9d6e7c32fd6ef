"""Page size P != D: prefill and decode pages of different sizes, byte-exact across two processes.

The reference is the room's token stream: token ``t`` of a buffer is its ``t``-th row (``heads x head_bytes``)
whatever the page size, so both sides' pages are filled and read back through it.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiotransfer import InvalidArgument, KVArgs, KVManager, KVPoll, KVSender, TransferConfig
from aiotransfer._layout import RankGeometry, pair_buffers
from aiotransfer._plan import unit_span, units_of
from tests.conftest import expected_digest
from tests.remote import RemoteError, RemotePeer
from tests.test_parallel import prefill_ranks

H, HB, BUFFERS = 4, 16, 4
ROW = H * HB


def token_rows(seed: int, tokens: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(tokens, H, HB), dtype=np.uint8) for _ in range(BUFFERS)]


def paged(rows: list[np.ndarray], page_size: int, num_pages: int, pages: list[int]) -> list[np.ndarray]:
    """Buffers of ``num_pages`` pages holding ``rows``'s tokens in ``pages`` (the last page part full)."""
    out = []
    for r in rows:
        buf = np.zeros((num_pages, page_size, H, HB), dtype=np.uint8)
        for i, p in enumerate(pages):
            part = r[i * page_size : (i + 1) * page_size]
            buf[p, : len(part)] = part
        out.append(buf.reshape(num_pages, -1))
    return out


def token_digest(rows: list[np.ndarray], tokens: int, head_start: int = 0, head_count: int = H) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(np.ascontiguousarray(r[:tokens, head_start : head_start + head_count]).tobytes())
    return h.hexdigest()


def zero_digest(num_pages: int, item_len: int) -> str:
    h = hashlib.sha256()
    for _ in range(BUFFERS):
        h.update(bytes(num_pages * item_len))
    return h.hexdigest()


async def send_in_two_chunks(tx: KVSender, src: list[int]) -> None:
    """The room's pages as two chunks (one when it has a single page), then its Success."""
    half = len(src) // 2
    if half:
        await tx.send_kv(src[:half], last=False)
    await tx.send_kv(src[half:])
    await tx.done(timeout=10)
    assert tx.poll() is KVPoll.Success


# -- the mapping -------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    p=st.sampled_from([1, 2, 4, 16, 64]), d=st.sampled_from([1, 2, 4, 16, 64]), tokens=st.integers(1, 300),
    cut=st.floats(0, 1), seed=st.integers(0, 2**16),
)
def test_unit_spans_map_every_token_once(p: int, d: int, tokens: int, cut: float, seed: int) -> None:
    """Chunks of source pages, mapped to units, put token t of the source at token t of the destination,
    every token of the room exactly once."""
    g = min(p, d)
    ks, kd = p // g, d // g
    rng = np.random.default_rng(seed)
    src_pages = rng.permutation(10_000)[: -(-tokens // p)].astype(np.int64)
    dst_pages = rng.permutation(10_000)[: -(-tokens // d)].astype(np.int64)
    total = -(-tokens // g)
    split = int(cut * src_pages.size)
    seen: list[tuple[int, int]] = []
    for start, chunk in ((0, src_pages[:split]), (split, src_pages[split:])):
        ours, theirs, first = unit_span(chunk, dst_pages, start, ks, kd, total)
        assert ours.size == theirs.size
        for i, (su, du) in enumerate(zip(ours.tolist(), theirs.tolist(), strict=True)):
            unit = first + i  # the room's unit: tokens [unit * g, unit * g + g)
            assert su == src_pages[unit // ks] * ks + unit % ks
            assert du == dst_pages[unit // kd] * kd + unit % kd
            seen.append((su, du))
    assert len(seen) == total == len({s for s, _ in seen}) == len({d for _, d in seen})


def test_units_of() -> None:
    assert units_of(np.array([3, 0]), 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
    assert units_of(np.array([3, 0]), 1).tolist() == [3, 0]


def _geo(page_size: int, item_len: int, layout: str = "layer_first", outer: int = 1) -> RankGeometry:
    return RankGeometry(layout=layout, page_size=page_size, item_lens=[item_len] * BUFFERS, layer_ids=[],
                        tp_size=1, tp_rank=0, kv_heads=H, total_kv_heads=H, outer=outer)


def test_pairing_in_units() -> None:
    pairing = pair_buffers(_geo(16, 16 * ROW), _geo(64, 64 * ROW))
    assert not isinstance(pairing, str)
    assert (pairing.src_units, pairing.dst_units, pairing.unit_lens) == (1, 4, (16 * ROW,) * BUFFERS)
    pairing = pair_buffers(_geo(64, 64 * ROW), _geo(1, ROW))
    assert not isinstance(pairing, str)
    assert (pairing.src_units, pairing.dst_units, pairing.dst_unit_lens) == (64, 1, (ROW,) * BUFFERS)


@pytest.mark.parametrize(("ours", "theirs", "match"), [
    (_geo(16, 16 * ROW), _geo(24, 24 * ROW), "neither divides the other: peer 24, ours 16"),
    (_geo(16, 16 * ROW), _geo(64, 64 * 2 * ROW), "item length mismatch at buffer 0"),
    (_geo(16, 2 * 16 * ROW, "page_first", 2), _geo(64, 2 * 64 * ROW, "page_first", 2), "needs token-major pages"),
])
def test_pairing_refuses_what_cannot_convert(ours: RankGeometry, theirs: RankGeometry, match: str) -> None:
    reason = pair_buffers(ours, theirs)
    assert isinstance(reason, str) and match in reason


# -- across two processes ------------------------------------------------------------------------------------


CASES = [(16, 64, 70), (64, 16, 70), (1, 16, 37), (16, 64, 128), (64, 16, 16)]


@pytest.mark.parametrize("staging", ["never", "always", "checksum"])
@pytest.mark.parametrize(("p", "d", "tokens"), CASES)
async def test_page_sizes_byte_exact(engine: str, p: int, d: int, tokens: int, staging: str) -> None:
    """P -> D with the last page part full on either side, in two chunks, direct and staged (and direct with
    the decode verifying a checksum of the units written): the decode's token stream equals the prefill's,
    and no byte outside the room's pages changes."""
    rows = token_rows(p * 1000 + d, tokens)
    n_src, n_dst = -(-tokens // p), -(-tokens // d)
    src_total, dst_total = max(64, 2 * n_src), max(16, 2 * n_dst)
    rng = np.random.default_rng(tokens)
    src = [int(x) for x in rng.permutation(src_total)[:n_src]]
    dst = [int(x) for x in rng.permutation(dst_total)[:n_dst]]
    checksum = staging == "checksum"
    cfg = TransferConfig(engine=engine, staging="never" if checksum else staging, checksum=checksum)
    args = KVArgs(paged(rows, p, src_total, src), page_size=p, dtype="uint8", kv_heads=H, total_kv_heads=H)
    async with KVManager(args, cfg) as mgr:
        peer = await RemotePeer.start(engine, buffers=BUFFERS, pages=dst_total, item_len=d * ROW, page_size=d,
                                      kv_heads=H, total_kv_heads=H)
        try:
            tx = mgr.sender(1)
            await peer.call("receiver", room=1, peer=mgr.endpoint, pages=dst, num_tokens=tokens)
            await tx.wait_ready(timeout=10)
            assert tx.num_pages == n_src
            await send_in_two_chunks(tx, src)
            assert (await peer.call("done", room=1))["status"] == "Success"
            got = await peer.call("token_digest", pages=dst, num_tokens=tokens)
            assert got["digest"] == token_digest(rows, tokens)
            others = sorted(set(range(dst_total)) - set(dst))
            assert (await peer.call("digest", pages=others))["digest"] == zero_digest(len(others), d * ROW)
            assert (mgr.stats().get("staged_pieces", 0) > 0) == (staging == "always")
            if checksum:
                assert (await peer.call("stats"))["stats"].get("checksums_verified") == 1
        finally:
            await peer.close()


async def test_page_sizes_with_head_slices_and_layers(engine: str) -> None:
    """TP 1 -> 2 with 16 -> 64 pages: each decode rank gets its heads of every token; the room streamed
    layer by layer."""
    tokens, p, d = 100, 16, 64
    rows = token_rows(7, tokens)
    src, dst = list(range(3, 3 + -(-tokens // p))), [5, 1]  # 7 pages of 16 tokens into 2 of 64
    args = KVArgs(paged(rows, p, 64, src), page_size=p, dtype="uint8", kv_heads=H, total_kv_heads=H,
                  num_layers=BUFFERS // 2)
    async with KVManager(args, TransferConfig(engine=engine)) as mgr:
        peers = [await RemotePeer.start(engine, buffers=BUFFERS, pages=8, item_len=d * ROW // 2, page_size=d,
                                        kv_heads=H // 2, total_kv_heads=H, tp_size=2, tp_rank=r) for r in range(2)]
        try:
            tx = mgr.sender(2)
            for peer in peers:
                await peer.call("receiver", room=2, peer=mgr.endpoint, pages=dst, num_tokens=tokens)
            await tx.wait_ready(timeout=10)
            stream = tx.stream(src)
            for layer in range(BUFFERS // 2):
                await stream.send_layers([layer], timeout=10)
            await tx.done(timeout=10)
            for r, peer in enumerate(peers):
                assert (await peer.call("done", room=2))["status"] == "Success"
                got = await peer.call("token_digest", pages=dst, num_tokens=tokens)
                assert got["digest"] == token_digest(rows, tokens, r * H // 2, H // 2), f"decode rank {r}"
        finally:
            for peer in peers:
                await peer.close()


@pytest.mark.parametrize(("p", "d"), [(16, 64), (64, 16)])
async def test_page_sizes_streamed_layer_by_layer(engine: str, p: int, d: int) -> None:
    """Each layer of each chunk moves as its own units as soon as it is sent (direct entries)."""
    tokens = 150
    rows = token_rows(p + d, tokens)
    n_src, n_dst = -(-tokens // p), -(-tokens // d)
    src, dst = list(range(n_src))[::-1], list(range(1, 1 + n_dst))
    args = KVArgs(paged(rows, p, 64, src), page_size=p, dtype="uint8", kv_heads=H, num_layers=BUFFERS // 2)
    async with KVManager(args, TransferConfig(engine=engine, staging="never")) as mgr:
        peer = await RemotePeer.start(engine, buffers=BUFFERS, pages=16, item_len=d * ROW, page_size=d, kv_heads=H)
        try:
            tx = mgr.sender(6)
            await peer.call("receiver", room=6, peer=mgr.endpoint, pages=dst, num_tokens=tokens)
            await tx.wait_ready(timeout=10)
            half = n_src // 2
            for chunk, last in ((src[:half], False), (src[half:], True)):
                stream = tx.stream(chunk, last=last)
                for layer in (1, 0):
                    await stream.send_layers(layer, timeout=10)
                    assert mgr.stats()["kv_entries_sent"] > 0
            await tx.done(timeout=10)
            assert mgr.stats()["layer_writes"] == 4
            assert (await peer.call("done", room=6))["status"] == "Success"
            got = await peer.call("token_digest", pages=dst, num_tokens=tokens)
            assert got["digest"] == token_digest(rows, tokens)
        finally:
            await peer.close()


async def test_page_sizes_that_do_not_divide_are_refused_before_a_byte_moves(engine: str) -> None:
    async with KVManager(KVArgs(paged(token_rows(1, 16), 16, 8, [0]), page_size=16, dtype="uint8"),
                         TransferConfig(engine=engine)) as mgr:
        peer = await RemotePeer.start(engine, buffers=BUFFERS, pages=8, item_len=24 * ROW, page_size=24)
        try:
            with pytest.raises(RemoteError) as info:
                await peer.call("receiver", room=3, peer=mgr.endpoint, pages=[0])
            assert info.value.error == "IncompatiblePeer"
            assert "neither divides the other: peer 24, ours 16" in info.value.reason
        finally:
            await peer.close()


async def test_num_tokens_must_fill_the_pages(engine: str) -> None:
    args = KVArgs([np.zeros((8, 16 * ROW), dtype=np.uint8)], page_size=16, dtype="uint8")
    async with KVManager(args, TransferConfig(engine=engine)) as mgr:
        rx = mgr.receiver(4, mgr.endpoint)
        with pytest.raises(InvalidArgument, match="num_tokens 40 does not fill the 2 pages given"):
            await rx.send_metadata([0, 1], num_tokens=40, timeout=5)
        assert rx.poll() is not KVPoll.Failed



@pytest.mark.parametrize("head_order", ["NHD", "HND"])
async def test_tp_2_to_1_with_other_page_sizes(engine: str, head_order: str) -> None:
    """Two prefill ranks with half the heads each, 16-token pages, into one decode rank with 64-token pages:
    units of 16 tokens, head-sliced (NHD), or converted while staging (HND decode)."""
    tokens, p, d = 90, 16, 64
    rows = token_rows(11, tokens)
    src, dst = list(range(2, 2 + -(-tokens // p))), [6, 3]
    per_rank = []
    for r in range(2):
        half = [np.ascontiguousarray(x[:, r * H // 2 : (r + 1) * H // 2]) for x in rows]
        bufs = [np.zeros((16, p, H // 2, HB), dtype=np.uint8) for _ in half]
        for b, x in zip(bufs, half, strict=True):
            for i, page in enumerate(src):
                part = x[i * p : (i + 1) * p]
                b[page, : len(part)] = part
        per_rank.append(KVArgs([b.reshape(16, -1) for b in bufs], page_size=p, dtype="uint8", tp_size=2, tp_rank=r,
                               kv_heads=H // 2, total_kv_heads=H, num_layers=BUFFERS // 2))
    async with prefill_ranks(per_rank, engine) as prefill:
        peer = await RemotePeer.start(engine, buffers=BUFFERS, pages=8, item_len=d * ROW, page_size=d, kv_heads=H,
                                      total_kv_heads=H, head_order=head_order, num_layers=BUFFERS // 2)
        try:
            senders = [m.sender(5) for m in prefill]
            await peer.call("receiver", room=5, peer=prefill[0].endpoint, pages=dst, num_tokens=tokens)
            for tx in senders:
                await tx.wait_ready(timeout=10)
            await asyncio.gather(*(tx.send_kv(src) for tx in senders))
            assert (await peer.call("done", room=5))["status"] == "Success"
            if head_order == "NHD":
                got = await peer.call("token_digest", pages=dst, num_tokens=tokens)
                assert got["digest"] == token_digest(rows, tokens)
            else:
                expected = [np.zeros((8, d, H, HB), dtype=np.uint8) for _ in rows]
                for e, x in zip(expected, rows, strict=True):
                    for i, page in enumerate(dst):
                        part = x[i * d : (i + 1) * d]
                        e[page, : len(part)] = part
                hnd = [np.ascontiguousarray(e.transpose(0, 2, 1, 3)).reshape(8, -1) for e in expected]
                got = await peer.call("digest", pages=dst)
                assert got["digest"] == expected_digest(hnd, dst)
        finally:
            await peer.close()
