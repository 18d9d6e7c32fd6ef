"""Staging with torch (``aiotransfer._torch_staging``): the code path that runs on a GPU, run here on host
tensors (``staging_backend="torch"``).

The torch gather and scatter are held to the NumPy ones byte for byte; then scattered pages and TP head
slices move through a torch-staging side over the real engines, to NumPy- and torch-staging peers in
another process (the staged bytes are laid out the same, so either side may use either backend).
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiotransfer import ConfigError, KVArgs, KVManager, TransferConfig
from aiotransfer._args import resolve_buffer
from aiotransfer._staging import (
    DEVICE_COPY_BW,
    HOST_COPY_BW,
    HostCopier,
    RowSlice,
    StagingArena,
    choose_staging,
    copy_bandwidth,
    gather_pages,
    scatter_pages,
    staging_backend,
)
from tests.conftest import GEOMETRY, expected_digest
from tests.peer import make_buffers
from tests.remote import RemotePeer
from tests.test_parallel import (
    HB,
    LAYERS,
    PAGES,
    PS,
    H,
    decode_ranks,
    global_kv,
    prefill_ranks,
    run_room,
    shard,
)
from tests.test_transfer import scattered

torch = pytest.importorskip("torch")

from aiotransfer import _torch_staging  # noqa: E402 -- imports torch: only once it is known to be there
from aiotransfer._torch_staging import TorchCopier, gather_pages_torch, scatter_pages_torch  # noqa: E402


# -- the copies, against NumPy -----------------------------------------------------------------------------
@st.composite
def layouts(draw: Any) -> tuple[RowSlice, list[int], np.ndarray, int]:
    """(row slice, units per buffer, distinct unit indices, buffer count): whole pages or a head slice."""
    rows = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 6))
    head_bytes = draw(st.sampled_from([1, 2, 8, 24]))
    if draw(st.booleans()):
        start, count = 0, heads
    else:
        start = draw(st.integers(0, heads - 1))
        count = draw(st.integers(1, heads - start))
    nbuf = draw(st.integers(1, 3))
    num_pages = draw(st.lists(st.integers(1, 24), min_size=nbuf, max_size=nbuf))
    pages = draw(st.lists(st.integers(0, min(num_pages) - 1), min_size=1, max_size=min(num_pages), unique=True))
    return RowSlice(rows, heads, start, count, head_bytes), num_pages, np.array(pages, dtype=np.int64), nbuf


def _buffers(seed: int, num_pages: list[int], sl: RowSlice, tail: int = 5) -> list[np.ndarray]:
    """Random buffers of ``num_pages`` units each, ``tail`` bytes longer (bytes past the units stay put)."""
    rng = np.random.default_rng(seed)
    unit = sl.rows * sl.heads * sl.head_bytes
    return [rng.integers(0, 256, n * unit + tail, dtype=np.uint8) for n in num_pages]


@settings(max_examples=80, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**16))
def test_torch_gather_and_scatter_match_numpy_byte_for_byte(
    layout: tuple[RowSlice, list[int], np.ndarray, int], seed: int
) -> None:
    sl, num_pages, pages, _ = layout
    src = _buffers(seed, num_pages, sl)
    want = np.zeros(len(src) * pages.size * sl.bytes_per_page, dtype=np.uint8)
    gather_pages(src, num_pages, pages, sl, want)
    got = torch.zeros(want.size, dtype=torch.uint8)
    gather_pages_torch([torch.from_numpy(b) for b in src], num_pages, torch.from_numpy(pages), sl, got)
    assert np.array_equal(got.numpy(), want)

    by_numpy, by_torch = _buffers(seed + 1, num_pages, sl), _buffers(seed + 1, num_pages, sl)
    scatter_pages(by_numpy, num_pages, pages, sl, want)
    scatter_pages_torch([torch.from_numpy(b) for b in by_torch], num_pages, torch.from_numpy(pages), sl, got)
    for a, b in zip(by_numpy, by_torch, strict=True):
        assert np.array_equal(a, b)


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**16), off=st.sampled_from([0, 64, 4096]))
def test_torch_copier_fills_the_arena_as_the_host_copier_does(
    layout: tuple[RowSlice, list[int], np.ndarray, int], seed: int, off: int
) -> None:
    """The whole copier: buffers picked (in any order) out of the rank's KV, at an offset in the arena."""
    sl, num_pages, pages, nbuf = layout
    units = [*num_pages, num_pages[0]]  # one buffer more than the piece moves
    arrays = _buffers(seed, units, sl)
    kv = [resolve_buffer(a, 1, what=f"kv[{i}]") for i, a in enumerate(arrays)]
    picked = list(range(len(arrays)))[::-1][:nbuf]
    counts = [units[i] for i in picked]
    nbytes = nbuf * pages.size * sl.bytes_per_page
    host = HostCopier(arrays, StagingArena(off + nbytes))
    dev = TorchCopier(kv, "cpu", off + nbytes)
    assert dev.arena.device == "cpu" and dev.arena.ptr % 64 == 0
    host.gather(picked, counts, pages, sl, off)
    dev.gather(picked, counts, pages, sl, off)
    assert np.array_equal(dev.arena.view[off : off + nbytes], host.arena.view[off : off + nbytes])

    targets = _buffers(seed + 7, units, sl)
    expect = [t.copy() for t in targets]
    HostCopier(expect, host.arena).scatter(picked, counts, pages, sl, off)
    kv_t = [resolve_buffer(t, 1, what=f"kv[{i}]") for i, t in enumerate(targets)]
    into = TorchCopier(kv_t, "cpu", off + nbytes)
    into.arena.view[:] = dev.arena.view
    into.scatter(picked, counts, pages, sl, off)
    for a, b in zip(expect, targets, strict=True):
        assert np.array_equal(a, b)


