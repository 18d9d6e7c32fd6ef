"""Token re-layout between page geometries, against a naive per-token reference.

The reference computes every byte offset from the layout definitions (one buffer per plane; one buffer
whose pages hold 2L sub-blocks; two buffers whose pages hold L sub-blocks; NHD or HND inside a sub-block)
and copies head by head in Python loops. It never uses :func:`plane_views`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiotransfer import _convert as convert
from aiotransfer._convert import (
    PageGeometry,
    _page_rows,
    check_convertible,
    convert_tokens,
    gather_tokens,
    plane_views,
    scatter_tokens,
    stream_nbytes,
)
from aiotransfer.errors import InvalidArgument
from benchmarks.conversion import conversion_bench, format_rows

LAYOUTS = ["layer_first", "page_first", "page_first_kv_split"]


# ----------------------------------------------------------------------------------------------------
# the reference
# ----------------------------------------------------------------------------------------------------
def ref_planes(geo: PageGeometry) -> int:
    return geo.num_layers if geo.layout == "mla" else 2 * geo.num_layers


def ref_buffer_sizes(geo: PageGeometry, num_pages: int) -> list[int]:
    block = geo.page_size * geo.heads * geo.head_bytes
    layers = geo.num_layers
    if geo.layout in ("layer_first", "mla"):
        return [num_pages * block] * ref_planes(geo)
    if geo.layout == "page_first":
        return [num_pages * 2 * layers * block]
    return [num_pages * layers * block] * 2


def ref_offset(geo: PageGeometry, plane: int, page: int, row: int, head: int) -> tuple[int, int]:
    """(buffer, byte offset) of one head of one token row of one page of one plane."""
    block = geo.page_size * geo.heads * geo.head_bytes
    if geo.head_order == "NHD":
        inner = (row * geo.heads + head) * geo.head_bytes
    else:
        inner = (head * geo.page_size + row) * geo.head_bytes
    layers = geo.num_layers
    if geo.layout in ("layer_first", "mla"):
        return plane, page * block + inner
    if geo.layout == "page_first":
        return 0, page * 2 * layers * block + plane * block + inner
    kv, layer = divmod(plane, layers)
    return kv, page * layers * block + layer * block + inner


def ref_gather(bufs, geo, pages, t0, t1, head_start, head_count) -> bytes:
    hb = geo.head_bytes
    out = bytearray()
    for plane in range(ref_planes(geo)):
        for t in range(t0, t1):
            page, row = pages[t // geo.page_size], t % geo.page_size
            for head in range(head_start, head_start + head_count):
                b, off = ref_offset(geo, plane, page, row, head)
                out += bufs[b][off : off + hb].tobytes()
    return bytes(out)


def ref_scatter(bufs, geo, pages, t0, t1, head_start, head_count, stream: bytes) -> None:
    hb = geo.head_bytes
    pos = 0
    for plane in range(ref_planes(geo)):
        for t in range(t0, t1):
            page, row = pages[t // geo.page_size], t % geo.page_size
            for head in range(head_start, head_start + head_count):
                b, off = ref_offset(geo, plane, page, row, head)
                bufs[b][off : off + hb] = np.frombuffer(stream[pos : pos + hb], dtype=np.uint8)
                pos += hb
    assert pos == len(stream)


def random_buffers(geo: PageGeometry, num_pages: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Bytes 1..255, never the sentinel 0 the destinations start with."""
    return [rng.integers(1, 256, size=n, dtype=np.uint8) for n in ref_buffer_sizes(geo, num_pages)]


def zero_buffers(geo: PageGeometry, num_pages: int) -> list[np.ndarray]:
    return [np.zeros(n, dtype=np.uint8) for n in ref_buffer_sizes(geo, num_pages)]


# ----------------------------------------------------------------------------------------------------
# hypothesis cases
# ----------------------------------------------------------------------------------------------------
@dataclass
class Side:
    geo: PageGeometry
    pages: list[int]
    pool: int
    head_start: int


@dataclass
class Case:
    src: Side
    dst: Side
    t0: int
    t1: int
    head_count: int
    seed: int


