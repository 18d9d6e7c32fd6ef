"""``python -m benchmarks device``: KV in device memory, through aiotransfer and the raw engine.

Each side runs in its own process on the one device (the decode is a child process). Measured per engine:

* **rooms**: 64 MiB and 1 GiB rooms (two buffers, K and V, of contiguous 32 KiB pages) through
  aiotransfer (``send_kv`` + ``done``, the page indices given as a Python list, as vLLM passes them, and as
  a NumPy array, as SGLang does) against the raw engine writing the same two entries, alternating the
  three, medians; bytes are checked on the decode after the first room of each kind. Where aiotransfer's
  time goes is read from its trace marks (:mod:`aiotransfer._trace`): the prefill's stages, medians; and
  the prefill's event-loop lag during aiotransfer's timed rooms;
* **aux by path**: a one-page room with ``send_aux``: aux buffers on the device
  (``custom_mem_pool="INTRA_NODE_NVLINK"``, written by the engine) against host aux on the TCP path;
* **device copies** (once): the gather (``index_select``) and scatter (``index_copy_``) of 10,000 of
  12,288 scattered 4 KiB pages, the staging copies whose throughput the cost model's
  :data:`aiotransfer._staging.DEVICE_COPY_BW` stands for.

``--device cpu`` runs the same code on host tensors (how CI keeps this module working without a GPU);
the device-aux figure needs CUDA and is left out there.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from aiotransfer import KVArgs, KVManager, LoopLagMonitor, TransferConfig, _trace
from aiotransfer._cli.channel import Child, open_parent_channel
from aiotransfer._cli.files import write_json
from aiotransfer._cli.raw import raw_engine

from . import options

__all__ = ["run_device"]

PAGE_BYTES = 32 * 1024
"""One page of one buffer: 16 tokens x 8 KV heads x 128 x bf16."""
BUFFERS = 2
SIZES = {"64M": 64 << 20, "1G": 1 << 30}
QUICK_SIZES = {"4M": 4 << 20}
AUX_ITEM = 64
AUX_SLOTS = 16
STAGES = ("start", "planned", "call_start", "call_end", "submitted", "engine_done", "success_out", "end")
"""The prefill's marks along a room, in order: ``start`` and ``end`` around ``send_kv`` + ``done``, and
``call_start`` / ``call_end`` around the engine's ``submit_write`` (on the thread that makes it)."""


def _torch() -> Any:
    import torch

    return torch


def _config(engine: str, device: str, *, aux: str = "none", progress_delay_us: int = 0) -> TransferConfig:
    kw: dict[str, Any] = {"engine": "nixl" if engine == "nixl_shm" else engine, "staging": "never",
                          "nixl_progress_delay_us": progress_delay_us}
    if device.startswith("cuda"):
        kw["device_id"] = int(device.partition(":")[2] or 0)
    if aux == "device":
        kw["custom_mem_pool"] = "INTRA_NODE_NVLINK"
    elif aux == "host":
        kw["aux_path"] = "tcp"
    return TransferConfig(**kw)


class _Side:
    """One side's memory and its one manager at a time: ``kv`` (the rooms figure) or an aux mode (``host``,
    ``device``), so that no idle engine of another figure runs beside the one measured."""

    def __init__(self, engine: str, device: str, pages: int, fill: bool, progress_delay_us: int = 0) -> None:
        torch = _torch()
        self.device = device
        self.pages = pages
        self.slab = torch.zeros((BUFFERS, pages + 1, PAGE_BYTES), dtype=torch.uint8, device=device)
        if fill:
            gen = torch.Generator(device=device).manual_seed(1)
            self.slab.random_(0, 256, generator=gen)
        self.kv = [self.slab[b, :pages] for b in range(BUFFERS)]  # the spare page keeps regions apart
        self.small = torch.zeros((BUFFERS, 2, PAGE_BYTES), dtype=torch.uint8, device=device)
        self.modes = ["host"] + (["device"] if device.startswith("cuda") else [])
        self.aux: dict[str, Any] = {}
        for mode in self.modes:
            from aiotransfer._aux_state import alloc_metadata_buffer

            pool = "INTRA_NODE_NVLINK" if mode == "device" else None
            dev = int(device.partition(":")[2] or 0) if mode == "device" else None
            aux = alloc_metadata_buffer(AUX_SLOTS, (AUX_ITEM,), torch.uint8, pool=pool, device_id=dev)
            if fill:
                aux.copy_(torch.arange(AUX_SLOTS * AUX_ITEM, dtype=torch.int64).reshape(AUX_SLOTS, AUX_ITEM) % 251)
            self.aux[mode] = aux
        self.engine = engine
        self.progress_delay_us = progress_delay_us
        self.key = ""
        self.mgr: KVManager | None = None

    async def use(self, key: str) -> KVManager:
        """Close the manager in use and start the one for ``key``."""
        await self.close()
        if key == "kv":
            args = KVArgs(self.kv, page_size=16, dtype="uint8")
        else:
            args = KVArgs([self.small[b, :1] for b in range(BUFFERS)], page_size=16, dtype="uint8",
                          aux_buffers=[self.aux[key]])
        cfg = _config(self.engine, self.device, aux="none" if key == "kv" else key,
                      progress_delay_us=self.progress_delay_us)
        self.mgr = await KVManager(args, cfg).start()
        self.key = key
        return self.mgr

    async def close(self) -> None:
        if self.mgr is not None:
            mgr, self.mgr = self.mgr, None
            await mgr.aclose()

    def digest(self, n: int) -> str:
        h = hashlib.sha256()
        for b in self.kv:
            h.update(b[:n].cpu().numpy().tobytes())
        return h.hexdigest()


