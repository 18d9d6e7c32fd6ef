"""``KVReceiver``: the decode side of one request (room)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping

import msgspec
import numpy as np

from . import _trace
from ._control.messages import MAX_ROOM_PAGES
from ._deadline import DEFAULT, Deadline, Default, seconds
from ._kv.client import PrefillClient, Route
from ._kv.context import RankContext, annotate, validate_state_indices
from ._kv.ledger import Ledger
from ._kv.notify import Notifier
from ._kv.room import RoomSide, decode_reason
from ._plan import as_index_array, bounds, check_range, check_unique
from ._status import KVPoll
from ._types import PageIndices
from .errors import AiotransferError, InvalidArgument, PeerError, TransferFailed, TransferTimeout

log = logging.getLogger("aiotransfer.manager")

FROZEN_S = 0.5
"""A page-lifecycle timer (the quarantine, a drain's settle) that fires this much late or more means this process
did not run meanwhile: stopped (SIGSTOP), a paused VM, swapped out. Bytes a prefill's engine sent to it then may
still wait in its kernel, to be applied as soon as its engine's threads run again, so the release waits
``FROZEN_SETTLE_S`` (or the engine's landing grace, if longer) more."""
FROZEN_SETTLE_S = 1.0

__all__ = ["KVReceiver", "decode_reason"]


class KVReceiver(RoomSide):
    """Declares where one room's pages go, then waits for every required prefill rank to report.

    Created by :meth:`KVManager.receiver`. Status: Bootstrapping -> WaitingForInput (metadata sent) ->
    Success when every required prefill rank reported Success, or Failed (sticky, with a reason).

    A resource: ``async with mgr.receiver(room, peer) as rx:``. Leaving the block without Success (an
    exception, a cancellation, a block that ended first) aborts the room on both sides with the cause as its
    reason; every exit then waits for :meth:`released`, at most the release quarantine plus ``peer_timeout``,
    through cancellations. The exception propagates unchanged.
    """

    def __init__(
        self, ctx: RankContext, room: int, peer: str, prefill_dp_rank: int | None, client: PrefillClient,
        notifier: Notifier, on_terminal: Callable[[RoomSide], None] | None = None,
        on_released: Callable[[RoomSide, str], None] | None = None,
    ) -> None:
        super().__init__(room, on_terminal, on_released)
        self._asked: set[str] = set()
        """Prefill ranks a transfer request may have reached (they may write into our pages)."""
        self._undrained: set[str] = set()
        self._settling: set[str] = set()
        """Prefill ranks that acknowledged the drain after a failed write: drained once the settle passed."""
        self._quarantine: asyncio.TimerHandle | None = None
        self._ledger = Ledger(room, on_empty=self._copies_ended)
        """Our own worker-thread copies into (or reads of) the room's pages still running."""
        self._held_release: str | None = None
        """A release proven while local copies still ran: it takes effect once they are done."""
        self._aborting = False
        self._ctx = ctx
        self._client = client
        self._notifier = notifier
        self.peer = peer
        self.prefill_dp_rank = prefill_dp_rank
        self._route: Route | None = None
        self._pages: np.ndarray | None = None
        self._num_tokens = 0
        self._sent = False
        self._succeeded: set[str] = set()
        """Prefill endpoints (sources of the route) that reported Success."""
        self._routing = False
        """``send_metadata`` is resolving where to ask: a failure meanwhile waits for it to decide."""
        self._told: set[str] = set()
        """Prefill ranks the abort of this room went to."""
        self._asking_again: set[str] = set()
        """Prefill ranks that did not take our request (a restarted process): registering and resending."""
        self.aux_index: int | None = None
        self.state_indices: dict[str, list[int]] = {}
        self.aux_path: str | None = None
        """How the aux arrived (``engine`` / ``tcp``), as reported with Success."""

    def __repr__(self) -> str:
        return (
            f"<KVReceiver room={self.room} peer={self.peer} {self.poll().name} "
            f"responses={len(self._succeeded)}/{self._route.required if self._route else 0}>"
        )

    @property
    def pages(self) -> np.ndarray | None:
        """The page indices declared by :meth:`send_metadata` (None before)."""
        return self._pages

    @property
    def num_tokens(self) -> int:
        """The tokens declared by :meth:`send_metadata` (0 before)."""
        return self._num_tokens

    @property
    def sources(self) -> Mapping[str, int]:
        """Prefill endpoint -> prefill rank, for every rank this room expects data and a status from."""
        return self._route.sources if self._route is not None else {}

    @property
    def prefill_endpoints(self) -> list[str]:
        """Every prefill rank this room involves (dummy ranks included); empty before the metadata is routed."""
        return list(self._route.endpoints) if self._route is not None else []

    # -- public API -----------------------------------------------------------------------------
    async def send_metadata(
        self,
        kv_indices: PageIndices,
        aux_index: int | None = None,
        state_indices: Mapping[str, PageIndices] | None = None,
        *,
        num_tokens: int | None = None,
        timeout: float | Default = DEFAULT,
    ) -> None:
        """Tell the prefill rank(s) where to write: local page indices, aux slot and state slots.

        Validated here before anything is sent: indices in range and unique (at most ``MAX_ROOM_PAGES``,
        1 Mi, pages and as many state indices per kind), the pages exactly those ``num_tokens`` need, aux
        slot in range. The first call to a peer also registers this rank's buffers with it (bounded
        handshake).

        Args:
            kv_indices: Local page indices the KV lands in, in the order the prefill sends them.
            aux_index: The local aux slot for the first token and logprobs, or None.
            state_indices: ``{kind: local indices}`` for hybrid models' state (``mamba``, ``swa``, ``nsa``).
            num_tokens: The tokens the room holds, its last page possibly part full (default: every page
                full). Give it when the prefill's page size differs from ours: the prefill sends exactly
                the pages that hold these tokens.
            timeout: Bounds the whole call, the handshake included; ``DEFAULT`` means ``handshake_timeout``.
                A call that reaches out takes no ``None``.

        Raises:
            InvalidArgument: Bad indices or slots, or metadata already sent.
            TransferFailed: The room failed (``.reason`` says why).
            TransferTimeout: The prefill did not answer in time; the room fails.
        """
        ctx = self._ctx
        ctx.check_open()
        budget = seconds(timeout, ctx.config.handshake_timeout, what="send_metadata")
        if self._status is KVPoll.Failed:
            raise TransferFailed(self._reason or "failed", room=self.room)
        if self._sent:
            raise InvalidArgument(f"room {self.room}: metadata was already sent")
        pages = as_index_array(kv_indices, what="kv_indices")
        check_range(pages, ctx.num_pages, what="kv_indices")
        check_unique(pages, what="kv_indices")
        if pages.size and bounds(pages)[1] >= 2**31:
            raise InvalidArgument("kv_indices must fit in int32")
        if pages.size > MAX_ROOM_PAGES:
            raise InvalidArgument(f"a room names at most {MAX_ROOM_PAGES} pages, got {pages.size}")
        if num_tokens is not None:
            size = ctx.args.page_size
            if num_tokens < 0 or -(-num_tokens // size) != pages.size:
                raise InvalidArgument(
                    f"num_tokens {num_tokens} does not fill the {pages.size} pages given "
                    f"({size} tokens per page: {-(-max(num_tokens, 0) // size)} pages)"
                )
        if aux_index is not None:
            slots = min((b.num_items for b in ctx.args.aux), default=0)
            if not ctx.args.aux:
                raise InvalidArgument("aux_index given but this manager has no aux buffers")
            if not 0 <= aux_index < slots:
                raise InvalidArgument(f"aux_index {aux_index} out of range [0, {slots})")
        states = validate_state_indices(ctx.args, state_indices or {})
        if any(len(idx) > MAX_ROOM_PAGES for idx in states.values()):
            raise InvalidArgument(f"a room names at most {MAX_ROOM_PAGES} state indices of one kind")
        deadline = Deadline(budget)
        self._sent = True
        self._pages = pages
        self._num_tokens = pages.size * ctx.args.page_size if num_tokens is None else num_tokens
        self._routing = True  # a failure from here on leaves the decision to ask anyone to this call
        try:
            try:
                route = await self._client.route(self.room, self.peer, self.prefill_dp_rank, pages, aux_index,
                                                 states, deadline, -1 if num_tokens is None else num_tokens)
            finally:
                self._routing = False
            self._route = route
            if self._failed():  # aborted or timed out while routing: nobody is asked
                self._routed_after_failure()
                raise TransferFailed(self._reason or "failed", room=self.room)
            self._asked.update(route.sources)  # before sending: a request on its way may still land
            for ep, req in route.requests:
                if self._failed():  # the rest are not asked; those asked were told by the abort
                    raise TransferFailed(self._reason or "failed", room=self.room)
                _trace.recorder is None or _trace.mark(self.room, "request_send")
                await self._client.send_one(ep, req, deadline)
                _trace.recorder is None or _trace.mark(self.room, "request_sent")
        except BaseException as exc:
            self._sent = False
            if isinstance(exc, (TransferTimeout, PeerError)):
                annotate(exc, self.room, self.peer)
            if not isinstance(exc, InvalidArgument):
                self.update(KVPoll.Failed, decode_reason(f"metadata not delivered: {str(exc) or type(exc).__name__}"))
            if not self._asked and self._failed():
                self._release("nothing-sent")
            raise
        self.update(KVPoll.WaitingForInput)
        self.aux_index = aux_index
        self.state_indices = states

    async def done(self, timeout: float | Default | None = DEFAULT) -> None:
        """Wait until every required prefill rank reported Success.

        Args:
            timeout: Seconds to wait; ``DEFAULT`` means ``done_timeout``; ``None``: no bound of its own (the
                room still ends on a failure, an abort, or a prefill rank's death within about
                ``peer_timeout + heartbeat_interval``). A cancellation of this call aborts the room as the
                timeout does (``aborted by decode: done() cancelled``) and stays a cancellation.

        Raises:
            TransferFailed: The room failed (``.reason`` says why, as reported by the prefill).
            TransferTimeout: No terminal status in time; the room is then failed and the prefill told.
        """
        ctx = self._ctx
        ctx.check_open()
        deadline = Deadline(seconds(timeout, ctx.config.done_timeout))
        try:
            ended = await self._wait_until(lambda: self._status.is_terminal, deadline.at)
        except asyncio.CancelledError:
            self._abandon("done() cancelled")
            raise
        if not ended:
            await self.abort(f"decode gave up waiting after {deadline.budget:.3g}s")
            raise TransferTimeout(f"room {self.room}: no completion within {deadline.budget:.3g}s",
                                  room=self.room, peer=self.peer)
        if self._status is KVPoll.Failed:
            raise TransferFailed(self._reason or "failed", room=self.room)
        _trace.recorder is None or _trace.mark(self.room, "done")

    async def abort(self, reason: str = "aborted by decode") -> None:
        """Fail the room here and tell every prefill rank that may hold it, whether or not the metadata
        was delivered (each then stops posting writes for it and acknowledges the drain). Nothing when the
        room already ended.

        Args:
            reason: Recorded by both sides as ``aborted by decode: <reason>``.
        """
        if self._status.is_terminal:
            return
        reason = decode_reason(reason)
        self._aborting = True  # the notice goes out below, awaited, instead of from the status change
        self.update(KVPoll.Failed, reason)
        await self._notifier.abort(self.room, self._abort_targets(), reason)

    def _abandon(self, reason: str) -> None:
        """:meth:`abort` without awaiting: the room fails at once; the status change sends the notice in the
        background."""
        if not self._status.is_terminal:
            self.update(KVPoll.Failed, decode_reason(reason))

    def _failed(self) -> bool:
        return self._status is KVPoll.Failed

    def _routed_after_failure(self) -> None:
        """The room failed while its route was resolved: no rank was asked. The routed ranks the abort did not
        reach (it went out before the topology was known) are told now, so that none of them waits for our
        metadata, and the pages are released: nothing was sent."""
        missed = [ep for ep in self.prefill_endpoints if ep not in self._told]
        ctx = self._ctx
        if missed and ctx.started and not ctx.closed:
            ctx.spawn(self._notifier.abort(self.room, missed, self._reason or "failed"), "abort")
        self._release("nothing-sent")

    def _abort_targets(self) -> list[str]:
        """Every prefill rank that may hold the room: the routed ones, or else the ranks of the cached
        topology, or else the bootstrap address itself."""
        targets = self.prefill_endpoints if self._route is not None else (
            self._client.known_ranks(self.peer) or [self.peer])
        self._told.update(targets)
        return targets

    # -- a prefill process that did not take our request ----------------------------------------------
    def ask_again(self, endpoint: str, generation: int, forget: Callable[[str], None]) -> bool:
        """The prefill rank at ``endpoint`` refused our request, sent with registration ``generation``, because
        it does not hold that registration (it restarted on the same endpoint, or forgot us): it took nothing
        of the room. Register again and resend, bounded by ``handshake_timeout``; the room fails with the
        reason if that fails. ``forget`` drops a stale registration. False when no request of this room went
        there with that registration."""
        route, ctx = self._route, self._ctx
        if route is None or self._status.is_terminal or ctx.closed or not ctx.started:
            return False
        if not any(ep == endpoint and req.generation == generation for ep, req in route.requests):
            return False
        if endpoint not in self._asking_again:
            self._asking_again.add(endpoint)
            stale = self._client.peers.get(endpoint)
            if stale is not None and stale.ack.generation == generation:
                forget(endpoint)  # a registration made since (another room's resend) is kept
            ctx.spawn(self._send_again(endpoint), "ask-again")
        return True

    def request_generation(self, endpoint: str) -> int | None:
        """The registration generation our request to ``endpoint`` was sent with (None: not sent there, or
        being sent again)."""
        if self._route is None or not self._sent or endpoint in self._asking_again:
            return None
        return next((req.generation for ep, req in self._route.requests if ep == endpoint), None)

    async def _send_again(self, endpoint: str) -> None:
        ctx = self._ctx
        deadline = Deadline(ctx.config.handshake_timeout)
        try:
            peer = await self._client.register(endpoint, deadline)
            route = self._route
            if route is None or self._failed():
                return
            requests = [(ep, msgspec.structs.replace(req, generation=peer.ack.generation) if ep == endpoint else req)
                        for ep, req in route.requests]
            self._route = dataclasses.replace(route, requests=requests)
            for ep, req in requests:
                if ep == endpoint and not self._failed():
                    await self._client.send_one(ep, req, deadline)
                    ctx.counters["requests_sent_again"] += 1
        except AiotransferError as exc:
            self.update(KVPoll.Failed, f"prefill {endpoint} did not take our request (restarted?) and asking it again "
                                       f"failed: {exc}")
        finally:
            self._asking_again.discard(endpoint)

    # -- page lifecycle ---------------------------------------------------------------------------
    def _changed(self, status: KVPoll) -> None:
        if status is KVPoll.Success:
            self._release("success")  # every prefill write landed before its Success
        elif status is KVPoll.Failed:
            ctx = self._ctx
            if ctx.started and not ctx.closed and not self._aborting:
                # each prefill rank that may hold the room stops, and acknowledges its drain; one that only
                # waits for our metadata fails at once instead of waiting out wait_ready
                ctx.spawn(self._notifier.abort(self.room, self._abort_targets(), self._reason or "failed"),
                          "abort")
            if self._routing:
                return  # send_metadata decides, once its route is known, whether anyone was asked
            if not self._asked:
                self._release("nothing-sent")  # no prefill rank was asked to write here
                return
            self._undrained = set(self._asked)
            self._quarantine = self._after(ctx.config.quarantine_s, self._release, "quarantine")

    def _after(self, delay: float, then: Callable[..., None], *args: str) -> asyncio.TimerHandle:
        """``then(*args)`` in ``delay`` seconds, or, if this process did not run when it was due (the timer
        fires ``FROZEN_S`` late or more), a settle later: what was sent to it meanwhile lands first."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        return loop.call_at(due, self._on_time, due, then, args)

    def _on_time(self, due: float, then: Callable[..., None], args: tuple[str, ...]) -> None:
        late = asyncio.get_running_loop().time() - due
        if late < FROZEN_S:
            then(*args)
            return
        settle = max(FROZEN_SETTLE_S, self._ctx.engine.traits.landing_grace_s)
        self._ctx.counters["freezes_settled"] += 1
        log.warning("room %d: this process did not run for %.3gs (stopped, paused or stalled): its pages are released %.3gs "
                    "from now, once what its prefill ranks sent meanwhile has landed", self.room, late, settle)
        timer = asyncio.get_running_loop().call_later(settle, then, *args)
        if then == self._release:
            self._quarantine = timer

    def _release(self, cause: str) -> None:
        if self._quarantine is not None:
            self._quarantine.cancel()
        if self._ledger.held:  # no prefill write can land any more, but one of our own copies still writes here
            self._held_release = self._held_release or cause
            return
        super()._release(cause)
        if self.is_released() and not self._ledger.closed:
            self._ledger.close()  # no copy into the pages can start from here on

    def _copies_ended(self) -> None:
        if self._held_release is not None:
            cause, self._held_release = self._held_release, None
            self._release(cause)

    def hold(self) -> Callable[[], None]:
        """A local copy into this room's pages starts (a staged piece's scatter): the pages are not released
        before the returned callback runs, which the copy's owner calls once the copy can touch them no more."""
        return self._ledger.take()

    @property
    def local_holds(self) -> int:
        """Local copies into this room's pages still running; its pages are not released before they end."""
        return self._ledger.held

    def on_drained(self, endpoint: str, cause: str = "drained", settle: float = 0.0) -> bool:
        """A prefill rank acknowledged the drain of this room, or was proven gone (``cause``); False when
        it is not one this room waits for. ``settle``: a write of the room failed on an engine whose failed
        writes may still deliver what they had sent; the rank counts as drained that long from now."""
        if endpoint not in self._undrained:
            return False
        if endpoint in self._settling:
            # a settle once begun is not cut short, by a later acknowledgement or by the rank's end: a failed
            # write's bytes already on their way (in our engine's socket buffers) land whether or not the
            # process that sent them is still alive
            return True
        if settle > 0:
            if endpoint not in self._settling:
                self._settling.add(endpoint)
                self._after(settle, self._settled, endpoint, cause)
            return True
        self._undrained.discard(endpoint)
        if not self._undrained:
            self._release(cause)
        return True

    def _settled(self, endpoint: str, cause: str) -> None:
        if endpoint in self._settling:
            self._settling.discard(endpoint)
            self.on_drained(endpoint, cause)

    @property
    def settling(self) -> list[str]:
        """Prefill ranks that acknowledged the drain after a failed write: counted as drained once the settle
        they asked for has passed (a failed write's bytes may still be on their way)."""
        return sorted(self._settling)

    @property
    def awaiting_drain(self) -> list[str]:
        """Prefill ranks whose drain this failed room still waits for before its pages are released."""
        return sorted(self._undrained) if not self.is_released() else []

    async def released(self, timeout: float | Default | None = DEFAULT) -> None:
        """Wait until this room's pages are safe to reuse: no prefill write of it can land any more.

        After ``Success`` that is at once. After a failure or abort, once every prefill rank asked to
        write here has acknowledged its drain, or has been proven gone (its process replaced, or its
        control port refusing connections), or the quarantine (``release_quarantine_s``) elapsed.
        [`is_released`][aiotransfer.KVReceiver.is_released] is the non-blocking check.

        Args:
            timeout: Seconds to wait; ``DEFAULT`` means the quarantine plus ``peer_timeout``; ``None``: no
                bound of its own (the room must end first; the quarantine bounds what follows). Cancelling
                it changes nothing.

        Raises:
            TransferTimeout: The pages are not released in time.
        """
        cfg = self._ctx.config
        deadline = Deadline(seconds(timeout, cfg.quarantine_s + cfg.peer_timeout))
        if not await self._wait_released(deadline.at):
            raise self._unreleased(deadline.budget)

    def _unreleased(self, budget: float) -> TransferTimeout:
        return TransferTimeout(
            f"room {self.room}: pages not released within {budget:.3g}s "
            f"({self._status.name}; waiting for {self._waiting_for()})",
            room=self.room, peer=self.peer,
        )

    def _exit_bound(self) -> float | None:
        """The exit of ``async with`` waits for the release as :meth:`released` does by default: the quarantine
        plus ``peer_timeout``, past which a failed room's pages are released anyway."""
        cfg = self._ctx.config
        return None if self._ctx.closed else cfg.quarantine_s + cfg.peer_timeout

    def _waiting_for(self) -> str:
        if self._held_release is not None:
            return f"{self._ledger.held} local copies into the pages to end"
        return ", ".join(self.awaiting_drain) or "the room to end"

    # -- reports from prefill ranks (the manager's decode side calls this) --------------------------
    def on_prefill_status(self, endpoint: str, rank: int, status: KVPoll, reason: str, aux_path: str = "") -> bool:
        """Apply one prefill rank's report; returns False if that endpoint is not one of the room's sources."""
        if endpoint not in self.sources:
            return False
        if status is KVPoll.Failed:
            self.update(KVPoll.Failed, reason or "prefill reported failure")
        elif status is KVPoll.Success:
            if aux_path:
                self.aux_path = aux_path
            if rank != self.sources[endpoint]:
                return False  # a source speaks for its own rank only
            self._succeeded.add(endpoint)  # counted by who sent it: one source cannot stand in for another
            if self._route is not None and len(self._succeeded) >= self._route.required:
                self.update(KVPoll.Success)
        return True
