"""aiotransfer's ``sglang-mooncake`` wire profile against unmodified SGLang 0.5.23, both directions.

* SGLang prefill -> aiotransfer decode: our ``KVReceiver`` resolves SGLang's bootstrap HTTP topology,
  registers with SGLang's register frames and pulls KV (and aux, by Mooncake write or AUX_DATA frames).
* aiotransfer prefill -> SGLang decode: our leader serves SGLang's bootstrap HTTP API, parses SGLang's
  register and metadata frames, and our ``KVSender`` writes KV and aux and reports status frames.

Plus TP 2 -> 1 in both directions, malformed and version-skewed input, and the per-room latency and
throughput of SGLang<->SGLang against SGLang<->aiotransfer on the same geometry, in one run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from aiotransfer import IncompatiblePeer, KVArgs, KVManager, KVPoll, TransferConfig
from aiotransfer._topology import held_heads
from tests.interop import (
    BASELINE_AUX,
    BASELINE_GEOMETRY,
    ROOT,
    SGLANG_VERSION,
    SGLangRemote,
    free_port,
    interop_venv_problem,
    start_sglang_peer,
)
from tests.peer import digest

_problem = interop_venv_problem()
pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(_problem is not None, reason=_problem or ""),
    pytest.mark.timeout(300),
]

SMALL: dict[str, Any] = {"layers": 2, "pages": 256, "page_size": 16, "heads": 2, "head_dim": 64,
                         "dtype_bytes": 2, "aux": "64,64,256", "aux_slots": 16}
ROOM_BASE = 2**62


def _buffers(geom: dict[str, Any], tp_size: int = 1, seed: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """KV buffers laid out as SGLang's MHA pool ([K_0..K_{L-1}, V_0..V_{L-1}], NHD pages) and aux buffers.

    Written at allocation (``np.full``), like a serving stack's pool: untouched ``np.zeros`` pages would
    page-fault during the first transfer and skew the timings."""
    heads = geom["heads"] // tp_size
    item_len = geom["page_size"] * heads * geom["head_dim"] * geom["dtype_bytes"]
    rng = np.random.default_rng(seed)
    kv = [rng.integers(0, 256, size=(geom["pages"], item_len), dtype=np.uint8) if seed is not None
          else np.full((geom["pages"], item_len), 0, np.uint8) for _ in range(2 * geom["layers"])]
    aux = [rng.integers(0, 256, size=(geom["aux_slots"], int(n)), dtype=np.uint8) if seed is not None
           else np.full((geom["aux_slots"], int(n)), 0, np.uint8) for n in str(geom["aux"]).split(",")]
    return kv, aux


def _args(geom: dict[str, Any], kv: list[np.ndarray], aux: list[np.ndarray], tp_size: int = 1,
          tp_rank: int = 0) -> KVArgs:
    return KVArgs(kv, page_size=geom["page_size"], dtype="auto", aux_buffers=aux, tp_size=tp_size, tp_rank=tp_rank,
                  kv_heads=geom["heads"] // tp_size, total_kv_heads=geom["heads"])


def _config(**kw: Any) -> TransferConfig:
    return TransferConfig(engine="mooncake_tcp", wire="sglang-mooncake", handshake_timeout=20.0, **kw)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _head_digest(kv: list[np.ndarray], geom: dict[str, Any], heads: int, pages: list[int], start: int,
                 count: int) -> str:
    import hashlib

    h = hashlib.sha256()
    idx = np.asarray(pages, dtype=np.int64)
    hb = geom["head_dim"] * geom["dtype_bytes"]
    for buf in kv:
        view = buf.reshape(buf.shape[0], geom["page_size"], heads, hb)
        h.update(np.ascontiguousarray(view[idx, :, start:start + count, :]).tobytes())
    return h.hexdigest()


# -- SGLang prefill -> aiotransfer decode ------------------------------------------------------------


@pytest_asyncio.fixture(params=["aux-engine", "aux-tcp"])
async def sglang_prefill(request: pytest.FixtureRequest) -> AsyncIterator[SGLangRemote]:
    env = {"SGLANG_MOONCAKE_SEND_AUX_TCP": "1"} if request.param == "aux-tcp" else {}
    peer = await start_sglang_peer("prefill", free_port(), seed=11, env=env, **SMALL)
    try:
        yield peer
    finally:
        await peer.close()


async def test_sglang_prefill_feeds_aiotransfer_decode(sglang_prefill: SGLangRemote) -> None:
    kv, aux = _buffers(SMALL)
    rng = random.Random(3)
    specs = [(5, 2), (12, None), (1, None), (20, 7)]
    src_pool, dst_pool = rng.sample(range(SMALL["pages"]), 40), rng.sample(range(SMALL["pages"]), 40)
    rooms: list[dict[str, Any]] = []
    at = 0
    for i, (n, chunk) in enumerate(specs):
        rooms.append({"room": ROOM_BASE + 10 + i, "src": src_pool[at:at + n], "dst": dst_pool[at:at + n],
                      "chunk": chunk, "src_aux": i, "dst_aux": 8 + i})
        at += n
    async with KVManager(_args(SMALL, kv, aux), _config()) as dec:
        await sglang_prefill.call("senders", rooms=[{"room": r["room"], "num_pages": len(r["dst"]),
                                                     "aux_index": r["src_aux"]} for r in rooms])
        receivers = {r["room"]: dec.receiver(r["room"], sglang_prefill.endpoint) for r in rooms}
        for r in rooms:
            await receivers[r["room"]].send_metadata(r["dst"], aux_index=r["dst_aux"])
            assert receivers[r["room"]].poll() is KVPoll.WaitingForInput
        ready = await sglang_prefill.call("wait_status", rooms=[r["room"] for r in rooms])
        assert set(ready["status"].values()) == {"WaitingForInput"}, ready
        await sglang_prefill.call("send", rooms=[{"room": r["room"], "pages": r["src"], "chunk": r["chunk"]}
                                                 for r in rooms])
        await asyncio.gather(*(rx.done(timeout=30) for rx in receivers.values()))
        for r in rooms:
            want = (await sglang_prefill.call("digest", pages=r["src"]))["digest"]
            assert digest(kv, r["dst"]) == want, f"KV differs for room {r['room']}"
            want = (await sglang_prefill.call("aux_digest", slots=[r["src_aux"]]))["digest"]
            assert digest(aux, [r["dst_aux"]]) == want, f"aux differs for room {r['room']}"
        stats = dec.stats()
        assert stats["rooms_received_success"] == len(rooms)


# -- aiotransfer prefill -> SGLang decode ------------------------------------------------------------


@pytest.mark.parametrize("aux_path", ["engine", "tcp"])
async def test_aiotransfer_prefill_feeds_sglang_decode(aux_path: str) -> None:
    kv, aux = _buffers(SMALL, seed=21)
    port = free_port()
    cfg = _config(sglang_bootstrap_port=port, aux_path=aux_path)
    async with KVManager(_args(SMALL, kv, aux), cfg) as pre:
        decode = await start_sglang_peer("decode", free_port(), **SMALL)
        try:
            bootstrap = f"127.0.0.1:{port}"
            rng = random.Random(4)
            src_pool, dst_pool = rng.sample(range(SMALL["pages"]), 30), rng.sample(range(SMALL["pages"]), 30)
            rooms: list[dict[str, Any]] = [{"room": ROOM_BASE + 40 + i, "src": src_pool[i * 10:(i + 1) * 10],
                      "dst": dst_pool[i * 10:(i + 1) * 10], "src_aux": i, "dst_aux": 5 + i} for i in range(3)]
            senders = {r["room"]: pre.sender(r["room"]) for r in rooms}
            reply = await decode.call("receivers", bootstrap_addr=bootstrap, rooms=[r["room"] for r in rooms])
            assert set(reply["status"].values()) == {"WaitingForInput"}, reply
            await decode.call("metadata", rooms=[{"room": r["room"], "pages": r["dst"], "aux_index": r["dst_aux"]}
                                                 for r in rooms])
            for r in rooms:
                tx = senders[r["room"]]
                await tx.wait_ready(timeout=20)
                await tx.send_kv(r["src"][:4], last=False)
                await tx.send_kv(r["src"][4:])
                assert tx.poll() is KVPoll.Transferring  # Success waits for the aux SGLang declared
                await tx.send_aux(r["src_aux"])
                assert tx.aux_path == aux_path
                await tx.done(timeout=20)
            done = await decode.call("wait_done", rooms=[r["room"] for r in rooms], timeout=30)
            assert set(done["status"].values()) == {"Success"}, done
            for r in rooms:
                assert (await decode.call("digest", pages=r["dst"]))["digest"] == digest(kv, r["src"])
                assert (await decode.call("aux_digest", slots=[r["dst_aux"]]))["digest"] == digest(aux, [r["src_aux"]])
        finally:
            await decode.close()


# -- TP mismatch ----------------------------------------------------------------------------------------


async def test_sglang_prefill_tp2_to_aiotransfer_decode_tp1() -> None:
    geom: dict[str, Any] = {**SMALL, "heads": 4}
    port = free_port()
    p0 = await start_sglang_peer("prefill", port, seed=31, aux_seed=99, tp_size=2, tp_rank=0, **geom)
    p1 = None
    try:
        p1 = await start_sglang_peer("prefill", port, seed=32, aux_seed=99, tp_size=2, tp_rank=1,
                                     no_bootstrap_server=True, **geom)
        kv, aux = _buffers(geom)
        async with KVManager(_args(geom, kv, aux), _config()) as dec:
            room, src, dst = ROOM_BASE + 70, [3, 9, 10, 11], [100, 5, 6, 200]
            for p in (p0, p1):
                await p.call("senders", rooms=[{"room": room, "num_pages": len(dst), "aux_index": 2}])
            rx = dec.receiver(room, p0.endpoint)
            await rx.send_metadata(dst, aux_index=7)
            for p in (p0, p1):
                await p.call("wait_status", rooms=[room])
                await p.call("send", rooms=[{"room": room, "pages": src, "chunk": 2}])
            await rx.done(timeout=30)
            for rank, p in enumerate((p0, p1)):
                want = (await p.call("head_digest", pages=src, head_start=0, num_heads=2))["digest"]
                assert _head_digest(kv, geom, 4, dst, 2 * rank, 2) == want, f"heads of prefill rank {rank}"
    finally:
        await p0.close()
        if p1 is not None:
            await p1.close()


async def test_aiotransfer_prefill_tp2_to_sglang_decode_tp1() -> None:
    geom: dict[str, Any] = {**SMALL, "heads": 4}
    full_kv, aux = _buffers(geom, seed=41)
    hb = geom["head_dim"] * geom["dtype_bytes"]

    def shard(rank: int) -> list[np.ndarray]:
        start, count = held_heads(rank, 2, 4)
        return [np.ascontiguousarray(b.reshape(geom["pages"], geom["page_size"], 4, hb)[:, :, start:start + count, :])
                .reshape(geom["pages"], -1) for b in full_kv]

    port = free_port()
    room, src, dst = ROOM_BASE + 80, [1, 2, 40, 41, 42], [9, 8, 7, 6, 5]
    async with KVManager(_args(geom, shard(0), aux, 2, 0), _config(sglang_bootstrap_port=port)) as r0, \
            KVManager(_args(geom, shard(1), [a.copy() for a in aux], 2, 1),
                      _config(bootstrap=f"127.0.0.1:{port}")) as r1:
        decode = await start_sglang_peer("decode", free_port(), **geom)
        try:
            senders = [r0.sender(room), r1.sender(room)]
            reply = await decode.call("receivers", bootstrap_addr=f"127.0.0.1:{port}", rooms=[room])
            assert reply["mapping"]["target_tp_ranks"] == [0, 1]
            await decode.call("metadata", rooms=[{"room": room, "pages": dst, "aux_index": 3}])
            for tx in senders:
                await tx.wait_ready(timeout=20)
                await tx.send_kv(src)
                await tx.send_aux(0)
                await tx.done(timeout=20)
            done = await decode.call("wait_done", rooms=[room], timeout=30)
            assert done["status"][str(room)] == "Success", done
            assert (await decode.call("digest", pages=dst))["digest"] == digest(full_kv, src)
        finally:
            await decode.close()


# -- malformed and version-skewed input ------------------------------------------------------------


async def test_malformed_sglang_frames_are_dropped_and_counted() -> None:
    kv, aux = _buffers(SMALL, seed=5)
    async with KVManager(_args(SMALL, kv, aux), _config(sglang_bootstrap_port=free_port())) as pre:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(pre.endpoint)
        bad = [
            [b"None", b"127.0.0.1", b"1"],  # a register message cut short (kills SGLang's own thread)
            [b"None", b"127.0.0.1", b"x", b"s:1"] + [b""] * 8,  # non-integer port
            [b"1", b"127.0.0.1", b"5", b"never-registered:1", b"\x00\x00\x00\x00", b"0", b"", b"1"],
            [b"AUX_DATA", b"1"],
            [b"7", b"9", b"0"],  # status 9
            [b"\xff\xfe"],
        ]
        for frames in bad:
            await sock.send_multipart(frames)
        sock.close()
        ctx.term()
        for _ in range(200):
            if sum(pre.stats()["control_dropped"].values()) >= len(bad):
                break
            await asyncio.sleep(0.02)
        assert sum(pre.stats()["control_dropped"].values()) == len(bad), pre.stats()["control_dropped"]
        assert pre.stats()["decode_peers"] == 0


async def test_version_skewed_topology_is_a_clear_error() -> None:
    from aiohttp import web

    async def route(request: Any) -> Any:  # a bootstrap server from some other SGLang version
        return web.json_response({"tp_size": 1, "page_size": 16})

    app = web.Application()
    app.router.add_get("/route", route)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        kv, aux = _buffers(SMALL)
        async with KVManager(_args(SMALL, kv, aux), _config()) as dec:
            rx = dec.receiver(1, f"127.0.0.1:{port}")
            t0 = time.monotonic()
            with pytest.raises(IncompatiblePeer, match=r"topology lacks \['attn_tp_size'"):
                await rx.send_metadata([1, 2], timeout=10)
            assert time.monotonic() - t0 < 2.0
    finally:
        await runner.cleanup()


# -- latency and throughput: SGLang<->SGLang against SGLang<->aiotransfer ----------------------------------


@pytest.mark.timeout(900)
async def test_latency_throughput_against_sglang_pair(capsys: pytest.CaptureFixture[str]) -> None:
    """Same geometry, one run: SGLang prefill -> SGLang decode, then SGLang prefill -> aiotransfer decode."""
    g = BASELINE_GEOMETRY
    pages_per_req = g["tokens"] // g["page_size"]
    n = g["requests"]
    geom: dict[str, Any] = {k: g[k] for k in ("layers", "page_size", "heads", "head_dim", "dtype_bytes")}
    geom.update(pages=n * pages_per_req, aux=BASELINE_AUX, aux_slots=2 * n)
    item_len = g["page_size"] * g["heads"] * g["head_dim"] * g["dtype_bytes"]
    room_bytes = pages_per_req * 2 * g["layers"] * item_len

    def specs(first: int) -> list[dict[str, Any]]:
        return [{"room": first + i, "src": list(range(i * pages_per_req, (i + 1) * pages_per_req)),
                 "dst": list(range((n - 1 - i) * pages_per_req, (n - i) * pages_per_req)),
                 "src_aux": i, "dst_aux": n + i} for i in range(n)]

    port = free_port()
    prefill = await start_sglang_peer("prefill", port, seed=3, **geom)
    results: dict[str, Any] = {}
    try:
        # SGLang decode
        sg = await start_sglang_peer("decode", free_port(), **geom)
        try:
            lat = []
            for r in specs(ROOM_BASE + 100_000)[:16]:
                await prefill.call("senders", rooms=[{"room": r["room"], "num_pages": pages_per_req,
                                                      "aux_index": r["src_aux"]}])
                await sg.call("receivers", bootstrap_addr=prefill.endpoint, rooms=[r["room"]])
                await sg.call("metadata", rooms=[{"room": r["room"], "pages": r["dst"], "aux_index": r["dst_aux"]}])
                await prefill.call("wait_status", rooms=[r["room"]])
                sent = await prefill.call("send", rooms=[{"room": r["room"], "pages": r["src"]}])
                done = await sg.call("wait_done", rooms=[r["room"]])
                lat.append(done["t_done"][str(r["room"])] - sent["t_send"][str(r["room"])])
            conc = specs(ROOM_BASE + 200_000)
            await prefill.call("senders", rooms=[{"room": r["room"], "num_pages": pages_per_req,
                                                  "aux_index": r["src_aux"]} for r in conc])
            await sg.call("receivers", bootstrap_addr=prefill.endpoint, rooms=[r["room"] for r in conc])
            await sg.call("metadata", rooms=[{"room": r["room"], "pages": r["dst"], "aux_index": r["dst_aux"]}
                                             for r in conc])
            await prefill.call("wait_status", rooms=[r["room"] for r in conc])
            sent = await prefill.call("send", rooms=[{"room": r["room"], "pages": r["src"]} for r in conc])
            done = await sg.call("wait_done", rooms=[r["room"] for r in conc], timeout=120, call_timeout=150)
            span = max(done["t_done"].values()) - min(sent["t_send"].values())
            results["sglang->sglang"] = {"room_latency_ms_p50": statistics.median(lat) * 1e3,
                                         "room_latency_ms_max": max(lat) * 1e3,
                                         "throughput_gib_s": room_bytes * n / span / 2**30}
        finally:
            await sg.close()

        # aiotransfer decode (this process)
        kv, aux = _buffers(geom)
        async with KVManager(_args(geom, kv, aux), _config()) as dec:
            lat = []
            for r in specs(ROOM_BASE + 300_000)[:16]:
                await prefill.call("senders", rooms=[{"room": r["room"], "num_pages": pages_per_req,
                                                      "aux_index": r["src_aux"]}])
                rx = dec.receiver(r["room"], prefill.endpoint)
                await rx.send_metadata(r["dst"], aux_index=r["dst_aux"])
                await prefill.call("wait_status", rooms=[r["room"]])
                sent = await prefill.call("send", rooms=[{"room": r["room"], "pages": r["src"]}])
                await rx.done(timeout=30)
                lat.append(time.monotonic() - sent["t_send"][str(r["room"])])
            conc = specs(ROOM_BASE + 400_000)
            await prefill.call("senders", rooms=[{"room": r["room"], "num_pages": pages_per_req,
                                                  "aux_index": r["src_aux"]} for r in conc])
            rxs = [dec.receiver(r["room"], prefill.endpoint) for r in conc]
            for rx, r in zip(rxs, conc, strict=True):
                await rx.send_metadata(r["dst"], aux_index=r["dst_aux"])
            await prefill.call("wait_status", rooms=[r["room"] for r in conc])
            sent = await prefill.call("send", rooms=[{"room": r["room"], "pages": r["src"]} for r in conc])
            await asyncio.gather(*(rx.done(timeout=120) for rx in rxs))
            span = time.monotonic() - min(sent["t_send"].values())
            results["sglang->aiotransfer"] = {"room_latency_ms_p50": statistics.median(lat) * 1e3,
                                              "room_latency_ms_max": max(lat) * 1e3,
                                              "throughput_gib_s": room_bytes * n / span / 2**30}
            for r in conc[:4]:
                assert digest(kv, r["dst"]) == (await prefill.call("digest", pages=r["src"]))["digest"]
    finally:
        await prefill.close()
    results["geometry"] = {**g, "room_bytes": room_bytes}
    os.makedirs(os.path.join(ROOT, "bench-results"), exist_ok=True)
    out = os.path.join(ROOT, "bench-results", "interop-profile.json")
    await asyncio.to_thread(_write_json, out, results)
    with capsys.disabled():
        print(f"\n[interop] SGLang {SGLANG_VERSION} prefill, {room_bytes / 2**20:.0f} MiB rooms, Mooncake TCP loopback")
        for pair in ("sglang->sglang", "sglang->aiotransfer"):
            r = results[pair]
            print(f"  {pair:22s} room latency p50 {r['room_latency_ms_p50']:.1f} ms (max {r['room_latency_ms_max']:.1f}),"
                  f" {n} rooms at once {r['throughput_gib_s']:.2f} GiB/s")