@st.composite
def sides(draw, *, layers: int, head_bytes: int, head_count: int, t1: int, mla: bool) -> Side:
    layout = "mla" if mla else draw(st.sampled_from(LAYOUTS))
    heads = head_count if mla else draw(st.integers(head_count, 4))
    geo = PageGeometry(
        layout,
        draw(st.sampled_from(["NHD", "HND"])),
        draw(st.sampled_from([1, 2, 4, 8, 16])),
        heads,
        head_bytes,
        layers,
    )
    room = math.ceil(t1 / geo.page_size) + draw(st.integers(0, 2))
    pool = room + draw(st.integers(0, 3))
    pages = draw(st.permutations(range(pool)))[:room]
    return Side(geo, list(pages), pool, draw(st.integers(0, heads - head_count)))


@st.composite
def cases(draw) -> Case:
    layers, head_bytes = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    mla = draw(st.integers(0, 4)) == 0
    head_count = draw(st.integers(1, 2)) if mla else draw(st.integers(1, 4))
    t1 = draw(st.integers(0, 40))
    t0 = draw(st.integers(0, t1))
    kw = dict(layers=layers, head_bytes=head_bytes, head_count=head_count, t1=t1, mla=mla)
    return Case(draw(sides(**kw)), draw(sides(**kw)), t0, t1, head_count, draw(st.integers(0, 2**32 - 1)))


def run_gather(case: Case, bufs) -> np.ndarray:
    s = case.src
    out = np.empty(
        stream_nbytes(ref_planes(s.geo), case.t0, case.t1, case.head_count, s.geo.head_bytes), np.uint8
    )
    planes = plane_views(bufs, s.geo)
    gather_tokens(planes, s.pages, s.geo.page_size, case.t0, case.t1, s.head_start, case.head_count, out)
    return out


@settings(max_examples=500, deadline=None)
@given(cases())
def test_gather_equals_reference_stream(case: Case) -> None:
    s = case.src
    bufs = random_buffers(s.geo, s.pool, np.random.default_rng(case.seed))
    before = [b.copy() for b in bufs]
    out = run_gather(case, bufs)
    assert out.tobytes() == ref_gather(bufs, s.geo, s.pages, case.t0, case.t1, s.head_start, case.head_count)
    assert all(np.array_equal(a, b) for a, b in zip(before, bufs, strict=True))


@settings(max_examples=500, deadline=None)
@given(cases())
def test_gather_then_scatter_writes_exactly_the_reference_bytes(case: Case) -> None:
    s, d = case.src, case.dst
    assert check_convertible(s.geo, d.geo) is None
    src_bufs = random_buffers(s.geo, s.pool, np.random.default_rng(case.seed))
    stream = run_gather(case, src_bufs)
    dst_bufs = zero_buffers(d.geo, d.pool)
    scatter_tokens(
        plane_views(dst_bufs, d.geo),
        d.pages,
        d.geo.page_size,
        case.t0,
        case.t1,
        d.head_start,
        case.head_count,
        stream,
    )
    expected = zero_buffers(d.geo, d.pool)
    ref = ref_gather(src_bufs, s.geo, s.pages, case.t0, case.t1, s.head_start, case.head_count)
    ref_scatter(expected, d.geo, d.pages, case.t0, case.t1, d.head_start, case.head_count, ref)
    # equal everywhere: the right bytes where the reference writes, the sentinel everywhere else
    for got, want in zip(dst_bufs, expected, strict=True):
        np.testing.assert_array_equal(got, want)

    direct = zero_buffers(d.geo, d.pool)
    convert_tokens(
        plane_views(src_bufs, s.geo), s.pages, s.geo.page_size,
        plane_views(direct, d.geo), d.pages, d.geo.page_size, case.t0, case.t1,
        src_head_start=s.head_start, dst_head_start=d.head_start, head_count=case.head_count,
    )  # fmt: skip
    for got, want in zip(direct, expected, strict=True):
        np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------------------------------
