"""``KVSender``: the prefill side of one request (room)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import _trace
from ._control.messages import TransferRequest
from ._deadline import DEFAULT, Deadline, Default, seconds, within
from ._device import check_ready, wait_device_work
from ._kv.context import RankContext, annotate, check_aux_index, state_mismatch, validate_state_indices
from ._kv.dsts import Dst, room_size
from ._kv.ledger import Ledger
from ._kv.notify import Notifier
from ._kv.peers import DecodePeer
from ._kv.push import Pusher, RoomWrites
from ._kv.room import RoomSide, prefill_reason
from ._plan import as_index_array, check_range
from ._status import KVPoll
from ._stream import KVStream
from ._types import DeviceWork, PageIndices
from .errors import InvalidArgument, PeerError, TransferFailed, TransferTimeout

__all__ = ["KVSender"]


class KVSender(RoomSide):
    """Sends one room's KV pages (and aux/state) to the decode rank(s) that asked for it.

    Created by :meth:`KVManager.sender`. Status: Bootstrapping -> WaitingForInput (all decode ranks
    sent their page indices) -> Transferring -> Success, or Failed (sticky, with a reason that the decode
    side receives too).

    A resource: ``async with mgr.sender(room) as tx:``. Leaving the block without Success (an exception,
    a cancellation, a block that ended first) aborts the room on both sides with the cause as its reason;
    every exit then waits for :meth:`released`, at most the release quarantine plus ``peer_timeout``, through
    cancellations. The exception propagates unchanged.
    """

    def __init__(
        self, ctx: RankContext, room: int, pusher: Pusher, notifier: Notifier,
        on_terminal: Callable[[RoomSide], None] | None = None,
        on_released: Callable[[RoomSide, str], None] | None = None,
    ) -> None:
        super().__init__(room, on_terminal, on_released)
        self._ledger = Ledger(room, on_empty=self._maybe_released, refusal=self._write_refusal)
        """Every write path (from its first await to its end), engine handle and worker-thread copy that may
        still touch this room's pages holds it; every engine submission asks it first."""
        self._writes = RoomWrites(room, self._ledger)
        """What push keeps for this room while it sends (it goes with the room)."""
        self._ctx = ctx
        self._pusher = pusher
        self._notifier = notifier
        self._dsts: dict[str, Dst] = {}
        self._required: int | None = None
        self._num_dst_pages: int | None = None
        self._cursor = 0
        self._last_reserved = False
        self._chunks_in_flight = 0
        self._chunk_finished = asyncio.Event()
        self._guarded: set[asyncio.Task[Any]] = set()
        self._interrupted: set[asyncio.Task[Any]] = set()
        self._kv_done = False
        self._aux_sent = False
        self._state_sent = False
        self._concluding = False
        self.aux_path: str | None = None
        """Path the aux took (``engine`` / ``tcp``), once sent."""
        self.bytes_sent = 0

    def __repr__(self) -> str:
        return (
            f"<KVSender room={self.room} {self.poll().name} dsts={len(self._dsts)}/{self._required or '?'} "
            f"pages={self._cursor}/{self._num_dst_pages if self._num_dst_pages is not None else '?'}>"
        )

    # -- status ---------------------------------------------------------------------------------
    def _changed(self, status: KVPoll) -> None:
        if status is KVPoll.Failed:
            # Interrupt sends in progress (peer declared dead, abort...): they return at once; the engine
            # transfers they started keep their buffers pinned until the engine reports them done.
            try:
                current = asyncio.current_task()
            except RuntimeError:  # no loop runs: the room failed as it was opened, from synchronous code
                current = None
            for task in list(self._guarded):
                if task is not current and task not in self._interrupted:
                    self._interrupted.add(task)
                    task.cancel()
        if status.is_terminal:
            self._writes.clear()
            self._maybe_released()

    def _maybe_released(self) -> None:
        """Released once terminal and nothing holds the ledger; a failed room then tells its decode ranks
        that it has drained (nothing of it can write into their pages any more)."""
        if not self._status.is_terminal or self._ledger.held or self.is_released():
            return
        self._ledger.close()  # nothing can take a hold on the pages from here on
        if self._status is KVPoll.Failed:
            self._release("drained")
            if self._dsts and self._ctx.started and not self._ctx.closed:
                settle = self._ctx.engine.traits.landing_grace_s if self._ledger.failed_writes else 0.0
                self._ctx.spawn(self._notifier.drained(self.room, list(self._dsts), settle), "drained")
        else:
            self._release("success")

    def _write_refusal(self) -> str | None:
        """Why this room may post no new engine write (asked right before every submission), or None."""
        if self._status is KVPoll.Failed:
            return self._reason or "failed"
        if self._status is KVPoll.Success:
            return f"room {self.room} already concluded"
        return None

    @property
    def engine_holds(self) -> int:
        """Engine operations and worker-thread copies of this room still pending (they pin its pages)."""
        return self._ledger.held

    async def released(self, timeout: float | Default | None = DEFAULT) -> None:
        """Wait until this room's source pages (and its staging space) are safe to reuse: the room is
        terminal and every engine handle that read them, and every copy of them on a worker thread, is
        over. After ``Success`` that is at once; after a failure, abort or cancellation, once the engine
        reports the room's last handle terminal. [`is_released`][aiotransfer.KVSender.is_released] is the
        non-blocking check.

        Args:
            timeout: Seconds to wait; ``DEFAULT`` means ``done_timeout``; ``None``: no bound of its own (the
                room must end first; the quarantine bounds what follows). Cancelling it changes nothing.

        Raises:
            TransferTimeout: The pages are not released in time; they then stay out of reach.
        """
        deadline = Deadline(seconds(timeout, self._ctx.config.done_timeout))
        if not await self._wait_released(deadline.at):
            raise self._unreleased(deadline.budget)

    def _unreleased(self, budget: float) -> TransferTimeout:
        return TransferTimeout(
            f"room {self.room}: pages not released within {budget:.3g}s "
            f"({self._status.name}, {self._ledger.held} engine operations pending)",
            room=self.room, peer=self._peer_hint(),
        )

    def _exit_bound(self) -> float | None:
        """The exit of ``async with`` waits for the release at most the release quarantine plus
        ``peer_timeout``: past the quarantine the engine's handles that never ended are abandoned."""
        cfg = self._ctx.config
        return None if self._ctx.closed else cfg.quarantine_s + cfg.peer_timeout

    async def _run_or_fail(self, aw: Any) -> Any:
        """Await ``aw``; it is interrupted if the room fails meanwhile. Any error fails the room on both
        sides, then propagates (an interruption as :class:`TransferFailed` with the room's reason)."""
        task = asyncio.current_task()
        assert task is not None
        self._guarded.add(task)
        try:
            try:
                return await aw
            finally:
                self._guarded.discard(task)
        except asyncio.CancelledError as exc:
            if task in self._interrupted:
                self._interrupted.discard(task)
                uncancel = getattr(task, "uncancel", None)
                if uncancel is not None:
                    uncancel()
                raise TransferFailed(self._reason or "failed", room=self.room) from None
            await self._fail_from(exc)
            raise
        except TransferFailed as exc:
            await asyncio.shield(self._fail(exc.reason))
            raise
        except (TransferTimeout, PeerError) as exc:
            annotate(exc, self.room, self._peer_hint())
            await self._fail_from(exc)
            raise
        except BaseException as exc:
            await self._fail_from(exc)
            raise

    def _peer_hint(self) -> str | None:
        return next(iter(self._dsts), None)

    async def _wait_for_status(self, predicate: Any, deadline: Deadline, what: str) -> None:
        if not await self._wait_until(predicate, deadline.at):
            raise TransferTimeout(f"room {self.room}: {what} not reached within {deadline.budget:.3g}s",
                                  room=self.room, peer=self._peer_hint())

    def _raise_if_failed(self) -> None:
        if self._status is KVPoll.Failed:
            raise TransferFailed(self._reason or "failed", room=self.room)

    # -- requests from decode (the manager's prefill side calls this) --------------------------------
    def admit(self, peer: DecodePeer, req: TransferRequest, kv_indices: np.ndarray) -> str | None:
        """Record one decode rank's transfer request (checked by the prefill side); returns a refusal
        reason or None. Once every required decode rank has spoken, the room is WaitingForInput."""
        if self._status is KVPoll.Failed or self._status is KVPoll.Success:
            return f"room {self.room} is already {self._status.name}"
        if self._required is None:
            self._required = req.required_dst_info_num
        elif req.required_dst_info_num != self._required:
            return (
                f"decode ranks disagree on required_dst_info_num ({req.required_dst_info_num} vs {self._required})"
            )
        if peer.endpoint in self._dsts:
            return f"duplicate transfer request for room {self.room} from {peer.endpoint}"
        if len(self._dsts) >= self._required:  # another decode naming the room gets no copy of it
            return (f"room {self.room} already has the {self._required} decode rank(s) it was asked for; "
                    f"a further request from {peer.endpoint} is refused")
        units = 0
        if not req.is_dummy:
            size = room_size(self._ctx.args.page_size, peer, req, kv_indices)
            if isinstance(size, str):
                return size
            pages, units = size
            if self._num_dst_pages is None:
                self._num_dst_pages = pages
            elif pages != self._num_dst_pages:
                return f"decode ranks disagree on the room's size ({pages} vs {self._num_dst_pages} of our pages)"
        self._dsts[peer.endpoint] = Dst(peer, req, kv_indices, units)
        if len(self._dsts) >= self._required:
            if self._num_dst_pages is None:
                self._num_dst_pages = 0
            self.update(KVPoll.WaitingForInput)
        return None

    @property
    def decode_endpoints(self) -> list[str]:
        """Control endpoints of the decode ranks that asked for this room so far."""
        return list(self._dsts)

    @property
    def num_pages(self) -> int | None:
        """Pages of ours the room needs (None until ready): the pages the decode declared, or, when the page
        sizes differ, ours that hold the tokens it declared."""
        return self._num_dst_pages

    @property
    def pages_remaining(self) -> int | None:
        """Pages of ours not yet covered by a chunk (None until ready)."""
        return None if self._num_dst_pages is None else self._num_dst_pages - self._cursor

    @property
    def is_dummy(self) -> bool:
        """Every decode rank that spoke for this room marked this rank a dummy."""
        return bool(self._dsts) and all(d.is_dummy for d in self._dsts.values())

    def _real_dsts(self) -> list[Dst]:
        return [d for d in self._dsts.values() if not d.is_dummy]

    @property
    def needs_aux(self) -> bool:
        """Decode declared an aux slot: Success waits for :meth:`send_aux`."""
        return any(d.request.aux_index >= 0 for d in self._real_dsts())

    @property
    def declared_state(self) -> dict[str, int]:
        """State kinds decode declared, with the number of indices for each."""
        out: dict[str, int] = {}
        for d in self._real_dsts():
            for kind, idx in d.request.state_indices.items():
                out[kind] = len(idx)
        return out

    # -- public API -----------------------------------------------------------------------------
    async def wait_ready(self, timeout: float | Default | None = DEFAULT) -> None:
        """Wait until every required decode rank has sent its page indices (WaitingForInput).

        Args:
            timeout: Seconds to wait; ``DEFAULT`` means ``ready_timeout``; ``None``: until the decode speaks,
                aborts or the manager closes. On expiry the room fails on both sides; a cancellation of this
                call (``asyncio.wait_for``, a cancel scope, ``task.cancel()``) aborts the room
                the same way, with ``wait_ready() cancelled`` as the reason, and stays a cancellation.

        Raises:
            TransferTimeout: The decode did not speak in time; the room fails.
            TransferFailed: The room failed meanwhile (``.reason`` says why).
        """
        self._ctx.check_open()
        t = seconds(timeout, self._ctx.config.ready_timeout)
        try:
            await self._wait_for_status(
                lambda: self._status is not KVPoll.Bootstrapping, Deadline(t), "WaitingForInput (decode metadata)"
            )
        except TransferTimeout as exc:
            await self._fail(f"decode metadata did not arrive within {t:.3g}s")
            raise exc
        except asyncio.CancelledError:
            self._abandon("wait_ready() cancelled")
            raise
        self._raise_if_failed()

    async def send_kv(self, indices: PageIndices, last: bool = True, *, ready: DeviceWork | None = None,
                      timeout: float | Default = DEFAULT) -> None:
        """Send the pages ``indices`` (local page indices) as the next chunk.

        Chunks fill consecutive slices of the decode's page list. The last chunk concludes the room:
        Success once the aux and state the decode declared have been delivered too.

        Args:
            indices: Local page indices. A 1-D integer array (NumPy, or anything ``np.asarray`` reads
                without a copy, such as a CPU torch tensor) is used as it is; a Python list is converted
                first, which costs about 50 ns a page on the event loop (0.8 ms for 16,384 pages): give
                large rooms as arrays.
            last: This chunk completes the decode's page list (False for an intermediate chunk).
            ready: The device work that writes these pages, as an object whose ``query()`` says whether
                it is done (a ``torch.cuda.Event`` recorded after the forward pass's kernels). No byte
                moves before it is; it is polled from the loop, within ``timeout``, as for
                [`KVStream.send_layers`][aiotransfer.KVStream.send_layers].
            timeout: Bounds the whole call, the conclusion included; ``DEFAULT`` means
                ``transfer_timeout``. A call that moves data takes no ``None``.

        Raises:
            InvalidArgument: Bad input (out-of-range or too many pages, a last chunk that leaves pages
                unfilled), before any byte moves; the room stays usable.
            TransferFailed: The room failed (``.reason`` says why, on both sides).
            TransferTimeout: The call did not end within ``timeout``; the room fails.
        """
        ctx = self._ctx
        budget = seconds(timeout, ctx.config.transfer_timeout, what="send_kv")
        check_ready(ready, f"room {self.room}")
        reserved = self._reserve(indices, last)
        if reserved is None:
            return
        src, start = reserved
        deadline = Deadline(budget)
        self.update(KVPoll.Transferring)
        give_back = self._ledger.take()  # before the first await: the room cannot be released under this call
        end_chunk = self._chunk()
        t0 = time.monotonic()
        try:
            if ready is not None:
                await self._run_or_fail(wait_device_work(ready, deadline, f"room {self.room}: send_kv"))
            await self._run_or_fail(self._run_chunk(src, start, deadline, conclude=last))
            ctx.metrics.observe("send_kv", time.monotonic() - t0)
            if last:
                await self._run_or_fail(self._finish(deadline))
        finally:
            end_chunk()
            give_back()

    def _chunk(self) -> Callable[[], None]:
        """Count one chunk (a ``send_kv`` call, an open stream, a ``send_layers`` call) in flight until the
        returned function runs (a second call does nothing): the room's one count of them, which the last
        chunk waits on before Success."""
        self._chunks_in_flight += 1
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self._chunks_in_flight -= 1
                self._chunk_finished.set()

        return end

    def _succeed(self) -> None:
        """The one way the room concludes: every chunk landed, the declared aux and state too, and Success
        has left for the decode rank(s) (or nothing moves: every decode rank made this rank a dummy)."""
        _trace.recorder is None or _trace.mark(self.room, "success_out")
        self._kv_done = True
        self._concluding = True
        self.update(KVPoll.Success)

    def _reserve(self, indices: Any, last: bool) -> tuple[np.ndarray, int] | None:
        """Check a chunk and reserve its slice of the decode's pages: ``(pages, start)``, or ``None`` on a
        dummy rank (nothing moves; the last chunk concludes Success at once)."""
        ctx = self._ctx
        ctx.check_open()
        self._raise_if_failed()
        if self._status is KVPoll.Bootstrapping:
            raise InvalidArgument(f"room {self.room} is not ready: await sender.wait_ready() first")
        if self._status is KVPoll.Success or self._last_reserved:
            raise InvalidArgument(f"room {self.room}: the last chunk was already sent")
        src = as_index_array(indices, what="send_kv indices")
        check_range(src, ctx.num_pages, what="send_kv indices")
        assert self._num_dst_pages is not None
        if self.is_dummy:
            # Every decode rank told us to stand by (MLA / CP / replica dummies): nothing moves, but the
            # room still concludes Success on its last chunk so every prefill rank's status terminates.
            if last:
                self._last_reserved = True
                self._succeed()
            return None
        remaining = self._num_dst_pages - self._cursor
        if src.size > remaining:
            raise InvalidArgument(
                f"room {self.room}: chunk of {src.size} pages but only {remaining} destination pages remain"
            )
        if last and src.size != remaining:
            raise InvalidArgument(
                f"room {self.room}: last chunk has {src.size} pages but {remaining} destination pages remain"
                " (pass last=False for an intermediate chunk)"
            )
        start, self._cursor = self._cursor, self._cursor + int(src.size)
        if last:
            self._last_reserved = True
        return src, start

    def stream(self, indices: PageIndices, *, last: bool = True) -> KVStream:
        """Open the pages ``indices`` as the next chunk, to be sent layer by layer with
        [`KVStream.send_layers`][aiotransfer.KVStream.send_layers] as the forward pass writes each layer.
        Chunks and layers compose: chunk after chunk, each streamed or sent whole with
        [`send_kv`][aiotransfer.KVSender.send_kv]. Layers are the KV buffers' ``kv_layer_ids`` (or derived
        from ``num_layers``, see [`KVArgs.buffer_layers`][aiotransfer.KVArgs.buffer_layers]).

        Args:
            indices: Local page indices, as for [`send_kv`][aiotransfer.KVSender.send_kv].
            last: This chunk completes the decode's page list.

        Returns:
            The chunk's stream.

        Raises:
            InvalidArgument: Bad input, or no layer ids in `KVArgs`, before any byte moves.
        """
        layers = self._ctx.args.buffer_layers()
        if layers is None:
            raise InvalidArgument(f"room {self.room}: layer streaming needs kv_layer_ids or num_layers in KVArgs")
        reserved = self._reserve(indices, last)
        if reserved is None:
            return KVStream(self.room, 0, layers, last, self._no_layers)
        src, start = reserved
        self.update(KVPoll.Transferring)
        return KVStream(self.room, int(src.size), layers, last,
                        functools.partial(self._send_layers, src, start, last, self._chunk()))

    async def _no_layers(self, layers: frozenset[int], complete: bool, timeout: float | Default, ready: Any) -> None:
        return None  # a dummy rank's chunk: nothing moves

    async def _send_layers(self, src: np.ndarray, start: int, last: bool, end_stream: Callable[[], None],
                           layers: frozenset[int], complete: bool, timeout: float | Default, ready: Any) -> None:
        """One ``send_layers`` call of a stream; the stream counts as a chunk in flight (``end_stream``) until
        the call that sends its last layers ends. ``ready``: device work to wait for before any byte moves
        (a wait that times out fails the room, as a write that times out does)."""
        ctx = self._ctx
        ctx.check_open()
        self._raise_if_failed()
        deadline = Deadline(seconds(timeout, ctx.config.transfer_timeout, what="send_layers"))
        t0 = time.monotonic()
        give_back = self._ledger.take()  # before the first await: the room cannot be released under this call
        end_call = self._chunk()
        try:
            if ready is not None:
                what = f"room {self.room}: layers {sorted(layers)}"
                await self._run_or_fail(wait_device_work(ready, deadline, what))
            await self._run_or_fail(self._run_layers(src, start, layers, complete, deadline))
            ctx.metrics.observe("send_layers", time.monotonic() - t0)
            if complete:
                end_stream()  # the chunk is complete
                if last:  # waits for every other call in flight, this chunk's other layers included
                    await self._run_or_fail(self._finish(deadline))
        finally:
            end_call()
            if complete:
                end_stream()
            give_back()

    async def _run_layers(self, src: np.ndarray, start: int, layers: frozenset[int], complete: bool,
                          deadline: Deadline) -> None:
        real = self._real_dsts()
        if not real or src.size == 0:
            return
        coros = []
        for d in real:
            ours, theirs, first = d.span(src, start)
            coros.append(self._pusher.write_kv_layers(self._writes, d.peer, ours, theirs, layers, complete, deadline,
                                                      dst_start=first))
        await self._gather(coros)
        if complete:
            self.bytes_sent += sum(b.item_len for b in self._ctx.args.kv) * int(src.size) * len(real)

    @staticmethod
    async def _gather(coros: list[Any]) -> None:
        if len(coros) == 1:
            await coros[0]
            return
        results = await asyncio.gather(*coros, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _run_chunk(self, src: np.ndarray, start: int, deadline: Deadline, conclude: bool = False) -> None:
        real = self._real_dsts()
        if not real or src.size == 0:
            return
        on_done = None
        if conclude and len(real) == 1 and not self._ctx.config.checksum:
            on_done = functools.partial(self._conclude_on_completion, real[0].peer)
        coros = []
        for d in real:
            ours, theirs, first = d.span(src, start)
            coros.append(self._pusher.write_kv(self._writes, d.peer, ours, theirs, deadline, dst_start=first,
                                               on_done=on_done))
        await self._gather(coros)
        self.bytes_sent += sum(b.item_len for b in self._ctx.args.kv) * int(src.size) * len(real)

    async def _finish(self, deadline: Deadline) -> None:
        """Last chunk: wait for earlier chunks, deliver aux/state, then notify Success (same channel), all
        within the deadline of the ``send_kv`` call that sent it."""
        while self._chunks_in_flight > 1:  # our own chunk counts as one; wait for the others
            self._chunk_finished.clear()
            try:
                await within(self._chunk_finished.wait(), deadline.remaining(0.0))
            except asyncio.TimeoutError:
                raise TransferTimeout(f"room {self.room}: earlier chunks did not finish in time",
                                      room=self.room, peer=self._peer_hint()) from None
        self._raise_if_failed()
        self._kv_done = True
        await self._maybe_conclude(deadline)

    @property
    def _extras_delivered(self) -> bool:
        """Aux and state are delivered, or were not declared by decode."""
        return not (self.needs_aux and not self._aux_sent) and not (self.declared_state and not self._state_sent)

    def _conclude_on_completion(self, peer: DecodePeer) -> None:
        """The last chunk's engine write just completed: when nothing else is owed (no other chunk in flight,
        aux and state delivered or not declared), Success leaves for the decode rank right here instead of
        after this task resumes, which takes the resumption off the decode's critical path. Anything else,
        or a message that cannot leave at once, is left to :meth:`_finish`."""
        if self._status.is_terminal or self._concluding or self._chunks_in_flight != 1 or not self._extras_delivered:
            return
        if self._notifier.try_success_now(self._writes, peer, self.aux_path or ""):
            self._ctx.counters["success_at_completion"] += 1
            self._succeed()

    async def _maybe_conclude(self, deadline: Deadline) -> None:
        """Success once the last KV chunk, the declared aux and the declared state have all landed."""
        if self._concluding or not self._kv_done or not self._extras_delivered:
            return
        self._concluding = True
        await self._notifier.success(self._writes, [d.peer for d in self._real_dsts()], self.aux_path or "", deadline)
        self._succeed()

    def _check_sendable(self) -> None:
        self._ctx.check_open()
        self._raise_if_failed()
        if self._status is KVPoll.Bootstrapping:
            raise InvalidArgument(f"room {self.room} is not ready: await sender.wait_ready() first")
        if self._status is KVPoll.Success:
            raise InvalidArgument(f"room {self.room} already concluded")

    async def send_aux(self, aux_index: int, *, timeout: float | Default = DEFAULT) -> None:
        """Send local aux slot ``aux_index`` into the slot each decode rank declared.

        The path (engine or TCP control channel) follows
        `select_aux_path`; on the ``auto`` path an engine failure
        falls back to TCP within the same ``timeout``. Aux always lands before Success is sent.

        Args:
            aux_index: The local aux slot.
            timeout: Bounds the call; ``DEFAULT`` means ``transfer_timeout``. A call that moves data takes
                no ``None``.

        Raises:
            InvalidArgument: No aux buffers, a slot out of range, or aux already sent.
            TransferFailed: The room failed (``.reason`` says why).
            TransferTimeout: The call did not end within ``timeout``; the room fails.
        """
        self._check_sendable()
        ctx = self._ctx
        budget = seconds(timeout, ctx.config.transfer_timeout, what="send_aux")
        if self.is_dummy:
            return  # a dummy rank sends nothing; its decode peers did not ask it for aux
        if self._aux_sent:
            raise InvalidArgument(f"room {self.room}: aux was already sent")
        slot = check_aux_index(ctx.args, aux_index)
        deadline = Deadline(budget)
        self.update(KVPoll.Transferring)
        dsts = [d for d in self._real_dsts() if d.request.aux_index >= 0]
        give_back = self._ledger.take()  # before the first await: the room cannot be released under this call
        try:
            paths = await self._run_or_fail(asyncio.gather(*(
                self._pusher.send_aux(self._writes, d.peer, slot, d.request.aux_index, deadline)
                for d in dsts
            )))
            self.aux_path = paths[0] if paths else None
            self._aux_sent = True
            await self._run_or_fail(self._maybe_conclude(deadline))
        finally:
            give_back()

    async def send_state(self, states: Mapping[str, PageIndices], *, ready: DeviceWork | None = None,
                         timeout: float | Default = DEFAULT) -> None:
        """Send per-request state.

        Args:
            states: ``{kind: local indices}`` (one slot for ``mamba``; pages for ``swa``/``nsa``). Kinds
                and counts must match what the decode declared in ``send_metadata``.
            ready: The device work that writes the state, as for [`send_kv`][aiotransfer.KVSender.send_kv].
            timeout: Bounds the call; ``DEFAULT`` means ``transfer_timeout``. A call that moves data takes
                no ``None``.

        Raises:
            InvalidArgument: Bad indices, or state already sent.
            TransferFailed: Kinds or counts differ from the decode's declaration (the room fails on both
                sides with the reason), or the room failed.
            TransferTimeout: The call did not end within ``timeout``; the room fails.
        """
        self._check_sendable()
        check_ready(ready, f"room {self.room}")
        ctx = self._ctx
        budget = seconds(timeout, ctx.config.transfer_timeout, what="send_state")
        if self.is_dummy:
            return  # a dummy rank sends nothing; its decode peers did not ask it for state
        if self._state_sent:
            raise InvalidArgument(f"room {self.room}: state was already sent")
        local = validate_state_indices(ctx.args, states, role="send_state")
        problem = state_mismatch(local, self.declared_state)
        if problem is not None:
            await self._fail(problem)
            raise TransferFailed(problem, room=self.room)
        deadline = Deadline(budget)
        self.update(KVPoll.Transferring)
        give_back = self._ledger.take()  # before the first await: the room cannot be released under this call
        try:
            if ready is not None:
                await self._run_or_fail(wait_device_work(ready, deadline, f"room {self.room}: send_state"))
            await self._run_or_fail(asyncio.gather(*(
                self._pusher.write_state(self._writes, d.peer, kind, np.asarray(idx, dtype=np.int64),
                                         np.asarray(d.request.state_indices[kind], dtype=np.int64), deadline)
                for d in self._real_dsts() for kind, idx in local.items()
            )))
            self._state_sent = True
            await self._run_or_fail(self._maybe_conclude(deadline))
        finally:
            give_back()

    async def done(self, timeout: float | Default | None = DEFAULT) -> None:
        """Wait for Success. The send that delivers the room's last part (last chunk, declared aux or state)
        returns once Success is sent: ``done()`` is needed only to wait for parts another task sends.

        Args:
            timeout: Seconds to wait; ``DEFAULT`` means ``done_timeout``; ``None``: no bound of its own (the
                room still ends on a failure, an abort, the decode's death within about ``peer_timeout +
                heartbeat_interval``, or the bounds of the sends that conclude it). On expiry the room is
                aborted on both sides; a cancellation of this call aborts it the same way
                (``aborted by prefill: done() cancelled``) and stays a cancellation.

        Raises:
            TransferFailed: The room failed (``.reason`` says why, on both sides).
            TransferTimeout: No terminal status in time.
        """
        self._ctx.check_open()
        t = seconds(timeout, self._ctx.config.done_timeout)
        try:
            await self._wait_for_status(lambda: self._status.is_terminal, Deadline(t), "a terminal status")
        except TransferTimeout:
            await self.abort(f"prefill gave up waiting after {t:.3g}s")
            raise
        except asyncio.CancelledError:
            self._abandon("done() cancelled")
            raise
        self._raise_if_failed()

    async def abort(self, reason: str = "aborted by prefill") -> None:
        """Fail the room here and on every decode rank that asked for it. Nothing when the room already ended.

        Args:
            reason: Recorded by both sides as ``aborted by prefill: <reason>``.
        """
        await self._fail(prefill_reason(reason))

    def _abandon(self, reason: str) -> None:
        """:meth:`abort` without awaiting: the room fails at once, the notice leaves in the background."""
        if self._status.is_terminal:
            return
        reason = prefill_reason(reason)
        ctx = self._ctx
        if self._dsts and ctx.started and not ctx.closed:
            # spawned before the status changes: the drain notice that the change may spawn leaves after it
            ctx.spawn(self._notifier.failure(self.room, list(self._dsts), reason), "abort")
        self.update(KVPoll.Failed, reason)

    # -- failure --------------------------------------------------------------------------------
    async def _fail_from(self, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            reason = "send cancelled on the prefill side (buffers stay pinned until the engine finishes)"
        elif isinstance(exc, TransferTimeout):
            reason = f"transfer timed out: {exc}"
        else:
            reason = f"{type(exc).__name__}: {exc}"
        await asyncio.shield(self._fail(reason))

    async def _fail(self, reason: str) -> None:
        if self._status.is_terminal:
            return
        self.update(KVPoll.Failed, reason)
        await self._notifier.failure(self.room, list(self._dsts), reason)
