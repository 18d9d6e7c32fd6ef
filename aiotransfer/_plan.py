"""Turn page (or slot) indices into transfer blocks: ``(src_addr, dst_addr, length)`` triples.

Pages are integer indices into a buffer whose pages are ``item_len`` bytes each.
A transfer pairs source page ``src_pages[i]`` with destination page ``dst_pages[i]``.
Everything here is pure and vectorised with NumPy (no per-page Python loops).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from aiotransfer.errors import InvalidArgument

__all__ = [
    "AddrArray",
    "Blocks",
    "IndexArray",
    "IntVector",
    "as_index_array",
    "bounds",
    "check_range",
    "check_unique",
    "coalesce_runs",
    "page_runs",
    "one_run",
    "pair_runs",
    "plan_blocks",
    "plan_coalesced",
    "plan_few",
    "plan_head_slices",
    "plan_runs",
    "plan_slots",
    "split_blocks",
    "unit_span",
    "units_of",
]

IndexArray: TypeAlias = npt.NDArray[np.int64]
"""1-D array of page indices / run starts / run lengths."""
AddrArray: TypeAlias = npt.NDArray[np.uint64]
"""1-D array of addresses or byte lengths."""
IntVector: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
"""One integer per buffer (bases, item lengths)."""

_INT64_MAX = int(np.iinfo(np.int64).max)
_UINT64_MAX = int(np.iinfo(np.uint64).max)


class Blocks(NamedTuple):
    """Transfer entries: copy ``length[k]`` bytes from ``src[k]`` to ``dst[k]``.

    ``len(blocks)`` is the number of entries (not 3); unpacking and pickling work,
    but ``_replace``/``_make`` raise TypeError: build ``Blocks(src, dst, length)``.
    """

    src: AddrArray
    dst: AddrArray
    length: AddrArray

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes moved by all entries."""
        if self.length.shape[0] <= _FEW:
            return sum(self.length.tolist())
        return int(self.length.sum(dtype=np.uint64))


_FEW = 16
"""Up to this many values, Python's ``min``/``max``/``sum`` over a list beat NumPy's reductions (about 0.3 us
against 2-3 us each): a small room's page list and engine entries are checked several times on its path."""
_FEW_UNIQUE = 64
"""Up to this many pages, uniqueness is checked with a Python set (1-2 us against 3-4 us for the sort)."""


def bounds(arr: npt.NDArray[np.integer[Any]]) -> tuple[int, int]:
    """``(min, max)`` of a non-empty integer array."""
    if arr.shape[0] <= _FEW:
        vals = arr.tolist()
        return min(vals), max(vals)
    return int(arr.min()), int(arr.max())


def _empty_index() -> IndexArray:
    return np.empty(0, dtype=np.int64)


def _empty_blocks() -> Blocks:
    return Blocks(np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64))


def as_index_array(indices: object, *, what: str = "indices") -> IndexArray:
    """Return ``indices`` as a 1-D int64 array (possibly sharing memory with the input).

    Accepts lists, tuples, ranges, NumPy integer arrays and anything ``np.asarray``
    understands (e.g. CPU torch tensors). Empty input is allowed whatever its dtype
    (``[]`` reads as float64). Raises :class:`InvalidArgument` for non-integer (or
    bool) dtypes, ``ndim != 1``, negative values and values beyond int64.
    """
    try:
        arr = np.asarray(indices)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"{what} cannot be read as an integer array: {exc}") from exc
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return _empty_index()
    kind = arr.dtype.kind
    if kind not in "iu":
        raise InvalidArgument(f"{what} must have an integer dtype, got {arr.dtype}")
    if kind == "u":
        if arr.dtype.itemsize == 8:
            top = bounds(arr)[1]
            if top > _INT64_MAX:
                raise InvalidArgument(f"{what} value {top} exceeds the int64 range")
    elif bounds(arr)[0] < 0:
        first = int(arr[np.argmax(arr < 0)])
        raise InvalidArgument(f"{what} must be non-negative, got {first}")
    return arr.astype(np.int64, copy=False)


