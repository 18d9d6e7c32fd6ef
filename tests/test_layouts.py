"""Pages laid out differently on the two sides (layout, head order, page size, TP split), converted while
staging, byte-exact across two processes against a reference re-layout in NumPy."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, TransferConfig, TransferFailed
from tests.remote import RemoteError, RemotePeer
from tests.test_page_sizes import send_in_two_chunks

H, HB, LAYERS = 4, 8, 2
PLANES = 2 * LAYERS


def token_planes(seed: int, tokens: int) -> list[np.ndarray]:
    """The room's KV: per plane (K of every layer, then V), tokens x heads x head bytes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size=(tokens, H, HB), dtype=np.uint8) for _ in range(PLANES)]


def laid_out(planes: list[np.ndarray], layout: str, order: str, page_size: int, num_pages: int, pages: list[int],
             heads: tuple[int, int] = (0, H)) -> list[np.ndarray]:
    """The buffers of one rank holding ``planes`` (heads ``[start, start+count)``) in ``pages``: written out
    from the layout's definition, one page and plane at a time."""
    start, count = heads
    per_buffer = {"layer_first": 1, "page_first": PLANES, "page_first_kv_split": LAYERS}[layout]
    block = (page_size, count, HB) if order == "NHD" else (count, page_size, HB)
    bufs = [np.zeros((num_pages, per_buffer, *block), dtype=np.uint8) for _ in range(PLANES // per_buffer)]
    for p, plane in enumerate(planes):
        buf, sub = bufs[p // per_buffer], p % per_buffer
        for i, page in enumerate(pages):
            rows = plane[i * page_size : (i + 1) * page_size, start : start + count]
            if order == "NHD":
                buf[page, sub, : len(rows)] = rows
            else:
                buf[page, sub, :, : len(rows)] = rows.transpose(1, 0, 2)
    return [b.reshape(num_pages, -1) for b in bufs]


def digest(bufs: list[np.ndarray], pages: list[int]) -> str:
    h = hashlib.sha256()
    for b in bufs:
        h.update(np.ascontiguousarray(b[np.asarray(pages)]).tobytes())
    return h.hexdigest()


def test_the_reference_tells_layouts_apart() -> None:
    """Negative control: the same tokens laid out head-major and token-major differ, and so do pages in
    another order, so a transfer that skipped the conversion or misplaced a page fails the checks below."""
    planes = token_planes(0, 20)
    a = laid_out(planes, "layer_first", "NHD", 16, 4, [2, 0])
    b = laid_out(planes, "layer_first", "HND", 16, 4, [2, 0])
    c = laid_out(planes, "layer_first", "NHD", 16, 4, [0, 2])
    assert digest(a, [2, 0]) != digest(b, [2, 0])
    assert digest(a, [0, 1, 2, 3]) != digest(c, [0, 1, 2, 3])


Side = tuple[str, str, int]
CASES: list[tuple[Side, Side]] = [
    (("layer_first", "NHD", 16), ("layer_first", "HND", 16)),
    (("layer_first", "NHD", 16), ("page_first", "NHD", 16)),
    (("page_first_kv_split", "HND", 16), ("layer_first", "NHD", 64)),
    (("layer_first", "HND", 64), ("layer_first", "HND", 16)),
    (("page_first", "HND", 1), ("page_first_kv_split", "NHD", 16)),
    (("page_first", "NHD", 16), ("page_first", "NHD", 64)),
]


async def _room(engine: str, ours: Side, theirs: Side, tokens: int, d_tp: int = 1) -> None:
    (p_layout, p_order, p), (d_layout, d_order, d) = ours, theirs
    planes = token_planes(tokens + p + d, tokens)
    n_src, n_dst = -(-tokens // p), -(-tokens // d)
    src_total, dst_total = 2 * n_src + 3, 2 * n_dst + 3
    rng = np.random.default_rng(tokens)
    src = [int(x) for x in rng.permutation(src_total)[:n_src]]
    dst = [int(x) for x in rng.permutation(dst_total)[:n_dst]]
    kv = laid_out(planes, p_layout, p_order, p, src_total, src)
    args = KVArgs(kv, page_size=p, dtype="uint8", layout=p_layout, head_order=p_order, kv_heads=H, total_kv_heads=H,
                  num_layers=LAYERS)
    heads = H // d_tp
    async with KVManager(args, TransferConfig(engine=engine, staging="auto")) as mgr:
        expected = [laid_out(planes, d_layout, d_order, d, dst_total, dst, (r * heads, heads)) for r in range(d_tp)]
        peers = [await RemotePeer.start(engine, buffers=len(expected[r]), pages=dst_total,
                                        item_len=expected[r][0].shape[1], page_size=d, layout=d_layout,
                                        head_order=d_order, kv_heads=heads, total_kv_heads=H, num_layers=LAYERS,
                                        tp_size=d_tp, tp_rank=r) for r in range(d_tp)]
        try:
            tx = mgr.sender(1)
            for peer in peers:
                await peer.call("receiver", room=1, peer=mgr.endpoint, pages=dst, num_tokens=tokens)
            await tx.wait_ready(timeout=10)
            await send_in_two_chunks(tx, src)
            assert mgr.stats()["staged_pieces"] > 0
            for r, peer in enumerate(peers):
                assert (await peer.call("done", room=1))["status"] == "Success"
                # the whole buffers: the room's pages converted, every other byte untouched
                got = (await peer.call("digest", pages=list(range(dst_total))))["digest"]
                assert got == digest(expected[r], list(range(dst_total))), f"decode rank {r}"
        finally:
            for peer in peers:
                await peer.close()


@pytest.mark.parametrize(("ours", "theirs"), CASES, ids=lambda s: "-".join(map(str, s)))
async def test_converted_layouts_byte_exact(engine: str, ours: Side, theirs: Side) -> None:
    await _room(engine, ours, theirs, tokens=70)


async def test_converted_layouts_with_head_slices(engine: str) -> None:
    """TP 1 -> 2, token-major 16-token pages into head-major 64-token pages: each decode rank its heads."""
    await _room(engine, ("layer_first", "NHD", 16), ("layer_first", "HND", 64), tokens=100, d_tp=2)


async def test_a_conversion_failing_mid_room_fails_it_on_both_sides(engine: str) -> None:
    """The decode cannot scatter a converted piece: the prefill's send fails at once with the decode's
    reason, and the decode's room fails too."""
    tokens = 300
    planes = token_planes(5, tokens)
    src = list(range(-(-tokens // 16)))
    args = KVArgs(laid_out(planes, "layer_first", "NHD", 16, len(src), src), page_size=16, dtype="uint8",
                  kv_heads=H, total_kv_heads=H)
    async with KVManager(args, TransferConfig(engine=engine, staging_bytes=1 << 14)) as mgr:
        peer = await RemotePeer.start(engine, buffers=PLANES, pages=len(src), item_len=16 * H * HB, page_size=16,
                                      head_order="HND", kv_heads=H, total_kv_heads=H)
        try:
            await peer.call("break_conversion")
            tx = mgr.sender(4)
            await peer.call("receiver", room=4, peer=mgr.endpoint, pages=src)
            await tx.wait_ready(timeout=10)
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(TransferFailed, match="conversion broke"):
                await tx.send_kv(src, timeout=30)
            assert asyncio.get_running_loop().time() - t0 < 10
            reply = await peer.call("reason", room=4)
            for _ in range(50):
                if reply["status"] == "Failed":
                    break
                await asyncio.sleep(0.1)
                reply = await peer.call("reason", room=4)
            assert reply["status"] == "Failed" and "conversion broke" in reply["reason"], reply
        finally:
            await peer.close()


@pytest.mark.parametrize(("config", "match"), [
    ({"checksum": True}, "a converted peer cannot be checked"),
    ({"staging": "never"}, "needs a staging arena on both sides"),
])
async def test_conversion_refused_before_a_byte_moves(engine: str, config: dict[str, object], match: str) -> None:
    kv = laid_out(token_planes(1, 16), "layer_first", "NHD", 16, 4, [0])
    args = KVArgs(kv, page_size=16, dtype="uint8", kv_heads=H, total_kv_heads=H)
    async with KVManager(args, TransferConfig(engine=engine, **config)) as mgr:  # type: ignore[arg-type]
        peer = await RemotePeer.start(engine, buffers=PLANES, pages=4, item_len=16 * H * HB, page_size=16,
                                      head_order="HND", kv_heads=H, total_kv_heads=H)
        try:
            with pytest.raises(RemoteError) as info:
                await peer.call("receiver", room=2, peer=mgr.endpoint, pages=[0])
            assert info.value.error == "IncompatiblePeer" and match in info.value.reason
        finally:
            await peer.close()


async def test_unknown_heads_cannot_be_converted(engine: str) -> None:
    kv = laid_out(token_planes(1, 16), "layer_first", "NHD", 16, 4, [0])
    async with KVManager(KVArgs(kv, page_size=16, dtype="uint8"), TransferConfig(engine=engine)) as mgr:
        peer = await RemotePeer.start(engine, buffers=PLANES, pages=4, item_len=16 * H * HB, page_size=16,
                                      head_order="HND")
        try:
            with pytest.raises(RemoteError, match="kv_heads is not set"):
                await peer.call("receiver", room=3, peer=mgr.endpoint, pages=[0])
        finally:
            await peer.close()
