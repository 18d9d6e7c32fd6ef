"""AMD MORI-IO adapter (``mori.io``, RDMA backend).

**MORI-IO cannot run on this project's CI**: ``mori.io`` needs ROCm (``libamdhip64.so.7``,
``libhsa-runtime64.so.1``) and an RDMA or XGMI device, and ``amd-mori`` has no wheel for CPython 3.11
(cp310 and cp312 only). This adapter is tested against ``tests/fake_mori.py``, an in-process fake of the
same Python API, never against the real library.

=====================  ==================================  ============  ==============================
method                 blocks?                             GIL released  thread-safe
=====================  ==================================  ============  ==============================
``__init__``           yes: engine + RDMA backend init     no            -- (run on the offload thread)
``register``           short (MR registration)             no            yes (engine lock)
``connect``            short: registers the peer engine    no            yes (engine lock)
``submit_write``       short per (local, remote) region    yes, in MORI  yes (engine lock)
                       pair; the first write to a pair
                       builds RDMA connections (blocks)
``check``              no: queries ``TransferStatus``      no            yes (engine lock)
``wait``               yes: polls ``check`` with short     while asleep  yes; for blocking callers only
                       sleeps (never MORI's ``wait_all``)
``close``              short                               no            yes (engine lock)
=====================  ==================================  ============  ==============================

Addressing: MORI names memory as (``MemoryDesc``, offset), not by address. ``local_info()`` therefore
carries the packed ``EngineDesc`` *and* the packed ``MemoryDesc`` of every registered region (msgpack
envelope; it is built when the Hello is, after registration, so memory registered later is unknown to
peers). ``submit_write`` maps each absolute address in :class:`~aiotransfer.plan.Blocks` to (region,
offset) on both sides and groups entries by (local region, remote region) pair.

Each pair is posted with its own ``batch_write`` call: MORI's multi-session call stops at the first pair
it cannot route (later statuses stay INIT forever) and raises for unknown remote memory after earlier
pairs were posted, losing statuses MORI still writes to. The handle polls every ``TransferStatus`` from
the event loop (POLL); it becomes terminal only once *all* of them are, so a failed entry never unpins
memory another entry may still be writing. ``TransferStatus`` objects are owned by Python and written by
MORI's completion threads: :meth:`MoriEngine.close` keeps unfinished ones (and the engine) alive for the
life of the process rather than free memory MORI may touch.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from ..config import TransferConfig
from ..errors import ClosedError, EngineError, EngineUnavailable
from ..plan import Blocks
from .base import EngineStatus, MemoryRegion, TransferHandle, WaitMode

__all__ = ["MoriEngine"]

log = logging.getLogger("aiotransfer.engines.mori")

_INSTALL_HINT = (
    "pip install amd-mori on a ROCm host (wheels for CPython 3.10 and 3.12 only); mori.io needs "
    "libamdhip64.so.7 and libhsa-runtime64.so.1 (ROCm), libpci.so.3 (libpci3), gRPC/protobuf system "
    "libraries and a ROCm build of torch"
)
_INFO_VERSION = 1
_WAIT_SLEEP_MAX = 0.001
_PARKED: list[tuple[Any, list[Any]]] = []
"""(engine, statuses) still written by MORI after close(): kept for the life of the process."""


def _import_io() -> Any:
    try:
        return importlib.import_module("mori.io")
    except (ImportError, OSError) as exc:
        raise EngineUnavailable(f"MORI-IO cannot be loaded ({exc}); {_INSTALL_HINT}") from exc


def _mori_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Info(msgspec.Struct, frozen=True, array_like=True):
    version: int
    engine: bytes
    memories: list[bytes]


class _Table:
    """Registered regions sorted by address: absolute address -> (region index, offset), in bulk."""

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        self.order = sorted(range(len(spans)), key=lambda i: spans[i][0])
        arr = np.array([spans[i] for i in self.order], dtype=np.uint64).reshape(-1, 2)
        self.starts = arr[:, 0].copy()
        self.ends = arr[:, 0] + arr[:, 1]
        self.index = np.array(self.order, dtype=np.intp)

    def locate(self, addrs: npt.NDArray[np.uint64], what: str) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.uint64]]:
        pos = np.searchsorted(self.starts, addrs, side="right") - 1
        inside = pos >= 0
        inside[inside] = addrs[inside] < self.ends[pos[inside]]
        if not inside.all():
            bad = int(addrs[int(np.argmin(inside))])
            raise EngineError(f"{what} address {bad:#x} is not inside any registered region")
        return self.index[pos], addrs - self.starts[pos]


@dataclass
class _Peer:
    info: bytes
    desc: Any
    memories: list[Any]
    table: _Table


@dataclass
class _Batch:
    """A TransferHandle's token: every posted status, plus an error from a later pair that raised."""

    statuses: list[Any]
    error: str | None = None
    done: list[bool] = field(default_factory=list)


