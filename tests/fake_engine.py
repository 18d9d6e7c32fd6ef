"""A fake transfer engine whose completions, failures and clock the test controls.

Every engine of one test shares a :class:`Fabric`: the sessions that exist, the memory each registered,
and every write ever posted. ``submit_write`` records the write (its entries resolved to destination
pages) and returns a POLL handle that stays PENDING until the test calls :meth:`Fabric.complete` or
:meth:`Fabric.fail`, or until ``engine_timeout_s`` of the fabric's clock has passed since it was posted
(then it fails in the engine, as a Mooncake write does). Nothing is copied: the test checks where writes
go, not what they carry.

The fabric knows which room owns each destination page through ``owner`` (set by the test: its page
allocator), records the owners when a write is posted and each time :meth:`Fabric.observe` runs while it
is live, and reports a write whose pages changed hands or were released while it was live.

A session that died (:meth:`Fabric.kill`) lands nothing any more: its writes are void, and writes to it
land nowhere that matters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiotransfer.engines.base import (
    EngineBase,
    EngineStatus,
    EngineTraits,
    MemoryRegion,
    TransferHandle,
    WaitMode,
)
from aiotransfer.errors import EngineError
from aiotransfer.plan import Blocks

__all__ = ["Fabric", "FakeEngine", "Page", "Write"]

Page = tuple[str, int, int]
"""(manager label, buffer index, page index) of one destination page."""


@dataclass(frozen=True)
class _Buffer:
    ptr: int
    nbytes: int
    item_len: int

    def pages(self, addr: int, length: int) -> range | None:
        if not (self.ptr <= addr and addr + length <= self.ptr + self.nbytes):
            return None
        first = (addr - self.ptr) // self.item_len
        last = (addr + max(length, 1) - 1 - self.ptr) // self.item_len
        return range(first, last + 1)


@dataclass
class Write:
    """One posted batch: where it goes, and who owned its pages while it could land."""

    wid: int
    src: str
    """Session that posted it."""
    dst: str
    """Session it writes into."""
    entries: list[tuple[int, int, int]]
    """(source address, destination address, length) of every entry."""
    pages: list[Page]
    """Destination KV pages (aux, state and staging entries resolve to none)."""
    posted_at: float
    handle: TransferHandle
    owners_at_submit: list[Any]
    owners_seen: list[list[Any]] = field(default_factory=list)
    """The owners recorded at every observation while the write was live."""
    outcome: str = "pending"
    """``pending``, ``done``, ``failed`` (by the test or the engine's timeout) or ``void`` (a party died)."""

    def live(self, now: float, timeout: float) -> bool:
        """The engine may still write this batch's bytes."""
        return self.outcome == "pending" and now < self.posted_at + timeout


class Fabric:
    """What the fake engines of one test share (see the module docstring)."""

    def __init__(self, clock: Callable[[], float], engine_timeout_s: float = 5.0) -> None:
        self.clock = clock
        self.engine_timeout_s = engine_timeout_s
        self.engines: dict[str, FakeEngine] = {}
        self.labels: dict[str, tuple[str, list[_Buffer]]] = {}
        """Session -> (manager label, its KV buffers)."""
        self.dead: set[str] = set()
        self.writes: list[Write] = []
        self.owner: Callable[[Page], Any] = lambda page: None
        """Which room owns a destination page right now (None: free); set by the test."""
        self.connects: list[tuple[str, str]] = []
        self._ids = itertools.count()

    # -- the test's side ----------------------------------------------------------------------
    def label(self, session: str, name: str, kv: Sequence[Any]) -> None:
        """Name the manager behind ``session`` and give its KV buffers (``ptr``, ``nbytes``, ``item_len``)."""
        self.labels[session] = (name, [_Buffer(b.ptr, b.nbytes, b.item_len) for b in kv])

    def live(self) -> list[Write]:
        now = self.clock()
        return [w for w in self.writes if w.live(now, self.engine_timeout_s)]

    def complete(self, write: Write) -> None:
        """The engine wrote every byte of ``write``: its status turns DONE at the next check."""
        if write.outcome == "pending":
            self._land(write)
            write.outcome = "done"

    def fail(self, write: Write) -> None:
        if write.outcome == "pending":
            write.outcome = "failed"

    def kill(self, session: str) -> None:
        """The process behind ``session`` died: its writes, and writes into it, can never land now."""
        self.dead.add(session)
        for w in self.writes:
            if w.outcome == "pending" and session in (w.src, w.dst):
                w.outcome = "void"

    def observe(self) -> None:
        """Record the current owner of every page each live write covers."""
        for w in self.live():
            w.owners_seen.append([self.owner(p) for p in w.pages])

    def _land(self, write: Write) -> None:
        write.owners_seen.append([self.owner(p) for p in write.pages])

    # -- the engines' side -------------------------------------------------------------------
    def resolve(self, session: str, addr: int, length: int) -> list[Page]:
        named = self.labels.get(session)
        if named is None:
            return []
        name, bufs = named
        for i, b in enumerate(bufs):
            pages = b.pages(addr, length)
            if pages is not None:
                return [(name, i, p) for p in pages]
        return []

    def post(self, src: str, dst: str, blocks: Blocks, handle: TransferHandle) -> Write:
        entries = [(int(s), int(d), int(n)) for s, d, n in zip(blocks.src, blocks.dst, blocks.length, strict=True)]
        pages = [p for _, d, n in entries for p in self.resolve(dst, d, n)]
        w = Write(next(self._ids), src, dst, entries, pages, self.clock(), handle, [self.owner(p) for p in pages])
        if src in self.dead or dst in self.dead:
            w.outcome = "void"
        self.writes.append(w)
        return w


class FakeEngine(EngineBase):
    """An engine adapter over a :class:`Fabric`. Every call is cheap and runs on the calling thread:
    submissions are posted from the event loop (``try_submit_inline``), so the loop alone decides the order
    in which things happen."""

    name = "fake"
    traits = EngineTraits(cheap_submit=True, quiet_threads=True)

    _sessions = itertools.count(1)

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self._session = f"fake-{next(self._sessions)}"
        self._scope = object()
        self.regions: list[MemoryRegion] = []
        self.closed = False
        self._writes: dict[int, Write] = {}
        fabric.engines[self._session] = self

    @property
    def credit_scope(self) -> object:
        return self._scope

    @property
    def session_id(self) -> str:
        return self._session

    @property
    def transport(self) -> str:
        return "fake"

    def describe(self) -> dict[str, Any]:
        return {"engine": "fake", "transport": "fake", "session_id": self._session}

    def local_info(self) -> bytes:
        return b""

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.regions.extend(regions)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            if r in self.regions:
                self.regions.remove(r)

    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None:
        if peer in self.fabric.dead or peer not in self.fabric.engines:
            raise EngineError(f"no fake engine at {peer}")
        self.fabric.connects.append((self._session, peer))

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        return self.submit_write(peer, blocks)

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        if self.closed:
            raise EngineError("fake engine closed")
        for s in blocks.src:
            if not any(r.ptr <= int(s) < r.end for r in self.regions):
                raise EngineError(f"source address {int(s):#x} is not registered")
        handle = TransferHandle(token=None, mode=WaitMode.POLL, peer=peer, entries=len(blocks),
                                nbytes=int(blocks.nbytes))
        w = self.fabric.post(self._session, peer, blocks, handle)
        handle.token = w.wid
        self._writes[w.wid] = w
        return handle

    def check(self, handle: TransferHandle) -> EngineStatus:
        handle.ensure_pending()
        w = self._writes[handle.token]
        fabric = self.fabric
        if w.outcome == "pending" and fabric.clock() >= w.posted_at + fabric.engine_timeout_s:
            w.outcome = "failed"
        if w.outcome == "pending":
            return EngineStatus.PENDING
        del self._writes[handle.token]
        if w.outcome == "done":
            return handle.finish(EngineStatus.DONE)
        return handle.finish(EngineStatus.FAILED, f"fake write {w.wid} {w.outcome}")

    def wait(self, handle: TransferHandle, timeout: float) -> EngineStatus:
        raise EngineError("the fake engine's handles are polled")

    def forget_peer(self, peer: str) -> None:
        return None

    def close(self) -> None:
        self.closed = True
