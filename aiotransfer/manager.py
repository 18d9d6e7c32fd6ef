"""``KVManager``: one per rank. Owns the engine, the poll loop, the control plane and the buffers."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from . import _threads
from ._device import device_initializer
from ._liveness import Liveness
from ._offload import Offloader
from ._poller import Poller
from .args import Buffer, KVArgs
from .aux import StateType, select_aux_path
from .config import AuxPath, TransferConfig, aux_tcp_forced
from .control.endpoint import ControlPlane, normalize_endpoint
from .control.messages import (
    PROTOCOL_VERSION,
    Abort,
    AuxData,
    BufferSpec,
    Hello,
    HelloAck,
    Message,
    Ping,
    Pong,
    RankEndpoint,
    RankRegister,
    Staged,
    StagedAck,
    StageGrant,
    StageRequest,
    StateSpec,
    Status,
    Topology,
    TopologyQuery,
    TransferRequest,
    pack_indices,
    unpack_indices,
)
from .engines.base import MemoryRegion, TransferEngine
from .engines.registry import create_engine
from .errors import (
    AiotransferError,
    ClosedError,
    EngineError,
    IncompatiblePeer,
    InvalidArgument,
    PeerError,
    ProtocolError,
    TransferFailed,
    TransferTimeout,
)
from .integrity import RoomChecksum, fold, region_crcs
from .layout import KVPairing, RankGeometry, pair_buffers
from .metrics import Metrics
from .plan import (
    Blocks,
    as_index_array,
    check_range,
    check_unique,
    pair_runs,
    plan_blocks,
    plan_head_slices,
    plan_runs,
)
from .receiver import KVReceiver
from .sender import KVSender
from .staging import RowSlice, StagingArena, choose_staging, gather_pages, host_view, scatter_pages
from .status import KVPoll, StatusTable
from .topology import ParallelInfo, RankMapping, map_ranks

__all__ = ["KVManager"]

log = logging.getLogger("aiotransfer.manager")

_PLAN_OFFLOAD_ENTRIES = 1 << 16
"""Plans larger than this many (page x buffer) pairs are computed on the offload thread."""
_FEW_PAGES = 256
"""Chunks of at most this many pages (no head slicing) have their page runs found in plain Python..."""
_FEW_ENTRIES = 64
"""...and are planned in plain Python when runs x buffers is at most this (:func:`plan_runs`): 32 contiguous
pages, one buffer: 5 us against 28 us through NumPy; 32 scattered pages x 64 buffers: 430 us against 54."""
_STAGE_PIECE_BYTES = 8 << 20
"""Target size of one staged piece: small enough to overlap gather, transfer and scatter."""


@dataclass
class _DecodePeer:
    """Prefill-side view of a decode rank that registered with us."""

    endpoint: str
    hello: Hello
    kv_bases: np.ndarray
    kv_item_lens: np.ndarray
    num_pages: int
    aux_slots: int
    aux_bases: np.ndarray
    state: dict[str, tuple[np.ndarray, int]]
    """kind -> (buffer bases, items addressable in every buffer of that kind)"""
    pairing: KVPairing
    dst_bases: np.ndarray
    """Remote bases, in the order of ``pairing.src``."""
    dst_item_lens: np.ndarray
    staging: BufferSpec | None = None
    few: tuple[list[int], list[int], list[int]] | None = None
    """(source bases, destination bases, item lengths) as ints, for :func:`plan_runs` (built on first use)."""

    @property
    def session_id(self) -> str:
        return self.hello.session_id


@dataclass
class _PrefillPeer:
    """Decode-side view of a prefill rank we registered with."""

    endpoint: str
    ack: HelloAck


@dataclass
class _PrefillTopology:
    """Decode-side cache of what a bootstrap address resolved to."""

    topo: Topology
    endpoints: dict[tuple[int, int, int, int], str]


@dataclass
class _Pending:
    """Transfer requests that arrived before the prefill created the room's sender."""

    since: float
    items: list[tuple[_DecodePeer, TransferRequest, np.ndarray]] = field(default_factory=list)


