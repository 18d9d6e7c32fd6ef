"""Prefill side data movement: plan a chunk (direct entries or staged pieces), write KV, state and aux.

One plan function decides for every chunk: :meth:`Pusher.plan` returns a :class:`TransferPlan` holding
either the direct engine entries or the staging slices. ``send_kv`` uses it, and so do the tools (through
:meth:`aiotransfer.KVManager.plan_transfer`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import _trace
from .._args import Buffer
from .._config import AuxPath
from .._control.messages import AuxData
from .._deadline import Deadline
from .._integrity import RoomChecksum
from .._plan import (
    Blocks,
    IndexArray,
    as_index_array,
    check_range,
    coalesce_runs,
    one_run,
    pair_runs,
    plan_blocks,
    plan_coalesced,
    plan_head_slices,
    plan_runs,
)
from .._poller import WriteGuard
from .._staging import RowSlice, choose_staging
from ..errors import ClosedError, EngineError, InvalidArgument, TransferFailed, TransferTimeout
from .context import RankContext, annotate, engine_failures
from .peers import LAYER_SETS, DecodePeer
from .staged import StagingWriter, piece_pages

__all__ = ["Pusher", "RoomWrites", "TransferPlan", "row_slices"]

log = logging.getLogger("aiotransfer.manager")

Runs = tuple[IndexArray, IndexArray, IndexArray]
"""A chunk's runs: :func:`coalesce_runs`'s (source starts, destination starts, lengths)."""

_PLAN_OFFLOAD_ENTRIES = 1 << 16
"""Plans larger than this many (page x buffer) pairs are computed on the offload thread."""
_FEW_PAGES = 256
"""Chunks of at most this many pages (no head slicing) have their page runs found in plain Python..."""
_FEW_ENTRIES = 64
"""...and are planned in plain Python when runs x buffers is at most this (:func:`plan_runs`): 32 contiguous
pages, one buffer: 5 us against 28 us through NumPy; 32 scattered pages x 64 buffers: 430 us against 54."""


class RoomWrites:
    """What push keeps for one room while it sends: its guard (the room's ledger: every write holds it and
    asks it before each engine submission), the checksums it accumulates per decode rank, the chunks being
    streamed and the layer batches waiting to be posted. Owned by the room, so it goes with the room."""

    __slots__ = ("batches", "checksums", "guard", "room", "streamed")

    def __init__(self, room: int, guard: WriteGuard) -> None:
        self.room = room
        self.guard = guard
        self.checksums: dict[str, RoomChecksum] = {}
        """Per decode rank: the CRC of what was sent so far."""
        self.streamed: dict[tuple[str, int], tuple[list[list[int]] | None, bool, Runs | None]] = {}
        """Chunks being streamed, per (decode rank, first destination slot): page runs, and whether layers
        move apart (direct) or the chunk moves whole with its last layer."""
        self.batches: dict[tuple[str, int], _LayerBatch] = {}
        """Layers of a chunk waiting to be posted together (per decode rank, first destination slot)."""

    def clear(self) -> None:
        """The room ended: drop what it kept (writes in flight keep their own references)."""
        self.checksums.clear()
        self.streamed.clear()


@dataclass(frozen=True)
class TransferPlan:
    """What ``send_kv`` does with one chunk for one decode rank: direct entries, or staged pieces."""

    blocks: Blocks | None
    """Direct: the engine entries (source, destination, length), runs coalesced."""
    slices: tuple[RowSlice, RowSlice] | None
    """Staged: which bytes of each page are gathered here and scattered there."""
    src_buffers: list[int]
    """Indices into ``args.kv`` of the buffers that move, in order."""
    pieces: int = 0
    """Staged: the number of pieces (one engine entry each)."""

    @property
    def staged(self) -> bool:
        return self.slices is not None

    @property
    def entries(self) -> int:
        """Engine entries this chunk posts."""
        return self.pieces if self.blocks is None else len(self.blocks)

    @property
    def src_slice(self) -> RowSlice | None:
        return self.slices[0] if self.slices is not None else None


def chunk_runs(src: np.ndarray, dst: np.ndarray) -> list[list[int]] | None:
    """A chunk's page runs when they are cheap to know: every run of a short chunk, or the one run of a long
    chunk contiguous on both sides; None otherwise (planned through NumPy)."""
    return pair_runs(src.tolist(), dst.tolist()) if src.size <= _FEW_PAGES else one_run(src, dst)


def row_slices(ctx: RankContext, peer: DecodePeer) -> tuple[list[RowSlice], list[RowSlice]]:
    """Per paired buffer: the (source, destination) row slice that moves."""
    pairing = peer.pairing
    if pairing.heads is None:
        src = [RowSlice(1, 1, 0, 1, n) for n in pairing.unit_lens]
        return src, src
    hs = pairing.heads
    rows, hb = pairing.rows_per_page, pairing.head_bytes
    n = int(pairing.src.size)
    return ([RowSlice(rows, hs.src_heads, hs.src_start, hs.count, hb)] * n,
            [RowSlice(rows, hs.dst_heads, hs.dst_start, hs.count, hb)] * n)


class Pusher:
    """Plans and writes one rank's outgoing KV, state and aux."""

    def __init__(self, ctx: RankContext) -> None:
        self._ctx = ctx
        self.staging = StagingWriter(ctx)
        self._aux_fallback_logged = False
        self._owners = ctx.args.buffer_layers()

    # -- planning ---------------------------------------------------------------------------------
    def plan(self, peer: DecodePeer, src: np.ndarray, dst: np.ndarray, *, staging: bool | None = None,
             runs: list[list[int]] | None = None) -> TransferPlan:
        """The plan for pages ``src`` (ours) into ``dst`` (the peer's). ``staging`` forces a path (None:
        decide as ``send_kv`` does); ``runs``: the chunk's :func:`pair_runs`, when already known."""
        src_buffers = [int(i) for i in peer.pairing.src]
        slices = self._staging_slices(peer, src, dst, runs, force=staging)
        if slices is not None:
            per_page = slices[0].bytes_per_page * len(src_buffers)
            arena, remote = self._ctx.arena, peer.staging
            assert arena is not None and remote is not None
            step = piece_pages(per_page, arena.nbytes, remote.nbytes)
            return TransferPlan(None, slices, src_buffers, pieces=-(-int(src.size) // step))
        return TransferPlan(self._blocks(peer, src, dst, runs), None, src_buffers)

    def plan_checked(self, peer: DecodePeer, src_pages: object, dst_pages: object, *,
                     staging: bool | None = None) -> TransferPlan:
        """:meth:`plan` for caller-supplied indices, checked first."""
        if peer.pairing.converts_pages or peer.pairing.stream:
            raise InvalidArgument(f"{peer.endpoint} pages differently (page size or layout): plans are per page of "
                                  "the same geometry")
        src = as_index_array(src_pages, what="src_pages")
        dst = as_index_array(dst_pages, what="dst_pages")
        check_range(src, self._ctx.num_pages, what="src_pages")
        check_range(dst, peer.num_pages, what="dst_pages")
        if src.size != dst.size:
            raise InvalidArgument(f"src_pages has {src.size} pages, dst_pages {dst.size}")
        return self.plan(peer, src, dst, staging=staging)

    def _blocks(self, peer: DecodePeer, src: np.ndarray, dst: np.ndarray, runs: list[list[int]] | None = None,
                positions: np.ndarray | None = None, coalesced: Runs | None = None) -> Blocks:
        """Direct entries; ``positions``: only these paired buffers (indices into the pairing); ``coalesced``:
        the chunk's runs from :func:`coalesce_runs`, when already known."""
        ctx, pairing = self._ctx, peer.pairing
        count = int(pairing.src.size) if positions is None else int(positions.size)
        if runs is not None and pairing.heads is None and len(runs) * count <= _FEW_ENTRIES:
            few = peer.few
            if few is None:
                few = peer.few = (
                    ctx.kv_bases[pairing.src].tolist(), peer.dst_bases.tolist(), list(pairing.unit_lens),
                )
            if positions is None:
                return plan_runs(few[0], few[1], few[2], runs)
            pick = positions.tolist()
            return plan_runs([few[0][i] for i in pick], [few[1][i] for i in pick], [few[2][i] for i in pick], runs)
        return self._blocks_of(peer, src, dst, positions, coalesced)

    def _blocks_of(self, peer: DecodePeer, src: np.ndarray, dst: np.ndarray, positions: np.ndarray | None,
                   coalesced: Runs | None = None) -> Blocks:
        ctx, pairing = self._ctx, peer.pairing
        local = pairing.src if positions is None else pairing.src[positions]
        dst_bases = peer.dst_bases if positions is None else peer.dst_bases[positions]
        dst_lens = peer.dst_item_lens if positions is None else peer.dst_item_lens[positions]
        src_bases = ctx.kv_bases[local]
        src_lens = peer.src_item_lens if positions is None else peer.src_item_lens[positions]
        if pairing.heads is None:
            if coalesced is not None:
                return plan_coalesced(src_bases, dst_bases, src_lens, coalesced)
            return plan_blocks(src_bases, dst_bases, src_lens, src, dst)
        hs = pairing.heads
        return plan_head_slices(
            src_bases, dst_bases, src_lens, dst_lens, src, dst,
            rows_per_page=pairing.rows_per_page, src_heads=hs.src_heads, dst_heads=hs.dst_heads,
            head_bytes=pairing.head_bytes, src_head_start=hs.src_start, dst_head_start=hs.dst_start,
            head_count=hs.count,
        )

    def _staging_slices(
        self, peer: DecodePeer, src: np.ndarray, dst: np.ndarray, runs: list[list[int]] | None,
        force: bool | None = None,
    ) -> tuple[RowSlice, RowSlice] | None:
        """(source slice, destination slice) when this chunk should be staged, else None (direct)."""
        ctx = self._ctx
        mode = ctx.config.staging if force is None else ("always" if force else "never")
        arena = ctx.arena
        if mode == "never" or arena is None or peer.staging is None:  # an arena exists only where we can copy
            return None
        pairing = peer.pairing
        nbuf = int(pairing.src.size)
        if mode == "auto" and pairing.heads is None and int(src.size) * nbuf <= 8:
            return None  # a handful of entries: staging's copies and round trips cannot pay off
        src_lens = set(pairing.unit_lens)
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
        if per_page * 2 > min(arena.nbytes, peer.staging.nbytes):
            return None
        if mode == "always":
            return s_sl, d_sl
        engine = ctx.engine
        traits = engine.traits
        if choose_staging(entries=entries, nbytes=per_page * int(src.size), entry_cost_s=traits.entry_cost_s,
                          bandwidth_bps=traits.bandwidth_bps, device=ctx.args.kv_device):
            return s_sl, d_sl
        return None

    # -- writes -----------------------------------------------------------------------------------
    async def write_kv(
        self, writes: RoomWrites, peer: DecodePeer, src: np.ndarray, dst: np.ndarray, deadline: Deadline, *,
        dst_start: int = 0, on_done: Callable[[], None] | None = None,
    ) -> None:
        """Write one chunk to one decode rank. ``on_done`` (direct writes only) runs on the loop as soon as
        the engine reports the write done, before the awaiting task resumes. ``writes.guard`` is the room: the
        caller holds it for the whole call, every engine submission asks it first, and everything that may
        touch the pages (engine handles, worker-thread copies) holds it until it is over."""
        ctx = self._ctx
        room, guard = writes.room, writes.guard
        pairing = peer.pairing
        if pairing.stream:  # units are tokens: ours and the peer's token slots, ``dst_start`` the first token
            size = pairing.src_units
            await self.staging.write_tokens(room, peer, src[::size] // size, int(src.size), dst_start, deadline, guard)
            return
        runs = chunk_runs(src, dst) if pairing.heads is None else None
        slices = self._staging_slices(peer, src, dst, runs)
        if slices is not None:
            await self.staging.write(room, peer, src, dst_start, slices, deadline, guard)
        else:
            rows = pairing.rows_per_page if pairing.sliced else 1
            with engine_failures(room, peer.endpoint, "engine transfer"):
                if src.size * pairing.src.size * rows > _PLAN_OFFLOAD_ENTRIES:
                    blocks: Blocks = await ctx.offload.run(self._blocks, peer, src, dst, timeout=deadline.remaining(),
                                                           what="transfer planning")
                else:
                    blocks = self._blocks(peer, src, dst, runs)
                _trace.recorder is None or _trace.mark(room, "planned")
                await ctx.poller.write(peer.session_id, blocks, timeout=deadline.remaining(), on_done=on_done,
                                       guard=guard)
            ctx.counters["kv_bytes_sent"] += blocks.nbytes
            ctx.counters["kv_entries_sent"] += len(blocks)
        if ctx.config.checksum:
            await self._checksum_add(peer, writes, src, deadline)

    def _by_layer(self, peer: DecodePeer) -> bool:
        """Whether a chunk to ``peer`` can move layer by layer as direct entries (not when the buffers'
        layers are unknown, when pages hold every layer (page-first layouts), or when heads are sliced)."""
        return (self._owners is not None and self._ctx.args.layout in ("layer_first", "mla")
                and peer.pairing.heads is None and not peer.pairing.stream)

    def _layer_positions(self, peer: DecodePeer, layers: frozenset[int]) -> np.ndarray:
        """The paired buffers (indices into ``peer.pairing``) holding ``layers``."""
        known = peer.layer_positions.get(layers)
        if known is not None:
            return known
        owners = self._owners
        assert owners is not None
        positions = np.array([i for i, b in enumerate(peer.pairing.src.tolist()) if owners[b] in layers], dtype=np.int64)
        positions.flags.writeable = False  # shared by every call for these layers
        if len(peer.layer_positions) < LAYER_SETS:
            peer.layer_positions[layers] = positions
        return positions

    async def write_kv_layers(
        self, writes: RoomWrites, peer: DecodePeer, src: np.ndarray, dst: np.ndarray, layers: frozenset[int],
        complete: bool, deadline: Deadline, *, dst_start: int,
    ) -> None:
        """Write ``layers`` of one chunk to one decode rank; ``complete``: this call sends the chunk's last
        layers. A chunk that is staged, or whose pages hold every layer, moves whole on that call."""
        ctx = self._ctx
        key = (peer.endpoint, dst_start)
        chunk = writes.streamed.get(key)
        if chunk is None:  # once per chunk and decode rank: its page runs, and whether layers move apart
            runs = chunk_runs(src, dst) if peer.pairing.heads is None else None
            apart = self._by_layer(peer) and self._staging_slices(peer, src, dst, runs) is None
            chunk = writes.streamed[key] = (runs, apart, coalesce_runs(src, dst) if apart else None)
        runs, apart, coalesced = chunk
        if complete:
            writes.streamed.pop(key, None)
        if not apart:
            if complete:
                await self.write_kv(writes, peer, src, dst, deadline, dst_start=dst_start)
            return
        positions = self._layer_positions(peer, layers)
        if positions.size:
            batch = writes.batches.get(key)
            if batch is None:  # the first layer of this loop iteration: later ones join it until it is posted
                batch = writes.batches[key] = _LayerBatch(deadline)
                self._post_layers(key, batch, writes, peer, src, dst, (runs, coalesced))
            done = batch.join(positions, deadline)
            with engine_failures(writes.room, peer.endpoint, "engine transfer"):
                await done
        if complete and ctx.config.checksum:
            await self._checksum_add(peer, writes, src, deadline)

    def _post_layers(self, key: tuple[str, int], batch: _LayerBatch, writes: RoomWrites, peer: DecodePeer,
                     src: np.ndarray, dst: np.ndarray, plans: tuple[list[list[int]] | None, Runs | None]) -> None:
        """Post the layers that queue up for one chunk and decode rank as one engine write: a task that starts
        on the next loop iteration, after the calls already scheduled (the other hooks) have joined. The task
        holds the room from now until it ends, and its submission asks the room first: a room that fails
        while the batch waits (for its callers, planning or credit) posts nothing."""
        ctx = self._ctx
        room, guard = writes.room, writes.guard
        give_back = guard.take()

        async def post() -> None:
            if writes.batches.get(key) is batch:
                del writes.batches[key]
            if all(w.cancelled() for w in batch.waiters):  # every caller gave up (the room failed): post nothing
                return
            positions = batch.positions[0] if len(batch.positions) == 1 else np.sort(np.concatenate(batch.positions))
            runs, coalesced = plans
            try:
                if coalesced is not None and coalesced[2].size * positions.size > _PLAN_OFFLOAD_ENTRIES:
                    blocks: Blocks = await ctx.offload.run(
                        self._blocks, peer, src, dst, runs, positions, coalesced, timeout=batch.deadline.remaining(),
                        what="transfer planning")
                else:
                    blocks = self._blocks(peer, src, dst, runs, positions=positions, coalesced=coalesced)
                await ctx.poller.write(peer.session_id, blocks, timeout=batch.deadline.remaining(), guard=guard)
            except Exception as exc:  # every caller of the batch raises it (and fails the room)
                batch.settle(exc)
                return
            ctx.counters["kv_bytes_sent"] += blocks.nbytes
            ctx.counters["kv_entries_sent"] += len(blocks)
            ctx.counters["layer_writes"] += 1
            ctx.counters["layer_calls_batched"] += len(batch.waiters) - 1
            batch.settle(None)

        def ended(_task: object) -> None:
            give_back()
            # a write cancelled by the manager's close (before or while it runs) still resumes its callers
            batch.settle(ClosedError("the manager closed while a layer write was pending"))

        ctx.spawn(post(), f"layers-{room}").add_done_callback(ended)

    async def write_state(
        self, writes: RoomWrites, peer: DecodePeer, kind: str, src: np.ndarray, dst: np.ndarray, deadline: Deadline,
    ) -> None:
        ctx = self._ctx
        room = writes.room
        bufs = ctx.args.state[kind]
        remote = peer.state.get(kind)
        if remote is None:
            raise TransferFailed(f"decode {peer.endpoint} registered no {kind} state buffers", room=room)
        bases = np.array([b.ptr for b in bufs], dtype=np.uint64)
        lens = np.array([b.item_len for b in bufs], dtype=np.uint64)
        blocks = plan_blocks(bases, remote[0], lens, src, dst)
        with engine_failures(room, peer.endpoint, f"{kind} state transfer"):
            await ctx.poller.write(peer.session_id, blocks, timeout=deadline.remaining(), guard=writes.guard)
        ctx.counters[f"state_{kind}_bytes_sent"] += blocks.nbytes

    async def send_aux(self, writes: RoomWrites, peer: DecodePeer, src_slot: int, dst_slot: int,
                       deadline: Deadline) -> str:
        """Deliver one aux slot to ``peer``; returns the path used (``engine`` or ``tcp``). On ``auto`` the
        engine attempt gets half the time left, so that a fallback to TCP still has the other half."""
        ctx = self._ctx
        room = writes.room
        if ctx.aux_path is AuxPath.ENGINE:
            fallback = ctx.config.aux_path is AuxPath.AUTO and all(b.device == "cpu" for b in ctx.args.aux)
            blocks = plan_blocks(ctx.aux_bases, peer.aux_bases, ctx.aux_item_lens, np.array([src_slot]),
                                 np.array([dst_slot]))
            try:
                t0 = time.monotonic()
                budget = deadline.remaining() / 2 if fallback else deadline.remaining()
                await ctx.poller.write(peer.session_id, blocks, timeout=budget, guard=writes.guard)
                ctx.metrics.observe("aux_engine", time.monotonic() - t0)
                ctx.counters["aux_engine"] += 1
                log.debug("room %d: aux slot %d -> %s slot %d via engine", room, src_slot, peer.endpoint, dst_slot)
                return "engine"
            except (EngineError, TransferTimeout) as exc:
                if ctx.config.aux_path is not AuxPath.AUTO:
                    raise TransferFailed(f"aux transfer to {peer.endpoint} failed: {exc}", room=room) from exc
                if not fallback:
                    raise TransferFailed(
                        f"aux transfer to {peer.endpoint} failed ({exc}); no TCP fallback for device-resident aux",
                        room=room,
                    ) from exc
                ctx.counters["aux_fallback"] += 1
                if not self._aux_fallback_logged:
                    self._aux_fallback_logged = True
                    log.warning("aux via the engine failed (%s); falling back to TCP (logged once)", exc)
        t0 = time.monotonic()
        try:
            for i, buf in enumerate(ctx.args.aux):
                msg = AuxData(room=room, buffer=i, index=dst_slot, data=_read_bytes(buf, src_slot),
                              endpoint=ctx.endpoint)
                await ctx.send(peer.endpoint, msg, deadline)
        except TransferTimeout as exc:
            annotate(exc, room, peer.endpoint)
            raise
        ctx.metrics.observe("aux_tcp", time.monotonic() - t0)
        ctx.counters["aux_tcp"] += 1
        log.debug("room %d: aux slot %d -> %s slot %d via tcp", room, src_slot, peer.endpoint, dst_slot)
        return "tcp"

    # -- checksums (prefill half) -----------------------------------------------------------------
    async def _checksum_add(self, peer: DecodePeer, writes: RoomWrites, src: np.ndarray, deadline: Deadline) -> None:
        ctx = self._ctx
        assert ctx.kv_views is not None
        acc = writes.checksums.get(peer.endpoint)
        if acc is None:
            acc = writes.checksums[peer.endpoint] = RoomChecksum(row_slices(ctx, peer)[0])
        idx = peer.pairing.src
        views = [ctx.kv_views[i] for i in idx]
        counts = [ctx.args.kv[i].num_items * peer.pairing.src_units for i in idx]
        await ctx.offload.run(acc.add, views, counts, src, timeout=deadline.remaining(), what="checksum",
                              on_done=writes.guard.take())

    def checksum_fields(self, writes: RoomWrites, peer: DecodePeer) -> tuple[int, list[int]]:
        """(checksum, slice geometry) to send with Success; (-1, []) when none was computed."""
        acc = writes.checksums.pop(peer.endpoint, None)
        if acc is None:
            return -1, []
        fields: list[int] = []
        for sl, b in zip(row_slices(self._ctx, peer)[1], peer.pairing.dst, strict=True):
            fields += [sl.rows, sl.heads, sl.start, sl.count, sl.head_bytes, int(b)]
        return acc.value, fields


class _LayerBatch:
    """Layers of one chunk sent in the same loop iteration (a forward pass whose hooks queued up): posted as
    one engine write, every caller resumed with its outcome. Each caller waits on its own future: a caller
    cancelled meanwhile does not cancel the write, which the room's pages stay held for until it is over."""

    __slots__ = ("deadline", "positions", "waiters")

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.positions: list[np.ndarray] = []
        self.waiters: list[asyncio.Future[None]] = []

    def join(self, positions: np.ndarray, deadline: Deadline) -> asyncio.Future[None]:
        self.positions.append(positions)
        if deadline.at < self.deadline.at:
            self.deadline = deadline  # the write ends within every caller's budget
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        return fut

    def settle(self, exc: Exception | None) -> None:
        for fut in self.waiters:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)


def _read_bytes(buf: Buffer, slot: int) -> bytes:
    """Copy one slot out of host memory (aux buffers on the TCP path live in host memory)."""
    return ctypes.string_at(buf.ptr + buf.item_len * slot, buf.item_len)
