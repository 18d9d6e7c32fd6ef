"""NVIDIA NIXL adapter (``nixl`` / ``nixl_cu12`` / ``nixl_cu13``, UCX backend).

Install on CPU hosts with ``pip install --no-deps nixl-cu12 numpy``: a plain ``pip install nixl-cu12``
also pulls a multi-GB CUDA build of torch that NIXL only uses for type hints. On GPU hosts use
``pip install nixl-cu12`` (CUDA 12) or ``pip install nixl-cu13`` (CUDA 13).

One NIXL agent per adapter, named ``aiotransfer-<host>-<pid>-<random>``; that name is the session id.

=====================  ==================================  ===============  ===========================
method                 blocks?                             GIL released     thread (who calls it)
=====================  ==================================  ===============  ===========================
``__init__``           yes: agent + UCX init (~0.2 s)      no               driver
``register``           short (memory registration)         yes (binding)    driver (agent lock)
``connect``            short: loads the peer's metadata,   yes (binding)    driver (agent lock)
                       then ``make_connection``
``submit_write``       short: indexes lists prepared once  while NIXL       driver (agent lock)
                       (or builds NumPy descriptor lists), creates/posts
                       then a non-blocking post
``try_submit_inline``  as ``submit_write``; None at once   while NIXL       event loop; tries the agent
                       when the agent lock is taken        posts            lock, never waits
``check``              no (~1 us)                          yes (binding)    event loop; tries the lock
``abandon``            short (releases the native handle)  yes              event loop (agent lock)
``close``              short                               partly           driver (agent lock)
=====================  ==================================  ===============  ===========================

NIXL calls must be serialised per agent: the poll loop calls ``check`` from the event-loop thread
while ``submit_write`` runs on the driver thread (``transfer()`` may copy inline over shared memory),
so every agent call takes one ``threading.Lock``; ``check`` only tries it and answers PENDING when a
submit holds it, so the event loop never waits for a copy. A handle is ``make_prepped_xfer`` (a write of
equal entries on their length's boundaries, from lists prepared once: :mod:`._nixl_lists`) or
``initialize_xfer``, then ``transfer`` and ``check_xfer_state``; only DONE is terminal (see :meth:`NixlEngine.check` and docs/engines.md): the
native xfer handle is released when DONE is seen, or, for a write NIXL answered ERR or raised for, only
when the release quarantine has passed (:meth:`NixlEngine.abandon`). A
:class:`~aiotransfer.engines.TransferHandle` is never queried twice. Handles that fail to release
are kept in a ledger, retried at :meth:`NixlEngine.close` and logged.

``local_info()`` is a small envelope (msgpack): the agent metadata plus the table of registered
regions (address, size, DRAM/VRAM, device id), because a remote descriptor must name the peer's
memory type and device. It is a snapshot: memory registered after the peer connected is unknown to it.

Environment defaults, set before the first agent (an explicit value wins): ``NIXL_LOG_LEVEL`` from the
config's ``engine_log_level`` (NIXL otherwise logs INFO lines to stdout), and, on hosts without an RDMA
device, ``UCX_MODULES=^ib*``: the wheel's bundled libibverbs otherwise loads the system's rdma-core
providers, two copies of libnl end up in the process and it segfaults at exit.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import importlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from .._config import TransferConfig
from .._plan import Blocks
from ..errors import ClosedError, EngineError, EngineUnavailable
from ._base import EngineStatus, EngineTraits, MemoryRegion, TransferHandle
from ._common import AgentEngine, RegionIndex, block_arrays, map_errors, quietly
from ._nixl_lists import MIN_ENTRIES, PreparedLists

__all__ = ["NixlEngine", "nixl_env_defaults"]

log = logging.getLogger("aiotransfer.engines.nixl")

_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")  # the meta package picks by CUDA version
_INSTALL_HINT = (
    "pip install --no-deps nixl-cu12 numpy (CPU hosts: the plain install pulls a multi-GB CUDA torch "
    "build that NIXL only needs for type hints); on GPU hosts pip install nixl-cu12 (CUDA 12) or "
    "nixl-cu13 (CUDA 13)"
)
_MEM_TYPES = ("DRAM", "VRAM")
_INFO_VERSION = 1
_NIXL_LEVELS = {"WARNING": "WARN", "CRITICAL": "FATAL"}


def nixl_env_defaults(environ: Mapping[str, str], *, log_level: str, has_rdma_device: bool) -> dict[str, str]:
    """Variables to ``setdefault`` before the first agent exists (pure; an explicit value wins)."""
    level = log_level.strip().upper()
    out = {"NIXL_LOG_LEVEL": _NIXL_LEVELS.get(level, level)}
    if not has_rdma_device:
        out["UCX_MODULES"] = "^ib*"
    return {k: v for k, v in out.items() if k not in environ}


def _has_rdma_device() -> bool:
    try:
        return any(os.scandir("/sys/class/infiniband"))
    except OSError:
        return False


def _import_api(config: TransferConfig, environ: MutableMapping[str, str]) -> Any:
    for key, value in nixl_env_defaults(
        environ, log_level=config.engine_log_level, has_rdma_device=_has_rdma_device()
    ).items():
        environ.setdefault(key, value)
    errors: list[str] = []
    for name in _MODULES:
        module = _try_import(name, errors)
        if module is not None:
            return module
    raise EngineUnavailable(f"NIXL cannot be loaded ({'; '.join(errors)}); {_INSTALL_HINT}")


def _try_import(name: str, errors: list[str]) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        errors.append(f"{name}: {exc}")
        return None


_AGENT_LOCK = threading.Lock()


def _create_agent(api: Any, name: str, delay_us: int) -> tuple[Any, int]:
    """A UCX agent; with ``delay_us`` > 0 its progress thread sleeps up to that long between polls.

    NIXL's Python agent fixes the delay at 0 (``pthrDelay``) on the native config it builds, so the native
    config class is swapped, while the agent is built, for one that keeps the delay asked for. Returns the
    delay in effect: 0 when this NIXL build has no such setting (logged)."""
    config = api.nixl_agent_config(backends=["UCX"])
    if delay_us <= 0:
        return api.nixl_agent(name, config), 0
    binding = getattr(api, "nixlBind", None)
    native = getattr(binding, "nixlAgentConfig", None)
    field: Any = getattr(native, "pthrDelay", None)
    if binding is None or native is None or not hasattr(field, "__set__"):
        log.warning("this NIXL build does not expose its progress thread delay; nixl_progress_delay_us ignored")
        return api.nixl_agent(name, config), 0

    class _DelayedConfig(native):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(field.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            field.__set__(self, max(int(value), delay_us))

    class _Binding:
        """The binding module, with the config class swapped."""

        nixlAgentConfig = _DelayedConfig

        def __getattr__(self, attr: str) -> Any:
            return getattr(binding, attr)

    with _AGENT_LOCK:
        api.nixlBind = _Binding()
        try:
            return api.nixl_agent(name, config), delay_us
        finally:
            api.nixlBind = binding


def _memory_kind(device: str) -> tuple[int, int]:
    """(index into _MEM_TYPES, device id) for a MemoryRegion device string."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return 0, 0
    if kind == "cuda" and (not index or index.isdigit()):
        return 1, int(index or 0)
    raise EngineError(f"NIXL adapter cannot register device {device!r}: expected 'cpu' or 'cuda:N'")


