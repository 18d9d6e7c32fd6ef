"""Prefill and decode that page their KV caches differently. Two processes, Mooncake TransferEngine over TCP.

The prefill keeps 16-token pages, token-major (NHD), one buffer per K or V of each layer. Two decodes
receive the same 70-token prompt (its last page part full on both sides):

* decode A: 64-token pages, same layout: the pages move as units of 16 tokens, no copy added;
* decode B: 64-token pages, head-major (HND): tokens are converted while staging.

Each decode rebuilds the prompt's tokens from its own pages and compares them with the prefill's. Run it::

    MC_LOG_LEVEL=ERROR python examples/different_pages.py
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys

import numpy as np

from aiotransfer import KVArgs, KVManager, TransferConfig

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's own log level (read when its engine loads)

LAYERS, HEADS, HEAD_DIM = 4, 8, 64  # fp16: 128 bytes per head
TOKENS = 70
CONFIG = TransferConfig(engine="mooncake_tcp")
DECODES = {"A": "NHD", "B": "HND"}


def prompt_kv() -> np.ndarray:
    """The prompt's KV as the prefill computed it: (K or V of each layer, token, head, head_dim)."""
    rng = np.random.default_rng(0)
    return rng.standard_normal((2 * LAYERS, TOKENS, HEADS, HEAD_DIM)).astype(np.float16)


def kv_args(kv: list[np.ndarray], page_size: int, head_order: str) -> KVArgs:
    return KVArgs(kv, page_size=page_size, dtype="float16", head_order=head_order, kv_heads=HEADS,
                  total_kv_heads=HEADS, num_layers=LAYERS)


async def prefill() -> int:
    page = 16
    kv = [np.zeros((32, page, HEADS, HEAD_DIM), dtype=np.float16) for _ in range(2 * LAYERS)]
    pages = [9, 2, 30, 17, 5]  # the prompt's pages, wherever the allocator put them
    for buf, tokens in zip(kv, prompt_kv(), strict=True):  # "the forward pass" writes the prompt's KV
        for i, p in enumerate(pages):
            part = tokens[i * page : (i + 1) * page]
            buf[p, : len(part)] = part
    async with KVManager(kv_args(kv, page, "NHD"), CONFIG) as mgr:
        ctx = multiprocessing.get_context("spawn")
        decodes = [ctx.Process(target=decode_process, args=(mgr.endpoint, room, name))
                   for room, name in enumerate(DECODES, start=1)]
        for d in decodes:
            d.start()
        for room in range(1, len(decodes) + 1):
            async with mgr.sender(room) as tx:
                await tx.wait_ready(timeout=30)
                await tx.send_kv(pages[: tx.num_pages])  # the decode declared 70 tokens: 5 of our pages
                await tx.done(timeout=30)
        print(f"prefill: sent {TOKENS} tokens from five 16-token pages to each decode "
              f"({mgr.stats().get('staged_pieces', 0)} staged pieces in all)")
        for d in decodes:
            await asyncio.to_thread(d.join, 60)
    return 0 if all(d.exitcode == 0 for d in decodes) else 1


async def decode(prefill_endpoint: str, room: int, name: str) -> bool:
    page, order = 64, DECODES[name]
    shape = (8, page, HEADS, HEAD_DIM) if order == "NHD" else (8, HEADS, page, HEAD_DIM)
    kv = [np.zeros(shape, dtype=np.float16) for _ in range(2 * LAYERS)]
    pages = [6, 1]  # 70 tokens: one full 64-token page and 6 tokens of the next
    async with KVManager(kv_args(kv, page, order), CONFIG) as mgr:
        async with mgr.receiver(room, prefill_endpoint) as rx:
            await rx.send_metadata(pages, num_tokens=TOKENS, timeout=30)
            await rx.done(timeout=30)
    tokens = [b[pages] if order == "NHD" else b[pages].transpose(0, 2, 1, 3) for b in kv]  # pages -> token rows
    got = np.stack([t.reshape(-1, HEADS, HEAD_DIM)[:TOKENS] for t in tokens])
    ok = bool(np.array_equal(got, prompt_kv()))
    print(f"decode {name}: 64-token {order} pages, {'tokens match' if ok else 'TOKENS DIFFER'}")
    return ok


def decode_process(prefill_endpoint: str, room: int, name: str) -> None:
    sys.exit(0 if asyncio.run(decode(prefill_endpoint, room, name)) else 1)


if __name__ == "__main__":
    sys.exit(asyncio.run(prefill()))
