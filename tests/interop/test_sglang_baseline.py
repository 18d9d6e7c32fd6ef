"""SGLang prefill -> SGLang decode, both unmodified SGLang 0.5.23 in their own processes (the baseline).

Proves the harness (aiotransfer/_cli/sglang/peer.py on .interop-venv) moves bytes correctly with SGLang's own
classes on both ends, and measures per-room latency and throughput on ``BASELINE_GEOMETRY``, so the same
numbers can later be taken with aiotransfer on one end. Skipped when .interop-venv is missing
(``bash scripts/interop-venv.sh`` builds it); run alone with ``pytest -m interop``.
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

import pytest
import pytest_asyncio

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

_problem = interop_venv_problem()
pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(_problem is not None, reason=_problem or ""),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
]

SMALL: dict[str, Any] = {"layers": 2, "pages": 256, "page_size": 16, "heads": 2, "head_dim": 64,
                         "dtype_bytes": 2, "aux": "64,64,256", "aux_slots": 16}
THROUGHPUT_ROUNDS = 3
ROOM_BASE = 2**62  # SGLang rooms are large random ints; ASCII decimal on the wire either way


class Pair:
    def __init__(self, prefill: SGLangRemote, decode: SGLangRemote) -> None:
        self.prefill = prefill
        self.decode = decode


async def close_all(*peers: SGLangRemote | None) -> None:
    for p in peers:
        if p is not None:
            await p.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["aux-engine", "aux-tcp"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    """One SGLang prefill (with the bootstrap server) and one SGLang decode, TP1 each.

    ``aux-tcp`` sets SGLANG_MOONCAKE_SEND_AUX_TCP=1 on the prefill, which then ships aux as AUX_DATA frames
    over its ZMQ socket instead of a Mooncake write.
    """
    port = free_port()
    env = {"SGLANG_MOONCAKE_SEND_AUX_TCP": "1"} if request.param == "aux-tcp" else {}
    prefill, decode = await asyncio.gather(
        start_sglang_peer("prefill", port, seed=11, env=env, **SMALL),
        start_sglang_peer("decode", port, **SMALL),
        return_exceptions=True,
    )
    peers = [p for p in (prefill, decode) if isinstance(p, SGLangRemote)]
    for p in (prefill, decode):
        if isinstance(p, BaseException):
            await close_all(*peers)
            raise p
    assert isinstance(prefill, SGLangRemote) and isinstance(decode, SGLangRemote)
    try:
        yield Pair(prefill, decode)
    finally:
        await close_all(prefill, decode)


async def run_rooms(prefill: SGLangRemote | list[SGLangRemote], decode: SGLangRemote,
                    rooms: list[dict[str, Any]], timeout: float = 60.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The SGLang PD sequence for ``rooms``; returns (decode wait_done reply, prefill send replies).

    Each room: ``{"room", "src": prefill pages, "dst": decode pages, "chunk", "src_aux", "dst_aux"}``.
    Prefill senders are created and init()ed, decode receivers are created, init()ed and send their
    metadata; once every prefill room is WaitingForInput, decode starts polling and prefill sends.
    """
    prefills = prefill if isinstance(prefill, list) else [prefill]
    ids = [r["room"] for r in rooms]
    for p in prefills:
        await p.call("senders", rooms=[{"room": r["room"], "num_pages": len(r["dst"]), "aux_index": r["src_aux"]}
                                       for r in rooms])
    reply = await decode.call("receivers", bootstrap_addr=prefills[0].endpoint, rooms=ids)
    assert set(reply["status"].values()) == {"WaitingForInput"}, reply
    await decode.call("metadata", rooms=[{"room": r["room"], "pages": r["dst"], "aux_index": r["dst_aux"]}
                                         for r in rooms])
    for p in prefills:
        ready = await p.call("wait_status", rooms=ids, at_least="WaitingForInput", timeout=timeout)
        assert set(ready["status"].values()) == {"WaitingForInput"}, ready
    done_task = asyncio.ensure_future(decode.call("wait_done", rooms=ids, timeout=timeout,
                                                  call_timeout=timeout + 30))
    await asyncio.sleep(0.05)  # let decode start polling before the first byte moves
    sent = [await p.call("send", rooms=[{"room": r["room"], "pages": r["src"], "chunk": r.get("chunk")}
                                        for r in rooms]) for p in prefills]
    for p in prefills:
        pdone = await p.call("wait_done", rooms=ids, timeout=timeout, call_timeout=timeout + 30)
        assert set(pdone["status"].values()) == {"Success"}, pdone
    ddone = await done_task
    assert set(ddone["status"].values()) == {"Success"}, ddone
    return ddone, sent


