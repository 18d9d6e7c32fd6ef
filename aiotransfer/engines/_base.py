"""The engine contract.

An engine adapter is a *synchronous* object wrapping one vendor transfer library. The async layers
(:mod:`aiotransfer._offload`, :mod:`aiotransfer._poller`) decide which thread calls what; adapters only
promise, method by method, whether a call blocks, spins or is cheap. The primitives:

* ``register`` / ``deregister``      -- make local memory addressable by peers (cheap, may hold the GIL)
* ``local_info``                     -- bytes a peer needs to reach us (NIXL agent metadata; empty for Mooncake)
* ``reach``                          -- bounded first contact with a peer that takes no engine lock (any thread)
* ``connect``                        -- blocking handshake with a peer; called on the engine's driver thread
* ``submit_write``                   -- post a batch of (src, dst, length) writes; returns a one-shot handle
* ``check``                          -- non-blocking status of a handle (cheap enough for the event loop; it
                                        never waits for a lock another call may hold)
* ``abandon``                        -- give up a handle the engine never ended, once its bound has passed
* ``close``                          -- tear down

Besides the primitives, each engine declares what the core needs to know about it, with defaults in one
place (:class:`EngineBase`; an adapter that declares every member itself need not inherit it):

* ``traits``                         -- :class:`EngineTraits`: inline submit, quiet threads, staging constants
* ``probe_region``                   -- a registered byte peers may write to during ``connect`` (or None)
* ``credit_scope``                   -- the object whose per-peer in-flight entry limit writes share
* ``try_submit_inline``              -- post a small write from the event loop if that cannot wait, else None

Terminal means terminal. ``check`` answers DONE or FAILED only when the engine can no longer touch the
write's memory; an engine answer that is not terminal in that sense (a timeout, "busy", an error while other
parts of the write may still run) leaves the handle PENDING and sets :attr:`TransferHandle.doomed`: the
write will not succeed, the caller learns it at once, and the memory stays pinned until a terminal answer
(or the release quarantine). docs/engines.md lists each engine's answers with their sources.

A :class:`TransferHandle` is consumed exactly once: after ``check`` returned a terminal status the adapter
has already released the native handle, and any further query raises instead of touching freed memory
(Mooncake batch ids are raw pointers; a second query is a use-after-free).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .._plan import Blocks
from ..errors import EngineError

__all__ = [
    "EngineBase",
    "EngineStatus",
    "EngineTraits",
    "MemoryRegion",
    "TransferEngine",
    "TransferHandle",
]


class EngineStatus(enum.Enum):
    """Status of a posted transfer, translated from each vendor's codes/strings inside the adapter.

    DONE and FAILED are terminal: the engine can no longer read the write's source or write its
    destination through this handle. Everything else is PENDING (see :attr:`TransferHandle.doomed`)."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self is not EngineStatus.PENDING


@dataclass(frozen=True)
class MemoryRegion:
    """A span of local memory to register with the engine."""

    ptr: int
    nbytes: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.ptr <= 0 or self.nbytes < 0:
            raise ValueError(f"invalid memory region ptr={self.ptr:#x} nbytes={self.nbytes}")

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes


