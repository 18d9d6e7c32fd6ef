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
peers). ``submit_write`` maps each absolute address in :class:`~aiotransfer.engines.Blocks` to (region,
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

import contextlib
import importlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from .._config import TransferConfig
from .._plan import Blocks
from ..errors import ClosedError, EngineError, EngineUnavailable
from ._base import EngineStatus, EngineTraits, MemoryRegion, TransferHandle
from ._common import AgentEngine, RegionIndex, block_arrays, map_errors, quietly, vendor_error

__all__ = ["MoriEngine"]

log = logging.getLogger("aiotransfer.engines.mori")

_INSTALL_HINT = (
    "pip install amd-mori on a ROCm host (wheels for CPython 3.10 and 3.12 only); mori.io needs "
    "libamdhip64.so.7 and libhsa-runtime64.so.1 (ROCm), libpci.so.3 (libpci3), gRPC/protobuf system "
    "libraries and a ROCm build of torch"
)
_INFO_VERSION = 1
_PARKED: list[tuple[Any, list[Any]]] = []
"""(engine, statuses) still written by MORI after close(): kept for the life of the process."""


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "1"))
    except ValueError:
        return 1


def _import_io() -> Any:
    try:
        return importlib.import_module("mori.io")
    except (ImportError, OSError) as exc:
        raise EngineUnavailable(f"MORI-IO cannot be loaded ({exc}); {_INSTALL_HINT}") from exc


class _Info(msgspec.Struct, frozen=True, array_like=True):
    version: int
    engine: bytes
    memories: list[bytes]


@dataclass
class _Peer:
    info: bytes
    desc: Any
    memories: list[Any]
    table: RegionIndex


@dataclass
class _Batch:
    """A TransferHandle's token: every posted status, plus an error from a later pair that raised."""

    statuses: list[Any]
    error: str | None = None
    done: list[bool] = field(default_factory=list)
    unknown: bool = False
    """A status query raised: nothing more can be learned about this batch."""


