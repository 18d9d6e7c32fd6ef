"""KV layouts and buffer pairing between two ranks (pure).

A page of a KV buffer is ``rows = outer * page_size`` rows of ``kv_heads * head_bytes`` bytes:

==========================  ===============================  ===================================
layout                      buffers                          ``outer`` (sub-blocks per page)
==========================  ===============================  ===================================
``layer_first``             one per (K or V, layer)          1
``page_first``              one; a page holds K and V of     2 x layers
                            every layer
``page_first_kv_split``     two (K, V); a page holds one     layers
                            of them for every layer
``mla``                     one latent buffer per layer      1, never head-sliced
==========================  ===============================  ===================================

:func:`pair_buffers` decides, for a (local, remote) pair of ranks, which buffer feeds which and whether
whole pages move or per-row head slices do. When both sides publish layer ids, buffers pair by layer
id (PP stages, draft layers); otherwise by position.

Page sizes may differ when one divides the other and pages are token-major (``layer_first``, ``mla``): both
sides are then seen as *units* of ``g = min(P, D)`` tokens, ``P / g`` per source page and ``D / g`` per
destination page, and every plan works on units as it would on pages (runs of units coalesce across page
boundaries). Page-first and head-major pages do not hold a token's rows together, so :func:`pair_buffers`
refuses a page-size difference between them; the prefill converts such peers as a token stream instead
(:mod:`aiotransfer._convert`).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._topology import HeadSlice, head_slice

__all__ = ["KVLayout", "KVPairing", "RankGeometry", "pair_buffers", "units_per_page"]


class KVLayout(str, enum.Enum):
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_KV_SPLIT = "page_first_kv_split"
    MLA = "mla"

    @property
    def is_mla(self) -> bool:
        return self is KVLayout.MLA


@dataclass(frozen=True)
class RankGeometry:
    """What pairing needs to know about one side."""

    layout: str
    page_size: int
    item_lens: Sequence[int]
    layer_ids: Sequence[int]
    tp_size: int
    tp_rank: int
    kv_heads: int
    total_kv_heads: int
    outer: int = 1
    """Sub-blocks per page (see module docstring); 1 for layer-first and MLA."""


@dataclass(frozen=True)
class KVPairing:
    """How local buffers feed remote ones."""

    src: np.ndarray
    """Local buffer indices that send."""
    dst: np.ndarray
    """The remote buffer each of them writes."""
    heads: HeadSlice | None
    """None: whole pages move. Otherwise per-row slices of heads."""
    rows_per_page: int = 0
    """Head slicing: rows (tokens x sub-blocks) of one unit."""
    head_bytes: int = 0
    src_units: int = 1
    """Units per source page (``P / min(P, D)``; 1 when the page sizes match)."""
    dst_units: int = 1
    """Units per destination page."""
    unit_lens: tuple[int, ...] = ()
    """Bytes of one source unit, per paired buffer (the item length when the page sizes match)."""
    dst_unit_lens: tuple[int, ...] = ()
    """Bytes of one destination unit, per paired buffer."""
    stream: bool = False
    """The sides page differently (layout, head order): tokens move as a staged stream, one unit per token,
    gathered with our geometry and scattered with the peer's; ``src`` and ``dst`` are empty."""

    @property
    def converts_pages(self) -> bool:
        """The two sides' page sizes differ: plans work on units, not pages."""
        return self.src_units != 1 or self.dst_units != 1

    @property
    def sliced(self) -> bool:
        return self.heads is not None


def _pair_indices(local: RankGeometry, remote: RankGeometry) -> tuple[list[int], list[int]] | str:
    lid, rid = list(local.layer_ids), list(remote.layer_ids)
    have_ids = lid and rid and all(i >= 0 for i in lid) and all(i >= 0 for i in rid)
    if not have_ids:
        if len(local.item_lens) != len(remote.item_lens):
            return (
                f"KV buffer count mismatch: peer {len(remote.item_lens)}, ours {len(local.item_lens)} "
                "(pass kv_layer_ids on both sides to pair PP stages or draft layers by layer id)"
            )
        n = len(local.item_lens)
        return list(range(n)), list(range(n))
    # k-th buffer carrying layer L locally pairs with the k-th remote buffer carrying layer L
    remote_slots: dict[int, list[int]] = defaultdict(list)
    for j, layer in enumerate(rid):
        remote_slots[layer].append(j)
    seen: dict[int, int] = defaultdict(int)
    src: list[int] = []
    dst: list[int] = []
    for i, layer in enumerate(lid):
        k = seen[layer]
        seen[layer] += 1
        slots = remote_slots.get(layer, [])
        if k >= len(slots):
            return f"peer has no buffer for layer {layer} (occurrence {k + 1})"
        src.append(i)
        dst.append(slots[k])
    return src, dst