async def clear_rooms(peers: list[SGLangRemote], ids: list[int]) -> None:
    for p in peers:
        await p.call("clear", rooms=ids)


def make_rooms(rng: random.Random, specs: list[tuple[int, int | None]], pages: int,
               first_room: int) -> list[dict[str, Any]]:
    """Disjoint, shuffled page sets on each side; distinct aux slots (prefill slot != decode slot)."""
    total = sum(n for n, _ in specs)
    src_pool = rng.sample(range(pages), total)
    dst_pool = rng.sample(range(pages), total)
    rooms = []
    at = 0
    for i, (n, chunk) in enumerate(specs):
        rooms.append({"room": first_room + i, "src": src_pool[at:at + n], "dst": dst_pool[at:at + n],
                      "chunk": chunk, "src_aux": i, "dst_aux": len(specs) + i})
        at += n
    return rooms


# --- correctness -----------------------------------------------------------------------------------------


async def test_rooms_chunked_aux(pair: Pair) -> None:
    """Several rooms at once, chunked sends (1, 3, 10 pages per chunk and whole), a room with no KV pages
    at all (aux only), scattered pages on both sides; KV and aux bytes verify on the decode side."""
    rng = random.Random(5)
    specs: list[tuple[int, int | None]] = [(1, None), (7, 3), (16, 1), (32, 10), (0, None), (24, None)]
    rooms = make_rooms(rng, specs, SMALL["pages"], ROOM_BASE + 100)
    await pair.decode.call("zero")
    _, sent = await run_rooms(pair.prefill, pair.decode, rooms)
    assert sent[0]["chunks"] == {str(r["room"]): c for r, c in zip(rooms, [1, 3, 16, 4, 1, 1], strict=True)}
    for r in rooms:
        if r["src"]:
            want = (await pair.prefill.call("digest", pages=r["src"]))["digest"]
            got = (await pair.decode.call("digest", pages=r["dst"]))["digest"]
            assert got == want, f"KV bytes differ for room {r['room']}"
        want = (await pair.prefill.call("aux_digest", slots=[r["src_aux"]]))["digest"]
        got = (await pair.decode.call("aux_digest", slots=[r["dst_aux"]]))["digest"]
        assert got == want, f"aux bytes differ for room {r['room']}"
    await clear_rooms([pair.prefill, pair.decode], [r["room"] for r in rooms])


async def test_decode_abort_fails_both_sides(pair: Pair) -> None:
    """Decode aborts a bootstrapped room (ABORT frame): the prefill room turns Failed, the decode one too."""
    room = ROOM_BASE + 900
    await pair.prefill.call("senders", rooms=[{"room": room, "num_pages": 2, "aux_index": 0}])
    await pair.decode.call("receivers", bootstrap_addr=pair.prefill.endpoint, rooms=[room])
    await pair.decode.call("metadata", rooms=[{"room": room, "pages": [1, 2], "aux_index": 1}])
    await pair.prefill.call("wait_status", rooms=[room], at_least="WaitingForInput")
    await pair.decode.call("abort", room=room)
    d = await pair.decode.call("poll", rooms=[room])
    assert d["status"][str(room)] == "Failed"
    assert "Aborted" in d["reasons"][str(room)]
    p = await pair.prefill.call("wait_done", rooms=[room], timeout=10)
    assert p["status"][str(room)] == "Failed", p
    await clear_rooms([pair.prefill, pair.decode], [room])


