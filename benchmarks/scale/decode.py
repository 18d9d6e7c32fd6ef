"""A process of the ``scale`` suite's fleet: many decode managers on one event loop, driven over JSON lines.

``python -m benchmarks.scale.decode --role decode --params JSON``. Each manager has one KV buffer of
:data:`~benchmarks.scale.common.DECODE_PAGES` pages of 4 KiB and no staging arena; every manager of the
process shares its one native Mooncake engine (the adapter's reference count). The lag probe is off
(``lag_probe_interval=0``): hundreds of managers on one loop would otherwise wake it 100 times a second
each, and what is measured is the prefill.

Commands (each answered ``ok`` once done; a ``churn`` also sends one ``room`` event per room it opens):

* ``grow``: start managers with the global ``indices`` given; with ``base``, each opens its room
  as soon as it is up (a restarted decode's first room);
* ``open``: every manager opens ``per_decode`` rooms (``send_metadata``; :func:`~.common.room_number`) and
  waits for them in the background;
* ``collect``: the outcome of the rooms of ``base`` (bytes checked);
* ``churn``: ``count`` short-lived managers, ``slots`` alive at once, each one room and gone;
* ``probe``: this process's CPU time, RSS, descriptors and threads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aiotransfer import AiotransferError, KVArgs, KVManager, TransferConfig
from aiotransfer._cli.channel import Channel, open_parent_channel

from .common import DECODE_PAGES, PAGE_BYTES, Params, page_value, process_probe, raise_fd_limit, room_number

__all__ = ["main"]


class _Decode:
    """One decode manager and its buffer."""

    def __init__(self, index: int, mgr: KVManager, buf: np.ndarray, up_at: float) -> None:
        self.index, self.mgr, self.buf, self.up_at = index, mgr, buf, up_at


class _Fleet:
    def __init__(self, chan: Channel, params: Params) -> None:
        self.chan = chan
        self.params = params
        self.decodes: list[_Decode] = []
        self.batches: dict[int, list[asyncio.Task[dict[str, Any]]]] = {}
        self._send_lock = asyncio.Lock()

    def config(self) -> TransferConfig:
        return TransferConfig(engine="mooncake_tcp", hostname=self.params.host, staging="never", staging_bytes=0,
                              lag_probe_interval=0, **self.params.decode_config)

    async def event(self, obj: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.chan.send(obj, timeout=60.0)

    async def _start(self, index: int, buf: np.ndarray | None = None) -> _Decode:
        buf = np.zeros((DECODE_PAGES, PAGE_BYTES), np.uint8) if buf is None else buf
        mgr = KVManager(KVArgs([buf], page_size=1, dtype="uint8"), self.config())
        await asyncio.wait_for(mgr.start(), 60.0)
        return _Decode(index, mgr, buf, time.perf_counter())

    async def _room(self, d: _Decode, room: int, timeout: float, posted: asyncio.Future[None] | None = None,
                    *, first_contact: bool = False) -> dict[str, Any]:
        """Open ``room`` on ``d`` and wait for it: its outcome, the time from the manager's start to done.
        ``first_contact``: ``send_metadata`` keeps its default bound (``handshake_timeout``), as a decode that
        registers for the first time would."""
        page = room % DECODE_PAGES
        d.buf[page] = 0
        rx = d.mgr.receiver(room, self.params.prefill)
        t0 = time.perf_counter()
        try:
            try:
                if first_contact:
                    await rx.send_metadata([page])
                else:
                    await rx.send_metadata([page], timeout=timeout)
            finally:
                if posted is not None and not posted.done():
                    posted.set_result(None)
            await rx.done(timeout=timeout)
            await rx.released(timeout=timeout)
        except AiotransferError as exc:
            return {"ok": False, "room": room, "error": f"{type(exc).__name__}: {exc}"[:240],
                    "s": time.perf_counter() - t0}
        t1 = time.perf_counter()
        if not (d.buf[page] == page_value(room)).all():
            return {"ok": False, "room": room, "error": f"room {room}: wrong bytes landed", "s": t1 - t0}
        return {"ok": True, "s": t1 - t0, "since_up_s": t1 - d.up_at}

    async def grow(self, cmd: dict[str, Any]) -> dict[str, Any]:
        base = cmd.get("base")
        new: list[_Decode] = []
        tasks: list[asyncio.Task[dict[str, Any]]] = []
        t0 = time.perf_counter()
        for i in cmd["indices"]:
            d = await self._start(i)
            new.append(d)
            if base is not None:
                tasks.append(asyncio.ensure_future(self._room(d, room_number(int(base), i), float(cmd["timeout"]))))
        self.decodes.extend(new)
        if base is not None:
            self.batches[int(base)] = tasks
        return {"started": len(new), "seconds": time.perf_counter() - t0}

    async def open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        base, timeout, k = int(cmd["base"]), float(cmd["timeout"]), int(cmd.get("per_decode", 1))
        loop = asyncio.get_running_loop()
        rooms = [(d, room_number(base, d.index, j)) for d in self.decodes for j in range(k)]
        posted = [loop.create_future() for _ in rooms]
        self.batches[base] = [asyncio.ensure_future(self._room(d, room, timeout, p))
                              for (d, room), p in zip(rooms, posted, strict=True)]
        await asyncio.wait_for(asyncio.gather(*posted), timeout + 5)
        return {"opened": len(posted)}

    async def collect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        tasks = self.batches.pop(int(cmd["base"]))
        res = await asyncio.wait_for(asyncio.gather(*tasks), float(cmd["timeout"]))
        return _outcome(res)

    async def churn(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``count`` decodes, each on a fresh manager (a new endpoint) over one of ``slots`` buffers."""
        rooms = iter(range(int(cmd["room0"]), int(cmd["room0"]) + int(cmd["count"])))
        timeout = float(cmd["timeout"])
        results: list[dict[str, Any]] = []
        endpoints: set[str] = set()

        async def slot() -> None:
            buf = np.zeros((DECODE_PAGES, PAGE_BYTES), np.uint8)
            for room in rooms:
                d = await self._start(room, buf)
                endpoints.add(d.mgr.endpoint)
                try:
                    loop = asyncio.get_running_loop()
                    posted: asyncio.Future[None] = loop.create_future()
                    task = asyncio.ensure_future(self._room(d, room, timeout, posted, first_contact=True))
                    await posted
                    if not task.done():
                        await self.event({"event": "room", "room": room})
                    results.append(await task)
                finally:
                    await d.mgr.aclose()

        await asyncio.wait_for(asyncio.gather(*(slot() for _ in range(int(cmd["slots"])))), float(cmd["budget"]))
        return {**_outcome(results), "endpoints": sorted(endpoints)}

    async def aclose(self) -> None:
        for tasks in self.batches.values():
            for t in tasks:
                t.cancel()
        for d in self.decodes:
            with contextlib.suppress(Exception):
                await d.mgr.aclose()


