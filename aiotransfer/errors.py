"""The exception tree.

Everything aiotransfer raises on purpose derives from :class:`AiotransferError`::

    AiotransferError
    ├── ConfigError (ValueError)          bad configuration, unknown engine/protocol
    ├── InvalidArgument (ValueError)      bad indices, lengths, rooms, buffers: nothing was moved
    ├── EngineUnavailable (ImportError)   the engine's package is not installed / cannot load
    ├── EngineError                       the engine refused or failed an operation
    ├── TransferFailed                    a room failed; ``.reason`` says why (both sides learn it)
    ├── TransferTimeout (TimeoutError)    a bounded wait expired
    ├── PeerError (ConnectionError)       the peer is unreachable, dead or misbehaving
    │   └── IncompatiblePeer              the peer's geometry/protocol does not match ours
    ├── ProtocolError                     a control message could not be decoded or validated
    └── ClosedError                       the manager/sender/receiver was closed
"""

from __future__ import annotations

__all__ = [
    "AiotransferError",
    "ClosedError",
    "ConfigError",
    "EngineError",
    "EngineUnavailable",
    "IncompatiblePeer",
    "InvalidArgument",
    "PeerError",
    "ProtocolError",
    "TransferFailed",
    "TransferTimeout",
]


class AiotransferError(Exception):
    """Root of every exception aiotransfer raises on purpose."""


class ConfigError(AiotransferError, ValueError):
    """The configuration is invalid (unknown engine, protocol, bad limits...)."""


class InvalidArgument(AiotransferError, ValueError):
    """An argument was rejected before any byte moved (indices, lengths, rooms, buffers)."""


class EngineUnavailable(AiotransferError, ImportError):
    """The engine's Python package is missing or cannot be loaded; the message says what to install."""


class EngineError(AiotransferError):
    """The transfer engine refused or failed an operation."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class TransferFailed(AiotransferError):
    """A room failed. ``reason`` is a human-readable cause, also sent to the other side."""

    def __init__(self, reason: str, *, room: int | None = None) -> None:
        self.reason = reason
        self.room = room
        prefix = f"room {room}: " if room is not None else ""
        super().__init__(prefix + reason)


class TransferTimeout(AiotransferError, TimeoutError):
    """A bounded wait expired (handshake, readiness, transfer or completion).

    ``room`` and ``peer`` say which room and which peer endpoint the wait concerned, where known."""

    def __init__(self, message: str, *, room: int | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.room = room
        self.peer = peer


class PeerError(AiotransferError, ConnectionError):
    """The peer is unreachable, dead, or sent something we refuse.

    ``room`` and ``peer`` say which room and which peer endpoint the error concerns, where known."""

    def __init__(self, message: str, *, room: int | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.room = room
        self.peer = peer


class IncompatiblePeer(PeerError):
    """The peer's protocol version or KV geometry does not match ours; refused at registration."""


class ProtocolError(AiotransferError):
    """A control message could not be decoded or failed validation."""


class ClosedError(AiotransferError):
    """The object was used after ``aclose()``."""
