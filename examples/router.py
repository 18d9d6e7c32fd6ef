"""A small prefill/decode router in asyncio + aiohttp, pairing one prefill and one decode worker process.

Three roles, all in this file:

* **prefill worker** (child process): owns a KVManager; ``POST /prefill {room, tokens}`` "computes" the
  prompt's KV into its pages and sends it with ``sender.send_kv`` once decode's pages are known.
* **decode worker** (child process): owns a KVManager; ``POST /decode {room, tokens, bootstrap}`` takes
  pages, declares them with ``receiver.send_metadata`` and awaits ``receiver.done()``, then checks the bytes.
* **router** (this process): ``POST /generate {tokens}`` assigns a room id and calls both workers at once,
  the way SGLang's router passes ``bootstrap_room`` / ``bootstrap_host``. A small client then sends
  requests to the router and reports per-request latency.

The router does not relay failures: if either side fails, aiotransfer tells the other one (``TransferFailed``
with the same reason), so each worker's answer already says what happened.

Run it::

    MC_LOG_LEVEL=ERROR python examples/router.py --requests 16 --concurrency 4

Needs ``aiohttp`` (``pip install aiohttp``; it is in aiotransfer's ``test`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import socket
import sys
import time
from typing import Any

import numpy as np

try:
    from aiohttp import ClientSession, ClientTimeout, web
except ImportError:  # pragma: no cover - explained to the user
    sys.exit("this example needs aiohttp: pip install aiohttp")

from aiotransfer import AiotransferError, KVArgs, KVManager, TransferConfig

LAYERS, PAGE_TOKENS, KV_HEADS, HEAD_DIM = 4, 16, 4, 64
POOL_PAGES = 512
CHUNK_PAGES = 16  # pages per send_kv call

# Mooncake logs at INFO by default; it reads MC_LOG_LEVEL when its module first loads (children inherit it).
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
CONFIG = TransferConfig(engine="mooncake_tcp", hostname="127.0.0.1")
SCRIPT = os.path.abspath(__file__)
MARK = "@example "


def kv_pool() -> list[np.ndarray]:
    return [np.zeros((POOL_PAGES, PAGE_TOKENS * KV_HEADS * HEAD_DIM), dtype=np.uint16) for _ in range(2 * LAYERS)]


def pattern(room: int, buffer: int, n_pages: int) -> np.ndarray:
    """What page ``i`` of buffer ``buffer`` of request ``room`` holds: derived from the room id alone."""
    words = PAGE_TOKENS * KV_HEADS * HEAD_DIM
    rng = np.random.default_rng([room, buffer])
    return rng.integers(0, 2**16, size=(n_pages, words), dtype=np.uint16)


def forward(kv: list[np.ndarray], room: int, pages: list[int]) -> None:
    idx = np.asarray(pages)
    for b, buf in enumerate(kv):
        buf[idx] = pattern(room, b, len(pages))


def check(kv: list[np.ndarray], room: int, pages: list[int]) -> bool:
    idx = np.asarray(pages)
    return all(np.array_equal(buf[idx], pattern(room, b, len(pages))) for b, buf in enumerate(kv))


class Pages:
    """A tiny paged-KV allocator (scattered pages, waits when exhausted)."""

    def __init__(self, seed: int) -> None:
        self.free = list(range(POOL_PAGES))
        random.Random(seed).shuffle(self.free)
        self.cond = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        async with self.cond:
            await self.cond.wait_for(lambda: len(self.free) >= n)
            out, self.free = self.free[:n], self.free[n:]
            return out

    async def give(self, pages: list[int]) -> None:
        async with self.cond:
            self.free += pages
            self.cond.notify_all()


def listen() -> socket.socket:
    """A listening socket on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def serve(app: web.Application, sock: socket.socket) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


def failure(exc: AiotransferError) -> web.Response:
    reason = getattr(exc, "reason", str(exc))
    return web.json_response({"ok": False, "error": type(exc).__name__, "reason": reason}, status=500)


# ----------------------------------------------------------------------------------------------------
# workers
# ----------------------------------------------------------------------------------------------------
async def prefill_worker() -> None:
    kv = kv_pool()
    pages = Pages(seed=1)
    async with KVManager(KVArgs(kv, page_size=PAGE_TOKENS, dtype="bfloat16"), CONFIG) as mgr:

        async def prefill(request: web.Request) -> web.Response:
            body = await request.json()
            room, n = body["room"], -(-body["tokens"] // PAGE_TOKENS)
            mine = await pages.take(n)
            t0 = time.perf_counter()
            tx = mgr.sender(room)  # decode may have spoken first: its request waits for us
            try:
                # Left without success, the room is aborted on both sides (the cause as its reason), and the
                # block exits once the engine is done with every write of the room (at once after Success).
                async with tx:
                    await asyncio.to_thread(forward, kv, room, mine)  # "prefill" writes the KV into our pages
                    await tx.wait_ready(timeout=10)
                    for first in range(0, n, CHUNK_PAGES):
                        await tx.send_kv(mine[first : first + CHUNK_PAGES], last=first + CHUNK_PAGES >= n)
                    await tx.done(timeout=10)
            except AiotransferError as exc:
                return failure(exc)
            finally:
                if tx.is_released():  # never proven safe, the pages stay out of the pool
                    await pages.give(mine)
            return web.json_response({"ok": True, "ms": (time.perf_counter() - t0) * 1e3})

        app = web.Application()
        app.router.add_post("/prefill", prefill)
        sock = listen()
        runner = await serve(app, sock)
        print(MARK + json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}", "bootstrap": mgr.endpoint}),
              flush=True)
        await wait_for_stdin_eof()
        await runner.cleanup()


