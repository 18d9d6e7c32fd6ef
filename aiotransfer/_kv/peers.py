"""What a rank knows of its peers, and the stash of transfer requests that came before their room."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..control.messages import BufferSpec, Hello, HelloAck, Topology, TransferRequest
from ..layout import KVPairing

__all__ = ["DecodePeer", "PendingRequests", "PrefillPeer", "PrefillTopology", "Stashed"]


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


@dataclass
class _Entry:
    since: float
    items: list[Stashed] = field(default_factory=list)


class PendingRequests:
    """Transfer requests that arrived before the prefill created the room's sender, oldest first.

    Bounded in time (``ttl``) and count (``max_rooms``): :meth:`add` returns what it evicted, so that the
    caller tells those decode ranks why their request went nowhere."""

    def __init__(self, ttl: float, max_rooms: int) -> None:
        self.ttl = ttl
        self.max_rooms = max_rooms
        self._rooms: OrderedDict[int, _Entry] = OrderedDict()

    def add(self, room: int, item: Stashed) -> list[tuple[int, list[Stashed]]]:
        now = time.monotonic()
        expired: list[tuple[int, list[Stashed]]] = []
        while self._rooms:
            first_room, first = next(iter(self._rooms.items()))
            if now - first.since <= self.ttl and len(self._rooms) < self.max_rooms:
                break
            del self._rooms[first_room]
            expired.append((first_room, first.items))
        entry = self._rooms.get(room)
        if entry is None:
            entry = self._rooms[room] = _Entry(now)
        entry.items.append(item)
        return expired

    def pop(self, room: int) -> list[Stashed] | None:
        entry = self._rooms.pop(room, None)
        return entry.items if entry is not None else None

    def __len__(self) -> int:
        return len(self._rooms)