def pair_buffers(local: RankGeometry, remote: RankGeometry) -> KVPairing | str:
    """Pair local (sending) buffers with remote (receiving) ones; returns a refusal reason on mismatch."""
    if local.layout != remote.layout:
        return f"layout mismatch: peer {remote.layout!r}, ours {local.layout!r}"
    units = _units(local, remote)
    if isinstance(units, str):
        return units
    k_src, k_dst = units
    pairs = _pair_indices(local, remote)
    if isinstance(pairs, str):
        return pairs
    src, dst = pairs
    s_arr, d_arr = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
    s_lens = [local.item_lens[i] // k_src for i in src]
    d_lens = [remote.item_lens[j] // k_dst for j in dst]
    s_units, d_units = tuple(s_lens), tuple(d_lens)
    is_mla = local.layout == KVLayout.MLA.value
    heads: HeadSlice | None = None
    if not is_mla and local.total_kv_heads and remote.total_kv_heads:
        if local.total_kv_heads != remote.total_kv_heads:
            return f"total KV heads mismatch: peer {remote.total_kv_heads}, ours {local.total_kv_heads}"
        if local.tp_size != remote.tp_size or local.kv_heads != remote.kv_heads:
            hs = head_slice(local.tp_rank, local.tp_size, remote.tp_rank, remote.tp_size, local.total_kv_heads)
            if hs is None:
                return f"TP rank {local.tp_rank}/{local.tp_size} holds none of the heads of {remote.tp_rank}/{remote.tp_size}"
            if not hs.is_whole:
                heads = hs
    if heads is None:
        for i, (a, b) in enumerate(zip(s_lens, d_lens, strict=True)):
            if a != b:
                what = "page" if k_src == k_dst == 1 else f"{min(local.page_size, remote.page_size)} tokens"
                return f"KV item length mismatch at buffer {src[i]}: peer {b} bytes/{what}, ours {a}"
        return KVPairing(s_arr, d_arr, None, 0, 0, k_src, k_dst, s_units, d_units)
    if local.outer != remote.outer:
        return f"page structure mismatch: {local.outer} vs {remote.outer} sub-blocks per page"
    rows = local.outer * local.page_size // k_src
    hb_local = {n // (rows * heads.src_heads) for n in s_lens}
    hb_remote = {n // (rows * heads.dst_heads) for n in d_lens}
    if len(hb_local) != 1 or hb_local != hb_remote:
        return f"per-head bytes differ: ours {sorted(hb_local)}, peer {sorted(hb_remote)}"
    head_bytes = hb_local.pop()
    for n in s_lens:
        if n != rows * heads.src_heads * head_bytes:
            return f"item length {n} is not {rows} rows x {heads.src_heads} heads x {head_bytes} bytes"
    return KVPairing(s_arr, d_arr, heads, rows, head_bytes, k_src, k_dst, s_units, d_units)


def _units(local: RankGeometry, remote: RankGeometry) -> tuple[int, int] | str:
    """(units per source page, units per destination page), or why the page sizes cannot be converted."""
    p, d = local.page_size, remote.page_size
    if p == d:
        return 1, 1
    if max(p, d) % min(p, d):
        return f"page sizes differ and neither divides the other: peer {d}, ours {p} tokens per page"
    if local.outer != 1 or remote.outer != 1:
        return (f"page sizes differ (peer {d}, ours {p} tokens per page): converting them needs token-major pages "
                f"(layer_first or mla), not {local.layout!r}")
    g = min(p, d)
    return p // g, d // g


def units_per_page(item_len: int, page_size: int, outer: int, unit_bytes: int) -> int | None:
    """How many units of ``unit_bytes`` one of our pages is, as a peer's message describes them: a whole
    number that divides our tokens per page (1 when the page sizes match; more only for token-major pages),
    else None."""
    if unit_bytes <= 0 or item_len % unit_bytes:
        return None
    k = item_len // unit_bytes
    if k == 1 or (outer == 1 and page_size % k == 0):
        return k
    return None
