"""What a rank knows of its peers, and the stash of transfer requests that came before their room."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .._control.messages import BufferSpec, Hello, HelloAck, Topology, TransferRequest
from .._layout import KVPairing

LAYER_SETS = 1024
"""Sets of layers whose buffer positions a :class:`DecodePeer` keeps (a model's layers one by one, or in the
groups its forward pass sends them in; a caller sending arbitrary sets stops adding beyond this)."""

__all__ = ["LAYER_SETS", "DecodePeer", "Evicted", "PendingRequests", "PrefillPeer", "PrefillTopology", "Stashed"]


@dataclass
class DecodePeer:
    """Prefill-side view of a decode rank that registered with us."""

    endpoint: str
    hello: Hello
    kv_bases: np.ndarray
    kv_item_lens: np.ndarray
    num_pages: int
    aux_slots: int
    aux_bases: np.ndarray
    state: dict[str, tuple[np.ndarray, int]]
    """kind -> (buffer bases, items addressable in every buffer of that kind)"""
    pairing: KVPairing
    dst_bases: np.ndarray
    """Remote bases, in the order of ``pairing.src``."""
    dst_item_lens: np.ndarray
    """Bytes of one of the peer's pages (units, when the page sizes differ), in the order of ``pairing.dst``."""
    src_item_lens: np.ndarray
    """Bytes of one of our pages (units), in the order of ``pairing.src``."""
    staging: BufferSpec | None = None
    few: tuple[list[int], list[int], list[int]] | None = None
    """(source bases, destination bases, item lengths) as ints, for :func:`plan_runs` (built on first use)."""
    layer_positions: dict[frozenset[int], np.ndarray] = field(default_factory=dict)
    """The paired buffers (indices into ``pairing``) holding each set of layers streamed to this peer (built on
    first use, at most :data:`LAYER_SETS` sets)."""

    @property
    def session_id(self) -> str:
        return self.hello.session_id

    @classmethod
    def from_hello(cls, hello: Hello, pairing: KVPairing) -> DecodePeer:
        kv_bases = np.array([b.ptr for b in hello.kv], dtype=np.uint64)
        item_lens = np.array([b.item_len for b in hello.kv], dtype=np.uint64)
        state = {
            s.kind: (
                np.array([b.ptr for b in s.buffers], dtype=np.uint64),
                min((b.nbytes // b.item_len for b in s.buffers), default=0),
            )
            for s in hello.state
        }
        return cls(
            hello.endpoint, hello, kv_bases, item_lens,
            num_pages=min((b.nbytes // b.item_len for b in hello.kv), default=0),
            aux_slots=min((b.nbytes // b.item_len for b in hello.aux), default=0),
            aux_bases=np.array([b.ptr for b in hello.aux], dtype=np.uint64),
            state=state, pairing=pairing, dst_bases=kv_bases[pairing.dst],
            dst_item_lens=np.array(pairing.dst_unit_lens, dtype=np.uint64),
            src_item_lens=np.array(pairing.unit_lens, dtype=np.uint64),
            staging=hello.staging,
        )


@dataclass
class PrefillPeer:
    """Decode-side view of a prefill rank we registered with."""

    endpoint: str
    ack: HelloAck


@dataclass
class PrefillTopology:
    """Decode-side cache of what a bootstrap address resolved to."""

    topo: Topology
    endpoints: dict[tuple[int, int, int, int], str]


@dataclass
class Stashed:
    """One transfer request, checked, waiting for the prefill to open its room."""

    peer: DecodePeer
    request: TransferRequest
    kv_indices: np.ndarray


class Evicted(NamedTuple):
    """Stashed requests that will not be served, and what their decode ranks are told."""

    room: int
    items: list[Stashed]
    reason: str
    counter: str
    """The counter to bump: ``pending_expired`` (too old, or pushed out by newer rooms), ``pending_refused``
    (the stash was full: the request was never kept) or ``pending_duplicate`` (nobody to tell)."""


@dataclass
class _Entry:
    since: float
    items: list[Stashed] = field(default_factory=list)
    nbytes: int = 0


def _nbytes(item: Stashed) -> int:
    return int(item.kv_indices.nbytes) + len(item.request.kv_indices) + 256


EXPIRED = "transfer request expired before the prefill created the room"


class PendingRequests:
    """Transfer requests that arrived before the prefill created the room's sender, oldest first.

    Bounded in time (``ttl``) and rooms (``max_rooms``: the oldest room is pushed out), and in requests per
    room (``per_room``: one per decode rank), requests per decode rank (``per_peer``, all rooms together) and
    bytes over all rooms (``max_bytes``): a request beyond any of these is refused. :meth:`add` returns what it
    evicted or refused, so that the caller tells those decode ranks why their request went nowhere."""

    def __init__(self, ttl: float, max_rooms: int, *, per_room: int = 64, max_bytes: int = 256 << 20,
                 per_peer: int = 4096) -> None:
        self.ttl = ttl
        self.max_rooms = max_rooms
        self.per_room = per_room
        self.per_peer = per_peer
        self.max_bytes = max_bytes
        self.nbytes = 0
        """Bytes held now (page indices as received and as unpacked, plus a fixed cost per request)."""
        self._rooms: OrderedDict[int, _Entry] = OrderedDict()
        self._per_peer: Counter[str] = Counter()
        """Requests held now, by decode endpoint."""

    def add(self, room: int, item: Stashed) -> list[Evicted]:
        now = time.monotonic()
        evicted: list[Evicted] = []
        while self._rooms:
            first_room, first = next(iter(self._rooms.items()))
            if now - first.since <= self.ttl and len(self._rooms) < self.max_rooms:
                break
            self._pop(first_room)
            evicted.append(Evicted(first_room, first.items, EXPIRED, "pending_expired"))
        entry = self._rooms.get(room)
        size = _nbytes(item)
        reason = None
        if entry is not None and any(s.peer.endpoint == item.peer.endpoint for s in entry.items):
            # a second request from the same decode rank: refused, but nobody is told (the rank's first
            # request is still waiting, and a failure status would end its room)
            evicted.append(Evicted(room, [], f"duplicate request for room {room}", "pending_duplicate"))
            return evicted
        if entry is not None and len(entry.items) >= self.per_room:
            reason = f"too many requests for room {room} before the prefill created it ({self.per_room})"
        elif self._per_peer[item.peer.endpoint] >= self.per_peer:
            reason = (f"too many requests from decode {item.peer.endpoint} waiting for rooms the prefill has not "
                      f"created ({self.per_peer})")
        elif self.nbytes + size > self.max_bytes:
            reason = f"too many requests waiting for rooms the prefill has not created ({self.max_bytes} bytes)"
        if reason is not None:
            evicted.append(Evicted(room, [item], reason, "pending_refused"))
            return evicted
        if entry is None:
            entry = self._rooms[room] = _Entry(now)
        entry.items.append(item)
        entry.nbytes += size
        self.nbytes += size
        self._per_peer[item.peer.endpoint] += 1
        return evicted

    def _pop(self, room: int) -> _Entry | None:
        entry = self._rooms.pop(room, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            for s in entry.items:
                ep = s.peer.endpoint
                self._per_peer[ep] -= 1
                if not self._per_peer[ep]:
                    del self._per_peer[ep]
        return entry

    def pop(self, room: int) -> list[Stashed] | None:
        entry = self._pop(room)
        return entry.items if entry is not None else None

    def peers(self) -> list[str]:
        """Decode endpoints with requests held now."""
        return list(self._per_peer)

    def __len__(self) -> int:
        return len(self._rooms)
