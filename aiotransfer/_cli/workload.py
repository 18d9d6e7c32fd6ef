"""The workload of the demo and the benchmarks: KV geometry, one side's KV pool, the request list both
sides derive from a seed, the byte pattern every transfer is verified with, a scattering page allocator,
and one worker thread for the NumPy work.

Filling and verifying are vectorised NumPy (one operation per buffer, never per page).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from aiotransfer import KVArgs

__all__ = [
    "I64",
    "U64",
    "DemoRequest",
    "Geometry",
    "KVPool",
    "PageAllocator",
    "Worker",
    "count_bad_pages",
    "fill_pages",
    "make_requests",
    "page_seeds",
    "word_ramp",
]

T = TypeVar("T")

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Geometry:
    """Layer-first KV cache: ``2 * layers`` buffers (K of every layer, then V), ``pool_pages`` pages each."""

    layers: int = 32
    page_tokens: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    pool_pages: int = 1024
    elem_bytes: int = 2

    @property
    def buffers(self) -> int:
        return 2 * self.layers

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.page_tokens, self.kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one buffer (Llama-3-8B: 16 x 8 x 128 x 2 = 32 KiB)."""
        return self.page_tokens * self.kv_heads * self.head_dim * self.elem_bytes

    @property
    def words(self) -> int:
        return self.page_bytes // 8

    @property
    def pool_bytes(self) -> int:
        return self.buffers * self.pool_pages * self.page_bytes

    def validate(self) -> None:
        for name in ("layers", "page_tokens", "kv_heads", "head_dim", "pool_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.page_bytes % 8:
            raise ValueError(f"a page must be a multiple of 8 bytes, got {self.page_bytes}")


class KVPool:
    """One side's KV memory: a single slab holding every buffer, one spare page between buffers.

    ``buffers[b]`` is a C-contiguous ``(pages, *page_shape)`` view (what is registered with the engine);
    ``words`` is the same memory as ``(nbuf, pages + 1, page_bytes // 8)`` uint64 for vectorised filling
    and checking. The spare page keeps registered regions from touching each other (aiotransfer's planner
    merges entries that are adjacent in memory, and Mooncake refuses an entry spanning two regions).
    """

    def __init__(
        self, nbuf: int, pages: int, page_shape: tuple[int, ...], dtype: npt.DTypeLike = np.uint16,
        layer_ids: Sequence[int] | None = None,
    ) -> None:
        slab = np.empty((nbuf, pages + 1, *page_shape), dtype=dtype)
        if slab[0, 0].nbytes % 8:
            raise ValueError(f"a page must be a multiple of 8 bytes, got {slab[0, 0].nbytes}")
        self.nbuf = nbuf
        self.pages = pages
        self.page_bytes = int(slab[0, 0].nbytes)
        self.slab = slab
        self.words: U64 = slab.reshape(nbuf, pages + 1, -1).view(np.uint64)
        self.buffers = [slab[b, :pages] for b in range(nbuf)]
        self.layer_ids = list(layer_ids) if layer_ids is not None else None

    @classmethod
    def for_geometry(cls, geo: Geometry) -> KVPool:
        """K of every layer, then V of every layer (SGLang's layer-first order)."""
        return cls(geo.buffers, geo.pool_pages, geo.page_shape, np.uint16,
                   [b % geo.layers for b in range(geo.buffers)])

    @property
    def bases(self) -> list[int]:
        return [int(b.ctypes.data) for b in self.buffers]

    def prefault(self, value: int = 0xA5) -> None:
        """Touch every page of the slab (as a serving engine's allocator does): a fresh mapping would make
        the first transfers pay the kernel's page faults. The poison value also exposes missed writes."""
        self.slab.view(np.uint8).fill(value)

    def poison(self, pages: I64, value: int = 0xA5A5A5A5A5A5A5A5) -> None:
        """Overwrite ``pages`` of every buffer (one NumPy op per buffer)."""
        for b in range(self.nbuf):
            self.words[b, pages] = np.uint64(value)

    def kv_args(self, page_size: int, dtype: str, heads: int = 0) -> KVArgs:
        return KVArgs(self.buffers, page_size=page_size, dtype=dtype, kv_layer_ids=self.layer_ids,
                      kv_heads=heads, total_kv_heads=heads)


@dataclass(frozen=True)
class DemoRequest:
    room: int
    tokens: int
    pages: int
    chunks: tuple[int, ...]
    """Pages per ``send_kv`` call; sums to ``pages``."""


def make_requests(
    seed: int, count: int, min_tokens: int, max_tokens: int, page_tokens: int, max_chunks: int
) -> list[DemoRequest]:
    """The request list both sides derive from the seed."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError("need 1 <= --min-tokens <= --max-tokens")
    rng = np.random.default_rng([seed, 0xD3110])
    tokens = rng.integers(min_tokens, max_tokens + 1, size=count)
    nchunks = rng.integers(1, max(max_chunks, 1) + 1, size=count)
    base = 1_000_000 + (seed % 1_000_000) * 100_000
    out = []
    for i in range(count):
        pages = math.ceil(int(tokens[i]) / page_tokens)
        k = min(int(nchunks[i]), pages)
        cuts = np.sort(rng.choice(np.arange(1, pages), size=k - 1, replace=False)) if k > 1 else np.empty(0, np.int64)
        bounds = [0, *(int(c) for c in cuts), pages]
        sizes = tuple(b - a for a, b in itertools.pairwise(bounds))
        out.append(DemoRequest(base + i, int(tokens[i]), pages, sizes))
    return out


def page_seeds(room: int, buffers: int, npages: int) -> U64:
    """(buffers, npages) uint64: one 64-bit seed per (room, buffer, page position in the request)."""
    b = np.arange(buffers, dtype=np.uint64)[:, None]
    p = np.arange(npages, dtype=np.uint64)[None, :]
    x = (b * _M2 + p * _M3) ^ (np.full(1, room, dtype=np.uint64) * _M1)
    x ^= x >> np.uint64(30)
    x *= _M2
    x ^= x >> np.uint64(27)
    x *= _M3
    x ^= x >> np.uint64(31)
    out: U64 = x
    return out


def word_ramp(words: int) -> U64:
    """Added to a page's seed to give every 8-byte word of the page a different value."""
    ramp: U64 = np.arange(words, dtype=np.uint64) * _M1
    return ramp


def fill_pages(pool: KVPool, room: int, pages: I64) -> None:
    """Write the pattern of ``room`` into ``pages`` of every buffer (one NumPy op per buffer)."""
    seeds = page_seeds(room, pool.nbuf, pages.size)
    ramp = word_ramp(pool.words.shape[2])
    for b in range(pool.nbuf):
        pool.words[b, pages] = seeds[b][:, None] + ramp


def count_bad_pages(pool: KVPool, room: int, pages: I64) -> int:
    """(buffer, page) pairs of ``room`` whose bytes differ from the pattern (every byte checked)."""
    seeds = page_seeds(room, pool.nbuf, pages.size)
    ramp = word_ramp(pool.words.shape[2])
    bad = 0
    for b in range(pool.nbuf):
        got = pool.words[b, pages]
        got -= ramp
        bad += int(np.count_nonzero((got != seeds[b][:, None]).any(axis=1)))
    return bad


class PageAllocator:
    """Free list handing out pages at random (scattered).

    Allocation is first-come first-served: a request never overtakes an earlier one that is waiting
    for pages. Both sides allocate rooms in the same order, so the oldest unfinished room always gets
    its pages on both sides (no cross-process deadlock when the pools are tight).
    """

    def __init__(self, num_pages: int, rng: np.random.Generator) -> None:
        self.num_pages = num_pages
        self._free: I64 = np.arange(num_pages, dtype=np.int64)
        self._rng = rng
        self._waiters: deque[tuple[int, asyncio.Future[I64]]] = deque()

    @property
    def free_pages(self) -> int:
        return int(self._free.size)

    def _take(self, n: int) -> I64:
        pick = self._rng.choice(self._free.size, size=n, replace=False)
        pages = self._free[pick]
        self._free = np.delete(self._free, pick)
        return pages

    async def alloc(self, n: int, timeout: float) -> I64:
        if n > self.num_pages:
            raise ValueError(f"request of {n} pages exceeds the pool of {self.num_pages}")
        if not self._waiters and self._free.size >= n:
            return self._take(n)
        fut: asyncio.Future[I64] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self._free = np.concatenate([self._free, fut.result()])
            self._serve()
            raise

    def _serve(self) -> None:
        while self._waiters and self._free.size >= self._waiters[0][0]:
            n, fut = self._waiters.popleft()
            fut.set_result(self._take(n))

    async def release(self, pages: I64) -> None:
        self._free = np.concatenate([self._free, pages])
        self._serve()


class Worker:
    """One thread for NumPy work (fill/verify) so the event loop never runs it inline."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, timeout: float) -> T:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        return await asyncio.wait_for(fut, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
