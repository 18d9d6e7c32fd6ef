"""What the phases share on the prefill worker: the client of the decode worker, one-buffer setups on
both sides, the raw thread, room numbers, progress lines, and the timed ``send_kv``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from aiotransfer import KVArgs, KVManager, TransferConfig
from aiotransfer._cli.channel import Channel, Child
from aiotransfer._cli.workload import U64, KVPool

from .common import ROOM0, TIMEOUT, EngineSpec, Params

__all__ = ["Ctx", "DecodeClient", "Flat", "addr", "attempt", "send"]


class DecodeClient:
    def __init__(self, child: Child) -> None:
        self.child = child

    async def call(self, op: str, timeout: float = TIMEOUT, **kw: Any) -> dict[str, Any]:
        await self.child.channel.send({"cmd": op, **kw}, timeout=60.0)
        msg = await self.child.channel.recv(timeout)
        if msg is None:
            raise RuntimeError(f"decode worker exited during {op!r}")
        if msg.get("event") == "error":
            raise RuntimeError(f"decode: {op}: {msg.get('message')}")
        return msg


@dataclass
class Flat:
    """Prefill side of a setup of flat pages (one or more managers; one buffer unless asked for more) and
    what the decode reported."""

    name: str
    pools: list[KVPool]
    mgrs: list[Any]
    auxes: list[npt.NDArray[np.uint8]]
    page_bytes: int
    pages: int
    session: str
    endpoint: str
    dst_base: int
    dst_bases: list[int] = field(default_factory=list)
    """The decode's base of every buffer (``dst_base`` is the first)."""

    @property
    def src_base(self) -> int:
        return self.pools[0].bases[0]


class Ctx:
    def __init__(self, spec: EngineSpec, params: Params, dec: DecodeClient, chan: Channel) -> None:
        self.spec = spec
        self.params = params
        self.dec = dec
        self.chan = chan
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-raw")
        self._rooms = itertools.count(ROOM0)
        self.results: dict[str, Any] = {}
        self.describe: dict[str, Any] | None = None

    def rooms(self, n: int) -> list[int]:
        return [next(self._rooms) for _ in range(n)]

    async def off(self, fn: Callable[..., Any], *args: Any, timeout: float = TIMEOUT) -> Any:
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self.thread, fn, *args), timeout)

    async def progress(self, message: str) -> None:
        await self.chan.send({"event": "progress", "message": f"[{self.spec.key}] {message}"})

    async def verify(self, name: str, tag: int, pages: Any, *, what: str, poison: bool = True) -> None:
        bad = (await self.dec.call("verify", name=name, tag=tag, pages=np.asarray(pages).tolist(),
                                   poison=poison))["bad"]
        if bad:
            raise RuntimeError(f"{what}: {bad} mismatched pages on the decode side")

    def config(self, **overrides: Any) -> Any:
        return TransferConfig(engine=self.spec.engine, hostname=self.params.host,
                              **{**self.params.manager_config(), **overrides})

    async def flat(self, name: str, *, pages: int, page_bytes: int, n: int = 1,
                   cfgs: Sequence[dict[str, Any]] | None = None, aux_slots: int = 0,
                   aux_bytes: int = 0, nbuf: int = 1, num_layers: int = 0) -> Flat:
        """``n`` managers over ``nbuf`` buffers of ``pages`` pages each (``num_layers``: buffer ``b`` holds layer
        ``b % num_layers``, for layer streaming), and one decode manager of the same shape."""
        pools: list[KVPool] = []
        mgrs: list[Any] = []
        auxes: list[npt.NDArray[np.uint8]] = []
        try:
            for i in range(n):
                pool = KVPool(nbuf, pages, (page_bytes // 2,))
                await self.off(pool.prefault)
                aux = np.zeros((aux_slots, aux_bytes), dtype=np.uint8) if aux_slots else None
                args = KVArgs(pool.buffers, page_size=1, dtype="uint16", aux_buffers=[aux] if aux is not None else (),
                              num_layers=num_layers)
                cfg = self.config(**(cfgs[i] if cfgs else {}))
                mgrs.append(await asyncio.wait_for(KVManager(args, cfg).start(), 60.0))
                pools.append(pool)
                if aux is not None:
                    auxes.append(aux)
            info = await self.dec.call("setup", name=name, kind="flat", pages=pages, page_bytes=page_bytes,
                                       aux_slots=aux_slots, aux_bytes=aux_bytes, nbuf=nbuf, num_layers=num_layers)
        except BaseException:
            for m in mgrs:
                with contextlib.suppress(Exception):
                    await m.aclose()
            raise
        if self.describe is None:
            self.describe = {"prefill": mgrs[0].describe(), "decode": info["describe"]}
        return Flat(name, pools, mgrs, auxes, page_bytes, pages, info["sessions"][0], info["endpoints"][0],
                    info["bases"][0][0], list(info["bases"][0]))

    async def close(self, f: Flat) -> None:
        for m in f.mgrs:
            with contextlib.suppress(Exception):
                await m.aclose()
        with contextlib.suppress(Exception):
            await self.dec.call("teardown", name=f.name)

    async def arm(self, name: str, batch: str, rooms: list[int], peer: str, *, dst: Any = None,
                  dsts: Sequence[Any] | None = None, aux: list[int] | None = None,
                  timeout: float | None = None) -> None:
        """The decode posts ``rooms`` (``send_metadata``) and waits for them in the background, each for at most
        ``timeout`` seconds (the decode's default when None); :meth:`collect` gathers the outcome."""
        kw: dict[str, Any] = {}
        if timeout is not None:
            kw["timeout"] = timeout
        if dsts is not None:
            kw["dsts"] = [np.asarray(d).tolist() for d in dsts]
        else:
            kw["dst"] = np.asarray(dst).tolist()
        if aux is not None:
            kw["aux"] = aux
        await self.dec.call("arm", name=name, batch=batch, rooms=rooms, peer=peer, **kw)

    async def collect(self, name: str, batch: str) -> dict[str, Any]:
        return await self.dec.call("collect", name=name, batch=batch)


async def attempt(aw: Awaitable[float]) -> tuple[float, str | None]:
    """``(result, None)`` or ``(nan, "Error: reason")``: failures are counted, not raised."""
    try:
        return await aw, None
    except Exception as exc:
        return float("nan"), f"{type(exc).__name__}: {exc}"


async def send(mgr: Any, room: int, src: Any, timeout: float = TIMEOUT) -> float:
    """Prefill-side time of ``await send_kv`` (decode already armed: ``wait_ready`` returns at once)."""
    tx = mgr.sender(room)
    await tx.wait_ready(timeout=timeout)
    t0 = time.perf_counter()
    await tx.send_kv(src, timeout=timeout)
    return time.perf_counter() - t0


def addr(base: int, pages: Any, page_bytes: int) -> U64:
    out: U64 = np.uint64(base) + np.asarray(pages, dtype=np.uint64) * np.uint64(page_bytes)
    return out