def _outcome(res: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in res if r["ok"]]
    errors = sorted({r["error"] for r in res if not r["ok"]})
    return {"rooms": len(res), "ok": len(ok), "failed": len(res) - len(ok), "errors": errors[:3],
            "failed_rooms": sorted(r["room"] for r in res if not r["ok"]),
            "room_s": [round(r["s"], 5) for r in ok],
            "since_up_s": [round(r["since_up_s"], 5) for r in ok]}


async def _serve(ns: argparse.Namespace) -> int:
    chan = await open_parent_channel()
    fleet = _Fleet(chan, Params.from_json(ns.params))
    handlers: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
        "grow": fleet.grow, "open": fleet.open, "collect": fleet.collect, "churn": fleet.churn, "probe": _probe}
    await fleet.event({"event": "ready", "pid": os.getpid()})
    try:
        for seq in itertools.count():
            cmd = await chan.recv(3600.0)
            if cmd is None:
                return 0
            try:
                reply = await handlers[cmd["cmd"]](cmd)
                reply.update(event="ok", cmd=cmd["cmd"], seq=seq)
            except Exception as exc:
                reply = {"event": "error", "cmd": cmd.get("cmd"), "message": f"{type(exc).__name__}: {exc}"}
            await fleet.event(reply)
    finally:
        await fleet.aclose()
    return 0


async def _probe(cmd: dict[str, Any]) -> dict[str, Any]:
    return process_probe()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale.decode")
    p.add_argument("--role", choices=("decode",), required=True)
    p.add_argument("--params", required=True)
    ns = p.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    raise_fd_limit()
    try:
        return asyncio.run(_serve(ns))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
