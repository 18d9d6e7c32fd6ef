"""KV in CUDA memory on both sides, two processes, over NIXL and Mooncake (``make test-gpu``).

Skipped where ``torch.cuda.is_available()`` is false. The decode runs in its own process on the same GPU
(``tests/peer.py --device cuda:0``); the prefill's KV tensors live on the GPU in this process.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, TransferConfig
from tests.conftest import expected_digest, nixl_available
from tests.peer import make_buffers
from tests.remote import RemotePeer


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _mooncake_cuda() -> bool:
    """A Mooncake wheel built with CUDA (the ``-non-cuda`` one cannot reach GPU memory)."""
    for dist in ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU: torch.cuda.is_available() is false here"),
]

DEVICE = "cuda:0"


@pytest.fixture(params=[  # without a GPU, the GPU is the reason given
    pytest.param("nixl", marks=pytest.mark.skipif(_cuda() and not nixl_available(), reason="nixl not installed")),
    pytest.param("mooncake_tcp", marks=pytest.mark.skipif(
        _cuda() and not _mooncake_cuda(), reason="needs a CUDA build of Mooncake: pip install 'aiotransfer[mooncake]'")),
])
def gpu_engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def cuda_kv(bufs: list[np.ndarray]) -> list[Any]:
    import torch

    return [torch.from_numpy(b).to(DEVICE) for b in bufs]


async def _room(mgr: KVManager, decode: RemotePeer, room: int, src: list[int], dst: list[int]) -> float:
    """One room of ``src`` -> ``dst``; returns the seconds ``send_kv`` + ``done`` took."""
    tx = mgr.sender(room)
    await decode.call("receiver", room=room, peer=mgr.endpoint, pages=dst, timeout=30)
    await tx.wait_ready(timeout=30)
    t0 = time.perf_counter()
    await tx.send_kv(src, timeout=120)
    await tx.done(timeout=120)
    elapsed = time.perf_counter() - t0
    assert (await decode.call("done", room=room, timeout=120))["status"] == "Success"
    return elapsed


@pytest.mark.parametrize("staging", ["never", "always"])
async def test_cuda_kv_both_sides_byte_exact(gpu_engine: str, staging: str) -> None:
    geometry: dict[str, Any] = {"buffers": 4, "pages": 256, "item_len": 4096}
    bufs = make_buffers(geometry["buffers"], geometry["pages"], geometry["item_len"], seed=7)
    cfg = TransferConfig(engine=gpu_engine, device_id=0, staging=staging, staging_bytes=1 << 20)
    decode = await RemotePeer.start(gpu_engine, device=DEVICE, **geometry)
    try:
        info = await decode.call("info")
        assert info["describe"]["kv_device"] == DEVICE and info["describe"]["staging_backend"] == "torch"
        async with KVManager(KVArgs(cuda_kv(bufs), page_size=16, dtype="uint8"), cfg) as mgr:
            assert mgr.describe()["kv_device"] == DEVICE
            rng = np.random.default_rng(8)
            src = [int(x) for x in rng.permutation(256)[:200]]
            dst = [int(x) for x in rng.permutation(256)[:200]]
            await _room(mgr, decode, 1, src, dst)
            assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
            staged = mgr.stats().get("staged_pieces", 0)
            assert (staged > 0) == (staging == "always"), mgr.stats()
    finally:
        await decode.close()


@pytest.mark.timeout(600)
async def test_device_staging_against_direct_on_10k_scattered_pages(gpu_engine: str) -> None:
    """10,000 scattered 4 KiB pages x 4 buffers (160 MiB) in GPU memory: staged on the device vs one
    engine entry per page. Prints GB/s of each; checks both are byte-exact."""
    geometry: dict[str, Any] = {"buffers": 4, "pages": 12_288, "item_len": 4096}
    n = 10_000
    bufs = make_buffers(geometry["buffers"], geometry["pages"], geometry["item_len"], seed=11)
    kv = cuda_kv(bufs)
    nbytes = n * geometry["buffers"] * geometry["item_len"]
    rng = np.random.default_rng(12)
    decode = await RemotePeer.start(gpu_engine, device=DEVICE, timeout=120, **geometry)
    try:
        results: dict[str, float] = {}
        for room, staging in enumerate(("never", "always"), start=1):
            cfg = TransferConfig(engine=gpu_engine, device_id=0, staging=staging)
            async with KVManager(KVArgs(kv, page_size=16, dtype="uint8"), cfg) as mgr:
                src = [int(x) for x in rng.permutation(geometry["pages"])[:n]]
                dst = [int(x) for x in rng.permutation(geometry["pages"])[:n]]
                await decode.call("zero")
                elapsed = await _room(mgr, decode, room, src, dst)
                assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
                stats = mgr.stats()
                assert (stats.get("staged_pieces", 0) > 0) == (staging == "always"), stats
                results[staging] = elapsed
                print(f"\n{gpu_engine} {staging:>6}: {n:,} scattered pages x {geometry['buffers']} buffers, "
                      f"{nbytes / 2**20:.0f} MiB in {elapsed * 1e3:.1f} ms = {nbytes / elapsed / 1e9:.2f} GB/s, "
                      f"{stats['kv_entries_sent']:,} engine entries")
        print(f"{gpu_engine}: device staging is {results['never'] / results['always']:.1f}x direct")
    finally:
        await decode.close()


async def test_nvlink_aux_on_the_device_moves_on_the_engine_path(gpu_engine: str) -> None:
    """INTRA_NODE_NVLINK: aux buffers allocated on the device on both sides, sent by the engine, byte-exact."""
    import torch

    from aiotransfer._aux_state import alloc_metadata_buffer

    geometry: dict[str, Any] = {"buffers": 2, "pages": 64, "item_len": 4096}
    bufs = make_buffers(geometry["buffers"], geometry["pages"], geometry["item_len"], seed=21)
    aux_host = make_buffers(1, 16, 64, seed=22)[0]
    aux = alloc_metadata_buffer(16, (64,), torch.uint8, pool="INTRA_NODE_NVLINK", device_id=0)
    aux.copy_(torch.from_numpy(aux_host))
    assert str(aux.device) == DEVICE
    cfg = TransferConfig(engine=gpu_engine, device_id=0, custom_mem_pool="INTRA_NODE_NVLINK")
    decode = await RemotePeer.start(gpu_engine, device=DEVICE, mem_pool="INTRA_NODE_NVLINK", aux_buffers=1,
                                    aux_slots=16, aux_item_len=64, **geometry)
    try:
        async with KVManager(KVArgs(cuda_kv(bufs), page_size=16, dtype="uint8", aux_buffers=[aux]), cfg) as mgr:
            tx = mgr.sender(1)
            await decode.call("receiver", room=1, peer=mgr.endpoint, pages=[3, 4], aux_index=5, timeout=30)
            await tx.wait_ready(timeout=30)
            await tx.send_kv([0, 1], timeout=60)
            await tx.send_aux(2, timeout=60)
            await tx.done(timeout=60)
            assert tx.aux_path == "engine"
            assert (await decode.call("done", room=1, timeout=60))["status"] == "Success"
            got = (await decode.call("aux_digest", slots=[5]))["digest"]
            assert got == expected_digest([aux_host], [2])
    finally:
        await decode.close()


# -- the CUDA stream ordering of the torch copier ----------------------------------------------------------
SPIN_CYCLES = 1_000_000_000
"""``torch.cuda._sleep`` cycles: about half a second at the GPU's clock."""