class _RegionTable:
    """Sorted registered regions (address, size, kind, device id); maps addresses to their row in bulk."""

    def __init__(self, rows: Sequence[tuple[int, int, int, int]]) -> None:
        self.rows: list[tuple[int, int, int, int]] = sorted((int(a), int(b), int(c), int(d)) for a, b, c, d in rows)
        arr = np.array(self.rows, dtype=np.uint64).reshape(-1, 4)
        self.index = RegionIndex([(a, n) for a, n, _k, _d in self.rows])
        self.kinds = arr[:, 2].copy()
        self.devs = arr[:, 3].copy()
        self._starts = [r[0] for r in self.rows]

    def few_descs(self, addrs: list[int], lengths: list[int], what: str) -> tuple[str, npt.NDArray[np.uint64]]:
        """:func:`_descs` for a handful of entries, in plain Python (a bisection per address instead of a
        dozen NumPy calls: 4 us for a two-entry write's two sides instead of 19 us)."""
        rows, held = self.rows, []
        for a in addrs:
            i = bisect.bisect_right(self._starts, a) - 1
            if i < 0 or a >= rows[i][0] + rows[i][1]:
                raise EngineError(f"{what} address {a:#x} is not inside any registered region")
            held.append(rows[i])
        if any(r[2] != held[0][2] for r in held):
            raise EngineError(_MIXED.format(what=what))
        out = [(a, n, r[3]) for a, n, r in zip(addrs, lengths, held, strict=True)]
        return _MEM_TYPES[held[0][2]], np.array(out, dtype=np.uint64).reshape(-1, 3)

    def locate(self, addrs: npt.NDArray[np.uint64], what: str) -> npt.NDArray[np.intp]:
        """Row of the region holding each address; raises EngineError naming the first stray one."""
        return self.index.locate(addrs, what)[0]


