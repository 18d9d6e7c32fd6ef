"""The in-memory fabric: what the memory engines of one process share, and what a test controls.

A `MemoryFabric` holds the engines that joined it, the host memory each registered, and every write
ever posted (a `Write`). A write's bytes are copied (``ctypes.memmove``) from the poster's registered
memory into the peer's when the write *lands*: by itself after `MemoryFabric.delay` in the default
auto mode, or when the test says so (`MemoryFabric.complete`) in manual mode.

The engine answers as the real engines do (docs/engines.md, "What each engine answer means"), so a scheduler
tested on it meets the same cases as in production:

* **A timeout is not an end.** A write still pending ``engine_timeout_s`` after its post is doomed (the poll
  loop fails it at once) but stays live, holding its memory, until it lands or is ended.
* **Late completion.** A doomed write can still complete (a stopped peer resumed). A write never ended is
  what NIXL does after an error: only the library's release quarantine ends it.
* **Partial failure.** One entry of a write can fail while the others still run
  (`MemoryFabric.fail_entry`): the handle is doomed at once and ends FAILED once the write ends.
* **A failed write's bytes may still land** for ``landing_grace_s`` after it ended FAILED
  (`MemoryFabric.land_late`), as Mooncake's TCP transport applies what it had sent before it closed
  the lane.
* **A submit waits while a handshake holds the engine.** ``connect`` takes the engine mutex (one per fabric,
  as Mooncake's is one per process) for as long as `MemoryFabric.hang_handshakes` keeps it hanging;
  every submit takes the same mutex.

A session that died (`MemoryFabric.kill`) lands nothing any more: its writes are void, and writes to
it land nowhere.

The methods under "the engines' side" are called by `aiotransfer.testing.MemoryEngine`; a test
has no need of them.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .._plan import Blocks
from ..engines._base import MemoryRegion, TransferEngine, TransferHandle
from ..engines._common import LoopGate
from ..errors import ConfigError, EngineError, TransferTimeout

__all__ = ["MemoryFabric", "Page", "Write", "WriteOutcome", "current_fabric", "default_fabric"]

Page = tuple[str, int, int]
"""(manager label, buffer index, page index) of one destination page (see `MemoryFabric.label`)."""


class WriteOutcome(str, Enum):
    """What became of a `Write`. A `str` enum: ``write.outcome == "done"`` holds as ``is WriteOutcome.DONE``."""

    PENDING = "pending"
    """Not ended: it may still land."""
    DONE = "done"
    """Landed: every entry's bytes were copied."""
    FAILED = "failed"
    """Ended FAILED: nothing landed, unless the fabric's ``landing_grace_s`` lets bytes it had sent land late."""
    VOID = "void"
    """A party died (`MemoryFabric.kill`): nothing of it lands any more."""

    def __str__(self) -> str:
        return self.value



@dataclass(frozen=True)
class _PagedBuffer:
    ptr: int
    nbytes: int
    item_len: int

    def pages(self, addr: int, length: int) -> range | None:
        if not (self.ptr <= addr and addr + length <= self.ptr + self.nbytes):
            return None
        first = (addr - self.ptr) // self.item_len
        last = (addr + max(length, 1) - 1 - self.ptr) // self.item_len
        return range(first, last + 1)


@dataclass(eq=False)
class Write:
    """One posted batch: where it goes, what became of it, and who owned its pages while it could land."""

    wid: int
    """Its number in the fabric, in posting order."""
    src: str
    """Session that posted it."""
    dst: str
    """Session it writes into."""
    entries: list[tuple[int, int, int]]
    """(source address, destination address, length) of every entry."""
    pages: list[Page]
    """Destination KV pages, for a destination named with `MemoryFabric.label` (else none)."""
    posted_at: float
    """When it was posted (fabric clock)."""
    handle: TransferHandle
    """The engine's handle for it (the library polls it)."""
    owners_at_submit: list[Any]
    """The owner of each page in `pages` when it was posted (`MemoryFabric.owner`)."""
    due: float | None = None
    """When it lands by itself (auto mode); None in manual mode."""
    failure: str | None = None
    """Set when the write is to end FAILED, landing nothing, when it would have landed
    (`MemoryFabric.fail_next`)."""
    failed_entries: set[int] = field(default_factory=set)
    """Entries that failed while the others ran (`MemoryFabric.fail_entry`): not copied on landing."""
    owners_seen: list[list[Any]] = field(default_factory=list)
    """The owners of `pages` recorded at every landing and observation while the write was live."""
    outcome: WriteOutcome = WriteOutcome.PENDING
    """`WriteOutcome.PENDING`, `DONE`, `FAILED` or `VOID` (a party died)."""
    reason: str | None = None
    """Why it ended FAILED or void."""
    ended_at: float | None = None
    """When the engine ended it (fabric clock)."""
    landed_bytes: int = 0
    """Bytes copied into the destination so far."""
    in_network: dict[int, bytes] = field(default_factory=dict)
    """Entry -> its bytes as read from the source before the write ended FAILED (with a landing grace): what
    `MemoryFabric.land_late` applies. The source is never read again after FAILED."""
    abandoned: bool = False
    """Its poster gave it up after the release quarantine (``abandon``): beyond what the library promises."""

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.entries)

    @property
    def entry_failed(self) -> bool:
        """An entry failed while the others ran."""
        return bool(self.failed_entries)

    def live(self, now: float, grace: float) -> bool:
        """The engine may still write this batch's bytes: it has not ended, or it failed less than ``grace``
        ago (bytes already sent may still be applied)."""
        if self.outcome is WriteOutcome.PENDING:
            return True
        return self.outcome is WriteOutcome.FAILED and self.ended_at is not None and now < self.ended_at + grace

    def __repr__(self) -> str:
        return (f"<Write {self.wid} {self.src} -> {self.dst} entries={len(self.entries)} bytes={self.nbytes} "
                f"{self.outcome}>")