async def test_prefill_tp2_to_decode_tp1() -> None:
    """Two SGLang prefill ranks (TP2, one bootstrap server) feed one SGLang decode (TP1): decode pulls from
    both ranks (required_prefill_response_num 2), each rank writes its half of the KV heads into every
    token slot (SGLang's head-sliced send_kvcache_slice path), and both ranks write the aux slot."""
    port = free_port()
    geom: dict[str, Any] = {**SMALL, "heads": 4}
    p0 = await start_sglang_peer("prefill", port, seed=21, aux_seed=99, tp_size=2, tp_rank=0, **geom)
    p1 = d = None
    try:
        p1, d = await asyncio.gather(
            start_sglang_peer("prefill", port, seed=22, aux_seed=99, tp_size=2, tp_rank=1,
                              no_bootstrap_server=True, **geom),
            start_sglang_peer("decode", port, tp_size=1, **geom),
        )
        reply = await d.call("receivers", bootstrap_addr=p0.endpoint, rooms=[])
        assert reply["mapping"] == {"prefill_attn_tp_size": 2, "target_tp_ranks": [0, 1],
                                    "required_dst_info_num": 1, "required_prefill_response_num": 2}
        rooms = make_rooms(random.Random(9), [(5, 2), (12, None), (3, 1)], geom["pages"], ROOM_BASE + 200)
        await run_rooms([p0, p1], d, rooms)
        for r in rooms:
            for rank, p in enumerate((p0, p1)):
                want = (await p.call("head_digest", pages=r["src"], head_start=0, num_heads=2))["digest"]
                got = (await d.call("head_digest", pages=r["dst"], head_start=2 * rank, num_heads=2))["digest"]
                assert got == want, f"heads of prefill rank {rank} differ for room {r['room']}"
            want = (await p0.call("aux_digest", slots=[r["src_aux"]]))["digest"]
            got = (await d.call("aux_digest", slots=[r["dst_aux"]]))["digest"]
            assert got == want
    finally:
        await close_all(p0, p1, d)