class KVManager:
    """One rank's transfer endpoint: engine + poll loop + control plane + registered buffers.

    Use as an async context manager::

        async with KVManager(args, TransferConfig(engine="mooncake_tcp")) as mgr:
            tx = mgr.sender(room)            # prefill role
            rx = mgr.receiver(room, peer)    # decode role (peer = the prefill's mgr.endpoint)

    A manager can play both roles. Nothing here blocks the event loop: engine calls go through one
    named executor and one poll loop, and every wait is bounded.
    """

    def __init__(
        self,
        args: KVArgs,
        config: TransferConfig | None = None,
        *,
        engine: TransferEngine | None = None,
    ) -> None:
        self.args = args
        self.config = config if config is not None else TransferConfig.from_env()
        self.generation = secrets.randbits(62)
        self._engine: TransferEngine | None = engine
        self._own_engine = engine is None
        # Device first (engines allocate per-device resources at init), and on every executor thread.
        self._offload = Offloader(
            self.config.engine, self.config.executor_threads, initializer=device_initializer(self.config)
        )
        self._poller: Poller | None = None
        self._control: ControlPlane | None = None
        self._regions = [MemoryRegion(b.ptr, b.nbytes, b.device) for b in args.all_buffers()]
        host_kv = all(b.device == "cpu" for b in args.kv)
        self._kv_views = [host_view(b.ptr, b.nbytes) for b in args.kv] if host_kv else None
        self._arena: StagingArena | None = None
        if self.config.staging_bytes and host_kv and self.config.staging != "never":
            self._arena = StagingArena(self.config.staging_bytes)
            self._regions.append(MemoryRegion(self._arena.ptr, self._arena.nbytes))
        self._checksums: dict[tuple[int, str], RoomChecksum] = {}
        # Back-to-back buffers (per-layer views of one tensor) are registered as one region: the planner
        # merges entries across such buffers, and engines require every entry inside one registration.
        self._regions = _merge_regions(self._regions)
        self._stage_ids = 0
        self._stage_waiters: dict[int, asyncio.Future[Any]] = {}
        self._stage_grants: dict[tuple[str, int], tuple[int, int, int]] = {}
        """decode side: (prefill endpoint, req id) -> (room, offset, nbytes) granted"""
        self._registered = False
        self._started = False
        self._engine_threads = "normal"
        """``engine_threads`` in effect: ``background`` only once started on an engine that allows it."""
        self._closed = False
        self._kv_bases = np.array([b.ptr for b in args.kv], dtype=np.uint64)
        self._kv_item_lens = np.array([b.item_len for b in args.kv], dtype=np.uint64)
        self._compat = args.compat_hash()
        self.parallel = ParallelInfo(
            args.tp_size, args.tp_rank, args.pp_size, args.pp_rank, args.cp_size, args.cp_rank, args.dp_rank
        )
        self._geometry = RankGeometry(
            layout=args.layout,
            page_size=args.page_size,
            item_lens=[b.item_len for b in args.kv],
            layer_ids=[b.layer_id for b in args.kv],
            tp_size=args.tp_size,
            tp_rank=args.tp_rank,
            kv_heads=args.kv_heads,
            total_kv_heads=args.total_kv_heads,
            outer=args.outer,
        )
        self._ranks: dict[tuple[int, int, int, int], str] = {}
        """Bootstrap leader: (dp, tp, pp, cp) -> control endpoint of every prefill rank registered."""
        self._topologies: dict[str, _PrefillTopology] = {}
        self._topology_waiters: dict[int, asyncio.Future[Topology]] = {}
        self._aux_bases = np.array([b.ptr for b in args.aux], dtype=np.uint64)
        self._aux_item_lens = np.array([b.item_len for b in args.aux], dtype=np.uint64)
        self.aux_path = select_aux_path(
            self.config.aux_path, self.config.custom_mem_pool, env_force_tcp=aux_tcp_forced()
        )
        """The aux path this manager uses (``ENGINE`` may still fall back to TCP on ``auto``)."""
        self._aux_fallback_logged = False
        self._senders: dict[int, KVSender] = {}
        self._receivers: dict[int, KVReceiver] = {}
        self._tx_status = StatusTable(on_change=self._on_tx_change)
        self._rx_status = StatusTable(on_change=self._on_rx_change)
        self._decode_peers: dict[str, _DecodePeer] = {}
        self._prefill_peers: dict[str, _PrefillPeer] = {}
        self._hello_tasks: dict[str, asyncio.Task[_PrefillPeer]] = {}
        self._hello_waiters: dict[int, asyncio.Future[HelloAck]] = {}
        self._hello_inflight: dict[str, asyncio.Task[None]] = {}
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counters: Counter[str] = Counter()
        self.metrics = Metrics()
        self._liveness = Liveness(
            interval=self.config.heartbeat_interval,
            timeout=self.config.peer_timeout,
            active_peers=self._active_peers,
            ping=self._ping,
            on_dead=self._on_peer_dead,
            on_restart=self._on_peer_restart,
        )
        if self.config.checksum and self._kv_views is None:
            raise InvalidArgument("checksum=True needs host-memory KV buffers")

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> KVManager:
        """Create the engine (on the executor, after device binding), register memory, open the control
        socket and start the heartbeat. Idempotent; ``async with`` calls it for you."""
        if self._started:
            return self
        if self._closed:
            raise ClosedError("manager is closed")
        cfg = self.config
        background = cfg.engine_threads == "background" and _threads.supported()
        if cfg.engine_threads == "background" and not background:
            log.warning("engine_threads='background' needs Linux SCHED_IDLE; engine threads stay normal")
        try:
            if background:
                _threads.mark_foreign()  # before the engine starts its threads
            if self._engine is None:
                # create_engine runs on an executor thread whose initializer already bound the device
                self._engine = await self._offload.run(
                    create_engine, cfg, timeout=max(cfg.handshake_timeout, 30.0), what="engine initialisation"
                )
            await self._offload.run(self._engine.register, self._regions, timeout=cfg.handshake_timeout,
                                    what="memory registration")
            self._registered = True
            if background and not getattr(self._engine, "quiet_threads", False):
                # A busy-polling engine thread at idle priority is preempted while it holds the engine's
                # own lock, and every submit and check of ours then waits behind it (priority inversion).
                background = False
                log.warning("engine_threads='background' ignored: the %s engine's threads busy-poll and hold "
                            "its internal lock; at idle priority they would stall transfers", cfg.engine)
            self._engine_threads = "background" if background else "normal"
            if background:
                await self._background_engine_threads()  # first look, before ZMQ starts its threads
            self._poller = Poller(
                self._engine,
                self._offload,
                max_in_flight=cfg.max_entries_in_flight,
                max_batch=cfg.max_batch_entries,
                interval_min=cfg.poll_interval_min,
                interval_max=cfg.poll_interval_max,
                inline_submit_max=1 if getattr(self._engine, "cheap_submit", False) else 0,
            )
            self._control = self._make_control_plane()
            await self._control.start()
            self._ranks[self._rank_key()] = self._control.endpoint
            self._liveness.start()
            if cfg.lag_probe_interval > 0:
                self._spawn(self._probe_loop_lag(cfg.lag_probe_interval), "lag-probe")
            if background:
                self._spawn(self._keep_engine_threads_background(), "engine-threads")
            if cfg.bootstrap:
                await self._register_with_leader(cfg.bootstrap)
        except BaseException:
            await self.aclose()
            raise
        self._started = True
        log.info("manager up: control=%s engine=%s", self.endpoint, self.describe().get("engine"))
        return self

    def _make_control_plane(self) -> ControlPlane:
        cfg, a = self.config, self.args
        if cfg.wire == "sglang-mooncake":
            from .control.sglang import SglangControlPlane, SglangIdentity

            identity = SglangIdentity(
                host=cfg.hostname, tp_size=a.tp_size, tp_rank=a.tp_rank, pp_size=a.pp_size, pp_rank=a.pp_rank,
                cp_size=a.cp_size, cp_rank=a.cp_rank, dp_rank=a.dp_rank, dp_size=cfg.dp_size, page_size=a.page_size,
                kv_cache_dtype=cfg.sglang_kv_cache_dtype, is_mla=a.is_mla, kv_heads=a.kv_heads,
                total_kv_heads=a.total_kv_heads, aux_item_lens=tuple(b.item_len for b in a.aux),
                compat=self._compat, layout=a.layout, engine=cfg.engine.replace("mooncake_tcp", "mooncake"),
                bootstrap_port=cfg.sglang_bootstrap_port,
            )
            plane = SglangControlPlane(identity, cfg.control_port, self._dispatch, max_sockets=cfg.max_sockets,
                                       max_message_bytes=cfg.max_message_bytes)
            return cast(ControlPlane, plane)  # duck-typed: the same interface as ControlPlane
        return ControlPlane(cfg.hostname, cfg.control_port, self._dispatch, max_sockets=cfg.max_sockets,
                            max_message_bytes=cfg.max_message_bytes, hmac_key=cfg.hmac_key)

    async def __aenter__(self) -> KVManager:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, timeout: float = 5.0) -> None:
        """Fail open rooms, drain the poll loop, deregister memory, close sockets (in that order)."""
        if self._closed:
            return
        self._closed = True
        for room, tx in list(self._senders.items()):
            if not tx.poll().is_terminal:
                self._tx_update(room, KVPoll.Failed, "manager closed")
        for room, rx in list(self._receivers.items()):
            if not rx.poll().is_terminal:
                self._rx_update(room, KVPoll.Failed, "manager closed")
        await self._liveness.aclose()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        remaining = 0
        if self._poller is not None:
            remaining = await self._poller.aclose(timeout)
        if self._engine is not None and self._registered and remaining == 0:
            with contextlib.suppress(AiotransferError):
                await self._offload.run(self._engine.deregister, self._regions, timeout=timeout,
                                        what="memory deregistration")
            self._registered = False
        if self._control is not None:
            await self._control.aclose()
        if self._engine is not None and self._own_engine and remaining == 0:
            with contextlib.suppress(AiotransferError):
                await self._offload.run(self._engine.close, timeout=timeout, what="engine close")
        self._offload.shutdown(wait=False)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("manager is closed")
        if not self._started:
            raise ClosedError("manager is not started: use 'async with KVManager(...)' or 'await mgr.start()'")

    @property
    def endpoint(self) -> str:
        """This rank's control address (give it to decode as ``peer``)."""
        return self._control.endpoint if self._control is not None else ""

    @property
    def engine(self) -> TransferEngine:
        if self._engine is None:
            raise ClosedError("manager is not started")
        return self._engine

    def describe(self) -> dict[str, Any]:
        """Static facts: engine, transport actually installed, session, endpoint, geometry."""
        info: dict[str, Any] = {
            "endpoint": self.endpoint,
            "generation": self.generation,
            "protocol_version": PROTOCOL_VERSION,
            "kv_buffers": len(self.args.kv),
            "num_pages": self.args.num_pages,
            "layout": self.args.layout,
            "compat": self._compat,
            "engine_threads": self._engine_threads,
        }
        if self._engine is not None:
            info.update(self._engine.describe())
        return info

    def stats(self) -> dict[str, Any]:
        """Counters: rooms, bytes, dropped control messages by cause, engine handles in flight."""
        c = self._control
        p = self._poller
        return {
            "senders_active": len(self._senders),
            "receivers_active": len(self._receivers),
            "pending_requests": len(self._pending),
            "decode_peers": len(self._decode_peers),
            "prefill_peers": len(self._prefill_peers),
            "in_flight": p.in_flight if p else 0,
            "pinned_bytes": p.pinned_bytes if p else 0,
            "engine_completed": p.completed if p else 0,
            "engine_failed": p.failed if p else 0,
            "control_received": c.received if c else 0,
            "control_sent": c.sent if c else 0,
            "control_dropped": dict(c.dropped) if c else {},
            "open_sockets": c.open_sockets if c else 0,
            "dead_peers": len(self._liveness.dead),
            "staging_bytes_in_use": self._arena.in_use if self._arena is not None else 0,
            **dict(self.counters),
            **self.metrics.snapshot(),
        }

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("up" if self._started else "new")
        return f"<KVManager {state} endpoint={self.endpoint or '-'} senders={len(self._senders)} receivers={len(self._receivers)}>"

    # -- factories ------------------------------------------------------------------------------
    def _check_room(self, room: int) -> None:
        if not isinstance(room, (int, np.integer)) or isinstance(room, bool) or not 0 <= int(room) < 2**63:
            raise InvalidArgument(f"room must be an integer in [0, 2**63), got {room!r}")

    def sender(self, room: int) -> KVSender:
        """Create the prefill side of ``room`` (Bootstrapping until decode's metadata arrives)."""
        self._check_open()
        self._check_room(room)
        room = int(room)
        if room in self._senders:
            raise InvalidArgument(f"duplicate room {room}: a sender for it is still active")
        if len(self._senders) >= self.config.max_rooms:
            raise InvalidArgument(f"too many active rooms ({self.config.max_rooms}); raise max_rooms")
        tx = KVSender(self, room)
        self._senders[room] = tx
        self._tx_status.update(room, KVPoll.Bootstrapping)
        pending = self._pending.pop(room, None)
        if pending is not None:
            for peer, req, idx in pending.items:
                self._accept_request(tx, peer, req, idx)
        return tx

    def receiver(self, room: int, peer: str, *, prefill_dp_rank: int | None = None) -> KVReceiver:
        """Create the decode side of ``room``, pulling from the prefill deployment whose bootstrap leader
        (or single rank) is at ``peer`` (``host:port``). ``prefill_dp_rank`` picks the attention-DP group
        (default ``room % dp_size``)."""
        self._check_open()
        self._check_room(room)
        room = int(room)
        try:
            endpoint = normalize_endpoint(peer)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if room in self._receivers:
            raise InvalidArgument(f"duplicate room {room}: a receiver for it is still active")
        if len(self._receivers) >= self.config.max_rooms:
            raise InvalidArgument(f"too many active rooms ({self.config.max_rooms}); raise max_rooms")
        rx = KVReceiver(self, room, endpoint, prefill_dp_rank)
        self._receivers[room] = rx
        self._rx_status.update(room, KVPoll.Bootstrapping)
        return rx

    # -- status plumbing ------------------------------------------------------------------------
    def _tx_update(self, room: int, status: KVPoll, reason: str | None = None) -> None:
        self._tx_status.update(room, status, reason)

    def _rx_update(self, room: int, status: KVPoll, reason: str | None = None) -> None:
        self._rx_status.update(room, status, reason)

    def _on_tx_change(self, room: int, old: KVPoll | None, new: KVPoll, reason: str | None) -> None:
        tx = self._senders.get(room)
        if tx is not None:
            tx._set_status(new, reason)
        if new is KVPoll.Failed:
            self.metrics.failure(reason or "failed")
            log.info("room %d failed (prefill side): %s", room, reason, extra={"room": room, "role": "prefill"})
        if new.is_terminal and tx is not None:
            self.metrics.observe("room_tx", time.monotonic() - tx._created)
        if new.is_terminal:
            self._tx_status.clear(room)
            self._senders.pop(room, None)
            self.counters[f"rooms_sent_{new.name.lower()}"] += 1

    def _on_rx_change(self, room: int, old: KVPoll | None, new: KVPoll, reason: str | None) -> None:
        rx = self._receivers.get(room)
        if rx is not None:
            rx._set_status(new, reason)
        if new is KVPoll.Failed:
            self.metrics.failure(reason or "failed")
            log.info("room %d failed (decode side): %s", room, reason, extra={"room": room, "role": "decode"})
        if new.is_terminal and rx is not None:
            self.metrics.observe("room_rx", time.monotonic() - rx._created)
        if new.is_terminal:
            self._rx_status.clear(room)
            self._receivers.pop(room, None)
            self.counters[f"rooms_received_{new.name.lower()}"] += 1

    async def _background_engine_threads(self) -> None:
        moved = await self._offload.run(_threads.background_engine_threads, timeout=self.config.handshake_timeout,
                                        what="engine thread priority")
        if moved:
            self.counters["engine_threads_background"] += moved

    async def _keep_engine_threads_background(self) -> None:
        """Move the engine's threads 0.2 s after start (a second look), then catch threads the engine starts
        later (a new peer...) at the second heartbeat that sees them."""
        delay = min(0.2, self.config.heartbeat_interval)
        while True:
            await asyncio.sleep(delay)
            delay = self.config.heartbeat_interval
            with contextlib.suppress(AiotransferError):
                await self._background_engine_threads()

    async def _probe_loop_lag(self, interval: float) -> None:
        """How late the event loop wakes a sleeper: the library's own responsiveness, as a histogram."""
        clock = time.perf_counter
        while True:
            t0 = clock()
            await asyncio.sleep(interval)
            self.metrics.observe("loop_lag", max(clock() - t0 - interval, 0.0))

    # -- liveness ------------------------------------------------------------------------------
    def _active_peers(self) -> set[str]:
        peers: set[str] = set()
        for tx in self._senders.values():
            peers.update(tx._dsts)
        for rx in self._receivers.values():
            peers.update(rx._all_targets)
        return peers

    async def _ping(self, endpoint: str) -> None:
        if self._control is None:
            return
        msg = Ping(endpoint=self.endpoint, nonce=secrets.randbits(32), incarnation=self.generation)
        with contextlib.suppress(AiotransferError):
            await self._control.send(endpoint, msg, timeout=0.05)

    def _fail_rooms_with(self, endpoint: str, reason: str) -> int:
        failed = 0
        for room, tx in list(self._senders.items()):
            if endpoint in tx._dsts and not tx.poll().is_terminal:
                self._tx_update(room, KVPoll.Failed, reason)
                failed += 1
        for room, rx in list(self._receivers.items()):
            if endpoint in rx._all_targets and not rx.poll().is_terminal:
                self._rx_update(room, KVPoll.Failed, reason)
                failed += 1
        return failed

    def _forget_prefill(self, endpoint: str) -> None:
        self._prefill_peers.pop(endpoint, None)
        self._hello_tasks.pop(endpoint, None)
        for key, topo in list(self._topologies.items()):
            if endpoint in topo.endpoints.values() or key == endpoint:
                del self._topologies[key]

    def _on_peer_dead(self, endpoint: str, reason: str) -> None:
        self.counters["peers_declared_dead"] += 1
        n = self._fail_rooms_with(endpoint, reason)
        self.counters["rooms_failed_dead_peer"] += n
        self._forget_prefill(endpoint)
        peer = self._decode_peers.get(endpoint)
        if peer is not None and self._engine is not None:
            self._engine.forget_peer(peer.session_id)

    def _on_peer_restart(self, endpoint: str) -> None:
        self.counters["peer_restarts"] += 1
        self._fail_rooms_with(endpoint, f"peer {endpoint} restarted; its earlier state is gone")
        self._forget_prefill(endpoint)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- decode side: registration and requests --------------------------------------------------
    def _hello(self) -> tuple[Hello, int]:
        a = self.args
        nonce = secrets.randbits(62)
        probe = getattr(self.engine, "probe_region", None)
        probe_addr = probe.ptr if probe is not None else a.kv[0].ptr
        hello = Hello(
            version=PROTOCOL_VERSION,
            endpoint=self.endpoint,
            generation=nonce,
            engine=self.config.engine.replace("mooncake_tcp", "mooncake"),
            session_id=self.engine.session_id,
            engine_info=self.engine.local_info(),
            probe_addr=probe_addr,
            compat=self._compat,
            kv=[BufferSpec(b.ptr, b.nbytes, b.item_len, b.layer_id) for b in a.kv],
            aux=[BufferSpec(b.ptr, b.nbytes, b.item_len) for b in a.aux],
            state=[
                StateSpec(kind, [BufferSpec(b.ptr, b.nbytes, b.item_len) for b in bufs], list(a.state_dims.get(kind, ())))
                for kind, bufs in a.state.items()
            ],
            layout=a.layout,
            tp_size=a.tp_size,
            tp_rank=a.tp_rank,
            pp_size=a.pp_size,
            pp_rank=a.pp_rank,
            kv_heads=a.kv_heads,
            total_kv_heads=a.total_kv_heads,
            page_size=a.page_size,
            cp_size=a.cp_size,
            cp_rank=a.cp_rank,
            outer=a.outer,
            staging=BufferSpec(self._arena.ptr, self._arena.nbytes, 1) if self._arena is not None else None,
        )
        return hello, nonce

    async def _ensure_prefill_peer(self, endpoint: str, timeout: float) -> _PrefillPeer:
        peer = self._prefill_peers.get(endpoint)
        if peer is not None:
            return peer
        task = self._hello_tasks.get(endpoint)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.get_running_loop().create_task(self._register_with(endpoint, timeout))
            self._hello_tasks[endpoint] = task
        return await asyncio.shield(task)

    async def _register_with(self, endpoint: str, timeout: float) -> _PrefillPeer:
        assert self._control is not None
        hello, nonce = self._hello()
        fut: asyncio.Future[HelloAck] = asyncio.get_running_loop().create_future()
        self._hello_waiters[nonce] = fut
        try:
            await self._control.send(endpoint, hello, timeout=timeout)
            try:
                ack = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                self._control.forget(endpoint)
                raise PeerError(
                    f"no registration answer from {endpoint} within {timeout:.3g}s "
                    "(wrong address, peer down, or not an aiotransfer manager)"
                ) from None
        finally:
            self._hello_waiters.pop(nonce, None)
        if not ack.accepted:
            raise IncompatiblePeer(f"{endpoint} refused registration: {ack.reason}")
        peer = _PrefillPeer(endpoint, ack)
        self._prefill_peers[endpoint] = peer
        return peer

    def _validate_state_indices(
        self, states: Mapping[Any, Sequence[int]], role: str = "send_metadata"
    ) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for key, idx in states.items():
            kind = key.value if isinstance(key, StateType) else str(key)
            bufs = self.args.state.get(kind)
            if not bufs:
                raise InvalidArgument(f"{role}: state indices for {kind!r} but no such state buffers are registered")
            arr = as_index_array(idx, what=f"{kind} state indices")
            check_range(arr, min(b.num_items for b in bufs), what=f"{kind} state indices")
            if StateType.slot_based(kind) and arr.size != 1:
                raise InvalidArgument(f"{role}: {kind} state takes exactly one slot per request, got {arr.size}")
            if not StateType.slot_based(kind):
                check_unique(arr, what=f"{kind} state indices")
            out[kind] = [int(v) for v in arr]
        return out

    async def _send_request(
        self,
        rx: KVReceiver,
        pages: np.ndarray,
        aux_index: int | None,
        states: dict[str, list[int]],
        *,
        timeout: float,
    ) -> None:
        assert self._control is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        resolved = await self._ensure_topology(rx.peer, timeout)
        topo = resolved.topo
        mapping: RankMapping = map_ranks(
            topo.tp_size, topo.pp_size, topo.cp_size, self.parallel,
            is_mla=topo.layout == "mla", total_heads=topo.total_kv_heads,
            all_cp_ranks_send=self.config.all_cp_ranks_send,
        )
        dp = rx.prefill_dp_rank if rx.prefill_dp_rank is not None else rx.room % topo.dp_size
        endpoints = []
        for t in mapping.targets:
            ep = resolved.endpoints.get((dp, t.tp_rank, t.pp_rank, t.cp_rank))
            if ep is None:
                raise PeerError(f"prefill topology from {rx.peer} lacks rank dp={dp} tp={t.tp_rank} pp={t.pp_rank}")
            if self._liveness.is_dead(ep):
                raise PeerError(f"prefill rank {ep} was declared dead and has not answered since; probing it")
            endpoints.append(ep)
        for ep in endpoints:
            self._liveness.activate(ep)
        peers = await asyncio.gather(*(
            self._ensure_prefill_peer(ep, max(deadline - loop.time(), 0.01)) for ep in dict.fromkeys(endpoints)
        ))
        by_ep = {p.endpoint: p for p in peers}
        rx._targets = {ep: t.unique_rank for t, ep in zip(mapping.targets, endpoints, strict=True) if not t.is_dummy}
        rx._all_targets = list(dict.fromkeys(endpoints))
        rx._required = mapping.required_responses
        packed = pack_indices(pages)
        for t, ep in zip(mapping.targets, endpoints, strict=True):
            req = TransferRequest(
                room=rx.room,
                endpoint=self.endpoint,
                generation=by_ep[ep].ack.generation,
                kv_indices=b"" if t.is_dummy else packed,
                aux_index=-1 if (aux_index is None or t.is_dummy) else aux_index,
                state_indices={} if t.is_dummy else states,
                required_dst_info_num=mapping.required_dst_info_num,
                is_dummy=t.is_dummy,
            )
            await self._control.send(ep, req, timeout=max(deadline - loop.time(), 0.01))
        self._rx_update(rx.room, KVPoll.WaitingForInput)

    async def _notify_abort(self, room: int, endpoints: list[str], reason: str) -> None:
        if self._control is None:
            return
        msg = Abort(room=room, endpoint=self.endpoint, reason=reason[:4000])
        for ep in endpoints:
            with contextlib.suppress(AiotransferError):
                await self._control.send(ep, msg, timeout=1.0)

    # -- prefill side: transfers ---------------------------------------------------------------
    async def _write_kv(
        self, peer: _DecodePeer, src: np.ndarray, dst: np.ndarray, *, timeout: float, room: int, dst_start: int = 0,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """``on_done`` (direct writes only) runs on the loop as soon as the engine reports the write done,
        before the awaiting task resumes."""
        await self._write_kv_inner(peer, src, dst, timeout=timeout, room=room, dst_start=dst_start, on_done=on_done)
        if self.config.checksum:
            await self._checksum_add(peer, room, src, timeout)

    def _row_slices(self, peer: _DecodePeer) -> tuple[list[RowSlice], list[RowSlice]]:
        """Per paired buffer: the (source, destination) row slice that moves."""
        pairing = peer.pairing
        if pairing.heads is None:
            src = [RowSlice(1, 1, 0, 1, self.args.kv[i].item_len) for i in pairing.src]
            return src, src
        hs = pairing.heads
        rows, hb = pairing.rows_per_page, pairing.head_bytes
        n = int(pairing.src.size)
        return ([RowSlice(rows, hs.src_heads, hs.src_start, hs.count, hb)] * n,
                [RowSlice(rows, hs.dst_heads, hs.dst_start, hs.count, hb)] * n)

    async def _checksum_add(self, peer: _DecodePeer, room: int, src: np.ndarray, timeout: float) -> None:
        assert self._kv_views is not None
        key = (room, peer.endpoint)
        acc = self._checksums.get(key)
        if acc is None:
            acc = self._checksums[key] = RoomChecksum(self._row_slices(peer)[0])
        idx = peer.pairing.src
        views = [self._kv_views[i] for i in idx]
        counts = [self.args.kv[i].num_items for i in idx]
        await self._offload.run(acc.add, views, counts, src, timeout=timeout, what="checksum")

    def _checksum_fields(self, room: int, peer: _DecodePeer) -> tuple[int, list[int]]:
        acc = self._checksums.pop((room, peer.endpoint), None)
        if acc is None:
            return -1, []
        fields: list[int] = []
        for sl, b in zip(self._row_slices(peer)[1], peer.pairing.dst, strict=True):
            fields += [sl.rows, sl.heads, sl.start, sl.count, sl.head_bytes, int(b)]
        return acc.value, fields

    async def _verify_checksum(self, rx: KVReceiver, msg: Status) -> str | None:
        """Decode: recompute what ``msg``'s rank wrote; returns a failure reason or None."""
        f = msg.slices
        if self._kv_views is None or rx._pages is None or len(f) % 6 or not f:
            return "checksum received but cannot be verified here"
        slices, views, counts = [], [], []
        for i in range(0, len(f), 6):
            rows, heads, start, count, hb, b = f[i : i + 6]
            if not 0 <= b < len(self.args.kv) or self.args.kv[b].item_len != rows * heads * hb or start + count > heads:
                return "checksum geometry does not match our buffers"
            slices.append(RowSlice(rows, heads, start, count, hb))
            views.append(self._kv_views[b])
            counts.append(self.args.kv[b].num_items)
        crcs = await self._offload.run(region_crcs, views, counts, rx._pages, slices,
                                       timeout=self.config.transfer_timeout, what="checksum verify")
        got = fold(crcs)
        if got != msg.checksum:
            return f"checksum mismatch for data from prefill rank {msg.rank}: sent {msg.checksum:#010x}, got {got:#010x}"
        return None

    async def _write_kv_inner(
        self, peer: _DecodePeer, src: np.ndarray, dst: np.ndarray, *, timeout: float, room: int, dst_start: int,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        assert self._poller is not None
        pairing = peer.pairing
        runs = pair_runs(src.tolist(), dst.tolist()) if pairing.heads is None and src.size <= _FEW_PAGES else None
        staged = self._staging_plan(peer, src, dst, runs)
        if staged is not None:
            await self._write_kv_staged(peer, src, dst_start, staged, timeout=timeout, room=room)
            return
        rows = pairing.rows_per_page if pairing.sliced else 1
        if src.size * pairing.src.size * rows > _PLAN_OFFLOAD_ENTRIES:
            blocks: Blocks = await self._offload.run(
                self._plan_kv, peer, src, dst, timeout=timeout, what="transfer planning"
            )
        else:
            blocks = self._plan_kv(peer, src, dst, runs)
        try:
            await self._poller.write(peer.session_id, blocks, timeout=timeout, on_done=on_done)
        except EngineError as exc:
            raise TransferFailed(f"engine transfer to {peer.endpoint} failed: {exc}", room=room) from exc
        self.counters["kv_bytes_sent"] += blocks.nbytes
        self.counters["kv_entries_sent"] += len(blocks)

    def _staging_plan(
        self, peer: _DecodePeer, src: np.ndarray, dst: np.ndarray, runs: list[list[int]] | None = None
    ) -> tuple[RowSlice, RowSlice] | None:
        """(source slice, destination slice) when this chunk should be staged, else None (direct).
        ``runs``: the chunk's :func:`pair_runs`, when already known."""
        mode = self.config.staging
        if mode == "never" or self._arena is None or peer.staging is None or self._kv_views is None:
            return None
        pairing = peer.pairing
        nbuf = int(pairing.src.size)
        if mode == "auto" and pairing.heads is None and int(src.size) * nbuf <= 8:
            return None  # a handful of entries: staging's copies and round trips cannot pay off
        src_lens = {int(self.args.kv[i].item_len) for i in pairing.src}
        dst_lens = {int(x) for x in peer.dst_item_lens}
        if len(src_lens) != 1 or len(dst_lens) != 1 or src.size == 0:
            return None
        if pairing.heads is None:
            item = src_lens.pop()
            s_sl = d_sl = RowSlice(1, 1, 0, 1, item)
            if runs is not None:
                breaks = len(runs) - 1
            else:
                breaks = int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1))) if src.size > 1 else 0
            entries = (breaks + 1) * nbuf
        else:
            hs = pairing.heads
            s_sl = RowSlice(pairing.rows_per_page, hs.src_heads, hs.src_start, hs.count, pairing.head_bytes)
            d_sl = RowSlice(pairing.rows_per_page, hs.dst_heads, hs.dst_start, hs.count, pairing.head_bytes)
            entries = int(src.size) * pairing.rows_per_page * nbuf
        per_page = s_sl.bytes_per_page * nbuf
        if per_page * 2 > min(self._arena.nbytes, peer.staging.nbytes):
            return None
        if mode == "always":
            return s_sl, d_sl
        cost = float(getattr(self.engine, "entry_cost_s", 30e-6))
        bw = float(getattr(self.engine, "bandwidth_bps", 2e9))
        if choose_staging(entries=entries, nbytes=per_page * int(src.size), entry_cost_s=cost, bandwidth_bps=bw):
            return s_sl, d_sl
        return None

    async def _write_kv_staged(
        self, peer: _DecodePeer, src: np.ndarray, dst_start: int, slices: tuple[RowSlice, RowSlice], *,
        timeout: float, room: int,
    ) -> None:
        """Gather -> one engine entry -> decode scatters, per piece, pipelined: one gather at a time (the
        copies are CPU-bound), its decode-side space asked for while it runs; writes in flight as long as
        our arena has room; the decode's scatter and ack overlap the next pieces."""
        assert self._arena is not None and self._kv_views is not None and self._poller is not None
        assert peer.staging is not None and self._control is not None
        arena, remote = self._arena, peer.staging
        s_sl, d_sl = slices
        pairing = peer.pairing
        poller = self._poller
        views = [self._kv_views[i] for i in pairing.src]
        num_pages = [self.args.kv[i].num_items for i in pairing.src]
        nbuf = len(views)
        per_page = s_sl.bytes_per_page * nbuf
        cap = max(per_page, min(arena.nbytes // 4, remote.nbytes // 4, _STAGE_PIECE_BYTES))
        step = max(1, cap // per_page)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        gathering = asyncio.Lock()
        dst_buffers = [int(j) for j in pairing.dst]

        def staged_msg(grant: StageGrant, a: int, b: int, nbytes: int) -> Staged:
            return Staged(
                room=room, endpoint=self.endpoint, req_id=grant.req_id, offset=grant.offset, nbytes=nbytes,
                dst_start=dst_start + a, n_pages=b - a, rows=d_sl.rows, heads=d_sl.heads, start=d_sl.start,
                count=d_sl.count, head_bytes=d_sl.head_bytes, buffers=dst_buffers,
            )

        async def piece(a: int, b: int) -> None:
            nbytes = (b - a) * per_page
            posted = landed = False
            granting: asyncio.Future[Any] | None = None
            try:
                async with gathering:
                    loff = await arena.acquire(nbytes, max(deadline - loop.time(), 0.0))
                    granting = asyncio.ensure_future(self._stage_call(
                        peer.endpoint, StageRequest(room=room, endpoint=self.endpoint, req_id=0, nbytes=nbytes),
                        deadline,
                    ))
                    try:
                        out = arena.view[loff : loff + nbytes]
                        await self._offload.run(gather_pages, views, num_pages, src[a:b], s_sl, out,
                                                timeout=max(deadline - loop.time(), 0.001), what="staging gather")
                    except Exception as exc:
                        arena.release(loff, nbytes)
                        if isinstance(exc, AiotransferError):
                            raise
                        raise TransferFailed(f"staging gather failed: {exc!r}", room=room) from exc
                    except BaseException:
                        arena.release(loff, nbytes)
                        raise
                try:
                    grant = await asyncio.shield(granting)  # a cancelled piece leaves the grant to be released
                    if not grant.granted:
                        raise TransferFailed(f"decode refused staging space: {grant.reason}", room=room)
                    blocks = Blocks(
                        np.array([arena.ptr + loff], dtype=np.uint64),
                        np.array([remote.ptr + grant.offset], dtype=np.uint64),
                        np.array([nbytes], dtype=np.uint64),
                    )
                    posted = True
                    await poller.write(peer.session_id, blocks, timeout=max(deadline - loop.time(), 0.001))
                    landed = True
                except EngineError as exc:
                    raise TransferFailed(f"staged transfer to {peer.endpoint} failed: {exc}", room=room) from exc
                finally:
                    if landed or not posted:
                        arena.release(loff, nbytes)  # our copy is free again (kept while the engine may read it)
                ack = await self._stage_call(peer.endpoint, staged_msg(grant, a, b, nbytes), deadline)
                if not ack.ok:
                    raise TransferFailed(f"decode could not scatter a staged piece: {ack.reason}", room=room)
            except BaseException:
                if granting is not None and not posted:
                    self._release_grant_later(peer.endpoint, granting, room)
                raise
            self.counters["kv_bytes_sent"] += nbytes
            self.counters["kv_entries_sent"] += 1
            self.counters["staged_pieces"] += 1

        bounds = [(a, min(a + step, int(src.size))) for a in range(0, int(src.size), step)]
        tasks = [asyncio.ensure_future(piece(a, b)) for a, b in bounds]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    def _release_grant_later(self, endpoint: str, granting: asyncio.Future[Any], room: int) -> None:
        """A piece gave up before anything was written into the decode's space it asked for: hand that
        space back (an empty ``Staged`` piece) once the grant arrives, so the decode does not hold it."""

        async def release() -> None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                grant = await asyncio.shield(granting)
                if grant.granted:
                    msg = Staged(room=room, endpoint=self.endpoint, req_id=grant.req_id, offset=grant.offset,
                                 nbytes=0, dst_start=0, n_pages=0, rows=1, heads=1, start=0, count=1,
                                 head_bytes=1, buffers=[])
                    await self._stage_call(endpoint, msg, asyncio.get_running_loop().time()
                                           + self.config.handshake_timeout)

        self._spawn(release(), "stage-release")

    async def _stage_call(self, endpoint: str, msg: StageRequest | Staged, deadline: float) -> Any:
        """Send a staging message and await its answer (grant or ack), bounded by ``deadline``."""
        assert self._control is not None
        loop = asyncio.get_running_loop()
        if isinstance(msg, StageRequest):
            self._stage_ids += 1
            msg = StageRequest(room=msg.room, endpoint=msg.endpoint, req_id=self._stage_ids, nbytes=msg.nbytes)
            key = msg.req_id
        else:
            key = -msg.req_id
        fut: asyncio.Future[Any] = loop.create_future()
        self._stage_waiters[key] = fut
        try:
            await self._control.send(endpoint, msg, timeout=max(deadline - loop.time(), 0.001))
            try:
                return await asyncio.wait_for(fut, max(deadline - loop.time(), 0.001))
            except asyncio.TimeoutError:
                raise TransferTimeout(f"no staging answer from {endpoint} in time") from None
        finally:
            self._stage_waiters.pop(key, None)

    def _on_stage_answer(self, msg: StageGrant | StagedAck) -> None:
        key = msg.req_id if isinstance(msg, StageGrant) else -msg.req_id
        fut = self._stage_waiters.get(key)
        if fut is None or fut.done():
            self._drop("unexpected-staging-answer", str(msg.req_id))
            return
        fut.set_result(msg)

    # decode side of staging
    def _on_stage_request(self, msg: StageRequest) -> None:
        rx = self._receivers.get(msg.room)
        if rx is None or msg.endpoint not in rx._targets:
            self._drop("unknown-room", f"staging request for room {msg.room}")
            return
        self._spawn(self._grant_stage(msg), "stage-grant")

    async def _grant_stage(self, msg: StageRequest) -> None:
        if self._arena is None:
            answer = StageGrant(room=msg.room, req_id=msg.req_id, offset=0, granted=False,
                                reason="decode has no staging arena")
        else:
            try:
                off = await self._arena.acquire(msg.nbytes, self.config.transfer_timeout)
                self._stage_grants[(msg.endpoint, msg.req_id)] = (msg.room, off, msg.nbytes)
                answer = StageGrant(room=msg.room, req_id=msg.req_id, offset=off, granted=True)
            except (InvalidArgument, TransferTimeout) as exc:
                answer = StageGrant(room=msg.room, req_id=msg.req_id, offset=0, granted=False, reason=str(exc))
        await self._reply(msg.endpoint, answer)

    def _on_staged(self, msg: Staged) -> None:
        grant = self._stage_grants.pop((msg.endpoint, msg.req_id), None)
        if grant is None:
            self._drop("unexpected-staged", f"room {msg.room} piece {msg.req_id}")
            return
        room, off, nbytes = grant
        assert self._arena is not None
        reason = None
        rx = self._receivers.get(msg.room)
        if room == msg.room and off == msg.offset and msg.n_pages == 0:  # the prefill gave the space back unused
            self._arena.release(off, nbytes)
            self.counters["staging_space_returned"] += 1
            self._spawn(self._reply(msg.endpoint, StagedAck(room=msg.room, req_id=msg.req_id, ok=True)), "staged-ack")
            return
        if room != msg.room or off != msg.offset or msg.nbytes > nbytes:
            reason = "staged piece does not match its grant"
        elif rx is None or rx._pages is None:
            reason = f"room {msg.room} is not open here"
        elif msg.dst_start + msg.n_pages > rx._pages.size:
            reason = f"staged pages [{msg.dst_start}, {msg.dst_start + msg.n_pages}) exceed the {rx._pages.size} declared"
        elif any(b >= len(self.args.kv) for b in msg.buffers) or self._kv_views is None:
            reason = "staged piece names unknown buffers"
        elif any(self.args.kv[b].item_len != msg.rows * msg.heads * msg.head_bytes for b in msg.buffers):
            reason = "staged row geometry does not match our pages"
        if reason is not None:
            self._arena.release(off, nbytes)
            self._drop("invalid-staged", reason)
            self._spawn(self._reply(msg.endpoint, StagedAck(room=msg.room, req_id=msg.req_id, ok=False,
                                                            reason=reason)), "staged-nack")
            return
        assert rx is not None and rx._pages is not None and self._kv_views is not None
        pages = rx._pages[msg.dst_start : msg.dst_start + msg.n_pages]
        sl = RowSlice(msg.rows, msg.heads, msg.start, msg.count, msg.head_bytes)
        views = [self._kv_views[b] for b in msg.buffers]
        counts = [self.args.kv[b].num_items for b in msg.buffers]
        src = self._arena.view[off : off + msg.nbytes]
        self._spawn(self._scatter(msg, pages, sl, views, counts, src, off, nbytes), "scatter")

    async def _scatter(self, msg: Staged, pages: np.ndarray, sl: RowSlice, views: list[np.ndarray],
                       counts: list[int], src: np.ndarray, off: int, nbytes: int) -> None:
        assert self._arena is not None
        ok, reason = True, ""
        try:
            await self._offload.run(scatter_pages, views, counts, pages, sl, src,
                                    timeout=self.config.transfer_timeout, what="staging scatter")
            self.counters["staged_pieces_received"] += 1
        except Exception as exc:  # the prefill learns why instead of waiting for an ack that never comes
            ok, reason = False, str(exc) if isinstance(exc, AiotransferError) else f"scatter failed: {exc!r}"
        finally:
            self._arena.release(off, nbytes)
        await self._reply(msg.endpoint, StagedAck(room=msg.room, req_id=msg.req_id, ok=ok, reason=reason))

    def _plan_kv(
        self, peer: _DecodePeer, src: np.ndarray, dst: np.ndarray, runs: list[list[int]] | None = None
    ) -> Blocks:
        pairing = peer.pairing
        if runs is not None and len(runs) * int(pairing.src.size) <= _FEW_ENTRIES:
            few = peer.few
            if few is None:
                few = peer.few = (
                    self._kv_bases[pairing.src].tolist(), peer.dst_bases.tolist(),
                    self._kv_item_lens[pairing.src].tolist(),
                )
            return plan_runs(few[0], few[1], few[2], runs)
        src_bases = self._kv_bases[pairing.src]
        src_lens = self._kv_item_lens[pairing.src]
        if pairing.heads is None:
            return plan_blocks(src_bases, peer.dst_bases, src_lens, src, dst)
        hs = pairing.heads
        return plan_head_slices(
            src_bases, peer.dst_bases, src_lens, peer.dst_item_lens, src, dst,
            rows_per_page=pairing.rows_per_page, src_heads=hs.src_heads, dst_heads=hs.dst_heads,
            head_bytes=pairing.head_bytes, src_head_start=hs.src_start, dst_head_start=hs.dst_start,
            head_count=hs.count,
        )

    async def _write_state(
        self, peer: _DecodePeer, kind: str, src: np.ndarray, dst: np.ndarray, *, timeout: float, room: int
    ) -> None:
        assert self._poller is not None
        bufs = self.args.state[kind]
        remote = peer.state.get(kind)
        if remote is None:
            raise TransferFailed(f"decode {peer.endpoint} registered no {kind} state buffers", room=room)
        bases = np.array([b.ptr for b in bufs], dtype=np.uint64)
        lens = np.array([b.item_len for b in bufs], dtype=np.uint64)
        blocks = plan_blocks(bases, remote[0], lens, src, dst)
        try:
            await self._poller.write(peer.session_id, blocks, timeout=timeout)
        except EngineError as exc:
            raise TransferFailed(f"{kind} state transfer to {peer.endpoint} failed: {exc}", room=room) from exc
        self.counters[f"state_{kind}_bytes_sent"] += blocks.nbytes

    async def _send_aux(self, peer: _DecodePeer, room: int, src_slot: int, dst_slot: int, timeout: float) -> str:
        """Deliver one aux slot to ``peer``; returns the path used (``engine`` or ``tcp``)."""
        assert self._poller is not None
        if self.aux_path is AuxPath.ENGINE:
            blocks = plan_blocks(
                self._aux_bases, peer.aux_bases, self._aux_item_lens, np.array([src_slot]), np.array([dst_slot])
            )
            try:
                t0 = time.monotonic()
                await self._poller.write(peer.session_id, blocks, timeout=timeout)
                self.metrics.observe("aux_engine", time.monotonic() - t0)
                self.counters["aux_engine"] += 1
                log.debug("room %d: aux slot %d -> %s slot %d via engine", room, src_slot, peer.endpoint, dst_slot)
                return "engine"
            except (EngineError, TransferTimeout) as exc:
                if self.config.aux_path is not AuxPath.AUTO:
                    raise TransferFailed(f"aux transfer to {peer.endpoint} failed: {exc}", room=room) from exc
                if any(b.device != "cpu" for b in self.args.aux):
                    raise TransferFailed(
                        f"aux transfer to {peer.endpoint} failed ({exc}); no TCP fallback for device-resident aux",
                        room=room,
                    ) from exc
                self.counters["aux_fallback"] += 1
                if not self._aux_fallback_logged:
                    self._aux_fallback_logged = True
                    log.warning("aux via the engine failed (%s); falling back to TCP (logged once)", exc)
        t0 = time.monotonic()
        await self._send_aux_tcp(peer, room, src_slot, dst_slot, timeout)
        self.metrics.observe("aux_tcp", time.monotonic() - t0)
        self.counters["aux_tcp"] += 1
        log.debug("room %d: aux slot %d -> %s slot %d via tcp", room, src_slot, peer.endpoint, dst_slot)
        return "tcp"

    async def _send_aux_tcp(self, peer: _DecodePeer, room: int, src_slot: int, dst_slot: int, timeout: float) -> None:
        assert self._control is not None
        for i, buf in enumerate(self.args.aux):
            data = _read_bytes(buf, src_slot)
            msg = AuxData(room=room, buffer=i, index=dst_slot, data=data, endpoint=self.endpoint)
            await self._control.send(peer.endpoint, msg, timeout=timeout)

    async def _conclude_success(self, tx: KVSender, dsts: list[Any], deadline: float) -> None:
        """Aux/state are delivered before this; then Success goes to every real decode rank."""
        assert self._control is not None
        loop = asyncio.get_running_loop()
        for d in dsts:
            await self._control.send(d.peer.endpoint, self._success_msg(tx, d.peer),
                                     timeout=max(deadline - loop.time(), 0.001), yield_cpu=self._yield_after_notify())
        self._tx_update(tx.room, KVPoll.Success)

    def _success_msg(self, tx: KVSender, peer: _DecodePeer) -> Status:
        checksum, slices = self._checksum_fields(tx.room, peer)
        return Status(room=tx.room, status=int(KVPoll.Success), rank=self._rank_id(), endpoint=self.endpoint,
                      aux_path=tx.aux_path or "", checksum=checksum, slices=slices)

    def _try_conclude_now(self, tx: KVSender, peer: _DecodePeer) -> bool:
        """Send Success to the room's only decode rank without waiting, from the completion of its last KV
        write (see :meth:`KVSender._conclude_on_completion`); False when the message cannot leave at once."""
        if self._control is None or self._closed:
            return False
        return self._control.try_send(peer.endpoint, self._success_msg(tx, peer), yield_cpu=self._yield_after_notify())

    def _yield_after_notify(self) -> bool:
        """Yield the CPU to ZMQ's I/O thread after a Success only when no transfer of ours waits for the loop,
        and only on engines whose threads sleep while idle: ``sched_yield`` hands the CPU to any runnable
        thread, and a spinning one (NIXL over UCX) keeps it for a whole time slice (4 KiB end to end on NIXL
        shm measured 2.3 ms with the yield, 0.68 ms without)."""
        return (
            self.config.yield_after_notify
            and getattr(self._engine, "quiet_threads", False)
            and (self._poller is None or self._poller.in_flight == 0)
        )

    async def _notify_failure(self, room: int, endpoints: list[str], reason: str) -> None:
        if self._control is None or self._closed:
            return
        msg = Status(room=room, status=int(KVPoll.Failed), rank=self._rank_id(), endpoint=self.endpoint,
                     reason=reason[:4000])
        for ep in endpoints:
            with contextlib.suppress(AiotransferError):
                await self._control.send(ep, msg, timeout=1.0)

    def _rank_id(self) -> int:
        return self.parallel.unique_rank

    def _rank_key(self) -> tuple[int, int, int, int]:
        p = self.parallel
        return (p.dp_rank, p.tp_rank, p.pp_rank, p.cp_rank)

    def _register_msg(self) -> RankRegister:
        a, p = self.args, self.parallel
        return RankRegister(
            version=PROTOCOL_VERSION,
            rank=RankEndpoint(p.dp_rank, p.tp_rank, p.pp_rank, p.cp_rank, self.endpoint),
            tp_size=p.tp_size, pp_size=p.pp_size, cp_size=p.cp_size, dp_size=self.config.dp_size,
            layout=a.layout, total_kv_heads=a.total_kv_heads, page_size=a.page_size,
        )

    async def _register_with_leader(self, leader: str) -> None:
        """Non-leader prefill rank: announce this rank to the bootstrap leader (fire and forget; the
        leader answers topology queries only once every rank is in, and decode retries until then)."""
        assert self._control is not None
        try:
            endpoint = normalize_endpoint(leader)
        except ValueError as exc:
            raise InvalidArgument(f"bootstrap: {exc}") from None
        await self._control.send(endpoint, self._register_msg(), timeout=self.config.handshake_timeout)

    # -- bootstrap leader ------------------------------------------------------------------------
    def _topology(self, nonce: int) -> Topology:
        p, a = self.parallel, self.args
        if self.config.bootstrap:
            return Topology(version=PROTOCOL_VERSION, nonce=nonce, ready=False,
                            reason="not the bootstrap leader", redirect=normalize_endpoint(self.config.bootstrap))
        expected = self.config.dp_size * p.tp_size * p.pp_size * p.cp_size
        ready = len(self._ranks) >= expected
        return Topology(
            version=PROTOCOL_VERSION, nonce=nonce, ready=ready,
            reason="" if ready else f"{len(self._ranks)}/{expected} prefill ranks registered",
            tp_size=p.tp_size, pp_size=p.pp_size, cp_size=p.cp_size, dp_size=self.config.dp_size,
            layout=a.layout, total_kv_heads=a.total_kv_heads, page_size=a.page_size,
            ranks=[RankEndpoint(*key, ep) for key, ep in sorted(self._ranks.items())] if ready else [],
        )

    def _on_rank_register(self, msg: RankRegister) -> None:
        p = self.parallel
        if self.config.bootstrap:
            self._drop("not-leader", f"rank registration from {msg.rank.endpoint}")
            return
        if (msg.tp_size, msg.pp_size, msg.cp_size, msg.dp_size) != (p.tp_size, p.pp_size, p.cp_size,
                                                                   self.config.dp_size):
            self._drop("bad-rank", f"{msg.rank.endpoint} reports a different topology")
            log.warning("prefill rank %s reports sizes tp=%d pp=%d cp=%d dp=%d; leader has tp=%d pp=%d cp=%d dp=%d",
                        msg.rank.endpoint, msg.tp_size, msg.pp_size, msg.cp_size, msg.dp_size,
                        p.tp_size, p.pp_size, p.cp_size, self.config.dp_size)
            return
        r = msg.rank
        self._ranks[(r.dp_rank, r.tp_rank, r.pp_rank, r.cp_rank)] = r.endpoint

    async def _ensure_topology(self, peer: str, timeout: float) -> _PrefillTopology:
        """Resolve a bootstrap address into the prefill topology (cached; retried until every rank is in)."""
        cached = self._topologies.get(peer)
        if cached is not None:
            return cached
        if self._liveness.is_dead(peer):
            raise PeerError(f"prefill {peer} was declared dead and has not answered since; probing it")
        assert self._control is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        target = peer
        delay = 0.01
        last = "no answer"
        while True:
            nonce = secrets.randbits(62)
            fut: asyncio.Future[Topology] = loop.create_future()
            self._topology_waiters[nonce] = fut
            try:
                await self._control.send(target, TopologyQuery(version=PROTOCOL_VERSION, endpoint=self.endpoint,
                                                               nonce=nonce), timeout=max(deadline - loop.time(), 0.01))
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    topo = await asyncio.wait_for(fut, min(remaining, max(1.0, delay * 4)))
                except asyncio.TimeoutError:
                    last = "no answer"
                    if loop.time() >= deadline:
                        break
                    continue
            finally:
                self._topology_waiters.pop(nonce, None)
            if topo.redirect:
                target = topo.redirect
                continue
            if topo.reason.startswith("refused:"):
                raise IncompatiblePeer(f"{peer}: {topo.reason[len('refused:'):].strip()}")
            if topo.ready:
                endpoints = {(r.dp_rank, r.tp_rank, r.pp_rank, r.cp_rank): r.endpoint for r in topo.ranks}
                resolved = _PrefillTopology(topo, endpoints)
                self._topologies[peer] = resolved
                return resolved
            last = topo.reason
            await asyncio.sleep(min(delay, max(deadline - loop.time(), 0)))
            delay = min(delay * 2, 0.5)
            if loop.time() >= deadline:
                break
        self._control.forget(peer)
        raise PeerError(
            f"no registration answer from {peer} within {timeout:.3g}s ({last}; wrong address, peer down, "
            "or not an aiotransfer manager)"
        )

    def _on_topology_query(self, msg: TopologyQuery) -> None:
        assert self._control is not None
        self._spawn(self._reply(msg.endpoint, self._topology(msg.nonce)), "topology")

    async def _reply(self, endpoint: str, msg: Message) -> None:
        assert self._control is not None
        with contextlib.suppress(AiotransferError):
            await self._control.send(endpoint, msg, timeout=self.config.handshake_timeout)

    def _on_topology(self, msg: Topology) -> None:
        fut = self._topology_waiters.get(msg.nonce)
        if fut is None or fut.done():
            self._drop("unexpected-topology", str(msg.nonce))
            return
        fut.set_result(msg)

    # -- inbound control messages -------------------------------------------------------------
    def _dispatch(self, msg: Message) -> None:
        sender = getattr(msg, "endpoint", None)
        if sender:
            self._liveness.seen(sender)
        if isinstance(msg, Ping):
            pong = Pong(endpoint=self.endpoint, nonce=msg.nonce, incarnation=self.generation)
            self._spawn(self._reply(msg.endpoint, pong), "pong")
        elif isinstance(msg, Pong):
            self._liveness.incarnation(msg.endpoint, msg.incarnation)
        elif isinstance(msg, TransferRequest):
            self._on_request(msg)
        elif isinstance(msg, Status):
            self._on_status(msg)
        elif isinstance(msg, Hello):
            if msg.endpoint not in self._hello_inflight:
                task = asyncio.get_running_loop().create_task(self._on_hello(msg), name=f"hello-{msg.endpoint}")
                self._tasks.add(task)
                self._hello_inflight[msg.endpoint] = task

                def _done(t: asyncio.Task[None], ep: str = msg.endpoint) -> None:
                    self._tasks.discard(t)
                    if self._hello_inflight.get(ep) is t:
                        del self._hello_inflight[ep]

                task.add_done_callback(_done)
        elif isinstance(msg, HelloAck):
            fut = self._hello_waiters.get(msg.generation)
            self._on_hello_ack(msg, fut)
        elif isinstance(msg, Abort):
            self._on_abort(msg)
        elif isinstance(msg, AuxData):
            self._on_aux(msg)
        elif isinstance(msg, TopologyQuery):
            self._on_topology_query(msg)
        elif isinstance(msg, Topology):
            self._on_topology(msg)
        elif isinstance(msg, RankRegister):
            self._on_rank_register(msg)
        elif isinstance(msg, (StageGrant, StagedAck)):
            self._on_stage_answer(msg)
        elif isinstance(msg, StageRequest):
            self._on_stage_request(msg)
        elif isinstance(msg, Staged):
            self._on_staged(msg)

    def _drop(self, cause: str, detail: str) -> None:
        self.counters[f"dropped_{cause}"] += 1
        log.debug("dropped control message (%s): %s", cause, detail)

    def _refusal(self, hello: Hello) -> KVPairing | str:
        """Pair our buffers with a registering decode rank's, or say why not."""
        a = self.args
        if hello.engine != self.config.engine.replace("mooncake_tcp", "mooncake"):
            return f"engine mismatch: peer uses {hello.engine!r}, we use {self.config.engine!r}"
        if hello.layout != a.layout:
            return f"layout mismatch: peer {hello.layout!r}, ours {a.layout!r}"
        if hello.page_size != a.page_size:
            return f"page size mismatch: peer {hello.page_size}, ours {a.page_size}"
        if hello.compat != self._compat:
            return f"KV geometry hash mismatch (dtype/layout/page size): peer {hello.compat}, ours {self._compat}"
        remote = RankGeometry(
            layout=hello.layout, page_size=hello.page_size, item_lens=[b.item_len for b in hello.kv],
            layer_ids=[b.layer_id for b in hello.kv], tp_size=hello.tp_size, tp_rank=hello.tp_rank,
            kv_heads=hello.kv_heads, total_kv_heads=hello.total_kv_heads, outer=hello.outer,
        )
        if (hello.tp_size != a.tp_size or hello.kv_heads != a.kv_heads) and not a.is_mla and not (
            a.total_kv_heads and hello.total_kv_heads
        ):
            return "TP sizes differ: both sides must set kv_heads and total_kv_heads for head slicing"
        pairing = pair_buffers(self._geometry, remote)
        if isinstance(pairing, str):
            return pairing
        if hello.aux and a.aux:
            theirs = [b.item_len for b in hello.aux]
            ours = [b.item_len for b in a.aux]
            if theirs != ours:
                return f"aux buffers mismatch: peer item lengths {theirs}, ours {ours}"
        for spec in hello.state:
            local = a.state.get(spec.kind)
            if local is None:
                continue
            theirs = [b.item_len for b in spec.buffers]
            ours = [b.item_len for b in local]
            if theirs != ours:
                return f"{spec.kind} state buffers mismatch: peer item lengths {theirs}, ours {ours}"
        return pairing

    async def _on_hello(self, hello: Hello) -> None:
        assert self._control is not None
        verdict = self._refusal(hello)
        reason = verdict if isinstance(verdict, str) else None
        if reason is None:
            try:
                await self._offload.run(
                    self.engine.connect, hello.session_id, hello.engine_info, hello.probe_addr,
                    timeout=self.config.handshake_timeout, what=f"engine handshake with {hello.session_id}",
                )
            except (EngineError, TransferTimeout) as exc:
                reason = f"our engine cannot reach yours ({hello.session_id}): {exc}"
        if reason is None:
            kv_bases = np.array([b.ptr for b in hello.kv], dtype=np.uint64)
            item_lens = np.array([b.item_len for b in hello.kv], dtype=np.uint64)
            num_pages = min((b.nbytes // b.item_len for b in hello.kv), default=0)
            aux_slots = min((b.nbytes // b.item_len for b in hello.aux), default=0)
            aux_bases = np.array([b.ptr for b in hello.aux], dtype=np.uint64)
            state = {
                s.kind: (
                    np.array([b.ptr for b in s.buffers], dtype=np.uint64),
                    min((b.nbytes // b.item_len for b in s.buffers), default=0),
                )
                for s in hello.state
            }
            old = self._decode_peers.get(hello.endpoint)
            if old is not None and old.hello.generation != hello.generation:
                self.counters["decode_peer_reregistered"] += 1
                self._fail_rooms_with(hello.endpoint, f"decode {hello.endpoint} registered again (restarted?)")
            assert isinstance(verdict, KVPairing)
            self._decode_peers[hello.endpoint] = _DecodePeer(
                hello.endpoint, hello, kv_bases, item_lens, num_pages, aux_slots, aux_bases, state,
                verdict, kv_bases[verdict.dst], item_lens[verdict.dst], hello.staging,
            )
        else:
            self.counters["peers_refused"] += 1
            log.warning("refusing decode peer %s: %s", hello.endpoint, reason)
        ack = HelloAck(
            version=PROTOCOL_VERSION,
            endpoint=self.endpoint,
            generation=hello.generation,
            accepted=reason is None,
            reason=reason or "",
            engine=self.config.engine,
            session_id=self.engine.session_id,
            rank=self._rank_id(),
        )
        with contextlib.suppress(AiotransferError):
            await self._control.send(hello.endpoint, ack, timeout=self.config.handshake_timeout)

    def _on_hello_ack(self, ack: HelloAck, fut: asyncio.Future[HelloAck] | None) -> None:
        if fut is None or fut.done():
            self._drop("unexpected-hello-ack", ack.endpoint)
            return
        fut.set_result(ack)

    def _on_request(self, req: TransferRequest) -> None:
        peer = self._decode_peers.get(req.endpoint)
        pending_hello = self._hello_inflight.get(req.endpoint)
        if peer is None and pending_hello is not None:
            # Its registration is still being checked (engine handshake): handle the request right after.
            self._spawn(self._after_hello(pending_hello, req), "request-after-hello")
            return
        if peer is None:
            self._drop("unregistered-peer", f"request for room {req.room} from {req.endpoint}")
            self._spawn(
                self._notify_failure(req.room, [req.endpoint], "transfer request from an unregistered decode rank"),
                "refuse",
            )
            return
        if req.generation != peer.hello.generation:
            self._drop("stale-generation", f"room {req.room} from {req.endpoint}")
            return
        try:
            idx = unpack_indices(req.kv_indices)
            if not req.is_dummy:
                check_range(idx, peer.num_pages, what="destination kv indices")
                check_unique(idx, what="destination kv indices")
            self._check_request_extras(peer, req)
        except (InvalidArgument, ProtocolError) as exc:
            self._drop("invalid-request", str(exc))
            reason = f"invalid transfer request: {exc}"
            tx = self._senders.get(req.room)
            if tx is not None:
                self._spawn(tx._fail(reason), "fail")
            if tx is None or req.endpoint not in tx._dsts:
                self._spawn(self._notify_failure(req.room, [req.endpoint], reason), "refuse")
            return
        tx = self._senders.get(req.room)
        if tx is None:
            self._stash(req.room, peer, req, idx)
            return
        self._accept_request(tx, peer, req, idx)

    def _check_request_extras(self, peer: _DecodePeer, req: TransferRequest) -> None:
        """Aux/state declarations against what the decode registered and what we can send."""
        if req.aux_index >= 0:
            if not self.args.aux:
                raise InvalidArgument("decode declared an aux slot but this prefill has no aux buffers")
            if not peer.hello.aux:
                raise InvalidArgument("decode declared an aux slot but registered no aux buffers")
            if req.aux_index >= peer.aux_slots:
                raise InvalidArgument(f"aux index {req.aux_index} out of range of the decode's {peer.aux_slots} slots")
        for kind, idx in req.state_indices.items():
            if kind not in self.args.state:
                raise InvalidArgument(f"decode declared {kind} state but this prefill has no {kind} state buffers")
            remote = peer.state.get(kind)
            if remote is None:
                raise InvalidArgument(f"decode declared {kind} state but registered no {kind} state buffers")
            if idx and max(idx) >= remote[1]:
                raise InvalidArgument(f"{kind} state index {max(idx)} out of range of the decode's {remote[1]} slots")
            if StateType.slot_based(kind) and len(idx) != 1:
                raise InvalidArgument(f"{kind} state takes exactly one slot per request, got {len(idx)}")

    async def _after_hello(self, hello_task: asyncio.Task[None], req: TransferRequest) -> None:
        with contextlib.suppress(Exception):
            await asyncio.shield(hello_task)
        self._on_request(req)

    def _accept_request(self, tx: KVSender, peer: _DecodePeer, req: TransferRequest, idx: np.ndarray) -> None:
        self._liveness.activate(req.endpoint)
        reason = tx._add_request(peer, req, idx)
        if reason is not None:
            self._drop("refused-request", reason)
            self._spawn(self._notify_failure(req.room, [req.endpoint], reason), "refuse")

    def _stash(self, room: int, peer: _DecodePeer, req: TransferRequest, idx: np.ndarray) -> None:
        now = time.monotonic()
        ttl = self.config.pending_request_ttl
        while self._pending:
            first_room, first = next(iter(self._pending.items()))
            if now - first.since <= ttl and len(self._pending) < self.config.max_rooms:
                break
            expired = self._pending.pop(first_room)
            self.counters["pending_expired"] += 1
            # nothing is dropped silently: the decode ranks learn why their request went nowhere
            self._spawn(self._notify_failure(
                first_room, [p.endpoint for p, _, _ in expired.items],
                "transfer request expired before the prefill created the room",
            ), "expire")
        entry = self._pending.get(room)
        if entry is None:
            entry = self._pending[room] = _Pending(now)
        entry.items.append((peer, req, idx))

    def _on_status(self, msg: Status) -> None:
        rx = self._receivers.get(msg.room)
        if rx is None:
            self._drop("unknown-room", f"status for room {msg.room}")
            return
        if msg.status == int(KVPoll.Success) and msg.checksum >= 0 and msg.endpoint in rx._targets:
            self._spawn(self._verified_status(rx, msg), "verify")
            return
        if not rx._on_prefill_status(msg.endpoint, msg.rank, KVPoll(msg.status), msg.reason, msg.aux_path):
            self._drop("wrong-peer", f"status for room {msg.room} from {msg.endpoint}")

    async def _verified_status(self, rx: KVReceiver, msg: Status) -> None:
        reason = await self._verify_checksum(rx, msg)
        if reason is not None:
            self.counters["checksum_mismatches"] += 1
            log.error("room %d: %s", rx.room, reason)
            await rx.abort(reason)
            return
        self.counters["checksums_verified"] += 1
        rx._on_prefill_status(msg.endpoint, msg.rank, KVPoll.Success, msg.reason, msg.aux_path)

    def _on_abort(self, msg: Abort) -> None:
        tx = self._senders.get(msg.room)
        if tx is not None and msg.endpoint in tx._dsts:
            self._tx_update(msg.room, KVPoll.Failed, f"aborted by decode: {msg.reason}")
            return
        if self._pending.pop(msg.room, None) is not None:
            return
        if msg.reason.startswith("checksum mismatch"):
            self.counters["checksum_mismatches_reported"] += 1
            log.error("decode %s reports for room %d: %s", msg.endpoint, msg.room, msg.reason)
            return
        rx = self._receivers.get(msg.room)
        if rx is not None and msg.endpoint in rx._targets:
            self._rx_update(msg.room, KVPoll.Failed, f"aborted by prefill: {msg.reason}")
            return
        self._drop("unknown-room", f"abort for room {msg.room}")

    def _on_aux(self, msg: AuxData) -> None:
        """Decode side of the TCP aux path: write the bytes in place, only into the declared slot."""
        rx = self._receivers.get(msg.room)
        if rx is None:
            self._drop("unknown-room", f"aux for room {msg.room}")
            return
        if msg.endpoint not in rx._targets:
            self._drop("wrong-peer", f"aux for room {msg.room} from {msg.endpoint}")
            return
        if rx.aux_index is None or msg.index != rx.aux_index or msg.buffer >= len(self.args.aux):
            self._drop("invalid-aux", f"aux for room {msg.room}: buffer {msg.buffer} slot {msg.index}")
            return
        buf = self.args.aux[msg.buffer]
        if len(msg.data) != buf.item_len:
            self._drop("invalid-aux", f"aux for room {msg.room}: {len(msg.data)} bytes, slot holds {buf.item_len}")
            return
        _write_bytes(buf, msg.index, msg.data)
        rx._aux_received.add(msg.buffer)
        self.counters["aux_tcp_received"] += 1


def _read_bytes(buf: Buffer, slot: int) -> bytes:
    """Copy one slot out of host memory (aux buffers on the TCP path live in host memory)."""
    return ctypes.string_at(buf.ptr + buf.item_len * slot, buf.item_len)


def _write_bytes(buf: Buffer, slot: int, data: bytes) -> None:
    ctypes.memmove(buf.ptr + buf.item_len * slot, data, len(data))


def _merge_regions(regions: list[MemoryRegion]) -> list[MemoryRegion]:
    """Merge touching or overlapping regions of the same device into one."""
    out: list[MemoryRegion] = []
    for r in sorted(set(regions), key=lambda r: (r.device, r.ptr)):
        if out and out[-1].device == r.device and r.ptr <= out[-1].end:
            last = out[-1]
            out[-1] = MemoryRegion(last.ptr, max(last.end, r.end) - last.ptr, last.device)
        else:
            out.append(r)
    return out
