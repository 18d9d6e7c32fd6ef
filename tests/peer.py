"""A KVManager in its own OS process, driven by JSON-line commands on stdin (test harness).

Usage: python tests/peer.py --engine mooncake_tcp --buffers 4 --pages 256 --item-len 4096 [--seed N]

``--staging-backend torch`` or ``--device cuda:0`` registers the KV buffers as torch tensors (on that device).

Each stdin line is {"id": n, "op": ..., ...}; each reply is one stdout line {"id": n, "ok": bool, ...}.
Commands run concurrently (one task each), so a test can hold a ``done`` open while sending others.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiotransfer import KVArgs, KVManager, TransferConfig
from aiotransfer.errors import TransferFailed


def make_buffers(n: int, pages: int, item_len: int, seed: int | None) -> list[np.ndarray]:
    bufs = []
    for b in range(n):
        if seed is None:
            bufs.append(np.zeros((pages, item_len), dtype=np.uint8))
        else:
            rng = np.random.default_rng([seed, b])
            bufs.append(rng.integers(0, 256, size=(pages, item_len), dtype=np.uint8))
    return bufs


def host_array(buf: Any) -> np.ndarray:
    """``buf`` as a NumPy array (a host copy of a device tensor; host tensors and arrays are not copied)."""
    return buf.cpu().numpy() if hasattr(buf, "cpu") else buf


def digest(bufs: Sequence[Any], pages: list[int]) -> str:
    h = hashlib.sha256()
    idx = np.asarray(pages, dtype=np.int64)
    for buf in bufs:
        h.update(np.ascontiguousarray(host_array(buf)[idx]).tobytes())
    return h.hexdigest()


class Peer:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.kv: list[Any] = make_buffers(ns.buffers, ns.pages, ns.item_len, ns.seed)
        if ns.scale_item_len:  # one per-page scale buffer per KV buffer (fp8 KV), registered as KV buffers
            self.kv += make_buffers(ns.buffers, ns.pages, ns.scale_item_len, None if ns.seed is None else ns.seed + 99)
        if ns.staging_backend == "torch" or ns.device != "cpu":
            import torch

            self.kv = [torch.from_numpy(b).to(ns.device) for b in self.kv]  # host: the same memory
        self.aux: list[Any] = make_buffers(ns.aux_buffers, ns.aux_slots, ns.aux_item_len, ns.seed) if ns.aux_buffers else []
        if ns.mem_pool and self.aux:  # aux where the pool puts it (INTRA_NODE_NVLINK: on the device)
            import torch

            from aiotransfer._aux_state import alloc_metadata_buffer

            device_id = int(ns.device.partition(":")[2] or 0) if ns.device.startswith("cuda") else None
            placed = []
            for b in self.aux:
                t = alloc_metadata_buffer(b.shape[0], (b.shape[1],), torch.uint8, pool=ns.mem_pool, device_id=device_id)
                t.copy_(torch.from_numpy(b))
                placed.append(t)
            self.aux = placed
        self.state: dict[str, list[np.ndarray]] = {}
        for i, spec in enumerate(ns.state or []):
            kind, nbuf, slots, item_len = spec.split(":")
            seed = None if ns.seed is None else ns.seed + 1000 * (i + 1)
            self.state[kind] = make_buffers(int(nbuf), int(slots), int(item_len), seed)
        self.out = sys.stdout
        self.rooms: dict[int, Any] = {}

    def reply(self, msg: dict[str, Any]) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    async def handle(self, mgr: KVManager, cmd: dict[str, Any]) -> None:
        rid = cmd.get("id")
        op = cmd["op"]
        try:
            result = await getattr(self, "op_" + op)(mgr, **{k: v for k, v in cmd.items() if k not in ("id", "op")})
            self.reply({"id": rid, "ok": True, **(result or {})})
        except TransferFailed as exc:
            self.reply({"id": rid, "ok": False, "error": "TransferFailed", "reason": exc.reason})
        except Exception as exc:
            self.reply({"id": rid, "ok": False, "error": type(exc).__name__, "reason": str(exc),
                        "trace": traceback.format_exc()})

    async def op_info(self, mgr: KVManager) -> dict[str, Any]:
        return {"endpoint": mgr.endpoint, "describe": {k: str(v) for k, v in mgr.describe().items()}}

    async def op_receiver(self, mgr: KVManager, room: int, peer: str, pages: list[int],
                          aux_index: int | None = None, state: dict[str, list[int]] | None = None,
                          timeout: float = 10.0, num_tokens: int | None = None) -> None:
        rx = mgr.receiver(room, peer)
        self.rooms[room] = rx
        await rx.send_metadata(pages, aux_index=aux_index, state_indices=state, num_tokens=num_tokens,
                               timeout=timeout)

    async def op_done(self, mgr: KVManager, room: int, timeout: float = 30.0) -> dict[str, Any]:
        obj = self.rooms[room]
        await obj.done(timeout=timeout)
        return {"status": obj.poll().name}

    async def op_poll(self, mgr: KVManager, room: int) -> dict[str, Any]:
        return {"status": self.rooms[room].poll().name}

    async def op_abort(self, mgr: KVManager, room: int, reason: str = "test abort") -> None:
        await self.rooms[room].abort(reason)

    async def op_abort_then_stop(self, mgr: KVManager, room: int, reason: str = "test abort") -> None:
        """Abort the room and stop this process (SIGSTOP) as soon as the room failed here, before the abort has
        reached anyone: it answers once it runs again."""
        rx = self.rooms[room]
        aborting = asyncio.ensure_future(rx.abort(reason))
        while rx.poll().name != "Failed":
            await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGSTOP)
        await aborting

    async def op_reason(self, mgr: KVManager, room: int) -> dict[str, Any]:
        obj = self.rooms[room]
        return {"status": obj.poll().name, "reason": obj.failure_reason}

    async def op_released(self, mgr: KVManager, room: int, timeout: float = 30.0) -> dict[str, Any]:
        obj = self.rooms[room]
        await obj.released(timeout=timeout)
        return {"cause": obj.release_cause}

    async def op_sender(self, mgr: KVManager, room: int) -> None:
        self.rooms[room] = mgr.sender(room)

    async def op_wait_ready(self, mgr: KVManager, room: int, timeout: float = 10.0) -> None:
        await self.rooms[room].wait_ready(timeout=timeout)

    async def op_send_kv(self, mgr: KVManager, room: int, pages: list[int], last: bool = True,
                         timeout: float = 30.0) -> None:
        await self.rooms[room].send_kv(pages, last=last, timeout=timeout)

    async def op_digest(self, mgr: KVManager, pages: list[int]) -> dict[str, Any]:
        return {"digest": digest(self.kv, pages)}

    async def op_token_digest(self, mgr: KVManager, pages: list[int], num_tokens: int, head_start: int = 0,
                              head_count: int = 0) -> dict[str, Any]:
        """Digest of the first ``num_tokens`` tokens held by ``pages`` (token-major pages), heads
        ``[head_start, +head_count)`` of each (0: every head): the same whatever the page size."""
        h = hashlib.sha256()
        heads = self.ns.kv_heads or 1
        for buf in map(host_array, self.kv):
            rows = np.ascontiguousarray(buf[np.asarray(pages, dtype=np.int64)]).reshape(-1, heads, buf.shape[1] // (
                self.ns.page_size * heads))[:num_tokens]
            h.update(np.ascontiguousarray(rows[:, head_start : head_start + (head_count or heads)]).tobytes())
        return {"digest": h.hexdigest()}

    async def op_aux_digest(self, mgr: KVManager, slots: list[int]) -> dict[str, Any]:
        return {"digest": digest(self.aux, slots)}

    async def op_state_digest(self, mgr: KVManager, kind: str, slots: list[int]) -> dict[str, Any]:
        return {"digest": digest(self.state[kind], slots)}

    async def op_send_aux(self, mgr: KVManager, room: int, aux_index: int, timeout: float = 30.0) -> dict[str, Any]:
        tx = self.rooms[room]
        await tx.send_aux(aux_index, timeout=timeout)
        return {"path": tx.aux_path}

    async def op_send_state(self, mgr: KVManager, room: int, state: dict[str, list[int]],
                            timeout: float = 30.0) -> None:
        await self.rooms[room].send_state(state, timeout=timeout)

    async def op_aux_path(self, mgr: KVManager, room: int) -> dict[str, Any]:
        return {"path": self.rooms[room].aux_path}

    async def op_zero(self, mgr: KVManager) -> None:
        for b in self.kv + self.aux + [x for bufs in self.state.values() for x in bufs]:
            b[...] = 0

    async def op_thread_policies(self, mgr: KVManager) -> dict[str, Any]:
        from tests.threads import thread_policies

        return {"threads": thread_policies()}

    async def op_break_conversion(self, mgr: KVManager) -> None:
        """Fault injection: every converted piece this process scatters from now on fails."""
        from aiotransfer._kv import staged as staged_module

        def broken(*args: object) -> None:
            raise RuntimeError("conversion broke")

        setattr(staged_module, "scatter_tokens", broken)  # noqa: B010 -- replaces the module global

    async def op_break_scatter(self, mgr: KVManager) -> None:
        """Fault injection: every staged piece this process scatters from now on fails."""
        from aiotransfer import _staging as staging

        def broken(*args: object) -> None:
            raise RuntimeError("scatter broke")

        setattr(staging, "scatter_pages", broken)  # noqa: B010 -- replaces the module global
        if self.ns.staging_backend == "torch" or self.ns.device != "cpu":
            from aiotransfer import _torch_staging

            setattr(_torch_staging, "scatter_pages_torch", broken)  # noqa: B010

    async def op_fill(self, mgr: KVManager, pages: list[int], value: int) -> None:
        """Every byte of ``pages`` in every KV buffer becomes ``value`` (a request's data, recognisable)."""
        for buf in map(host_array, self.kv):
            buf[np.asarray(pages, dtype=np.int64)] = value

    async def op_byte_counts(self, mgr: KVManager, pages: list[int]) -> dict[str, Any]:
        """How many bytes of ``pages`` (every KV buffer) hold each value."""
        counts = np.zeros(256, dtype=np.int64)
        for buf in map(host_array, self.kv):
            counts += np.bincount(np.asarray(buf[np.asarray(pages, dtype=np.int64)]).ravel(), minlength=256)
        return {"counts": {str(v): int(n) for v, n in enumerate(counts) if n}}

    async def op_refill_when_released(self, mgr: KVManager, room: int, pages: list[int], value: int,
                                      timeout: float = 60.0) -> dict[str, Any]:
        """A scheduler's next request: once the room's pages are released, write new data into them at once."""
        obj = self.rooms[room]
        await obj.released(timeout=timeout)
        await self.op_fill(mgr, pages, value)
        return {"cause": obj.release_cause}

    async def op_released_counts(self, mgr: KVManager, room: int, pages: list[int], timeout: float = 60.0,
                                 after: float = 2.0) -> dict[str, Any]:
        """The pages' byte counts the moment the room is released, and ``after`` seconds later."""
        obj = self.rooms[room]
        await obj.released(timeout=timeout)
        at_release = (await self.op_byte_counts(mgr, pages))["counts"]
        await asyncio.sleep(after)
        return {"cause": obj.release_cause, "at_release": at_release,
                "later": (await self.op_byte_counts(mgr, pages))["counts"]}

    async def op_stats(self, mgr: KVManager) -> dict[str, Any]:
        return {"stats": json.loads(json.dumps(mgr.stats(), default=str))}

    async def run(self) -> None:
        ns = self.ns
        device_id = int(ns.device.partition(":")[2] or 0) if ns.device.startswith("cuda") else None
        cfg = TransferConfig.from_env(engine=ns.engine, handshake_timeout=ns.handshake_timeout,
                                      staging_backend=ns.staging_backend, device_id=device_id,
                                      custom_mem_pool=ns.mem_pool or None)
        layer_ids = [int(x) for x in ns.layer_ids.split(",")] if ns.layer_ids else None
        args = KVArgs(self.kv, page_size=ns.page_size, dtype=ns.dtype, aux_buffers=self.aux, state_buffers=self.state,
                      layout=ns.layout, tp_size=ns.tp_size, tp_rank=ns.tp_rank, kv_heads=ns.kv_heads,
                      total_kv_heads=ns.total_kv_heads, kv_layer_ids=layer_ids, pp_size=ns.pp_size,
                      pp_rank=ns.pp_rank, head_order=ns.head_order, num_layers=ns.num_layers)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        async with KVManager(args, cfg) as mgr:
            if ns.hostile_handshake:
                from benchmarks.hostile import front_handshake

                front_handshake(mgr, ns.hostile_handshake, ns.hostile_mode)
            self.reply({"id": 0, "ok": True, "endpoint": mgr.endpoint})
            tasks: set[asyncio.Task[None]] = set()
            while True:
                line = await reader.readline()
                if not line:
                    break
                cmd = json.loads(line)
                if cmd["op"] == "exit":
                    break
                t = asyncio.create_task(self.handle(mgr, cmd))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            for t in tasks:
                t.cancel()
        os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="mooncake_tcp")
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--item-len", type=int, default=4096)
    p.add_argument("--aux-buffers", type=int, default=0)
    p.add_argument("--aux-slots", type=int, default=16)
    p.add_argument("--aux-item-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--state", action="append", help="kind:buffers:slots:item_len")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="uint8", help="the KV dtype this peer declares")
    p.add_argument("--scale-item-len", type=int, default=0, help="bytes per page of per-page scale buffers")
    p.add_argument("--layout", default="layer_first")
    p.add_argument("--head-order", default="NHD")
    p.add_argument("--num-layers", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--pp-rank", type=int, default=0)
    p.add_argument("--kv-heads", type=int, default=0)
    p.add_argument("--total-kv-heads", type=int, default=0)
    p.add_argument("--layer-ids", default="")
    p.add_argument("--handshake-timeout", type=float, default=10.0)
    p.add_argument("--staging-backend", choices=("auto", "numpy", "torch"), default="auto",
                   help="TransferConfig.staging_backend; torch registers the KV buffers as torch tensors")
    p.add_argument("--mem-pool", default="", help="TransferConfig.custom_mem_pool; aux buffers placed by it")
    p.add_argument("--device", default="cpu", help="where the KV buffers live (cuda:N: torch tensors there)")
    p.add_argument("--hostile-handshake", type=float, default=0.0,
                   help="seconds a front listener holds the engine's handshake requests (benchmarks.hostile)")
    p.add_argument("--hostile-mode", choices=("once", "silent"), default="once")
    asyncio.run(Peer(p.parse_args()).run())


if __name__ == "__main__":
    main()
