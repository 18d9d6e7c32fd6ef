"""The decode side's inbound half: status reports from prefill ranks (with checksums), their aborts, and
aux bytes that came over the control channel."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping

from .. import _trace
from .._control.messages import Abort, AuxData, Drained, Status
from .._integrity import fold, region_crcs
from .._layout import units_per_page
from .._plan import units_of
from .._staging import RowSlice
from .._status import KVPoll
from ..errors import AiotransferError
from .context import RankContext
from .room import ReceiverRoom

__all__ = ["DecodeSide"]

log = logging.getLogger("aiotransfer.manager")


class DecodeSide:
    def __init__(
        self, ctx: RankContext, receivers: Mapping[int, ReceiverRoom], draining: Mapping[int, ReceiverRoom],
        forget_prefill: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self._forget_prefill = forget_prefill
        self._receivers = receivers
        self._draining = draining

    def on_drained(self, msg: Drained) -> None:
        """A prefill rank acknowledges that nothing of a failed room can write here any more."""
        rx = self._receivers.get(msg.room) or self._draining.get(msg.room)
        if rx is None or not rx.on_drained(msg.endpoint, settle=msg.settle_ms / 1000):
            self._ctx.drop("unexpected-drained", f"room {msg.room} from {msg.endpoint}")
            return
        self._ctx.counters["drains_acknowledged"] += 1

    def on_status(self, msg: Status) -> None:
        _trace.recorder is None or _trace.mark(msg.room, "status_in")
        rx = self._receivers.get(msg.room)
        if msg.register_again and msg.status == int(KVPoll.Failed):
            # the prefill process does not hold the registration our request named (it restarted, or forgot
            # us): it took nothing of the room, which registers again and resends its request
            if rx is None or not rx.ask_again(msg.endpoint, msg.generation, self._forget_prefill):
                self._ctx.drop("unexpected-register-again", f"room {msg.room} from {msg.endpoint}")
            return
        if rx is None:
            self._ctx.drop("unknown-room", f"status for room {msg.room}")
            return
        if msg.status == int(KVPoll.Success) and msg.checksum >= 0 and msg.endpoint in rx.sources:
            self._ctx.spawn(self._verified_status(rx, msg), "verify")
            return
        if not rx.on_prefill_status(msg.endpoint, msg.rank, KVPoll(msg.status), msg.reason, msg.aux_path):
            self._ctx.drop("wrong-peer", f"status for room {msg.room} from {msg.endpoint}")

    async def _verified_status(self, rx: ReceiverRoom, msg: Status) -> None:
        try:
            reason = await self._verify_checksum(rx, msg)
        except Exception as exc:  # the room fails with why, instead of waiting out done_timeout
            detail = str(exc) if isinstance(exc, AiotransferError) else repr(exc)
            reason = f"checksum could not be verified: {detail}"
        if reason is not None:
            self._ctx.counters["checksum_mismatches"] += 1
            log.error("room %d: %s", rx.room, reason)
            await rx.abort(reason)
            return
        self._ctx.counters["checksums_verified"] += 1
        rx.on_prefill_status(msg.endpoint, msg.rank, KVPoll.Success, msg.reason, msg.aux_path)

    async def _verify_checksum(self, rx: ReceiverRoom, msg: Status) -> str | None:
        """Recompute what ``msg``'s rank wrote; returns a failure reason or None."""
        ctx, f = self._ctx, msg.slices
        kv, views, pages = ctx.args.kv, ctx.kv_views, rx.pages
        if views is None or pages is None or len(f) % 6 or not f:
            return "checksum received but cannot be verified here"
        slices, regions, counts, ks = [], [], [], set()
        for i in range(0, len(f), 6):
            rows, heads, start, count, hb, b = f[i : i + 6]
            if min(rows, heads, count, hb) < 1 or start < 0 or start + count > heads or not 0 <= b < len(kv):
                return "checksum geometry does not match our buffers"
            k = units_per_page(kv[b].item_len, ctx.args.page_size, ctx.args.outer, rows * heads * hb)
            if k is None:
                return "checksum geometry does not match our buffers"
            ks.add(k)
            slices.append(RowSlice(rows, heads, start, count, hb))
            regions.append(views[b])
            counts.append(kv[b].num_items * k)
        if len(ks) != 1:
            return "checksum geometry does not match our buffers"
        k = ks.pop()  # units per page: the room's tokens, in the units the prefill wrote
        units = units_of(pages, k)[: -(-rx.num_tokens // (ctx.args.page_size // k))]
        # the thread reads the room's pages: they are not released before it is done with them
        crcs = await ctx.offload.run(region_crcs, regions, counts, units, slices,
                                     timeout=ctx.config.transfer_timeout, what="checksum verify", on_done=rx.hold())
        got = fold(crcs)
        if got != msg.checksum:
            return f"checksum mismatch for data from prefill rank {msg.rank}: sent {msg.checksum:#010x}, got {got:#010x}"
        return None

    def on_abort(self, msg: Abort) -> bool:
        """A prefill rank gave up on a room of ours; False when the abort is not for one of ours."""
        rx = self._receivers.get(msg.room)
        if rx is not None and msg.endpoint in rx.sources:
            rx.update(KVPoll.Failed, f"aborted by prefill: {msg.reason}")
            return True
        return False

    def on_aux(self, msg: AuxData) -> None:
        """The TCP aux path: write the bytes in place, only into the declared slot."""
        ctx = self._ctx
        rx = self._receivers.get(msg.room)
        if rx is None:
            ctx.drop("unknown-room", f"aux for room {msg.room}")
            return
        if msg.endpoint not in rx.sources:
            ctx.drop("wrong-peer", f"aux for room {msg.room} from {msg.endpoint}")
            return
        aux = ctx.args.aux
        if rx.aux_index is None or msg.index != rx.aux_index or msg.buffer >= len(aux):
            ctx.drop("invalid-aux", f"aux for room {msg.room}: buffer {msg.buffer} slot {msg.index}")
            return
        buf = aux[msg.buffer]
        if len(msg.data) != buf.item_len:
            ctx.drop("invalid-aux", f"aux for room {msg.room}: {len(msg.data)} bytes, slot holds {buf.item_len}")
            return
        ctypes.memmove(buf.ptr + buf.item_len * msg.index, msg.data, len(msg.data))
        ctx.counters["aux_tcp_received"] += 1
