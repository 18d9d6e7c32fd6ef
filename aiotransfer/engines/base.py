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
    "EngineStatus",
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


@runtime_checkable
class TransferEngine(Protocol):
    """What every engine adapter provides (structural typing; adapters need not inherit)."""

    name: str

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
