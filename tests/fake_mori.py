"""An in-process fake of MORI-IO's Python API (``mori.io``), for testing the MORI adapter without ROCm.

Modelled on ROCm/mori (``python/mori/io/engine.py``, ``src/pybind/pybind_io.cpp``, ``src/io/engine.cpp``,
``src/io/rdma/backend_impl.cpp``; mid-2026): same names, signatures, enums and failure behaviour:

* ``batch_write(local_mds, local_offsets, remote_mds, remote_offsets, sizes, uids)`` is the multi-session
  form (one list entry per (local, remote) memory pair) and returns one ``TransferStatus`` per session.
  A session MORI cannot route (no backend, remote engine not registered) gets ``ERR_BAD_STATE`` and the
  call *returns at once*, leaving later statuses ``INIT`` (as ``SELECT_BACKEND_AND_RETURN_IF_NONE`` does).
* Remote memory the peer never registered (or deregistered) makes session creation *raise*
  ``RuntimeError("... remote MR size mismatch ...")``; set ``missing_remote_memory = "status"`` to get an
  ``ERR_NOT_FOUND`` status instead (MORI's source has a TODO for exactly that code).
* Offsets past a region's end, or a request above ``UINT32_MAX``, fail the status with
  ``ERR_INVALID_ARGS`` ("length out of range") before anything moves.
* Status codes go INIT -> IN_PROGRESS -> SUCCESS or ERR_*; an error code is sticky (``Update`` ignores
  later updates once failed).

Differences, on purpose: both engines live in one process and completions are driven by status queries
(``polls_to_complete`` queries of ``Code()``/``InProgress()``/... complete a session, standing in for
MORI's CQ thread); bytes really move, with ``ctypes.memmove``, when a session completes. ``wait_all`` /
``Wait`` complete at once and are counted in ``blocking_waits`` (an asyncio adapter must never call them).
Scripted faults: :meth:`FakeMori.fail_next`, :meth:`FakeMori.kill`, ``rdma_available = False``.

Install with :func:`install` (``sys.modules["mori"]`` and ``sys.modules["mori.io"]``).
"""

from __future__ import annotations

import ctypes
import enum
import os
import socket
import sys
import threading
import types
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = ["FakeMori", "install"]

_UINT32_MAX = 2**32 - 1
_ERR_BEGIN = 10


