from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiotransfer._plan import (
    Blocks,
    as_index_array,
    check_range,
    check_unique,
    coalesce_runs,
    one_run,
    page_runs,
    pair_runs,
    plan_blocks,
    plan_few,
    plan_runs,
    plan_slots,
    split_blocks,
)
from aiotransfer.errors import InvalidArgument

U64 = np.uint64


def arr(*values: int) -> npt.NDArray[np.int64]:
    return np.array(values, dtype=np.int64)


def blocks_list(blocks: Blocks) -> list[tuple[int, int, int]]:
    return [(int(s), int(d), int(n)) for s, d, n in zip(blocks.src, blocks.dst, blocks.length, strict=True)]


def runs_list(*arrays: npt.NDArray[np.int64]) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in row) for row in zip(*arrays, strict=True)]


# ------------------------------------------------------------- as_index_array


class FakeTensor:
    """Stands in for a CPU torch tensor: only exposes ``__array__``."""

    def __init__(self, values: list[int]) -> None:
        self._values = values

    def __array__(self, dtype: Any = None, copy: Any = None) -> npt.NDArray[Any]:
        return np.array(self._values, dtype=np.int32 if dtype is None else dtype)


@pytest.mark.parametrize(
    "value",
    [
        [3, 1, 2],
        (3, 1, 2),
        np.array([3, 1, 2], dtype=np.int32),
        np.array([3, 1, 2], dtype=np.uint8),
        np.array([3, 1, 2], dtype=np.uint64),
        np.array([9, 3, 8, 1, 7, 2])[1::2],  # non-contiguous view
        FakeTensor([3, 1, 2]),
    ],
)
def test_as_index_array_accepts(value: object) -> None:
    out = as_index_array(value)
    assert out.dtype == np.int64
    assert out.ndim == 1
    assert out.tolist() == [3, 1, 2]


def test_as_index_array_range_and_empty() -> None:
    assert as_index_array(range(2, 6)).tolist() == [2, 3, 4, 5]
    empties: list[object] = [[], (), range(0), np.empty(0, dtype=np.int32), np.empty(0)]
    for empty in empties:
        out = as_index_array(empty)
        assert out.dtype == np.int64
        assert out.shape == (0,)


def test_as_index_array_large_input_is_vectorised() -> None:
    values = np.arange(100_000, dtype=np.int64)
    out = as_index_array(values)
    assert out.shape == (100_000,)
    assert as_index_array(values.tolist())[-1] == 99_999


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([1.0, 2.0], r"kv_indices must have an integer dtype, got float64"),
        ([True, False], r"kv_indices must have an integer dtype, got bool"),
        (["1", "2"], r"kv_indices must have an integer dtype"),
        ([1, None], r"kv_indices must have an integer dtype, got object"),
        ([[1, 2], [3, 4]], r"kv_indices must be 1-D, got shape \(2, 2\)"),
        (5, r"kv_indices must be 1-D, got shape \(\)"),
        ([[]], r"kv_indices must be 1-D"),
        ([1, -2, 3, -4], r"kv_indices must be non-negative, got -2"),
        (np.array([2**63], dtype=np.uint64), r"kv_indices value 9223372036854775808 exceeds the int64"),
        ([[1], [1, 2]], r"kv_indices cannot be read as an integer array"),
    ],
)
def test_as_index_array_rejects(value: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        as_index_array(value, what="kv_indices")


def test_invalid_argument_is_value_error() -> None:
    with pytest.raises(ValueError, match="indices must be non-negative"):
        as_index_array([-1])


# ----------------------------------------------------- check_range / unique


def test_check_range() -> None:
    check_range(arr(0, 5, 9), 10, what="dst")
    check_range(arr(), 0, what="dst")
    with pytest.raises(InvalidArgument, match=r"dst page 10 is out of range \(must be < 10\)"):
        check_range(arr(3, 10, 12), 10, what="dst")
    with pytest.raises(InvalidArgument, match=r"src page 0 is out of range \(must be < 0\)"):
        check_range(arr(0), 0, what="src")
    with pytest.raises(InvalidArgument, match=r"src page -1 is negative"):
        check_range(arr(1, -1), 4, what="src")
    with pytest.raises(InvalidArgument, match=r"num_pages must be >= 0"):
        check_range(arr(), -1, what="src")


def test_check_unique() -> None:
    check_unique(arr(), what="dst")
    check_unique(arr(4), what="dst")
    check_unique(arr(4, 1, 7), what="dst")
    with pytest.raises(InvalidArgument, match=r"dst must not repeat, page 7 appears more than once"):
        check_unique(arr(7, 1, 9, 7), what="dst")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=200))
