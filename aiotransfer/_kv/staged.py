"""The staging protocol, both ends: the writer (prefill) and the grantor (decode).

See :mod:`aiotransfer._staging` for the flow of one piece and the pure parts (arena, gather, scatter, cost
model). Arena space follows one rule on both sides: it is freed only once nothing can touch it any more.
A gather or scatter that outlives its deadline keeps its slice until its thread has returned (the
offloader's ``on_done``); a slice an engine write was posted from is kept until that write landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._control.messages import Staged, StagedAck, StageGrant, StageRequest, staged_shape
from .._control.rendezvous import Rendezvous
from .._convert import gather_tokens, scatter_tokens
from .._deadline import Deadline
from .._layout import units_per_page
from .._plan import Blocks, units_of
from .._poller import WriteGuard, joint
from .._staging import RowSlice, StagingArena
from ..errors import AiotransferError, InvalidArgument, TransferFailed, TransferTimeout
from .context import RankContext, engine_failures
from .peers import DecodePeer
from .room import StagingRoom

__all__ = ["StagingGrantor", "StagingRoom", "StagingWriter", "PIECE_BYTES"]

PIECE_BYTES = 8 << 20
"""Target size of one staged piece: small enough to overlap gather, transfer and scatter."""


class _Lease:
    """A slice of the arena with two holders: its owner and a worker thread. Freed when both let go."""

    __slots__ = ("_arena", "_busy", "_freed", "_wanted", "n", "off")

    def __init__(self, arena: StagingArena, off: int, n: int) -> None:
        self._arena, self.off, self.n = arena, off, n
        self._busy = 0
        self._wanted = False
        self._freed = False

    def lend(self) -> Callable[[], None]:
        """A worker thread takes the slice; call the returned function once that thread is done with it."""
        self._busy += 1

        def back() -> None:
            self._busy -= 1
            self._settle()

        return back

    def release(self) -> None:
        """The owner is done with the slice (it is freed once no thread holds it)."""
        self._wanted = True
        self._settle()

    def _settle(self) -> None:
        if self._wanted and not self._busy and not self._freed:
            self._freed = True
            self._arena.release(self.off, self.n)


class StagingWriter:
    """Prefill side: gather -> one engine entry into the decode's granted space -> the decode scatters."""

    def __init__(self, ctx: RankContext) -> None:
        self._ctx = ctx
        self._ids = 0
        self.answers: Rendezvous[tuple[str, int, int], StageGrant | StagedAck] = Rendezvous()
        """Answers are keyed by the decode asked (its endpoint, which a signed answer must be sent from), the
        room and the request id (minus the id for an ack): another decode cannot answer for it."""

    def on_answer(self, msg: StageGrant | StagedAck) -> None:
        key = (msg.endpoint, msg.room, msg.req_id if isinstance(msg, StageGrant) else -msg.req_id)
        if not self.answers.resolve(key, msg):
            self._ctx.drop("unexpected-staging-answer", f"room {msg.room} piece {msg.req_id} from {msg.endpoint}")

    async def write(
        self, room: int, peer: DecodePeer, src: np.ndarray, dst_start: int, slices: tuple[RowSlice, RowSlice],
        deadline: Deadline, guard: WriteGuard,
    ) -> None:
        """Gather -> one engine entry -> decode scatters, per piece, pipelined: one gather at a time (the
        copies are CPU-bound), its decode-side space asked for while it runs; writes in flight as long as
        our arena has room; the decode's scatter and ack overlap the next pieces."""
        ctx = self._ctx
        copier = ctx.copier
        assert copier is not None
        s_sl, d_sl = slices
        pairing = peer.pairing
        src_buffers = [int(i) for i in pairing.src]
        num_pages = [ctx.args.kv[i].num_items * pairing.src_units for i in src_buffers]
        dst_buffers = [int(j) for j in pairing.dst]

        def gather(a: int, b: int, off: int) -> None:
            copier.gather(src_buffers, num_pages, src[a:b], s_sl, off)

        def staged_msg(grant: StageGrant, a: int, b: int, nbytes: int) -> Staged:
            return Staged(
                room=room, endpoint=ctx.endpoint, req_id=grant.req_id, offset=grant.offset, nbytes=nbytes,
                dst_start=dst_start + a, n_pages=b - a, rows=d_sl.rows, heads=d_sl.heads, start=d_sl.start,
                count=d_sl.count, head_bytes=d_sl.head_bytes, buffers=dst_buffers,
            )

        await self._pieces(room, peer, int(src.size), s_sl.bytes_per_page * len(src_buffers), gather, staged_msg,
                           deadline, guard)

    async def write_tokens(
        self, room: int, peer: DecodePeer, pages: np.ndarray, tokens: int, first: int, deadline: Deadline,
        guard: WriteGuard,
    ) -> None:
        """Stream ``tokens`` tokens held by our ``pages`` (from their first row) to the room's tokens from
        ``first`` on: gathered with our geometry, scattered by the decode with its own."""
        ctx = self._ctx
        planes = ctx.planes
        pairing = peer.pairing
        hs = pairing.heads
        geo = ctx.page_geometry
        assert planes is not None and geo is not None
        src_start, dst_start, count = (0, 0, geo.heads) if hs is None else (hs.src_start, hs.dst_start, hs.count)
        dst_heads = geo.heads if hs is None else hs.dst_heads
        size = pairing.src_units
        arena = ctx.arena
        assert arena is not None
        per_token = len(planes) * count * pairing.head_bytes

        def gather(a: int, b: int, off: int) -> None:
            out = arena.view[off : off + (b - a) * per_token]  # planes exist only for host KV: a host arena
            gather_tokens(planes, pages, size, a, b, src_start, count, out)

        def staged_msg(grant: StageGrant, a: int, b: int, nbytes: int) -> Staged:
            return Staged(
                room=room, endpoint=ctx.endpoint, req_id=grant.req_id, offset=grant.offset, nbytes=nbytes,
                dst_start=first + a, n_pages=b - a, rows=1, heads=dst_heads, start=dst_start, count=count,
                head_bytes=pairing.head_bytes, buffers=[], stream=True,
            )

        await self._pieces(room, peer, tokens, per_token, gather, staged_msg, deadline, guard)

    async def _pieces(
        self, room: int, peer: DecodePeer, total: int, per_item: int, gather: Callable[[int, int, int], None],
        staged_msg: Callable[[StageGrant, int, int, int], Staged], deadline: Deadline, guard: WriteGuard,
    ) -> None:
        """Items ``[0, total)`` (pages or tokens) of ``per_item`` bytes each, piece by piece; ``gather(a, b,
        off)`` copies items ``[a, b)`` into our arena at ``off`` (on an offload thread)."""
        ctx = self._ctx
        arena, remote = ctx.arena, peer.staging
        assert arena is not None and remote is not None
        step = piece_pages(per_item, arena.nbytes, remote.nbytes)
        gathering = asyncio.Lock()

        async def piece(a: int, b: int) -> None:
            nbytes = (b - a) * per_item
            posted = False
            granting: asyncio.Future[Any] | None = None
            lease: _Lease | None = None
            try:
                async with gathering:
                    lease = _Lease(arena, await arena.acquire(nbytes, deadline.remaining(0.0)), nbytes)
                    granting = asyncio.ensure_future(self._call(
                        peer.endpoint, StageRequest(room=room, endpoint=ctx.endpoint, req_id=0, nbytes=nbytes),
                        deadline,
                    ))
                    try:
                        guard.admit()  # the room may have failed while this piece waited for space
                        await ctx.offload.run(gather, a, b, lease.off,
                                              timeout=deadline.remaining(), what="staging gather",
                                              on_done=joint(guard.take, lease.lend)())
                    except AiotransferError:
                        raise
                    except Exception as exc:
                        raise TransferFailed(f"staging gather failed: {exc!r}", room=room) from exc
                with engine_failures(room, peer.endpoint, "staged transfer"):
                    grant = await asyncio.shield(granting)  # a cancelled piece leaves the grant to be released
                    if not grant.granted:
                        raise TransferFailed(f"decode refused staging space: {grant.reason}", room=room)
                    if not 0 <= grant.offset <= remote.nbytes - nbytes:
                        ctx.drop("invalid-staging-grant", f"room {room}: offset {grant.offset} from {peer.endpoint}")
                        raise TransferFailed(
                            f"decode granted [{grant.offset}, {grant.offset + nbytes}), outside the "
                            f"{remote.nbytes} bytes of staging arena it declared", room=room)
                    blocks = Blocks(
                        np.array([arena.ptr + lease.off], dtype=np.uint64),
                        np.array([remote.ptr + grant.offset], dtype=np.uint64),
                        np.array([nbytes], dtype=np.uint64),
                    )
                    posted = True
                    # the slice (and the room's pages) stay held until the engine is done with the write
                    await ctx.poller.write(peer.session_id, blocks, timeout=deadline.remaining(), guard=guard,
                                           hold=lease.lend)
                lease.release()  # the engine has read our copy
                ack = await self._call(peer.endpoint, staged_msg(grant, a, b, nbytes), deadline)
                if not ack.ok:
                    raise TransferFailed(f"decode could not scatter a staged piece: {ack.reason}", room=room)
            except BaseException:
                if lease is not None:
                    lease.release()  # freed once no engine handle or thread holds it any more
                if granting is not None and not posted:
                    self._release_grant_later(peer.endpoint, granting, room)
                raise
            ctx.counters["kv_bytes_sent"] += nbytes
            ctx.counters["kv_entries_sent"] += 1
            ctx.counters["staged_pieces"] += 1

        tasks = [asyncio.ensure_future(piece(a, min(a + step, total))) for a in range(0, total, step)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    def _release_grant_later(self, endpoint: str, granting: asyncio.Future[Any], room: int) -> None:
        """A piece gave up before anything was written into the decode's space it asked for: hand that
        space back (an empty ``Staged`` piece) once the grant arrives, so the decode does not hold it."""
        ctx = self._ctx

        async def release() -> None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                grant = await asyncio.shield(granting)
                if grant.granted:
                    msg = Staged(room=room, endpoint=ctx.endpoint, req_id=grant.req_id, offset=grant.offset,
                                 nbytes=0, dst_start=0, n_pages=0, rows=1, heads=1, start=0, count=1,
                                 head_bytes=1, buffers=[])
                    await self._call(endpoint, msg, Deadline(ctx.config.handshake_timeout))

        ctx.spawn(release(), "stage-release")

    async def _call(self, endpoint: str, msg: StageRequest | Staged, deadline: Deadline) -> Any:
        """Send a staging message and await its answer (grant or ack), bounded by ``deadline``."""
        if isinstance(msg, StageRequest):
            self._ids += 1
            msg = StageRequest(room=msg.room, endpoint=msg.endpoint, req_id=self._ids, nbytes=msg.nbytes)
            key = (endpoint, msg.room, msg.req_id)
        else:
            key = (endpoint, msg.room, -msg.req_id)
        with self.answers.expect(key) as fut:
            await self._ctx.send(endpoint, msg, deadline)
            answer = await self.answers.wait(fut, deadline.remaining())
        if answer is None:
            raise TransferTimeout(f"no staging answer from {endpoint} in time", room=msg.room, peer=endpoint)
        return answer


def piece_pages(per_page: int, local_arena: int, remote_arena: int) -> int:
    """Pages per staged piece: about :data:`PIECE_BYTES`, at most a quarter of either arena, at least one."""
    cap = max(per_page, min(local_arena // 4, remote_arena // 4, PIECE_BYTES))
    return max(1, cap // per_page)


class _Piece:
    """One staging request held for a room: waiting for arena space (``task``), then granted (``off``)."""

    __slots__ = ("nbytes", "off", "task")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.off: int | None = None
        self.task: asyncio.Task[None] | None = None


class StagingGrantor:
    """Decode side: grant arena space to a prefill rank's piece, then scatter it into the room's pages.

    A grant belongs to the room it was made for, the room itself rather than its number, and is keyed there by
    the asking rank's endpoint and the request id: releasing a room frees the space granted to that room's
    pieces and never another's. A prefill's ids are unique only within its process: one restarted on the same
    endpoint counts from 1 again, for rooms of its own, while grants to its old process's rooms are still
    held. A request that repeats a key whose space is still granted (or being acquired) is refused with the
    reason; it never replaces the first grant, whose space comes back when its piece lands or when its room is
    released.

    Requests held (waiting for space, or granted and not yet used) are bounded per prefill rank and room
    (``max_staging_requests_per_room``) and per prefill rank (``max_staging_requests_per_peer``); one beyond
    either is refused at once with the reason (``dropped_staging-over-cap``). The bytes a room holds, granted
    and not yet scattered, are bounded by ``max_staging_share_per_room`` of the arena: a request past it
    waits for the room's own space to come back, and one larger than the share is refused at once.

    A piece is read from the arena by its shape: before anything is scattered, the shape must cover exactly
    the bytes the piece declares, within the space granted to it, and name only our buffers and the room's
    declared pages; otherwise the piece is refused with the reason and nothing is copied.
    """

    def __init__(self, ctx: RankContext, lookup: Callable[[int], StagingRoom | None],
                 ended: Callable[[int], StagingRoom | None]) -> None:
        self._ctx = ctx
        self._lookup = lookup
        """An open room of ours, by number"""
        self._ended = ended
        """A room that ended here but still holds its pages, by number"""
        self._pieces: dict[StagingRoom, dict[str, dict[int, _Piece]]] = {}
        """room -> prefill endpoint -> request id -> the request held"""
        self._per_peer: dict[str, int] = {}
        """Requests held, by prefill endpoint"""
        self._room_bytes: dict[StagingRoom, int] = {}
        """Arena bytes taken for a room's pieces and not yet back, by room (granted, or being scattered)"""

    @property
    def held(self) -> int:
        """Staging requests held now: waiting for arena space, or granted and not yet used."""
        return sum(self._per_peer.values())

    def on_request(self, msg: StageRequest) -> None:
        ctx, cfg = self._ctx, self._ctx.config
        rx = self._lookup(msg.room)
        if rx is not None and msg.endpoint in rx.sources:
            mine = self._pieces.get(rx, {}).get(msg.endpoint, {})
            if msg.req_id in mine:
                ctx.drop("repeated-staging-request", f"room {msg.room} piece {msg.req_id} from {msg.endpoint}")
                self._refuse(msg, f"staging request {msg.req_id} for room {msg.room} repeats one whose space is "
                                  "still held")
                return
            if ctx.arena is None:
                self._refuse(msg, "decode has no staging arena")
                return
            if msg.nbytes <= 0:
                ctx.drop("invalid-staging-request", f"room {msg.room}: {msg.nbytes} bytes from {msg.endpoint}")
                self._refuse(msg, f"a staging request of {msg.nbytes} bytes: a piece holds at least one byte")
                return
            if msg.nbytes > self._room_share():
                refusal = (f"a staging piece of {msg.nbytes} bytes exceeds the {self._room_share()} bytes one room "
                           "may hold here (max_staging_share_per_room)")
            elif len(mine) >= cfg.max_staging_requests_per_room:
                refusal = (f"room {msg.room} already holds {len(mine)} staging requests from {msg.endpoint} "
                           f"(max_staging_requests_per_room)")
            elif self._per_peer.get(msg.endpoint, 0) >= cfg.max_staging_requests_per_peer:
                refusal = (f"{msg.endpoint} already holds {self._per_peer[msg.endpoint]} staging requests here "
                           f"(max_staging_requests_per_peer)")
            else:
                refusal = None
            if refusal is not None:
                ctx.drop("staging-over-cap", refusal)
                self._refuse(msg, refusal)
                return
            piece = self._pieces.setdefault(rx, {}).setdefault(msg.endpoint, {})[msg.req_id] = _Piece(msg.nbytes)
            self._per_peer[msg.endpoint] = self._per_peer.get(msg.endpoint, 0) + 1
            piece.task = ctx.spawn(self._grant(msg, rx, piece), "stage-grant")
            return
        ended = self._ended(msg.room)
        if ended is not None and msg.endpoint in ended.sources:
            # the room ended here while that rank still sends (it has not heard why yet): it learns now, not
            # at its deadline
            ctx.counters["staging_refused_ended"] += 1
            self._refuse(msg, f"room {msg.room} has ended here: {ended.failure_reason or 'done'}")
            return
        ctx.drop("unknown-room", f"staging request for room {msg.room}")

    def _room_share(self) -> int:
        arena = self._ctx.arena
        return int(arena.nbytes * self._ctx.config.max_staging_share_per_room) if arena is not None else 0

    def _take(self, rx: StagingRoom, n: int) -> None:
        self._room_bytes[rx] = self._room_bytes.get(rx, 0) + n

    def _free(self, rx: StagingRoom, off: int, n: int) -> None:
        """Space taken for a piece of ``rx`` is back in the arena (nothing touches it any more)."""
        assert self._ctx.arena is not None
        self._ctx.arena.release(off, n)
        left = self._room_bytes.get(rx, 0) - n
        if left > 0:
            self._room_bytes[rx] = left
        else:
            self._room_bytes.pop(rx, None)

    def _refuse(self, msg: StageRequest, reason: str) -> None:
        self._answer(msg.endpoint, StageGrant(room=msg.room, endpoint=self._ctx.endpoint, req_id=msg.req_id,
                                              offset=0, granted=False, reason=reason), "stage-refuse")

    def _answer(self, endpoint: str, msg: StageGrant | StagedAck, name: str) -> None:
        """Send an answer; without a task when it can leave at once (refusing a flood creates none)."""
        self._ctx.answer(endpoint, msg, name)

    async def _grant(self, msg: StageRequest, rx: StagingRoom, piece: _Piece) -> None:
        """Wait (bounded) for arena space for ``piece`` of ``rx``, and answer. Cancelled when ``rx`` is released
        meanwhile: no space was taken, and its prefill rank has drained (it waits for no answer)."""
        ctx = self._ctx
        arena = ctx.arena
        assert arena is not None
        reason = f"room {msg.room} is not open here"
        share = self._room_share()
        try:
            off = await arena.acquire(msg.nbytes, ctx.config.transfer_timeout,
                                      admit=lambda: self._room_bytes.get(rx, 0) + msg.nbytes <= share)
        except (InvalidArgument, TransferTimeout) as exc:
            off, reason = None, str(exc)
        if off is not None:
            self._take(rx, msg.nbytes)
        if off is not None and self._lookup(msg.room) is rx and self._holds(rx, msg.endpoint, msg.req_id, piece):
            piece.off, piece.task = off, None
            answer = StageGrant(room=msg.room, endpoint=ctx.endpoint, req_id=msg.req_id, offset=off, granted=True)
        else:  # refused, or the room ended while the piece waited for space
            if off is not None:
                self._free(rx, off, msg.nbytes)
            self._forget(rx, msg.endpoint, msg.req_id, piece)
            answer = StageGrant(room=msg.room, endpoint=ctx.endpoint, req_id=msg.req_id, offset=0, granted=False,
                                reason=reason)
        await ctx.reply(msg.endpoint, answer)

    def _holds(self, rx: StagingRoom, endpoint: str, req_id: int, piece: _Piece) -> bool:
        return self._pieces.get(rx, {}).get(endpoint, {}).get(req_id) is piece

    def _forget(self, rx: StagingRoom, endpoint: str, req_id: int, piece: _Piece) -> None:
        """``piece`` is no longer held for ``rx`` (used, refused, or its space freed)."""
        if not self._holds(rx, endpoint, req_id, piece):
            return
        by_peer = self._pieces[rx]
        del by_peer[endpoint][req_id]
        if not by_peer[endpoint]:
            del by_peer[endpoint]
            if not by_peer:
                del self._pieces[rx]
        self._uncount(endpoint, 1)

    def _uncount(self, endpoint: str, n: int) -> None:
        left = self._per_peer.get(endpoint, 0) - n
        if left > 0:
            self._per_peer[endpoint] = left
        else:
            self._per_peer.pop(endpoint, None)

    def release_room(self, rx: StagingRoom) -> int:
        """``rx``'s pages were released (no prefill write of it can land any more): so is the staging space
        granted to its pieces that never arrived, and requests of it still waiting for space are dropped.
        Only ``rx``'s own: a room opened since under the same number keeps its grants. Returns the bytes
        freed."""
        freed = 0
        for endpoint, pieces in self._pieces.pop(rx, {}).items():
            self._uncount(endpoint, len(pieces))
            for piece in pieces.values():
                if piece.task is not None:
                    piece.task.cancel()  # it never got space: nothing can be written into any
                elif piece.off is not None:
                    self._free(rx, piece.off, piece.nbytes)
                    freed += piece.nbytes
        if freed:
            self._ctx.counters["staging_space_reclaimed"] += 1
        return freed

    def _granted(self, msg: Staged) -> tuple[StagingRoom, _Piece] | None:
        """The room (open, or ended and still holding its pages) and the grant a piece names, if granted."""
        for rx in (self._lookup(msg.room), self._ended(msg.room)):
            piece = self._pieces.get(rx, {}).get(msg.endpoint, {}).get(msg.req_id) if rx is not None else None
            if rx is not None and piece is not None and piece.off is not None:
                return rx, piece
        return None

    def on_staged(self, msg: Staged) -> None:
        ctx = self._ctx
        found = self._granted(msg)
        if found is None:
            ctx.drop("unexpected-staged", f"room {msg.room} piece {msg.req_id}")
            return
        owner, piece = found
        off, nbytes = piece.off, piece.nbytes
        assert off is not None
        arena = ctx.arena
        assert arena is not None
        if off != msg.offset or msg.nbytes > nbytes:
            # not the piece it was granted for: the grant stays held (a write into it may still come) until its
            # piece lands or the room is released
            reason = "staged piece does not match its grant"
            ctx.drop("invalid-staged", reason)
            self._answer(msg.endpoint, StagedAck(room=msg.room, endpoint=ctx.endpoint, req_id=msg.req_id, ok=False,
                                                 reason=reason), "staged-nack")
            return
        self._forget(owner, msg.endpoint, msg.req_id, piece)  # the piece landed: its grant is used
        if msg.n_pages == 0:  # the prefill gave the space back unused
            self._free(owner, off, nbytes)
            ctx.counters["staging_space_returned"] += 1
            self._answer(msg.endpoint, StagedAck(room=msg.room, endpoint=ctx.endpoint, req_id=msg.req_id, ok=True),
                         "staged-ack")
            return
        rx = owner if self._lookup(msg.room) is owner else None
        if rx is None or rx.pages is None:
            scatter: Callable[[], None] | str = f"room {msg.room} is not open here"
        elif msg.stream:
            scatter = self._stream_scatter(msg, rx, off)
        else:
            scatter = self._page_scatter(msg, rx.pages, off, nbytes)
        if isinstance(scatter, str):
            self._free(owner, off, nbytes)
            ctx.drop("invalid-staged", scatter)
            self._answer(msg.endpoint, StagedAck(room=msg.room, endpoint=ctx.endpoint, req_id=msg.req_id, ok=False,
                                                 reason=scatter), "staged-nack")
            return
        assert rx is not None
        ctx.spawn(self._scatter(msg, scatter, functools.partial(self._free, rx, off, nbytes), rx.hold()), "scatter")

    def _page_scatter(self, msg: Staged, pages: np.ndarray, off: int, granted: int) -> Callable[[], None] | str:
        """The copy of a piece of pages (or units of pages: ``k`` a page, 1 when the page sizes match) into
        the room's pages, or why the piece does not fit them or the ``granted`` bytes at ``off``."""
        args, copier = self._ctx.args, self._ctx.copier
        shape = staged_shape(msg)
        if isinstance(shape, str):
            return shape
        if shape > granted:
            return f"staged piece shaped as {shape} bytes exceeds the {granted} bytes granted to it"
        if copier is None or not all(0 <= b < len(args.kv) for b in msg.buffers):
            return "staged piece names unknown buffers"
        unit = msg.rows * msg.heads * msg.head_bytes
        ks = {units_per_page(args.kv[b].item_len, args.page_size, args.outer, unit) for b in msg.buffers}
        k = ks.pop() if len(ks) == 1 else None
        if k is None:
            return "staged row geometry does not match our pages"
        if msg.dst_start + msg.n_pages > pages.size * k:
            return f"staged units [{msg.dst_start}, {msg.dst_start + msg.n_pages}) exceed the {pages.size * k} declared"
        first, last = msg.dst_start // k, -(-(msg.dst_start + msg.n_pages) // k)
        units = units_of(pages[first:last], k)[msg.dst_start - first * k :][: msg.n_pages]
        sl = RowSlice(msg.rows, msg.heads, msg.start, msg.count, msg.head_bytes)
        counts = [args.kv[b].num_items * k for b in msg.buffers]
        return functools.partial(copier.scatter, list(msg.buffers), counts, units, sl, off)

    def _stream_scatter(self, msg: Staged, rx: StagingRoom, off: int) -> Callable[[], None] | str:
        """The copy of a converted piece (tokens of the room) into our pages with our own geometry, or why
        the piece does not fit them."""
        ctx = self._ctx
        planes, geo, arena, pages = ctx.planes, ctx.page_geometry, ctx.arena, rx.pages
        t0, t1 = msg.dst_start, msg.dst_start + msg.n_pages
        if planes is None or geo is None or arena is None or pages is None:
            return "a converted piece came but our pages cannot be converted into"
        if isinstance(shape := staged_shape(msg), str):
            return shape
        if not 0 <= t0 < t1 <= rx.num_tokens:
            return f"staged tokens [{t0}, {t1}) exceed the {rx.num_tokens} declared"
        if msg.heads != geo.heads or msg.head_bytes != geo.head_bytes or msg.start + msg.count > geo.heads:
            return "staged head geometry does not match our pages"
        if msg.nbytes != len(planes) * (t1 - t0) * msg.count * msg.head_bytes:
            return "staged piece size does not match its tokens"
        return functools.partial(scatter_tokens, planes, pages, geo.page_size, t0, t1, msg.start, msg.count,
                                 arena.view[off : off + msg.nbytes])

    async def _scatter(self, msg: Staged, scatter: Callable[[], None], free: Callable[[], None],
                       unhold: Callable[[], None]) -> None:
        """Run a piece's copy into our pages on the offload thread, then ack it (with the reason on failure).
        ``free`` gives the piece's space back and ``unhold`` lets the room's pages be released: both run once
        the copy ends."""
        ctx = self._ctx
        ok, reason = True, ""

        def done() -> None:
            free()
            unhold()

        try:
            # the granted space is freed, and the room's pages may be released, once the scatter's thread is
            # done with them (its copies complete), not when we stop waiting
            await ctx.offload.run(scatter, timeout=ctx.config.transfer_timeout, what="staging scatter",
                                  on_done=done)
            ctx.counters["staged_pieces_received"] += 1
        except Exception as exc:  # the prefill learns why instead of waiting for an ack that never comes
            ok, reason = False, str(exc) if isinstance(exc, AiotransferError) else f"scatter failed: {exc!r}"
        await ctx.reply(msg.endpoint, StagedAck(room=msg.room, endpoint=self._ctx.endpoint, req_id=msg.req_id, ok=ok, reason=reason))