class BackendType(enum.Enum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(enum.Enum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.Enum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


class PollCqMode(enum.Enum):
    POLLING = 0
    EVENT = 1


class IOEngineConfig:
    def __init__(self, host: str = "", port: int = 0) -> None:
        self.host = host
        self.port = port


class RdmaBackendConfig:
    def __init__(
        self,
        qp_per_transfer: int = 1,
        post_batch_size: int = -1,
        num_worker_threads: int = -1,
        poll_cq_mode: PollCqMode = PollCqMode.POLLING,
        enable_notification: bool = True,
        notif_per_qp: int = 1024,
        enable_transfer_chunking: bool = False,
        chunk_bytes: int = 65536,
        max_chunks_per_transfer: int = 64,
        num_nics_per_transfer: int = 1,
    ) -> None:
        self.qp_per_transfer = qp_per_transfer
        self.post_batch_size = post_batch_size
        self.num_worker_threads = num_worker_threads
        self.poll_cq_mode = poll_cq_mode
        self.enable_notification = enable_notification
        self.notif_per_qp = notif_per_qp
        self.enable_transfer_chunking = enable_transfer_chunking
        self.chunk_bytes = chunk_bytes
        self.max_chunks_per_transfer = max_chunks_per_transfer
        self.num_nics_per_transfer = num_nics_per_transfer


@dataclass(frozen=True)
class EngineDesc:
    key: str
    node_id: str
    hostname: str
    host: str
    port: int
    pid: int

    def pack(self) -> bytes:
        return msgspec.msgpack.encode([self.key, self.node_id, self.hostname, self.host, self.port, self.pid])

    @staticmethod
    def unpack(data: bytes) -> EngineDesc:
        key, node_id, hostname, host, port, pid = msgspec.msgpack.decode(data)
        return EngineDesc(key, node_id, hostname, host, port, pid)


@dataclass(frozen=True)
class MemoryDesc:
    engine_key: str = ""
    id: int = 0
    device_id: int = -1
    device_bus_id: str = ""
    data: int = 0
    size: int = 0
    loc: MemoryLocationType = MemoryLocationType.Unknown
    ipc_handle: bytes = bytes(64)
    numa_node: int = -1

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(
            [self.engine_key, self.id, self.device_id, self.device_bus_id, self.data, self.size,
             self.loc.value, self.ipc_handle, self.numa_node]
        )

    @staticmethod
    def unpack(data: bytes) -> MemoryDesc:
        key, mid, dev, bus, ptr, size, loc, ipc, numa = msgspec.msgpack.decode(data)
        return MemoryDesc(key, mid, dev, bus, ptr, size, MemoryLocationType(loc), ipc, numa)


class TransferStatus:
    def __init__(self) -> None:
        self._code = StatusCode.INIT
        self._msg = ""
        self._progress: Callable[[], None] | None = None
        self._owner: FakeMori | None = None

    def _poll(self) -> None:
        if self._code is StatusCode.IN_PROGRESS and self._progress is not None:
            self._progress()

    def Code(self) -> StatusCode:
        self._poll()
        return self._code

    def Message(self) -> str:
        return self._msg

    def Update(self, code: StatusCode, message: str) -> None:
        if self._code.value > _ERR_BEGIN:
            return
        self._msg = message
        self._code = code

    def Init(self) -> bool:
        return self.Code() is StatusCode.INIT

    def InProgress(self) -> bool:
        return self.Code() is StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:
        return self.Code() is StatusCode.SUCCESS

    def Failed(self) -> bool:
        return self.Code().value > _ERR_BEGIN

    def SetCode(self, code: StatusCode) -> None:
        self._code = code

    def SetMessage(self, message: str) -> None:
        self._msg = message

    def Wait(self) -> None:
        self.WaitFor(-1)

    def WaitFor(self, timeout_ms: int = -1) -> StatusCode:
        (self._owner or _fake()).blocking_waits += 1
        while self._code is StatusCode.IN_PROGRESS and self._progress is not None:
            self._progress()
        return self._code


@dataclass
class _Session:
    """One posted (local, remote) pair: completes after ``polls`` status queries."""

    fake: FakeMori
    initiator: str
    local: MemoryDesc
    remote: MemoryDesc
    entries: list[tuple[int, int, int]]
    status: TransferStatus
    uid: int
    is_read: bool
    polls: int
    fault: tuple[StatusCode, str] | None

    def progress(self) -> None:
        with self.fake.lock:
            if self.status._code is not StatusCode.IN_PROGRESS:
                return
            self.polls -= 1
            if self.polls <= 0:
                self._complete()

    def _complete(self) -> None:
        if self.fault is not None:
            self.status.Update(*self.fault)
            return
        target = self.fake.engines.get(self.remote.engine_key)
        live = None if target is None else target.mem_pool.get(self.remote.id)
        if live is None or live.data != self.remote.data:
            self.status.Update(
                StatusCode.ERR_RDMA_OP,
                "remote access error; verify the remote buffer is still registered, rkey/permissions",
            )
            return
        for loff, roff, size in self.entries:
            local_addr, remote_addr = self.local.data + loff, self.remote.data + roff
            if self.is_read:
                ctypes.memmove(local_addr, remote_addr, size)
            else:
                ctypes.memmove(remote_addr, local_addr, size)
        self.status.Update(StatusCode.SUCCESS, "success")
        self.fake.bytes_moved += sum(s for _l, _r, s in self.entries)
        assert target is not None
        inbound = TransferStatus()
        inbound.SetCode(StatusCode.SUCCESS)
        target.inbound[(self.initiator, self.uid)] = inbound


class IOEngineSession:
    def __init__(self, engine: IOEngine, local: MemoryDesc, remote: MemoryDesc) -> None:
        self._engine = engine
        self._local = local
        self._remote = remote

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self._one([local_offset], [remote_offset], [size], uid, True)

    def write(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self._one([local_offset], [remote_offset], [size], uid, False)

    def batch_read(self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int],
                   uid: int) -> TransferStatus:
        return self._one(local_offsets, remote_offsets, sizes, uid, True)

    def batch_write(self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int],
                    uid: int) -> TransferStatus:
        return self._one(local_offsets, remote_offsets, sizes, uid, False)

    def _one(self, lo: Sequence[int], ro: Sequence[int], sizes: Sequence[int], uid: int, is_read: bool
             ) -> TransferStatus:
        status = TransferStatus()
        self._engine._post(self._local, lo, self._remote, ro, sizes, status, uid, is_read)
        return status

    def alive(self) -> bool:
        return True


class IOEngine:
    def __init__(self, key: str, config: IOEngineConfig) -> None:
        fake = self._fake = _fake()  # bound for life: a later install() does not disturb this engine
        with fake.lock:
            if key in fake.engines:
                raise RuntimeError(f"fake MORI: engine key {key!r} already exists in this process")
            self.config = config
            host = socket.gethostname()
            self._desc = EngineDesc(key, host, host, config.host, config.port, os.getpid())
            self._backends: set[BackendType] = set()
            self.remotes: dict[str, EngineDesc] = {}
            self.mem_pool: dict[int, MemoryDesc] = {}
            self.sessions: set[tuple[int, str, int]] = set()
            self.inbound: dict[tuple[str, int], TransferStatus] = {}
            self._next_mem = 0
            self._next_uid = 0
            fake.engines[key] = self

    def get_engine_desc(self) -> EngineDesc:
        return self._desc

    def create_backend(self, type: BackendType, config: Any = None) -> None:
        fake = self._fake
        if type is not BackendType.RDMA:
            raise NotImplementedError("fake MORI implements the RDMA backend only")
        with fake.lock:
            if type in self._backends:
                return
            if not fake.rdma_available:
                raise RuntimeError(
                    "no active RDMA device on this host; set MORI_DISABLE_AUTO_XGMI=0 to enable XGMI-only fallback"
                )
            if self.config.port == 0:
                fake.next_port += 1
                d = self._desc
                self._desc = EngineDesc(d.key, d.node_id, d.hostname, d.host, fake.next_port, d.pid)
                self.config.port = fake.next_port
            self._backends.add(type)

    def remove_backend(self, type: BackendType) -> None:
        self._backends.discard(type)

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        if self._backends:
            self.remotes[engine_desc.key] = engine_desc

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        self.remotes.pop(engine_desc.key, None)
        self.sessions = {s for s in self.sessions if s[1] != engine_desc.key}

    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType) -> MemoryDesc:
        with self._fake.lock:
            md = MemoryDesc(self._desc.key, self._next_mem, device_id, "", ptr, size, mem_loc)
            self._next_mem += 1
            self.mem_pool[md.id] = md
            return md

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        device_id = tensor.device.index if tensor.device.index is not None else -1
        loc = MemoryLocationType.CPU if tensor.device.type == "cpu" else MemoryLocationType.GPU
        return self.register_memory(tensor.data_ptr(), tensor.nelement() * tensor.element_size(), device_id, loc)

    def deregister_memory(self, mem_desc: MemoryDesc) -> None:
        with self._fake.lock:
            self.mem_pool.pop(mem_desc.id, None)
            self.sessions = {s for s in self.sessions if s[0] != mem_desc.id}

    def allocate_transfer_uid(self) -> int:
        with self._fake.lock:
            self._next_uid += 1
            return self._next_uid - 1

    def read(self, local: MemoryDesc, local_offset: int, remote: MemoryDesc, remote_offset: int, size: int,
             uid: int) -> TransferStatus:
        status = TransferStatus()
        self._post(local, [local_offset], remote, [remote_offset], [size], status, uid, True)
        return status

    def write(self, local: MemoryDesc, local_offset: int, remote: MemoryDesc, remote_offset: int, size: int,
              uid: int) -> TransferStatus:
        status = TransferStatus()
        self._post(local, [local_offset], remote, [remote_offset], [size], status, uid, False)
        return status

    def batch_read(self, *args: Any) -> list[TransferStatus]:
        return self._batch(*args, is_read=True)

    def batch_write(self, *args: Any) -> list[TransferStatus]:
        return self._batch(*args, is_read=False)

    def _batch(
        self,
        local_mds: Sequence[MemoryDesc],
        local_offsets: Sequence[Sequence[int]],
        remote_mds: Sequence[MemoryDesc],
        remote_offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        uids: Sequence[int],
        *,
        is_read: bool,
    ) -> list[TransferStatus]:
        statuses = [TransferStatus() for _ in range(len(sizes))]
        n = len(local_mds)
        if not (n == len(remote_mds) == len(local_offsets) == len(remote_offsets) == len(sizes) == len(uids)):
            raise RuntimeError("fake MORI: session vectors differ in length (an assert in MORI's BatchWrite)")
        for i in range(n):
            if not self._post(local_mds[i], local_offsets[i], remote_mds[i], remote_offsets[i], sizes[i],
                              statuses[i], uids[i], is_read):
                break  # MORI returns from the whole call: later statuses stay INIT
        return statuses

    def _post(
        self,
        local: MemoryDesc,
        local_offsets: Sequence[int],
        remote: MemoryDesc,
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        status: TransferStatus,
        uid: int,
        is_read: bool,
    ) -> bool:
        """One session, as IOEngine::BatchWrite + RdmaBackend do; False = routing failed (stop the batch)."""
        fake = self._fake
        with fake.lock:
            if BackendType.RDMA not in self._backends or remote.engine_key not in self.remotes:
                status.Update(StatusCode.ERR_BAD_STATE, "No available backend found, create backend first")
                return False
            if len(sizes) == 0:
                status.SetCode(StatusCode.SUCCESS)
                return True
            key = (local.id, remote.engine_key, remote.id)
            if key not in self.sessions:
                target = fake.engines.get(remote.engine_key)
                live = None if target is None else target.mem_pool.get(remote.id)
                if live is None or live.size != remote.size:
                    if fake.missing_remote_memory == "status":
                        status.Update(StatusCode.ERR_NOT_FOUND, f"remote memory {remote.id} is not registered")
                        return True
                    raise RuntimeError(
                        f"RdmaBackend::CreateSession: remote MR size mismatch for engine {remote.engine_key} "
                        f"rdevId=0 memId={remote.id} expected={remote.size} got=0"
                    )
                self.sessions.add(key)
            status.SetCode(StatusCode.IN_PROGRESS)
            if not len(local_offsets) == len(remote_offsets) == len(sizes):
                status.Update(StatusCode.ERR_INVALID_ARGS, "lengths of local offsets, remote offsets or sizes mismatch")
                return True
            entries = list(zip(local_offsets, remote_offsets, sizes, strict=True))
            for lo, ro, size in entries:
                if size > _UINT32_MAX:
                    status.Update(StatusCode.ERR_INVALID_ARGS,
                                  f"single request size {size} exceeds UINT32_MAX; split it before submitting")
                    return True
                if lo + size > local.size or ro + size > remote.size:
                    status.Update(StatusCode.ERR_INVALID_ARGS, "length out of range")
                    return True
            fault = fake.faults.popleft() if fake.faults else None
            session = _Session(fake, self._desc.key, local, remote, entries, status, uid, is_read,
                               fake.polls_to_complete, fault)
            status._progress = session.progress
            status._owner = fake
            fake.sessions_posted += 1
            return True

    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc) -> IOEngineSession | None:
        if BackendType.RDMA not in self._backends or remote_mem.engine_key not in self.remotes:
            return None
        return IOEngineSession(self, local_mem, remote_mem)

    def pop_inbound_transfer_status(self, remote_key: str, transfer_uid: int) -> TransferStatus | None:
        with self._fake.lock:
            return self.inbound.pop((remote_key, transfer_uid), None)

    def wait_all(self, statuses: Sequence[TransferStatus], timeout_ms: int = -1) -> StatusCode:
        first_error = StatusCode.SUCCESS
        for st in statuses:
            code = st.WaitFor(timeout_ms)
            if code is not StatusCode.SUCCESS and first_error is StatusCode.SUCCESS:
                first_error = code
        return first_error


