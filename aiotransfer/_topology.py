"""Parallel topology: which prefill ranks a decode rank pulls from, and which heads move (pure).

Terms: P/D = prefill/decode attention TP size, H = total KV heads of the model. A rank holds
``H / tp`` heads; when ``tp > H`` heads are replicated and rank ``r`` holds head ``r // (tp / H)``.

* ``D >= P``: decode rank ``d`` pulls from prefill rank ``d // (D / P)``; each prefill rank feeds ``D / P``
  decode ranks (``required_dst_info_num``).
* ``D < P``: decode rank ``d`` pulls from prefill ranks ``[d * P/D, (d+1) * P/D)``. MHA needs a response
  from each rank holding distinct heads (replicas beyond the first are dummies); MLA (no head split)
  needs one response, the other ranks are dummies that still conclude Success.
* PP: decode PP equals prefill PP (stage ``q`` pulls from stage ``q``), or is 1 (pull every stage, each
  sends its own layers; responses x pp).
* CP: only CP rank 0 sends; the other CP ranks are dummies.
* Unique prefill rank id: ``tp_rank * (pp_size * cp_size) + pp_rank * cp_size + cp_rank``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import ConfigError, IncompatiblePeer

__all__ = [
    "HeadSlice",
    "ParallelInfo",
    "RankMapping",
    "Target",
    "head_slice",
    "held_heads",
    "map_ranks",
    "unique_rank",
]


@dataclass(frozen=True)
class ParallelInfo:
    """Parallel sizes and ranks of one manager."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank, name in (
            (self.tp_size, self.tp_rank, "tp"),
            (self.pp_size, self.pp_rank, "pp"),
            (self.cp_size, self.cp_rank, "cp"),
        ):
            if size < 1 or not 0 <= rank < size:
                raise ConfigError(f"{name}_rank {rank} out of range for {name}_size {size}")
        if self.dp_rank < 0:
            raise ConfigError("dp_rank must be >= 0")

    @property
    def unique_rank(self) -> int:
        return unique_rank(self.tp_rank, self.pp_rank, self.cp_rank, self.pp_size, self.cp_size)


def unique_rank(tp_rank: int, pp_rank: int, cp_rank: int, pp_size: int, cp_size: int) -> int:
    return tp_rank * (pp_size * cp_size) + pp_rank * cp_size + cp_rank


@dataclass(frozen=True)
class Target:
    """One prefill rank a decode rank sends metadata to."""

    tp_rank: int
    pp_rank: int
    cp_rank: int
    is_dummy: bool
    unique_rank: int


@dataclass(frozen=True)
class RankMapping:
    targets: tuple[Target, ...]
    required_responses: int
    """Success reports the decode rank needs (non-dummy targets)."""
    required_dst_info_num: int
    """Decode ranks each targeted prefill rank hears from."""


def held_heads(rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """``(first head, count)`` held by ``rank``."""
    if total_heads < 1:
        raise ConfigError("total_kv_heads must be >= 1 for head slicing")
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ConfigError(f"{total_heads} KV heads do not split over TP {tp_size}")
        per = total_heads // tp_size
        return rank * per, per
    if tp_size % total_heads:
        raise ConfigError(f"TP {tp_size} is not a multiple of {total_heads} KV heads")
    return rank // (tp_size // total_heads), 1


def _ratio(a: int, b: int) -> int:
    big, small = max(a, b), min(a, b)
    if big % small:
        raise IncompatiblePeer(f"TP sizes {a} and {b} are not multiples of each other")
    return big // small


@functools.lru_cache(maxsize=256)
def map_ranks(
    prefill_tp: int,
    prefill_pp: int,
    prefill_cp: int,
    decode: ParallelInfo,
    *,
    is_mla: bool,
    total_heads: int = 0,
    all_cp_ranks_send: bool = False,
) -> RankMapping:
    """The prefill ranks decode rank ``decode`` pulls from (see module docstring). Pure, and cached: a decode
    asks it for every room it routes."""
    if decode.pp_size not in (1, prefill_pp):
        raise IncompatiblePeer(f"decode PP {decode.pp_size} must equal prefill PP {prefill_pp} or be 1")
    if decode.cp_size != 1:
        raise IncompatiblePeer("decode context parallelism is not supported (decode cp_size must be 1)")
    P, D = prefill_tp, decode.tp_size
    ratio = _ratio(P, D)
    if D >= P:
        tp_targets = [(decode.tp_rank // ratio, False)]
        dst_info_num = ratio
    else:
        ranks = list(range(decode.tp_rank * ratio, (decode.tp_rank + 1) * ratio))
        if is_mla:
            tp_targets = [(r, i != 0) for i, r in enumerate(ranks)]
        else:
            seen: set[tuple[int, int]] = set()
            tp_targets = []
            for r in ranks:
                heads = held_heads(r, P, total_heads) if total_heads else (r, 1)
                tp_targets.append((r, heads in seen))
                seen.add(heads)
        dst_info_num = 1
    pp_ranks = [decode.pp_rank] if decode.pp_size == prefill_pp else list(range(prefill_pp))
    targets = []
    for pp in pp_ranks:
        for tp, dummy in tp_targets:
            for cp in range(prefill_cp):
                cp_dummy = cp != 0 and not all_cp_ranks_send
                targets.append(
                    Target(tp, pp, cp, dummy or cp_dummy, unique_rank(tp, pp, cp, prefill_pp, prefill_cp))
                )
    required = sum(1 for t in targets if not t.is_dummy)
    return RankMapping(tuple(targets), required, dst_info_num)


@dataclass(frozen=True)
class HeadSlice:
    """Heads moving from one source rank to one destination rank."""

    src_start: int
    """First head, relative to the source rank's own heads."""
    count: int
    dst_start: int
    """First head, relative to the destination rank's own heads."""
    src_heads: int
    dst_heads: int

    @property
    def is_whole(self) -> bool:
        """Both ranks hold exactly these heads: whole pages move, no slicing."""
        return self.count == self.src_heads == self.dst_heads


def head_slice(src_rank: int, src_tp: int, dst_rank: int, dst_tp: int, total_heads: int) -> HeadSlice | None:
    """The heads ``src_rank`` (of ``src_tp``) sends to ``dst_rank`` (of ``dst_tp``); None if disjoint."""
    s0, sn = held_heads(src_rank, src_tp, total_heads)
    d0, dn = held_heads(dst_rank, dst_tp, total_heads)
    lo, hi = max(s0, d0), min(s0 + sn, d0 + dn)
    if lo >= hi:
        return None
    return HeadSlice(lo - s0, hi - lo, lo - d0, sn, dn)