def test_torch_copier_on_tensors_of_other_dtypes_moves_their_bytes() -> None:
    """KV given as float16 / bfloat16 tensors: pages move as bytes, whatever the element type."""
    kv_t = [torch.randn(8, 4, 16, dtype=torch.float16), torch.randn(8, 4, 16, dtype=torch.bfloat16)]
    kv = [resolve_buffer(t, None, what="kv") for t in kv_t]
    sl = RowSlice(1, 1, 0, 1, kv[0].item_len)
    pages = np.array([5, 0, 3])
    copier = TorchCopier(kv, "cpu", 1 << 16)
    copier.gather([0, 1], [8, 8], pages, sl, 128)
    got = copier.arena.view[128 : 128 + 2 * 3 * sl.bytes_per_page]
    want = np.concatenate([t[torch.from_numpy(pages)].view(torch.uint8).reshape(-1).numpy() for t in kv_t])
    assert np.array_equal(got, want)


# -- choosing a backend, and what it costs -------------------------------------------------------------------
def test_staging_backend_resolution() -> None:
    assert staging_backend("auto", "cpu") == "numpy"
    assert staging_backend("auto", "cuda:0") == "torch"
    assert staging_backend("torch", "cpu") == "torch"
    assert staging_backend("numpy", "cpu") == "numpy"
    with pytest.raises(ConfigError, match="cannot copy KV that lives on cuda:1"):
        staging_backend("numpy", "cuda:1")


def test_config_validates_staging_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TransferConfig().staging_backend == "auto"
    assert TransferConfig.from_env({"AIOTRANSFER_STAGING_BACKEND": "torch"}).staging_backend == "torch"
    with pytest.raises(ConfigError, match="auto, numpy or torch"):
        TransferConfig(staging_backend="gpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs torch: pip install 'aiotransfer\[torch\]'"):
        TransferConfig(staging_backend="torch")
    assert TransferConfig(staging_backend="numpy").staging_backend == "numpy"


def test_device_copies_make_staging_pay_where_host_copies_do_not() -> None:
    """1,000 entries of 100 KB over a 10 GB/s engine: the host copies (2 x 25 ms) cost more than the
    entries they save (30 ms); HBM copies (2 x 0.2 ms) do not."""
    def stage(**kw: Any) -> bool:
        return choose_staging(entries=1000, nbytes=100_000_000, entry_cost_s=30e-6, bandwidth_bps=1e10, **kw)

    assert copy_bandwidth("cpu") == HOST_COPY_BW and copy_bandwidth("cuda:0") == DEVICE_COPY_BW
    assert not stage() and not stage(device="cpu")
    assert stage(device="cuda:0") and stage(copy_bw=DEVICE_COPY_BW)


def test_managers_pick_their_backend_and_register_the_arena_on_its_device() -> None:
    bufs = make_buffers(2, 16, 256, seed=1)
    tensors = [torch.from_numpy(b) for b in bufs]
    cases: list[tuple[list[Any], dict[str, Any], str | None]] = [
        (bufs, {}, "numpy"),
        (tensors, {}, "numpy"),  # host tensors: NumPy unless torch is asked for
        (tensors, {"staging_backend": "torch"}, "torch"),
        (bufs, {"staging_backend": "torch"}, "torch"),  # any host buffer can be viewed as a tensor
        (bufs, {"staging": "never"}, None),
        (bufs, {"staging_bytes": 0, "staging_backend": "torch"}, None),
    ]
    for kv, cfg, backend in cases:
        mgr = KVManager(KVArgs(kv, page_size=4), TransferConfig(engine="mooncake_tcp", **cfg))
        assert mgr.describe()["staging_backend"] == backend, cfg
        ctx = mgr._ctx
        if backend is None:
            assert ctx.arena is None
            continue
        assert ctx.arena is not None
        assert type(ctx.copier).__name__ == {"numpy": "HostCopier", "torch": "TorchCopier"}[backend]
        arena = [r for r in ctx.regions() if r.ptr <= ctx.arena.ptr < r.end]
        assert len(arena) == 1 and arena[0].device == "cpu"


