"""A fake transfer engine that answers as the real engines do, with completions, failures and clock the test
controls.

Every engine of one test shares a :class:`Fabric`: the sessions that exist, the memory each registered,
and every write ever posted. ``submit_write`` records the write (its entries resolved to destination
pages) and returns a handle that stays PENDING until the test ends it. What the real engines do, and the
fake therefore does too (docs/engines.md, "What each engine answer means"; each behaviour pinned against the
real engine by tests/test_engine_conformance.py):

* **A timeout is not an end.** A write still pending ``engine_timeout_s`` after it was posted is doomed but
  stays live: it may still land, until the test ends it. The fake models the union of what the engines do
  past their timeouts: Mooncake over TCP fails, at its status deadline, the entries of a write that were
  sent whole while the others run on (the handle is doomed, not over), and leaves an entry larger than the
  socket buffers in flight for as long as the peer is stopped; ``get_batch_transfer_status`` answers -1
  while the batch runs; over RDMA, ``transfer_check_status`` answers -2 for an overdue entry that still
  runs. (On TCP the deadline counts from when an entry was sent, not from its post.)
* **Late completion.** A doomed write can still complete (:meth:`Fabric.complete`): a stopped peer resumed.
  A write the test never ends is what NIXL does after an error (it never answers again): only the release
  quarantine ends it.
* **Partial failure.** One entry of a write can fail while the others still run (:meth:`Fabric.fail_entry`):
  the handle is doomed at once and ends FAILED only once every entry ended.
* **A failed write's bytes may still land.** A write that ended FAILED is live for ``landing_grace_s`` more
  (:meth:`Fabric.land_late` lands it within that time): what Mooncake's TCP transport had sent before it
  closed the lane is applied when the peer next runs. Every fake peer always runs, so the grace counts from
  the failure here.
* **A submit waits while a handshake holds the engine.** ``connect`` takes the engine's mutex (shared by
  every fake engine of a fabric, as Mooncake's is by a process) and holds it while the test keeps the
  handshake hanging (:meth:`Fabric.hang_handshakes`); ``submit_write`` takes the same mutex. A submit made
  on the event loop's thread that finds the mutex held is recorded in :attr:`Fabric.loop_waits` (the
  real engine would have blocked the loop) and refused. ``try_submit_inline`` declines while a handshake
  is in progress, and for a peer this engine has not connected to, as the Mooncake adapter does.

Nothing is copied: the test checks where writes go, not what they carry. The fabric knows which room owns
each destination page through ``owner`` (set by the test: its page allocator), records the owners when a
write is posted and each time :meth:`Fabric.observe` runs while it is live, and reports a write whose pages
changed hands or were released while it was live.

A session that died (:meth:`Fabric.kill`) lands nothing any more: its writes are void, and writes to it
land nowhere that matters.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiotransfer.engines._common import LoopGate
from aiotransfer.engines.base import EngineBase, EngineStatus, EngineTraits, MemoryRegion, TransferHandle
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
    """``pending``, ``done``, ``failed`` (by the test) or ``void`` (a party died)."""
    entry_failed: bool = False
    """One entry failed while the others run (:meth:`Fabric.fail_entry`)."""
    ended_at: float | None = None
    """When the engine ended it (fabric clock)."""
    abandoned: bool = False
    """Its poster gave it up after the release quarantine (``abandon``): beyond what the library promises."""

    def live(self, now: float, grace: float) -> bool:
        """The engine may still write this batch's bytes: it has not ended, or it failed less than ``grace``
        ago (bytes already sent may still be applied)."""
        if self.outcome == "pending":
            return True
        return self.outcome == "failed" and self.ended_at is not None and now < self.ended_at + grace


class Fabric:
    """What the fake engines of one test share (see the module docstring)."""

    def __init__(self, clock: Callable[[], float], engine_timeout_s: float = 5.0, landing_grace_s: float = 1.0) -> None:
        self.clock = clock
        self.engine_timeout_s = engine_timeout_s
        self.landing_grace_s = landing_grace_s
        self.engines: dict[str, FakeEngine] = {}
        self.labels: dict[str, tuple[str, list[_Buffer]]] = {}
        """Session -> (manager label, its KV buffers)."""
        self.dead: set[str] = set()
        self.writes: list[Write] = []
        self.owner: Callable[[Page], Any] = lambda page: None
        """Which room owns a destination page right now (None: free); set by the test."""
        self.connects: list[tuple[str, str]] = []
        self.mutex = threading.Lock()
        """The engine-wide mutex: taken by ``connect`` (across the handshake) and by every submit."""
        self.loop_thread: int | None = None
        """The event loop's thread id: a submit there must never wait for :attr:`mutex`."""
        self.loop_waits: list[str] = []
        """Submits made on the event loop while a handshake held the mutex (each would have blocked it)."""
        self.gate = LoopGate()
        """The gate ``try_submit_inline`` honours (the Mooncake adapter's own)."""
        self._hang = threading.Event()
        self._hang.set()
        self._ids = itertools.count()

    # -- the test's side ----------------------------------------------------------------------
    def label(self, session: str, name: str, kv: Sequence[Any]) -> None:
        """Name the manager behind ``session`` and give its KV buffers (``ptr``, ``nbytes``, ``item_len``)."""
        self.labels[session] = (name, [_Buffer(b.ptr, b.nbytes, b.item_len) for b in kv])

    def live(self) -> list[Write]:
        now = self.clock()
        return [w for w in self.writes if w.live(now, self.landing_grace_s)]

    def pending(self) -> list[Write]:
        """Writes the engine has not ended (the ones the test can complete or fail)."""
        return [w for w in self.writes if w.outcome == "pending"]

    def complete(self, write: Write) -> None:
        """The engine wrote every byte of ``write`` (also after it was doomed): DONE at the next check, or
        FAILED if one of its entries failed."""
        if write.outcome == "pending":
            self._land(write)
            self._end(write, "failed" if write.entry_failed else "done")

    def fail(self, write: Write) -> None:
        """The engine ends ``write`` FAILED; bytes it had sent may still land for ``landing_grace_s``."""
        if write.outcome == "pending":
            self._end(write, "failed")

    def fail_entry(self, write: Write) -> None:
        """One entry of ``write`` fails; the others still run (the handle is doomed, not ended)."""
        if write.outcome == "pending":
            write.entry_failed = True

    def land_late(self, write: Write) -> None:
        """Bytes of a write that ended FAILED are applied now (only while it is still live)."""
        if write.live(self.clock(), self.landing_grace_s):
            self._land(write)

    def kill(self, session: str) -> None:
        """The process behind ``session`` died: its writes, and writes into it, can never land now."""
        self.dead.add(session)
        for w in self.writes:
            if w.outcome == "pending" and session in (w.src, w.dst):
                self._end(w, "void")
            elif w.outcome == "failed" and session in (w.src, w.dst):
                w.outcome = "void"

    def hang_handshakes(self, hang: bool) -> None:
        """While set, a ``connect`` holds the engine mutex until it is cleared (a peer that does not answer the
        engine's metadata request)."""
        if hang:
            self._hang.clear()
        else:
            self._hang.set()

    def observe(self) -> None:
        """Record the current owner of every page each live write covers."""
        for w in self.live():
            w.owners_seen.append([self.owner(p) for p in w.pages])

    def _land(self, write: Write) -> None:
        write.owners_seen.append([self.owner(p) for p in write.pages])

    def _end(self, write: Write, outcome: str) -> None:
        write.outcome = outcome
        write.ended_at = self.clock()

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
            self._end(w, "void")
        self.writes.append(w)
        return w

    def handshake(self) -> None:
        """The engine's handshake: the gate closed to the loop's submits, then under the mutex for as long as
        the test keeps it hanging (as the Mooncake adapter's gate and the engine's mutex do)."""
        with self.gate.handshake(), self.mutex:
            self._hang.wait()

    @property
    def handshakes(self) -> int:
        """Handshakes in progress or about to start."""
        return self.gate.handshakes

    def take_mutex(self, what: str) -> None:
        if self.mutex.acquire(blocking=False):
            return
        if threading.get_ident() == self.loop_thread:
            self.loop_waits.append(what)
            raise EngineError(f"{what} would wait on the engine mutex on the event loop")
        self.mutex.acquire()


