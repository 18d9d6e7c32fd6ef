"""Mooncake TransferEngine adapter (``mooncake.engine``).

Install: ``pip install aiotransfer[mooncake-cpu]`` (``mooncake-transfer-engine-non-cuda``) on hosts without
an NVIDIA driver, ``aiotransfer[mooncake]`` (``mooncake-transfer-engine``) on CUDA 12 hosts,
``aiotransfer[mooncake-cuda13]`` on CUDA 13 hosts (:func:`~aiotransfer.engines.recommended_wheels`).
The wheels are mutually exclusive (same ``mooncake`` package); the CUDA ones fail to import without
``libcuda.so.1``.

Call by call (measured facts and the binding's source, see docs/engines.md):

==============================  ===============================  ============  =========================
method                          blocks?                          GIL released  thread (who calls it)
==============================  ===============================  ============  =========================
``__init__``                    yes (engine init, ~ms)           no            driver
``register``/``deregister``     no (metadata only on TCP)        yes (batch)   driver
``connect``                     yes: metadata request (bounded   yes           driver; takes the
                                by ``handshake_timeout``), then                engine's mutex for the
                                the engine's own handshake                     handshake
``try_submit_inline``           short (~20 us per entry);        yes           event loop; never waits:
                                None while a handshake runs                    falls back to the driver
``submit_write``                short (~20 us per entry)         yes           driver
``check``                       no (~5 us), no engine lock       yes           event loop
``abandon``                     no: shuts the peer's sockets     n/a           driver
                                down (scans /proc/self/fd)
==============================  ===============================  ============  =========================

Every write is posted entry by entry (``transfer_submit_write``) and every entry polled with
``transfer_check_status``, the binding's one answer that is terminal entry by entry: 1 and -1 end the entry
and free its id, -2 (timeout) does not (the entry still runs; the handle is doomed and asked again). A
multi-entry batch (``batch_transfer_async_write``) is not used: ``get_batch_transfer_status`` answers -1 on a
timeout or on the first failed entry while others still run, and the batch can never be asked again after
that (it frees the ids it can; docs/engines.md). Native ids are raw pointers freed by the terminal query;
:class:`TransferHandle` makes them one-shot so no id is ever queried twice (a second query is a
use-after-free: SIGSEGV). Past the release quarantine a write is cut, not dropped (:meth:`MooncakeEngine.abandon`).

The native engine is shared by every manager in the process under a reference count (as serving stacks
share it between PD transfer and KV offloading); each adapter owns only its own registrations.

Protocol selection happens in one place, :func:`select_mooncake_setup` (pure, in
:mod:`aiotransfer.engines._mooncake_setup`, re-exported here): config ``protocol``, then
``$MOONCAKE_PROTOCOL``, then ``"rdma"``; engine ``mooncake_tcp`` means ``tcp``. Mooncake's ``protocol``
argument does not select the transport in most builds (it picks a memory allocator; the transport comes
from the build, ``MC_FORCE_TCP``/``MC_FORCE_MNNVL``/``MC_INTRANODE_NVLINK`` and topology discovery), so
the adapter sets those variables itself (``setdefault``: a user's value wins) and reports the transport
that was actually installed (:func:`installed_transport`) in a log line and in ``describe()``.

Mooncake's ``initialize`` logs three benign start-up lines on stderr: glog's ``WARNING: Logging before
InitGoogleLogging() is written to STDERR`` (Mooncake never initialises glog), ``W... Using default
malloc/free for protocol: tcp`` (at ``MC_LOG_LEVEL=WARNING`` or lower), and, in P2P handshake mode,
``E... transfer_metadata.cpp:NNN] Local segment descriptor not found``: installing a transport looks up the
descriptor of its own segment before creating it. The adapter drops exactly these lines, only while
``initialize`` runs (:func:`~aiotransfer.engines._mooncake_stderr.without_benign_start_lines`), and logs them at DEBUG; every other line passes
through.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from itertools import repeat, takewhile
from typing import Any

import numpy as np

from .._config import TransferConfig
from .._plan import Blocks
from ..errors import ConfigError, EngineError, EngineUnavailable
from ._base import EngineBase, EngineStatus, EngineTraits, MemoryRegion, TransferHandle
from ._common import LoopGate
from ._mooncake_cut import cut_connections
from ._mooncake_preflight import fetch_descriptor
from ._mooncake_setup import (
    MOONCAKE_PROTOCOLS,
    REFRESH_ENV,
    MooncakeSetup,
    apply_env,
    installed_transport,
    load_time_env,
    read_build_flags,
    select_mooncake_setup,
)
from ._mooncake_stderr import without_benign_start_lines

__all__ = [
    "MOONCAKE_PROTOCOLS",
    "MooncakeEngine",
    "MooncakeSetup",
    "installed_transport",
    "memory_location",
    "select_mooncake_setup",
]

log = logging.getLogger("aiotransfer.engines.mooncake")

_CHECK_PENDING, _CHECK_DONE, _CHECK_TIMEOUT = 0, 1, -2
"""``transfer_check_status`` answers (transfer_engine_py.cpp, ``transferCheckStatus``); -1 is FAILED."""
_CHECK_WINDOW = 8
"""``check`` asks the entries in posting order, from the oldest not ended, and stops once this many are still
running: the write cannot end before they do, and a failure among them dooms the write at once."""


class _Entries:
    """A write's entry ids in posting order: the first ``head`` have ended, and so have those at the indices
    in ``ended`` (beyond ``head``). ``check`` asks from ``head`` on, so a round costs the window plus the
    entries that ended since the last, however long the write. The ids of a growing write's later slices are
    appended as they are posted (``try_extend_inline``)."""

    __slots__ = ("ended", "head", "ids")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.head = 0
        self.ended: set[int] = set()
_INLINE_ENTRIES = 64
"""Writes of up to this many entries may be posted from the event loop: about 6 us an entry through the
adapter (0.4 ms for 64, measured on 2 vCPUs); larger writes come in slices of this size (``inline_slice``).
Every write is posted entry by entry and polled from the loop."""
_RC_ALREADY_REGISTERED = -7
_HANDSHAKE_RETRY_S = 0.25
_HANDSHAKE_WINDOW_S = 2.0

_LOAD_APPLIED: dict[str, str] = {}
"""What ``_import_engine_module`` set before the first import (reported with the engine's start line)."""


def _import_engine_module(config: TransferConfig) -> Any:
    # Set (unless the user did) before the first import: later values are ignored by the loaded extension.
    if "mooncake.engine" not in sys.modules:
        for key, value in load_time_env(config).items():
            if key not in os.environ:
                os.environ[key] = value
                _LOAD_APPLIED[key] = value
    try:
        import mooncake.engine as module
    except ImportError as exc:
        hint = (
            "pip install 'aiotransfer[mooncake-cpu]'  (mooncake-transfer-engine-non-cuda, for hosts without "
            "an NVIDIA driver) or 'aiotransfer[mooncake]' (mooncake-transfer-engine, GPU hosts)"
        )
        if "libcuda" in str(exc) or "libcudart" in str(exc):
            hint = (
                "the installed Mooncake wheel is a CUDA build and this host has no NVIDIA driver: "
                "pip uninstall -y mooncake-transfer-engine && pip install mooncake-transfer-engine-non-cuda"
            )
        elif "libibverbs" in str(exc) or "libnuma" in str(exc) or "libcurl" in str(exc):
            hint = "missing system libraries: apt-get install -y libibverbs1 libnuma1 libcurl4"
        raise EngineUnavailable(f"Mooncake TransferEngine cannot be loaded ({exc}); {hint}") from exc
    return module


def _free_port() -> int:
    """A TCP port free right now (Ascend's ``host:port:npu_<id>`` hostname needs one, as SGLang does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def memory_location(device: str) -> str:
    """Mooncake's location for a region on ``device``: ``cuda:N`` for GPU memory (its NIC affinity and
    GPUDirect path follow it), ``*`` (let Mooncake find out) for host memory and anything else."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        return f"cuda:{int(index or 0)}"
    return "*"