# negative control: the property can fail
# ----------------------------------------------------------------------------------------------------
def test_reference_tells_hnd_from_nhd() -> None:
    hnd = PageGeometry("layer_first", "HND", 4, 2, 2, 1)
    nhd = PageGeometry("layer_first", "NHD", 4, 2, 2, 1)
    bufs = random_buffers(hnd, 3, np.random.default_rng(1))
    pages = [2, 0]
    want = ref_gather(bufs, hnd, pages, 1, 7, 0, 2)
    out = np.empty(len(want), np.uint8)
    gather_tokens(plane_views(bufs, nhd), pages, 4, 1, 7, 0, 2, out)  # read with the wrong order
    assert out.tobytes() != want
    gather_tokens(plane_views(bufs, hnd), pages, 4, 1, 7, 0, 2, out)
    assert out.tobytes() == want

    # and a scatter with the wrong geometry fails the byte-for-byte comparison
    got, expected = zero_buffers(hnd, 3), zero_buffers(hnd, 3)
    ref_scatter(expected, hnd, pages, 1, 7, 0, 2, want)
    scatter_tokens(plane_views(got, nhd), pages, 4, 1, 7, 0, 2, out)
    assert not all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_reference_tells_page_first_from_kv_split() -> None:
    pf = PageGeometry("page_first", "NHD", 2, 1, 1, 2)
    split = PageGeometry("page_first_kv_split", "NHD", 2, 1, 1, 2)
    (whole,) = random_buffers(pf, 2, np.random.default_rng(2))
    halves = [whole[: whole.size // 2], whole[whole.size // 2 :]]
    assert ref_gather([whole], pf, [1, 0], 0, 4, 0, 1) != ref_gather(halves, split, [1, 0], 0, 4, 0, 1)


# ----------------------------------------------------------------------------------------------------
# plane views
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [*LAYOUTS, "mla"])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_plane_views_are_zero_copy_and_canonical(layout: str, order: str) -> None:
    geo = PageGeometry(layout, order, 4, 3, 2, 2)
    bufs = zero_buffers(geo, 5)
    planes = plane_views(bufs, geo)
    assert len(planes) == ref_planes(geo)
    for p, plane in enumerate(planes):
        assert plane.shape == (5, 4, 3, 2)
        plane[3, 2, 1, :] = p + 1
        b, off = ref_offset(geo, p, 3, 2, 1)
        assert bufs[b][off : off + 2].tolist() == [p + 1, p + 1]
    assert sum(int(np.count_nonzero(b)) for b in bufs) == 2 * len(planes)


def test_fast_path_covers_token_major_pages() -> None:
    for layout in LAYOUTS:
        geo = PageGeometry(layout, "NHD", 4, 3, 2, 2)
        assert all(_page_rows(p) is not None for p in plane_views(zero_buffers(geo, 5), geo))
    hnd = PageGeometry("page_first", "HND", 4, 3, 2, 2)
    assert all(_page_rows(p) is None for p in plane_views(zero_buffers(hnd, 5), hnd))
    one_head = PageGeometry("page_first", "HND", 4, 1, 2, 2)  # HND with one head is token-major
    assert all(_page_rows(p) is not None for p in plane_views(zero_buffers(one_head, 5), one_head))


@pytest.mark.parametrize("bounce", [1, 100, 10**6])
def test_strided_gather_in_bounce_chunks(monkeypatch: pytest.MonkeyPatch, bounce: int) -> None:
    monkeypatch.setattr(convert, "_BOUNCE_BYTES", bounce)  # 1 or 3 pages per step, or all at once
    for geo, hs, hc in [
        (PageGeometry("page_first", "HND", 4, 3, 8, 2), 0, 3),
        (PageGeometry("layer_first", "NHD", 4, 3, 8, 1), 1, 2),
    ]:
        bufs = random_buffers(geo, 12, np.random.default_rng(3))
        pages = [7, 2, 11, 0, 5, 9, 1, 3]
        out = np.empty(stream_nbytes(geo.num_planes, 3, 30, hc, 8), np.uint8)
        gather_tokens(plane_views(bufs, geo), pages, 4, 3, 30, hs, hc, out)
        assert out.tobytes() == ref_gather(bufs, geo, pages, 3, 30, hs, hc)


def test_plane_views_validation() -> None:
    geo = PageGeometry("layer_first", "NHD", 4, 2, 2, 2)
    good = zero_buffers(geo, 3)
    with pytest.raises(InvalidArgument, match="needs 4 buffers, got 3"):
        plane_views(good[:3], geo)
    with pytest.raises(InvalidArgument, match="not a whole number of 16-byte pages"):
        plane_views([*good[:3], np.zeros(40, np.uint8)], geo)
    with pytest.raises(InvalidArgument, match="buffer 2 holds 4 pages, buffer 0 holds 3"):
        plane_views([good[0], good[1], np.zeros(64, np.uint8), good[3]], geo)
    with pytest.raises(InvalidArgument, match="1-D uint8"):
        plane_views([*good[:3], np.zeros(12, np.int32)], geo)
    with pytest.raises(InvalidArgument, match="1-D uint8"):
        plane_views([*good[:3], np.zeros((3, 16), np.uint8)], geo)
    with pytest.raises(InvalidArgument, match="contiguous"):
        plane_views([*good[:3], np.zeros(96, np.uint8)[::2]], geo)
    with pytest.raises(InvalidArgument, match="NumPy array"):
        plane_views([*good[:3], bytearray(48)], geo)  # type: ignore[list-item]
    pf = PageGeometry("page_first", "NHD", 4, 2, 2, 2)
    with pytest.raises(InvalidArgument, match="needs 1 buffers, got 2"):
        plane_views(good[:2], pf)
    with pytest.raises(InvalidArgument, match=r"64-byte pages \(4 x 4 tokens x 2 heads x 2 bytes\)"):
        plane_views([np.zeros(100, np.uint8)], pf)


def test_geometry_validation() -> None:
    with pytest.raises(InvalidArgument, match="unknown KV layout 'paged'"):
        PageGeometry("paged", "NHD", 16, 8, 256, 32)
    with pytest.raises(InvalidArgument, match="unknown head order 'NDH'"):
        PageGeometry("layer_first", "NDH", 16, 8, 256, 32)
    with pytest.raises(InvalidArgument, match="page_size must be a positive integer"):
        PageGeometry("layer_first", "NHD", 0, 8, 256, 32)
    geo = PageGeometry("page_first_kv_split", "HND", 16, 8, 256, 32)
    assert (geo.num_planes, geo.num_buffers, geo.page_bytes) == (64, 2, 32 * 16 * 8 * 256)


# ----------------------------------------------------------------------------------------------------
# gather / scatter argument checks
# ----------------------------------------------------------------------------------------------------
def test_gather_scatter_validation() -> None:
    geo = PageGeometry("layer_first", "NHD", 4, 2, 2, 1)
    planes = plane_views(zero_buffers(geo, 3), geo)
    out = np.empty(stream_nbytes(2, 0, 6, 2, 2), np.uint8)
    with pytest.raises(InvalidArgument, match="need 2 pages of 4 tokens, the room has 1"):
        gather_tokens(planes, [0], 4, 0, 6, 0, 2, out)
    with pytest.raises(InvalidArgument, match="page 3 is out of range"):
        gather_tokens(planes, [0, 3], 4, 0, 6, 0, 2, out)
    with pytest.raises(InvalidArgument, match="non-negative"):
        gather_tokens(planes, [0, -1], 4, 0, 6, 0, 2, out)
    with pytest.raises(InvalidArgument, match=r"heads \[1, 3\) are not within the planes' 2 heads"):
        gather_tokens(planes, [0, 1], 4, 0, 6, 1, 2, out)
    with pytest.raises(InvalidArgument, match="need 48"):
        gather_tokens(planes, [0, 1], 4, 0, 6, 0, 2, out[:-1])
    with pytest.raises(InvalidArgument, match="does not match the planes' 4 rows"):
        gather_tokens(planes, [0, 1], 8, 0, 6, 0, 2, out)
    with pytest.raises(InvalidArgument, match="0 <= t0 <= t1"):
        gather_tokens(planes, [0, 1], 4, 5, 4, 0, 2, out)
    with pytest.raises(InvalidArgument, match="contiguous uint8"):
        gather_tokens(planes, [0, 1], 4, 0, 6, 0, 2, out.view(np.int8))
    frozen = [p.copy() for p in planes]
    frozen[1].flags.writeable = False
    with pytest.raises(InvalidArgument, match="plane 1 is read-only"):
        scatter_tokens(frozen, [0, 1], 4, 0, 6, 0, 2, out)
    # a rejected scatter writes nothing, even if only its last pages are bad
    src = np.full(out.size, 9, np.uint8)
    with pytest.raises(InvalidArgument, match="page 5 is out of range"):
        scatter_tokens(planes, [0, 5], 4, 0, 6, 0, 2, src)
    assert not any(p.any() for p in planes)


def test_empty_range_moves_nothing() -> None:
    geo = PageGeometry("page_first", "HND", 4, 2, 2, 1)
    planes = plane_views(zero_buffers(geo, 2), geo)
    gather_tokens(planes, [], 4, 0, 0, 0, 2, np.empty(0, np.uint8))
    scatter_tokens(planes, [1], 4, 3, 3, 0, 2, np.empty(0, np.uint8))


# ----------------------------------------------------------------------------------------------------
# check_convertible
# ----------------------------------------------------------------------------------------------------
def g(layout="layer_first", order="NHD", page_size=16, heads=8, head_bytes=256, layers=32) -> PageGeometry:
    return PageGeometry(layout, order, page_size, heads, head_bytes, layers)


def test_check_convertible_accepts() -> None:
    assert check_convertible(g(page_size=16), g(page_size=64)) is None
    assert check_convertible(g(page_size=64), g("page_first", "HND", page_size=1)) is None
    assert check_convertible(g("page_first_kv_split"), g(heads=4)) is None  # head-sliced (TP mismatch)
    assert check_convertible(g("mla", heads=1, head_bytes=1152), g("mla", "HND", 64, 1, 1152)) is None


def test_check_convertible_refusals() -> None:
    assert (
        check_convertible(g(page_size=16), g(page_size=24))
        == "page sizes 16 and 24: one must divide the other"
    )
    assert "page sizes 24 and 16" in (check_convertible(g(page_size=24), g(page_size=16)) or "")
    assert "MLA cannot pair with non-MLA" in (check_convertible(g("mla", heads=1, layers=64), g()) or "")
    assert "plane counts differ: source 64 (32 layers), destination 62 (31 layers)" == check_convertible(
        g(), g(layers=31)
    )
    assert "bytes per head differ: source 256, destination 128" == check_convertible(g(), g(head_bytes=128))
    assert "MLA token sizes differ" in (check_convertible(g("mla", heads=1), g("mla", heads=2)) or "")


# ----------------------------------------------------------------------------------------------------
# the bench tool (structure only)
# ----------------------------------------------------------------------------------------------------
def test_conversion_bench_rows() -> None:
    rows = conversion_bench(tokens=100, repeat=1, layers=2)
    assert [r["name"][:3] for r in rows] == ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)"]
    for row in rows:
        assert {
            "name",
            "gb_s",
            "ratio",
            "gather_gb_s",
            "scatter_gb_s",
            "bytes",
            "tokens",
            "layers",
            "note",
        } <= set(row)
        assert row["verified"] is True
        assert row["gb_s"] > 0 and row["layers"] == 2 and row["note"] == "2 of 32 layers"
    assert rows[0]["ratio"] == 1.0
    assert rows[1]["bytes"] == 4 * 100 * 8 * 256
    assert "(f) layer_first -> page_first" in format_rows(rows)


def test_conversion_suite_from_the_benchmarks_cli(tmp_path: Path) -> None:
    out = tmp_path / "conversion.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "conversion", "--quick",
                           "--out", str(out)], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 6 and all(r["verified"] and r["gb_s"] > 0 for r in rows)
    assert "(e) NHD -> HND" in proc.stdout
