"""What a staged piece may make the decode read and write, whatever its prefill says.

The decode grants arena space to a prefill rank's piece, then scatters the piece into the room's pages by the
shape the piece declares. The wire's decoder refuses a malformed shape, but the grantor does not rely on it:
a piece is checked where it is read, against the space granted to it and the room's own pages. So is every
size the arena is asked for, and the bytes one room may hold. These tests hand messages straight to the
grantor, past the decoder, as a buggy or hostile peer's would arrive were the decoder wrong.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiotransfer import KVManager
from aiotransfer._control.messages import Staged, StageGrant, StageRequest, decode, encode
from aiotransfer._staging import ARENA_ALIGN, StagingArena
from aiotransfer.errors import InvalidArgument, ProtocolError
from tests.test_room_reuse import ITEM, managers
from tests.zmqtools import wait_until

ARENA = 1 << 20
ROOM_PAGES = [10, 11, 12, 13]
INSIDE, OUTSIDE = 0x5A, 0xEE
"""What the arena holds inside the space granted to the piece under test, and everywhere else."""


def _piece(endpoint: str, req_id: int, off: int, **shape: Any) -> Staged:
    """A piece of whole pages of buffer 0 (one row of one head of ``ITEM`` bytes a page), unless ``shape``
    says otherwise."""
    fields: dict[str, Any] = {"nbytes": ITEM, "dst_start": 0, "n_pages": 1, "rows": 1, "heads": 1, "start": 0,
                              "count": 1, "head_bytes": ITEM, "buffers": [0]}
    fields.update(shape)
    return Staged(room=1, endpoint=endpoint, req_id=req_id, offset=off, **fields)


class _Room:
    """An open room 1 on a decode, its prefill's grants caught as they come."""

    def __init__(self, dec: KVManager, pre: KVManager, bufs: list[np.ndarray]) -> None:
        self.dec, self.pre, self.bufs = dec, pre, bufs
        self.grants: list[StageGrant] = []
        pre._handlers[StageGrant] = self.grants.append
        self._ids = 0

    async def open(self, room: int = 1) -> None:
        tx = self.pre.sender(room)
        await self.dec.receiver(room, self.pre.endpoint).send_metadata(ROOM_PAGES, timeout=10)
        await tx.wait_ready(timeout=10)

    async def grant(self, nbytes: int, room: int = 1) -> StageGrant:
        self._ids += 1
        n = len(self.grants)
        self.dec._grantor.on_request(StageRequest(room=room, endpoint=self.pre.endpoint, req_id=self._ids,
                                                  nbytes=nbytes))
        await wait_until(lambda: len(self.grants) > n)
        return self.grants[n]

    def in_use(self) -> int:
        return int(self.dec.stats()["staging_bytes_in_use"])

    def hand_back(self, grant: StageGrant) -> None:
        self.dec._grantor.on_staged(Staged(room=grant.room, endpoint=self.pre.endpoint, req_id=grant.req_id,
                                           offset=grant.offset, nbytes=0, dst_start=0, n_pages=0, rows=1,
                                           heads=1, start=0, count=1, head_bytes=1, buffers=[]))


async def test_a_piece_shaped_past_its_grant_is_refused_and_scatters_nothing() -> None:
    """Granted one page's bytes and declaring them, but shaped as three pages: were it read by its shape, the
    two pages after its grant (another room's staged bytes) would land in this room's pages."""
    async with managers("memory", 2, staging="always", staging_bytes=ARENA) as [(dec, bufs), (pre, _)]:
        room = _Room(dec, pre, bufs)
        await room.open()
        grant = await room.grant(ITEM)
        assert grant.granted
        view = _arena(dec)
        view[:] = OUTSIDE
        view[grant.offset : grant.offset + ITEM] = INSIDE
        dec._grantor.on_staged(_piece(pre.endpoint, grant.req_id, grant.offset, n_pages=3))
        await wait_until(lambda: room.in_use() == 0)
        await asyncio.sleep(0.05)
        assert not bufs[0].any() and not bufs[1].any()
        assert dec.stats()["dropped_invalid-staged"] == 1


