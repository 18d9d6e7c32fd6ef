"""The page lifecycle of a rank's rooms: which ended rooms still hold their pages, and why they let go.

A room's pages go: in use -> (Success) released, or (Failed / aborted) awaiting release -> released. On the
prefill a room is released once its ledger is empty (every engine handle terminal, every worker copy
returned). On the decode a failed room is released once each prefill rank asked to write into it has
acknowledged a drain (``Drained``), or has been proven gone (a new incarnation answered on its endpoint,
or its control port refuses connections: no process is listening there any more), or the quarantine
elapsed. This module keeps the rooms awaiting release, proves peers gone, and counts it all.

A room number stays taken until its room is released: an ended room still holding its pages keeps its
number, so that nothing keyed by it (a drain acknowledgement, staging space) can be taken for a new room
(:meth:`Lifecycle.holding`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .._events import PeerEvent
from .context import RankContext
from .probe import port_refuses
from .room import ReceiverRoom, SenderRoom
from .staged import StagingGrantor

__all__ = ["Lifecycle", "port_refuses"]

log = logging.getLogger("aiotransfer.manager")



class Lifecycle:
    def __init__(self, ctx: RankContext, grantor: StagingGrantor, publish: Callable[[PeerEvent], None]) -> None:
        self._ctx = ctx
        self._publish = publish
        self._grantor = grantor
        self.tx: dict[int, SenderRoom] = {}
        """Prefill rooms that ended here and still hold their pages."""
        self.rx: dict[int, ReceiverRoom] = {}
        """Decode rooms that ended here and still hold their pages."""
        for name in ("drains_acknowledged", "quarantines_expired", "peers_proven_gone", "rooms_refused_in_use",
                     "freezes_settled"):
            ctx.counters[name] += 0

    def ended(self, tx: SenderRoom | None = None, rx: ReceiverRoom | None = None) -> None:
        """A prefill room (``tx``) or a decode room (``rx``) just became terminal; it waits here until
        released."""
        if tx is not None and not tx.is_released():
            self.tx[tx.room] = tx
        if rx is not None and not rx.is_released():
            self.rx[rx.room] = rx

    def released(self, cause: str, tx: SenderRoom | None = None, rx: ReceiverRoom | None = None) -> None:
        ctx = self._ctx
        side: SenderRoom | ReceiverRoom | None = tx
        if tx is not None and self.tx.get(tx.room) is tx:
            del self.tx[tx.room]
        if rx is not None:
            side = rx
            if self.rx.get(rx.room) is rx:
                del self.rx[rx.room]
            self._grantor.release_room(rx)  # staging space granted to this room's pieces, and only to them
        assert side is not None
        ctx.counters[f"rooms_released_{cause.replace('-', '_')}"] += 1
        if cause == "quarantine":
            ctx.counters["quarantines_expired"] += 1
            log.warning("room %d: pages released after the %.3gs quarantine; no drain acknowledgement from %s",
                        side.room, ctx.config.quarantine_s, ", ".join(rx.awaiting_drain if rx else []) or "-")

    def holding(self, room: int, *, prefill: bool) -> str | None:
        """Why the number ``room`` is still taken on this side by a room that ended here and has not released
        its pages (the state it is in), or None. ``prefill``: this rank's senders, else its receivers."""
        if prefill:
            tx = self.tx.get(room)
            if tx is None or tx.is_released():
                return None
            state = (f"it ended ({_how(tx)}) and engine operations or worker copies of its pages are still pending "
                     f"({tx.engine_holds})")
        else:
            rx = self.rx.get(room)
            if rx is None or rx.is_released():
                return None
            waiting = rx.awaiting_drain
            if waiting and all(self._ctx.liveness.is_dead(ep) for ep in waiting):
                state = (f"it ended ({_how(rx)}) and is quarantined: its prefill ranks {', '.join(waiting)} are "
                         f"silent, so only a proof that they are gone or the {self._ctx.config.quarantine_s:g}s "
                         "quarantine releases its pages")
            elif waiting:
                state = f"it ended ({_how(rx)}) and is awaiting its drain acknowledgement from {', '.join(waiting)}"
            else:
                state = f"it ended ({_how(rx)}) and its own copies into its pages are still running"
        side = "tx" if prefill else "rx"
        return (f"{state}; a room number is unique until its pages are released: await {side}.released() of the "
                "ended room first, and give a retried request a new room number")

    def peer_gone(self, endpoint: str, cause: str) -> int:
        """``endpoint``'s process is provably gone: nothing it posted can land any more."""
        n = sum(rx.on_drained(endpoint, cause) for rx in list(self.rx.values()))
        if n:
            self._ctx.counters["peers_proven_gone"] += 1
        return n

    async def prove_gone(self) -> None:
        """Each heartbeat: a dead prefill rank that rooms still wait for is gone if its port refuses."""
        ctx = self._ctx
        while True:
            await asyncio.sleep(ctx.config.heartbeat_interval)
            waiting = {ep for rx in self.rx.values() for ep in rx.awaiting_drain if ctx.liveness.is_dead(ep)}
            for ep in sorted(waiting):
                if await port_refuses(ep):
                    log.info("prefill %s is gone (its control port refuses connections)", ep)
                    self.peer_gone(ep, "peer-gone")
                    self._publish(PeerEvent("gone", ep, (), f"peer {ep} is gone: its control port refuses connections"))

    def stats(self, page_bytes: int, open_pages: int) -> dict[str, Any]:
        """Pages (and bytes) by state: in use by open rooms (``open_pages``), awaiting a drain, and
        quarantined (decode rooms whose every awaited prefill rank is silent: only the quarantine or a
        proof of its death will release them)."""
        dead = self._ctx.liveness.is_dead
        draining = sum(tx.num_pages or 0 for tx in self.tx.values())
        quarantined = 0
        for rx in self.rx.values():
            n = int(rx.pages.size) if rx.pages is not None else 0
            waiting = rx.awaiting_drain
            if waiting and all(dead(ep) for ep in waiting):
                quarantined += n
            else:
                draining += n
        return {
            "rooms_awaiting_release": len(self.tx) + len(self.rx),
            "pages_in_use": open_pages, "bytes_in_use": open_pages * page_bytes,
            "pages_awaiting_drain": draining, "bytes_awaiting_drain": draining * page_bytes,
            "pages_quarantined": quarantined, "bytes_quarantined": quarantined * page_bytes,
            "engine_holds_pending": sum(tx.engine_holds for tx in self.tx.values()),
        }


def _how(side: SenderRoom | ReceiverRoom) -> str:
    """How a room ended, for a message: its status, and its reason when it failed."""
    status = side.status.name.lower()
    return f"{status}: {side.failure_reason}" if side.failure_reason else status