async def decode_worker() -> None:
    kv = kv_pool()
    pages = Pages(seed=2)
    async with KVManager(KVArgs(kv, page_size=PAGE_TOKENS, dtype="bfloat16"), CONFIG) as mgr:

        async def decode(request: web.Request) -> web.Response:
            body = await request.json()
            room, n = body["room"], -(-body["tokens"] // PAGE_TOKENS)
            mine = await pages.take(n)
            t0 = time.perf_counter()
            rx = mgr.receiver(room, body["bootstrap"])
            try:
                # the block exits once no prefill write of the room can land: at once after Success; after a
                # failure once the prefill acknowledged its drain, or was proven gone
                async with rx:
                    await rx.send_metadata(mine, timeout=10)
                    await rx.done(timeout=10)
                    exact = await asyncio.to_thread(check, kv, room, mine)
            except AiotransferError as exc:
                return failure(exc)
            finally:
                if rx.is_released():  # never proven safe, the pages stay out of the pool
                    await pages.give(mine)
            return web.json_response({"ok": exact, "ms": (time.perf_counter() - t0) * 1e3,
                                      "reason": "" if exact else "bytes differ"})

        app = web.Application()
        app.router.add_post("/decode", decode)
        sock = listen()
        runner = await serve(app, sock)
        print(MARK + json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}"}), flush=True)
        await wait_for_stdin_eof()
        await runner.cleanup()


async def wait_for_stdin_eof() -> None:
    """Workers run until the router closes their stdin (or dies)."""
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()


async def spawn(role: str) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, SCRIPT, "--role", role, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        if not line:
            raise RuntimeError(f"{role} worker exited during start-up")
        if line.startswith(MARK):
            return proc, json.loads(line[len(MARK):])


# ----------------------------------------------------------------------------------------------------
# router and client
# ----------------------------------------------------------------------------------------------------
def router_app(http: ClientSession, prefill: dict[str, Any], decode: dict[str, Any]) -> web.Application:
    rooms = itertools.count(random.SystemRandom().randrange(2**40))  # unique per router instance

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        room = next(rooms)
        t0 = time.perf_counter()
        job = {"room": room, "tokens": body["tokens"]}
        p, d = await asyncio.gather(
            http.post(prefill["url"] + "/prefill", json=job),
            http.post(decode["url"] + "/decode", json={**job, "bootstrap": prefill["bootstrap"]}),
        )
        p_body, d_body = await p.json(), await d.json()
        ms = (time.perf_counter() - t0) * 1e3
        ok = p_body["ok"] and d_body["ok"]
        return web.json_response({"room": room, "ok": ok, "ms": ms, "prefill": p_body, "decode": d_body})

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


async def main(n_requests: int, concurrency: int) -> int:
    (p_proc, prefill), (d_proc, decode) = await asyncio.gather(spawn("prefill"), spawn("decode"))
    results: list[dict[str, Any]] = []
    try:
        async with ClientSession(timeout=ClientTimeout(total=60)) as http:
            sock = listen()
            runner = await serve(router_app(http, prefill, decode), sock)
            router = f"http://127.0.0.1:{sock.getsockname()[1]}"
            print(f"router {router} -> prefill {prefill['url']} (bootstrap {prefill['bootstrap']}), "
                  f"decode {decode['url']}")

            limit = asyncio.Semaphore(concurrency)
            rng = random.Random(0)

            async def client(tokens: int) -> None:
                async with limit, http.post(router + "/generate", json={"tokens": tokens}) as resp:
                    results.append({"tokens": tokens, **await resp.json()})

            t0 = time.perf_counter()
            await asyncio.gather(*(client(rng.randint(64, 2048)) for _ in range(n_requests)))
            elapsed = time.perf_counter() - t0
            await runner.cleanup()
    finally:
        for proc in (p_proc, d_proc):
            assert proc.stdin is not None
            proc.stdin.close()  # workers exit on stdin EOF
        codes = [await asyncio.wait_for(proc.wait(), 30) for proc in (p_proc, d_proc)]

    print(f"{'room':>15} {'tokens':>6} {'total ms':>9} {'prefill ms':>10} {'decode ms':>9}  result")
    for r in sorted(results, key=lambda r: r["room"]):
        status = "ok" if r["ok"] else f"FAILED: {r['prefill'].get('reason') or r['decode'].get('reason')}"
        print(f"{r['room']:>15} {r['tokens']:>6} {r['ms']:>9.1f} {r['prefill'].get('ms', 0):>10.1f} "
              f"{r['decode'].get('ms', 0):>9.1f}  {status}")
    lat = np.array([r["ms"] for r in results])
    good = sum(r["ok"] for r in results)
    print(f"{good}/{n_requests} requests ok in {elapsed:.2f} s; latency p50 {np.percentile(lat, 50):.1f} ms, "
          f"p99 {np.percentile(lat, 99):.1f} ms; workers exited with {codes}")
    return 0 if good == n_requests and codes == [0, 0] else 1


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["router", "prefill", "decode"], default="router")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    ns = parser.parse_args()
    if ns.role == "prefill":
        asyncio.run(prefill_worker())
        return 0
    if ns.role == "decode":
        asyncio.run(decode_worker())
        return 0
    return asyncio.run(main(ns.requests, ns.concurrency))


if __name__ == "__main__":
    sys.exit(cli())