def set_log_level(level: str) -> None:
    _fake().log_level = level


@dataclass
class FakeMori:
    """The fake's process state and fault script."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    engines: dict[str, IOEngine] = field(default_factory=dict)
    polls_to_complete: int = 2
    """Status queries before a posted session completes."""
    rdma_available: bool = True
    missing_remote_memory: str = "raise"
    """``"raise"`` (what MORI does today) or ``"status"`` (an ERR_NOT_FOUND status)."""
    faults: deque[tuple[StatusCode, str]] = field(default_factory=deque)
    blocking_waits: int = 0
    sessions_posted: int = 0
    bytes_moved: int = 0
    next_port: int = 40000
    log_level: str = ""

    def fail_next(self, code: StatusCode = StatusCode.ERR_RDMA_OP, message: str = "injected RDMA failure") -> None:
        """The next posted session fails at completion with ``code`` (nothing is written)."""
        self.faults.append((code, message))

    def kill(self, key: str) -> None:
        """The engine ``key`` disappears: sessions in flight to it fail with ERR_RDMA_OP."""
        with self.lock:
            self.engines.pop(key, None)


_STATE: FakeMori | None = None


def _fake() -> FakeMori:
    if _STATE is None:
        raise RuntimeError("fake MORI is not installed")
    return _STATE


def install(setitem: Callable[[Any, str, Any], None] | None = None) -> FakeMori:
    """Put fresh ``mori`` / ``mori.io`` modules in ``sys.modules``; returns the fake's state.

    Pass ``monkeypatch.setitem`` so pytest restores ``sys.modules`` afterwards.
    """
    global _STATE
    _STATE = FakeMori()
    io = types.ModuleType("mori.io")
    for obj in (IOEngine, IOEngineSession, IOEngineConfig, StatusCode, BackendType, EngineDesc, MemoryDesc,
                MemoryLocationType, PollCqMode, RdmaBackendConfig, TransferStatus, set_log_level):
        setattr(io, obj.__name__, obj)
    pkg = types.ModuleType("mori")
    pkg.__path__ = []
    pkg.__version__ = "0.0.0+fake"  # type: ignore[attr-defined]
    pkg.io = io  # type: ignore[attr-defined]
    put = setitem if setitem is not None else _plain_setitem
    put(sys.modules, "mori", pkg)
    put(sys.modules, "mori.io", io)
    return _STATE


def _plain_setitem(mapping: Any, key: str, value: Any) -> None:
    mapping[key] = value
