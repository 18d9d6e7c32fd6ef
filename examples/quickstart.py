"""The smallest prefill -> decode KV-cache transfer: two processes, Mooncake TransferEngine over TCP.

This process is the prefill. Once its manager is up it starts the decode process, giving it the prefill's
address; decode declares where the pages must land, prefill sends them in two chunks, and decode checks
the bytes. Run it::

    MC_LOG_LEVEL=ERROR python examples/quickstart.py
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys

import numpy as np

from aiotransfer import KVArgs, KVManager, TransferConfig

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's own log level (read when its engine loads)

BUFFERS, PAGES, PAGE_BYTES = 4, 128, 4096  # e.g. K and V of 2 layers, 128 pages of 4 KiB each
ROOM = 42  # one request; both sides use the same room id
SRC = [10, 11, 12, 13, 70, 71]  # prefill pages holding the prompt's KV
DST = [3, 4, 5, 6, 100, 9]  # decode pages it must land in
CONFIG = TransferConfig(engine="mooncake_tcp")  # Mooncake, TCP transport (no RDMA needed)


def prefill_cache() -> list[np.ndarray]:
    """The prefill's KV buffers: one (pages, page_bytes) array per buffer, filled by the "model"."""
    return [np.random.default_rng(b).integers(0, 256, (PAGES, PAGE_BYTES), dtype=np.uint8) for b in range(BUFFERS)]


async def prefill() -> int:
    kv = prefill_cache()
    async with KVManager(KVArgs(kv, page_size=16, dtype="uint8"), CONFIG) as mgr:
        decode = multiprocessing.get_context("spawn").Process(target=decode_process, args=(mgr.endpoint,))
        decode.start()  # it gets our control address: the "bootstrap" endpoint

        # A room left without success (an error, a cancellation) is aborted on both sides, with the cause
        # as its reason; the block exits once the room's pages are safe to reuse.
        async with mgr.sender(room=ROOM) as tx:
            await tx.wait_ready(timeout=30)  # decode's page indices have arrived
            await tx.send_kv(SRC[:4], last=False)  # first chunk
            await tx.send_kv(SRC[4:])  # last chunk (last=True by default): returns once Success is sent
            # No tx.done() needed: nothing else (aux, state) was declared, so the last chunk concluded the room.
        await asyncio.to_thread(decode.join, 30)  # keep the manager up until decode is finished
        print(f"prefill: {tx!r}", flush=True)  # once decode has printed: the two share the terminal
    return decode.exitcode if decode.exitcode is not None else 1


async def decode(prefill_endpoint: str) -> bool:
    kv = [np.zeros((PAGES, PAGE_BYTES), dtype=np.uint8) for _ in range(BUFFERS)]
    async with KVManager(KVArgs(kv, page_size=16, dtype="uint8"), CONFIG) as mgr:
        async with mgr.receiver(room=ROOM, peer=prefill_endpoint) as rx:
            await rx.send_metadata(DST)  # where the KV must land
            await rx.done(timeout=30)  # raises TransferFailed(reason) or TransferTimeout
        print(f"decode:  {rx!r}", flush=True)
    expected = prefill_cache()
    return all(np.array_equal(kv[b][DST], expected[b][SRC]) for b in range(BUFFERS))


def decode_process(prefill_endpoint: str) -> None:
    ok = asyncio.run(decode(prefill_endpoint))
    print("decode:  bytes match" if ok else "decode:  BYTES DIFFER", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(asyncio.run(prefill()))
