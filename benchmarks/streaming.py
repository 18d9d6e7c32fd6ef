"""``python -m benchmarks streaming``: how much of the KV transfer layer streaming hides.

A Llama-8B-shaped request (32 layers, 8 KV heads of 128, bf16: 2 KiB per token per K or V buffer, pages of
16 tokens) of 1k and 4k tokens. The prefill (this process) runs a simulated forward pass, a fixed compute
time per layer (:data:`COMPUTE_S_PER_TOKEN_LAYER` per token), and moves the request's KV either after the
pass (``send_kv``) or layer by layer from the pass's hooks (``tx.stream`` + ``send_layers``). The decode is
a child process. Measured, alternating the two modes: the exposed transfer time (the end of the last
layer's compute -> the room's Success), against one layer's share of the whole transfer (the exposed time
of the after-compute mode / 32), and the event loop's CPU time per ``send_layers`` call (polling the
engine until the layer is written included). Bytes are checked
on the decode after every room.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from aiotransfer import KVArgs, KVManager, TransferConfig
from aiotransfer._cli.channel import Child, open_parent_channel
from aiotransfer._cli.files import write_json

from . import options

__all__ = ["run_streaming"]

LAYERS, PAGE_TOKENS, PAGE_BYTES = 32, 16, 16 * 2048  # Llama-8B: K or V of one layer, one page, bf16
COMPUTE_S_PER_TOKEN_LAYER = 2e-6
"""Simulated prefill compute: 2 us per token per layer (a 1k-token prompt: 2 ms a layer, 66 ms in all)."""


def _config(engine: str) -> TransferConfig:
    return TransferConfig(engine="nixl" if engine == "nixl_shm" else engine)


def _args(pages: int, fill: bool) -> tuple[KVArgs, list[np.ndarray]]:
    bufs = [np.full((pages, PAGE_BYTES), (b * 7 + 1) % 251 if fill else 0, dtype=np.uint8) for b in range(2 * LAYERS)]
    return KVArgs(bufs, page_size=PAGE_TOKENS, dtype="bfloat16", num_layers=LAYERS), bufs


async def _decode(ns: argparse.Namespace) -> int:
    """Child: receives each room it is told of into pages in reverse order, and checks the bytes."""
    channel = await open_parent_channel()
    args, bufs = _args(ns.pages, fill=False)
    async with KVManager(args, _config(ns.engine)) as mgr:
        await channel.send({"event": "ready", "endpoint": mgr.endpoint})

        async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
            n = int(cmd["pages"])
            dst = list(range(n))[::-1]
            for b in bufs:
                b[dst] = 0
            rx = mgr.receiver(int(cmd["room"]), cmd["peer"])
            await rx.send_metadata(dst, timeout=30)
            await rx.done(timeout=60)
            ok = all(bool((b[dst] == (i * 7 + 1) % 251).all()) for i, b in enumerate(bufs))
            return {"bytes_ok": ok}

        await channel.serve(handle, idle_timeout=300)
    return 0


async def _room(mgr: KVManager, child: Child, room: int, tokens: int, streamed: bool) -> dict[str, float]:
    pages = tokens // PAGE_TOKENS
    tx = mgr.sender(room)
    await child.channel.send({"cmd": "open", "room": room, "pages": pages, "peer": mgr.endpoint})
    await tx.wait_ready(timeout=30)
    layer_s = COMPUTE_S_PER_TOKEN_LAYER * tokens
    stream = tx.stream(list(range(pages))) if streamed else None
    sends = []
    cpu0 = time.thread_time()
    for layer in range(LAYERS):
        await asyncio.sleep(layer_s)  # the layer's compute (on a GPU it runs asynchronously to the loop)
        if stream is not None:
            sends.append(asyncio.ensure_future(stream.send_layers(layer)))
    computed = time.monotonic()
    if stream is None:
        await tx.send_kv(list(range(pages)))
    else:
        await asyncio.gather(*sends)
    await tx.done(timeout=60)
    exposed = time.monotonic() - computed
    cpu = time.thread_time() - cpu0
    reply = await child.expect("ok", 60)
    if not reply.get("bytes_ok"):
        raise RuntimeError(f"room {room}: the decode's bytes differ")
    return {"exposed_ms": exposed * 1e3, "loop_cpu_us_per_call": cpu * 1e6 / LAYERS if streamed else float("nan")}


async def _per_call(mgr: KVManager, child: Child, room: int, queued: bool) -> float:
    """Loop CPU per ``send_layers`` call for small layers (one 16-token page: 64 KiB a layer): 8 chunks of a
    room, each chunk's 32 layers sent together (``queued``: hooks that queued up, in flight at once) or one
    after the other (each awaited before the next), the engine's completions included."""
    chunks = 8
    tx = mgr.sender(room)
    await child.channel.send({"cmd": "open", "room": room, "pages": chunks, "peer": mgr.endpoint})
    await tx.wait_ready(timeout=30)
    cpu0 = time.thread_time()
    for chunk in range(chunks):
        stream = tx.stream([chunk], last=chunk == chunks - 1)
        if queued:
            await asyncio.gather(*(stream.send_layers(layer) for layer in range(LAYERS)))
        else:
            for layer in range(LAYERS):
                await stream.send_layers(layer)
    cpu = time.thread_time() - cpu0
    await tx.done(timeout=60)
    reply = await child.expect("ok", 60)
    if not reply.get("bytes_ok"):
        raise RuntimeError(f"room {room}: the decode's bytes differ")
    return cpu * 1e6 / (chunks * LAYERS)