class FakeEngine(EngineBase):
    """An engine adapter over a :class:`Fabric`. Calls are cheap; ``connect`` holds the engine mutex while
    the fabric keeps handshakes hanging. Submissions are posted from the event loop (``try_submit_inline``)
    unless a handshake is in progress, so the loop alone decides the order in which things happen."""

    name = "fake"
    traits = EngineTraits(quiet_threads=True, landing_grace_s=1.0)

    _sessions = itertools.count(1)

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self._session = f"fake-{next(self._sessions)}"
        self._scope = object()
        self.regions: list[MemoryRegion] = []
        self.closed = False
        self._writes: dict[int, Write] = {}
        self._connected: set[str] = set()
        self.traits = EngineTraits(quiet_threads=True, landing_grace_s=fabric.landing_grace_s)
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
        self.fabric.handshake()
        if peer in self.fabric.dead or peer not in self.fabric.engines:
            raise EngineError(f"no fake engine at {peer}")
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
            raise EngineError("fake engine closed")
        fabric = self.fabric
        fabric.take_mutex(f"submit to {peer}")
        try:
            for s in blocks.src:
                if not any(r.ptr <= int(s) < r.end for r in self.regions):
                    raise EngineError(f"source address {int(s):#x} is not registered")
            handle = TransferHandle(token=None, peer=peer, entries=len(blocks), nbytes=int(blocks.nbytes))
            w = fabric.post(self._session, peer, blocks, handle)
        finally:
            fabric.mutex.release()
        handle.token = w.wid
        self._writes[w.wid] = w
        return handle

    def check(self, handle: TransferHandle) -> EngineStatus:
        handle.ensure_pending()
        w = self._writes[handle.token]
        fabric = self.fabric
        if w.outcome == "pending":
            if w.entry_failed:
                handle.doom(f"fake write {w.wid}: an entry failed (the others still run)")
            elif fabric.clock() >= w.posted_at + fabric.engine_timeout_s:
                handle.doom(f"fake write {w.wid}: engine timeout (still in flight)")
            return EngineStatus.PENDING
        del self._writes[handle.token]
        if w.outcome == "done":
            return handle.finish(EngineStatus.DONE)
        return handle.finish(EngineStatus.FAILED, handle.doomed or f"fake write {w.wid} {w.outcome}")

    def abandon(self, handle: TransferHandle) -> None:
        w = self._writes.pop(handle.token, None)
        if w is not None:
            w.abandoned = True
        super().abandon(handle)

    def forget_peer(self, peer: str) -> None:
        return None

    def close(self) -> None:
        self.closed = True