@dataclass
class _Injection:
    count: int
    to: str | None
    reason: str


class _Regions:
    """One engine's registered regions, found by address in O(log n): a write's every entry is checked."""

    def __init__(self) -> None:
        self.items: list[MemoryRegion] = []
        self._by_ptr: list[MemoryRegion] | None = None
        self._ptrs: list[int] = []

    def extend(self, regions: Iterable[MemoryRegion]) -> None:
        self.items.extend(regions)
        self._by_ptr = None

    def discard(self, region: MemoryRegion) -> None:
        if region in self.items:
            self.items.remove(region)
            self._by_ptr = None

    def covers(self, addr: int, length: int) -> bool:
        """Whether one region holds ``[addr, addr + length)``."""
        if self._by_ptr is None:
            self._by_ptr = sorted(self.items, key=lambda r: r.ptr)
            self._ptrs = [r.ptr for r in self._by_ptr]
        i = bisect_right(self._ptrs, addr) - 1
        if i >= 0 and addr + length <= self._by_ptr[i].end:
            return True
        # overlapping regions: one that starts earlier may still hold it
        return any(r.ptr <= addr and addr + length <= r.end for r in self._by_ptr[:max(i, 0)])


_NONE = _Regions()
"""The regions of an engine that left the fabric: none."""