async def _engine(engine: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    pages = max(sizes) // PAGE_TOKENS
    child = await Child.spawn("benchmarks.streaming", ["--engine", engine, "--pages", str(pages)])
    out: dict[str, Any] = {"engine": engine, "sizes": {}}
    try:
        ready = await child.expect("ready", 60)
        args, _ = _args(pages, fill=True)
        async with KVManager(args, _config(engine)) as mgr:
            room = 1
            for tokens in sizes:
                await _room(mgr, child, room, tokens, streamed=False)  # warm-up: connection, first touch
                room += 1
                runs: dict[str, list[dict[str, float]]] = {"after": [], "streamed": []}
                for _ in range(repeats):
                    for mode in ("after", "streamed"):
                        runs[mode].append(await _room(mgr, child, room, tokens, streamed=mode == "streamed"))
                        room += 1
                after = statistics.median(r["exposed_ms"] for r in runs["after"])
                streamed = statistics.median(r["exposed_ms"] for r in runs["streamed"])
                out["sizes"][tokens] = {
                    "bytes": tokens // PAGE_TOKENS * PAGE_BYTES * 2 * LAYERS,
                    "layer_compute_ms": COMPUTE_S_PER_TOKEN_LAYER * tokens * 1e3,
                    "exposed_after_compute_ms": after, "exposed_streamed_ms": streamed,
                    "one_layer_ms": after / LAYERS, "streamed_over_one_layer": streamed / (after / LAYERS),
                    "streamed_over_after": streamed / after,
                    "loop_cpu_us_per_call": statistics.median(r["loop_cpu_us_per_call"] for r in runs["streamed"]),
                }
            calls: dict[str, list[float]] = {"queued": [], "alone": []}
            await _per_call(mgr, child, room, queued=True)  # warm-up
            room += 1
            for _ in range(repeats):
                for mode in ("queued", "alone"):
                    calls[mode].append(await _per_call(mgr, child, room, queued=mode == "queued"))
                    room += 1
            out["call_cpu_us"] = {mode: statistics.median(v) for mode, v in calls.items()}
        out["endpoint"] = ready["endpoint"]
    finally:
        await child.close()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "streaming", quick="1,024 tokens only, 2 repeats")
    options.engines(p, "mooncake_tcp,nixl_shm")


def run_streaming(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m benchmarks streaming``."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    engines = (ns.engines or "mooncake_tcp,nixl_shm").split(",")
    sizes = [1024] if ns.quick else [1024, 4096]
    repeats = 2 if ns.quick else 5
    results = []
    print(f"streaming: Llama-8B-shaped KV ({LAYERS} layers, 2 KiB per token per buffer),")
    print(f"  simulated compute {COMPUTE_S_PER_TOKEN_LAYER * 1e6:.0f} us per token per layer, medians of {repeats}")
    for engine in engines:
        res = asyncio.run(_engine(engine, sizes, repeats))
        results.append(res)
        for tokens, r in res["sizes"].items():
            print(f"{engine}, {tokens} tokens ({r['bytes'] >> 20} MiB):")
            print(f"  exposed transfer after compute {r['exposed_after_compute_ms']:.1f} ms, streamed "
                  f"{r['exposed_streamed_ms']:.1f} ms ({r['streamed_over_after']:.2f} of it)")
            print(f"  streamed = {r['streamed_over_one_layer']:.1f} x one layer's {r['one_layer_ms']:.2f} ms; "
                  f"loop CPU per send_layers {r['loop_cpu_us_per_call']:.0f} us")
        c = res["call_cpu_us"]
        print(f"{engine}, small layers (64 KiB): loop CPU per send_layers call")
        print(f"  {c['queued']:.0f} us when a chunk's layers queue up together, {c['alone']:.0f} us one at a time")
    write_json(ns.out or options.default_out("streaming"), results, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="decode")
    p.add_argument("--engine", default="mooncake_tcp")
    p.add_argument("--pages", type=int, default=256)
    return asyncio.run(_decode(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
