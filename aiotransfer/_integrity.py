"""Optional end-to-end checksums (``TransferConfig(checksum=True)``).

Each prefill rank computes, per room, a CRC32 per destination buffer over exactly the bytes it wrote
(page order of the room, rows and head slice as moved), folds them into one value and sends it with
Success. Decode recomputes the same from its own memory before it reports Success; a mismatch fails the
room on both sides with the reason. Host memory only.
"""

from __future__ import annotations

import zlib

import numpy as np

from ._staging import RowSlice, _page_view

__all__ = ["RoomChecksum", "region_crcs", "fold"]


def region_crcs(views: list[np.ndarray], num_pages: list[int], pages: np.ndarray, slices: list[RowSlice],
                crcs: list[int] | None = None) -> list[int]:
    """Running CRC32 per buffer over ``pages`` (buffer ``b``'s ``slices[b]``), continuing from ``crcs``."""
    out = list(crcs) if crcs is not None else [0] * len(views)
    for b, view in enumerate(views):
        data = np.ascontiguousarray(_page_view(view, num_pages[b], slices[b])[pages])
        out[b] = zlib.crc32(data.tobytes() if data.size < 4096 else data.data, out[b])
    return out


def fold(crcs: list[int]) -> int:
    return zlib.crc32(np.asarray(crcs, dtype=np.uint32).tobytes())


class RoomChecksum:
    """Accumulates per-buffer CRCs over a room's chunks for one destination."""

    def __init__(self, slices: list[RowSlice]) -> None:
        self.crcs = [0] * len(slices)
        self.slices = slices

    def add(self, views: list[np.ndarray], num_pages: list[int], pages: np.ndarray) -> None:
        self.crcs = region_crcs(views, num_pages, pages, self.slices, self.crcs)

    @property
    def value(self) -> int:
        return fold(self.crcs)