def check_range(pages: npt.NDArray[np.integer[Any]], num_pages: int, *, what: str) -> None:
    """Raise :class:`InvalidArgument` unless every page is in ``[0, num_pages)``."""
    if num_pages < 0:
        raise InvalidArgument(f"{what}: num_pages must be >= 0, got {num_pages}")
    if pages.size == 0:
        return
    lo, hi = bounds(pages)
    if hi >= num_pages:
        first = int(pages[np.argmax(pages >= num_pages)])
        raise InvalidArgument(f"{what} page {first} is out of range (must be < {num_pages})")
    if lo < 0:
        first = int(pages[np.argmax(pages < 0)])
        raise InvalidArgument(f"{what} page {first} is negative")


def check_unique(pages: npt.NDArray[np.integer[Any]], *, what: str) -> None:
    """Raise :class:`InvalidArgument` if any page appears more than once."""
    if pages.size < 2:
        return
    if pages.size <= _FEW_UNIQUE:
        vals = pages.tolist()
        if len(set(vals)) == len(vals):
            return
    ordered = np.sort(pages, kind="stable")
    repeated = ordered[1:] == ordered[:-1]
    if repeated.any():
        dup = int(ordered[1:][np.argmax(repeated)])
        raise InvalidArgument(f"{what} must not repeat, page {dup} appears more than once")


