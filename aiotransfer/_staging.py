"""Staging: gather scattered pages (or head slices) into one registered region, move it with one
engine entry, scatter it on the receiver.

Mooncake pays ~30 us per entry whatever its size, so 10,000 scattered 4 KiB pages cost ~300 ms as
10,000 entries but ~20 ms as one contiguous write. Staging trades two memory copies (GB/s) for the
entry count. :func:`choose_staging` is the cost model that decides per chunk.

Flow for one staged piece (prefill P, decode D), all on the control channel except the data:

1. P gathers the piece into its own staging arena (offload thread; one gather at a time, host copies
   are CPU-bound) and meanwhile asks D for room in D's staging arena (``StageRequest``); D grants an
   offset when space frees up (``StageGrant``): backpressure, nothing is dropped.
2. P writes the piece with one engine entry (several pieces may be in flight, as long as P's arena has
   room; the next gather runs meanwhile), then tells D what it is (``Staged``).
3. D validates it against the room's declared pages, scatters it into its KV pages (offload thread),
   frees the space and acks (``StagedAck``). P counts the piece as landed only after the ack, so the
   Success status (sent after) always follows the scatter.
4. A piece that fails before its write hands D's space back with an empty ``Staged`` (no pages, no
   bytes); space a posted write may still land in stays held.

Where the copies run (``TransferConfig.staging_backend``): host KV is copied with NumPy views of the
registered buffers (:class:`HostCopier`); KV on a device (CUDA tensors) with torch operations on an arena
allocated on that device, on its own stream (:mod:`aiotransfer._torch_staging`). Both implement
:class:`ArenaCopier` and move the same bytes in the same order, so the two sides of a transfer need not
use the same backend.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._deadline import within
from .errors import ConfigError, InvalidArgument, TransferTimeout

__all__ = [
    "ARENA_ALIGN",
    "DEVICE_COPY_BW",
    "HOST_COPY_BW",
    "ArenaCopier",
    "HostCopier",
    "RowSlice",
    "StagingArena",
    "choose_staging",
    "copy_bandwidth",
    "gather_pages",
    "host_view",
    "scatter_pages",
    "staging_backend",
]

ARENA_ALIGN = 64
"""Alignment of an arena's first byte; an arena over outside memory needs this much slack."""

HOST_COPY_BW = 4e9
"""Gather/scatter throughput of host memory in bytes per second (NumPy copies of scattered pages, measured
on the CPU machines)."""
DEVICE_COPY_BW = 5.5e11
"""Gather/scatter throughput of device memory in bytes per second, measured on an NVIDIA H200 (2026-11-27,
``bench --suite device``): 10,000 scattered 4 KiB pages gather (``index_select``) at 1.20-1.43 TB/s and
scatter (``index_copy_``) at 0.34-0.35 TB/s of payload; a staged chunk pays one of each, which is two
copies at 0.55 TB/s."""


