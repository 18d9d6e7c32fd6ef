"""Re-lay out KV tokens between two page geometries (pure, vectorised NumPy).

Two processes may page the same KV differently: another page size, head-major instead of token-major
blocks, one buffer per layer instead of one per page. Tokens then move as a *stream*: the sender gathers
them out of its pages with its geometry, the receiver scatters the stream into its pages with its own.

A *plane* is the KV of one (K or V, layer) pair; canonical plane order is ``p = kv * L + l`` (every K
layer, then every V layer), one plane per layer for MLA. Seen canonically a plane is an array
``(num_pages, page_size, heads, head_bytes)``; token ``t`` of a room with page list ``pages`` sits at page
``pages[t // page_size]``, row ``t % page_size``. The stream is laid out ``(plane, token, head, byte)``.

* :class:`PageGeometry`     -- how one side pages its KV (layout, head order, page size, heads, layers)
* :func:`check_convertible` -- None if tokens can move between two geometries, else the reason
* :func:`plane_views`       -- zero-copy canonical plane views of one rank's host buffers
* :func:`stream_nbytes`     -- size of the token stream for a token range and head slice
* :func:`gather_tokens`     -- tokens ``[t0, t1)`` (a head slice of them) of every plane -> stream
* :func:`scatter_tokens`    -- the inverse: stream -> planes
* :func:`convert_tokens`    -- both, within one process

Copies work page by page in bulk: whole pages of a token-major plane move with one ``np.take`` (gather) or
one fancy-index assignment (scatter); partial first and last pages are sliced; head-major and head-sliced
planes go through a cache-sized bounce buffer, a few pages at a time. Nothing loops per token in Python.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from ._layout import KVLayout
from ._plan import IndexArray, as_index_array, check_range
from .errors import InvalidArgument

__all__ = [
    "HeadOrder",
    "PageGeometry",
    "check_convertible",
    "page_geometry",
    "plane_views",
    "stream_nbytes",
    "gather_tokens",
    "scatter_tokens",
    "convert_tokens",
]

ByteArray: TypeAlias = npt.NDArray[np.uint8]
"""A uint8 NumPy array (a host buffer, a plane view, a token stream)."""
Pages: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
"""A room's page list: token ``t`` lives in page ``pages[t // page_size]``."""

_BOUNCE_BYTES = 256 * 1024
"""Bytes gathered per step through strided views: the temporary stays in the CPU cache."""


class HeadOrder(str, enum.Enum):
    """Order of rows and heads inside one (sub-)block of a page."""

    NHD = "NHD"
    """Token-major: ``(page_size, heads, head_bytes)``."""
    HND = "HND"
    """Head-major: ``(heads, page_size, head_bytes)``."""