def _run_starts(breaks: npt.NDArray[np.bool_]) -> IndexArray:
    """Start positions of the runs, given ``breaks[i]`` = "element i+1 starts a new run"."""
    starts = np.empty(int(np.count_nonzero(breaks)) + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = np.flatnonzero(breaks) + 1
    return starts


def _run_lengths(starts: IndexArray, n: int) -> IndexArray:
    lengths = np.empty_like(starts)
    lengths[:-1] = starts[1:] - starts[:-1]
    lengths[-1] = n - starts[-1]
    return lengths


def page_runs(pages: npt.NDArray[np.integer[Any]]) -> tuple[IndexArray, IndexArray]:
    """Split ``pages`` into maximal runs advancing by exactly +1; return ``(starts, lengths)``.

    ``starts`` holds page values (not positions). Used for gather/scatter staging.
    """
    p = np.asarray(pages, dtype=np.int64)
    if p.size == 0:
        return _empty_index(), _empty_index()
    pos = _run_starts(np.diff(p) != 1)
    return p[pos], _run_lengths(pos, p.size)


def coalesce_runs(
    src_pages: npt.NDArray[np.integer[Any]], dst_pages: npt.NDArray[np.integer[Any]]
) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Split paired page arrays into maximal runs where both sides advance by exactly +1.

    Returns ``(src_start, dst_start, run_len)`` as int64 arrays.
    """
    s = np.asarray(src_pages, dtype=np.int64)
    d = np.asarray(dst_pages, dtype=np.int64)
    if s.ndim != 1 or d.ndim != 1:
        raise InvalidArgument(f"page arrays must be 1-D, got shapes {s.shape} and {d.shape}")
    if s.shape != d.shape:
        raise InvalidArgument(f"source and destination page counts differ: {s.size} != {d.size}")
    if s.size == 0:
        return _empty_index(), _empty_index(), _empty_index()
    breaks = np.diff(s) != 1
    breaks |= np.diff(d) != 1
    pos = _run_starts(breaks)
    return s[pos], d[pos], _run_lengths(pos, s.size)


def _as_u64(values: object, *, what: str, positive: bool = False) -> AddrArray:
    """Per-buffer integers -> 1-D uint64 array (non-negative, or positive)."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"{what} cannot be read as integers: {exc}") from exc
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got dtype {arr.dtype}")
    low = int(arr.min())
    if low < 0 or (positive and low == 0):
        raise InvalidArgument(f"{what} must be {'positive' if positive else 'non-negative'}, got {low}")
    return arr.astype(np.uint64)


def _merge_adjacent(src: AddrArray, dst: AddrArray, length: AddrArray) -> Blocks:
    """Merge entry k into k-1 when both its src and dst start where k-1 ends."""
    if src.size < 2:
        return Blocks(src, dst, length)
    joins = src[:-1] + length[:-1] == src[1:]
    joins &= dst[:-1] + length[:-1] == dst[1:]
    if not joins.any():
        return Blocks(src, dst, length)
    starts = _run_starts(~joins)
    return Blocks(src[starts], dst[starts], np.add.reduceat(length, starts))


def _check_address_space(bases: AddrArray, item_lens: AddrArray, pages: IndexArray, *, what: str) -> None:
    """Refuse layouts whose byte addresses would overflow uint64 (O(buffers))."""
    if pages.size == 0:
        return
    top = int(pages.max()) + 1
    end = max(b + top * n for b, n in zip(bases.tolist(), item_lens.tolist(), strict=True))
    if end > _UINT64_MAX + 1:
        raise InvalidArgument(f"{what} addresses overflow 64 bits (end {end:#x})")


def plan_blocks(
    src_bases: IntVector,
    dst_bases: IntVector,
    item_lens: IntVector,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    *,
    dst_item_lens: IntVector | None = None,
) -> Blocks:
    """Plan the transfer of ``src_pages[i] -> dst_pages[i]`` in every buffer.

    One entry per (buffer, run of :func:`coalesce_runs`), buffer-major::

        src    = src_bases[b] + src_start * item_lens[b]
        dst    = dst_bases[b] + dst_start * item_lens[b]
        length = run_len * item_lens[b]

    Entries whose src and dst both start where the previous entry ends are then
    merged (this joins buffers laid out back to back on both sides).
    ``dst_item_lens``, if given, must equal ``item_lens`` (validation only).
    Pages go through :func:`as_index_array`; bounds and destination uniqueness are the caller's job
    (:func:`check_range`, :func:`check_unique`).
    """
    sb = _as_u64(src_bases, what="src_bases")
    db = _as_u64(dst_bases, what="dst_bases")
    il = _as_u64(item_lens, what="item_lens", positive=True)
    if not sb.size == db.size == il.size:
        raise InvalidArgument(
            "src_bases, dst_bases and item_lens must have one entry per buffer, "
            f"got {sb.size}, {db.size} and {il.size}"
        )
    if dst_item_lens is not None:
        dil = _as_u64(dst_item_lens, what="dst_item_lens", positive=True)
        if dil.shape != il.shape:
            raise InvalidArgument(
                f"dst_item_lens has {dil.size} entries, expected {il.size} (one per buffer)"
            )
        if not np.array_equal(dil, il):
            b = int(np.argmax(dil != il))
            raise InvalidArgument(
                f"item length mismatch in buffer {b}: source {int(il[b])} != destination {int(dil[b])}"
            )
    sp = as_index_array(src_pages, what="src_pages")
    dp = as_index_array(dst_pages, what="dst_pages")
    s0, d0, n = coalesce_runs(sp, dp)
    if il.size == 0 or n.size == 0:
        return _empty_blocks()
    _check_address_space(sb, il, sp, what="source")
    _check_address_space(db, il, dp, what="destination")
    return plan_coalesced(sb, db, il, (s0, d0, n))


def plan_coalesced(sb: AddrArray, db: AddrArray, il: AddrArray, runs: tuple[IndexArray, IndexArray, IndexArray]) -> Blocks:
    """:func:`plan_blocks` from runs already found by :func:`coalesce_runs` (a chunk planned once, sent
    buffer by buffer). Inputs are trusted: uint64 per-buffer arrays validated by the caller."""
    s0, d0, n = runs
    if il.size == 0 or n.size == 0:
        return _empty_blocks()
    # (buffers, runs) grids, raveled in C order = buffer-major.
    col = il[:, None]
    src = np.multiply(col, s0.astype(np.uint64))
    src += sb[:, None]
    dst = np.multiply(col, d0.astype(np.uint64))
    dst += db[:, None]
    length = np.multiply(col, n.astype(np.uint64))
    return _merge_adjacent(src.ravel(), dst.ravel(), length.ravel())


def plan_slots(
    src_bases: IntVector,
    dst_bases: IntVector,
    item_lens: IntVector,
    src_slots: npt.ArrayLike,
    dst_slots: npt.ArrayLike,
) -> Blocks:
    """:func:`plan_blocks` for per-request slots (aux data, mamba state...)."""
    return plan_blocks(src_bases, dst_bases, item_lens, src_slots, dst_slots)


def split_blocks(blocks: Blocks, max_entries: int) -> list[Blocks]:
    """Chunk ``blocks`` into consecutive views of at most ``max_entries`` entries.

    Empty ``blocks`` gives an empty list.
    """
    if max_entries < 1:
        raise InvalidArgument(f"max_entries must be >= 1, got {max_entries}")
    total = len(blocks)
    src, dst, length = blocks.src, blocks.dst, blocks.length
    return [
        Blocks(src[i : i + max_entries], dst[i : i + max_entries], length[i : i + max_entries])
        for i in range(0, total, max_entries)
    ]


def pair_runs(src_pages: list[int], dst_pages: list[int]) -> list[list[int]]:
    """``[src start, dst start, pages]`` for each run of pages consecutive on both sides, in plain Python
    (for short page lists, where NumPy's fixed cost per call dominates)."""
    n = len(src_pages)
    if n > 1 and len(dst_pages) == n:
        s0, d0 = src_pages[0], dst_pages[0]
        # One run on both sides, the common case (a prompt's pages allocated together): compared in C, about
        # 5 us for 256 pages against 34 us for the loop below.
        if (src_pages[-1] - s0 == n - 1 and dst_pages[-1] - d0 == n - 1
                and src_pages == list(range(s0, s0 + n)) and dst_pages == list(range(d0, d0 + n))):
            return [[s0, d0, n]]
    runs: list[list[int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if runs:
            last = runs[-1]
            if s == last[0] + last[2] and d == last[1] + last[2]:
                last[2] += 1
                continue
        runs.append([s, d, 1])
    return runs


def one_run(src_pages: npt.NDArray[np.integer[Any]], dst_pages: npt.NDArray[np.integer[Any]]) -> list[list[int]] | None:
    """:func:`pair_runs`' answer when both page arrays are one run each (``[[src start, dst start, pages]]``),
    else None: a few NumPy calls for a long page list, where building the runs in plain Python costs about
    0.13 us a page."""
    n = int(src_pages.size)
    if n < 2 or int(dst_pages.size) != n:
        return None
    s0, d0 = int(src_pages[0]), int(dst_pages[0])
    if int(src_pages[-1]) - s0 != n - 1 or int(dst_pages[-1]) - d0 != n - 1:
        return None
    if not bool((np.diff(src_pages) == 1).all()) or not bool((np.diff(dst_pages) == 1).all()):
        return None
    return [[s0, d0, n]]


def plan_runs(src_bases: list[int], dst_bases: list[int], item_lens: list[int], runs: list[list[int]]) -> Blocks:
    """:func:`plan_blocks` for page runs from :func:`pair_runs`, in plain Python: the same entries, without
    NumPy's fixed cost per call (tens of microseconds, most of a small request's planning). Use it when
    runs x buffers is small. Inputs are trusted: bases and lengths validated at registration, pages checked
    by the caller."""
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for sb, db, il in zip(src_bases, dst_bases, item_lens, strict=True):
        for s, d, n in runs:
            a, b, length = sb + s * il, db + d * il, n * il
            if lens and srcs[-1] + lens[-1] == a and dsts[-1] + lens[-1] == b:
                lens[-1] += length
            else:
                srcs.append(a)
                dsts.append(b)
                lens.append(length)
    return Blocks(np.array(srcs, dtype=np.uint64), np.array(dsts, dtype=np.uint64), np.array(lens, dtype=np.uint64))


def plan_few(
    src_bases: list[int], dst_bases: list[int], item_lens: list[int], src_pages: list[int], dst_pages: list[int]
) -> Blocks:
    """:func:`plan_runs` of :func:`pair_runs`: :func:`plan_blocks` in plain Python."""
    return plan_runs(src_bases, dst_bases, item_lens, pair_runs(src_pages, dst_pages))


def plan_head_slices(
    src_bases: IntVector,
    dst_bases: IntVector,
    src_item_lens: IntVector,
    dst_item_lens: IntVector,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    *,
    rows_per_page: int,
    src_heads: int,
    dst_heads: int,
    head_bytes: int,
    src_head_start: int,
    dst_head_start: int,
    head_count: int,
) -> Blocks:
    """Entries moving a head slice of every row (token) of every page, per paired buffer.

    A page is ``rows_per_page`` rows of ``heads * head_bytes``; row ``r`` of source page ``sp`` contributes
    heads ``[src_head_start, +head_count)`` to heads ``[dst_head_start, +head_count)`` of the same row of
    destination page ``dp``. One entry per (buffer, page, row) before merging adjacent entries, which
    collapses whole-row (and whole-page) copies. Vectorised by broadcasting.
    """
    sb = _as_u64(src_bases, what="src_bases")
    db = _as_u64(dst_bases, what="dst_bases")
    sl = _as_u64(src_item_lens, what="src_item_lens", positive=True)
    dl = _as_u64(dst_item_lens, what="dst_item_lens", positive=True)
    if not (sb.shape == db.shape == sl.shape == dl.shape):
        raise InvalidArgument("per-buffer arrays must have the same length")
    sp = as_index_array(src_pages, what="src_pages")
    dp = as_index_array(dst_pages, what="dst_pages")
    if sp.shape != dp.shape:
        raise InvalidArgument(f"src_pages and dst_pages differ in length ({sp.size} vs {dp.size})")
    if head_count < 1 or src_head_start + head_count > src_heads or dst_head_start + head_count > dst_heads:
        raise InvalidArgument("head slice out of range")
    if sp.size == 0 or sb.size == 0:
        return _empty_blocks()
    rows = np.arange(rows_per_page, dtype=np.uint64)
    hb = np.uint64(head_bytes)
    src_row = np.uint64(src_heads) * hb
    dst_row = np.uint64(dst_heads) * hb
    # shapes: buffers (B,1,1), pages (1,N,1), rows (1,1,R)
    src = (
        sb[:, None, None]
        + sp.astype(np.uint64)[None, :, None] * sl[:, None, None]
        + rows[None, None, :] * src_row
        + np.uint64(src_head_start) * hb
    )
    dst = (
        db[:, None, None]
        + dp.astype(np.uint64)[None, :, None] * dl[:, None, None]
        + rows[None, None, :] * dst_row
        + np.uint64(dst_head_start) * hb
    )
    src = src.reshape(-1)
    dst = dst.reshape(-1)
    length = np.full(src.shape, np.uint64(head_count) * hb, dtype=np.uint64)
    return _merge_adjacent(src, dst, length)


def units_of(pages: npt.NDArray[np.integer[Any]], k: int) -> IndexArray:
    """The units of ``pages`` when each page is ``k`` units: page ``p`` is units ``[p * k, p * k + k)``, in
    order."""
    p = np.asarray(pages, dtype=np.int64)
    if k == 1:
        return p
    return (p[:, None] * k + np.arange(k, dtype=np.int64)).reshape(-1)


def unit_span(
    src: IndexArray, dst_pages: IndexArray, start: int, src_units: int, dst_units: int, total: int
) -> tuple[IndexArray, IndexArray, int]:
    """A chunk of source pages ``src`` starting at source page ``start`` of a room, in units:
    ``(source units, destination units, first unit)``, the room's destination pages being ``dst_pages`` and
    its tokens ``total`` units (the last page on either side may be part full). With equal page sizes these
    are the pages themselves."""
    if src_units == dst_units == 1:
        return src, dst_pages[start : start + src.size], start
    first = start * src_units
    n = max(0, min(int(src.size) * src_units, total - first))
    lo, hi = first // dst_units, -(-(first + n) // dst_units)
    dst = units_of(dst_pages[lo:hi], dst_units)[first - lo * dst_units :][:n]
    return units_of(src, src_units)[:n], dst, first