async def test_a_negative_size_is_refused_and_never_grants_the_same_bytes_twice() -> None:
    """A request for -1,024 bytes used to grow the arena's first free run backwards: the next two rooms were
    both granted [0, 1024)."""
    async with managers("memory", 2, staging="always", staging_bytes=ARENA) as [(dec, bufs), (pre, _)]:
        room = _Room(dec, pre, bufs)
        await room.open(1)
        await room.open(2)
        refused = await room.grant(-1024, room=1)
        assert not refused.granted and "at least one byte" in refused.reason
        first, second = await room.grant(1024, room=1), await room.grant(1024, room=2)
        assert first.granted and second.granted
        assert abs(first.offset - second.offset) >= 1024
        assert room.in_use() == 2 * max(1024, ARENA_ALIGN)


async def test_a_room_holds_at_most_its_share_of_the_arena() -> None:
    """With half the arena a room's share, a second piece of one room waits though the arena has space, while
    another room's piece is granted; the first piece's space coming back lets it through. A piece larger
    than the share is refused at once."""
    async with managers("memory", 2, staging="always", staging_bytes=ARENA,
                        max_staging_share_per_room=0.5) as [(dec, bufs), (pre, _)]:
        room = _Room(dec, pre, bufs)
        await room.open(1)
        await room.open(2)
        big = await room.grant(ARENA // 2 - 4096, room=1)
        assert big.granted
        n = len(room.grants)
        room._ids += 1
        dec._grantor.on_request(StageRequest(room=1, endpoint=pre.endpoint, req_id=room._ids, nbytes=8192))
        other = await room.grant(8192, room=2)
        assert other.granted and len(room.grants) == n + 1  # room 1's second piece still waits
        assert room.in_use() == ARENA // 2 - 4096 + 8192
        room.hand_back(big)
        await wait_until(lambda: len(room.grants) == n + 2)
        assert room.grants[-1].granted and room.grants[-1].room == 1
        too_big = await room.grant(ARENA // 2 + ARENA_ALIGN, room=2)
        assert not too_big.granted and "max_staging_share_per_room" in too_big.reason


def _arena(dec: KVManager) -> np.ndarray:
    arena = dec._ctx.arena
    assert arena is not None
    return arena.view


def _dropped(dec: KVManager) -> int:
    stats: dict[str, Any] = dict(dec.stats())
    return int(stats.get("dropped_invalid-staged", 0) + stats.get("dropped_unexpected-staged", 0))


def _fuzzed(rng: random.Random, endpoint: str, grant: StageGrant) -> Staged:
    def pick(*values: int) -> int:
        return rng.choice(values)

    if rng.random() < 0.5:  # a well-formed piece: whole pages or halves (k units a page), heads or a slice
        k, rows, heads = pick(1, 2), pick(1, 2), pick(1, 2, 4)
        count = pick(heads, heads, 1)
        head_bytes, units = ITEM // k // rows // heads, pick(1, 2, 3)
        shaped = units * rows * count * head_bytes  # declared as it is, or as what fits the grant
        return _piece(endpoint, grant.req_id, grant.offset, nbytes=pick(shaped, shaped, min(shaped, 2 * ITEM), ITEM),
                      dst_start=rng.randrange(len(ROOM_PAGES) * k + 1), n_pages=units, rows=rows, heads=heads,
                      start=pick(0, heads - count), count=count, head_bytes=head_bytes, buffers=[pick(0, 1)])
    rows, heads, head_bytes = pick(-1, 0, 1, 1, 2, 4), pick(0, 1, 1, 2, 4), pick(-1, 0, 64, 256, 512, ITEM, ITEM)
    n_pages, n_buffers = pick(-2, 0, 1, 1, 2, 3, 6), pick(0, 1, 1, 2, 3)
    buffers = [pick(-2, -1, 0, 0, 1, 1, 2) for _ in range(n_buffers)]
    start, count = pick(-1, 0, 0, 1, 3), pick(-1, 0, 1, 1, 2, 4)
    shaped = max(len(buffers), 1) * n_pages * rows * count * head_bytes
    nbytes = pick(shaped, shaped, ITEM, 2 * ITEM, 4 * ITEM, -ITEM, 0, 1)
    offset = grant.offset if rng.random() < 0.9 else pick(-ITEM, 0, ITEM, ARENA - ITEM, ARENA)
    return Staged(room=1, endpoint=endpoint, req_id=grant.req_id, offset=offset, nbytes=nbytes,
                  dst_start=pick(-3, -1, 0, 0, 1, 2, 3, 4, 5), n_pages=n_pages, rows=rows, heads=heads,
                  start=start, count=count, head_bytes=head_bytes, buffers=buffers, stream=rng.random() < 0.1)


async def test_fuzzed_pieces_write_only_the_rooms_pages_from_only_their_grant() -> None:
    """Pieces with every field drawn from sizes, offsets, indices and counts a buggy or hostile prefill may
    send (half of them well formed but for a size that may lie), each after a real grant of two pages: no byte lands outside the room's own pages, none comes from
    outside the piece's grant, and every byte granted comes back."""
    rng = random.Random(20261202)
    async with managers("memory", 2, staging="always", staging_bytes=ARENA) as [(dec, bufs), (pre, _)]:
        room = _Room(dec, pre, bufs)
        await room.open()
        view = _arena(dec)
        allowed = np.zeros(bufs[0].shape, dtype=bool)
        allowed[ROOM_PAGES, :] = True
        landed = refused = 0
        for _ in range(300):
            grant = await room.grant(2 * ITEM)
            assert grant.granted
            view[:] = OUTSIDE
            view[grant.offset : grant.offset + 2 * ITEM] = INSIDE
            for b in bufs:
                b[:] = 0
            before = _dropped(dec)
            msg = _fuzzed(rng, pre.endpoint, grant)
            dec._grantor.on_staged(msg)
            if _dropped(dec) > before:
                refused += 1
                if dec._grantor.held:  # a piece that does not match its grant leaves the grant held
                    room.hand_back(grant)
            await wait_until(lambda: room.in_use() == 0 and dec._grantor.held == 0)
            await wait_until(lambda: dec.stats()["staging_bytes_in_use"] == 0)
            for b in bufs:
                written = b != 0
                assert not (written & ~allowed).any(), msg
                assert (b[written] == INSIDE).all(), msg
            landed += int(any(b.any() for b in bufs))
        print(f"300 fuzzed pieces: {landed} scattered, {refused} refused")
        assert landed and refused  # the draws reach both outcomes


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(-4096, 3 * 4096)), max_size=40))
def test_the_arena_never_grants_a_byte_twice(ops: list[tuple[bool, int]]) -> None:
    """Any sequence of takes (of any size, zero and negative ones included) and gives back: the live grants
    never overlap, lie inside the arena, and add up to what the arena says is in use."""
    arena = StagingArena(8 * 4096)
    live: list[tuple[int, int]] = []
    for take, n in ops:
        if take:
            try:
                off = arena.try_acquire(n)
            except InvalidArgument:
                assert n <= 0
                continue
            if off is not None:
                live.append((off, -(-n // ARENA_ALIGN) * ARENA_ALIGN))
        elif live:
            off, size = live.pop(n % len(live))
            arena.release(off, size)
        spans = sorted(live)
        assert all(0 <= o and o + s <= arena.nbytes for o, s in spans)
        assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert arena.in_use == sum(s for _, s in spans)


def test_the_decoder_refuses_a_piece_whose_shape_is_not_its_size() -> None:
    piece = _piece("tcp://127.0.0.1:1", 1, 0, n_pages=3)
    with pytest.raises(ProtocolError, match="staged size does not match its geometry"):
        decode(encode(piece))
    assert decode(encode(_piece("tcp://127.0.0.1:1", 1, 0, n_pages=3, nbytes=3 * ITEM))) is not None
