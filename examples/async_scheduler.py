"""An async prefill scheduler: many requests, bounded concurrency, chunked sends, bytes verified on decode.

This process is the prefill. It spawns the decode as a second process (this same file with
``--role decode``) and tells it about each request with one JSON line on the child's stdin; the KV bytes
themselves travel through Mooncake TransferEngine (TCP over 127.0.0.1) via aiotransfer.

Per request (``--requests`` of them, at most ``--concurrency`` in flight):

1. prefill takes pages from its pool (scattered, like a real paged allocator) and "computes" the KV
   into them, chunk by chunk (chunked prefill);
2. decode takes pages from its own pool and declares them with ``rx.send_metadata(pages)``;
3. prefill ``send_kv``s each chunk as soon as it is computed (``last=False``), then the last one;
4. decode awaits ``rx.done()`` and checks every byte against the pattern both sides derive from the
   room id, then frees its pages.

Each side holds its room in ``async with``: a room left without success (an error, a cancellation) is
aborted on both sides with the cause as its reason, and the block exits once the room's pages are released,
so they go back to the pool right after it.

Run it::

    MC_LOG_LEVEL=ERROR python examples/async_scheduler.py --requests 32 --concurrency 8

Exits non-zero if any request failed or any byte differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np

from aiotransfer import AiotransferError, KVArgs, KVManager, TransferConfig

# Model geometry (a small Llama-like model): layer-first, one K and one V buffer per layer.
LAYERS, PAGE_TOKENS, KV_HEADS, HEAD_DIM = 8, 16, 2, 64
POOL_PAGES = 1024  # pages per buffer, on each side
MAX_PROMPT = 4096  # tokens
CHUNK_TOKENS = 512  # chunked prefill: tokens computed (and sent) per step

# Mooncake logs at INFO by default; it reads MC_LOG_LEVEL when its module first loads (children inherit it).
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
# Mooncake TransferEngine over TCP on loopback (engine="mooncake" would pick RDMA where present).
CONFIG = TransferConfig(engine="mooncake_tcp", hostname="127.0.0.1")
SCRIPT = os.path.abspath(__file__)
MARK = "@example "  # prefix of protocol lines on the child's stdout


WORDS = PAGE_TOKENS * KV_HEADS * HEAD_DIM  # uint16 words per page
_BASE = (np.arange(MAX_PROMPT // PAGE_TOKENS * WORDS, dtype=np.int64) * 31 % 65_521).astype(np.uint16).reshape(-1, WORDS)


def make_kv_pool() -> list[np.ndarray]:
    """``2 * LAYERS`` buffers of ``POOL_PAGES`` pages; a page is ``PAGE_TOKENS x KV_HEADS x HEAD_DIM`` fp16."""
    return [np.zeros((POOL_PAGES, PAGE_TOKENS, KV_HEADS, HEAD_DIM), dtype=np.float16) for _ in range(2 * LAYERS)]


def pattern(room: int, buffer: int, first: int, n: int) -> np.ndarray:
    """The bytes of pages ``first .. first+n`` of a request (as uint16 words): a function of the room only,
    so decode can check what arrived without any extra communication."""
    return np.asarray(_BASE[first : first + n] + np.uint16((room * 1_000_003 + buffer * 7_919) % 65_536))


class PagePool:
    """A paged-KV free list; ``alloc`` waits (asynchronously) when the pool is exhausted."""

    def __init__(self, pages: int, seed: int) -> None:
        self._free = list(range(pages))
        random.Random(seed).shuffle(self._free)  # scattered pages, as in a long-running server
        self._cond = asyncio.Condition()

    async def alloc(self, n: int) -> list[int]:
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._free) >= n)
            pages, self._free = self._free[:n], self._free[n:]
            return pages

    async def free(self, pages: list[int]) -> None:
        async with self._cond:
            self._free.extend(pages)
            self._cond.notify_all()


def emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(msg) + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------------
# decode process
# ----------------------------------------------------------------------------------------------------
async def decode_main() -> None:
    kv = make_kv_pool()
    pool = PagePool(POOL_PAGES, seed=2)
    async with KVManager(KVArgs(kv, page_size=PAGE_TOKENS, dtype="float16"), CONFIG) as mgr:

        async def receive(room: int, n_pages: int, peer: str) -> None:
            pages = await pool.alloc(n_pages)
            t0 = time.perf_counter()
            rx = mgr.receiver(room, peer)  # opened first: the pool needs to know about it after its block
            try:
                # Leaving the block exits once no prefill write of this room can land in its pages any more:
                # at once after Success; after a failure, once the prefill acknowledged its drain (or is gone).
                async with rx:
                    await rx.send_metadata(pages, timeout=10)
                    await rx.done(timeout=30)
                    bad = await asyncio.to_thread(check, kv, room, pages)  # off the event loop
                emit({"room": room, "ok": bad == 0, "bad_words": bad, "ms": (time.perf_counter() - t0) * 1e3})
            except AiotransferError as exc:  # TransferFailed (with the reason prefill gave), timeouts, ...
                emit({"room": room, "ok": False, "reason": f"{type(exc).__name__}: {exc}"})
            if rx.is_released():  # never proven safe (a peer that neither drains nor dies): they stay out
                await pool.free(pages)

        tasks: set[asyncio.Task[None]] = set()
        emit({"ready": True})
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            task = asyncio.create_task(receive(cmd["room"], cmd["pages"], cmd["peer"]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        emit({"stats": {k: v for k, v in mgr.stats().items() if isinstance(v, int)}})


# ----------------------------------------------------------------------------------------------------
# prefill process (the scheduler)
# ----------------------------------------------------------------------------------------------------
class DecodeProcess:
    """The decode child: JSON lines in on stdin, JSON lines out on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.results: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.stats: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls) -> DecodeProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, SCRIPT, "--role", "decode",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        self = cls(proc)
        await asyncio.wait_for(self._ready, 30)
        return self

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := (await self.proc.stdout.readline()).decode():
            if not line.startswith(MARK):
                sys.stderr.write(line)  # anything else the child printed
                continue
            msg = json.loads(line[len(MARK):])
            if "ready" in msg:
                self._ready.set_result(None)
            elif "stats" in msg:
                self.stats.set_result(msg["stats"])
            else:
                self.results.setdefault(msg["room"], asyncio.get_running_loop().create_future()).set_result(msg)
        waiting: list[asyncio.Future[Any]] = [self._ready, self.stats, *self.results.values()]
        for fut in waiting:
            if not fut.done():
                fut.set_exception(RuntimeError("decode process exited"))

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())

    def result(self, room: int) -> asyncio.Future[dict[str, Any]]:
        return self.results.setdefault(room, asyncio.get_running_loop().create_future())

    async def close(self) -> tuple[int, dict[str, Any]]:
        """Ask the child to finish; returns its exit code and its manager's final stats()."""
        try:
            self.send({"op": "exit"})
            stats = await asyncio.wait_for(self.stats, 30)
            return await asyncio.wait_for(self.proc.wait(), 30), stats
        except (asyncio.TimeoutError, ConnectionError, RuntimeError):
            self.proc.kill()
            return await self.proc.wait() or 1, {}