@dataclass(frozen=True)
class PageGeometry:
    """How one rank pages its KV cache.

    ``layout`` is a :class:`~aiotransfer._layout.KVLayout` value and ``head_order`` a :class:`HeadOrder`
    value (enum members or their strings; stored as strings). ``head_bytes`` is the size of one head of one
    token (``head_dim x`` element size; the latent size for MLA).
    """

    layout: str
    head_order: str
    page_size: int
    heads: int
    head_bytes: int
    num_layers: int

    def __post_init__(self) -> None:
        try:
            layout = KVLayout(self.layout).value
        except ValueError:
            known = ", ".join(repr(k.value) for k in KVLayout)
            raise InvalidArgument(f"unknown KV layout {self.layout!r}; expected one of {known}") from None
        try:
            order = HeadOrder(self.head_order).value
        except ValueError:
            raise InvalidArgument(
                f"unknown head order {self.head_order!r}; expected 'NHD' or 'HND'"
            ) from None
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "head_order", order)
        for name in ("page_size", "heads", "head_bytes", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise InvalidArgument(f"PageGeometry.{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))

    @property
    def is_mla(self) -> bool:
        return self.layout == KVLayout.MLA.value

    @property
    def num_planes(self) -> int:
        """``2 x num_layers`` (K and V), or ``num_layers`` for MLA."""
        return self.num_layers if self.is_mla else 2 * self.num_layers

    @property
    def planes_per_buffer(self) -> int:
        """Sub-blocks per page of one buffer: 1 (layer-first, MLA), 2L (page-first), L (K/V split)."""
        if self.layout == KVLayout.PAGE_FIRST.value:
            return 2 * self.num_layers
        if self.layout == KVLayout.PAGE_FIRST_KV_SPLIT.value:
            return self.num_layers
        return 1

    @property
    def num_buffers(self) -> int:
        return self.num_planes // self.planes_per_buffer

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one plane (every head)."""
        return self.heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one page of one plane."""
        return self.page_size * self.token_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one buffer (its item length)."""
        return self.planes_per_buffer * self.block_bytes


def page_geometry(
    layout: str, head_order: str, page_size: int, kv_heads: int, item_lens: Sequence[int], num_layers: int
) -> PageGeometry | str:
    """The geometry of one rank's pages from what it declares (``KVArgs``, or a peer's registration).

    Args:
        layout: The KV layout's name.
        head_order: ``NHD`` or ``HND``.
        page_size: Tokens per page.
        kv_heads: KV heads in a page.
        item_lens: Bytes per page of each KV buffer.
        num_layers: Layers (0: one buffer per plane).

    Returns:
        The geometry, or the reason when that does not describe whole heads of every token.
    """
    if not kv_heads:
        return "kv_heads is not set, so the heads inside a page are unknown"
    paged_layers = layout in (KVLayout.PAGE_FIRST.value, KVLayout.PAGE_FIRST_KV_SPLIT.value)
    if paged_layers and not num_layers:
        return f"num_layers is not set for the {layout} layout"
    layers = num_layers or (len(item_lens) if layout == KVLayout.MLA.value else len(item_lens) // 2)
    per_buffer = (2 * layers if layout == KVLayout.PAGE_FIRST.value else layers) if paged_layers else 1
    item = item_lens[0] if item_lens else 0
    per_head = per_buffer * page_size * kv_heads
    if layers < 1 or not item or item % per_head or any(n != item for n in item_lens):
        return f"KV pages of {item} bytes are not {per_buffer} x {page_size} tokens x {kv_heads} heads"
    try:
        return PageGeometry(layout, head_order, page_size, kv_heads, item // per_head, layers)
    except InvalidArgument as exc:
        return str(exc)


def check_convertible(src: PageGeometry, dst: PageGeometry) -> str | None:
    """Whether tokens can move from ``src`` pages to ``dst`` pages.

    Layouts and head orders may differ freely. Both sides need the same planes and the same bytes per
    head; head counts may differ (a head-sliced transfer between TP sizes: the caller picks the slice),
    except for MLA, which is never head-sliced. One page size must divide the other.

    Args:
        src: The source geometry.
        dst: The destination geometry.

    Returns:
        None if they pair, else a human-readable reason.
    """
    if src.is_mla != dst.is_mla:
        return f"MLA cannot pair with non-MLA: source layout {src.layout!r}, destination {dst.layout!r}"
    if src.num_planes != dst.num_planes:
        return (
            f"plane counts differ: source {src.num_planes} ({src.num_layers} layers), "
            f"destination {dst.num_planes} ({dst.num_layers} layers)"
        )
    if src.head_bytes != dst.head_bytes:
        return f"bytes per head differ: source {src.head_bytes}, destination {dst.head_bytes}"
    if src.is_mla and src.heads != dst.heads:
        return f"MLA token sizes differ: source {src.token_bytes} bytes, destination {dst.token_bytes}"
    small, large = sorted((src.page_size, dst.page_size))
    if large % small:
        return f"page sizes {src.page_size} and {dst.page_size}: one must divide the other"
    return None


def _check_buffer(buf: object, b: int) -> ByteArray:
    if not isinstance(buf, np.ndarray):
        raise InvalidArgument(f"buffer {b} must be a NumPy array, got {type(buf).__name__}")
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise InvalidArgument(f"buffer {b} must be a 1-D uint8 array, got {buf.ndim}-D {buf.dtype}")
    if not buf.flags.c_contiguous:
        raise InvalidArgument(f"buffer {b} must be contiguous (a view of registered memory)")
    return buf


def plane_views(buffers: Sequence[ByteArray], geo: PageGeometry) -> list[ByteArray]:
    """Zero-copy views of every plane in canonical order, each ``(num_pages, page_size, heads, head_bytes)``.

    Head-major (HND) planes are transposed views.

    Args:
        buffers: One rank's host buffers (1-D uint8) in the layout's order (one per plane; one; or K
            then V).
        geo: Their geometry.

    Returns:
        One view per plane.

    Raises:
        InvalidArgument: The buffer count, type or size does not fit ``geo``, or the buffers hold
            different page counts.
    """
    if len(buffers) != geo.num_buffers:
        raise InvalidArgument(
            f"layout {geo.layout!r} with {geo.num_layers} layers needs {geo.num_buffers} buffers, got {len(buffers)}"
        )
    per, ps, heads, hb = geo.planes_per_buffer, geo.page_size, geo.heads, geo.head_bytes
    views: list[ByteArray] = []
    first_pages = 0
    for b, raw in enumerate(buffers):
        buf = _check_buffer(raw, b)
        if buf.size % geo.page_bytes:
            raise InvalidArgument(
                f"buffer {b} holds {buf.size} bytes, not a whole number of {geo.page_bytes}-byte pages "
                f"({per} x {ps} tokens x {heads} heads x {hb} bytes)"
            )
        n = buf.size // geo.page_bytes
        if b == 0:
            first_pages = n
        elif n != first_pages:
            raise InvalidArgument(f"buffer {b} holds {n} pages, buffer 0 holds {first_pages}")
        if geo.head_order == HeadOrder.NHD.value:
            shaped = buf.reshape(n, per, ps, heads, hb)
        else:
            shaped = buf.reshape(n, per, heads, ps, hb).transpose(0, 1, 3, 2, 4)
        views.extend(shaped[:, i] for i in range(per))
    return views


def stream_nbytes(num_planes: int, t0: int, t1: int, head_count: int, head_bytes: int) -> int:
    """Bytes of the token stream of tokens ``[t0, t1)``, ``head_count`` heads, ``num_planes`` planes.

    Args:
        num_planes: Planes in the stream.
        t0: First token.
        t1: End token (excluded).
        head_count: Heads per token.
        head_bytes: Bytes per head.
    """
    return num_planes * max(t1 - t0, 0) * head_count * head_bytes


class _Span(NamedTuple):
    """Where tokens ``[t0, t1)`` sit in a room's pages: a partial first page, whole pages, a partial last."""

    first: tuple[int, int, int] | None
    """(page, row start, row stop), or None when the range starts on a page boundary."""
    whole: IndexArray
    """Pages moved whole, in token order."""
    last: tuple[int, int, int] | None
    """(page, 0, row stop), or None when the range ends on a page boundary (or within ``first``)."""
    at_whole: int
    """Stream position (tokens) of the first whole page."""
    at_last: int
    """Stream position (tokens) of the last partial page."""


def _span(pages: IndexArray, page_size: int, t0: int, t1: int) -> _Span:
    i0, r0 = divmod(t0, page_size)
    i1, r1 = divmod(t1, page_size)
    if t0 == t1:
        return _Span(None, pages[:0], None, 0, 0)
    if i0 == i1:
        return _Span((int(pages[i0]), r0, r1), pages[:0], None, r1 - r0, r1 - r0)
    first = (int(pages[i0]), r0, page_size) if r0 else None
    last = (int(pages[i1]), 0, r1) if r1 else None
    whole = pages[i0 + (1 if r0 else 0) : i1]
    at_whole = page_size - r0 if r0 else 0
    return _Span(first, whole, last, at_whole, at_whole + whole.size * page_size)


def _check_planes(planes: Sequence[ByteArray], page_size: int, *, writable: bool) -> tuple[int, int, int]:
    """Validate the planes; return (heads, head_bytes, pages every plane holds)."""
    if not planes:
        raise InvalidArgument("no planes given")
    shape = None
    held = None
    for i, plane in enumerate(planes):
        if not isinstance(plane, np.ndarray) or plane.dtype != np.uint8 or plane.ndim != 4:
            raise InvalidArgument(f"plane {i} must be a 4-D uint8 array (see plane_views)")
        if shape is None:
            shape = plane.shape[1:]
        elif plane.shape[1:] != shape:
            raise InvalidArgument(f"plane {i} has pages of shape {plane.shape[1:]}, plane 0 {shape}")
        if writable and not plane.flags.writeable:
            raise InvalidArgument(f"plane {i} is read-only")
        held = plane.shape[0] if held is None else min(held, plane.shape[0])
    assert shape is not None and held is not None
    if shape[0] != page_size:
        raise InvalidArgument(f"page_size {page_size} does not match the planes' {shape[0]} rows per page")
    return int(shape[1]), int(shape[2]), int(held)


def _prepare(
    planes: Sequence[ByteArray],
    pages: Pages,
    page_size: int,
    t0: int,
    t1: int,
    head_start: int,
    head_count: int,
    stream: ByteArray,
    *,
    gather: bool,
) -> tuple[_Span, ByteArray]:
    """Validate a gather (writes ``stream``) or a scatter (writes the planes); return the span and the
    stream shaped (plane, token, head, byte)."""
    what = "out" if gather else "src"
    if page_size < 1:
        raise InvalidArgument(f"page_size must be >= 1, got {page_size}")
    heads, head_bytes, held = _check_planes(planes, page_size, writable=not gather)
    if not 0 <= t0 <= t1:
        raise InvalidArgument(f"token range [{t0}, {t1}) must satisfy 0 <= t0 <= t1")
    if head_count < 1 or head_start < 0 or head_start + head_count > heads:
        raise InvalidArgument(
            f"heads [{head_start}, {head_start + head_count}) are not within the planes' {heads} heads"
        )
    idx = as_index_array(pages, what="pages")
    needed = -(-t1 // page_size)
    if idx.size < needed:
        raise InvalidArgument(
            f"tokens up to {t1} need {needed} pages of {page_size} tokens, the room has {idx.size}"
        )
    check_range(idx[t0 // page_size : needed], held, what="pages")
    nbytes = stream_nbytes(len(planes), t0, t1, head_count, head_bytes)
    if not isinstance(stream, np.ndarray) or stream.dtype != np.uint8 or not stream.flags.c_contiguous:
        raise InvalidArgument(f"{what} must be a contiguous uint8 array")
    if stream.size != nbytes:
        raise InvalidArgument(
            f"{what} holds {stream.size} bytes; {len(planes)} planes x {t1 - t0} tokens x {head_count} heads "
            f"x {head_bytes} bytes need {nbytes}"
        )
    if gather and not stream.flags.writeable:
        raise InvalidArgument("out is read-only")
    return _span(idx, page_size, t0, t1), stream.reshape(len(planes), t1 - t0, head_count, head_bytes)


def _page_rows(plane: ByteArray) -> tuple[ByteArray, int] | None:
    """A read-only contiguous ``(rows, page_block)`` view whose row ``step * q`` is page ``q`` of a token-major plane.

    Pages of a page-first plane are each contiguous but interleaved with other planes' pages; this view
    spans them with a contiguous stride so ``np.take`` reads them in place (it would first copy a strided
    array whole). None when the plane's pages are not contiguous token-major blocks.
    """
    n, ps, heads, hb = plane.shape
    block = ps * heads * hb
    wanted = (heads * hb, hb, 1)
    # a dimension of size 1 may carry any stride (an HND plane with one head is token-major)
    inner = zip(plane.shape[1:], plane.strides[1:], wanted, strict=True)
    if n == 0 or any(size > 1 and got != want for size, got, want in inner):
        return None
    stride = plane.strides[0] if n > 1 else block
    if stride < block or stride % block:
        return None
    step = stride // block
    rows = as_strided(plane, shape=((n - 1) * step + 1, block), strides=(block, 1), writeable=False)
    return rows, step


def _bounce_pages(page_bytes: int) -> int:
    return max(1, _BOUNCE_BYTES // max(page_bytes, 1))


def gather_tokens(
    planes: Sequence[ByteArray],
    pages: Pages,
    page_size: int,
    t0: int,
    t1: int,
    head_start: int,
    head_count: int,
    out: ByteArray,
) -> None:
    """Copy tokens ``[t0, t1)``, heads ``[head_start, head_start + head_count)``, of every plane into ``out``.

    Args:
        planes: Canonical plane views (`plane_views`).
        pages: The room's page list (token ``t`` in ``pages[t // page_size]``).
        page_size: Tokens per page.
        t0: First token.
        t1: End token (excluded).
        head_start: First head.
        head_count: Heads to copy.
        out: A contiguous uint8 array of `stream_nbytes` bytes,
            filled ``(plane, token, head, byte)``.

    Raises:
        InvalidArgument: Out-of-range tokens, pages or heads, or a wrongly sized ``out``, before anything
            is copied.
    """
    span, stream = _prepare(planes, pages, page_size, t0, t1, head_start, head_count, out, gather=True)
    hs, he = head_start, head_start + head_count
    at_whole, at_last, m = span.at_whole, span.at_last, span.whole.size
    for plane, seg in zip(planes, stream, strict=True):
        if span.first is not None:
            page, r0, r1 = span.first
            seg[: r1 - r0] = plane[page, r0:r1, hs:he]
        if m:
            dst = seg[at_whole:at_last].reshape(m, page_size, head_count, seg.shape[2])
            rows = _page_rows(plane) if head_count == plane.shape[2] else None
            if rows is not None:
                view, step = rows
                idx = span.whole if step == 1 else span.whole * step
                # mode="clip": the default mode="raise" makes NumPy buffer ``out`` (4-5x slower); the pages
                # were range-checked above.
                np.take(view, idx, axis=0, out=dst.reshape(m, -1), mode="clip")
            else:
                chunk = _bounce_pages(dst[0].nbytes)
                for a in range(0, m, chunk):
                    dst[a : a + chunk] = plane[span.whole[a : a + chunk], :, hs:he]
        if span.last is not None:
            page, _, r1 = span.last
            seg[at_last:] = plane[page, :r1, hs:he]


def scatter_tokens(
    planes: Sequence[ByteArray],
    pages: Pages,
    page_size: int,
    t0: int,
    t1: int,
    head_start: int,
    head_count: int,
    src: ByteArray,
) -> None:
    """Inverse of :func:`gather_tokens`: write the stream ``src`` into tokens ``[t0, t1)``, heads
    ``[head_start, head_start + head_count)``, of every plane. Other bytes of the planes are left alone.

    Pages are not checked for repeats: a page listed twice receives the later tokens.

    Args:
        planes: Canonical plane views, written.
        pages: The room's page list.
        page_size: Tokens per page.
        t0: First token.
        t1: End token (excluded).
        head_start: First head.
        head_count: Heads to write.
        src: The stream, as `gather_tokens` fills it.

    Raises:
        InvalidArgument: As for `gather_tokens`.
    """
    span, stream = _prepare(planes, pages, page_size, t0, t1, head_start, head_count, src, gather=False)
    hs, he = head_start, head_start + head_count
    at_whole, at_last, m = span.at_whole, span.at_last, span.whole.size
    for plane, seg in zip(planes, stream, strict=True):
        if span.first is not None:
            page, r0, r1 = span.first
            plane[page, r0:r1, hs:he] = seg[: r1 - r0]
        if m:
            part = seg[at_whole:at_last].reshape(m, page_size, head_count, seg.shape[2])
            if head_count == plane.shape[2]:
                plane[span.whole] = part
            else:
                plane[span.whole, :, hs:he] = part
        if span.last is not None:
            page, _, r1 = span.last
            plane[page, :r1, hs:he] = seg[at_last:]


def convert_tokens(
    src_planes: Sequence[ByteArray],
    src_pages: Pages,
    src_page_size: int,
    dst_planes: Sequence[ByteArray],
    dst_pages: Pages,
    dst_page_size: int,
    t0: int,
    t1: int,
    *,
    src_head_start: int = 0,
    dst_head_start: int = 0,
    head_count: int | None = None,
) -> None:
    """Move tokens ``[t0, t1)`` from one geometry's planes to another's, within one process.

    Both sides are validated before any destination byte changes.

    Args:
        src_planes: The source's canonical plane views.
        src_pages: The source's page list.
        src_page_size: Source tokens per page.
        dst_planes: The destination's canonical plane views.
        dst_pages: The destination's page list.
        dst_page_size: Destination tokens per page.
        t0: First token.
        t1: End token (excluded).
        src_head_start: First source head.
        dst_head_start: The destination head the first source head lands on.
        head_count: Heads to move; None is every source head.

    Raises:
        InvalidArgument: Planes that do not pair, or out-of-range tokens, pages or heads.
    """
    if len(src_planes) != len(dst_planes):
        raise InvalidArgument(f"plane counts differ: source {len(src_planes)}, destination {len(dst_planes)}")
    heads, head_bytes, _ = _check_planes(src_planes, src_page_size, writable=False)
    count = heads if head_count is None else head_count
    stream = np.empty(stream_nbytes(len(src_planes), t0, t1, count, head_bytes), dtype=np.uint8)
    _prepare(dst_planes, dst_pages, dst_page_size, t0, t1, dst_head_start, count, stream, gather=False)
    gather_tokens(src_planes, src_pages, src_page_size, t0, t1, src_head_start, count, stream)
    scatter_tokens(dst_planes, dst_pages, dst_page_size, t0, t1, dst_head_start, count, stream)