def test_the_library_imports_and_stages_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "import aiotransfer\n"
        "from aiotransfer import KVArgs, KVManager, TransferConfig, ConfigError\n"
        "mgr = KVManager(KVArgs([np.zeros((4, 64), np.uint8)]), TransferConfig(engine='mooncake_tcp'))\n"
        "assert mgr.describe()['staging_backend'] == 'numpy'\n"
        "try:\n"
        "    TransferConfig(staging_backend='torch')\n"
        "except ConfigError as exc:\n"
        "    assert 'pip install' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('torch backend accepted without torch')\n"
        "assert 'aiotransfer._torch_staging' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- two processes over the real engines ------------------------------------------------------------------
@pytest.fixture
def torch_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts the torch gathers and scatters of this process."""
    calls = {"gather": 0, "scatter": 0}
    gather, scatter = _torch_staging.gather_pages_torch, _torch_staging.scatter_pages_torch

    def counted_gather(*args: Any) -> None:
        calls["gather"] += 1
        gather(*args)

    def counted_scatter(*args: Any) -> None:
        calls["scatter"] += 1
        scatter(*args)

    monkeypatch.setattr(_torch_staging, "gather_pages_torch", counted_gather)
    monkeypatch.setattr(_torch_staging, "scatter_pages_torch", counted_scatter)
    yield calls


@contextlib.asynccontextmanager
async def staged_decode(engine: str, backend: str) -> AsyncIterator[RemotePeer]:
    peer = await RemotePeer.start(engine, staging_backend=backend, **GEOMETRY)
    try:
        info = await peer.call("info")
        assert info["describe"]["staging_backend"] == backend
        yield peer
    finally:
        await peer.close()


@pytest.mark.parametrize(("prefill_backend", "decode_backend"), [("torch", "numpy"), ("torch", "torch"),
                                                                  ("numpy", "torch")])
async def test_scattered_pages_staged_between_backends_byte_exact(
    engine: str, prefill_backend: str, decode_backend: str, torch_copies: dict[str, int]
) -> None:
    bufs = make_buffers(GEOMETRY["buffers"], GEOMETRY["pages"], GEOMETRY["item_len"], seed=501)
    kv = [torch.from_numpy(b) for b in bufs]  # the same memory: ``bufs`` shows what the tensors hold
    cfg = TransferConfig(engine=engine, staging="always", staging_bytes=1 << 20, staging_backend=prefill_backend)
    async with staged_decode(engine, decode_backend) as decode, KVManager(
        KVArgs(kv, page_size=16, dtype="uint8"), cfg
    ) as mgr:
        assert mgr.describe()["staging_backend"] == prefill_backend
        rng = np.random.default_rng(502)
        for room in (1, 2):
            dst, src = scattered(rng, 150), scattered(rng, 150)
            tx = mgr.sender(room)
            await decode.call("receiver", room=room, peer=mgr.endpoint, pages=dst)
            await tx.wait_ready(timeout=10)
            await tx.send_kv(src[:61], last=False)
            await tx.send_kv(src[61:])
            await tx.done(timeout=20)
            assert (await decode.call("done", room=room))["status"] == "Success"
            assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
        stats = mgr.stats()
        assert stats["staged_pieces"] > 0 and stats["kv_entries_sent"] == stats["staged_pieces"]
        assert stats["staging_bytes_in_use"] == 0
        received = (await decode.call("stats"))["stats"]
        assert received["staged_pieces_received"] == stats["staged_pieces"]
        assert (torch_copies["gather"] > 0) == (prefill_backend == "torch")


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
async def test_tp_head_slices_through_torch_staging_byte_exact(
    engine: str, p_tp: int, d_tp: int, torch_copies: dict[str, int]
) -> None:
    """TP 2 -> 1: each prefill rank gathers its whole pages, the decode scatters them into its half of
    the heads; TP 1 -> 2: the prefill gathers a head slice per decode rank. Torch on both sides."""
    g = global_kv(seed=40 + p_tp)
    per_rank = [
        KVArgs([torch.from_numpy(b) for b in shard(g, r, p_tp)], page_size=PS, dtype="uint8", tp_size=p_tp,
               tp_rank=r, kv_heads=H // p_tp, total_kv_heads=H)
        for r in range(p_tp)
    ]
    rng = np.random.default_rng(p_tp * 3 + d_tp)
    async with prefill_ranks(per_rank, engine, staging="always", staging_backend="torch") as prefill, decode_ranks(
        engine, d_tp, buffers=2 * LAYERS, pages=PAGES, item_len=PS * (H // d_tp) * HB, page_size=PS,
        kv_heads=H // d_tp, total_kv_heads=H, staging_backend="torch",
    ) as decode:
        src = [int(x) for x in rng.permutation(PAGES)[:12]]
        dst = [int(x) for x in rng.permutation(PAGES)[:12]]
        await run_room(prefill, decode, 1, src, dst)
        for d, peer in enumerate(decode):
            got = (await peer.call("digest", pages=dst))["digest"]
            assert got == expected_digest(shard(g, d, d_tp), src), f"decode rank {d}"
        assert sum(m.stats().get("staged_pieces", 0) for m in prefill) > 0
        assert torch_copies["gather"] > 0
