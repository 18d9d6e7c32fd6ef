"""Status and abort messages to the other side of a room.

The prefill tells decode ranks Success (after aux and state, on the same ordered channel) or Failed with
the reason; the decode tells prefill ranks it aborted. Failure notices are best-effort and bounded: the
other side's own deadline and liveness cover a notice that is lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from .._control.messages import Abort, Drained, Status
from .._deadline import Deadline
from .._status import KVPoll
from ..errors import AiotransferError
from .context import RankContext
from .peers import DecodePeer
from .push import Pusher, RoomWrites

__all__ = ["Notifier", "REASON_MAX"]

REASON_MAX = 4000
"""Reasons longer than this many characters are cut on the wire."""
_NOTICE_TIMEOUT = 1.0


class Notifier:
    def __init__(self, ctx: RankContext, pusher: Pusher) -> None:
        self._ctx = ctx
        self._pusher = pusher

    def _success(self, writes: RoomWrites, peer: DecodePeer, aux_path: str) -> Status:
        checksum, slices = self._pusher.checksum_fields(writes, peer)
        return Status(room=writes.room, status=int(KVPoll.Success), rank=self._ctx.rank_id, endpoint=self._ctx.endpoint,
                      aux_path=aux_path, checksum=checksum, slices=slices)

    async def success(self, writes: RoomWrites, peers: Iterable[DecodePeer], aux_path: str, deadline: Deadline) -> None:
        """Success to every real decode rank of the room (aux and state were delivered before this)."""
        ctx = self._ctx
        for peer in peers:
            await ctx.send(peer.endpoint, self._success(writes, peer, aux_path), deadline,
                           yield_cpu=ctx.yield_after_notify())

    def try_success_now(self, writes: RoomWrites, peer: DecodePeer, aux_path: str) -> bool:
        """Success to the room's only decode rank without waiting; False when it cannot leave at once."""
        ctx = self._ctx
        if ctx.control_or_none is None or ctx.closed:
            return False
        return ctx.control_or_none.try_send(peer.endpoint, self._success(writes, peer, aux_path),
                                            yield_cpu=ctx.yield_after_notify())

    async def failure(self, room: int, endpoints: Iterable[str], reason: str) -> None:
        """Tell decode ranks that the room failed here, and why."""
        ctx = self._ctx
        msg = Status(room=room, status=int(KVPoll.Failed), rank=ctx.rank_id, endpoint=ctx.endpoint,
                     reason=reason[:REASON_MAX])
        await self._broadcast(endpoints, msg)

    async def abort(self, room: int, endpoints: Iterable[str], reason: str) -> None:
        """Tell prefill ranks that the decode gave up on the room, and why."""
        ctx = self._ctx
        await self._broadcast(endpoints, Abort(room=room, endpoint=ctx.endpoint, reason=reason[:REASON_MAX]))

    async def drained(self, room: int, endpoints: Iterable[str], settle: float = 0.0) -> None:
        """Tell decode ranks that nothing of this failed room can write into their pages any more; ``settle``:
        seconds they must still wait once they read it (a failed write's bytes still in the network)."""
        msg = Drained(room=room, endpoint=self._ctx.endpoint, settle_ms=round(settle * 1000))
        await self._broadcast(endpoints, msg)

    async def _broadcast(self, endpoints: Iterable[str], msg: Status | Abort | Drained) -> None:
        ctx = self._ctx
        if ctx.control_or_none is None or ctx.closed:
            return
        for ep in endpoints:
            with contextlib.suppress(AiotransferError):
                await ctx.control_or_none.send(ep, msg, timeout=_NOTICE_TIMEOUT)