def test_check_unique_refuses_exactly_the_lists_with_a_repeat(values: list[int]) -> None:
    """Short lists (a set) and long ones (a sort) give the same verdict, and name the smallest repeat."""
    repeats = sorted(v for v in set(values) if values.count(v) > 1)
    if not repeats:
        check_unique(np.array(values, dtype=np.int64), what="dst")
        return
    with pytest.raises(InvalidArgument, match=rf"page {repeats[0]} appears more than once"):
        check_unique(np.array(values, dtype=np.int64), what="dst")


# ------------------------------------------------------------- coalesce_runs


def test_coalesce_fully_contiguous() -> None:
    assert runs_list(*coalesce_runs(np.arange(5, 12), np.arange(100, 107))) == [(5, 100, 7)]


def test_coalesce_fully_scattered() -> None:
    src = arr(9, 3, 7, 1)
    dst = arr(0, 2, 4, 6)
    assert runs_list(*coalesce_runs(src, dst)) == [(9, 0, 1), (3, 2, 1), (7, 4, 1), (1, 6, 1)]


def test_coalesce_mixed() -> None:
    src = arr(0, 1, 2, 5, 6, 10, 11)
    dst = arr(3, 4, 5, 9, 8, 20, 21)
    assert runs_list(*coalesce_runs(src, dst)) == [(0, 3, 3), (5, 9, 1), (6, 8, 1), (10, 20, 2)]


def test_coalesce_src_contiguous_dst_not() -> None:
    src = arr(0, 1, 2, 3)
    dst = arr(7, 2, 3, 9)
    assert runs_list(*coalesce_runs(src, dst)) == [(0, 7, 1), (1, 2, 2), (3, 9, 1)]


def test_coalesce_descending_and_repeats_break() -> None:
    assert runs_list(*coalesce_runs(arr(3, 2, 2, 3), arr(0, 1, 2, 3))) == [(3, 0, 1), (2, 1, 1), (2, 2, 2)]


def test_coalesce_empty_and_single() -> None:
    for out in coalesce_runs(arr(), arr()):
        assert out.dtype == np.int64 and out.shape == (0,)
    assert runs_list(*coalesce_runs(arr(4), arr(8))) == [(4, 8, 1)]


def test_coalesce_errors() -> None:
    with pytest.raises(InvalidArgument, match=r"page counts differ: 3 != 2"):
        coalesce_runs(arr(1, 2, 3), arr(1, 2))
    with pytest.raises(InvalidArgument, match=r"must be 1-D"):
        coalesce_runs(np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64))


def test_page_runs() -> None:
    starts, lengths = page_runs(arr(4, 5, 6, 9, 1, 2, 2))
    assert runs_list(starts, lengths) == [(4, 3), (9, 1), (1, 2), (2, 1)]
    starts, lengths = page_runs(arr())
    assert starts.shape == lengths.shape == (0,)
    assert starts.dtype == lengths.dtype == np.int64


# --------------------------------------------------------------- plan_blocks