@dataclass(eq=False)
class TransferHandle:
    """A one-shot token for one posted batch. Only the adapter that created it may interpret ``token``."""

    token: Any
    peer: str
    entries: int
    nbytes: int
    status: EngineStatus = EngineStatus.PENDING
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    doomed: str | None = None
    """Why the write will not succeed, although the engine may still touch its memory (a timeout that is not
    terminal, one entry failed while others run, an error the engine reports before it has quiesced): set
    by the adapter while ``check`` still answers PENDING. The poll loop fails the write at once with this
    reason and keeps the handle, and every hold on its memory, until ``check`` answers terminally, or until
    the release quarantine has passed (then :meth:`TransferEngine.abandon`, which ends it only if the engine
    lets go of its memory)."""
    inline: bool = False
    """Posted from the event loop (``try_submit_inline``), not by the driver thread (set by the poll loop)."""
    landed: bool = False
    """The engine reported the write complete when it was posted (NIXL copies inline over shared memory): the
    poll loop asks ``check`` right away instead of on its next round, so the completion and a ``Success``
    waiting on it go out in the same step as the submission. Still asked through ``check``, which releases
    the native handle."""
    growing: bool = False
    """Set by the poll loop while later slices of the same write may still join this handle
    (:meth:`TransferEngine.try_extend_inline`): ``check`` answers PENDING, even once every entry posted so
    far has ended, until the poll loop clears it."""

    @property
    def consumed(self) -> bool:
        return self.status.is_terminal

    def finish(self, status: EngineStatus, error: str | None = None) -> EngineStatus:
        """Mark terminal; called by adapters once the native handle has been released."""
        if self.status.is_terminal:
            raise EngineError(f"transfer handle {self!r} already consumed")
        self.status = status
        self.error = error
        return status

    def doom(self, reason: str) -> None:
        """Record the first reason the write will not succeed (the handle stays PENDING)."""
        if self.doomed is None:
            self.doomed = reason

    def ensure_pending(self) -> None:
        if self.status.is_terminal:
            raise EngineError("transfer handle already consumed; it must not be queried again")

    def __repr__(self) -> str:
        return (
            f"<TransferHandle peer={self.peer} entries={self.entries} bytes={self.nbytes} {self.status.value}"
            f"{' doomed' if self.doomed and not self.status.is_terminal else ''}>"
        )


@dataclass(frozen=True)
class EngineTraits:
    """What the core needs to know about an engine to drive it well; read as ``engine.traits.<field>``.

    The defaults describe a cautious engine: its threads may busy-poll, a failed write leaves nothing in
    flight, and its staging constants are Mooncake TCP's (measured). Whether a write may be posted from the
    event loop is not a trait but a question asked per write (``try_submit_inline``): only the adapter knows
    whether its locks are free right now.
    """

    quiet_threads: bool = False
    """The engine's own threads block while idle: after a ``Success`` the loop may yield its CPU
    (``TransferConfig.yield_after_notify``), and ``engine_threads="background"`` may put them at idle
    priority. Never set it for an engine whose threads busy-poll."""
    entry_cost_s: float = 30e-6
    """Cost of one transfer entry whatever its size, in seconds: a constant of the staging cost model."""
    bandwidth_bps: float = 2e9
    """Throughput of one peer connection in bytes per second: the other constant of the staging cost model."""
    inline_slice: int = 0
    """With a value, writes of more entries are posted in slices of this many entries, each offered to
    ``try_submit_inline`` in turn, the loop yielding between them: for an engine whose native post is one call
    per entry (Mooncake), where a large write handed to the driver thread would take the GIL back once per
    entry. The slices after the first are offered to ``try_extend_inline``, to join the first one's handle.
    0: a write is one post."""
    landing_grace_s: float = 0.0
    """How long, once the destination runs, bytes of a write the engine ended FAILED may still be applied there:
    a FAILED answer proves the source quiesced, not that nothing already sent is still in the network
    (Mooncake TCP drops the connection of a write whose acknowledgement is late; what the kernel had already
    sent is still read and applied by the peer when it runs again). A decode keeps the pages of a room whose
    writes failed this long after the prefill's drain acknowledgement arrives."""

    def __post_init__(self) -> None:
        if self.entry_cost_s < 0 or self.bandwidth_bps <= 0 or self.landing_grace_s < 0 or self.inline_slice < 0:
            raise ValueError(
                f"invalid engine traits entry_cost_s={self.entry_cost_s} bandwidth_bps={self.bandwidth_bps} "
                f"landing_grace_s={self.landing_grace_s}"
            )


