"""Layer streaming: send each layer's KV as soon as the forward pass has written it, so the transfer hides
behind the compute of the following layers. Two processes, Mooncake TransferEngine over TCP.

The prefill "computes" a 16-layer model (a fixed time per layer, simulated) twice over the same 64 MiB
request: once sending the KV after the forward pass (``send_kv``), once streaming it layer by layer
(``tx.stream(pages)`` then ``stream.send_layers(layer)`` in the layer's forward hook). It prints the
exposed transfer time of each (from the end of the last layer's compute to the room's ``Success``),
and the event loop's CPU time per ``send_layers`` call. The decode checks every byte. Run it::

    MC_LOG_LEVEL=ERROR python examples/layer_streaming.py
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
import time

import numpy as np

from aiotransfer import KVArgs, KVManager, KVStream, TransferConfig

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's own log level (read when its engine loads)

LAYERS = 16  # buffers: K of every layer, then V of every layer (KVArgs num_layers says which is which)
PAGES, PAGE_BYTES, REQUEST_PAGES = 80, 32 << 10, 64  # 64 pages x 32 buffers x 32 KiB = 64 MiB per request
LAYER_COMPUTE_S = 0.004  # the forward pass of one layer over the prompt, simulated
ROOMS = {1: "after compute", 2: "streamed"}
CONFIG = TransferConfig(engine="mooncake_tcp")


def cache(fill: bool) -> list[np.ndarray]:
    if not fill:
        return [np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8) for _ in range(2 * LAYERS)]
    return [np.random.default_rng(b).integers(0, 256, (PAGES, PAGE_BYTES), dtype=np.uint8) for b in range(2 * LAYERS)]


def kv_args(kv: list[np.ndarray]) -> KVArgs:
    return KVArgs(kv, page_size=16, dtype="uint8", num_layers=LAYERS)


async def forward(on_layer_done: list[asyncio.Task[None]], stream: KVStream | None) -> float:
    """Run the layers; each layer's hook hands its KV to ``stream`` (if any). Returns when compute ends."""
    for layer in range(LAYERS):
        await asyncio.sleep(LAYER_COMPUTE_S)  # the layer's compute (on a GPU this runs asynchronously)
        if stream is not None:  # the forward hook: send what this layer just wrote, without waiting for it
            on_layer_done.append(asyncio.create_task(stream.send_layers(layer)))
    return time.monotonic()


async def prefill() -> int:
    kv = cache(fill=True)
    src = list(range(REQUEST_PAGES))
    async with KVManager(kv_args(kv), CONFIG) as mgr:
        decode = multiprocessing.get_context("spawn").Process(target=decode_process, args=(mgr.endpoint,))
        decode.start()
        for room, how in ROOMS.items():
            async with mgr.sender(room=room) as tx:
                await tx.wait_ready(timeout=30)
                sends: list[asyncio.Task[None]] = []
                if how == "streamed":
                    computed = await forward(sends, tx.stream(src))
                    await asyncio.gather(*sends)
                else:
                    computed = await forward(sends, None)
                    await tx.send_kv(src)
                await tx.done(timeout=30)
            exposed = (time.monotonic() - computed) * 1e3
            print(f"prefill: {how:>13}: exposed transfer {exposed:6.1f} ms after {LAYERS} layers of compute")
        cpu = await per_layer_cpu(mgr)
        print(f"prefill: loop CPU per send_layers call: {cpu:.0f} us")
        await asyncio.to_thread(decode.join, 60)
    return decode.exitcode if decode.exitcode is not None else 1


async def per_layer_cpu(mgr: KVManager) -> float:
    """The event loop thread's CPU time per ``send_layers`` call: 8 chunks of one page, each chunk's layers
    sent as a forward pass sends them (all in flight together), engine completions included."""
    async with mgr.sender(room=3) as tx:
        await tx.wait_ready(timeout=30)
        calls = 0
        t0 = time.thread_time()
        for chunk in range(8):
            stream = tx.stream([chunk], last=chunk == 7)
            await asyncio.gather(*(stream.send_layers(layer) for layer in range(LAYERS)))
            calls += LAYERS
        cpu = (time.thread_time() - t0) / calls
        await tx.done(timeout=30)
        return cpu * 1e6


async def decode(prefill_endpoint: str) -> bool:
    kv = cache(fill=False)
    expected = cache(fill=True)
    ok = True
    async with KVManager(kv_args(kv), CONFIG) as mgr:
        for room, dst in ((1, list(range(REQUEST_PAGES))), (2, list(range(REQUEST_PAGES))[::-1]),
                          (3, list(range(8)))):
            for b in kv:
                b[dst] = 0
            async with mgr.receiver(room=room, peer=prefill_endpoint) as rx:
                await rx.send_metadata(dst)
                await rx.done(timeout=30)
            src = list(range(len(dst)))
            ok = ok and all(np.array_equal(kv[b][dst], expected[b][src]) for b in range(2 * LAYERS))
    return ok


def decode_process(prefill_endpoint: str) -> None:
    ok = asyncio.run(decode(prefill_endpoint))
    print("decode:  bytes match" if ok else "decode:  BYTES DIFFER")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(asyncio.run(prefill()))