async def _decode(ns: argparse.Namespace) -> int:
    """Child: ``use`` starts the manager for a figure; one receiver per ``open`` command, into pages 0..n of
    its KV (and slot ``aux_index`` of aux)."""
    channel = await open_parent_channel()
    side = _Side(ns.engine, ns.device, ns.pages, fill=False, progress_delay_us=ns.nixl_progress_delay_us)
    try:
        await channel.send({"event": "ready"})

        async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
            if cmd["cmd"] == "use":
                mgr = await side.use(cmd["key"])
                return {"endpoint": mgr.endpoint, "session": mgr.engine.session_id,
                        "bases": [int(b.data_ptr()) for b in side.kv]}
            if cmd["cmd"] == "digest":
                return {"digest": side.digest(int(cmd["pages"]))}
            if cmd["cmd"] == "zero":
                side.slab.zero_()
                return {}
            if cmd["cmd"] == "aux":
                row = side.aux[cmd["mode"]][int(cmd["slot"])]
                return {"aux": row.cpu().numpy().tolist()}
            assert side.mgr is not None, "open before use"
            rx = side.mgr.receiver(int(cmd["room"]), cmd["peer"])
            slot = int(cmd["slot"]) if "slot" in cmd else None
            await rx.send_metadata(list(range(int(cmd["pages"]))), aux_index=slot, timeout=60)
            await rx.done(timeout=300)
            return {"aux_path": rx.aux_path}

        await channel.serve(handle, idle_timeout=600)
    finally:
        await side.close()
    return 0