class _PeerInfo(msgspec.Struct, frozen=True, array_like=True):
    version: int
    agent: str
    metadata: bytes
    regions: list[tuple[int, int, int, int]]


@dataclass
class _Peer:
    info: bytes
    name: str
    table: _RegionTable
    lists: PreparedLists | None = None
    """The peer's blocks, prepared at the first write to it that can use them."""


@dataclass
class _Xfer:
    """What a TransferHandle's token holds: the native xfer handle, until released."""

    native: Any
    released: bool = False


class NixlEngine(AgentEngine):
    """NIXL adapter with one agent per instance (see module docstring)."""

    name = "nixl"
    traits = EngineTraits(entry_cost_s=6e-6, bandwidth_bps=8.0e9)
    """Not ``cheap_submit``: ``transfer()`` may copy inline over UCX shared memory, so writes are submitted
    from the executor, except small ones, and up to 1 MiB while nothing else is in flight, that find the agent
    free (:meth:`try_submit_inline`). Not
    ``quiet_threads``: UCX's progress thread polls. Staging constants measured over shared memory (with
    ``UCX_TLS=tcp``: 12 us and 1.2 GB/s, set per instance)."""
    inline_max_bytes = 64 * 1024
    """Writes up to this size may be posted from the event loop at any time: the inline copy takes ~10-40 us,
    less than the hop to the executor and back (4 KiB end to end over shared memory: see docs/performance.md)."""
    inline_alone_max_bytes = 1024 * 1024
    """Writes up to this size may be posted from the event loop while no other write of this agent is in
    flight: the copy (0.1-0.2 ms for 1 MiB over shared memory) then costs less than the two thread hops
    through the executor it saves (~0.1 ms each way on a 2-vCPU host; docs/performance.md, fourth cut)."""
    inline_max_entries = 8
    """Writes of up to this many entries may be posted from the event loop with descriptor lists built for
    them (about 6 us an entry)."""
    inline_prepared_max_entries = 64
    """Writes of up to this many entries may be posted from the event loop when they are made from descriptor
    lists the driver has already prepared (index arrays, no per-entry list): UCX's post of the entries is
    then the cost, as for a raw caller."""

    def __init__(self, config: TransferConfig) -> None:
        api = _import_api(config, os.environ)
        self._api = api
        self._agent_name = f"aiotransfer-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        with map_errors("NIXL agent creation failed"):
            agent, self._progress_delay_us = _create_agent(api, self._agent_name, config.nixl_progress_delay_us)
        if "UCX" not in agent.backends:
            raise EngineUnavailable(
                f"NIXL has no UCX backend here (plugins: {', '.join(agent.get_plugin_list())}); "
                "reinstall the nixl wheel or set NIXL_PLUGIN_DIR"
            )
        self._agent: Any = agent
        self._lock = threading.Lock()
        self._regions: dict[MemoryRegion, tuple[Any, int]] = {}  # region -> (reg descs, refcount)
        self._local = _RegionTable([])
        self._peers: dict[str, _Peer] = {}
        self._live: set[TransferHandle] = set()
        self._forgotten: set[str] = set()
        """Peers to remove once their last live write ends (see ``forget_peer``)."""
        self._unreleased: list[Any] = []
        self._local_lists: PreparedLists | None = None
        self._retired_lists: list[Any] = []
        """Prepared lists of regions or peers since replaced: a made transfer may still use them (see close)."""
        self.prepared_writes = 0
        self._closed = False
        tls = os.environ.get("UCX_TLS", "").strip()
        self._transport = f"ucx({tls})" if tls else "ucx"
        if tls and "tcp" in tls and not any(t in tls for t in ("shm", "cma", "rc", "dc", "ud")):
            self.traits = dataclasses.replace(self.traits, entry_cost_s=12e-6, bandwidth_bps=1.2e9)  # measured
        log.info("NIXL agent up: %s via %s (transport %s)", self._agent_name, api.__name__, self._transport)

    # -- identity ------------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self._agent_name

    @property
    def transport(self) -> str:
        return self._transport

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "session_id": self._agent_name,
            "transport": self._transport,
            "backend": "UCX",
            "module": self._api.__name__,
            "regions": len(self._regions),
            "peers": len(self._peers),
            "in_flight": len(self._live),
            "unreleased_handles": len(self._unreleased),
            "prepared_writes": self.prepared_writes,
            "progress_delay_us": self._progress_delay_us,
        }

    def _check_open(self) -> Any:
        if self._closed:
            raise ClosedError("NIXL engine is closed")
        return self._agent

    def local_info(self) -> bytes:
        with self._lock:
            agent = self._check_open()
            with map_errors("NIXL get_agent_metadata failed"):
                metadata = agent.get_agent_metadata()
            rows = list(self._local.rows)
        return msgspec.msgpack.encode(_PeerInfo(_INFO_VERSION, self._agent_name, bytes(metadata), rows))

    # -- memory --------------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            agent = self._check_open()
            for r in regions:
                held = self._regions.get(r)
                if held is not None:
                    self._regions[r] = (held[0], held[1] + 1)
                    continue
                kind, dev = _memory_kind(r.device)
                with map_errors(f"NIXL register_memory({r.ptr:#x}, {r.nbytes}, {r.device}) failed"):
                    descs = agent.register_memory([(r.ptr, r.nbytes, dev, "")], _MEM_TYPES[kind])
                self._regions[r] = (descs, 1)
            self._rebuild_local()

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            if self._closed:
                return  # close() deregistered everything
            agent = self._agent
            for r in regions:
                held = self._regions.get(r)
                if held is None:
                    continue
                descs, count = held
                if count > 1:
                    self._regions[r] = (descs, count - 1)
                    continue
                del self._regions[r]
                quietly(log, f"NIXL deregister_memory({r.ptr:#x})", agent.deregister_memory, descs)
            self._rebuild_local()

    def _rebuild_local(self) -> None:
        self._local = _RegionTable([(r.ptr, r.nbytes, *_memory_kind(r.device)) for r in self._regions])
        if self._local_lists is not None:
            self._retired_lists.extend(self._local_lists.handles())
            self._local_lists = None

    # -- peers ---------------------------------------------------------------------------------
    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None:
        """Load the peer's agent metadata (idempotent) and open the UCX connection now."""
        if not peer_info:
            raise EngineError(
                f"no NIXL metadata from peer {peer}: its Hello carried empty engine info "
                "(is the peer running a NIXL engine?)"
            )
        try:
            info = msgspec.msgpack.decode(peer_info, type=_PeerInfo)
        except msgspec.DecodeError as exc:
            raise EngineError(f"malformed NIXL peer info from {peer}: {exc}") from exc
        if info.version != _INFO_VERSION:
            raise EngineError(f"NIXL peer info version {info.version} from {peer}; expected {_INFO_VERSION}")
        if info.agent != peer:
            raise EngineError(f"NIXL peer info from {peer!r} describes agent {info.agent!r}")
        if not info.metadata:
            raise EngineError(f"NIXL peer {peer} sent empty agent metadata")
        if any(kind >= len(_MEM_TYPES) for _p, _n, kind, _d in info.regions):
            raise EngineError(f"NIXL peer info from {peer} names an unknown memory type")
        with self._lock:
            agent = self._check_open()
            self._forgotten.discard(peer)
            known = self._peers.get(peer)
            if known is not None and known.info == peer_info:
                return
            with map_errors(f"NIXL add_remote_agent for {peer} failed"):
                loaded = agent.add_remote_agent(info.metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer:
                self._remove_remote(agent, name)
                raise EngineError(f"NIXL metadata for {peer!r} describes agent {name!r}")
            try:
                with map_errors(f"NIXL make_connection to {peer} failed"):
                    agent.make_connection(name)
            except EngineError:
                self._remove_remote(agent, name)
                raise
            if known is not None and known.lists is not None:
                self._retired_lists.extend(known.lists.handles())
            self._peers[peer] = _Peer(peer_info, name, _RegionTable(info.regions))

    def forget_peer(self, peer: str) -> None:
        """Drop a peer declared dead. While writes to it are live the removal waits for them to end: NIXL
        invalidates a removed agent's handles (``getXferStatus`` then answers NOT_FOUND without asking UCX,
        whose requests may still run)."""
        with self._lock:
            self._forgotten.add(peer)
            self._forget_if_idle(peer)

    @staticmethod
    def _remove_remote(agent: Any, name: str) -> None:
        quietly(log, f"NIXL remove_remote_agent({name})", agent.remove_remote_agent, name)

    # -- transfers -----------------------------------------------------------------------------
    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        if len(blocks) == 0:
            raise EngineError("empty transfer batch")
        with self._lock:
            handle = self._submit_locked(peer, blocks, prepare=True)
        assert handle is not None
        return handle

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        """Post a small write from the calling (event-loop) thread if the agent is free right now; None
        (nothing posted) when the write is too large (bytes, or entries: more than ``inline_max_entries``
        unless it is made from lists the driver has already prepared), or another thread holds the agent, so
        the caller goes through the driver. Never waits for the lock, and never prepares a list."""
        n = len(blocks)
        if not 0 < n <= self.inline_prepared_max_entries or blocks.nbytes > self.inline_alone_max_bytes:
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if blocks.nbytes > self.inline_max_bytes and self._live:
                return None  # other writes are in flight: a large copy waits in the executor, not on the loop
            return self._submit_locked(peer, blocks, prepare=False, built_max=self.inline_max_entries)
        finally:
            self._lock.release()

    def _submit_locked(self, peer: str, blocks: Blocks, *, prepare: bool, built_max: int | None = None) -> TransferHandle | None:
        """Post one write; the caller holds the agent lock. ``prepare``: the caller is the driver thread,
        which may prepare the descriptor lists a write of uniform entries is made from. ``built_max``: a write
        of more entries that cannot be made from prepared lists is not posted (None)."""
        n = len(blocks)
        agent = self._check_open()
        known = self._peers.get(peer)
        if known is None or peer in self._forgotten:
            raise EngineError(f"NIXL peer {peer} is not connected")
        src, dst, length = block_arrays(blocks)
        made = self._by_index(agent, known, src, dst, length, prepare) if n >= MIN_ENTRIES else None
        if made is None and built_max is not None and n > built_max:
            return None
        with map_errors(
            f"NIXL rejected a {n}-entry write to {peer}",
            hint=" (a descriptor lies outside memory registered on either side, or the peer is unknown)",
        ):
            if made is not None:
                native = agent.make_prepped_xfer("WRITE", *made)
                self.prepared_writes += 1
            else:
                local_mem, local_descs = _descs(self._local, src, length, "local source")
                remote_mem, remote_descs = _descs(known.table, dst, length, f"destination on {peer}")
                lx = agent.get_xfer_descs(local_descs, local_mem)
                rx = agent.get_xfer_descs(remote_descs, remote_mem)
                native = agent.initialize_xfer("WRITE", lx, rx, known.name)
        xfer = _Xfer(native)
        handle = TransferHandle(token=xfer, peer=peer, entries=n, nbytes=blocks.nbytes)
        try:
            with map_errors(f"NIXL transfer to {peer} failed to post"):
                state = agent.transfer(native)
        except EngineError as exc:
            if type(exc.__cause__).__name__ == _NOT_POSTED:
                self._release(xfer)  # refused by NIXL's own checks, before any request was posted
                raise
            # the backend may have posted some of the write's requests before one failed: they run on
            handle.doom(str(exc))
            state = "PROC"
        if state == "ERR":  # the binding raises instead; kept for a build that answers it
            handle.doom(f"NIXL transfer to {peer} reported ERR at its post")
        handle.landed = state == "DONE"
        self._live.add(handle)
        return handle

    def _by_index(self, agent: Any, known: _Peer, src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64],
                  length: npt.NDArray[np.uint64], prepare: bool) -> tuple[Any, Any, Any, Any] | None:
        """(local list, local indices, remote list, remote indices) of a write whose entries are all one
        length and lie on that length's boundaries on both sides (see :mod:`._nixl_lists`); None otherwise."""
        size = int(length[0])
        if size == 0 or not bool((length == length[0]).all()):
            return None
        try:
            local_kind = int(self._local.kinds[self._local.locate(src[:1], "")[0]])
            remote_kind = int(known.table.kinds[known.table.locate(dst[:1], "")[0]])
        except EngineError:
            return None  # a stray address: the descriptor path names it
        if self._local_lists is None:
            self._local_lists = PreparedLists(agent, "NIXL_INIT_AGENT", self._local.rows, self._local.index, _MEM_TYPES)
        if known.lists is None:
            known.lists = PreparedLists(agent, known.name, known.table.rows, known.table.index, _MEM_TYPES)
        local = self._local_lists.indices(src, size, local_kind, prepare=prepare)
        if local is None:
            return None
        remote = known.lists.indices(dst, size, remote_kind, prepare=prepare)
        if remote is None:
            return None
        return local[0], local[1], remote[0], remote[1]

    def check(self, handle: TransferHandle) -> EngineStatus:
        """Non-blocking, even against a concurrent submit: when the agent lock is busy (a ``transfer()``
        copying inline over shared memory on the driver thread) it answers PENDING instead of waiting.

        Only DONE is terminal. ``check_xfer_state`` answers ERR as soon as the last UCX request of the write
        failed, while its other requests may still run (``nixlUcxBackendReqH::status``), and NIXL never asks
        UCX again once it has answered ERR; an exception (the remote agent invalidated or disconnected) comes
        before NIXL looked at the requests at all; and releasing a handle whose requests still run cancels
        nothing (``ucp_request_cancel`` does not stop RMA). So ERR and exceptions doom the handle: it stays
        live, the native handle unreleased, until the release quarantine (:meth:`abandon`)."""
        handle.ensure_pending()
        if not isinstance(handle.token, _Xfer):
            raise EngineError("check() on a handle this NIXL engine did not create")
        if handle.doomed is not None:
            return EngineStatus.PENDING  # NIXL will not answer again: only the quarantine ends it
        if not self._lock.acquire(blocking=False):
            return EngineStatus.PENDING
        with contextlib.ExitStack() as held:
            held.callback(self._lock.release)
            self._check_open()
            if handle.landed:  # transfer() reported it DONE: check_xfer_state is not asked again
                return self._terminal(handle, EngineStatus.DONE)
            try:
                with map_errors(f"NIXL transfer to {handle.peer} failed"):
                    state = self._agent.check_xfer_state(handle.token.native)
            except EngineError as exc:
                handle.doom(str(exc))
                return EngineStatus.PENDING
            if state == "PROC":
                return EngineStatus.PENDING
            if state == "DONE":
                return self._terminal(handle, EngineStatus.DONE)
            handle.doom(f"NIXL transfer to {handle.peer} reported {state}")
            return EngineStatus.PENDING

    def abandon(self, handle: TransferHandle) -> None:
        """The quarantine passed without a terminal answer.

        A write NIXL still reports in progress (no error: a peer that is stopped or stalled) is kept: NIXL
        has no call that stops a posted put or closes the path to one peer while a request holds it
        (``remove_remote_agent`` leaves the connection to the request; releasing the handle cancels nothing),
        and UCX reads the source when the peer takes the bytes. Measured over UCX's TCP transport with a
        decode stopped past the quarantine: released here, every byte the scheduler then wrote into the
        pages reached the decode when it ran again. So the handle stays PENDING, its memory held, until NIXL
        answers DONE (the peer ran again) or an error (then the next abandon releases it). A doomed write
        (NIXL reported an error, after which it never answers again) is released: the native handle, NIXL
        freeing its UCX requests, and the handle ends FAILED."""
        with self._lock:
            if handle.consumed:
                return
            if not isinstance(handle.token, _Xfer):
                raise EngineError("abandon() of a handle this NIXL engine did not create")
            if self._closed:
                handle.finish(EngineStatus.FAILED, handle.doomed or "NIXL engine closed")
                return
            if handle.doomed is None:
                if not handle.extra.get("held"):
                    handle.extra["held"] = True
                    log.warning("NIXL write to %s still in progress past the quarantine: NIXL cannot cut it, so its "
                                "memory stays held until NIXL ends it", handle.peer)
                return
            self._terminal(handle, EngineStatus.FAILED, handle.doomed or "abandoned after the release quarantine")
            self._forget_if_idle(handle.peer)

    def _terminal(self, handle: TransferHandle, status: EngineStatus, error: str | None = None) -> EngineStatus:
        """Under the lock: release the native handle, then consume the TransferHandle."""
        self._live.discard(handle)
        self._release(handle.token)
        self._forget_if_idle(handle.peer)
        return handle.finish(status, error)

    def _forget_if_idle(self, peer: str) -> None:
        """Under the lock: remove a peer whose removal waited for its last live write to end."""
        if peer in self._forgotten and not any(h.peer == peer for h in self._live):
            self._forgotten.discard(peer)
            known = self._peers.pop(peer, None)
            if known is not None and known.lists is not None:
                self._retired_lists.extend(known.lists.handles())
            if known is not None and not self._closed:
                self._remove_remote(self._agent, known.name)

    def _release(self, xfer: _Xfer) -> None:
        if xfer.released:
            return
        if not quietly(log, "NIXL release_xfer_handle (kept for close)", self._agent.release_xfer_handle, xfer.native):
            self._unreleased.append(xfer.native)
        xfer.released = True

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release leftover handles, deregister memory, drop peers and the agent."""
        with self._lock:
            if self._closed:
                return
            agent = self._agent
            for handle in list(self._live):
                self._terminal(handle, EngineStatus.FAILED, "NIXL engine closed before the transfer completed")
            for descs, _count in self._regions.values():
                quietly(log, "NIXL deregister_memory at close", agent.deregister_memory, descs)
            lists = [*self._retired_lists, *(self._local_lists.handles() if self._local_lists else [])]
            lists += [h for known in self._peers.values() if known.lists is not None for h in known.lists.handles()]
            for prepared in lists:  # every transfer that could use them was released above
                quietly(log, "NIXL release_dlist_handle at close", agent.release_dlist_handle, prepared)
            self._retired_lists, self._local_lists = [], None
            self._regions.clear()
            self._local = _RegionTable([])
            for known in self._peers.values():
                self._remove_remote(agent, known.name)
            self._peers.clear()
            self._unreleased = [
                h for h in self._unreleased
                if not quietly(log, "NIXL release_xfer_handle at close", agent.release_xfer_handle, h)
            ]
            if self._unreleased:
                log.error("%d NIXL xfer handles could not be released; they leak with the agent", len(self._unreleased))
            self._closed = True
            self._agent = None

    def raw(self) -> Any:
        """The native ``nixl_agent`` (benchmarks and diagnostics only)."""
        return self._check_open()


_NOT_POSTED = "nixlNotFoundError"
"""The one exception ``transfer()`` raises before the backend posted anything (the remote agent or its
generation is gone: ``nixlAgent::postXferReq``); after any other, requests may be in flight."""
_FEW_DESCS = 8
_MIXED = "{what}: one NIXL transfer cannot mix DRAM and VRAM; split the batch"
"""Up to this many entries, a write's descriptors are built in plain Python (:meth:`_RegionTable.few_descs`)."""


def _descs(
    table: _RegionTable, addrs: npt.NDArray[np.uint64], length: npt.NDArray[np.uint64], what: str
) -> tuple[str, npt.NDArray[np.uint64]]:
    """(memory type, Nx3 [addr, len, dev] uint64) for one side of a transfer."""
    if 0 < addrs.shape[0] <= _FEW_DESCS:
        return table.few_descs(addrs.tolist(), length.tolist(), what)
    return _descs_vectorised(table, addrs, length, what)


def _descs_vectorised(
    table: _RegionTable, addrs: npt.NDArray[np.uint64], length: npt.NDArray[np.uint64], what: str
) -> tuple[str, npt.NDArray[np.uint64]]:
    idx = table.locate(addrs, what)
    kinds = np.unique(table.kinds[idx])
    if kinds.size != 1:
        raise EngineError(_MIXED.format(what=what))
    out = np.empty((addrs.shape[0], 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = length
    out[:, 2] = table.devs[idx]
    return _MEM_TYPES[int(kinds[0])], out