def test_plan_blocks_example() -> None:
    blocks = plan_blocks([0, 1000], [10_000, 20_000], [10, 10], arr(0, 1, 2, 5, 6), arr(3, 4, 5, 9, 8))
    assert blocks_list(blocks) == [
        (0, 10_030, 30),
        (50, 10_090, 10),
        (60, 10_080, 10),
        (1000, 20_030, 30),
        (1050, 20_090, 10),
        (1060, 20_080, 10),
    ]
    assert len(blocks) == 6
    assert blocks.nbytes == 100
    for part in blocks:
        assert part.dtype == np.uint64


def test_plan_blocks_per_buffer_item_lens() -> None:
    blocks = plan_blocks([0, 10_000], [50_000, 60_000], [4, 64], arr(2, 3), arr(7, 8))
    assert blocks_list(blocks) == [(8, 50_028, 8), (10_128, 60_448, 128)]


def test_plan_blocks_empty() -> None:
    for blocks in (
        plan_blocks([0], [0], [8], arr(), arr()),
        plan_blocks([0], [0], [8], [], []),
        plan_blocks([], [], [], arr(1), arr(2)),
    ):
        assert len(blocks) == 0
        assert blocks.nbytes == 0
        assert not blocks
        assert all(part.dtype == np.uint64 and part.shape == (0,) for part in blocks)
        assert split_blocks(blocks, 4) == []


def test_plan_blocks_huge_addresses() -> None:
    base = 2**63 + 2**40
    blocks = plan_blocks(np.array([base], dtype=np.uint64), [2**62], [4096], arr(1), arr(2))
    assert blocks_list(blocks) == [(base + 4096, 2**62 + 8192, 4096)]


def test_merge_back_to_back_buffers() -> None:
    # 2 buffers of 10 pages x 16 bytes, back to back on both sides.
    blocks = plan_blocks([0, 160], [1000, 1160], [16, 16], np.arange(10), np.arange(10))
    assert blocks_list(blocks) == [(0, 1000, 320)]


def test_merge_chains_across_many_buffers_with_different_item_lens() -> None:
    # buffers: 4 pages x 8 B at 0, 4 x 16 B at 32, 4 x 4 B at 96 (src); same shape at 500 (dst).
    src_bases = [0, 32, 96]
    dst_bases = [500, 532, 596]
    blocks = plan_blocks(src_bases, dst_bases, [8, 16, 4], np.arange(4), np.arange(4))
    assert blocks_list(blocks) == [(0, 500, 112)]


def test_merge_only_at_touching_ends() -> None:
    # Two buffers of 4 pages x 16 B, back to back on both sides (buffer 1 starts at byte 64).
    # Runs (2..3), (0): buffer 0's last entry is page 0, which does not touch buffer 1.
    blocks = plan_blocks([0, 64], [1000, 1064], [16, 16], arr(2, 3, 0), arr(2, 3, 0))
    assert blocks_list(blocks) == [(32, 1032, 32), (0, 1000, 16), (96, 1096, 32), (64, 1064, 16)]
    # Runs (0), (2..3): buffer 0's last run ends at byte 64 = buffer 1's page 0, on both sides.
    blocks = plan_blocks([0, 64], [1000, 1064], [16, 16], arr(0, 2, 3), arr(0, 2, 3))
    assert blocks_list(blocks) == [(0, 1000, 16), (32, 1032, 48), (96, 1096, 32)]


def test_no_merge_when_only_src_is_back_to_back() -> None:
    blocks = plan_blocks([0, 160], [1000, 2000], [16, 16], np.arange(10), np.arange(10))
    assert blocks_list(blocks) == [(0, 1000, 160), (160, 2000, 160)]


