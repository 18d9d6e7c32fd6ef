"""aiotransfer's side of ``python -m benchmarks sglang``: one ``KVManager`` in its own process, driven with the
commands of :mod:`benchmarks.sglang.peer` (SGLang's side), so one orchestrator runs both stacks the
same way.

Usage: ``python -m benchmarks.sglang.aio_peer --role prefill|decode --layers 8 --page-size 1
--heads 1 --head-dim 128 --dtype-bytes 2 --pages N [--seed S] [--engine mooncake_tcp]``.

KV layout as SGLang's MHA pool: ``2 * layers`` buffers of ``(pages, item_len)`` bytes, ``item_len =
page_size * heads * head_dim * dtype_bytes``; the prefill's are filled from ``--seed``, the decode's written
with zeros at start-up (so no page faults during a timed room). Commands, one JSON object per line, answered
in order (the protocol of :class:`benchmarks.sglang.PeerProcess`):

* prefill: ``senders`` (``mgr.sender(room)`` per room), ``wait_status`` (``wait_ready`` of every room),
  ``send`` (for each room in order: the time, then ``send_kv(pages)`` started as a task; the reply comes once
  every task has begun), ``wait_done`` (every ``send_kv`` and ``done()`` returned);
* decode: ``receivers`` (``mgr.receiver(room, peer)``), ``metadata`` (``send_metadata(pages)`` room by room),
  ``wait_done`` (``done()`` of every room, each timed when it returns);
* both: ``digest`` (sha256 of the pages of every buffer, as the SGLang peer computes it), ``zero``, ``clear``.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from aiotransfer import KVArgs, KVManager, TransferConfig
from aiotransfer._cli.channel import Channel, open_parent_channel

__all__ = ["main"]


class AioPeer:
    def __init__(self, ns: argparse.Namespace, mgr: KVManager, kv: list[np.ndarray]) -> None:
        self.ns = ns
        self.mgr = mgr
        self.kv = kv
        self.senders: dict[int, Any] = {}
        self.receivers: dict[int, Any] = {}
        self.sends: dict[int, asyncio.Task[None]] = {}

    # --- prefill ---------------------------------------------------------------------------------------
    async def op_senders(self, rooms: list[dict[str, Any]]) -> dict[str, Any]:
        for spec in rooms:
            room = int(spec["room"])
            self.senders[room] = self.mgr.sender(room)
        return {}

    async def op_wait_status(
        self, rooms: list[int], at_least: str = "WaitingForInput", timeout: float = 30.0
    ) -> dict[str, Any]:
        await asyncio.gather(*(self.senders[r].wait_ready(timeout=timeout) for r in rooms))
        return {"status": {str(r): "WaitingForInput" for r in rooms}}

    async def op_send(self, rooms: list[dict[str, Any]]) -> dict[str, Any]:
        t_send: dict[str, float] = {}
        for spec in rooms:
            room = int(spec["room"])
            pages = np.asarray(spec["pages"], dtype=np.int64)
            t_send[str(room)] = time.monotonic()
            self.sends[room] = asyncio.ensure_future(self.senders[room].send_kv(pages))
        await asyncio.sleep(0)  # every send_kv has begun before the reply goes out
        return {"t_send": t_send, "chunks": {k: 1 for k in t_send}}

    # --- decode -----------------------------------------------------------------------------------------
    async def op_receivers(self, bootstrap_addr: str, rooms: list[int], **_: Any) -> dict[str, Any]:
        for room in rooms:
            self.receivers[room] = self.mgr.receiver(room, peer=bootstrap_addr)
        return {"status": {str(r): "WaitingForInput" for r in rooms}}

    async def op_metadata(self, rooms: list[dict[str, Any]]) -> dict[str, Any]:
        t_meta: dict[str, float] = {}
        for spec in rooms:
            room = int(spec["room"])
            t_meta[str(room)] = time.monotonic()
            await self.receivers[room].send_metadata(np.asarray(spec["pages"], dtype=np.int64))
        return {"t_meta": t_meta}

    # --- both -------------------------------------------------------------------------------------------
    async def op_wait_done(self, rooms: list[int], timeout: float = 60.0) -> dict[str, Any]:
        prefill = self.ns.role == "prefill"
        t_done: dict[str, float] = {}
        status: dict[str, str] = {}
        reasons: dict[str, str] = {}

        async def one(room: int) -> None:
            try:
                if prefill:
                    await asyncio.wait_for(self.sends.pop(room), timeout)
                    await self.senders[room].done(timeout=timeout)
                else:
                    await self.receivers[room].done(timeout=timeout)
                t_done[str(room)] = time.monotonic()
                status[str(room)] = "Success"
            except Exception as exc:
                status[str(room)] = "Failed"
                reasons[str(room)] = f"{type(exc).__name__}: {exc}"

        await asyncio.gather(*(one(r) for r in rooms))
        return {"status": status, "t_done": t_done, "reasons": reasons, "timed_out": []}

    async def op_clear(self, rooms: list[int]) -> dict[str, Any]:
        for r in rooms:
            self.senders.pop(r, None)
            self.receivers.pop(r, None)
            task = self.sends.pop(r, None)
            if task is not None:
                task.cancel()
        return {}

    async def op_digest(self, pages: list[int]) -> dict[str, Any]:
        return {"digest": digest(self.kv, pages)}  # between rooms: nothing is in flight

    async def op_zero(self, pages: list[int] | None = None) -> dict[str, Any]:
        idx = slice(None) if pages is None else np.asarray(pages, dtype=np.int64)
        for buf in self.kv:
            buf[idx] = 0
        return {}


def digest(bufs: Sequence[np.ndarray], rows: list[int]) -> str:
    """sha256 over ``buf[rows]`` of every buffer in order (as the SGLang peer's ``digest``)."""
    h = hashlib.sha256()
    idx = np.asarray(rows, dtype=np.int64)
    for buf in bufs:
        h.update(np.ascontiguousarray(buf[idx]).tobytes())
    return h.hexdigest()


def make_buffers(n: int, pages: int, item_len: int, seed: int | None) -> list[np.ndarray]:
    """``n`` buffers of ``(pages, item_len)`` bytes, each written once (random from ``seed``, else zeros)."""
    out = []
    for b in range(n):
        if seed is None:
            out.append(np.zeros((pages, item_len), dtype=np.uint8))
            out[-1].fill(0)  # touch every page now, not during a timed room
        else:
            rng = np.random.default_rng([seed, b])
            out.append(rng.integers(0, 256, size=(pages, item_len), dtype=np.uint8))
    return out


async def _serve(ns: argparse.Namespace, chan: Channel) -> None:
    def reply(msg: dict[str, Any]) -> Awaitable[None]:
        assert chan.writer is not None
        chan.writer.write((json.dumps(msg) + "\n").encode())
        return chan.writer.drain()

    item_len = ns.page_size * ns.heads * ns.head_dim * ns.dtype_bytes
    try:
        kv = make_buffers(2 * ns.layers, ns.pages, item_len, ns.seed)  # before any manager runs
        args = KVArgs(kv, page_size=ns.page_size, dtype="auto")
        mgr = await asyncio.wait_for(
            KVManager(args, TransferConfig(engine=ns.engine, hostname=ns.host)).start(), 60
        )
    except Exception as exc:
        await reply(
            {
                "id": 0,
                "ok": False,
                "error": type(exc).__name__,
                "reason": str(exc),
                "trace": traceback.format_exc(),
            }
        )
        return
    peer = AioPeer(ns, mgr, kv)
    try:
        await reply({"id": 0, "ok": True, "endpoint": mgr.endpoint, "role": ns.role, "item_len": item_len})
        while line := await chan.reader.readline():
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "exit":
                break
            rid = cmd.get("id")
            try:
                fn: Callable[..., Awaitable[dict[str, Any]]] = getattr(peer, "op_" + str(op))
                result = await fn(**{k: v for k, v in cmd.items() if k not in ("id", "op")})
                await reply({"id": rid, "ok": True, **result})
            except Exception as exc:
                await reply(
                    {
                        "id": rid,
                        "ok": False,
                        "error": type(exc).__name__,
                        "reason": str(exc),
                        "trace": traceback.format_exc(),
                    }
                )
    finally:
        await mgr.aclose()


async def _main(ns: argparse.Namespace) -> None:
    await _serve(ns, await open_parent_channel())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sglang.aio_peer",
        description="aiotransfer's side of python -m benchmarks sglang",
    )
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--engine", default="mooncake_tcp")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--pages", type=int, required=True)
    p.add_argument("--page-size", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--dtype-bytes", type=int, required=True)
    p.add_argument("--seed", type=int, default=None)
    ns = p.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        asyncio.run(_main(ns))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