class MemoryFabric:
    """What the memory engines of one process share, and the test's handle on their writes.

    Parameters:
        auto_complete: Writes land by themselves, ``delay`` seconds after their post, and end DONE (the
            default: a scheduler's test needs no stepping). ``False``: every write stays pending until the
            test ends it (`complete`, `fail`), to order events exactly. May be changed at any time.
        delay: Seconds between a write's post and its landing in auto mode (0: it lands inside the post).
        clock: Seconds, for ``delay``, ``engine_timeout_s`` and ``landing_grace_s`` (default
            ``time.monotonic``; a test that moves time itself passes its own).
        engine_timeout_s: A write still pending this long after its post is doomed: it fails in the library at
            once, while its memory stays pinned until it lands or is ended (a timeout is not an end).
        landing_grace_s: How long a write that ended FAILED may still land (`land_late`); the engines
            declare it as ``traits.landing_grace_s``, and a decode keeps a failed room's pages this long.

    Engines made by ``TransferConfig(engine="memory")`` join `current_fabric`: the fabric of the
    innermost ``with fabric:`` block, else the process-wide `default_fabric`.
    """

    def __init__(
        self,
        *,
        auto_complete: bool = True,
        delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        engine_timeout_s: float = 30.0,
        landing_grace_s: float = 0.0,
    ) -> None:
        if delay < 0 or engine_timeout_s <= 0 or landing_grace_s < 0:
            raise ConfigError(
                f"need delay >= 0, engine_timeout_s > 0 and landing_grace_s >= 0 (got {delay}, {engine_timeout_s}, "
                f"{landing_grace_s})"
            )
        self.auto_complete = auto_complete
        self.delay = delay
        self.clock = clock
        self.engine_timeout_s = engine_timeout_s
        self.landing_grace_s = landing_grace_s
        self.engines: dict[str, TransferEngine] = {}
        """Session id -> the engine behind it."""
        self.dead: set[str] = set()
        """Sessions killed (`kill`)."""
        self.writes: list[Write] = []
        """Every write posted, in order."""
        self.owner: Callable[[Page], Any] = lambda page: None
        """Which room owns a destination page right now (None: free): the test's page allocator, for tests
        that check no write lands in a page after it changed hands (see `label`, `observe`)."""
        self.connects: list[tuple[str, str]] = []
        """(session, peer) of every handshake that succeeded."""
        self.mutex = threading.Lock()
        """The engine-wide mutex: held by ``connect`` across the handshake, taken by every submit."""
        self.loop_thread: int | None = None
        """The event loop's thread id, when the test wants to catch a submit that would block the loop."""
        self.loop_waits: list[str] = []
        """Submits made on `loop_thread` while a handshake held `mutex` (each would have blocked
        the event loop on a real engine), refused."""
        self.gate = LoopGate()
        """The gate ``try_submit_inline`` honours (the Mooncake adapter's own)."""
        self._regions: dict[str, _Regions] = {}
        self._labels: dict[str, tuple[str, list[_PagedBuffer]]] = {}
        self._injections: list[_Injection] = []
        self._lock = threading.RLock()
        self._hang = threading.Event()
        self._hang.set()
        self._ids = itertools.count()

    def __repr__(self) -> str:
        mode = "auto" if self.auto_complete else "manual"
        return f"<MemoryFabric {mode} engines={len(self.engines)} writes={len(self.writes)} pending={len(self.pending())}>"

    # -- which fabric engine="memory" joins ---------------------------------------------------------------
    def __enter__(self) -> MemoryFabric:
        """Make this the fabric that engines created with ``engine="memory"`` join, until the block ends."""
        with _CURRENT_LOCK:
            _CURRENT.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _CURRENT_LOCK:
            for i in range(len(_CURRENT) - 1, -1, -1):
                if _CURRENT[i] is self:
                    del _CURRENT[i]
                    break
        self.hang_handshakes(False)  # no thread stays parked in a handshake past the test

    async def __aenter__(self) -> MemoryFabric:
        """As ``with fabric:``, for one ``async with`` together with the managers."""
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    # -- looking ------------------------------------------------------------------------------------
    def pending(self) -> list[Write]:
        """Writes the engine has not ended (those the test can complete or fail), oldest first."""
        with self._lock:
            return [w for w in self.writes if w.outcome is WriteOutcome.PENDING]

    def live(self) -> list[Write]:
        """Writes whose bytes may still land: pending, or failed less than ``landing_grace_s`` ago."""
        now = self.clock()
        with self._lock:
            return [w for w in self.writes if w.live(now, self.landing_grace_s)]

    async def wait_for_writes(self, count: int = 1, *, timeout: float = 5.0) -> list[Write]:
        """Wait until at least ``count`` writes are pending, and return the pending writes.

        Raises:
            TransferTimeout: fewer were pending after ``timeout`` seconds (wall clock).
        """
        deadline = time.monotonic() + timeout
        while len(found := self.pending()) < count:
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"{len(found)} of {count} writes pending after {timeout} s")
            await asyncio.sleep(0.001)
        return found

    @property
    def handshakes(self) -> int:
        """Handshakes in progress or about to start."""
        return self.gate.handshakes

    # -- steering ---------------------------------------------------------------------------------------
    def complete(self, write: Write) -> None:
        """``write`` lands now, every entry that did not fail (also after it was doomed): DONE at the next
        check, or FAILED if an entry failed or a failure was injected into it. No effect once it ended."""
        with self._lock:
            if write.outcome is not WriteOutcome.PENDING:
                return
            if write.failure is not None:
                self._end(write, WriteOutcome.FAILED, write.failure)
                return
            self._land(write, skip=write.failed_entries)
            if write.failed_entries:
                self._send(write, sorted(write.failed_entries))
                self._end(write, WriteOutcome.FAILED, f"entries {sorted(write.failed_entries)} failed")
            else:
                self._end(write, WriteOutcome.DONE)

    def complete_all(self) -> int:
        """`complete` every pending write; returns how many there were."""
        pending = self.pending()
        for w in pending:
            self.complete(w)
        return len(pending)

    def fail(self, write: Write, reason: str = "injected failure") -> None:
        """``write`` ends FAILED without landing; the bytes it had read from the source may still land for
        ``landing_grace_s`` (`land_late`). No effect once it ended."""
        with self._lock:
            if write.outcome is WriteOutcome.PENDING:
                self._send(write, range(len(write.entries)))
                self._end(write, WriteOutcome.FAILED, reason)

    def fail_entry(self, write: Write, entry: int = 0) -> None:
        """Entry ``entry`` of ``write`` fails while the others still run: the handle is doomed at once (the
        library fails the write) and ends FAILED when the write lands or is ended."""
        with self._lock:
            if write.outcome is WriteOutcome.PENDING:
                if not 0 <= entry < len(write.entries):
                    raise IndexError(f"{write!r} has no entry {entry}")
                write.failed_entries.add(entry)

    def fail_next(self, count: int = 1, *, to: str | None = None, reason: str = "injected failure") -> None:
        """The next ``count`` writes posted (into session ``to``, or anywhere) end FAILED, landing nothing,
        when they would have landed (in auto mode after ``delay``; in manual mode at `complete`)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._lock:
            self._injections.append(_Injection(count, to, reason))

    def land_late(self, write: Write) -> None:
        """Bytes of a write that ended FAILED, as it had read them from the source, are applied now, if it is
        still live (within ``landing_grace_s``). On a write still pending, the source is copied as it is now."""
        with self._lock:
            if not write.live(self.clock(), self.landing_grace_s):
                return
            if write.outcome is WriteOutcome.PENDING:
                self._land(write, skip=set())
                return
            write.owners_seen.append([self.owner(p) for p in write.pages])
            dst_regions = self._regions.get(write.dst, _NONE)
            for i, data in sorted(write.in_network.items()):
                _, d, n = write.entries[i]
                if write.dst not in self.dead and dst_regions.covers(d, n):
                    ctypes.memmove(d, data, n)
                    write.landed_bytes += n
            write.in_network.clear()

    def kill(self, session: str) -> None:
        """The process behind ``session`` died: its writes, and writes into it, can never land now; a
        handshake with it fails."""
        with self._lock:
            self.dead.add(session)
            for w in self.writes:
                if session not in (w.src, w.dst):
                    continue
                if w.outcome is WriteOutcome.PENDING:
                    self._end(w, WriteOutcome.VOID, f"{session} died")
                elif w.outcome is WriteOutcome.FAILED:
                    w.outcome = WriteOutcome.VOID
                    w.in_network.clear()

    def hang_handshakes(self, hang: bool = True) -> None:
        """While set, a ``connect`` holds the engine mutex until it is cleared (a peer that does not answer
        the engine's metadata request), and submits wait behind it."""
        if hang:
            self._hang.clear()
        else:
            self._hang.set()

    # -- page ownership (tests of the page lifecycle) ---------------------------------------------------------
    def label(self, session: str, name: str, kv: Sequence[Any]) -> None:
        """Name the manager behind ``session`` and give its KV buffers (objects with ``ptr``, ``nbytes`` and
        ``item_len``, e.g. ``manager.args.kv``): the pages of writes into it are then recorded in
        `Write.pages` as (``name``, buffer index, page index)."""
        self._labels[session] = (name, [_PagedBuffer(b.ptr, b.nbytes, b.item_len) for b in kv])

    def observe(self) -> None:
        """Record the current `owner` of every page each live write covers (in `Write.owners_seen`)."""
        for w in self.live():
            w.owners_seen.append([self.owner(p) for p in w.pages])

    # -- the engines' side -------------------------------------------------------------------------------
    def join(self, engine: TransferEngine) -> None:
        with self._lock:
            self.engines[engine.session_id] = engine
            self._regions[engine.session_id] = _Regions()

    def leave(self, session: str) -> None:
        """The engine closed: nothing lands in or from its memory any more."""
        with self._lock:
            self._regions.pop(session, None)

    def register(self, session: str, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            if r.device != "cpu":
                raise EngineError(f"the memory engine copies host memory only; {r} is on {r.device}")
        with self._lock:
            self._regions.setdefault(session, _Regions()).extend(regions)

    def deregister(self, session: str, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            held = self._regions.get(session, _NONE)
            for r in regions:
                held.discard(r)

    def reachable(self, peer: str) -> str | None:
        """Why a handshake with ``peer`` cannot succeed, or None."""
        if peer in self.dead:
            return f"memory engine {peer} died"
        if peer not in self.engines:
            return (f"no memory engine {peer} on this fabric: engine='memory' connects managers of one process "
                    "that share a MemoryFabric")
        return None

    def handshake(self) -> None:
        """The engine's handshake: the gate closed to the loop's submits, then under the mutex for as long as
        the test keeps it hanging (as the Mooncake adapter's gate and the engine's mutex do)."""
        with self.gate.handshake(), self.mutex:
            self._hang.wait()

    def take_mutex(self, what: str) -> None:
        """Take `mutex` for a submit; refuse (and record) a wait on `loop_thread`."""
        if self.mutex.acquire(blocking=False):
            return
        if threading.get_ident() == self.loop_thread:
            self.loop_waits.append(what)
            raise EngineError(f"{what} would wait on the engine mutex on the event loop")
        self.mutex.acquire()

    def check_source(self, session: str, blocks: Blocks) -> None:
        """Raise `EngineError` unless every entry's source lies in memory ``session`` registered."""
        with self._lock:
            regions = self._regions.get(session, _NONE)
            for s, n in zip(blocks.src.tolist(), blocks.length.tolist(), strict=True):
                if not regions.covers(s, n):
                    raise EngineError(f"source address {s:#x} (+{n}) is not inside any registered region")

    def post(self, src: str, dst: str, blocks: Blocks, handle: TransferHandle) -> Write:
        """Record a write (void when a party died); in auto mode with no delay it lands at once."""
        entries = list(zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), strict=True))
        with self._lock:
            if dst not in self.dead:
                if dst not in self.engines:
                    raise EngineError(f"no memory engine {dst} on this fabric")
                regions = self._regions.get(dst, _NONE)
                for _, d, n in entries:
                    if not regions.covers(d, n):
                        raise EngineError(f"destination address {d:#x} (+{n}) is not registered by {dst}")
            pages = [p for _, d, n in entries for p in self._resolve(dst, d, n)]
            now = self.clock()
            w = Write(next(self._ids), src, dst, entries, pages, now, handle, [self.owner(p) for p in pages])
            w.failure = self._injected(dst)
            self.writes.append(w)
            if src in self.dead or dst in self.dead:
                self._end(w, WriteOutcome.VOID, "a party died")
            elif self.auto_complete:
                w.due = now + self.delay
                self.advance(w)
            return w

    def advance(self, write: Write) -> None:
        """Land ``write`` if auto mode is on and it is due."""
        if self.auto_complete and write.outcome is WriteOutcome.PENDING:
            due = write.due if write.due is not None else write.posted_at + self.delay
            if self.clock() >= due:
                self.complete(write)

    # -- inside -------------------------------------------------------------------------------------------
    def _injected(self, dst: str) -> str | None:
        for inj in self._injections:
            if inj.to is None or inj.to == dst:
                inj.count -= 1
                if inj.count == 0:
                    self._injections.remove(inj)
                return inj.reason
        return None

    def _resolve(self, session: str, addr: int, length: int) -> list[Page]:
        named = self._labels.get(session)
        if named is None:
            return []
        name, bufs = named
        for i, b in enumerate(bufs):
            pages = b.pages(addr, length)
            if pages is not None:
                return [(name, i, p) for p in pages]
        return []

    def _land(self, write: Write, skip: set[int]) -> None:
        """Copy the entries not in ``skip`` whose memory is still registered on both sides (under the lock, so
        no deregistration runs meanwhile), and record the pages' owners."""
        write.owners_seen.append([self.owner(p) for p in write.pages])
        if write.src in self.dead or write.dst in self.dead:
            return
        src_regions, dst_regions = self._regions.get(write.src, _NONE), self._regions.get(write.dst, _NONE)
        for i, (s, d, n) in enumerate(write.entries):
            if i in skip or n == 0:
                continue
            if src_regions.covers(s, n) and dst_regions.covers(d, n):
                ctypes.memmove(d, s, n)
                write.landed_bytes += n

    def _send(self, write: Write, entries: Sequence[int] | range) -> None:
        """Read ``entries`` from the source now, for a write about to end FAILED whose bytes may still land."""
        if self.landing_grace_s <= 0 or write.src in self.dead:
            return
        src_regions = self._regions.get(write.src, _NONE)
        for i in entries:
            s, _, n = write.entries[i]
            if n and src_regions.covers(s, n):
                write.in_network[i] = ctypes.string_at(s, n)

    def _end(self, write: Write, outcome: WriteOutcome, reason: str | None = None) -> None:
        write.outcome = outcome
        write.reason = reason
        write.ended_at = self.clock()


_CURRENT: list[MemoryFabric] = []
_CURRENT_LOCK = threading.Lock()
_DEFAULT: list[MemoryFabric] = []


def default_fabric() -> MemoryFabric:
    """The process-wide fabric (auto mode, no delay) that ``engine="memory"`` engines join outside any
    ``with fabric:`` block."""
    with _CURRENT_LOCK:
        if not _DEFAULT:
            _DEFAULT.append(MemoryFabric())
        return _DEFAULT[0]


def current_fabric() -> MemoryFabric:
    """The fabric a new ``engine="memory"`` engine joins: the innermost ``with fabric:`` block's, else
    `default_fabric`."""
    with _CURRENT_LOCK:
        if _CURRENT:
            return _CURRENT[-1]
    return default_fabric()