class MoriEngine:
    """MORI-IO adapter, one ``IOEngine`` per instance (see module docstring)."""

    name = "mori"
    cheap_submit = False
    entry_cost_s = 5e-6
    bandwidth_bps = 20.0e9

    def __init__(self, config: TransferConfig) -> None:
        io = _import_io()
        self._io = io
        self._key = f"aiotransfer-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            io.set_log_level(config.engine_log_level.lower())
        except Exception as exc:
            log.debug("MORI set_log_level(%r) failed: %s", config.engine_log_level, exc)
        try:
            engine = io.IOEngine(self._key, io.IOEngineConfig(host=config.hostname, port=0))
            engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
        except Exception as exc:
            raise EngineError(f"MORI-IO engine setup failed: {_mori_error(exc)}") from exc
        self._engine: Any = engine
        self._lock = threading.Lock()
        self._regions: dict[MemoryRegion, tuple[Any, int]] = {}  # region -> (MemoryDesc, refcount)
        self._local_mds: list[Any] = []
        self._local = _Table([])
        self._peers: dict[str, _Peer] = {}
        self._live: set[TransferHandle] = set()
        self._closed = False
        xgmi = os.environ.get("MORI_DISABLE_AUTO_XGMI") == "0"
        self._transport = "rdma+xgmi" if xgmi else "rdma"
        desc = engine.get_engine_desc()
        log.info("MORI-IO engine up: %s at %s:%s", self._key, desc.host, desc.port)

    # -- identity ------------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self._key

    @property
    def transport(self) -> str:
        return self._transport

    def describe(self) -> dict[str, Any]:
        mori = importlib.import_module("mori")
        return {
            "engine": self.name,
            "session_id": self._key,
            "transport": self._transport,
            "mori_version": getattr(mori, "__version__", "unknown"),
            "regions": len(self._regions),
            "peers": len(self._peers),
            "in_flight": len(self._live),
        }

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"peers={len(self._peers)} in_flight={len(self._live)}"
        return f"<MoriEngine {self._key} {self._transport} {state}>"

    def _check_open(self) -> Any:
        if self._closed:
            raise ClosedError("MORI engine is closed")
        return self._engine

    def local_info(self) -> bytes:
        with self._lock:
            engine = self._check_open()
            try:
                info = _Info(_INFO_VERSION, bytes(engine.get_engine_desc().pack()),
                             [bytes(md.pack()) for md in self._local_mds])
            except Exception as exc:
                raise EngineError(f"MORI descriptor packing failed: {_mori_error(exc)}") from exc
        return msgspec.msgpack.encode(info)

    # -- memory --------------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        io = self._io
        with self._lock:
            engine = self._check_open()
            for r in regions:
                held = self._regions.get(r)
                if held is not None:
                    self._regions[r] = (held[0], held[1] + 1)
                    continue
                kind, _, index = r.device.partition(":")
                if kind == "cpu":
                    loc, dev = io.MemoryLocationType.CPU, -1
                elif kind == "cuda" and (index or "0").isdigit():
                    loc, dev = io.MemoryLocationType.GPU, int(index or 0)
                else:
                    raise EngineError(f"MORI adapter cannot register device {r.device!r}: expected 'cpu' or 'cuda:N'")
                try:
                    md = engine.register_memory(r.ptr, r.nbytes, dev, loc)
                except Exception as exc:
                    raise EngineError(
                        f"MORI register_memory({r.ptr:#x}, {r.nbytes}, {r.device}) failed: {_mori_error(exc)}"
                    ) from exc
                self._regions[r] = (md, 1)
            self._rebuild_local()

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            if self._closed:
                return  # close() deregistered everything
            for r in regions:
                held = self._regions.get(r)
                if held is None:
                    continue
                if held[1] > 1:
                    self._regions[r] = (held[0], held[1] - 1)
                    continue
                del self._regions[r]
                self._quietly(f"deregister_memory({r.ptr:#x})", self._engine.deregister_memory, held[0])
            self._rebuild_local()

    def _rebuild_local(self) -> None:
        self._local_mds = [md for md, _count in self._regions.values()]
        self._local = _Table([(r.ptr, r.nbytes) for r in self._regions])

    @staticmethod
    def _quietly(what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            log.warning("MORI %s failed: %s", what, _mori_error(exc))

    # -- peers ---------------------------------------------------------------------------------
    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None:
        """Register the peer's engine and learn its memory descriptors (idempotent)."""
        io = self._io
        if not peer_info:
            raise EngineError(f"no MORI engine info from peer {peer} (is the peer running a MORI engine?)")
        try:
            info = msgspec.msgpack.decode(peer_info, type=_Info)
            desc = io.EngineDesc.unpack(info.engine)
            memories = [io.MemoryDesc.unpack(m) for m in info.memories]
        except Exception as exc:
            raise EngineError(f"malformed MORI peer info from {peer}: {_mori_error(exc)}") from exc
        if info.version != _INFO_VERSION:
            raise EngineError(f"MORI peer info version {info.version} from {peer}; expected {_INFO_VERSION}")
        if desc.key != peer or any(md.engine_key != peer for md in memories):
            raise EngineError(f"MORI peer info from {peer!r} describes engine {desc.key!r}")
        with self._lock:
            engine = self._check_open()
            known = self._peers.get(peer)
            if known is not None and known.info == peer_info:
                return
            if known is not None:
                self._quietly(f"deregister_remote_engine({peer})", engine.deregister_remote_engine, known.desc)
            try:
                engine.register_remote_engine(desc)
            except Exception as exc:
                raise EngineError(f"MORI register_remote_engine({peer}) failed: {_mori_error(exc)}") from exc
            table = _Table([(int(md.data), int(md.size)) for md in memories])
            self._peers[peer] = _Peer(peer_info, desc, memories, table)

    def forget_peer(self, peer: str) -> None:
        with self._lock:
            known = self._peers.pop(peer, None)
            if known is not None and not self._closed:
                self._quietly(f"deregister_remote_engine({peer})", self._engine.deregister_remote_engine, known.desc)

    # -- transfers -----------------------------------------------------------------------------
    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        n = len(blocks)
        if n == 0:
            raise EngineError("empty transfer batch")
        with self._lock:
            engine = self._check_open()
            known = self._peers.get(peer)
            if known is None:
                raise EngineError(f"MORI peer {peer} is not connected")
            src = np.ascontiguousarray(blocks.src, dtype=np.uint64)
            dst = np.ascontiguousarray(blocks.dst, dtype=np.uint64)
            length = np.ascontiguousarray(blocks.length, dtype=np.uint64)
            li, loff = self._local.locate(src, "local source")
            ri, roff = known.table.locate(dst, f"destination on {peer}")
            pair = li * len(known.memories) + ri
            order = np.argsort(pair, kind="stable")
            cuts = np.flatnonzero(np.diff(pair[order])) + 1
            batch = _Batch([])
            for group in np.split(order, cuts):
                first = int(group[0])
                lmd, rmd = self._local_mds[int(li[first])], known.memories[int(ri[first])]
                try:
                    uid = engine.allocate_transfer_uid()
                    statuses = engine.batch_write(
                        [lmd], [loff[group].tolist()], [rmd], [roff[group].tolist()], [length[group].tolist()], [uid]
                    )
                except Exception as exc:
                    reason = f"MORI batch_write to {peer} failed: {_mori_error(exc)}"
                    if not batch.statuses:
                        raise EngineError(reason) from exc
                    batch.error = reason  # earlier pairs are in flight: report once they finish
                    break
                batch.statuses.extend(statuses)
            batch.done = [False] * len(batch.statuses)
            handle = TransferHandle(token=batch, mode=WaitMode.POLL, peer=peer, entries=n, nbytes=blocks.nbytes)
            self._live.add(handle)
            return handle

    def check(self, handle: TransferHandle) -> EngineStatus:
        """Non-blocking: terminal once every posted status is (the first error is reported)."""
        handle.ensure_pending()
        batch = handle.token
        if handle.mode is not WaitMode.POLL or not isinstance(batch, _Batch):
            raise EngineError("check() on a handle this MORI engine did not create")
        codes = self._io.StatusCode
        with self._lock:
            self._check_open()
            pending = False
            errors: list[str] = []
            try:
                for i, st in enumerate(batch.statuses):
                    if batch.done[i]:
                        continue
                    code = st.Code()
                    if code == codes.SUCCESS:
                        batch.done[i] = True
                    elif code in (codes.INIT, codes.IN_PROGRESS):
                        pending = True
                    else:
                        batch.done[i] = True
                        errors.append(f"{getattr(code, 'name', code)}: {st.Message()}")
            except Exception as exc:
                reason = f"MORI status query for {handle.peer} failed: {_mori_error(exc)}"
                self._live.discard(handle)
                _PARKED.append((self._engine, list(batch.statuses)))  # MORI may still write them
                handle.finish(EngineStatus.FAILED, reason)
                raise EngineError(reason) from exc
            if errors and batch.error is None:
                batch.error = f"MORI write to {handle.peer} failed: {'; '.join(errors)}"
            if pending:
                return EngineStatus.PENDING
            self._live.discard(handle)
            batch.statuses.clear()
            if batch.error is not None:
                return handle.finish(EngineStatus.FAILED, batch.error)
            return handle.finish(EngineStatus.DONE)

    def wait(self, handle: TransferHandle, timeout: float) -> EngineStatus:
        """Poll ``check`` with short sleeps (blocking callers only). Returns PENDING after ``timeout``
        seconds if still in flight (the handle stays live); ``timeout <= 0`` checks once."""
        deadline = time.monotonic() + timeout
        pause = 0.00005
        while (status := self.check(handle)) is EngineStatus.PENDING:
            if time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, _WAIT_SLEEP_MAX)
        return status

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Deregister memory and peers; unfinished statuses (and the engine) are parked, not freed."""
        with self._lock:
            if self._closed:
                return
            engine = self._engine
            self._closed = True
            self._engine = None
            unfinished = [st for h in self._live for st in h.token.statuses]
            for handle in list(self._live):
                handle.finish(EngineStatus.FAILED, "MORI engine closed before the transfer completed")
            self._live.clear()
            if unfinished:
                # MORI may still write these statuses and this memory: keep everything, touch nothing.
                log.warning("MORI engine closed with %d transfers in flight; engine and memory stay registered",
                            len(unfinished))
                _PARKED.append((engine, unfinished))
                return
            for md, _count in self._regions.values():
                self._quietly("deregister_memory at close", engine.deregister_memory, md)
            self._regions.clear()
            self._rebuild_local()
            for name, known in self._peers.items():
                self._quietly(f"deregister_remote_engine({name})", engine.deregister_remote_engine, known.desc)
            self._peers.clear()

    def raw(self) -> Any:
        """The native ``mori.io.IOEngine`` (diagnostics only)."""
        return self._check_open()