def host_view(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 NumPy view of host memory at ``ptr`` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class StagingArena:
    """A first-fit allocator over one buffer, with bounded waits for space (backpressure)."""

    def __init__(self, nbytes: int, *, base: int | None = None, device: str = "cpu", owner: Any = None) -> None:
        """``nbytes`` of fresh host memory; or, given ``base``, memory allocated elsewhere (a device tensor):
        ``owner`` holds ``nbytes + ARENA_ALIGN`` bytes from ``base`` on ``device``; the arena keeps it."""
        if base is None:
            owner = np.zeros(nbytes + ARENA_ALIGN, dtype=np.uint8)
            owner[::4096] = 1  # fault every page in now, not during the first transfer
            owner[::4096] = 0
            base, device = int(owner.ctypes.data), "cpu"
        self.nbytes = nbytes
        self.ptr = base + (-base) % ARENA_ALIGN
        """The arena's first byte (64-byte aligned): what the engine registers and peers write to."""
        self.device = device
        """Where the arena lives: ``cpu`` or a device such as ``cuda:0``."""
        self.owner = owner
        self._view = host_view(self.ptr, nbytes) if device == "cpu" else None
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        self._changed = asyncio.Event()
        self.in_use = 0

    @property
    def view(self) -> np.ndarray:
        """The arena as a writable uint8 NumPy array (host arenas only)."""
        if self._view is None:
            raise InvalidArgument(f"the staging arena lives on {self.device}: it has no host view")
        return self._view

    def try_acquire(self, n: int) -> int | None:
        """The offset of ``n`` free bytes, now taken, or None while there are none. ``n`` must be > 0: a
        size of zero or less would take no space, or grow a free run backwards over space already taken."""
        if n <= 0:
            raise InvalidArgument(f"staging piece of {n} bytes: a piece holds at least one byte")
        n = (n + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN
        for i, (off, size) in enumerate(self._free):
            if size >= n:
                if size == n:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + n, size - n)
                self.in_use += n
                return off
        return None

    async def acquire(self, n: int, timeout: float, admit: Callable[[], bool] | None = None) -> int:
        """Take ``n`` bytes, waiting (at most ``timeout`` seconds) for them to be free and, given ``admit``,
        for it to say yes: a caller's own share of the arena, which shrinks only as space comes back."""
        if not 0 < n <= self.nbytes:
            raise InvalidArgument(f"staging piece of {n} bytes does not fit the {self.nbytes}-byte arena")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (admit is not None and not admit()) or (off := self.try_acquire(n)) is None:
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TransferTimeout(f"no staging space for {n} bytes within {timeout:.3g}s")
            try:
                await within(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue
        return off

    def release(self, off: int, n: int) -> None:
        if not (n > 0 and self.owns(off, n)):
            raise InvalidArgument(f"staging release of [{off}, {off + n}) is outside the {self.nbytes}-byte arena")
        n = (n + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN
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


class ArenaCopier(Protocol):
    """Moves pages between a rank's KV buffers and its staging arena. Both calls run on an offload thread
    and return only once the copy is complete: the engine may read the gathered bytes, or the slice be
    granted again, as soon as they return.

    The bytes of slice ``[off, off + n)`` are laid out buffer after buffer (``buffers`` order), each
    segment the ``sl`` slice of ``pages`` in page order: ``n = len(buffers) * pages.size *
    sl.bytes_per_page``."""

    @property
    def arena(self) -> StagingArena: ...

    def gather(self, buffers: Sequence[int], num_pages: Sequence[int], pages: np.ndarray, sl: RowSlice,
               off: int) -> None:
        """Copy ``pages`` of KV buffers ``buffers`` (each of ``num_pages`` units) into the arena at ``off``."""

    def scatter(self, buffers: Sequence[int], num_pages: Sequence[int], pages: np.ndarray, sl: RowSlice,
                off: int) -> None:
        """Inverse of :meth:`gather`: write the arena's bytes at ``off`` into ``pages`` of ``buffers``."""


class HostCopier:
    """:class:`ArenaCopier` for host memory: NumPy views of the KV buffers and a host arena."""

    def __init__(self, views: Sequence[np.ndarray], arena: StagingArena) -> None:
        self._views = list(views)
        self._arena = arena

    @property
    def arena(self) -> StagingArena:
        return self._arena

    def _slice(self, buffers: Sequence[int], pages: np.ndarray, sl: RowSlice, off: int) -> np.ndarray:
        return self._arena.view[off : off + len(buffers) * pages.size * sl.bytes_per_page]

    def gather(self, buffers: Sequence[int], num_pages: Sequence[int], pages: np.ndarray, sl: RowSlice,
               off: int) -> None:
        gather_pages([self._views[i] for i in buffers], list(num_pages), pages, sl, self._slice(buffers, pages, sl, off))

    def scatter(self, buffers: Sequence[int], num_pages: Sequence[int], pages: np.ndarray, sl: RowSlice,
                off: int) -> None:
        scatter_pages([self._views[i] for i in buffers], list(num_pages), pages, sl,
                      self._slice(buffers, pages, sl, off))


def staging_backend(requested: str, kv_device: str) -> str:
    """The copier a rank uses: ``numpy`` or ``torch``, from ``TransferConfig.staging_backend`` (which checked
    the value and that torch is there when asked for). ``auto`` picks torch for KV on a device and NumPy
    for host memory; ``numpy`` cannot reach device memory."""
    on_device = kv_device != "cpu"
    if requested == "auto":
        return "torch" if on_device else "numpy"
    if requested == "numpy" and on_device:
        raise ConfigError(f"staging_backend='numpy' cannot copy KV that lives on {kv_device}: use 'auto' or "
                          "'torch' (or staging='never' for the direct path)")
    return requested


def copy_bandwidth(device: str) -> float:
    """Gather/scatter throughput of the memory on ``device`` (a constant of the cost model)."""
    return HOST_COPY_BW if device == "cpu" else DEVICE_COPY_BW


def choose_staging(
    *,
    entries: int,
    nbytes: int,
    entry_cost_s: float,
    bandwidth_bps: float,
    copy_bw: float | None = None,
    device: str = "cpu",
    round_trip_s: float = 6e-4,
) -> bool:
    """Stage when it is cheaper (a cost model, measured constants per engine).

    direct = max(entries x per-entry cost, bytes / engine bandwidth): small entries are bound by the
    per-entry cost, large ones by the wire. staged = bytes / engine bandwidth + gather and scatter copies
    (not overlapped: on small hosts the copies compete with the engine's own threads) + round trips.
    ``copy_bw`` defaults to the copy throughput of the KV's ``device`` (:func:`copy_bandwidth`).
    """
    if entries <= 1:
        return False
    if copy_bw is None:
        copy_bw = copy_bandwidth(device)
    wire = nbytes / bandwidth_bps
    direct = max(entries * entry_cost_s, wire)
    staged = wire + 2 * nbytes / copy_bw + round_trip_s + entry_cost_s
    return staged < direct