@contextlib.contextmanager
def _unordered(self: Any) -> Iterator[None]:
    """The copier's copies on its stream with no ordering at all: the negative control."""
    import torch

    with torch.cuda.stream(torch.cuda.Stream(self.device)):
        yield


def _pair_configs(engine: str, decode_arena: int) -> tuple[TransferConfig, TransferConfig]:
    common: dict[str, Any] = {"engine": engine, "device_id": 0, "staging": "always", "handshake_timeout": 30.0}
    return TransferConfig(**common, staging_bytes=1 << 20), TransferConfig(**common, staging_bytes=decode_arena)


async def _staged_room(engine: str, kv_p: list[Any], kv_d: list[Any], pages: list[int], decode_arena: int,
                       before_send: Any = None) -> None:
    cfg_p, cfg_d = _pair_configs(engine, decode_arena)
    async with KVManager(KVArgs(kv_p, page_size=16, dtype="uint8"), cfg_p) as mp, \
            KVManager(KVArgs(kv_d, page_size=16, dtype="uint8"), cfg_d) as md:
        tx, rx = mp.sender(1), md.receiver(1, mp.endpoint)
        await rx.send_metadata(pages, timeout=30)
        await tx.wait_ready(timeout=30)
        if before_send is not None:
            before_send()
        await tx.send_kv(pages, timeout=60)
        await tx.done(timeout=60)
        await rx.done(timeout=60)
        assert mp.stats().get("staged_pieces", 0) > 0, mp.stats()


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "negative-control"])
async def test_a_gather_reads_the_kv_only_after_the_default_stream_and_ends_before_the_engine_reads(
    gpu_engine: str, ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV is written on the default stream behind half a second of spinning, and sent at once: the
    staged bytes are the new ones only if the gather waits for the default stream and completes before
    the engine reads the arena. Without the ordering (the negative control) the old bytes arrive."""
    import torch

    from aiotransfer._torch_staging import TorchCopier

    if not ordered:
        monkeypatch.setattr(TorchCopier, "_copying", _unordered)
    kv_p = [torch.zeros((64, 4096), dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    kv_d = [torch.zeros((64, 4096), dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    torch.cuda.synchronize()

    def write_kv_late() -> None:
        torch.cuda._sleep(SPIN_CYCLES)  # the default stream is busy (a forward pass, say)
        for b in kv_p:
            b.fill_(0x5A)  # the KV the engine must send, ready only after it

    pages = list(range(64))
    await _staged_room(gpu_engine, kv_p, kv_d, pages, 4 << 20, before_send=write_kv_late)
    torch.cuda.synchronize()
    arrived = all(bool((b == 0x5A).all()) for b in kv_d)
    assert arrived == ordered


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "negative-control"])
async def test_a_scatter_is_complete_before_its_arena_space_is_granted_again(
    gpu_engine: str, ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every scatter on the decode starts behind 20 ms of spinning on its stream, and the decode's arena
    holds four pieces, so 32 pieces reuse its space eight times: the pages are right only if a scatter has
    read its piece before the space is granted to the next one. Without the ordering they are not."""
    import torch

    from aiotransfer import _torch_staging
    from aiotransfer._torch_staging import TorchCopier

    scatter = _torch_staging.scatter_pages_torch

    def slow_scatter(*args: Any) -> None:
        torch.cuda._sleep(SPIN_CYCLES // 25)  # on the copier's stream, ahead of the copies
        scatter(*args)

    monkeypatch.setattr(_torch_staging, "scatter_pages_torch", slow_scatter)
    if not ordered:
        monkeypatch.setattr(TorchCopier, "_copying", _unordered)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    kv_p = [torch.randint(0, 256, (64, 4096), dtype=torch.uint8, device=DEVICE, generator=gen) for _ in range(2)]
    kv_d = [torch.zeros((64, 4096), dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    torch.cuda.synchronize()
    pages = list(range(64))
    await _staged_room(gpu_engine, kv_p, kv_d, pages, 64 << 10)  # pieces of 2 pages x 2 buffers
    torch.cuda.synchronize()
    intact = all(bool(torch.equal(p, d)) for p, d in zip(kv_p, kv_d, strict=True))
    assert intact == ordered
