"""Configuration of the performance suite (engine configurations, parameters), the statistics every
phase reports, and the byte patterns both workers derive (aux slots, TP head slices)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from aiotransfer import LoopLagMonitor
from aiotransfer._cli.workload import I64, U64, KVPool, page_seeds, word_ramp

__all__ = [
    "KIB",
    "MIB",
    "TIMEOUT",
    "ROOM0",
    "ALL_PHASES",
    "OPT_IN_PHASES",
    "ENGINES",
    "EngineSpec",
    "Params",
    "make_params",
    "rep_count",
    "stats_us",
    "median",
    "gbps",
    "timing",
    "lag_record",
    "aux_pattern",
    "tp_fill",
    "tp_bad_pages",
]


KIB = 1024
MIB = 1024 * 1024
TIMEOUT = 300.0
"""Bound on one step (one transfer, one decode command)."""
ROOM0 = 7_000_000
"""First room of a worker's run."""


# ----------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    key: str
    engine: str
    label: str
    env: dict[str, str]
    unset: tuple[str, ...]
    phases: tuple[str, ...]


ALL_PHASES = ("ceilings", "throughput", "scattered", "lag", "concurrency", "e2e", "floor", "aux", "tp", "cpu")
OPT_IN_PHASES = ("cpu",)
"""Phases that run only when named in ``--phases`` (minutes at full size)."""

ENGINES: dict[str, EngineSpec] = {
    "mooncake_tcp": EngineSpec(
        "mooncake_tcp", "mooncake_tcp", "Mooncake TCP", {}, (),
        ("throughput", "scattered", "lag", "concurrency", "e2e", "floor", "aux", "tp", "cpu"),
    ),
    "nixl_shm": EngineSpec(
        "nixl_shm", "nixl", "NIXL UCX (default TLS: shm)", {}, ("UCX_TLS",),
        ("throughput", "scattered", "lag", "concurrency", "e2e", "floor", "aux", "cpu"),
    ),
    "nixl_tcp": EngineSpec(
        "nixl_tcp", "nixl", "NIXL UCX_TLS=tcp", {"UCX_TLS": "tcp"}, (),
        ("throughput", "scattered"),
    ),
}