def test_plan_blocks_dst_item_lens() -> None:
    plain = plan_blocks([0, 100], [0, 100], [4, 8], arr(1), arr(2))
    checked = plan_blocks([0, 100], [0, 100], [4, 8], arr(1), arr(2), dst_item_lens=[4, 8])
    assert blocks_list(plain) == blocks_list(checked)
    mismatch = r"item length mismatch in buffer 1: source 8 != destination 16"
    with pytest.raises(InvalidArgument, match=mismatch):
        plan_blocks([0, 100], [0, 100], [4, 8], arr(1), arr(2), dst_item_lens=[4, 16])
    with pytest.raises(InvalidArgument, match=r"dst_item_lens has 1 entries, expected 2"):
        plan_blocks([0, 100], [0, 100], [4, 8], arr(1), arr(2), dst_item_lens=[4])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([0, 1], [0], [8, 8], arr(1), arr(1)), r"one entry per buffer, got 2, 1 and 2"),
        (([0], [0], [0], arr(1), arr(1)), r"item_lens must be positive, got 0"),
        (([-8], [0], [8], arr(1), arr(1)), r"src_bases must be non-negative, got -8"),
        (([0], [0.5], [8], arr(1), arr(1)), r"dst_bases must be integers, got dtype float64"),
        (([[0]], [[0]], [[8]], arr(1), arr(1)), r"src_bases must be 1-D"),
        (([0], [0], [8], arr(1, 2), arr(1)), r"page counts differ: 2 != 1"),
        (([0], [0], [8], arr(-1), arr(1)), r"src_pages must be non-negative, got -1"),
        (([0], [0], [8], arr(1), np.array([1.5])), r"dst_pages must have an integer dtype"),
        (([2**63 + 1], [0], [2**62], arr(1), arr(1)), r"source addresses overflow 64 bits"),
        (([0], [2**63], [2**60], arr(0), arr(8)), r"destination addresses overflow 64 bits"),
    ],
)
def test_plan_blocks_errors(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        plan_blocks(*args)


def test_plan_slots_delegates() -> None:
    slots = plan_slots([0, 4096], [8192, 12288], [64, 128], arr(3, 4), arr(0, 1))
    assert blocks_list(slots) == [(192, 8192, 128), (4480, 12288, 256)]


def test_blocks_tuple_behaviour() -> None:
    blocks = plan_blocks([0], [100], [8], arr(0, 5), arr(1, 2))
    src, dst, length = blocks  # unpacking still yields the 3 fields
    assert len(blocks) == 2
    assert blocks_list(pickle.loads(pickle.dumps(blocks))) == blocks_list(blocks)
    assert blocks_list(Blocks(src, dst, length)) == [(0, 108, 8), (40, 116, 8)]


# -------------------------------------------------------------- split_blocks


def test_split_blocks_example() -> None:
    blocks = Blocks(np.arange(5, dtype=U64), np.arange(10, 15, dtype=U64), np.ones(5, dtype=U64))
    parts = split_blocks(blocks, 2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert [blocks_list(p) for p in parts] == [
        [(0, 10, 1), (1, 11, 1)],
        [(2, 12, 1), (3, 13, 1)],
        [(4, 14, 1)],
    ]
    assert [len(p) for p in split_blocks(blocks, 5)] == [5]
    assert [len(p) for p in split_blocks(blocks, 100)] == [5]
    with pytest.raises(InvalidArgument, match=r"max_entries must be >= 1, got 0"):
        split_blocks(blocks, 0)


# ---------------------------------------------------------------- properties


def expand_blocks(blocks: Blocks) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Byte-level (src_byte, dst_byte) pairs covered by the blocks, in entry order."""
    length = blocks.length.astype(np.int64)
    total = int(length.sum())
    entry = np.repeat(np.arange(len(blocks)), length)
    first = np.cumsum(length) - length
    offset = (np.arange(total) - np.repeat(first, length)).astype(np.uint64)
    return blocks.src[entry] + offset, blocks.dst[entry] + offset


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, Any]:
    """Random buffers (often back to back) and page pairs with unique destinations.

    Modes: ``random`` pairs, ``runs`` (contiguous src, sorted dst), and ``wrap``
    (identical sorted pages that include the first and last page, so that runs
    touch the buffer ends and merge across back-to-back buffers).
    """
    nbuf = draw(st.integers(1, 4))
    item_lens = draw(st.lists(st.integers(1, 6), min_size=nbuf, max_size=nbuf))
    mode = draw(st.sampled_from(["random", "runs", "wrap"]))
    num_src = draw(st.integers(1, 24))
    num_dst = num_src if mode == "wrap" else draw(st.integers(1, 24))

    def bases(num_pages: int, start: int) -> list[int]:
        gaps = draw(st.lists(st.sampled_from([0, 0, 0, 1, 7]), min_size=nbuf, max_size=nbuf))
        out: list[int] = []
        pos = start
        for gap, il in zip(gaps, item_lens, strict=True):
            pos += gap
            out.append(pos)
            pos += num_pages * il
        return out

    if mode == "wrap":
        inner = draw(st.sets(st.integers(0, num_src - 1)))
        dst = sorted(inner | {0, num_src - 1})
        src = list(dst)
    else:
        n = draw(st.integers(1, num_dst))  # empty input has its own tests
        dst = draw(st.permutations(range(num_dst)))[:n]
        src = draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n))
        if mode == "runs":
            dst = sorted(dst)
            first = draw(st.integers(0, max(num_src - n, 0)))
            src = [first + i for i in range(n)]
            num_src = max(num_src, first + n)
    return {
        "src_bases": bases(num_src, draw(st.integers(0, 50))),
        "dst_bases": bases(num_dst, 1000 + draw(st.integers(0, 50))),
        "item_lens": item_lens,
        "src_pages": np.array(src, dtype=np.int64),
        "dst_pages": np.array(dst, dtype=np.int64),
    }


def expected_bytes(lay: dict[str, Any]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Reference (src_byte, dst_byte) pairs: every byte of every (buffer, page pair)."""
    src_parts, dst_parts = [], []
    for sb, db, il in zip(lay["src_bases"], lay["dst_bases"], lay["item_lens"], strict=True):
        offs = np.arange(il)
        src_parts.append((sb + lay["src_pages"][:, None] * il + offs).ravel())
        dst_parts.append((db + lay["dst_pages"][:, None] * il + offs).ravel())
    return np.concatenate(src_parts), np.concatenate(dst_parts)


@settings(deadline=None, max_examples=300)
@given(layouts())
def test_property_plan_few_equals_plan_blocks(lay: dict[str, Any]) -> None:
    """The plain-Python planner for small chunks gives exactly the NumPy planner's entries, in order."""
    few = plan_few(*(list(map(int, lay[k])) for k in ("src_bases", "dst_bases", "item_lens", "src_pages", "dst_pages")))
    ref = plan_blocks(**lay)
    for got, want in zip(few, ref, strict=True):
        assert got.dtype == want.dtype == np.uint64
        assert got.tolist() == want.tolist()


@settings(deadline=None, max_examples=300)
@given(layouts())
def test_property_blocks_cover_exact_byte_mapping(lay: dict[str, Any]) -> None:
    blocks = plan_blocks(**lay, dst_item_lens=lay["item_lens"])
    n = len(lay["dst_pages"])
    assert blocks.nbytes == n * sum(lay["item_lens"])
    assert np.all(blocks.length > 0)

    got_src, got_dst = expand_blocks(blocks)
    exp_src, exp_dst = expected_bytes(lay)
    # Destination bytes are unique, so sorting by destination is canonical.
    got_order = np.argsort(got_dst, kind="stable")
    exp_order = np.argsort(exp_dst, kind="stable")
    assert got_dst[got_order].astype(np.int64).tolist() == exp_dst[exp_order].tolist()
    assert got_src[got_order].astype(np.int64).tolist() == exp_src[exp_order].tolist()

    # No two destination ranges overlap.
    order = np.argsort(blocks.dst, kind="stable")
    d, ln = blocks.dst[order], blocks.length[order]
    assert np.all(d[:-1] + ln[:-1] <= d[1:])

    # Entries are maximal: no consecutive pair could be merged further.
    s, d, ln = blocks
    assert not np.any((s[:-1] + ln[:-1] == s[1:]) & (d[:-1] + ln[:-1] == d[1:]))

    # Merging only ever removes entries.
    runs = coalesce_runs(lay["src_pages"], lay["dst_pages"])[2]
    assert len(blocks) <= len(lay["item_lens"]) * len(runs)


@settings(deadline=None, max_examples=200)
@given(layouts())
def test_property_separate_buffers_are_buffer_major(lay: dict[str, Any]) -> None:
    # Put a gap in front of every buffer so no cross-buffer merge can happen.
    for key in ("src_bases", "dst_bases"):
        lay[key] = [b + 1 + i for i, b in enumerate(lay[key])]
    blocks = plan_blocks(**lay)
    s0, d0, rl = coalesce_runs(lay["src_pages"], lay["dst_pages"])
    expected = [
        (sb + int(s) * il, db + int(d) * il, int(r) * il)
        for sb, db, il in zip(lay["src_bases"], lay["dst_bases"], lay["item_lens"], strict=True)
        for s, d, r in zip(s0, d0, rl, strict=True)
    ]
    assert blocks_list(blocks) == expected


page_lists = st.lists(st.integers(0, 12), max_size=40)


@settings(deadline=None)
@given(st.data())
def test_property_coalesce_runs_roundtrip(data: st.DataObject) -> None:
    src = np.array(data.draw(page_lists), dtype=np.int64)
    n = len(src)
    dst = np.array(data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)), dtype=np.int64)
    s0, d0, rl = coalesce_runs(src, dst)
    assert np.all(rl >= 1)
    assert int(rl.sum()) == len(src)
    rebuilt_src = [p for s, r in zip(s0.tolist(), rl.tolist(), strict=True) for p in range(s, s + r)]
    rebuilt_dst = [p for d, r in zip(d0.tolist(), rl.tolist(), strict=True) for p in range(d, d + r)]
    assert rebuilt_src == src.tolist()
    assert rebuilt_dst == dst.tolist()
    # maximal: the next run never continues both sides of the previous one
    ends_s, ends_d = s0[:-1] + rl[:-1], d0[:-1] + rl[:-1]
    assert not np.any((ends_s == s0[1:]) & (ends_d == d0[1:]))