@runtime_checkable
class TransferEngine(Protocol):
    """What every engine adapter provides (structural typing; adapters need not inherit).

    :class:`EngineBase` supplies the defaults of ``traits``, ``probe_region``, ``credit_scope``,
    ``try_submit_inline``, ``reach`` and ``abandon``.
    """

    name: str
    traits: EngineTraits
    """What the core needs to know about this engine (see :class:`EngineTraits`)."""

    @property
    def probe_region(self) -> MemoryRegion | None:
        """A small registered region whose address peers receive as ``probe_addr`` and may write one byte
        into during ``connect``; None when the engine needs none. (Read-only here, so an adapter may
        declare it as a plain attribute of type ``MemoryRegion``.)"""
        ...

    @property
    def credit_scope(self) -> object:
        """The object whose per-peer in-flight entry limit this engine's writes count against: every poller
        driving an engine with the same scope (on one event loop) shares one budget per peer."""
        ...

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        """Post a small write from the calling (event-loop) thread if that cannot wait (no lock that another
        call may hold across network I/O or a large copy); None, with nothing posted, sends the write
        through the engine's driver thread."""
        ...

    def try_extend_inline(self, handle: TransferHandle, blocks: Blocks) -> bool:
        """Post ``blocks`` from the event loop as more entries of ``handle``, a write this engine posted from
        the loop whose ``growing`` is set, under the same conditions as :meth:`try_submit_inline`; the handle's
        ``entries`` and ``nbytes`` grow by what was posted. False, with nothing posted, when that could wait
        or the engine cannot grow a handle: the slice is then posted as a write of its own. One handle polled
        for a whole write, instead of one per slice, is what makes slicing cheap (a streamed Mooncake layer of
        512 entries: 8 handles cost about 1 ms of loop CPU more than one, measured on 2 vCPUs)."""
        ...

    @property
    def session_id(self) -> str:
        """The address peers use to reach this engine (e.g. ``"10.0.0.5:15123"``)."""
        ...

    @property
    def transport(self) -> str:
        """The transport actually in use (``"tcp"``, ``"rdma"``, ``"ucx"``...), as the engine reports it."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def local_info(self) -> bytes: ...

    def register(self, regions: Sequence[MemoryRegion]) -> None: ...

    def deregister(self, regions: Sequence[MemoryRegion]) -> None: ...

    def reach(self, peer: str, timeout: float) -> None:
        """Blocking, bounded by ``timeout``, and without any lock of the engine: check that ``peer`` answers
        what the engine's handshake will ask of it (raise :class:`EngineError` if not), so that a peer that
        does not answer never reaches ``connect``, which may hold the engine's lock while it waits."""
        ...

    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None: ...

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle: ...

    def check(self, handle: TransferHandle) -> EngineStatus: ...

    def abandon(self, handle: TransferHandle) -> None:
        """Give up a handle whose write the engine never ended (its release quarantine has passed), without
        waiting. Consume ``handle`` as FAILED only when the engine can no longer read or write its memory (the
        native handle dropped or parked, nothing posted left running). Otherwise cut what the engine allows
        (Mooncake over TCP: its connections to the peer) and leave the handle PENDING: the poll loop keeps its
        memory, polls it on, and calls ``abandon`` again every :data:`aiotransfer._expiry.RECUT_S` until
        ``check`` answers terminally. Called on the engine's driver thread (it may take the engine's lock);
        the handle is not polled meanwhile."""
        ...

    def forget_peer(self, peer: str) -> None: ...

    def close(self) -> None: ...


class EngineBase:
    """The defaults of the optional engine members, in one place; adapters and fakes inherit them.

    Override ``traits`` (a class attribute, or an instance attribute set in ``__init__`` when a measured
    value depends on the configuration), ``probe_region``, ``credit_scope``, ``try_submit_inline``,
    ``reach`` or ``abandon`` as the engine needs.
    """

    traits: EngineTraits = EngineTraits()
    probe_region: MemoryRegion | None = None

    @property
    def credit_scope(self) -> object:
        """Default: the adapter itself (its limits are its own)."""
        return self

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        """Default: never inline; every write goes through the engine's driver thread."""
        return None

    def try_extend_inline(self, handle: TransferHandle, blocks: Blocks) -> bool:
        """Default: a handle never grows; each slice is a write of its own."""
        return False

    def reach(self, peer: str, timeout: float) -> None:
        """Default: nothing to check before ``connect``."""
        return None

    def abandon(self, handle: TransferHandle) -> None:
        """Default: nothing native to drop; the handle ends FAILED."""
        if not handle.consumed:
            handle.finish(EngineStatus.FAILED, handle.doomed or "abandoned after the release quarantine")
