"""The engine contract.

An engine adapter is a *synchronous* object wrapping one vendor transfer library. The async layers
(:mod:`aiotransfer._offload`, :mod:`aiotransfer._poller`) decide which thread calls what; adapters only
promise, method by method, whether a call blocks, spins or is cheap. The primitives:

* ``register`` / ``deregister``      -- make local memory addressable by peers (cheap, may hold the GIL)
* ``local_info``                     -- bytes a peer needs to reach us (NIXL agent metadata; empty for Mooncake)
* ``connect``                        -- blocking first contact with a peer; always called off the loop, bounded
* ``submit_write``                   -- post a batch of (src, dst, length) writes; returns a one-shot handle
* ``check``                          -- non-blocking status of a POLL handle (cheap enough for the event loop)
* ``wait``                           -- blocking wait for a BLOCK handle, exactly once, on a waiter thread
* ``close``                          -- tear down

Besides the primitives, each engine declares what the core needs to know about it, with defaults in one
place (:class:`EngineBase`; an adapter that declares every member itself need not inherit it):

* ``traits``                         -- :class:`EngineTraits`: inline submit, quiet threads, staging constants
* ``probe_region``                   -- a registered byte peers may write to during ``connect`` (or None)
* ``credit_scope``                   -- the object whose per-peer in-flight entry limit writes share
* ``try_submit_inline``              -- post a small write from the event loop if that cannot wait, else None

A :class:`TransferHandle` is consumed exactly once: after ``check`` or ``wait`` returned a terminal
status the adapter has already released the native handle, and any further query raises instead of
touching freed memory (Mooncake batch ids are raw pointers; a second query is a use-after-free).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import EngineError
from ..plan import Blocks

__all__ = [
    "EngineBase",
    "EngineStatus",
    "EngineTraits",
    "MemoryRegion",
    "TransferEngine",
    "TransferHandle",
    "WaitMode",
]


class EngineStatus(enum.Enum):
    """Status of a posted transfer, translated from each vendor's codes/strings inside the adapter."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self is not EngineStatus.PENDING


class WaitMode(enum.Enum):
    """How completion of a handle is observed."""

    POLL = "poll"
    """``check()`` is non-blocking and cheap: the poll loop calls it from the event loop."""
    BLOCK = "block"
    """Only ``wait()`` works and it blocks (and may spin): one waiter thread calls it, exactly once."""


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
    mode: WaitMode
    peer: str
    entries: int
    nbytes: int
    status: EngineStatus = EngineStatus.PENDING
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    landed: bool = False
    """The engine reported the write complete when it was posted (NIXL copies inline over shared memory): the
    poll loop asks ``check`` right away instead of on its next round, so the completion and a ``Success``
    waiting on it go out in the same step as the submission. Still asked through ``check``, which releases
    the native handle."""

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

    def ensure_pending(self) -> None:
        if self.status.is_terminal:
            raise EngineError("transfer handle already consumed; it must not be queried again")

    def __repr__(self) -> str:
        return (
            f"<TransferHandle {self.mode.value} peer={self.peer} entries={self.entries} "
            f"bytes={self.nbytes} {self.status.value}>"
        )


@dataclass(frozen=True)
class EngineTraits:
    """What the core needs to know about an engine to drive it well; read as ``engine.traits.<field>``.

    The defaults describe a cautious engine: every submit goes through the executor, its threads may
    busy-poll, and its staging constants are Mooncake TCP's (measured).
    """

    cheap_submit: bool = False
    """``submit_write`` of a few entries only queues work: the poll loop calls it from the event loop instead
    of the executor, for writes of up to :attr:`inline_entries` entries."""
    inline_entries: int = 1
    """With :attr:`cheap_submit`, the most entries a write submitted from the event loop may have."""
    quiet_threads: bool = False
    """The engine's own threads block while idle: after a ``Success`` the loop may yield its CPU
    (``TransferConfig.yield_after_notify``), and ``engine_threads="background"`` may put them at idle
    priority. Never set it for an engine whose threads busy-poll."""
    entry_cost_s: float = 30e-6
    """Cost of one transfer entry whatever its size, in seconds: a constant of the staging cost model."""
    bandwidth_bps: float = 2e9
    """Throughput of one peer connection in bytes per second: the other constant of the staging cost model."""

    def __post_init__(self) -> None:
        if self.entry_cost_s < 0 or self.bandwidth_bps <= 0 or self.inline_entries < 0:
            raise ValueError(
                f"invalid engine traits entry_cost_s={self.entry_cost_s} bandwidth_bps={self.bandwidth_bps}"
            )


@runtime_checkable
class TransferEngine(Protocol):
    """What every engine adapter provides (structural typing; adapters need not inherit).

    :class:`EngineBase` supplies the defaults of ``traits``, ``probe_region``, ``credit_scope`` and
    ``try_submit_inline``.
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
        """Post a small write from the calling (event-loop) thread if that cannot wait (no lock held
        elsewhere, no copy of size); None, with nothing posted, sends the write through the executor."""
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

    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None: ...

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle: ...

    def check(self, handle: TransferHandle) -> EngineStatus: ...

    def wait(self, handle: TransferHandle, timeout: float) -> EngineStatus: ...

    def forget_peer(self, peer: str) -> None: ...

    def close(self) -> None: ...


class EngineBase:
    """The defaults of the optional engine members, in one place; adapters and fakes inherit them.

    Override ``traits`` (a class attribute, or an instance attribute set in ``__init__`` when a measured
    value depends on the configuration), ``probe_region``, ``credit_scope`` or ``try_submit_inline`` as
    the engine needs.
    """

    traits: EngineTraits = EngineTraits()
    probe_region: MemoryRegion | None = None

    @property
    def credit_scope(self) -> object:
        """Default: the adapter itself (its limits are its own)."""
        return self

    def try_submit_inline(self, peer: str, blocks: Blocks) -> TransferHandle | None:
        """Default: never inline; every write goes through the executor."""
        return None
