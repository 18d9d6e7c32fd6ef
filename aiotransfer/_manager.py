"""``KVManager``: one per rank. Lifecycle, the room registry, liveness, stats, and the dispatch of
control messages to the part that handles them (see :mod:`aiotransfer._kv` for the parts)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import numpy as np

from . import _threads
from ._args import KVArgs
from ._config import AuxPath, TransferConfig
from ._control.endpoint import ControlPlane, normalize_endpoint
from ._control.messages import (
    PROTOCOL_VERSION,
    Abort,
    AuxData,
    Drained,
    Hello,
    HelloAck,
    Message,
    Ping,
    Pong,
    RankRegister,
    Staged,
    StagedAck,
    StageGrant,
    StageRequest,
    Status,
    Topology,
    TopologyQuery,
    TransferRequest,
)
from ._control.rendezvous import Rendezvous
from ._events import PeerEvent, PeerEvents
from ._kv import shutdown, upkeep
from ._kv.client import PrefillClient
from ._kv.context import RankContext
from ._kv.decode import DecodeSide
from ._kv.leader import BootstrapLeader
from ._kv.lifecycle import Lifecycle
from ._kv.notify import Notifier
from ._kv.prefill import PrefillSide
from ._kv.push import Pusher, TransferPlan
from ._kv.room import RoomSide
from ._kv.staged import StagingGrantor
from ._liveness import Liveness
from ._metrics import Metrics
from ._poller import Poller
from ._receiver import KVReceiver, decode_reason
from ._sender import KVSender
from ._status import KVPoll
from ._topology import ParallelInfo
from ._types import ManagerStats, PageIndices
from .engines._base import TransferEngine
from .engines._registry import create_engine
from .errors import AiotransferError, ClosedError, InvalidArgument

__all__ = ["KVManager"]

log = logging.getLogger("aiotransfer.manager")


class KVManager:
    """One rank's transfer endpoint: engine + poll loop + control plane + registered buffers.

    Use as an async context manager:

    ```python
    async with KVManager(args, TransferConfig(engine="mooncake_tcp")) as mgr:
        tx = mgr.sender(room)            # prefill role
        rx = mgr.receiver(room, peer)    # decode role (peer = the prefill's mgr.endpoint)
    ```

    A manager can play both roles. Nothing here blocks the event loop: engine calls go through one
    named executor and one poll loop, and every wait is bounded.

    Args:
        args: This rank's memory: KV buffers, aux and state buffers, page size, parallelism.
        config: Engine and bounds; None reads
            [`TransferConfig.from_env`][aiotransfer.TransferConfig.from_env].
        engine: An engine object to use instead of creating one from ``config.engine`` (the manager
            then does not close it): in tests, a `MemoryEngine` on a fabric of the test's own
            (``KVManager(args, engine=MemoryEngine(fabric))``). ``config.engine`` follows the object's
            ``name`` when it names another engine.

    Raises:
        InvalidArgument: A configuration this memory cannot serve (``checksum=True`` with device KV).
    """

    def __init__(
        self,
        args: KVArgs,
        config: TransferConfig | None = None,
        *,
        engine: TransferEngine | None = None,
    ) -> None:
        self.args = args
        config = config if config is not None else TransferConfig.from_env()
        if engine is not None and config.engine.partition("_")[0] != engine.name:
            # the object says which engine this is: peers are told its name, and its threads are named after it
            config = dataclasses.replace(config, engine=engine.name)
        self.config = config
        self._own_engine = engine is None
        self._liveness = Liveness(
            interval=self.config.heartbeat_interval, timeout=self.config.peer_timeout,
            active_peers=self._active_peers, ping=self._ping, on_dead=self._on_peer_dead,
            on_restart=self._on_peer_restart, max_peers=self.config.max_peers,
        )
        ctx = self._ctx = RankContext(args, self.config, engine, self._liveness)
        ctx.on_send_failed = self._on_send_failed
        self._regions = ctx.regions()
        self._registered = False
        self._engine_threads = "normal"
        """``engine_threads`` in effect: ``background`` only once started on an engine that allows it."""
        self._senders: dict[int, KVSender] = {}
        self._receivers: dict[int, KVReceiver] = {}
        self._pusher = Pusher(ctx)
        self._notifier = Notifier(ctx, self._pusher)
        self._grantor = StagingGrantor(ctx, self._receivers.get, lambda room: self._life.rx.get(room))
        self._events = PeerEvents()
        self._life = Lifecycle(ctx, self._grantor, self._events.publish)
        self._prefill = PrefillSide(ctx, self._senders, self._life.tx, self._notifier, self._fail_rooms_with)
        self._client = PrefillClient(ctx)
        self._decode = DecodeSide(ctx, self._receivers, self._life.rx, self._client.forget)
        self._leader = BootstrapLeader(ctx)
        self._round_trips: Rendezvous[int, Pong] = Rendezvous()
        """Pings whose answer someone waits for, by nonce (see :meth:`_on_peer_restart`)."""
        p, c, d = self._prefill, self._client, self._decode
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            Ping: self._on_ping, Pong: self._on_pong,
            Hello: p.on_hello, HelloAck: c.on_hello_ack, TransferRequest: p.on_request, Abort: self._on_abort,
            Status: d.on_status, AuxData: d.on_aux,
            TopologyQuery: self._leader.on_query, Topology: c.on_topology, RankRegister: self._leader.on_register,
            StageGrant: self._pusher.staging.on_answer, StagedAck: self._pusher.staging.on_answer,
            StageRequest: self._grantor.on_request, Staged: self._grantor.on_staged, Drained: d.on_drained,
        }
        if self.config.checksum and ctx.kv_views is None:
            raise InvalidArgument("checksum=True needs host-memory KV buffers")

    # -- what users read --------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """This manager's incarnation id (a restarted peer shows a new one)."""
        return self._ctx.generation

    @property
    def parallel(self) -> ParallelInfo:
        return self._ctx.parallel

    @property
    def aux_path(self) -> AuxPath:
        """The aux path this manager uses (``ENGINE`` may still fall back to TCP on ``auto``)."""
        return self._ctx.aux_path

    @property
    def counters(self) -> Any:
        """Event counters (a :class:`collections.Counter`), also part of :meth:`stats`."""
        return self._ctx.counters

    @property
    def metrics(self) -> Metrics:
        return self._ctx.metrics

    @property
    def endpoint(self) -> str:
        """This rank's control address (give it to decode as ``peer``)."""
        return self._ctx.endpoint

    @property
    def engine(self) -> TransferEngine:
        return self._ctx.engine

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> KVManager:
        """Create the engine (on its driver thread, after device binding), register memory, open the control
        socket and start the heartbeat. Idempotent; ``async with`` calls it for you.

        Returns:
            This manager.

        Raises:
            EngineUnavailable: The engine's package is not installed (the message says what to install).
            EngineError: The engine failed to start or to register the memory.
            ClosedError: The manager was closed.
        """
        ctx, cfg = self._ctx, self.config
        if ctx.started:
            return self
        if ctx.closed:
            raise ClosedError("manager is closed")
        background = cfg.engine_threads == "background" and _threads.supported()
        if cfg.engine_threads == "background" and not background:
            log.warning("engine_threads='background' needs Linux SCHED_IDLE; engine threads stay normal")
        try:
            if background:
                _threads.mark_foreign()  # before the engine starts its threads
            if ctx.engine_or_none is None:
                # create_engine runs on the driver thread, whose initializer already bound the device
                ctx.engine_or_none = await ctx.driver.run(
                    create_engine, cfg, timeout=max(cfg.handshake_timeout, 30.0), what="engine initialisation"
                )
            engine = ctx.engine
            await ctx.driver.run(engine.register, self._regions, timeout=cfg.handshake_timeout,
                                 what="memory registration")
            ctx.engine_info = await ctx.driver.run(engine.local_info, timeout=cfg.handshake_timeout,
                                                   what="engine info")
            self._registered = True
            if background and not engine.traits.quiet_threads:
                # A busy-polling engine thread at idle priority is preempted while it holds the engine's
                # own lock, and every submit and check of ours then waits behind it (priority inversion).
                background = False
                log.warning("engine_threads='background' ignored: the %s engine's threads busy-poll and hold "
                            "its internal lock; at idle priority they would stall transfers", cfg.engine)
            self._engine_threads = "background" if background else "normal"
            if background:
                await upkeep.background_engine_threads(ctx)  # first look, before ZMQ starts its threads
            ctx.poller_or_none = Poller(
                engine, ctx.driver, max_in_flight=cfg.max_entries_in_flight, max_batch=cfg.max_batch_entries,
                interval_min=cfg.poll_interval_min, interval_max=cfg.poll_interval_max,
                expire_after=cfg.quarantine_s, fine_timer=cfg.fine_poll_timer,
            )
            ctx.control_or_none = self._make_control_plane()
            await ctx.control_or_none.start()
            self._leader.add_self()
            self._liveness.start()
            ctx.spawn(self._life.prove_gone(), "prove-gone")
            ctx.spawn(self._prefill.forget_idle_every(min(cfg.registration_idle_s / 4, 60.0)), "idle-registrations")
            if cfg.lag_probe_interval > 0:
                ctx.spawn(upkeep.probe_loop_lag(ctx, cfg.lag_probe_interval), "lag-probe")
            if background:
                ctx.spawn(upkeep.keep_engine_threads_background(ctx), "engine-threads")
            if cfg.bootstrap:
                await self._leader.register_with(cfg.bootstrap)
        except BaseException:
            await self.aclose()
            raise
        ctx.started = True
        log.info("manager up: control=%s engine=%s", self.endpoint, self.describe().get("engine"))
        return self

    def _make_control_plane(self) -> ControlPlane:
        cfg, a, ctx = self.config, self.args, self._ctx
        if cfg.wire == "sglang-mooncake":
            from ._control.sglang import SglangControlPlane, SglangIdentity

            identity = SglangIdentity(
                host=cfg.hostname, tp_size=a.tp_size, tp_rank=a.tp_rank, pp_size=a.pp_size, pp_rank=a.pp_rank,
                cp_size=a.cp_size, cp_rank=a.cp_rank, dp_rank=a.dp_rank, dp_size=cfg.dp_size, page_size=a.page_size,
                kv_cache_dtype=cfg.sglang_kv_cache_dtype, is_mla=a.is_mla, kv_heads=a.kv_heads,
                total_kv_heads=a.total_kv_heads, aux_item_lens=tuple(b.item_len for b in a.aux),
                compat=ctx.compat, layout=a.layout, engine=ctx.engine_name, bootstrap_port=cfg.sglang_bootstrap_port,
            )
            plane = SglangControlPlane(identity, cfg.control_port, self._dispatch, max_sockets=cfg.max_sockets,
                                       max_message_bytes=cfg.max_message_bytes)
            return cast(ControlPlane, plane)  # duck-typed: the same interface as ControlPlane
        return ControlPlane(cfg.hostname, cfg.control_port, self._dispatch, max_sockets=cfg.max_sockets,
                            max_message_bytes=cfg.max_message_bytes, hmac_key=cfg.hmac_key, curve=cfg.control_curve,
                            incarnation=ctx.generation, on_stranger=self._prefill.on_stranger)

    async def __aenter__(self) -> KVManager:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, timeout: float = 5.0) -> None:
        """Fail open rooms, drain the poll loop, deregister memory, close sockets (in that order).

        Engine writes still in flight after ``timeout`` are waited for in the background, at most the release
        quarantine, before the rest (see :func:`aiotransfer._kv.shutdown.close_down`).

        Args:
            timeout: Seconds to wait for engine writes in flight before leaving them to the background.
        """
        ctx = self._ctx
        if ctx.closed:
            return
        ctx.closed = True
        self._handlers.clear()  # closing: every message that still comes is ignored
        for side in [*self._senders.values(), *self._receivers.values()]:
            side.update(KVPoll.Failed, "manager closed")
        await self._liveness.aclose()
        await ctx.cancel_tasks()

        await shutdown.close_down(ctx, self._regions, registered=self._registered, own_engine=self._own_engine,
                                  timeout=timeout)

    def describe(self) -> dict[str, Any]:
        """Static facts: engine, transport actually installed, session, endpoint, geometry, and what stages
        (``staging_backend``: ``numpy``, ``torch``, or None when staging is off)."""
        info: dict[str, Any] = {
            "endpoint": self.endpoint, "generation": self.generation, "protocol_version": PROTOCOL_VERSION,
            "kv_buffers": len(self.args.kv), "num_pages": self.args.num_pages, "layout": self.args.layout,
            "compat": self._ctx.compat, "engine_threads": self._engine_threads, "kv_device": self.args.kv_device,
            "staging_backend": self._ctx.staging_backend,
        }
        if self._ctx.engine_or_none is not None:
            info.update(self._ctx.engine_or_none.describe())
        return info

    def stats(self) -> ManagerStats:
        """Counters: rooms, bytes, dropped control messages by cause, engine handles in flight."""
        ctx = self._ctx
        open_pages = sum(t.num_pages or 0 for t in self._senders.values()) + sum(
            int(r.pages.size) for r in self._receivers.values() if r.pages is not None)
        c, p, arena = ctx.control_or_none, ctx.poller_or_none, ctx.arena
        return cast("ManagerStats", {
            "senders_active": len(self._senders),
            "receivers_active": len(self._receivers),
            "pending_requests": len(self._prefill.pending),
            "tombstones": len(self._prefill.tombstones),
            "decode_peers": len(self._prefill.decode_peers),
            "prefill_peers": len(self._client.peers),
            "in_flight": p.in_flight if p else 0,
            "pinned_bytes": p.pinned_bytes if p else 0,
            "engine_completed": p.completed if p else 0,
            "engine_failed": p.failed if p else 0,
            "engine_doomed": p.doomed if p else 0,
            "engine_overdue": p.overdue if p else 0,
            "engine_expired": p.expired if p else 0,
            "engine_held": p.held if p else 0,
            "control_received": c.received if c else 0,
            "control_sent": c.sent if c else 0,
            "control_dropped": dict(c.dropped) if c else {},
            "open_sockets": c.open_sockets if c else 0,
            "sockets_opened": c.sockets_opened if c else 0,
            "dead_peers": len(self._liveness.dead),
            "staging_bytes_in_use": arena.in_use if arena is not None else 0,
            "staging_requests_held": self._grantor.held,
            **self._life.stats(sum(b.item_len for b in self.args.kv), open_pages),
            **dict(ctx.counters),
            **ctx.metrics.snapshot(),
        })

    async def run_on_worker_threads(self, fn: Callable[[str], None], *, timeout: float = 10.0) -> None:
        """Diagnostics: run ``fn(where)`` once on each thread besides the event loop's that works for this
        manager's calls: the engine's driver (``where`` is ``"driver"``), then every offload thread
        (``"offload"``). For per-thread tools, such as a CPU profiler turned on before a call and off after
        it. ``fn`` must be quick and must not call into the manager.

        Args:
            fn: Called with where it runs.
            timeout: Bounds each thread's turn.

        Raises:
            ClosedError: The manager is not running.
            TransferTimeout: A thread did not take its turn within ``timeout``.
        """
        await self._ctx.on_worker_threads(fn, timeout)

    def __repr__(self) -> str:
        ctx = self._ctx
        state = "closed" if ctx.closed else ("up" if ctx.started else "new")
        return (f"<KVManager {state} endpoint={self.endpoint or '-'} senders={len(self._senders)} "
                f"receivers={len(self._receivers)}>")

    # -- factories ------------------------------------------------------------------------------
    @staticmethod
    def _check_room(room: int) -> int:
        if not isinstance(room, (int, np.integer)) or isinstance(room, bool) or not 0 <= int(room) < 2**63:
            raise InvalidArgument(f"room must be an integer in [0, 2**63), got {room!r}")
        return int(room)

    def _check_capacity(self, room: int, rooms: dict[int, Any], what: str) -> None:
        """A room number is unique on each side while it holds anything: refused while a room of that number is
        open, has ended without releasing its pages, or (prefill) failed here within its tombstone."""
        prefill = what == "sender"
        held = (f"a {what} for it is still active" if room in rooms else
                self._life.holding(room, prefill=prefill) or (self._prefill.reused(room) if prefill else None))
        if held is not None:
            self.counters["rooms_refused_in_use"] += 1
            raise InvalidArgument(f"duplicate room {room}: {held}")
        if len(rooms) >= self.config.max_rooms:
            raise InvalidArgument(f"too many active rooms ({self.config.max_rooms}); raise max_rooms")

    def sender(self, room: int) -> KVSender:
        """Create the prefill side of ``room`` (Bootstrapping until decode's metadata arrives); use it as
        ``async with mgr.sender(room) as tx:`` (see :class:`KVSender`).

        A room number names one request: :class:`InvalidArgument`, naming the state, while a sender of that
        number is open, has ended and still holds its pages, or failed here less than ``tombstone_ttl`` ago
        (``stats()['rooms_refused_in_use']``). So a retried request takes a new room number; after a success
        the number is free once the old sender's ``released()`` returned. A room its decode aborted before this
        call opens and fails at once with the decode's reason.

        Args:
            room: The request's number, shared with its decode side.

        Returns:
            The room's sender.

        Raises:
            InvalidArgument: The room number is in use, or ``max_rooms`` rooms are open.
            ClosedError: The manager is closed.
        """
        self._ctx.check_open()
        room = self._check_room(room)
        self._check_capacity(room, self._senders, "sender")
        tx = KVSender(self._ctx, room, self._pusher, self._notifier, self._on_terminal, self._on_released)
        self._senders[room] = tx
        self._prefill.opened(tx)
        return tx

    def receiver(self, room: int, peer: str, *, prefill_dp_rank: int | None = None) -> KVReceiver:
        """Create the decode side of ``room``, pulling from the prefill deployment at ``peer``. Use it as
        ``async with mgr.receiver(room, peer) as rx:`` (see [`KVReceiver`][aiotransfer.KVReceiver]).

        A room number names one request: :class:`InvalidArgument`, naming the state, while a receiver of that
        number is open, or has ended and awaits its drain acknowledgement, is quarantined or still copies into
        its pages (``stats()['rooms_refused_in_use']``). A retried request takes a new room number: after a
        failure the prefill refuses the old one for ``tombstone_ttl`` even once ``rx.released()`` returned.

        Args:
            room: The request's number, shared with its prefill side.
            peer: The prefill deployment's bootstrap leader, or its single rank (``host:port``, the
                prefill manager's [`endpoint`][aiotransfer.KVManager.endpoint]).
            prefill_dp_rank: The attention-DP group to pull from (default ``room % dp_size``).

        Returns:
            The room's receiver.

        Raises:
            InvalidArgument: The room number is in use, ``max_rooms`` rooms are open, or ``peer`` is not
                an address.
            ClosedError: The manager is closed.
        """
        self._ctx.check_open()
        room = self._check_room(room)
        try:
            endpoint = normalize_endpoint(peer)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        self._check_capacity(room, self._receivers, "receiver")
        rx = KVReceiver(self._ctx, room, endpoint, prefill_dp_rank, self._client, self._notifier, self._on_terminal,
                        self._on_released)
        self._receivers[room] = rx
        return rx

    def plan_transfer(self, decode_endpoint: str, src_pages: PageIndices, dst_pages: PageIndices, *,
                      staging: bool | None = None) -> TransferPlan:
        """The plan ``send_kv`` would make: direct engine entries or staged pieces. Nothing moves. For
        tools and the curious.

        Args:
            decode_endpoint: A registered decode rank's control endpoint.
            src_pages: Our pages.
            dst_pages: The decode's pages.
            staging: Force a path; None decides as ``send_kv`` does.

        Returns:
            The entries or pieces, with the path chosen.

        Raises:
            InvalidArgument: ``decode_endpoint`` is not a registered decode rank, or bad pages.
        """
        self._ctx.check_open()
        peer = self._prefill.decode_peers.get(decode_endpoint)
        if peer is None:
            raise InvalidArgument(f"{decode_endpoint!r} is not a registered decode rank")
        return self._pusher.plan_checked(peer, src_pages, dst_pages, staging=staging)

    def _on_terminal(self, side: RoomSide) -> None:
        """A room ended on this side: leave the registry, count it, log a failure once."""
        prefill = isinstance(side, KVSender)
        status = side.status
        rooms: dict[int, Any] = self._senders if prefill else self._receivers
        if rooms.get(side.room) is side:
            del rooms[side.room]
        if isinstance(side, KVSender):
            self._prefill.ended(side)
            self._life.ended(tx=side)
        elif isinstance(side, KVReceiver):
            self._life.ended(rx=side)
        role = "prefill" if prefill else "decode"
        if status is KVPoll.Failed:
            self.metrics.failure(side.failure_reason or "failed")
            log.info("room %d failed (%s side): %s", side.room, role, side.failure_reason,
                     extra={"room": side.room, "role": role})
        self.metrics.observe("room_tx" if prefill else "room_rx", time.monotonic() - side.created)
        self.counters[f"rooms_{'sent' if prefill else 'received'}_{status.name.lower()}"] += 1

    def _on_released(self, side: RoomSide, cause: str) -> None:
        if isinstance(side, KVSender):
            self._life.released(cause, tx=side)
        elif isinstance(side, KVReceiver):
            self._life.released(cause, rx=side)

    # -- liveness ------------------------------------------------------------------------------
    def _active_peers(self) -> set[str]:
        peers: set[str] = set()
        for tx in self._senders.values():
            peers.update(tx.decode_endpoints)
        for rx in self._receivers.values():
            peers.update(rx.prefill_endpoints)
        return peers

    async def _ping(self, endpoint: str, nonce: int | None = None) -> None:
        control = self._ctx.control_or_none
        if control is None:
            return
        nonce = secrets.randbits(32) if nonce is None else nonce
        msg = Ping(endpoint=self.endpoint, nonce=nonce, incarnation=self.generation)
        if not control.try_send(endpoint, msg):
            # it waits for its socket (or for room) in the background: the heartbeat pass goes on meanwhile
            self._ctx.spawn(self._ping_later(control, endpoint, msg), "ping")

    async def _ping_later(self, control: ControlPlane, endpoint: str, msg: Ping) -> None:
        with contextlib.suppress(AiotransferError):
            await control.send(endpoint, msg, timeout=self.config.heartbeat_interval)

    def _fail_rooms_with(self, endpoint: str, reason: str) -> list[int]:
        failed = [tx.room for tx in list(self._senders.values())
                  if endpoint in tx.decode_endpoints and tx.update(KVPoll.Failed, reason)]
        failed += [rx.room for rx in list(self._receivers.values())
                   if endpoint in rx.prefill_endpoints and rx.update(KVPoll.Failed, reason)]
        return failed

    def _on_send_failed(self, endpoint: str, what: str, exc: AiotransferError) -> None:
        """An answer to ``endpoint`` could not leave: the peer would hear nothing and conclude on its own, so
        every room held with it fails here with the reason, and the peer is told the same reason (if that
        notice can leave)."""
        reason = f"our {what} to {endpoint} could not leave: {exc}"
        sides: list[KVSender | KVReceiver] = [tx for tx in self._senders.values() if endpoint in tx.decode_endpoints]
        sides += [rx for rx in self._receivers.values() if endpoint in rx.prefill_endpoints]
        for side in sides:
            self._ctx.spawn(side.abort(reason), "send-failed")
        self.counters["rooms_failed_send"] += len(sides)

    def _on_peer_dead(self, endpoint: str, reason: str) -> None:
        self.counters["peers_declared_dead"] += 1
        rooms = self._fail_rooms_with(endpoint, reason)
        self.counters["rooms_failed_dead_peer"] += len(rooms)
        self._client.forget(endpoint)
        peer = self._prefill.decode_peers.get(endpoint)
        if peer is not None and self._ctx.engine_or_none is not None and not self._ctx.closed:
            self._ctx.driver.call(self._ctx.engine_or_none.forget_peer, peer.session_id).add_done_callback(_logged)
        self._events.publish(PeerEvent("dead", endpoint, tuple(rooms), reason))

    def _on_peer_restart(self, endpoint: str) -> None:
        """``endpoint`` answered with a new incarnation. Our rooms its old process served fail; a decode room
        whose request reached the new process is not one of them: that process refuses it (it does not know
        our registration) and the room registers again and resends it (:meth:`KVReceiver.ask_again`)."""
        self.counters["peer_restarts"] += 1
        reason = f"peer {endpoint} restarted; its earlier state is gone"
        rooms = [tx.room for tx in list(self._senders.values())
                 if endpoint in tx.decode_endpoints and tx.update(KVPoll.Failed, reason)]
        self._client.forget(endpoint)
        self._life.peer_gone(endpoint, "peer-restarted")  # its old process, and what it posted, is gone
        self._ctx.spawn(self._fail_after_round_trip(endpoint, reason, rooms), "peer-restarted")

    async def _fail_after_round_trip(self, endpoint: str, reason: str, rooms: list[int]) -> None:
        """One ping to the new process first: it answers each message in the order they came, so by its answer
        every request of ours it got has been refused and is being sent again. A decode room whose request is
        still bound to a registration other than the current one went to the old process: it fails."""
        nonce = secrets.randbits(32)
        with self._round_trips.expect(nonce) as fut:
            await self._ping(endpoint, nonce)
            await self._round_trips.wait(fut, self.config.peer_timeout)
        current = self._client.peers.get(endpoint)
        generation = current.ack.generation if current is not None else None
        for rx in list(self._receivers.values()):
            sent_with = rx.request_generation(endpoint)
            if sent_with is not None and sent_with != generation and rx.update(KVPoll.Failed, reason):
                rooms.append(rx.room)
                rx.on_drained(endpoint, "peer-restarted")  # only the old process, gone now, could write there
        self._events.publish(PeerEvent("restarted", endpoint, tuple(rooms), reason))

    def _on_pong(self, msg: Pong) -> None:
        self._liveness.incarnation(msg.endpoint, msg.incarnation)
        self._round_trips.resolve(msg.nonce, msg)

    # -- events ---------------------------------------------------------------------------------
    def add_peer_listener(self, callback: Callable[[PeerEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` on the loop for every :class:`PeerEvent` (a peer declared dead,
        restarted or proven gone, with the rooms it failed here).

        Args:
            callback: Called with each event, on the event loop; it must not block.

        Returns:
            The function that unsubscribes.
        """
        return self._events.add_listener(callback)

    def peer_events(self, maxsize: int = 256) -> AsyncIterator[PeerEvent]:
        """The same events as [`add_peer_listener`][aiotransfer.KVManager.add_peer_listener]'s, as an async
        iterator.

        Args:
            maxsize: Events kept for a slow reader; one that falls further behind loses the oldest.
        """
        return self._events.stream(maxsize)

    # -- inbound control messages -------------------------------------------------------------
    def _dispatch(self, msg: Message) -> None:
        # A sign of life counts only for a peer a room of ours depends on: liveness ignores other endpoints, so
        # junk naming new ones grows nothing. With a shared secret the endpoint is the signed sender's.
        sender: str = getattr(msg, "endpoint", "")
        known = bool(sender) and self._liveness.seen(sender)
        if isinstance(msg, Pong) and not known:  # we ping only the peers we track
            self._ctx.drop("unknown-peer", f"pong from {sender}")
            return
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _on_ping(self, msg: Ping) -> None:
        pong = Pong(endpoint=self.endpoint, nonce=msg.nonce, incarnation=self.generation)
        self._ctx.answer(msg.endpoint, pong, "pong")

    def _on_abort(self, msg: Abort) -> None:
        if not self._prefill.on_abort(msg) and not self._decode.on_abort(msg):
            self._ctx.drop("unknown-room", f"abort for room {msg.room}")
            # nothing of that room is in flight here; a request for it still on its way is refused
            self._prefill.drained_now(msg.room, msg.endpoint, decode_reason(msg.reason))


def _logged(fut: asyncio.Future[None]) -> None:
    """A background engine call's failure is logged, never raised."""
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("engine call failed: %r", fut.exception())
