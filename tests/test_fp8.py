"""fp8 KV with per-page scales through a real engine: prefill (torch float8 tensors) in this process,
decode in another OS process. The scale tensors are registered as KV buffers of their own size, so they
move with their pages and land before Success; a KV dtype mismatch is refused at the handshake."""

from __future__ import annotations

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, TransferConfig
from tests.conftest import GEOMETRY
from tests.peer import digest
from tests.remote import RemoteError, RemotePeer

torch = pytest.importorskip("torch")

PAGES, BUFFERS, VALUES = GEOMETRY["pages"], GEOMETRY["buffers"], GEOMETRY["item_len"]  # fp8: 1 byte a value
GROUP = 256  # values per scale
SCALE_BYTES = VALUES // GROUP * 4  # float32 scales per page


def quantized_cache(dtype: object) -> tuple[list[object], list[object]]:
    """K/V pages in fp8 and their per-page, per-group float32 scales."""
    gen = torch.Generator().manual_seed(8)
    kv, scales = [], []
    for _ in range(BUFFERS):
        x = torch.randn(PAGES, VALUES // GROUP, GROUP, generator=gen) * 3
        s = x.abs().amax(dim=2, keepdim=True).clamp(min=1e-6) / torch.finfo(dtype).max
        kv.append((x / s).to(dtype).reshape(PAGES, VALUES))
        scales.append(s.reshape(PAGES, VALUES // GROUP).contiguous())
    return kv, scales


def as_bytes(t: object) -> np.ndarray:
    """A tensor's bytes, as the engine moves them (fp8 values, float32 scales)."""
    return np.asarray(t.view(torch.uint8).numpy())  # type: ignore[attr-defined]


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
async def test_fp8_pages_and_their_scales_land_byte_exact(engine: str, fp8: str) -> None:
    kv, scales = quantized_cache(getattr(torch, fp8))
    decode = await RemotePeer.start(engine, dtype=fp8, scale_item_len=SCALE_BYTES, **GEOMETRY)
    try:
        async with KVManager(KVArgs([*kv, *scales], page_size=16, dtype=fp8), TransferConfig(engine=engine)) as mgr:
            rng = np.random.default_rng(4)
            src = [int(x) for x in rng.permutation(PAGES)[:60]]
            dst = [int(x) for x in rng.permutation(PAGES)[:60]]
            tx = mgr.sender(1)
            await decode.call("receiver", room=1, peer=mgr.endpoint, pages=dst)
            await tx.wait_ready(timeout=10)
            await tx.send_kv(src[:25], last=False)
            await tx.send_kv(src[25:])
            await tx.done(timeout=10)
            assert (await decode.call("done", room=1))["status"] == "Success"
            got = (await decode.call("digest", pages=dst))["digest"]
            assert got == digest([as_bytes(t) for t in [*kv, *scales]], src)
            assert tx.bytes_sent == 60 * BUFFERS * (VALUES + SCALE_BYTES)
    finally:
        await decode.close()


async def test_an_fp8_format_mismatch_is_refused_at_the_handshake_naming_both(engine: str) -> None:
    kv, scales = quantized_cache(torch.float8_e4m3fn)
    decode = await RemotePeer.start(engine, dtype="float8_e5m2", scale_item_len=SCALE_BYTES, **GEOMETRY)
    try:
        args = KVArgs([*kv, *scales], page_size=16, dtype="float8_e4m3fn")
        async with KVManager(args, TransferConfig(engine=engine, handshake_timeout=5.0)) as mgr:
            with pytest.raises(RemoteError, match=r"KV dtype mismatch: peer .float8_e5m2., ours .float8_e4m3fn.") as info:
                await decode.call("receiver", room=2, peer=mgr.endpoint, pages=[1, 2])
            assert info.value.error == "IncompatiblePeer"
            assert mgr.stats().get("kv_bytes_sent", 0) == 0
    finally:
        await decode.close()
