"""Types of the public signatures: page indices, device work to wait for, and what ``stats()`` returns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias, TypedDict, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["DeviceWork", "LatencySummary", "ManagerStats", "PageIndices", "SupportsArray"]


class SupportsArray(Protocol):
    """An object NumPy reads as an array through ``__array__``: a CPU ``torch.Tensor``, for example."""

    def __array__(self) -> npt.NDArray[Any]: ...


PageIndices: TypeAlias = npt.NDArray[np.integer[Any]] | Sequence[int] | SupportsArray
"""Page (or slot) numbers: a 1-D NumPy integer array, a sequence of ints (a list, a tuple, a ``range``) or
an object NumPy reads as a 1-D integer array (a CPU ``torch.Tensor``). Values are non-negative and fit in
int64; anything else raises ``InvalidArgument``. An array is read without a copy where it can be."""


@runtime_checkable
class DeviceWork(Protocol):
    """Work queued on a device that a send waits for before it reads the pages: a ``torch.cuda.Event``
    recorded after the kernels that write them, or any object with the same ``query()``.

    ``query()`` answers at once whether the work is done; it is polled from the event loop and must not
    block.
    """

    def query(self) -> bool: ...


class LatencySummary(TypedDict):
    """One latency histogram of ``stats()["latency"]``; quantiles are bucket upper bounds, in seconds."""

    count: int
    mean_s: float
    p50_s: float
    p99_s: float


class _AlwaysPresent(TypedDict):
    senders_active: int
    receivers_active: int
    pending_requests: int
    tombstones: int
    decode_peers: int
    prefill_peers: int
    in_flight: int
    pinned_bytes: int
    engine_completed: int
    engine_failed: int
    engine_doomed: int
    engine_overdue: int
    engine_expired: int
    engine_held: int
    control_received: int
    control_sent: int
    control_dropped: dict[str, int]
    open_sockets: int
    sockets_opened: int
    dead_peers: int
    staging_bytes_in_use: int
    staging_requests_held: int
    rooms_awaiting_release: int
    pages_in_use: int
    bytes_in_use: int
    pages_awaiting_drain: int
    bytes_awaiting_drain: int
    pages_quarantined: int
    bytes_quarantined: int
    engine_holds_pending: int
    drains_acknowledged: int
    quarantines_expired: int
    peers_proven_gone: int
    rooms_refused_in_use: int
    freezes_settled: int
    latency: dict[str, LatencySummary]
    failures_by_reason: dict[str, int]


_Dropped = TypedDict(
    "_Dropped",
    {
        "dropped_bad-rank": int,
        "dropped_invalid-aux": int,
        "dropped_invalid-request": int,
        "dropped_invalid-staged": int,
        "dropped_invalid-staging-grant": int,
        "dropped_malformed": int,
        "dropped_not-leader": int,
        "dropped_refused-request": int,
        "dropped_repeated-staging-request": int,
        "dropped_room-ended": int,
        "dropped_socket-error": int,
        "dropped_staging-over-cap": int,
        "dropped_too-many-peers": int,
        "dropped_unexpected-drained": int,
        "dropped_unexpected-hello-ack": int,
        "dropped_unexpected-register-again": int,
        "dropped_unexpected-staged": int,
        "dropped_unexpected-staging-answer": int,
        "dropped_unexpected-topology": int,
        "dropped_unknown-peer": int,
        "dropped_unknown-room": int,
        "dropped_wrong-peer": int,
    },
    total=False,
)
"""Messages refused by the manager, by cause (the causes are names with hyphens: hence this form)."""


class ManagerStats(_AlwaysPresent, _Dropped, total=False):
    """What ``KVManager.stats()`` returns: a plain dict, cheap to build (docs: Observability).

    Always present: the gauges (``senders_active``, ``in_flight``, ``pinned_bytes``, ``open_sockets``,
    ``pages_*`` / ``bytes_*``, ...), the engine and control totals, ``control_dropped`` (``{cause: count}``),
    ``latency`` (``{op: LatencySummary}``) and ``failures_by_reason`` (``{label: count}``).

    The counters appear once they are non-zero: the ones declared here, ``dropped_<cause>`` (messages
    refused by the manager, by cause, e.g. ``dropped_invalid-aux``), ``rooms_released_<cause>`` (rooms
    whose pages were released, by cause) and ``state_<kind>_bytes_sent`` (state bytes per kind; a custom
    kind's key is not declared: read it with ``stats.get(name)``).
    """

    kv_bytes_sent: int
    kv_entries_sent: int
    layer_writes: int
    layer_calls_batched: int
    staged_pieces: int
    staged_pieces_received: int
    staging_refused_ended: int
    staging_space_reclaimed: int
    staging_space_returned: int
    aux_engine: int
    aux_tcp: int
    aux_fallback: int
    aux_tcp_received: int
    rooms_sent_success: int
    rooms_sent_failed: int
    rooms_received_success: int
    rooms_received_failed: int
    engine_threads_background: int
    success_at_completion: int
    peers_declared_dead: int
    rooms_failed_dead_peer: int
    peer_restarts: int
    peers_refused: int
    decode_peer_reregistered: int
    decode_peers_forgotten: int
    control_send_failed: int
    rooms_failed_send: int
    pending_expired: int
    pending_duplicate: int
    pending_refused: int
    late_requests_refused: int
    requests_register_again: int
    requests_sent_again: int
    checksums_verified: int
    checksum_mismatches: int
    checksum_mismatches_reported: int
    rooms_released_success: int
    rooms_released_drained: int
    rooms_released_nothing_sent: int
    rooms_released_quarantine: int
    rooms_released_peer_gone: int
    rooms_released_peer_restarted: int
    state_mamba_bytes_sent: int
    state_swa_bytes_sent: int
    state_nsa_bytes_sent: int