@dataclass
class Params:
    """Everything both workers need; serialised on their command lines."""

    scale: str = "full"
    repeats: int = 5
    seed: int = 0
    host: str = "127.0.0.1"
    sizes: list[int] = field(default_factory=lambda: [64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB])
    sizes_nixl_tcp: list[int] = field(default_factory=lambda: [MIB, 64 * MIB])
    scattered_pages: int = 10_000
    lag_seconds: float = 3.0
    lag_inflight: int = 8
    lag_size: int = 8 * MIB
    conc_levels: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 256])
    conc_size: int = 256 * KIB
    conc_requests: int = 512
    e2e_reps: int = 300
    floor_rounds: int = 10
    floor_reps: int = 20
    """``floor``: rounds of every measurement (a random order each), and repetitions of each per round."""
    floor_gap: float = 0.001
    """``floor``: seconds of idle before each repetition (round trip, raw write, room). Longer gaps let the
    CPUs fall idle between rooms, as they do between the requests of a lightly loaded server."""
    aux_reps: int = 300
    aux_bytes: int = 4 * KIB
    tp_tokens: int = 4096
    tp_layers: int = 32
    tp_never_repeats: int = 1
    tp_always_repeats: int = 3
    tp_split_credits: bool = True
    """Give each of the P prefill managers max_entries_in_flight = 1024 // P: they share one Mooncake
    engine, and the library's default (1,024 per manager and peer) lets P x 1,024 entries queue to the
    same decode segment, which Mooncake fails (-1). False reproduces that."""
    phases: list[str] | None = None
    engine_threads: str = "normal"
    """``TransferConfig.engine_threads`` of every manager of the run, on both sides."""
    nixl_progress_delay_us: int = 0
    """``TransferConfig.nixl_progress_delay_us`` of every manager of the run, on both sides."""
    yield_after_notify: bool = True
    """``TransferConfig.yield_after_notify`` of every manager of the run, on both sides."""
    cpu_buffers: int = 64
    """``cpu``: KV buffers of both sides (K then V of ``cpu_buffers // 2`` layers)."""
    cpu_page_bytes: int = 2048
    """``cpu``: bytes of one page of one buffer (one token of 8 KV heads x 128 in bf16)."""
    cpu_pages: list[int] = field(default_factory=lambda: [1, 64, 4096])
    """``cpu``: pages of the timed ``send_kv`` rooms; the largest is also sent as a Python list."""
    cpu_reps: list[int] = field(default_factory=lambda: [200, 200, 30])
    """``cpu``: timed calls of each of ``cpu_pages`` (and as many raw writes, alternating)."""
    cpu_layer_pages: int = 256
    """``cpu``: pages of the streamed chunk; one ``send_layers`` call moves one layer (2 buffers)."""
    cpu_layer_reps: int = 200
    """``cpu``: timed ``send_layers`` calls (the calls that complete a chunk are not counted)."""
    cpu_gap: float = 0.002
    """``cpu``: seconds of idle before each timed call, so that the previous one's aftermath is over."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    def manager_config(self) -> dict[str, Any]:
        """``TransferConfig`` fields every manager of the run gets, on both sides."""
        return {"engine_threads": self.engine_threads, "nixl_progress_delay_us": self.nixl_progress_delay_us,
                "yield_after_notify": self.yield_after_notify}

    @classmethod
    def from_json(cls, text: str) -> Params:
        return cls(**json.loads(text))


def make_params(*, quick: bool, tiny: bool, repeats: int | None, seed: int, host: str,
                phases: Sequence[str] | None, tp_split_credits: bool = True, engine_threads: str = "normal",
                nixl_progress_delay_us: int = 0, floor_gap: float | None = None,
                yield_after_notify: bool = True) -> Params:
    if tiny:
        p = Params(
            scale="tiny", repeats=1, sizes=[64 * KIB, MIB], sizes_nixl_tcp=[MIB], scattered_pages=512,
            lag_seconds=0.25, lag_inflight=4, lag_size=MIB, conc_levels=[1, 8], conc_size=64 * KIB,
            conc_requests=16, e2e_reps=10, floor_rounds=1, floor_reps=3, aux_reps=10, tp_tokens=64, tp_layers=2,
            tp_always_repeats=1, cpu_buffers=4, cpu_pages=[1, 8, 64], cpu_reps=[6, 6, 3], cpu_layer_pages=16,
            cpu_layer_reps=6,
        )
    elif quick:
        p = Params(
            scale="quick", repeats=2, sizes=[64 * KIB, MIB, 16 * MIB, 64 * MIB], sizes_nixl_tcp=[MIB, 64 * MIB],
            scattered_pages=2_000, lag_seconds=0.6, lag_inflight=8, lag_size=4 * MIB, conc_levels=[1, 16, 256],
            conc_size=256 * KIB, conc_requests=256, e2e_reps=40, floor_rounds=4, floor_reps=15, aux_reps=40,
            tp_tokens=512, tp_layers=4,
            tp_always_repeats=1, cpu_pages=[1, 64, 1024], cpu_reps=[40, 40, 10], cpu_layer_reps=40,
        )
    else:
        p = Params()
    if repeats is not None:
        p.repeats = repeats
    p.seed, p.host = seed, host
    p.phases = list(phases) if phases else None
    p.engine_threads = engine_threads
    p.nixl_progress_delay_us = nixl_progress_delay_us
    p.yield_after_notify = yield_after_notify
    p.tp_split_credits = tp_split_credits
    if floor_gap is not None:
        p.floor_gap = floor_gap
    return p


def rep_count(nbytes: int, repeats: int) -> int:
    """More repetitions for small transfers (they are cheap and noisier)."""
    if nbytes <= MIB:
        return repeats * 8
    if nbytes <= 16 * MIB:
        return repeats * 4
    return repeats * 2


def stats_us(xs: Sequence[float]) -> dict[str, Any]:
    """Percentiles of durations given in seconds, reported in microseconds."""
    if not xs:
        return {"n": 0, "p50_us": None, "p99_us": None, "max_us": None, "mean_us": None}
    a = np.asarray(xs, dtype=np.float64) * 1e6
    p50, p99 = np.percentile(a, [50, 99])
    return {"n": int(a.size), "p50_us": round(float(p50), 2), "p99_us": round(float(p99), 2),
            "max_us": round(float(a.max()), 2), "mean_us": round(float(a.mean()), 2)}


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def timing(nbytes: int, times: Sequence[float]) -> dict[str, Any]:
    med = median(times)
    return {"median_s": med, "gbps": gbps(nbytes, med), "times_s": [round(t, 7) for t in times]}


def lag_record(mon: LoopLagMonitor) -> dict[str, Any]:
    out = mon.summary()
    out["samples_ms"] = [round(float(x), 4) for x in mon.samples]
    return out


# ----------------------------------------------------------------------------------------------------
# byte patterns shared by both workers
# ----------------------------------------------------------------------------------------------------
def aux_pattern(room: int, nbytes: int) -> npt.NDArray[np.uint8]:
    out: npt.NDArray[np.uint8] = ((np.arange(nbytes, dtype=np.int64) + room * 131) % 251).astype(np.uint8)
    return out


def _tp_head_values(tag: int, nbuf: int, npages: int, rows: int, heads: int, head_words: int,
                    b: int, h0: int, hc: int) -> U64:
    """Expected words of heads ``[h0, h0+hc)`` of the request's pages in buffer ``b``:
    shape (npages, rows, hc, head_words); the same global pattern on every TP rank."""
    seeds = page_seeds(tag, nbuf, npages)[b]
    ramp = word_ramp(rows * heads * head_words).reshape(rows, heads, head_words)[:, h0 : h0 + hc, :]
    out: U64 = seeds[:, None, None, None] + ramp[None]
    return out


def tp_fill(pool: KVPool, tag: int, pages: I64, rows: int, heads: int, head_words: int, h0: int, hc: int) -> None:
    for b in range(pool.nbuf):
        vals = _tp_head_values(tag, pool.nbuf, pages.size, rows, heads, head_words, b, h0, hc)
        pool.words[b, pages] = vals.reshape(pages.size, -1)


def tp_bad_pages(pool: KVPool, tag: int, pages: I64, rows: int, heads: int, head_words: int, h0: int,
                 hc: int) -> int:
    bad = 0
    for b in range(pool.nbuf):
        vals = _tp_head_values(tag, pool.nbuf, pages.size, rows, heads, head_words, b, h0, hc)
        got = pool.words[b, pages].reshape(vals.shape)
        bad += int(np.count_nonzero((got != vals).reshape(pages.size, -1).any(axis=1)))
    return bad
