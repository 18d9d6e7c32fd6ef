"""The prefill side of a rank: decode registrations (handshake), transfer requests and decode aborts.

A decode rank registers once (``Hello``: its buffers and geometry, checked here and refused with the reason
when they cannot be paired with ours), then sends one ``TransferRequest`` per room. A request for a room
whose sender does not exist yet is stashed, bounded in time and count.

A registration ends when its decode registers again on its endpoint (the new one replaces it), or when no
room has used it for ``registration_idle_s``; and, when ``max_peers`` registrations are held and a new decode
registers, the least recently used one that no room, stashed request or pending registration holds is
forgotten to make room (a decode declared dead holds nothing once its rooms have failed, so it goes first). A decode whose registration was forgotten is told to register
again by its next request (the ``register_again`` answer), so forgetting loses nothing of its.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import msgspec
import numpy as np

from .. import _trace
from .._aux_state import StateType
from .._control.messages import (
    PROTOCOL_VERSION,
    Abort,
    Hello,
    HelloAck,
    Status,
    TransferRequest,
    unpack_indices,
)
from .._convert import check_convertible, page_geometry
from .._deadline import Deadline
from .._layout import KVPairing, RankGeometry, pair_buffers
from .._plan import check_range, check_unique
from .._status import KVPoll
from .._topology import head_slice
from ..errors import AiotransferError, EngineError, InvalidArgument, ProtocolError, TransferTimeout
from .context import RankContext
from .notify import Notifier
from .peers import DecodePeer, PendingRequests, Stashed
from .room import SenderRoom, decode_reason
from .tombstones import Tombstones

__all__ = ["PrefillSide"]

log = logging.getLogger("aiotransfer.manager")


class PrefillSide:
    """Registrations from decode ranks and their requests, handed to this rank's senders."""

    def __init__(
        self, ctx: RankContext, senders: Mapping[int, SenderRoom], draining: Mapping[int, SenderRoom],
        notifier: Notifier, fail_rooms_with: Callable[[str, str], list[int]],
    ) -> None:
        self._ctx = ctx
        self._senders = senders
        self._draining = draining
        self._notifier = notifier
        self._fail_rooms_with = fail_rooms_with
        self.decode_peers: dict[str, DecodePeer] = {}
        self.pending = PendingRequests(ctx.config.pending_request_ttl, ctx.config.max_rooms,
                                       per_room=ctx.config.max_pending_per_room, max_bytes=ctx.config.max_pending_bytes,
                                       per_peer=ctx.config.max_pending_per_peer)
        self.tombstones = Tombstones(ctx.config.tombstone_ttl, ctx.config.max_rooms)
        """Rooms that failed here, or whose request was refused before their sender existed: a late request
        for one is refused, and a sender opened for one fails, with the room's reason."""
        self._hellos: dict[str, asyncio.Task[None]] = {}
        """Registrations being checked (engine handshake), by decode endpoint."""
        self._after: dict[str, int] = {}
        """Requests waiting for their decode's registration to be checked, by decode endpoint (bounded by
        ``max_pending_per_peer``)."""
        self._used: OrderedDict[str, float] = OrderedDict()
        """Registered decode endpoints -> when a registration or request last used them (monotonic), least
        recent first."""
        self._none_idle_until = 0.0
        """A full table had nothing to forget: until then a registration of a new decode is dropped at once."""

    # -- registrations that end -------------------------------------------------------------------
    def _use(self, endpoint: str) -> None:
        self._used[endpoint] = time.monotonic()
        self._used.move_to_end(endpoint)

    def _held(self) -> set[str]:
        """Decode endpoints whose registration something still holds: a room open or draining, a stashed request,
        a request waiting for its registration to be checked."""
        held = {ep for tx in self._senders.values() for ep in tx.decode_endpoints}
        held.update(ep for tx in self._draining.values() for ep in tx.decode_endpoints)
        held.update(self._after)
        held.update(self.pending.peers())
        return held

    def forget(self, endpoint: str, why: str) -> None:
        """End ``endpoint``'s registration (counted as ``decode_peers_forgotten``); its engine connection goes
        too when nothing holds the registration any more (``why`` is logged)."""
        peer = self.decode_peers.pop(endpoint, None)
        self._used.pop(endpoint, None)
        if peer is None:
            return
        ctx = self._ctx
        ctx.counters["decode_peers_forgotten"] += 1
        log.info("forgetting decode %s's registration: %s", endpoint, why)
        if endpoint not in self._held() and ctx.engine_or_none is not None and not ctx.closed:
            ctx.driver.call(ctx.engine_or_none.forget_peer, peer.session_id).add_done_callback(_logged)

    def forget_idle(self) -> int:
        """Forget the registrations no room has used for ``registration_idle_s``; how many."""
        now, idle = time.monotonic(), self._ctx.config.registration_idle_s
        old = []
        for ep, since in self._used.items():
            if now - since <= idle:
                break
            old.append(ep)
        held = self._held() if old else set()
        old = [ep for ep in old if ep not in held]
        for ep in old:
            self.forget(ep, f"no room used it for {idle:g}s")
        return len(old)

    async def forget_idle_every(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            self.forget_idle()

    def _make_room(self) -> bool:
        """With ``max_peers`` registrations held: forget the least recently used one nothing holds; False when
        every one is held."""
        now = time.monotonic()
        if now < self._none_idle_until:
            return False
        self.forget_idle()
        if len(self.decode_peers) + len(self._hellos) < self._ctx.config.max_peers:
            return True
        held = self._held()
        for ep in self._used:
            if ep not in held and ep not in self._hellos:
                self.forget(ep, f"max_peers ({self._ctx.config.max_peers}) registrations held; least recently used")
                return True
        self._none_idle_until = now + 0.1
        return False

    # -- registration -----------------------------------------------------------------------------
    def on_hello(self, msg: Hello) -> None:
        if msg.endpoint in self._hellos:
            return
        ctx = self._ctx
        if (msg.endpoint not in self.decode_peers and len(self.decode_peers) + len(self._hellos) >= ctx.config.max_peers
                and not self._make_room()):
            ctx.drop("too-many-peers", msg.endpoint)  # every registration is held: the decode waits out its own
            return
        task = self._ctx.spawn(self._answer_hello(msg), f"hello-{msg.endpoint}")
        self._hellos[msg.endpoint] = task

        def _done(t: asyncio.Task[None], ep: str = msg.endpoint) -> None:
            if self._hellos.get(ep) is t:
                del self._hellos[ep]

        task.add_done_callback(_done)

    def refusal(self, hello: Hello) -> KVPairing | str:
        """Pair our buffers with a registering decode rank's, or say why not."""
        ctx, a = self._ctx, self._ctx.args
        if hello.engine != ctx.engine_name:
            return f"engine mismatch: peer uses {hello.engine!r}, we use {ctx.config.engine!r}"
        if hello.dtype and hello.dtype != a.dtype:
            return f"KV dtype mismatch: peer {hello.dtype!r}, ours {a.dtype!r} (moving it would corrupt the cache)"
        if hello.compat != ctx.compat:
            return f"KV geometry hash mismatch (dtype): peer {hello.compat}, ours {ctx.compat}"
        remote = RankGeometry(
            layout=hello.layout, page_size=hello.page_size, item_lens=[b.item_len for b in hello.kv],
            layer_ids=[b.layer_id for b in hello.kv], tp_size=hello.tp_size, tp_rank=hello.tp_rank,
            kv_heads=hello.kv_heads, total_kv_heads=hello.total_kv_heads, outer=hello.outer,
        )
        if (hello.tp_size != a.tp_size or hello.kv_heads != a.kv_heads) and not a.is_mla and not (
            a.total_kv_heads and hello.total_kv_heads
        ):
            return "TP sizes differ: both sides must set kv_heads and total_kv_heads for head slicing"
        sliced = hello.tp_size != a.tp_size or hello.kv_heads != a.kv_heads
        resized = hello.page_size != a.page_size
        token_major = a.head_order == hello.head_order == "NHD" and a.outer == hello.outer == 1
        if hello.layout != a.layout or hello.head_order != a.head_order or (resized and not token_major) or (
                "HND" in (hello.head_order, a.head_order) and sliced):
            pairing = self._stream_pairing(hello)
        else:
            pairing = pair_buffers(ctx.geometry, remote)
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

    def _stream_pairing(self, hello: Hello) -> KVPairing | str:
        """Pages laid out differently on the two sides (layout, head order; head-major pages of another size
        or another TP split): tokens move as a stream through both staging arenas, converted on the way."""
        ctx, a = self._ctx, self._ctx.args
        ours = a.page_geometry()
        how = f"converting {a.layout}/{a.head_order} pages to the peer's {hello.layout}/{hello.head_order}"
        if isinstance(ours, str):
            return f"{how} needs our geometry: {ours}"
        theirs = page_geometry(hello.layout, hello.head_order, hello.page_size, hello.kv_heads,
                               [b.item_len for b in hello.kv], hello.num_layers)
        if isinstance(theirs, str):
            return f"{how} needs the peer's geometry: {theirs}"
        if ctx.config.checksum:
            return f"{how}: checksums cover pages as laid out, so a converted peer cannot be checked (checksum off)"
        if ctx.arena is None or hello.staging is None:
            side = "ours" if ctx.arena is None else "the peer's"
            return f"{how} needs a staging arena on both sides ({side} is off)"
        if a.kv_device != "cpu" or hello.kv_device != "cpu":
            device = a.kv_device if a.kv_device != "cpu" else hello.kv_device
            return f"{how} runs on host memory only (KV on {device})"
        heads = None
        if hello.tp_size != a.tp_size or hello.kv_heads != a.kv_heads:
            if not (a.total_kv_heads and hello.total_kv_heads) or a.total_kv_heads != hello.total_kv_heads:
                return f"{how} across TP sizes needs the same total_kv_heads on both sides"
            heads = head_slice(a.tp_rank, a.tp_size, hello.tp_rank, hello.tp_size, a.total_kv_heads)
            if heads is None:
                return f"TP rank {a.tp_rank}/{a.tp_size} holds none of the heads of {hello.tp_rank}/{hello.tp_size}"
        reason = check_convertible(ours, theirs)
        if reason is not None:
            return f"{how}: {reason}"
        empty = np.empty(0, dtype=np.int64)
        return KVPairing(empty, empty, heads, 0, ours.head_bytes, ours.page_size, theirs.page_size, stream=True)

    async def _answer_hello(self, hello: Hello) -> None:
        ctx = self._ctx
        verdict = self.refusal(hello)
        reason = verdict if isinstance(verdict, str) else None
        if reason is None:
            try:
                # first the bounded check that takes no engine lock (an executor thread), then the handshake
                # on the driver: a peer that does not answer never holds up the engine's other calls
                deadline = Deadline(ctx.config.handshake_timeout)
                # the engine's own bound a little inside ours, so that its reason is the one reported
                await ctx.offload.run(ctx.engine.reach, hello.session_id, 0.9 * deadline.budget,
                                      timeout=deadline.budget, what=f"first contact with {hello.session_id}")
                await ctx.driver.run(
                    ctx.engine.connect, hello.session_id, hello.engine_info, hello.probe_addr,
                    timeout=deadline.remaining(), what=f"engine handshake with {hello.session_id}",
                )
            except (EngineError, TransferTimeout) as exc:
                reason = f"our engine cannot reach yours ({hello.session_id}): {exc}"
        if reason is None:
            assert isinstance(verdict, KVPairing)
            if hello.incarnation:
                # a decode that restarted shows it here, before it can open a room with us: rooms of its old
                # process fail now, not when a later heartbeat would also fail the ones it opens next
                ctx.liveness.incarnation(hello.endpoint, hello.incarnation)
            old = self.decode_peers.get(hello.endpoint)
            if old is not None and old.hello.generation != hello.generation:
                ctx.counters["decode_peer_reregistered"] += 1
                self._fail_rooms_with(hello.endpoint, f"decode {hello.endpoint} registered again (restarted?)")
            self.decode_peers[hello.endpoint] = DecodePeer.from_hello(hello, verdict)
            self._use(hello.endpoint)
        else:
            ctx.counters["peers_refused"] += 1
            log.warning("refusing decode peer %s: %s", hello.endpoint, reason)
        ack = HelloAck(
            version=PROTOCOL_VERSION, endpoint=ctx.endpoint, generation=hello.generation, accepted=reason is None,
            reason=reason or "", engine=ctx.config.engine, session_id=ctx.engine.session_id, rank=ctx.rank_id,
            incarnation=ctx.generation,
        )
        try:
            await ctx.control.send(hello.endpoint, ack, timeout=ctx.config.handshake_timeout)
        except AiotransferError as exc:
            await self._ack_lost(hello, ack, exc)

    async def _ack_lost(self, hello: Hello, ack: HelloAck, exc: AiotransferError) -> None:
        """A registration's answer could not leave: the registration is not kept (the decode never learned of
        it), the failure is counted and fails what is held with that decode, and a refusal saying why is tried
        once more, so that the decode fails its room with the same reason rather than a timeout."""
        ctx = self._ctx
        peer = self.decode_peers.get(hello.endpoint)
        if peer is not None and peer.hello is hello:
            del self.decode_peers[hello.endpoint]
            self._used.pop(hello.endpoint, None)
        ctx.send_failed(hello.endpoint, "HelloAck", exc)
        if not ack.accepted:
            return
        reason = f"the prefill's answer to this registration could not leave: {exc}"
        refusal = msgspec.structs.replace(ack, accepted=False, reason=reason)
        with contextlib.suppress(AiotransferError):
            await ctx.control.send(hello.endpoint, refusal, timeout=ctx.config.handshake_timeout)

    # -- requests ---------------------------------------------------------------------------------
    def on_request(self, req: TransferRequest) -> None:
        _trace.recorder is None or _trace.mark(req.room, "request_in")
        ctx = self._ctx
        peer = self.decode_peers.get(req.endpoint)
        pending_hello = self._hellos.get(req.endpoint)
        if peer is None and pending_hello is not None:
            # Its registration is still being checked (engine handshake): handle the request right after.
            waiting = self._after.get(req.endpoint, 0)
            if waiting >= ctx.config.max_pending_per_peer:
                ctx.counters["pending_refused"] += 1
                self._refuse(req, f"too many requests from decode {req.endpoint} waiting for its registration "
                                  f"({ctx.config.max_pending_per_peer})")
                return
            self._after[req.endpoint] = waiting + 1
            ctx.spawn(self._after_hello(pending_hello, req), "request-after-hello")
            return
        if peer is None or req.generation != peer.hello.generation:
            # a decode registration this process does not hold (it restarted on this endpoint, or the decode
            # registered again since): nothing of the request is taken, the decode registers and resends
            self.on_stranger(req)
            return
        self._use(req.endpoint)
        try:
            idx = unpack_indices(req.kv_indices)
            if not req.is_dummy:
                check_range(idx, peer.num_pages, what="destination kv indices")
                check_unique(idx, what="destination kv indices")
            self._check_extras(peer, req)
        except (InvalidArgument, ProtocolError) as exc:
            ctx.drop("invalid-request", str(exc))
            reason = f"invalid transfer request: {exc}"
            tx = self._senders.get(req.room)
            if tx is not None and self._may_speak_for(tx, req.endpoint):
                ctx.spawn(tx.abort(reason), "fail")
            if tx is None or req.endpoint not in tx.decode_endpoints:
                self._refuse(req, reason)
            return
        tx = self._senders.get(req.room)
        if tx is None:
            ended = self.tombstones.reason(req.room)
            if ended is not None:  # a late request for a room that failed here: never served
                ctx.counters["late_requests_refused"] += 1
                ctx.drop("room-ended", f"request for room {req.room} from {req.endpoint}: {ended}")
                self._refuse(req, ended)
                return
            for room, items, why, counter in self.pending.add(req.room, Stashed(peer, req, idx)):
                ctx.counters[counter] += 1
                # nothing is dropped silently: the decode ranks learn why their request went nowhere
                if items:
                    ctx.spawn(self._notifier.failure(room, [s.peer.endpoint for s in items], why), "expire")
            return
        self.accept(tx, peer, req, idx)

    def on_stranger(self, req: TransferRequest) -> None:
        """A transfer request this process cannot take: it names a registration we do not hold, or (signed)
        an earlier incarnation of ours. The room is not touched here (no failure, no tombstone): the decode
        is told to register again and resend it with the registration it then gets. The answer leaves before
        any later message to that decode (a ``Pong``, a ``HelloAck``), so a decode that learns of our restart
        from those has already heard which of its requests this process never took."""
        ctx = self._ctx
        ctx.counters["requests_register_again"] += 1
        reason = f"transfer request from an unregistered decode rank ({req.endpoint}); register again"
        msg = Status(room=req.room, status=int(KVPoll.Failed), rank=ctx.rank_id, endpoint=ctx.endpoint, reason=reason,
                     register_again=True, generation=req.generation)
        ctx.answer(req.endpoint, msg, "register-again")

    @staticmethod
    def _may_speak_for(tx: SenderRoom, endpoint: str) -> bool:
        """Whether a request from ``endpoint`` may fail ``tx``: one of its decode ranks, or any decode rank
        while none has spoken for the room yet (it waits for a request and this one cannot be served)."""
        return not tx.decode_endpoints or endpoint in tx.decode_endpoints

    def _refuse(self, req: TransferRequest, reason: str) -> None:
        self._ctx.spawn(self._notifier.failure(req.room, [req.endpoint], reason), "refuse")

    def _check_extras(self, peer: DecodePeer, req: TransferRequest) -> None:
        """Aux/state declarations against what the decode registered and what we can send."""
        args = self._ctx.args
        if req.aux_index >= 0:
            if not args.aux:
                raise InvalidArgument("decode declared an aux slot but this prefill has no aux buffers")
            if not peer.hello.aux:
                raise InvalidArgument("decode declared an aux slot but registered no aux buffers")
            if req.aux_index >= peer.aux_slots:
                raise InvalidArgument(f"aux index {req.aux_index} out of range of the decode's {peer.aux_slots} slots")
        for kind, idx in req.state_indices.items():
            if kind not in args.state:
                raise InvalidArgument(f"decode declared {kind} state but this prefill has no {kind} state buffers")
            remote = peer.state.get(kind)
            if remote is None:
                raise InvalidArgument(f"decode declared {kind} state but registered no {kind} state buffers")
            if idx and max(idx) >= remote[1]:
                raise InvalidArgument(f"{kind} state index {max(idx)} out of range of the decode's {remote[1]} slots")
            if StateType.slot_based(kind) and len(idx) != 1:
                raise InvalidArgument(f"{kind} state takes exactly one slot per request, got {len(idx)}")

    async def _after_hello(self, hello_task: asyncio.Task[None], req: TransferRequest) -> None:
        try:
            with contextlib.suppress(Exception):
                await asyncio.shield(hello_task)
        finally:
            left = self._after.pop(req.endpoint, 1) - 1
            if left:
                self._after[req.endpoint] = left
        self.on_request(req)

    def accept(self, tx: SenderRoom, peer: DecodePeer, req: TransferRequest, idx: np.ndarray) -> None:
        self._ctx.liveness.activate(req.endpoint)
        reason = tx.admit(peer, req, idx)
        if reason is not None:
            self._ctx.drop("refused-request", reason)
            self._refuse(req, reason)

    def reused(self, room: int) -> str | None:
        """Why a new sender may not take the number ``room``: a sender of it failed here and its tombstone
        lasts; None otherwise. A room whose decode aborted it before a sender of it opened here is not a reuse
        (the same request): its sender opens and fails at once with the decode's reason (:meth:`opened`)."""
        tomb = self.tombstones.get(room)
        if tomb is None or not tomb.opened:
            return None
        return (f"it failed here {time.monotonic() - tomb.since:.0f}s ago ({tomb.reason}) and is remembered for "
                f"tombstone_ttl ({self.tombstones.ttl:g}s); a room number is unique until its tombstone expires: "
                "give a retried request a new room number")

    def opened(self, tx: SenderRoom) -> None:
        """A sender was just created: hand it the requests that came before it (or the refusal of one: its
        decode aborted the room before it opened)."""
        refused = self.tombstones.reason(tx.room)
        if refused is not None:
            tx.update(KVPoll.Failed, refused)
            return
        for item in self.pending.pop(tx.room) or ():
            self.accept(tx, item.peer, item.request, item.kv_indices)

    # -- aborts from decode -----------------------------------------------------------------------
    def on_abort(self, msg: Abort) -> bool:
        """A decode rank gave up on a room (and asks for a drain acknowledgement); False when the abort is
        not for a room of ours. A room that has not heard from any decode rank yet takes the abort from any
        decode rank: the abort may come before its request could (a cancelled first contact)."""
        # a decode words every abort "aborted by decode: <why>"; a checksum mismatch is counted whether or not
        # the room is still open here (it usually is not: the mismatch is found after our Success)
        mismatch = msg.reason.removeprefix("aborted by decode: ").startswith("checksum mismatch")
        if mismatch:
            self._ctx.counters["checksum_mismatches_reported"] += 1
            log.error("decode %s reports for room %d: %s", msg.endpoint, msg.room, msg.reason)
        tx = self._senders.get(msg.room)
        if tx is not None and (msg.endpoint in tx.decode_endpoints or not tx.decode_endpoints):
            reason = decode_reason(msg.reason)
            others = [ep for ep in tx.decode_endpoints if ep != msg.endpoint]
            if others and not tx.status.is_terminal:
                # the room's other decode ranks learn why at once (told first: the drain acknowledgement the
                # update may send them right away must not overtake it)
                self._tell_failed(msg.room, others, reason)
            # stops posting at once; the drain acknowledgement follows when its last handle is terminal
            tx.update(KVPoll.Failed, reason)
            return True
        ended = self._draining.get(msg.room)
        if ended is not None:
            if ended.status is KVPoll.Success and msg.endpoint in ended.decode_endpoints:
                # Success left only once every write of the room had landed: nothing of it can write into the
                # decode's pages any more, though the call that sent it has not returned yet (the abort
                # crossed the Success on the wire). Waiting for that call's release would send nothing: a
                # room released with Success tells nobody it drained.
                self.drained_now(msg.room, msg.endpoint)
            return True  # a failed room: the acknowledgement follows when it has drained
        stashed = self.pending.pop(msg.room)
        if stashed is not None or mismatch:
            reason = decode_reason(msg.reason)
            self.drained_now(msg.room, msg.endpoint, reason)  # nothing was posted for it
            others = [s.peer.endpoint for s in stashed or () if s.peer.endpoint != msg.endpoint]
            if others:  # the other decode ranks' requests went with the room: they learn why, and that it drained
                self._tell_failed(msg.room, others, reason, drained=True)
            return True
        return False

    def _tell_failed(self, room: int, endpoints: list[str], reason: str, *, drained: bool = False) -> None:
        """Tell decode ranks that ``room`` failed here with ``reason`` and, with ``drained``, that nothing of it
        can write into their pages (in that order, on their ordered channels)."""
        notifier = self._notifier

        async def tell() -> None:
            await notifier.failure(room, endpoints, reason)
            if drained:
                await notifier.drained(room, endpoints)

        self._ctx.spawn(tell(), "abort-others")

    def drained_now(self, room: int, endpoint: str, reason: str | None = None) -> None:
        """Nothing of ``room`` can write into ``endpoint``'s pages from here: say so. With ``reason`` (the
        decode aborted a room this rank holds nothing of) the room is remembered as failed, so that a request
        for it still on its way is refused."""
        if reason is not None and self._senders.get(room) is None:
            self.tombstones.bury(room, reason)
        self._ctx.spawn(self._notifier.drained(room, [endpoint]), "drained")

    def ended(self, tx: SenderRoom) -> None:
        """A sender of ours became terminal: a failed room is remembered (see :attr:`tombstones`)."""
        if tx.status is KVPoll.Failed:
            self.tombstones.bury(tx.room, tx.failure_reason or "failed", opened=True)



def _logged(fut: asyncio.Future[None]) -> None:
    """A background engine call's failure is logged, never raised."""
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("engine call failed: %r", fut.exception())