class MoriEngine(AgentEngine):
    """MORI-IO adapter, one ``IOEngine`` per instance (see module docstring)."""

    name = "mori"
    traits = EngineTraits(entry_cost_s=5e-6, bandwidth_bps=20.0e9)

    def __init__(self, config: TransferConfig) -> None:
        io = _import_io()
        self._io = io
        self._key = f"aiotransfer-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            io.set_log_level(config.engine_log_level.lower())
        except Exception as exc:
            log.debug("MORI set_log_level(%r) failed: %s", config.engine_log_level, exc)
        with map_errors("MORI-IO engine setup failed"):
            engine = io.IOEngine(self._key, io.IOEngineConfig(host=config.hostname, port=0))
            engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
        self._engine: Any = engine
        self._lock = threading.Lock()
        self._regions: dict[MemoryRegion, tuple[Any, int]] = {}  # region -> (MemoryDesc, refcount)
        self._local_mds: list[Any] = []
        self._local = RegionIndex([])
        self._peers: dict[str, _Peer] = {}
        self._live: set[TransferHandle] = set()
        self._closed = False
        codes = io.StatusCode
        over = [codes.INIT, codes.ERR_INVALID_ARGS, codes.ERR_NOT_FOUND]
        if _env_int("MORI_IO_NUM_WORKER_THREADS") <= 1:
            over.append(codes.ERR_BAD_STATE)  # through the executor, one split's code while others were posted
        self._over = frozenset(over)
        """Status codes after which MORI no longer touches the status's memory."""
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

    def _check_open(self) -> Any:
        if self._closed:
            raise ClosedError("MORI engine is closed")
        return self._engine

    def local_info(self) -> bytes:
        with self._lock:
            engine = self._check_open()
            with map_errors("MORI descriptor packing failed"):
                info = _Info(_INFO_VERSION, bytes(engine.get_engine_desc().pack()),
                             [bytes(md.pack()) for md in self._local_mds])
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
                with map_errors(f"MORI register_memory({r.ptr:#x}, {r.nbytes}, {r.device}) failed"):
                    md = engine.register_memory(r.ptr, r.nbytes, dev, loc)
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
                quietly(log, f"MORI deregister_memory({r.ptr:#x})", self._engine.deregister_memory, held[0])
            self._rebuild_local()

    def _rebuild_local(self) -> None:
        self._local_mds = [md for md, _count in self._regions.values()]
        self._local = RegionIndex([(r.ptr, r.nbytes) for r in self._regions])

    # -- peers ---------------------------------------------------------------------------------
    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None:
        """Register the peer's engine and learn its memory descriptors (idempotent)."""
        io = self._io
        if not peer_info:
            raise EngineError(f"no MORI engine info from peer {peer} (is the peer running a MORI engine?)")
        with map_errors(f"malformed MORI peer info from {peer}"):
            info = msgspec.msgpack.decode(peer_info, type=_Info)
            desc = io.EngineDesc.unpack(info.engine)
            memories = [io.MemoryDesc.unpack(m) for m in info.memories]
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
                quietly(log, f"MORI deregister_remote_engine({peer})", engine.deregister_remote_engine, known.desc)
            with map_errors(f"MORI register_remote_engine({peer}) failed"):
                engine.register_remote_engine(desc)
            table = RegionIndex([(int(md.data), int(md.size)) for md in memories])
            self._peers[peer] = _Peer(peer_info, desc, memories, table)

    def forget_peer(self, peer: str) -> None:
        with self._lock:
            known = self._peers.pop(peer, None)
            if known is not None and not self._closed:
                quietly(log, f"MORI deregister_remote_engine({peer})", self._engine.deregister_remote_engine,
                        known.desc)

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
            src, dst, length = block_arrays(blocks)
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
                    reason = f"MORI batch_write to {peer} failed: {vendor_error(exc)}"
                    if not batch.statuses:
                        raise EngineError(reason) from exc
                    batch.error = reason  # earlier pairs are in flight: report once they finish
                    break
                batch.statuses.extend(statuses)
            batch.done = [False] * len(batch.statuses)
            handle = TransferHandle(token=batch, peer=peer, entries=n, nbytes=blocks.nbytes)
            self._live.add(handle)
            return handle

    def check(self, handle: TransferHandle) -> EngineStatus:
        """Non-blocking (the engine lock is only tried: a submit holding it answers PENDING). Terminal once
        every posted status is over: SUCCESS, or an error MORI sets before posting anything (INIT left by an
        early return, ERR_INVALID_ARGS, ERR_BAD_STATE without the executor, ERR_NOT_FOUND). ERR_RDMA_OP and
        ERR_GPU_OP are not an end: MORI sets them on a partial post, a failed notification after every data
        write was posted, or the first error of several queue pairs, while other work of the status runs on
        (docs/engines.md): the handle is doomed and stays live until the release quarantine (:meth:`abandon`
        parks its statuses). A status query that raises leaves nothing known: doomed likewise."""
        handle.ensure_pending()
        batch = handle.token
        if not isinstance(batch, _Batch):
            raise EngineError("check() on a handle this MORI engine did not create")
        if batch.unknown:
            return EngineStatus.PENDING
        codes = self._io.StatusCode
        if not self._lock.acquire(blocking=False):
            return EngineStatus.PENDING  # a submit holds the engine (the first write to a pair connects)
        with contextlib.ExitStack() as held:
            held.callback(self._lock.release)
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
                    elif code == codes.IN_PROGRESS:
                        pending = True
                    elif code in self._over:  # nothing of it was posted, or nothing of it runs any more
                        batch.done[i] = True
                        errors.append(f"{getattr(code, 'name', code)}: {st.Message()}")
                    else:  # an error while some of its work may still run: never an end
                        pending = True
                        handle.doom(f"MORI write to {handle.peer} failed: {getattr(code, 'name', code)}: "
                                    f"{st.Message()} (some of it may still run)")
            except Exception as exc:
                batch.unknown = True
                handle.doom(f"MORI status query for {handle.peer} failed: {vendor_error(exc)}")
                return EngineStatus.PENDING
            if errors and batch.error is None:
                batch.error = f"MORI write to {handle.peer} failed: {'; '.join(errors)}"
            if batch.error is not None:
                handle.doom(batch.error)
            if pending:
                return EngineStatus.PENDING
            self._live.discard(handle)
            batch.statuses.clear()
            if batch.error is not None:
                return handle.finish(EngineStatus.FAILED, batch.error)
            return handle.finish(EngineStatus.DONE)

    def abandon(self, handle: TransferHandle) -> None:
        """The quarantine passed without every status ending: the statuses (which MORI's completion threads
        may still write) are parked for the life of the process, and the handle ends FAILED."""
        batch = handle.token
        with self._lock:
            if handle.consumed:
                return
            self._live.discard(handle)
            if isinstance(batch, _Batch) and batch.statuses:
                _PARKED.append((self._engine, list(batch.statuses)))
                batch.statuses.clear()
            handle.finish(EngineStatus.FAILED, handle.doomed or "abandoned after the release quarantine")

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
                quietly(log, "MORI deregister_memory at close", engine.deregister_memory, md)
            self._regions.clear()
            self._rebuild_local()
            for name, known in self._peers.items():
                quietly(log, f"MORI deregister_remote_engine({name})", engine.deregister_remote_engine, known.desc)
            self._peers.clear()

    def raw(self) -> Any:
        """The native ``mori.io.IOEngine`` (diagnostics only)."""
        return self._check_open()