async def prefill_main(n_requests: int, concurrency: int, seed: int) -> int:
    kv = make_kv_pool()
    words = [buf.view(np.uint16).reshape(POOL_PAGES, -1) for buf in kv]
    pool = PagePool(POOL_PAGES, seed=1)
    rng = random.Random(seed)
    prompts = [rng.randint(100, MAX_PROMPT) for _ in range(n_requests)]  # prompt lengths in tokens
    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    failures: list[str] = []
    moved = 0

    async with KVManager(KVArgs(kv, page_size=PAGE_TOKENS, dtype="float16"), CONFIG) as mgr:
        decode = await DecodeProcess.start()

        async def serve(room: int, tokens: int) -> None:
            nonlocal moved
            n_pages = -(-tokens // PAGE_TOKENS)
            async with slots:  # bounded concurrency: at most `concurrency` requests in flight
                t0 = time.perf_counter()
                pages = await pool.alloc(n_pages)
                tx = mgr.sender(room)  # opened first: the pool needs to know about it after its block
                try:
                    # After a failure the engine may still be reading these pages: leaving the block waits
                    # until every engine handle of the room is terminal.
                    async with tx:
                        decode.send({"op": "request", "room": room, "pages": n_pages, "peer": mgr.endpoint})
                        await tx.wait_ready(timeout=10)  # decode's page indices have arrived
                        step = CHUNK_TOKENS // PAGE_TOKENS
                        for first in range(0, n_pages, step):
                            chunk = pages[first : first + step]
                            # "compute" this chunk's KV (off the event loop, like a real forward pass)
                            await asyncio.to_thread(fill, words, room, chunk, first)
                            await tx.send_kv(chunk, last=first + step >= n_pages)
                        await tx.done(timeout=30)
                    result = await asyncio.wait_for(decode.result(room), 30)
                    if not result["ok"]:
                        failures.append(f"room {room}: {result}")
                    latencies.append(time.perf_counter() - t0)
                    moved += n_pages * sum(b.item_len for b in mgr.args.kv)
                except AiotransferError as exc:  # TransferFailed (with .reason), TransferTimeout, ...
                    failures.append(f"room {room}: {type(exc).__name__}: {exc}")
                if tx.is_released():  # never proven safe: these pages stay out of the pool
                    await pool.free(pages)

        t_start = time.perf_counter()
        await asyncio.gather(*(serve(room, tokens) for room, tokens in enumerate(prompts)))
        elapsed = time.perf_counter() - t_start
        stats = mgr.stats()
        rc, decode_stats = await decode.close()

    lat = np.array(latencies) * 1e3
    print(f"{len(latencies)}/{n_requests} requests, {sum(prompts)} tokens, {moved / 2**20:.1f} MiB "
          f"in {elapsed:.2f} s ({moved / 2**30 / elapsed:.2f} GiB/s), concurrency {concurrency}")
    if lat.size:
        print(f"per-request latency: p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms")
    print(f"prefill: {stats['kv_entries_sent']} engine entries, {stats.get('staged_pieces', 0)} staged pieces, "
          f"{stats['rooms_sent_success']} rooms Success, {stats.get('rooms_sent_failed', 0)} Failed")
    print(f"decode:  {decode_stats.get('rooms_received_success', 0)} rooms Success, "
          f"{decode_stats.get('staged_pieces_received', 0)} staged pieces scattered into its pages")
    for f in failures:
        print("FAILED", f)
    ok = not failures and len(latencies) == n_requests and rc == 0
    print("decode verified every byte: OK" if ok else "FAILED")
    return 0 if ok else 1


def check(kv: list[np.ndarray], room: int, pages: list[int]) -> int:
    """Words of the request's pages that differ from the expected pattern (0 = byte-exact)."""
    idx = np.asarray(pages)
    return sum(
        int(np.count_nonzero(buf.view(np.uint16).reshape(POOL_PAGES, -1)[idx] != pattern(room, b, 0, len(pages))))
        for b, buf in enumerate(kv)
    )


def fill(words: list[np.ndarray], room: int, pages: list[int], first: int) -> None:
    idx = np.asarray(pages)
    for b, w in enumerate(words):
        w[idx] = pattern(room, b, first, len(pages))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    if ns.role == "decode":
        asyncio.run(decode_main())
        return 0
    return asyncio.run(prefill_main(ns.requests, ns.concurrency, ns.seed))


if __name__ == "__main__":
    sys.exit(main())
