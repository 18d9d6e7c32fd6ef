"""The decode ranks a room sends to, as its sender sees them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._control.messages import TransferRequest
from .._plan import unit_span
from .peers import DecodePeer

__all__ = ["Dst", "room_size"]


@dataclass
class Dst:
    """One decode rank this room sends to."""

    peer: DecodePeer
    request: TransferRequest
    kv_indices: np.ndarray
    units: int = 0
    """The room's tokens in units of the pairing (its pages, when both page sizes match)."""

    @property
    def is_dummy(self) -> bool:
        return self.request.is_dummy

    def span(self, src: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(our units, the decode's units, first unit) of the chunk of pages ``src`` starting at ``start``."""
        pairing = self.peer.pairing
        return unit_span(src, self.kv_indices, start, pairing.src_units, pairing.dst_units, self.units)


def room_size(page_size: int, peer: DecodePeer, req: TransferRequest, kv_indices: np.ndarray) -> tuple[int, int] | str:
    """(our pages the room needs, its units) from a decode rank's declaration, or why it does not add up."""
    theirs = peer.hello.page_size
    tokens = req.num_tokens if req.num_tokens >= 0 else int(kv_indices.size) * theirs
    if -(-tokens // theirs) != kv_indices.size:
        return f"decode declares {tokens} tokens in {kv_indices.size} pages of {theirs}"
    unit = page_size // peer.pairing.src_units
    return -(-tokens // page_size), -(-tokens // unit)
