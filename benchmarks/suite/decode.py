"""The decode worker of the suite: a command server over JSON lines, driven by the prefill worker.

Each ``setup`` builds fresh decode managers over their own buffers (one flat buffer, or a TP group);
``arm`` posts receivers, ``collect`` waits for them, ``verify``/``poison`` check and reset the bytes."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from aiotransfer import KVArgs, KVManager, TransferConfig
from aiotransfer._cli.channel import open_parent_channel
from aiotransfer._cli.workload import I64, KVPool, count_bad_pages

from .ceilings import TcpSink
from .common import ENGINES, TIMEOUT, Params, aux_pattern, tp_bad_pages
from .floor import DecodeFloor

__all__ = ["decode_worker"]


@dataclass
class _DSetup:
    kind: str
    pools: list[KVPool]
    mgrs: list[Any]
    auxes: list[npt.NDArray[np.uint8]]
    geo: dict[str, Any]
    batches: dict[str, asyncio.Future[list[Any]]] = field(default_factory=dict)


async def decode_worker(ns: argparse.Namespace) -> int:
    chan = await open_parent_channel()
    spec = ENGINES[ns.engine_key]
    params = Params.from_json(ns.params)
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-decode")
    loop = asyncio.get_running_loop()
    setups: dict[str, _DSetup] = {}
    sink: list[TcpSink] = []
    floor = DecodeFloor(params.host)

    async def off(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wait_for(loop.run_in_executor(worker, fn, *args), TIMEOUT)

    async def close_setup(name: str) -> None:
        s = setups.pop(name, None)
        if s is None:
            return
        for m in s.mgrs:
            with contextlib.suppress(Exception):
                await m.aclose()
        for fut in s.batches.values():
            fut.cancel()
            with contextlib.suppress(BaseException):
                await fut

    async def setup(cmd: dict[str, Any]) -> dict[str, Any]:
        name = cmd["name"]
        await close_setup(name)
        cfg = TransferConfig(engine=spec.engine, hostname=params.host,
                             **{**params.manager_config(), **cmd.get("cfg", {})})
        pools: list[KVPool] = []
        auxes: list[npt.NDArray[np.uint8]] = []
        mgrs: list[Any] = []
        geo: dict[str, Any] = dict(cmd)
        try:
            if cmd["kind"] == "flat":
                pool = KVPool(int(cmd.get("nbuf", 1)), cmd["pages"], (cmd["page_bytes"] // 2,))
                await off(pool.prefault)
                aux = (np.zeros((cmd["aux_slots"], cmd["aux_bytes"]), dtype=np.uint8) if cmd.get("aux_slots")
                       else None)
                args = KVArgs(pool.buffers, page_size=1, dtype="uint16",
                              aux_buffers=[aux] if aux is not None else (), num_layers=int(cmd.get("num_layers", 0)))
                mgrs.append(await asyncio.wait_for(KVManager(args, cfg).start(), 60.0))
                pools.append(pool)
                if aux is not None:
                    auxes.append(aux)
            elif cmd["kind"] == "tp":
                ranks, heads = cmd["ranks"], cmd["heads"] // cmd["ranks"]
                for d in range(ranks):
                    pool = KVPool(2 * cmd["layers"], cmd["pages"], (cmd["rows"], heads, cmd["head_dim"]),
                                  layer_ids=[b % cmd["layers"] for b in range(2 * cmd["layers"])])
                    await off(pool.prefault)
                    args = KVArgs(pool.buffers, page_size=cmd["rows"], dtype="uint16", kv_layer_ids=pool.layer_ids,
                                  tp_size=ranks, tp_rank=d, kv_heads=heads, total_kv_heads=cmd["heads"])
                    mgrs.append(await asyncio.wait_for(KVManager(args, cfg).start(), 60.0))
                    pools.append(pool)
            else:
                raise ValueError(f"unknown setup kind {cmd['kind']!r}")
        except BaseException:
            for m in mgrs:
                with contextlib.suppress(Exception):
                    await m.aclose()
            raise
        setups[name] = _DSetup(cmd["kind"], pools, mgrs, auxes, geo)
        return {
            "endpoints": [m.endpoint for m in mgrs],
            "sessions": [m.engine.session_id for m in mgrs],
            "bases": [p.bases for p in pools],
            "aux_bases": [int(a.ctypes.data) for a in auxes],
            "describe": mgrs[0].describe(),
        }

    async def arm(cmd: dict[str, Any]) -> dict[str, Any]:
        s = setups[cmd["name"]]
        rooms: list[int] = cmd["rooms"]
        dsts: list[list[int]] = cmd.get("dsts") or [cmd["dst"]] * len(rooms)
        auxs: list[int | None] = cmd.get("aux") or [None] * len(rooms)
        timeout = float(cmd.get("timeout", TIMEOUT))
        rxs = [m.receiver(room, cmd["peer"]) for m in s.mgrs for room in rooms]
        pairs = [(rx, np.asarray(dsts[i % len(rooms)], dtype=np.int64), auxs[i % len(rooms)])
                 for i, rx in enumerate(rxs)]
        await asyncio.gather(*(rx.send_metadata(d, aux_index=a, timeout=timeout) for rx, d, a in pairs))

        async def wait_one(rx: Any) -> list[Any]:
            try:
                await rx.done(timeout=timeout)
                return [time.monotonic(), None, rx.aux_path]
            except Exception as exc:
                return [time.monotonic(), f"{type(exc).__name__}: {exc}", None]

        s.batches[cmd["batch"]] = asyncio.ensure_future(asyncio.gather(*(wait_one(rx) for rx in rxs)))
        return {"armed": len(rxs)}

    async def collect(cmd: dict[str, Any]) -> dict[str, Any]:
        s = setups[cmd["name"]]
        fut = s.batches.pop(cmd["batch"])
        rows = await asyncio.wait_for(fut, float(cmd.get("timeout", TIMEOUT)))
        errors = [r[1] for r in rows if r[1]]
        return {"done_ts": [r[0] for r in rows], "aux_paths": [r[2] for r in rows], "failed": len(errors),
                "errors": errors[:5]}

    def verify_flat(s: _DSetup, tag: int, pages: I64, poison: bool) -> int:
        pool = s.pools[0]
        bad = count_bad_pages(pool, tag, pages)
        if poison:
            pool.poison(pages)
        return bad

    def verify_tp(s: _DSetup, tag: int, pages: I64, poison: bool) -> int:
        g = s.geo
        ranks = g["ranks"]
        hc = g["heads"] // ranks
        bad = 0
        for d, pool in enumerate(s.pools):
            bad += tp_bad_pages(pool, tag, pages, g["rows"], g["heads"], g["head_dim"] * 2 // 8, d * hc, hc)
            if poison:
                pool.poison(pages)
        return bad

    def verify_aux(s: _DSetup, rooms: list[int], slots: list[int]) -> int:
        aux = s.auxes[0]
        return sum(int(not np.array_equal(aux[slot], aux_pattern(room, aux.shape[1])))
                   for room, slot in zip(rooms, slots, strict=True))

    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "setup":
            return await setup(cmd)
        if op == "teardown":
            await close_setup(cmd["name"])
            return {}
        if op == "arm":
            return await arm(cmd)
        if op == "collect":
            return await collect(cmd)
        if op == "verify":
            s = setups[cmd["name"]]
            pages = np.asarray(cmd["pages"], dtype=np.int64)
            fn = verify_tp if s.kind == "tp" else verify_flat
            return {"bad": await off(fn, s, int(cmd["tag"]), pages, bool(cmd.get("poison", True)))}
        if op == "poison":
            s = setups[cmd["name"]]
            pages = np.asarray(cmd["pages"], dtype=np.int64)
            for pool in s.pools:
                await off(pool.poison, pages)
            return {}
        if op == "verify_aux":
            return {"bad": await off(verify_aux, setups[cmd["name"]], cmd["rooms"], cmd["slots"])}
        if op == "tcp_sink":
            t = TcpSink(params.host, int(cmd["bufsize"]))
            await off(t.buf.fill, 1)
            t.start()
            sink.append(t)
            return {"port": t.port}
        if op == "tcp_sink_stop":
            while sink:
                t = sink.pop()
                t.close()
                await off(t.join, 10.0)
            return {}
        if op == "clock":
            return {"t": time.monotonic()}
        if op.startswith("floor_"):
            return await floor.handle(cmd, lambda name: setups[name].mgrs[0])
        if op == "stats":
            s = setups[cmd["name"]]
            return {"stats": [{k: v for k, v in m.stats().items() if isinstance(v, int)} for m in s.mgrs]}
        raise ValueError(f"unknown command {op!r}")

    try:
        await chan.serve(handle, idle_timeout=7200.0, send_timeout=60.0, trace=True)
    finally:
        await floor.aclose()
        for name in list(setups):
            await close_setup(name)
        for t in sink:
            t.close()
        worker.shutdown(wait=False, cancel_futures=True)
    return 0
