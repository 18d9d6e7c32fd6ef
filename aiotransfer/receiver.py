"""``KVReceiver``: the decode side of one request (room)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._room import RoomSide
from .errors import InvalidArgument, TransferFailed, TransferTimeout
from .plan import as_index_array, check_range, check_unique
from .status import KVPoll

if TYPE_CHECKING:
    from .manager import KVManager

__all__ = ["KVReceiver"]

log = logging.getLogger("aiotransfer.receiver")


class KVReceiver(RoomSide):
    """Declares where one room's pages go, then waits for every required prefill rank to report.

    Created by :meth:`KVManager.receiver`. Status: Bootstrapping -> WaitingForInput (metadata sent) ->
    Success when every required prefill rank reported Success, or Failed (sticky, with a reason).
    """

    def __init__(self, manager: KVManager, room: int, peer: str, prefill_dp_rank: int | None = None) -> None:
        super().__init__(room)
        self._m = manager
        self.peer = peer
        self.prefill_dp_rank = prefill_dp_rank
        self._all_targets: list[str] = []
        self._pages: np.ndarray | None = None
        self._sent = False
        self._targets: dict[str, int] = {}
        """prefill endpoint -> prefill rank, for every rank we expect a status from."""
        self._required = 0
        self._succeeded: set[int] = set()
        self.aux_index: int | None = None
        self.state_indices: dict[str, list[int]] = {}
        self.aux_path: str | None = None
        """How the aux arrived (``engine`` / ``tcp``), as reported with Success."""
        self._aux_received: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"<KVReceiver room={self.room} peer={self.peer} {self.poll().name} "
            f"responses={len(self._succeeded)}/{self._required}>"
        )

    # -- public API -----------------------------------------------------------------------------
    async def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Mapping[str, Sequence[int]] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Tell the prefill rank(s) where to write: local page indices, aux slot and state slots.

        Validated here before anything is sent: indices in range and unique, aux slot in range.
        The first call to a peer also registers this rank's buffers with it (bounded handshake).
        """
        m = self._m
        m._check_open()
        if self._status is KVPoll.Failed:
            raise TransferFailed(self._reason or "failed", room=self.room)
        if self._sent:
            raise InvalidArgument(f"room {self.room}: metadata was already sent")
        pages = as_index_array(kv_indices, what="kv_indices")
        check_range(pages, m.args.num_pages, what="kv_indices")
        check_unique(pages, what="kv_indices")
        if pages.size and int(pages.max()) >= 2**31:
            raise InvalidArgument("kv_indices must fit in int32")
        if aux_index is not None:
            slots = min((b.num_items for b in m.args.aux), default=0)
            if not m.args.aux:
                raise InvalidArgument("aux_index given but this manager has no aux buffers")
            if not 0 <= aux_index < slots:
                raise InvalidArgument(f"aux_index {aux_index} out of range [0, {slots})")
        states = m._validate_state_indices(state_indices or {})
        t = m.config.handshake_timeout if timeout is None else timeout
        self._sent = True
        self._pages = pages
        try:
            await m._send_request(self, pages, aux_index, states, timeout=t)
        except BaseException as exc:
            self._sent = False
            if not isinstance(exc, (InvalidArgument,)):
                m._rx_update(self.room, KVPoll.Failed, f"metadata not delivered: {exc}")
            raise
        self.aux_index = aux_index
        self.state_indices = states

    async def done(self, timeout: float | None = None) -> None:
        """Wait until every required prefill rank reported Success.

        Raises :class:`TransferFailed` (``.reason`` says why, as reported by prefill) or
        :class:`TransferTimeout` (the room is then failed and prefill is told).
        """
        m = self._m
        m._check_open()
        t = m.config.done_timeout if timeout is None else timeout
        deadline = asyncio.get_running_loop().time() + t
        if not await self._wait_until(lambda: self._status.is_terminal, deadline):
            await self.abort(f"decode gave up waiting after {t:.3g}s")
            raise TransferTimeout(f"room {self.room}: no completion within {t:.3g}s")
        if self._status is KVPoll.Failed:
            raise TransferFailed(self._reason or "failed", room=self.room)

    async def abort(self, reason: str = "aborted by the decode side") -> None:
        """Fail the room here and tell every prefill rank involved."""
        if self._status.is_terminal:
            return
        self._m._rx_update(self.room, KVPoll.Failed, reason)
        await self._m._notify_abort(self.room, self._all_targets or list(self._targets), reason)

    # -- called by the manager ------------------------------------------------------------------
    def _on_prefill_status(
        self, endpoint: str, rank: int, status: KVPoll, reason: str, aux_path: str = ""
    ) -> bool:
        """Apply one prefill rank's report; returns False if that endpoint is not a target."""
        if endpoint not in self._targets:
            return False
        if status is KVPoll.Failed:
            self._m._rx_update(self.room, KVPoll.Failed, reason or "prefill reported failure")
        elif status is KVPoll.Success:
            if aux_path:
                self.aux_path = aux_path
            self._succeeded.add(rank)
            if len(self._succeeded) >= self._required:
                self._m._rx_update(self.room, KVPoll.Success)
        return True