# --- baseline numbers ----------------------------------------------------------------------------------


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@pytest.mark.timeout(900)
async def test_baseline_latency_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang->SGLang on BASELINE_GEOMETRY: per-room latency (rooms one at a time) and throughput (all
    requests at once). Latency = decode's first Success poll minus prefill's send() call, both taken with
    CLOCK_MONOTONIC inside the peers (0.5 ms polling); KV and aux bytes verified for every room of the last
    concurrent round. Printed, and written to bench-results/interop-sglang-baseline.json."""
    g = BASELINE_GEOMETRY
    pages_per_req = g["tokens"] // g["page_size"]
    pool = g["requests"] * pages_per_req
    geom: dict[str, Any] = {k: g[k] for k in ("layers", "page_size", "heads", "head_dim", "dtype_bytes")}
    geom.update(pages=pool, aux=BASELINE_AUX, aux_slots=2 * g["requests"])
    item_len = g["page_size"] * g["heads"] * g["head_dim"] * g["dtype_bytes"]
    room_bytes = pages_per_req * 2 * g["layers"] * item_len
    port = free_port()
    prefill, decode = await asyncio.gather(start_sglang_peer("prefill", port, seed=3, **geom),
                                           start_sglang_peer("decode", port, **geom))
    try:
        def room_specs(first: int) -> list[dict[str, Any]]:
            # Contiguous pages per request, as a fresh SGLang pool hands them out; decode blocks in reverse
            # order so source and destination offsets differ.
            n = g["requests"]
            return [{"room": first + i, "src": list(range(i * pages_per_req, (i + 1) * pages_per_req)),
                     "dst": list(range((n - 1 - i) * pages_per_req, (n - i) * pages_per_req)),
                     "chunk": None, "src_aux": i, "dst_aux": n + i}
                    for i in range(n)]

        # 1. latency: one room in flight at a time.
        seq = room_specs(ROOM_BASE + 10_000)
        latencies = []
        for r in seq:
            ddone, sent = await run_rooms(prefill, decode, [r])
            key = str(r["room"])
            latencies.append(ddone["t_done"][key] - sent[0]["t_send"][key])
        await clear_rooms([prefill, decode], [r["room"] for r in seq])

        # 2. throughput: every request in flight at once, THROUGHPUT_ROUNDS times (the machine is shared
        # and small, so one round is noisy); decode pages zeroed before each round, bytes verified after
        # the last one.
        rounds = []
        for k in range(THROUGHPUT_ROUNDS):
            await decode.call("zero")
            conc = room_specs(ROOM_BASE + 20_000 + 1000 * k)
            ddone, sent = await run_rooms(prefill, decode, conc, timeout=300)
            t0 = min(sent[0]["t_send"].values())
            t1 = max(ddone["t_done"].values())
            lat = [ddone["t_done"][str(r["room"])] - sent[0]["t_send"][str(r["room"])] for r in conc]
            rounds.append({"seconds": t1 - t0, "throughput_gib_s": room_bytes * len(conc) / (t1 - t0) / 2**30,
                           "room_latency_ms_p50": statistics.median(lat) * 1e3,
                           "room_latency_ms_max": max(lat) * 1e3})
            await clear_rooms([prefill, decode], [r["room"] for r in conc])
        for r in conc:
            want = (await prefill.call("digest", pages=r["src"]))["digest"]
            got = (await decode.call("digest", pages=r["dst"]))["digest"]
            assert got == want, f"KV bytes differ for room {r['room']}"
        want = (await prefill.call("aux_digest", slots=[r["src_aux"] for r in conc]))["digest"]
        got = (await decode.call("aux_digest", slots=[r["dst_aux"] for r in conc]))["digest"]
        assert got == want
    finally:
        await close_all(prefill, decode)

    result: dict[str, Any] = {
        "pair": f"sglang-{SGLANG_VERSION} -> sglang-{SGLANG_VERSION}",
        "transport": "mooncake tcp, 127.0.0.1",
        "geometry": {**g, "item_len": item_len, "room_bytes": room_bytes, "aux": BASELINE_AUX},
        "latency_ms": {"p50": statistics.median(latencies) * 1e3, "p90": _pct(latencies, 0.9) * 1e3,
                       "min": min(latencies) * 1e3, "max": max(latencies) * 1e3, "rooms": len(latencies)},
        "concurrent": {"rooms": g["requests"], "bytes": room_bytes * g["requests"],
                       "throughput_gib_s_median": statistics.median(r["throughput_gib_s"] for r in rounds),
                       "throughput_gib_s_best": max(r["throughput_gib_s"] for r in rounds),
                       "rounds": rounds},
        "cpus": os.cpu_count(),
        "loadavg_1min_after": os.getloadavg()[0],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out_dir = os.path.join(ROOT, "bench-results")
    os.makedirs(out_dir, exist_ok=True)
    await asyncio.to_thread(_write_json, os.path.join(out_dir, "interop-sglang-baseline.json"), result)
    with capsys.disabled():
        lat = result["latency_ms"]
        c = result["concurrent"]
        print(f"\n[interop baseline] SGLang {SGLANG_VERSION} prefill -> SGLang decode, Mooncake TCP loopback, "
              f"{g['layers']} layers x {g['heads']} heads x {g['head_dim']} x {g['dtype_bytes']} B, page "
              f"{g['page_size']}, {g['requests']} x {g['tokens']} tokens ({room_bytes / 2**20:.0f} MiB/room)\n"
              f"  one room at a time: p50 {lat['p50']:.1f} ms, p90 {lat['p90']:.1f} ms, "
              f"min {lat['min']:.1f} ms, max {lat['max']:.1f} ms\n"
              f"  {c['rooms']} rooms at once ({c['bytes'] / 2**30:.2f} GiB), {len(rounds)} rounds: "
              f"median {c['throughput_gib_s_median']:.2f} GiB/s, best {c['throughput_gib_s_best']:.2f} GiB/s; "
              f"per round " + ", ".join(f"{r['throughput_gib_s']:.2f} GiB/s in {r['seconds']:.2f} s "
                                        f"(room p50 {r['room_latency_ms_p50']:.0f} ms)" for r in rounds) +
              f"\n  (load average {result['loadavg_1min_after']:.1f} on {os.cpu_count()} CPUs)")
