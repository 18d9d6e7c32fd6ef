"""Staging with torch: gather and scatter on the KV's own device.

Used when the KV buffers live on a device (CUDA tensors; ``TransferConfig.staging_backend="auto"``), and
on host memory when asked for (``"torch"``: how CI runs this code without a GPU). The arena is a uint8
tensor on the KV's device, registered with the engine like the host arena. Its bytes are laid out as
:func:`aiotransfer._staging.gather_pages` lays them out (buffer after buffer, pages in order, the row
slice of each page), so the two sides of a transfer may use different backends.

Whole pages move with ``index_select`` / ``index_copy_`` on a (pages, bytes) view of each buffer; head
slices with the same calls on a strided (pages, rows, heads, head bytes) view sliced to the heads.

On CUDA the copies run on a stream of their own, after the work already queued on the device's default
stream, and both calls wait for that stream before they return, raised or not: the engine reads a
gathered slice, and a scattered slice is granted again, only once the copies are complete.

torch is imported with this module, and this module only by a rank that stages with torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ._args import Buffer
from ._staging import ARENA_ALIGN, RowSlice, StagingArena, host_view
from .errors import InvalidArgument

__all__ = ["TorchCopier", "gather_pages_torch", "kv_bytes", "scatter_pages_torch"]


def _units(flat: torch.Tensor, num_pages: int, sl: RowSlice) -> torch.Tensor:
    """Buffer ``flat`` (uint8) as (pages, rows, heads, head bytes)."""
    return flat[: num_pages * sl.rows * sl.heads * sl.head_bytes].view(num_pages, sl.rows, sl.heads, sl.head_bytes)


def gather_pages_torch(
    buffers: Sequence[torch.Tensor], num_pages: Sequence[int], pages: torch.Tensor, sl: RowSlice, out: torch.Tensor
) -> None:
    """:func:`aiotransfer._staging.gather_pages` on uint8 tensors: ``pages`` (an int64 tensor on the
    buffers' device) of every buffer into ``out``, buffer after buffer."""
    n = int(pages.numel())
    seg = n * sl.bytes_per_page
    for b, flat in enumerate(buffers):
        src = _units(flat, num_pages[b], sl)
        dst = out[b * seg : (b + 1) * seg]
        if sl.count == sl.heads:
            torch.index_select(src.view(num_pages[b], -1), 0, pages, out=dst.view(n, -1))
        else:
            torch.index_select(src[:, :, sl.start : sl.start + sl.count], 0, pages,
                               out=dst.view(n, sl.rows, sl.count, sl.head_bytes))


def scatter_pages_torch(
    buffers: Sequence[torch.Tensor], num_pages: Sequence[int], pages: torch.Tensor, sl: RowSlice, src: torch.Tensor
) -> None:
    """Inverse of :func:`gather_pages_torch`: each segment of ``src`` into ``pages`` of every buffer."""
    n = int(pages.numel())
    seg = n * sl.bytes_per_page
    for b, flat in enumerate(buffers):
        dst = _units(flat, num_pages[b], sl)
        part = src[b * seg : (b + 1) * seg]
        if sl.count == sl.heads:
            dst.view(num_pages[b], -1).index_copy_(0, pages, part.view(n, -1))
        else:
            dst[:, :, sl.start : sl.start + sl.count].index_copy_(0, pages,
                                                                  part.view(n, sl.rows, sl.count, sl.head_bytes))


def kv_bytes(buf: Buffer, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over a KV buffer (no copy): any host buffer, or a tensor on ``device``."""
    if device.type == "cpu":
        return torch.from_numpy(host_view(buf.ptr, buf.nbytes))
    owner = buf.owner
    if not isinstance(owner, torch.Tensor) or owner.device != device:
        raise InvalidArgument(f"KV buffers on {device} must be torch tensors on that device to be staged there")
    flat = owner.detach().reshape(-1).view(torch.uint8)
    if flat.data_ptr() != buf.ptr or flat.numel() != buf.nbytes:
        raise InvalidArgument("a KV tensor changed since it was registered (address or size)")
    return flat


class TorchCopier:
    """:class:`~aiotransfer._staging.ArenaCopier` with torch, on the KV's device (its arena is there too)."""

    def __init__(self, kv: Sequence[Buffer], device: str, nbytes: int) -> None:
        self.device = torch.device(device)
        self._kv = [kv_bytes(b, self.device) for b in kv]
        memory = torch.zeros(nbytes + ARENA_ALIGN, dtype=torch.uint8, device=self.device)
        base = int(memory.data_ptr())
        self._arena = StagingArena(nbytes, base=base, device=device, owner=memory)
        start = self._arena.ptr - base
        self._memory = memory[start : start + nbytes]
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]

    @property
    def arena(self) -> StagingArena:
        return self._arena

    def gather(self, buffers: Sequence[int], num_pages: Sequence[int], pages: np.ndarray, sl: RowSlice,
               off: int) -> None:
        n = len(buffers) * pages.size * sl.bytes_per_page
        with self._copying():
            gather_pages_torch([self._kv[i] for i in buffers], num_pages, self._index(pages), sl,
                               self._memory[off : off + n])

    def scatter(self, buffers: Sequence[int], num_pages: Sequence[int], pages: np.ndarray, sl: RowSlice,
                off: int) -> None:
        n = len(buffers) * pages.size * sl.bytes_per_page
        with self._copying():
            scatter_pages_torch([self._kv[i] for i in buffers], num_pages, self._index(pages), sl,
                                self._memory[off : off + n])

    def _index(self, pages: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64)).to(self.device)

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Issue the block's copies (on our stream on CUDA) and wait until they are complete, even when the
        block raises: the caller frees or hands on the arena slice as soon as we return."""
        stream = self._stream
        if stream is None:
            try:
                yield
            finally:
                if self.device.type != "cpu":
                    torch.accelerator.synchronize(self.device)
            return
        stream.wait_stream(torch.cuda.default_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            stream.synchronize()
