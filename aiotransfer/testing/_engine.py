"""The memory engine: an engine adapter over a `aiotransfer.testing.MemoryFabric`, in one process.

| method | blocks? | GIL | thread-safe |
|---|---|---|---|
| ``register`` / ``deregister`` | no | held | yes (the fabric's lock) |
| ``reach`` | no | held | yes |
| ``connect`` | while the fabric keeps handshakes hanging, holding the engine mutex | released while it waits | yes |
| ``submit_write`` | while a handshake holds the engine mutex (refused on the fabric's ``loop_thread``); copies the bytes when the write lands at once | released during the copy | yes |
| ``try_submit_inline`` | no: declines while a handshake runs, and for a peer not connected yet (as the Mooncake adapter) | as ``submit_write`` | yes |
| ``check`` | no; copies the bytes when an auto-mode write is due | released during the copy | yes |
| ``close`` | no | held | yes |
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._plan import Blocks
from ..engines._base import EngineBase, EngineStatus, EngineTraits, MemoryRegion, TransferHandle
from ..errors import EngineError
from ._fabric import MemoryFabric, Write, WriteOutcome, current_fabric

if TYPE_CHECKING:
    from .._config import TransferConfig

__all__ = ["MemoryEngine", "engine_from_config"]

_SESSIONS = itertools.count(1)


class MemoryEngine(EngineBase):
    """An engine whose writes are copies between host buffers of one process, steered by a fabric.

    ``TransferConfig(engine="memory")`` creates one on `aiotransfer.testing.current_fabric`; a test
    may also create it directly on a fabric of its own (``MemoryEngine(fabric)``, e.g. as the factory of a
    name given to `aiotransfer.engines._registry.register_engine`). Host memory only; peers must be
    engines of the same fabric, so of the same process.
    """

    name = "memory"

    def __init__(self, fabric: MemoryFabric | None = None) -> None:
        self.fabric = fabric if fabric is not None else current_fabric()
        self._session = f"memory-{os.getpid()}-{next(_SESSIONS)}"
        self._scope = object()
        self.closed = False
        self._writes: dict[int, Write] = {}
        self._connected: set[str] = set()
        self.traits = EngineTraits(quiet_threads=True, landing_grace_s=self.fabric.landing_grace_s)
        self.fabric.join(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"peers={len(self._connected)} in_flight={len(self._writes)}"
        return f"<MemoryEngine {self._session} {state}>"

    @property
    def credit_scope(self) -> object:
        return self._scope

    @property
    def session_id(self) -> str:
        return self._session

    @property
    def transport(self) -> str:
        return "memory"

    def describe(self) -> dict[str, Any]:
        return {"engine": "memory", "transport": "memory", "session_id": self._session,
                "mode": "auto" if self.fabric.auto_complete else "manual"}

    def local_info(self) -> bytes:
        return b""

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.fabric.register(self._session, regions)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        self.fabric.deregister(self._session, regions)

    def reach(self, peer: str, timeout: float) -> None:
        if (why := self.fabric.reachable(peer)) is not None:
            raise EngineError(why)

    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None:
        self.fabric.handshake()
        if (why := self.fabric.reachable(peer)) is not None:
            raise EngineError(why)
        self.fabric.connects.append((self._session, peer))
        self._connected.add(peer)

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        if peer not in self._connected or not self.fabric.gate.enter():
            return None  # the gate: a handshake may hold the engine mutex
        try:
            return self.submit_write(peer, blocks)
        finally:
            self.fabric.gate.leave()

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        if self.closed:
            raise EngineError("memory engine closed")
        fabric = self.fabric
        fabric.take_mutex(f"submit to {peer}")
        try:
            fabric.check_source(self._session, blocks)
            handle = TransferHandle(token=None, peer=peer, entries=len(blocks), nbytes=int(blocks.nbytes))
            w = fabric.post(self._session, peer, blocks, handle)
        finally:
            fabric.mutex.release()
        handle.token = w.wid
        handle.landed = w.outcome is not WriteOutcome.PENDING
        self._writes[w.wid] = w
        return handle

    def check(self, handle: TransferHandle) -> EngineStatus:
        handle.ensure_pending()
        w = self._writes[handle.token]
        fabric = self.fabric
        fabric.advance(w)
        if w.outcome is WriteOutcome.PENDING:
            if w.failed_entries:
                handle.doom(f"memory write {w.wid}: an entry failed (the others still run)")
            elif fabric.clock() >= w.posted_at + fabric.engine_timeout_s:
                handle.doom(f"memory write {w.wid}: engine timeout (still in flight)")
            return EngineStatus.PENDING
        del self._writes[handle.token]
        if w.outcome is WriteOutcome.DONE:
            return handle.finish(EngineStatus.DONE)
        return handle.finish(EngineStatus.FAILED, handle.doomed or f"memory write {w.wid} {w.outcome}: {w.reason}")

    def abandon(self, handle: TransferHandle) -> None:
        w = self._writes.pop(handle.token, None)
        if w is not None:
            w.abandoned = True
        super().abandon(handle)

    def forget_peer(self, peer: str) -> None:
        return None  # nothing cached per peer but the handshake, which a new connect repeats at no cost

    def close(self) -> None:
        self.closed = True
        self.fabric.leave(self._session)


def engine_from_config(config: TransferConfig) -> MemoryEngine:
    """The factory behind ``TransferConfig(engine="memory")``: an engine on the current fabric."""
    return MemoryEngine(current_fabric())