def _visible_hcas(device_filter: str, root: str = "/sys/class/infiniband") -> list[str]:
    """RDMA devices the kernel shows, restricted to ``device_filter`` (a comma list) when given."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    wanted = {d for d in device_filter.split(",") if d}
    return [n for n in names if not wanted or n in wanted]


def _has_hca(native: Any, device_filter: str) -> bool:
    """Whether Mooncake's topology discovery finds a usable HCA. No device in sysfs means none (cheap);
    otherwise ask the engine (``get_local_topology`` runs a discovery: ~1 s)."""
    if not _visible_hcas(device_filter):
        return False
    try:
        topo = json.loads(native.get_local_topology(device_filter or None))
        return any(any(hcas) for entry in topo.values() for hcas in entry)
    except Exception as exc:  # unknown: the devices exist, so Mooncake most likely installed RDMA
        log.debug("Mooncake topology query failed: %r", exc)
        return True


def _fresh_alias(name: str) -> str:
    """``host:port`` -> ``host:0port``: the same address to the engine, a new key in its descriptor cache."""
    host, _, port = name.rpartition(":")
    return f"{host}:0{port}"


def _env_int(name: str) -> int:
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0


class _SharedNative:
    """The process-wide native engine, reference counted."""

    lock = threading.Lock()
    instance: _SharedNative | None = None

    def __init__(
        self, native: Any, session_id: str, transport: str, setup: MooncakeSetup, module: Any,
        flags: Mapping[str, bool],
    ) -> None:
        self.native = native
        self.session_id = session_id
        self.transport = transport
        self.setup = setup
        self.module = module
        self.flags = dict(flags)
        self.refs = 0
        self.known: set[str] = set()
        """Peers the engine has fetched a descriptor for (it keeps them for its lifetime)."""
        self.opened: set[str] = set()
        """Names (``names`` values) whose segment the engine has open: a write to one takes the engine's mutex
        only to look it up, never across a handshake."""
        self.gate = LoopGate()
        self.names: dict[str, str] = {}
        """Peer session -> the alias the engine knows a restarted peer by (see ``_handshake``)."""
        self.regions: dict[tuple[int, int], int] = {}  # (ptr, nbytes) -> refcount
        self.data_addrs: dict[str, tuple[str, int]] = {}
        """Peer session -> the TCP data address its descriptor named when this process last fetched it (what
        :meth:`MooncakeEngine.abandon` cuts)."""
        self.refresh_s = _env_int(REFRESH_ENV)
        """How often the engine re-reads cached peer descriptors (0: never)."""


class MooncakeEngine(EngineBase):
    """Mooncake adapter; one native engine per process, shared (see module docstring)."""

    name = "mooncake"
    traits = EngineTraits(quiet_threads=True, entry_cost_s=30e-6, bandwidth_bps=2.0e9, landing_grace_s=1.0,
                          inline_slice=_INLINE_ENTRIES)
    """``quiet_threads``: the transport's threads block while idle (0.5 % CPU for an idle process, measured),
    so the loop may yield its CPU after a Success without waiting behind them. Staging constants: the
    measured per-entry cost over TCP, whatever the entry size, and the TCP loopback throughput of one peer
    connection. ``inline_slice``: the binding posts one entry per call, so a write of many entries handed to
    the driver would take the GIL back once per entry behind the event loop's turns (measured: 8,000 entries
    took over 10 s behind a busy loop); the loop posts them itself, 64 at a time. ``landing_grace_s``: a write whose acknowledgement is late fails after its lane is closed,
    and what the kernel had already sent is still applied when the peer runs again (measured: a decode
    stopped with SIGSTOP; the bytes of its failed writes landed within milliseconds of SIGCONT)."""
    probe_region: MemoryRegion
    """A registered 64-byte scratch region: the source of this engine's handshake writes, and the target
    of its peers'."""

    def __init__(self, config: TransferConfig, *, alias_tcp: bool = False) -> None:
        module = _import_engine_module(config)
        flags = read_build_flags(module)
        setup = select_mooncake_setup(
            config_protocol=config.protocol,
            env=os.environ,
            alias_tcp=alias_tcp or config.engine == "mooncake_tcp",
            build_flags=flags,
            rdma_devices=config.rdma_devices,
            device_id=config.device_id,
        )
        with _SharedNative.lock:
            shared = _SharedNative.instance
            if shared is None:
                shared = self._create(config, setup, module, flags)
                _SharedNative.instance = shared
            elif shared.setup.protocol != setup.protocol:
                raise ConfigError(
                    f"this process already runs a Mooncake engine with protocol {shared.setup.protocol!r}; "
                    f"one engine per process (asked for {setup.protocol!r})"
                )
            elif shared.setup.device_name != setup.device_name:
                log.warning(
                    "Mooncake engine is shared per process: RDMA devices %r asked for, %r in use",
                    setup.device_name, shared.setup.device_name,
                )
            shared.refs += 1
        self._shared = shared
        self._owned: list[MemoryRegion] = []
        self._closed = False
        self._handshake_window = min(_HANDSHAKE_WINDOW_S, config.handshake_timeout / 2)
        self._handshake_bound = config.handshake_timeout
        """Bound on a peer's answer to the metadata request made before the engine's own (see ``reach``)."""
        self._reached: set[str] = set()
        """Peers :meth:`reach` checked, for the ``connect`` that follows."""
        scratch = np.zeros(64, dtype=np.uint8)
        self._scratch = scratch
        self.probe_region = MemoryRegion(int(scratch.ctypes.data), scratch.nbytes)
        self.register([self.probe_region])

    @staticmethod
    def _create(
        config: TransferConfig, setup: MooncakeSetup, module: Any, flags: Mapping[str, bool]
    ) -> _SharedNative:
        applied = {**_LOAD_APPLIED, **apply_env(config, setup, os.environ)}
        for note in setup.notes:
            log.warning("Mooncake: %s", note)
        native = module.TransferEngine()
        hostname = setup.local_hostname(config.hostname, _free_port() if setup.npu_id is not None else None)
        with without_benign_start_lines():
            rc = native.initialize(hostname, "P2PHANDSHAKE", setup.protocol, setup.device_name)
        if rc != 0:
            raise EngineError(
                f"Mooncake initialize({hostname!r}, protocol={setup.protocol!r}, devices={setup.device_name!r}) "
                f"failed with {rc}",
                code=rc,
            )
        port = native.get_rpc_port()
        transport = installed_transport(
            setup.protocol, flags, os.environ, lambda: _has_hca(native, setup.device_name)
        )
        session = f"{config.hostname}:{port}"
        log.info(
            "Mooncake engine up: session=%s protocol=%s (from %s) transport=%s devices=%r env set=%s",
            session, setup.protocol, setup.source, transport, setup.device_name,
            ",".join(f"{k}={v}" for k, v in applied.items()) or "none",
        )
        if setup.protocol not in transport.split("+"):
            log.warning(
                "Mooncake protocol %r was asked for (from %s) but the %r transport is installed",
                setup.protocol, setup.source, transport,
            )
        return _SharedNative(native, session, transport, setup, module, flags)

    @property
    def credit_scope(self) -> object:
        """In-flight entry limits are per native engine, which every manager of the process shares."""
        return self._shared

    # -- identity ------------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self._shared.session_id

    @property
    def transport(self) -> str:
        return self._shared.transport

    def describe(self) -> dict[str, Any]:
        s = self._shared
        return {
            "engine": self.name,
            "session_id": s.session_id,
            "protocol": s.setup.protocol,
            "protocol_source": s.setup.source,
            "transport": s.transport,
            "rdma_devices": s.setup.device_name,
            "build": sorted(k for k, v in s.flags.items() if v),
            "shared_refs": s.refs,
            "metadata_refresh_s": s.refresh_s,
        }

    def local_info(self) -> bytes:
        return b""

    # -- memory --------------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        s = self._shared
        fresh: list[MemoryRegion] = []
        with _SharedNative.lock:
            for r in regions:
                key = (r.ptr, r.nbytes)
                if key in s.regions:
                    s.regions[key] += 1
                    self._owned.append(r)
                else:
                    fresh.append(r)
            for r in fresh:
                rc = s.native.register_memory(r.ptr, r.nbytes, memory_location(r.device))
                if rc != 0:
                    hint = " (overlaps a region already registered)" if rc == _RC_ALREADY_REGISTERED else ""
                    raise EngineError(f"register_memory({r.ptr:#x}, {r.nbytes}) failed with {rc}{hint}", code=rc)
                s.regions[(r.ptr, r.nbytes)] = 1
                self._owned.append(r)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        s = self._shared
        with _SharedNative.lock:
            for r in regions:
                key = (r.ptr, r.nbytes)
                count = s.regions.get(key)
                if count is None:
                    continue
                if r in self._owned:
                    self._owned.remove(r)
                if count > 1:
                    s.regions[key] = count - 1
                    continue
                del s.regions[key]
                rc = s.native.unregister_memory(r.ptr)
                if rc != 0:
                    log.warning("unregister_memory(%#x) returned %d", r.ptr, rc)

    # -- transfers -----------------------------------------------------------------------------
    def reach(self, peer: str, timeout: float) -> None:
        """Any thread, no engine lock: :func:`fetch_descriptor`, the metadata request the engine's handshake
        makes, bounded by ``timeout``. A peer that does not answer it is refused here and never reaches
        ``connect``, where the engine would wait for it (60 s) holding the mutex every write takes."""
        self._fetch(peer, timeout)
        with _SharedNative.lock:
            self._reached.add(peer)

    def _fetch(self, peer: str, timeout: float) -> None:
        """:func:`fetch_descriptor`, keeping the peer's TCP data address (a restarted peer's replaces it)."""
        desc = fetch_descriptor(peer, timeout)
        host, port = desc.get("tcp_data_host"), desc.get("tcp_data_port")
        if isinstance(host, str) and host and isinstance(port, int) and 0 < port < 65536:
            with _SharedNative.lock:
                self._shared.data_addrs[peer] = (host, port)

    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None:
        """Blocking handshake (driver thread). Unless :meth:`reach` just checked the peer, it does so first
        (bounded by ``handshake_timeout``). Then, with the gate closed to writes from the event loop, the
        engine opens the peer's segment: a 1-byte write into the peer's probe region, or, for peers that
        publish none (``probe_addr == 0``: SGLang decodes), a zero-length write, which opens the segment
        and moves nothing. A peer that answered :meth:`reach` and then leaves the engine's identical request
        unanswered holds the engine's mutex up to Mooncake's fixed 60 s receive timeout: the driver and
        other writes wait that long, never the event loop."""
        s = self._shared
        with _SharedNative.lock:
            reached = peer in self._reached
            self._reached.discard(peer)
        if not reached:
            self._fetch(peer, self._handshake_bound)
        with s.gate.handshake():
            if probe_addr > 0:
                self._handshake(peer, probe_addr)
            else:
                self._open(peer)
        s.known.add(peer)

    def _open(self, peer: str) -> None:
        s = self._shared
        name = s.names.get(peer, peer)
        rc = s.native.transfer_sync_write(name, self.probe_region.ptr, self.probe_region.ptr, 0)
        if rc != 0:
            s.opened.discard(name)
            raise EngineError(f"Mooncake could not open the segment of {peer} ({rc})", code=rc)
        s.opened.add(name)

    def _handshake(self, peer: str, probe_addr: int) -> None:
        """Write one byte into the peer's probe region, retrying over a short window.

        The engine caches a peer's descriptor (its data port, its buffers) under the name it was addressed
        by, and never drops it. A peer restarted on an address this engine already knew would fail every
        write: the engine keeps using the dead process's data port. When a known peer fails, it is addressed
        under a fresh alias of the same ``host:port`` (the port with a leading zero, which the engine parses
        to the same number), so the engine fetches its descriptor again. A data port reused from a dead
        peer fails until its connection lane cools down: the retries cover that."""
        s = self._shared
        name = s.names.get(peer, peer)
        deadline = time.monotonic() + self._handshake_window
        attempts = 0
        while True:
            attempts += 1
            rc = s.native.transfer_sync_write(name, self.probe_region.ptr, probe_addr, 1)
            if rc == 0:
                s.opened.add(name)
                if name != s.names.get(peer, peer):
                    s.names[peer] = name
                    log.info("Mooncake peer %s restarted on a known address: addressed as %s from now on", peer, name)
                elif attempts > 1:
                    log.info("Mooncake handshake with %s succeeded after %d attempts", peer, attempts)
                return
            s.opened.discard(name)  # a failed sync write may have closed the segment (transferSync)
            if attempts == 1 and peer in s.known:
                name = _fresh_alias(name)
                continue
            if time.monotonic() + _HANDSHAKE_RETRY_S >= deadline:
                break
            time.sleep(_HANDSHAKE_RETRY_S)
        raise EngineError(
            f"Mooncake handshake write to {peer} failed with {rc} ({attempts} attempts over "
            f"{self._handshake_window:.1f} s)",
            code=rc,
        )

    def forget_peer(self, peer: str) -> None:
        """Nothing to drop: the engine keeps a peer's descriptor for its lifetime, and a peer that comes
        back on the same address is re-fetched by the next handshake (see ``_handshake``)."""

    def abandon(self, handle: TransferHandle) -> None:
        """Past the quarantine the binding can neither end an entry nor close a peer's connections, and a
        dropped handle would let the engine read the pages once reused: cut the engine's connections to the
        peer's data port (:func:`cut_connections`, those of other managers sharing the engine too) and leave
        the handle PENDING; the engine answers -1 for its entries once their reads ended. Nothing cut (not
        TCP, data address unknown): the handle stays pending, its memory held."""
        if handle.consumed:
            return
        s = self._shared
        addr = s.data_addrs.get(handle.peer)
        say = log.debug if "cuts" in handle.extra else log.warning
        if "tcp" not in s.transport.split("+") or addr is None:
            handle.extra["cuts"] = 0
            say("Mooncake write to %s cannot be cut (transport %s%s): its memory stays held until the engine ends "
                "it", handle.peer, s.transport, "" if addr else ", data address unknown")
            return
        cut = cut_connections(*addr)
        handle.extra["cuts"] = handle.extra.get("cuts", 0) + cut
        say("Mooncake write to %s abandoned: %d connection(s) to its data port %s:%d shut down; its memory is "
            "released once the engine has ended every entry", handle.peer, cut, addr[0], addr[1])

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        """Post a write of up to ``_INLINE_ENTRIES`` entries from the event loop, unless that could wait:
        ``transfer_submit_write`` takes the engine's mutex, which a handshake holds across a network round
        trip, and opens (under that mutex) the segment of a peer the engine has not opened. So the write
        goes to the driver thread instead (None, nothing posted) while any handshake of this process is in
        progress, or when the engine has not opened ``peer``'s segment."""
        s = self._shared
        if len(blocks) > _INLINE_ENTRIES:
            return None
        name = s.names.get(peer, peer)
        if name not in s.opened or not s.gate.enter():
            return None
        try:
            return self._submit_entries(peer, name, blocks)
        finally:
            s.gate.leave()

    def try_extend_inline(self, handle: TransferHandle, blocks: Blocks) -> bool:
        """More entries of a growing write, posted from the loop under the conditions of
        :meth:`try_submit_inline`; their ids join the handle's (see :class:`_Entries`). An entry the engine
        refuses dooms the handle; those posted before it stay in the handle."""
        s = self._shared
        name = s.names.get(handle.peer, handle.peer)
        if (len(blocks) > _INLINE_ENTRIES or not handle.growing or handle.consumed or handle.doomed is not None
                or name not in s.opened or not s.gate.enter()):
            return False
        try:
            ids = self._post(name, blocks)
        finally:
            s.gate.leave()
        entries: _Entries = handle.token
        entries.ids.extend(ids)
        handle.entries += len(ids)
        handle.nbytes += blocks.nbytes if len(ids) == len(blocks) else int(blocks.length[: len(ids)].sum())
        if len(ids) < len(blocks):
            handle.doom(f"Mooncake refused entry {handle.entries} of a write to {handle.peer} (peer unreachable)")
        return True

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        """Driver thread. A peer whose segment the engine has not opened is opened first, as ``connect``
        does (bounded first contact, then the engine's own)."""
        if len(blocks) == 0:
            raise EngineError("empty transfer batch")
        s = self._shared
        name = s.names.get(peer, peer)
        if name not in s.opened:
            self._fetch(peer, self._handshake_bound)
            with s.gate.handshake():
                self._open(peer)
        return self._submit_entries(peer, name, blocks)

    def _submit_entries(self, peer: str, name: str, blocks: Blocks) -> TransferHandle:
        """Each entry its own one-entry write (``transfer_submit_write``, which only queues it), all polled
        with ``transfer_check_status``: the only answer of the binding that is terminal entry by entry (a
        multi-entry batch is answered by ``get_batch_transfer_status``, whose -1 may come while entries still
        run, after which the batch can never be asked again; see docs/engines.md). An entry the engine
        refuses after others were posted dooms the handle, which ends once those are over."""
        n = len(blocks)
        ids = self._post(name, blocks)
        handle = TransferHandle(token=_Entries(ids), peer=peer, entries=n, nbytes=blocks.nbytes)
        if len(ids) < n:
            refused = f"Mooncake refused entry {len(ids)} of a {n}-entry write to {peer} (peer unreachable)"
            if not ids:
                raise EngineError(refused)
            handle.doom(refused)
        return handle

    def _post(self, name: str, blocks: Blocks) -> list[int]:
        """The ids of the entries posted, in order: one native call per entry, looped in C; the first refusal
        (0) ends the posting."""
        submit = self._shared.native.transfer_submit_write
        n = len(blocks)
        posted = map(submit, repeat(name, n), blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist())
        return list(takewhile(bool, posted))

    def check(self, handle: TransferHandle) -> EngineStatus:
        """Asks the entries in posting order, from the oldest not ended, and stops once ``_CHECK_WINDOW`` are
        still running (see :class:`_Entries`: a write of thousands of entries asked about each, every round,
        cost most of the loop). Takes no lock of the engine (``transfer_check_status`` reads the task's
        counters). 1 (completed) and -1 (failed: the lane was closed first, the source is no longer read) end
        an entry and free its id, so an ended entry is never asked again. -2 (timed out) is not an end: the
        entry still runs and its id stays valid; the handle is doomed and asked again. DONE once every entry
        completed, FAILED once every entry ended and one failed."""
        handle.ensure_pending()
        entries: _Entries = handle.token
        ids, ended, n = entries.ids, entries.ended, len(entries.ids)
        status = self._shared.native.transfer_check_status
        head = j = entries.head
        running = 0
        while j < n and running < _CHECK_WINDOW:
            if j in ended:
                j += 1
                continue
            rc = status(ids[j])
            if rc == _CHECK_PENDING:
                running += 1
            elif rc == _CHECK_TIMEOUT:
                running += 1
                handle.doom(f"Mooncake write to {handle.peer}: engine timeout (the entry is still in flight)")
            else:
                if rc != _CHECK_DONE:
                    handle.doom(f"Mooncake write to {handle.peer}: engine reported failure ({rc})")
                    handle.error = handle.error or handle.doomed
                if j == head:
                    head += 1
                    while head in ended:  # entries that had ended behind it join the ended prefix
                        ended.discard(head)
                        head += 1
                    j = head
                    continue
                ended.add(j)
            j += 1
        entries.head = head
        if head < n or handle.growing:
            return EngineStatus.PENDING
        if handle.doomed is not None:
            return handle.finish(EngineStatus.FAILED, handle.doomed)
        return handle.finish(EngineStatus.DONE)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.deregister(list(self._owned))
        with _SharedNative.lock:
            s = self._shared
            s.refs -= 1
            if s.refs == 0 and _SharedNative.instance is s:
                # The native engine is kept for the life of the process: Mooncake has no safe teardown
                # while peers may still hold its segment, and re-initialising in-process is not supported.
                pass

    def raw(self) -> Any:
        """The native ``mooncake.engine.TransferEngine`` (benchmarks and diagnostics only)."""
        return self._shared.native

