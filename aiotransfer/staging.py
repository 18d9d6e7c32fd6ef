"""Staging: gather scattered pages (or head slices) into one registered region, move it with one
engine entry, scatter it on the receiver.

Mooncake pays ~30 us per entry whatever its size, so 10,000 scattered 4 KiB pages cost ~300 ms as
10,000 entries but ~20 ms as one contiguous write. Staging trades two memory copies (GB/s) for the
entry count. :func:`choose_staging` is the cost model that decides per chunk.

Flow for one staged piece (prefill P, decode D), all on the control channel except the data:

1. P gathers the piece into its own staging arena (offload thread, NumPy ``take``; one gather at a
   time, the copies are CPU-bound) and meanwhile asks D for room in D's staging arena
   (``StageRequest``); D grants an offset when space frees up (``StageGrant``): backpressure, nothing is
   dropped.
2. P writes the piece with one engine entry (several pieces may be in flight, as long as P's arena has
   room; the next gather runs meanwhile), then tells D what it is (``Staged``).
3. D validates it against the room's declared pages, scatters it into its KV pages (offload thread),
   frees the space and acks (``StagedAck``). P counts the piece as landed only after the ack, so the
   Success status (sent after) always follows the scatter.
4. A piece that fails before its write hands D's space back with an empty ``Staged`` (no pages, no
   bytes); space a posted write may still land in stays held.

Staging works on host memory (NumPy views of the registered buffers); device-resident KV uses the
direct path.
"""

from __future__ import annotations

import asyncio
import ctypes
from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgument, TransferTimeout

__all__ = ["RowSlice", "StagingArena", "choose_staging", "gather_pages", "host_view", "scatter_pages"]

_ALIGN = 64


def host_view(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 NumPy view of host memory at ``ptr`` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class StagingArena:
    """A first-fit allocator over one buffer, with bounded waits for space (backpressure)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffer = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
        base = int(self.buffer.ctypes.data)
        self.offset0 = (-base) % _ALIGN
        self.ptr = base + self.offset0
        self.view = self.buffer[self.offset0 : self.offset0 + nbytes]
        self.buffer[::4096] = 1  # fault every page in now, not during the first transfer
        self.buffer[::4096] = 0
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        self._changed = asyncio.Event()
        self.in_use = 0

    def try_acquire(self, n: int) -> int | None:
        n = (n + _ALIGN - 1) // _ALIGN * _ALIGN
        for i, (off, size) in enumerate(self._free):
            if size >= n:
                if size == n:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + n, size - n)
                self.in_use += n
                return off
        return None

    async def acquire(self, n: int, timeout: float) -> int:
        if n > self.nbytes:
            raise InvalidArgument(f"staging piece of {n} bytes exceeds the {self.nbytes}-byte arena")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (off := self.try_acquire(n)) is None:
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TransferTimeout(f"no staging space for {n} bytes within {timeout:.3g}s")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue
        return off

    def release(self, off: int, n: int) -> None:
        n = (n + _ALIGN - 1) // _ALIGN * _ALIGN
        self.in_use -= n
        self._free.append((off, n))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._free = merged
        self._changed.set()

    def owns(self, off: int, n: int) -> bool:
        return 0 <= off and n >= 0 and off + n <= self.nbytes


@dataclass(frozen=True)
class RowSlice:
    """Which bytes of each page move: ``rows`` rows, heads ``[start, start+count)`` of ``heads`` per row.
    ``count == heads`` moves whole pages."""

    rows: int
    heads: int
    start: int
    count: int
    head_bytes: int

    @property
    def bytes_per_page(self) -> int:
        return self.rows * self.count * self.head_bytes


def _page_view(view: np.ndarray, num_pages: int, sl: RowSlice) -> np.ndarray:
    shaped = view[: num_pages * sl.rows * sl.heads * sl.head_bytes].reshape(num_pages, sl.rows, sl.heads, sl.head_bytes)
    return shaped[:, :, sl.start : sl.start + sl.count, :]


def gather_pages(
    buffers: list[np.ndarray], num_pages: list[int], pages: np.ndarray, sl: RowSlice, out: np.ndarray
) -> None:
    """Copy ``pages`` (their ``sl`` slice) of every buffer into ``out``, buffer after buffer."""
    seg = pages.size * sl.bytes_per_page
    for b, view in enumerate(buffers):
        dst = out[b * seg : (b + 1) * seg].reshape(pages.size, sl.rows, sl.count, sl.head_bytes)
        src = _page_view(view, num_pages[b], sl)
        if sl.count == sl.heads:
            # mode="clip": with the default mode="raise" NumPy buffers ``out`` (4-5x slower); the pages were
            # range-checked by the caller (send_kv).
            np.take(src, pages, axis=0, out=dst, mode="clip")
        else:
            # a head slice is a strided view: np.take would first copy the whole buffer contiguous
            dst[...] = src[pages]


def scatter_pages(
    buffers: list[np.ndarray], num_pages: list[int], pages: np.ndarray, sl: RowSlice, src: np.ndarray
) -> None:
    """Inverse of :func:`gather_pages`: write each segment of ``src`` into ``pages`` of every buffer."""
    seg = pages.size * sl.bytes_per_page
    for b, view in enumerate(buffers):
        part = src[b * seg : (b + 1) * seg].reshape(pages.size, sl.rows, sl.count, sl.head_bytes)
        _page_view(view, num_pages[b], sl)[pages] = part


def choose_staging(
    *,
    entries: int,
    nbytes: int,
    entry_cost_s: float,
    bandwidth_bps: float,
    copy_bw: float = 4e9,
    round_trip_s: float = 6e-4,
) -> bool:
    """Stage when it is cheaper (a cost model, measured constants per engine).

    direct = max(entries x per-entry cost, bytes / engine bandwidth): small entries are bound by the
    per-entry cost, large ones by the wire. staged = bytes / engine bandwidth + gather and scatter copies
    (not overlapped: on small hosts the copies compete with the engine's own threads) + round trips.
    """
    if entries <= 1:
        return False
    wire = nbytes / bandwidth_bps
    direct = max(entries * entry_cost_s, wire)
    staged = wire + 2 * nbytes / copy_bw + round_trip_s + entry_cost_s
    return staged < direct