class _Bench:
    def __init__(self, side: _Side, child: Child) -> None:
        self.side = side
        self.child = child
        self.peer: dict[str, Any] = {}
        self.room = 0
        self.stages: list[dict[str, int]] = []

    async def call(self, cmd: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        await self.child.channel.send(cmd)
        return await self.child.expect("ok", timeout)

    async def use(self, key: str) -> KVManager:
        """Both sides switch to the managers of ``key``. The engine's submissions are marked
        (``call_start``, ``call_end``, on the thread that makes them) in traced rooms."""
        self.peer = await self.call({"cmd": "use", "key": key}, timeout=120)
        mgr = await self.side.use(key)
        engine = mgr.engine
        submit = engine.submit_write

        def marked(peer: str, blocks: Any) -> Any:
            _trace.recorder is None or _trace.mark(self.room, "call_start")
            try:
                return submit(peer, blocks)
            finally:
                _trace.recorder is None or _trace.mark(self.room, "call_end")

        engine.submit_write = marked  # type: ignore[method-assign]
        return mgr

    async def aio_room(self, pages: int, aux_slot: int | None = None, as_array: bool = False,
                       trace: bool = False) -> float:
        self.room += 1
        m = self.side.mgr
        assert m is not None
        tx = m.sender(self.room)
        cmd: dict[str, Any] = {"cmd": "open", "room": self.room, "pages": pages, "peer": m.endpoint}
        if aux_slot is not None:
            cmd["slot"] = aux_slot
        await self.child.channel.send(cmd)
        await tx.wait_ready(timeout=60)
        indices = np.arange(pages) if as_array else list(range(pages))
        rec = _trace.start() if trace else None
        t0 = time.perf_counter()
        _trace.recorder is None or _trace.mark(self.room, "start")
        await tx.send_kv(indices, timeout=300)
        if aux_slot is not None:
            await tx.send_aux(3, timeout=60)
        await tx.done(timeout=300)
        elapsed = time.perf_counter() - t0
        _trace.recorder is None or _trace.mark(self.room, "end")
        if rec is not None:
            _trace.stop()
            self.stages.append({stage: t for room, stage, t in rec.take() if room == self.room})
        await self.child.expect("ok", 300)
        return elapsed

    async def raw_room(self, pages: int) -> float:
        dev = self.side.device
        assert self.side.mgr is not None
        raw = raw_engine(self.side.mgr, self.peer["session"],
                         int(dev.partition(":")[2] or 0) if dev.startswith("cuda") else None)
        src = np.array([int(b.data_ptr()) for b in self.side.kv], dtype=np.uint64)
        dst = np.array(self.peer["bases"], dtype=np.uint64)
        length = np.full(BUFFERS, pages * PAGE_BYTES, dtype=np.uint64)
        return await asyncio.to_thread(raw.batches, src, dst, length)

    async def check(self, pages: int, what: str) -> None:
        got = (await self.call({"cmd": "digest", "pages": pages}))["digest"]
        if got != self.side.digest(pages):
            raise RuntimeError(f"{what}: the decode's bytes differ from the prefill's")
        await self.call({"cmd": "zero"})


async def _engine(engine: str, device: str, sizes: dict[str, int], repeats: int, aux_rooms: int,
                  progress_delay_us: int) -> dict[str, Any]:
    pages = max(sizes.values()) // (BUFFERS * PAGE_BYTES)
    child = await Child.spawn("benchmarks.device_bench",
                              ["--engine", engine, "--device", device, "--pages", str(pages),
                               "--nixl-progress-delay-us", str(progress_delay_us)])
    out: dict[str, Any] = {"engine": engine, "device": device, "nixl_progress_delay_us": progress_delay_us,
                           "rooms": {}, "aux": {}}
    side = _Side(engine, device, pages, fill=True, progress_delay_us=progress_delay_us)
    try:
        await child.expect("ready", 120)
        b = _Bench(side, child)
        await b.use("kv")
        for label, nbytes in sizes.items():
            n = nbytes // (BUFFERS * PAGE_BYTES)
            await b.aio_room(n)
            await b.check(n, f"{engine} {label} through aiotransfer")
            await b.raw_room(n)
            await b.check(n, f"{engine} {label} through the raw engine")
            times: dict[str, list[float]] = {"list": [], "array": [], "raw": []}
            b.stages.clear()
            lag = LoopLagMonitor()  # sampled during aiotransfer's rooms only: the raw driver spins on a thread
            for _ in range(repeats):
                for as_array in (False, True):
                    lag.start()
                    t = await b.aio_room(n, as_array=as_array, trace=as_array)
                    await lag.stop()
                    times["array" if as_array else "list"].append(t)
                times["raw"].append(await b.raw_room(n))
            gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            out["rooms"][label] = {"bytes": nbytes, "aiotransfer_gbps": gbps["list"],
                                   "aiotransfer_array_gbps": gbps["array"], "raw_gbps": gbps["raw"],
                                   "ratio": gbps["list"] / gbps["raw"], "ratio_array": gbps["array"] / gbps["raw"],
                                   "raw_us": statistics.median(times["raw"]) * 1e6,
                                   "stages_us": _stage_medians(b.stages), "loop_lag": lag.summary()}
        for mode in side.modes:
            await b.use(mode)
            aux_times = []
            for i in range(aux_rooms + 1):
                t = await b.aio_room(1, aux_slot=5)
                if i:
                    aux_times.append(t)
            row = (await b.call({"cmd": "aux", "mode": mode, "slot": 5}))["aux"]
            want = [(3 * AUX_ITEM + k) % 251 for k in range(AUX_ITEM)]
            if row != want:
                raise RuntimeError(f"{engine}: aux on the {mode} path arrived wrong")
            out["aux"][mode] = {"room_us": statistics.median(aux_times) * 1e6,
                                "path": "engine" if mode == "device" else "tcp"}
    finally:
        await side.close()
        await child.close()
    return out


def _stage_medians(rooms: list[dict[str, int]]) -> dict[str, float]:
    """Median microseconds from each mark to the next one present (``a->b``)."""
    out: dict[str, float] = {}
    for a, b in itertools.pairwise(STAGES):
        gaps = [(r[b] - r[a]) / 1e3 for r in rooms if a in r and b in r]
        if gaps:
            out[f"{a}->{b}"] = statistics.median(gaps)
    return out


def _copy_bandwidth(device: str, repeats: int = 20) -> dict[str, float]:
    """Payload bytes per second of the staging copies: 10,000 of 12,288 scattered 4 KiB pages."""
    torch = _torch()
    pool, n, page = 12_288, 10_000, 4096
    src = torch.randint(0, 256, (pool, page), dtype=torch.uint8, device=device)
    idx = torch.randperm(pool, device=device)[:n]
    out = torch.empty((n, page), dtype=torch.uint8, device=device)
    cuda = device.startswith("cuda")

    def timed(fn: Any) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return n * page * repeats / (time.perf_counter() - t0)

    return {"gather_bps": timed(lambda: torch.index_select(src, 0, idx, out=out)),
            "scatter_bps": timed(lambda: src.index_copy_(0, idx, out))}


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "device", repeats="default 5; 2 with --quick", quick="smaller rooms, 5 aux rooms")
    options.engines(p, "nixl,mooncake_tcp")
    p.add_argument("--device", default="cuda:0",
                   help="where both sides' KV lives (default cuda:0; cpu runs the same code on host tensors)")
    p.add_argument("--nixl-progress-delay-us", type=int, default=0, metavar="US",
                   help="TransferConfig.nixl_progress_delay_us of every manager, both sides (default 0)")


