"""``python -m benchmarks.conversion``: what re-laying out KV tokens between page geometries costs,
against plain whole-page staging of the same bytes.

One Llama-8B-shaped rank (8 KV heads, head_dim 128 in bf16: 256 bytes a head; 32 layers, 2 planes each)
moves ``tokens`` tokens out of scattered pages of one pool into scattered pages of another, as a sender's
gather and a receiver's scatter would (one process, host memory, single-threaded NumPy):

* (a) baseline: :func:`~aiotransfer._staging.gather_pages` / :func:`~aiotransfer._staging.scatter_pages`,
  whole 16-token pages on both sides;
* (b)-(f) :func:`~aiotransfer._convert.gather_tokens` with the source geometry, then
  :func:`~aiotransfer._convert.scatter_tokens` with the destination one: page size 16 -> 64, 64 -> 16,
  1 -> 16, NHD -> HND, layer_first -> page_first.

Each row reports the best of ``repeat`` runs as GB/s of KV moved (bytes / (gather + scatter time)), and
its ratio to (a). Every case is verified once after timing (the destination read back equals the stream).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiotransfer._cli import console
from aiotransfer._convert import PageGeometry, gather_tokens, plane_views, scatter_tokens, stream_nbytes
from aiotransfer._layout import KVLayout
from aiotransfer._staging import RowSlice, gather_pages, scatter_pages

from . import options

__all__ = ["FULL_LAYERS", "conversion_bench", "format_rows", "main", "run_conversion"]

FULL_LAYERS = 32
"""Layers of the Llama-8B shape; ``layers=`` may run fewer (the row says so)."""
_HEADS = 8
_HEAD_BYTES = 256
_SPARE = 4
"""Pool size: needed pages x (1 + 1/_SPARE), so the page lists are scattered, not a prefix."""

_LF, _PF = KVLayout.LAYER_FIRST.value, KVLayout.PAGE_FIRST.value
_CASES: list[tuple[str, tuple[str, str, int], tuple[str, str, int]]] = [
    ("(a) staging baseline, whole pages 16 -> 16", (_LF, "NHD", 16), (_LF, "NHD", 16)),
    ("(b) page size 16 -> 64", (_LF, "NHD", 16), (_LF, "NHD", 64)),
    ("(c) page size 64 -> 16", (_LF, "NHD", 64), (_LF, "NHD", 16)),
    ("(d) page size 1 -> 16", (_LF, "NHD", 1), (_LF, "NHD", 16)),
    ("(e) NHD -> HND, page size 16", (_LF, "NHD", 16), (_LF, "HND", 16)),
    ("(f) layer_first -> page_first, page size 16", (_LF, "NHD", 16), (_PF, "NHD", 16)),
]


def _pool(
    geo: PageGeometry, tokens: int, rng: np.random.Generator, fill: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """Buffers of a pool a little larger than ``tokens`` need (memory touched), and a shuffled page list."""
    needed = math.ceil(tokens / geo.page_size)
    total = needed + needed // _SPARE + 1
    buffers = []
    for b in range(geo.num_buffers):
        buf = np.empty(total * geo.page_bytes, dtype=np.uint8)
        buf.fill((fill + b) % 251 + 1)
        buffers.append(buf)
    return buffers, rng.permutation(total)[:needed].astype(np.int64)


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _case(
    src_geo: PageGeometry,
    dst_geo: PageGeometry,
    tokens: int,
    repeat: int,
    rng: np.random.Generator,
    *,
    baseline: bool,
) -> tuple[int, float, float, bool]:
    """(bytes, best gather s, best scatter s, verified) of one case."""
    src_bufs, src_pages = _pool(src_geo, tokens, rng, 7)
    dst_bufs, dst_pages = _pool(dst_geo, tokens, rng, 0)
    if baseline:
        sl = RowSlice(1, 1, 0, 1, src_geo.page_bytes)
        src_n = [b.size // src_geo.page_bytes for b in src_bufs]
        dst_n = [b.size // dst_geo.page_bytes for b in dst_bufs]
        stream = np.empty(len(src_bufs) * src_pages.size * sl.bytes_per_page, dtype=np.uint8)

        def gather() -> None:
            gather_pages(src_bufs, src_n, src_pages, sl, stream)

        def scatter() -> None:
            scatter_pages(dst_bufs, dst_n, dst_pages, sl, stream)

        def read_back(out: np.ndarray) -> None:
            gather_pages(dst_bufs, dst_n, dst_pages, sl, out)

    else:
        src_planes, dst_planes = plane_views(src_bufs, src_geo), plane_views(dst_bufs, dst_geo)
        heads = src_geo.heads
        stream = np.empty(
            stream_nbytes(len(src_planes), 0, tokens, heads, src_geo.head_bytes), dtype=np.uint8
        )

        def gather() -> None:
            gather_tokens(src_planes, src_pages, src_geo.page_size, 0, tokens, 0, heads, stream)

        def scatter() -> None:
            scatter_tokens(dst_planes, dst_pages, dst_geo.page_size, 0, tokens, 0, heads, stream)

        def read_back(out: np.ndarray) -> None:
            gather_tokens(dst_planes, dst_pages, dst_geo.page_size, 0, tokens, 0, heads, out)

    gather_s = scatter_s = math.inf
    for _ in range(repeat):
        gather_s = min(gather_s, _timed(gather))
        scatter_s = min(scatter_s, _timed(scatter))
    check = np.empty_like(stream)
    read_back(check)
    return stream.size, gather_s, scatter_s, bool(np.array_equal(check, stream))


def conversion_bench(
    tokens: int = 4096, repeat: int = 5, *, layers: int = FULL_LAYERS, seed: int = 0
) -> list[dict[str, Any]]:
    """Throughput of gather + scatter for cases (a)-(f) (module docstring); one dict per case.

    Row keys: ``name``, ``gb_s`` (bytes / (best gather + best scatter)), ``ratio`` (to row (a)),
    ``gather_gb_s``, ``scatter_gb_s``, ``bytes``, ``tokens``, ``layers``, ``verified``, ``note``.
    """
    if tokens < 1 or repeat < 1 or layers < 1:
        raise ValueError(f"tokens, repeat and layers must be >= 1, got {tokens}, {repeat}, {layers}")
    rng = np.random.default_rng(seed)
    note = "" if layers == FULL_LAYERS else f"{layers} of {FULL_LAYERS} layers"
    rows: list[dict[str, Any]] = []
    for i, (name, (s_layout, s_order, s_ps), (d_layout, d_order, d_ps)) in enumerate(_CASES):
        src = PageGeometry(s_layout, s_order, s_ps, _HEADS, _HEAD_BYTES, layers)
        dst = PageGeometry(d_layout, d_order, d_ps, _HEADS, _HEAD_BYTES, layers)
        nbytes, gather_s, scatter_s, ok = _case(src, dst, tokens, repeat, rng, baseline=i == 0)
        rows.append(
            {
                "name": name,
                "gb_s": nbytes / (gather_s + scatter_s) / 1e9,
                "gather_gb_s": nbytes / gather_s / 1e9,
                "scatter_gb_s": nbytes / scatter_s / 1e9,
                "bytes": nbytes,
                "tokens": tokens,
                "layers": layers,
                "verified": ok,
                "note": note,
            }
        )
    base = rows[0]["gb_s"]
    for row in rows:
        row["ratio"] = row["gb_s"] / base
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of :func:`conversion_bench` rows."""
    cells = [("case", "GB/s", "ratio", "gather", "scatter", "verified")]
    cells.extend((r["name"], f"{r['gb_s']:.2f}", f"{r['ratio']:.2f}", f"{r['gather_gb_s']:.2f}",
                  f"{r['scatter_gb_s']:.2f}", f"{r['verified']}" + (f" ({r['note']})" if r["note"] else ""))
                 for r in rows)
    return console.table(cells)


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.common(p, "conversion", repeats="best of; default 5, 2 with --quick", seed=True,
                   quick="1,024 tokens, 4 layers")


def run_conversion(ns: argparse.Namespace) -> int:
    """``python -m benchmarks conversion [--quick] [--out JSON]``: the table, and the rows as JSON."""
    tokens, layers = (1024, 4) if ns.quick else (4096, FULL_LAYERS)
    repeat = ns.repeats or (2 if ns.quick else 5)
    rows = conversion_bench(tokens, repeat, layers=layers, seed=ns.seed)
    print(f"{tokens} tokens, {layers} layers, {rows[0]['bytes'] / 2**20:.0f} MiB of KV per case, best of {repeat}")
    print(format_rows(rows))
    out = ns.out or options.default_out("conversion")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=2)
    return 0 if all(r["verified"] for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.conversion", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--layers", type=int, default=FULL_LAYERS)
    args = p.parse_args(argv)
    rows = conversion_bench(args.tokens, args.repeat, layers=args.layers)
    mib = rows[0]["bytes"] / 2**20
    print(f"{args.tokens} tokens, {args.layers} layers, {mib:.0f} MiB of KV per case, best of {args.repeat}")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