@settings(deadline=None, max_examples=300)
@given(st.data())
def test_property_pair_runs_equals_coalesce_runs(data: st.DataObject) -> None:
    """The plain-Python runs (with their one-run shortcut) are exactly the NumPy ones, also for lists that
    start and end like one run without being one (``[4, 6, 5, 7]``)."""
    n = data.draw(st.integers(1, 40))
    s0, d0 = data.draw(st.integers(0, 100)), data.draw(st.integers(0, 100))
    mode = data.draw(st.sampled_from(["run", "swapped", "random"]))
    src, dst = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    if mode == "swapped" and n >= 4:
        i = data.draw(st.integers(1, n - 3))
        side = data.draw(st.sampled_from([src, dst]))
        side[i], side[i + 1] = side[i + 1], side[i]
    elif mode == "random":
        src = data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    runs = pair_runs(src, dst)
    s, d, r = coalesce_runs(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
    assert runs == [list(x) for x in zip(s.tolist(), d.tolist(), r.tolist(), strict=True)]


@settings(deadline=None, max_examples=300)
@given(st.data())
def test_property_one_run_is_pair_runs_when_there_is_one(data: st.DataObject) -> None:
    """The NumPy shortcut for long chunks answers exactly when the chunk is one run on both sides."""
    n = data.draw(st.integers(0, 40))
    s0, d0 = data.draw(st.integers(0, 100)), data.draw(st.integers(0, 100))
    src, dst = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    if data.draw(st.booleans()) and n >= 4:  # same ends, not one run
        i = data.draw(st.integers(1, n - 3))
        side = data.draw(st.sampled_from([src, dst]))
        side[i], side[i + 1] = side[i + 1], side[i]
    if data.draw(st.booleans()) and n >= 2:  # a break
        dst[-1] += data.draw(st.integers(1, 3))
    runs = pair_runs(src, dst)
    got = one_run(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
    assert got == (runs if n >= 2 and len(runs) == 1 else None)


def test_pair_runs_length_mismatch() -> None:
    with pytest.raises(ValueError):
        pair_runs([1, 2, 3], [1, 2])


@settings(deadline=None)
@given(page_lists)
def test_property_page_runs_roundtrip(pages: list[int]) -> None:
    starts, lengths = page_runs(np.array(pages, dtype=np.int64))
    rebuilt = [p for s, r in zip(starts.tolist(), lengths.tolist(), strict=True) for p in range(s, s + r)]
    assert rebuilt == pages
    assert not np.any(starts[:-1] + lengths[:-1] == starts[1:])


@settings(deadline=None)
@given(st.integers(0, 50), st.integers(1, 20))
def test_property_split_blocks(num: int, max_entries: int) -> None:
    blocks = Blocks(
        np.arange(num, dtype=U64) * U64(3),
        np.arange(num, dtype=U64) * U64(5),
        np.arange(1, num + 1, dtype=U64),
    )
    parts = split_blocks(blocks, max_entries)
    assert all(1 <= len(p) <= max_entries for p in parts)
    assert all(len(p) == max_entries for p in parts[:-1])
    assert len(parts) == -(-num // max_entries)
    for i, field in enumerate(("src", "dst", "length")):
        joined = np.concatenate([p[i] for p in parts]) if parts else np.empty(0, dtype=U64)
        assert joined.tolist() == getattr(blocks, field).tolist()
    assert sum(p.nbytes for p in parts) == blocks.nbytes


def _byte_map(blocks: Any) -> dict[int, int]:
    """Every source byte address -> the destination byte address it is written to."""
    out: dict[int, int] = {}
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist(), strict=True):
        for k in range(n):
            assert s + k not in out, "a byte is written twice"
            out[s + k] = d + k
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_layer_plans_together_move_exactly_the_chunk(data: st.DataObject) -> None:
    """Layer streaming plans each layer's buffers of a chunk on its own (plain Python for small plans):
    over all layers, the same bytes go to the same places as the chunk's plan in one piece, however the
    buffers are laid out in memory (adjacent buffers included) and however the pages run."""
    nbuf = data.draw(st.integers(1, 6))
    layers = data.draw(st.integers(1, nbuf))
    owners = [b % layers for b in range(nbuf)]
    lens = data.draw(st.lists(st.integers(1, 24), min_size=nbuf, max_size=nbuf))
    pages = 12
    gap = data.draw(st.sampled_from([0, 7]))  # 0: buffers back to back, so the whole plan may merge them
    src_bases, dst_bases, at_s, at_d = [], [], 4096, 1 << 20
    for n in lens:
        src_bases.append(at_s)
        dst_bases.append(at_d)
        at_s += n * pages + gap
        at_d += n * pages + gap
    count = data.draw(st.integers(1, pages))
    src = data.draw(st.permutations(range(pages)))[:count]
    dst = data.draw(st.permutations(range(pages)))[:count]
    whole = _byte_map(plan_blocks(np.array(src_bases, np.uint64), np.array(dst_bases, np.uint64),
                                  np.array(lens, np.uint64), np.array(src), np.array(dst)))
    runs = pair_runs(list(src), list(dst))
    parts: dict[int, int] = {}
    for layer in range(layers):
        pick = [b for b in range(nbuf) if owners[b] == layer]
        part = _byte_map(plan_runs([src_bases[b] for b in pick], [dst_bases[b] for b in pick],
                                   [lens[b] for b in pick], runs))
        assert not parts.keys() & part.keys(), "two layers write the same byte"
        parts.update(part)
    assert parts == whole