def run_device(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m benchmarks device``."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    device = ns.device
    engines = (ns.engines or "nixl,mooncake_tcp").split(",")
    sizes = QUICK_SIZES if ns.quick else SIZES
    repeats = ns.repeats or (2 if ns.quick else 5)
    aux_rooms = 5 if ns.quick else 50
    if device.startswith("cuda"):
        torch = _torch()
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            print(f"benchmarks device: {device} is not available here "
                  f"({torch.cuda.device_count()} CUDA devices); --device cpu runs it on host memory", file=sys.stderr)
            return 2
        name = torch.cuda.get_device_name(index)
    else:
        name = "host memory"
    print(f"device: {device} ({name}); rooms of {BUFFERS} buffers of {PAGE_BYTES >> 10} KiB pages;")
    print(f"  medians of {repeats}, aiotransfer and the raw engine alternating")
    results: dict[str, Any] = {"device": device, "device_name": name, "engines": []}
    for engine in engines:
        res = asyncio.run(_engine(engine, device, sizes, repeats, aux_rooms, ns.nixl_progress_delay_us))
        results["engines"].append(res)
        for label, r in res["rooms"].items():
            print(f"{engine}, {label} room:")
            print(f"  aiotransfer {r['aiotransfer_gbps']:.2f} GB/s (indices as a list), "
                  f"{r['aiotransfer_array_gbps']:.2f} GB/s (an array); raw {r['raw_gbps']:.2f} GB/s "
                  f"({r['raw_us']:.0f} us); ratios {r['ratio']:.2f}, {r['ratio_array']:.2f}")
            print("  stages (array, us): " + ", ".join(f"{k} {v:.0f}" for k, v in r["stages_us"].items()))
            print(f"  event-loop lag during aiotransfer's rooms: p99 {r['loop_lag']['p99_ms']} ms, "
                  f"max {r['loop_lag']['max_ms']} ms")
        for mode, r in res["aux"].items():
            print(f"{engine}, one-page room + send_aux, {mode} aux on the {r['path']} path: "
                  f"{r['room_us']:.0f} us (median of {aux_rooms})")
    bw = _copy_bandwidth(device)
    results["copies"] = bw
    print(f"staging copies, 10,000 scattered 4 KiB pages: gather {bw['gather_bps'] / 1e9:.0f} GB/s, "
          f"scatter {bw['scatter_bps'] / 1e9:.0f} GB/s")
    write_json(ns.out or options.default_out("device"), results, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="decode")
    p.add_argument("--engine", default="nixl")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--nixl-progress-delay-us", type=int, default=0)
    return asyncio.run(_decode(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
