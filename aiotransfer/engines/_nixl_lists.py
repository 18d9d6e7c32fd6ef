"""NIXL descriptor lists prepared once, and writes made from them by index.

A write whose entries all have one length ``L`` (a scattered room: one entry per page and buffer) and lie on
``L``-byte boundaries of their regions is a set of rows of a list that never changes: every ``L``-byte block of
every registered region of one memory kind. That list is prepared once per side (``prep_xfer_dlist``: the
local regions at the first such write, the peer's at the first write to it), and each write is
``make_prepped_xfer`` with two index arrays, instead of two descriptor lists built and ``initialize_xfer`` per
write (vLLM's and SGLang's NIXL connectors make every transfer this way). A list is described by one strided
row per region (``address, L, device, L, count``: NIXL expands it) where the installed NIXL takes them, else
row by row up to :data:`MAX_DENSE_ROWS`; beyond that, or for entries of mixed lengths, writes build their
lists as before.

The owner (:class:`~aiotransfer.engines._nixl.NixlEngine`) calls everything here under its agent lock, and only
its driver thread prepares (preparing a large list takes milliseconds). Prepared lists are released at the
owner's close, never earlier: a made transfer may still refer to them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._common import RegionIndex

__all__ = ["MAX_DENSE_ROWS", "MIN_ENTRIES", "PreparedLists"]

log = logging.getLogger("aiotransfer.engines.nixl")

MIN_ENTRIES = 9
"""Writes of fewer entries build their lists in plain Python (a few microseconds): not worth an index."""
MAX_DENSE_ROWS = 1 << 21
"""A list NIXL must take row by row (no strided rows) is prepared up to this many rows (48 MiB of rows)."""
_INDEX_MAX = (1 << 31) - 1


@dataclass
class _List:
    handle: Any
    firsts: npt.NDArray[np.int64]
    """Index of each region's first block in the list (-1: the region is of another memory kind)."""
    counts: npt.NDArray[np.int64]


class PreparedLists:
    """One side's prepared lists, by (entry length, memory kind). ``target``: ``NIXL_INIT_AGENT`` for the
    local side, the peer's agent name for a remote one. ``rows``: the side's regions, sorted by address,
    as (address, size, kind index, device id); ``index`` locates addresses in them."""

    def __init__(self, agent: Any, target: str, rows: list[tuple[int, int, int, int]], index: RegionIndex,
                 mem_types: tuple[str, ...]) -> None:
        self._agent, self._target, self._rows, self._index = agent, target, rows, index
        self._mem_types = mem_types
        self._lists: dict[tuple[int, int], _List | None] = {}
        self.strided: bool | None = None
        """Whether NIXL took strided rows (None: nothing prepared yet)."""

    def indices(self, addrs: npt.NDArray[np.uint64], length: int, kind: int, *,
                prepare: bool) -> tuple[Any, npt.NDArray[np.int32]] | None:
        """(prepared list, the index of each address's block in it), or None: the addresses are not all
        on ``length`` boundaries of regions of memory kind ``kind``, no list could be prepared, or none is
        and ``prepare`` is false."""
        key = (length, kind)
        if key not in self._lists:
            if not prepare:
                return None
            self._lists[key] = self._prepare(length, kind)
        prepared = self._lists[key]
        if prepared is None:
            return None
        try:
            region, offset = self._index.locate(addrs, "")
        except Exception:  # an address outside every region: the caller's own checks say which
            return None
        block = offset // np.uint64(length)
        first = prepared.firsts[region]
        if ((offset % np.uint64(length)).any() or (first < 0).any()
                or (block.astype(np.int64) >= prepared.counts[region]).any()):
            return None
        return prepared.handle, (first + block.astype(np.int64)).astype(np.int32)

    def _prepare(self, length: int, kind: int) -> _List | None:
        counts = np.array([size // length if k == kind else 0 for _a, size, k, _d in self._rows], dtype=np.int64)
        firsts = np.where(counts > 0, np.cumsum(counts) - counts, -1)
        total = int(counts.sum())
        if total == 0 or total > _INDEX_MAX:
            return None
        mem = self._mem_types[kind]
        mine = [i for i, c in enumerate(counts) if c > 0]
        if self.strided is not False:
            strided = np.array([(self._rows[i][0], length, self._rows[i][3], length, int(counts[i])) for i in mine],
                               dtype=np.uint64).reshape(-1, 5)
            try:
                handle = self._agent.prep_xfer_dlist(self._target, strided, mem)
                self.strided = True
                return _List(handle, firsts, counts)
            except Exception as exc:  # a NIXL without strided rows
                log.debug("NIXL prep_xfer_dlist with strided rows failed (%r): rows one by one", exc)
                self.strided = False
        if total > MAX_DENSE_ROWS:
            return None
        dense = np.empty((total, 3), dtype=np.uint64)
        for i in mine:
            a, _size, _k, dev = self._rows[i]
            lo = int(firsts[i])
            hi = lo + int(counts[i])
            dense[lo:hi, 0] = np.uint64(a) + np.arange(counts[i], dtype=np.uint64) * np.uint64(length)
            dense[lo:hi, 1] = length
            dense[lo:hi, 2] = dev
        try:
            return _List(self._agent.prep_xfer_dlist(self._target, dense, mem), firsts, counts)
        except Exception as exc:
            log.warning("NIXL prep_xfer_dlist of %d rows for %s failed (%r): writes build their lists", total,
                        self._target, exc)
            return None

    def handles(self) -> list[Any]:
        """Every prepared list (to release when the agent closes)."""
        return [p.handle for p in self._lists.values() if p is not None]
