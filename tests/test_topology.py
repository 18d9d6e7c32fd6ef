"""Rank mapping and head slicing, checked against expectations derived by hand."""

from __future__ import annotations

import pytest

from aiotransfer._topology import HeadSlice, ParallelInfo, head_slice, held_heads, map_ranks, unique_rank
from aiotransfer.errors import ConfigError, IncompatiblePeer


def _targets(m):
    return [(t.tp_rank, t.pp_rank, t.cp_rank, t.is_dummy) for t in m.targets]


def test_tp_4_to_2_mha() -> None:
    m0 = map_ranks(4, 1, 1, ParallelInfo(tp_size=2, tp_rank=0), is_mla=False, total_heads=8)
    m1 = map_ranks(4, 1, 1, ParallelInfo(tp_size=2, tp_rank=1), is_mla=False, total_heads=8)
    assert _targets(m0) == [(0, 0, 0, False), (1, 0, 0, False)]
    assert _targets(m1) == [(2, 0, 0, False), (3, 0, 0, False)]
    assert (m0.required_responses, m0.required_dst_info_num) == (2, 1)
    # prefill ranks hold 2 heads each, decode ranks 4: slices land side by side
    assert head_slice(0, 4, 0, 2, 8) == HeadSlice(0, 2, 0, 2, 4)
    assert head_slice(1, 4, 0, 2, 8) == HeadSlice(0, 2, 2, 2, 4)
    assert head_slice(3, 4, 1, 2, 8) == HeadSlice(0, 2, 2, 2, 4)
    assert head_slice(2, 4, 0, 2, 8) is None


def test_tp_2_to_4_mha() -> None:
    for d, p in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        m = map_ranks(2, 1, 1, ParallelInfo(tp_size=4, tp_rank=d), is_mla=False, total_heads=8)
        assert _targets(m) == [(p, 0, 0, False)]
        assert (m.required_responses, m.required_dst_info_num) == (1, 2)
    assert head_slice(0, 2, 0, 4, 8) == HeadSlice(0, 2, 0, 4, 2)
    assert head_slice(0, 2, 1, 4, 8) == HeadSlice(2, 2, 0, 4, 2)
    assert head_slice(1, 2, 3, 4, 8) == HeadSlice(2, 2, 0, 4, 2)


def test_tp_1_to_8() -> None:
    for d in range(8):
        m = map_ranks(1, 1, 1, ParallelInfo(tp_size=8, tp_rank=d), is_mla=False, total_heads=8)
        assert _targets(m) == [(0, 0, 0, False)]
        assert m.required_dst_info_num == 8
        assert head_slice(0, 1, d, 8, 8) == HeadSlice(d, 1, 0, 8, 1)


def test_tp_8_to_1() -> None:
    m = map_ranks(8, 1, 1, ParallelInfo(tp_size=1, tp_rank=0), is_mla=False, total_heads=8)
    assert _targets(m) == [(r, 0, 0, False) for r in range(8)]
    assert (m.required_responses, m.required_dst_info_num) == (8, 1)
    for r in range(8):
        assert head_slice(r, 8, 0, 1, 8) == HeadSlice(0, 1, r, 1, 8)


def test_gqa_replication_two_heads_tp8() -> None:
    assert [held_heads(r, 8, 2) for r in range(8)] == [(0, 1)] * 4 + [(1, 1)] * 4
    # same TP: every rank pairs with its twin and holds one whole head
    m = map_ranks(8, 1, 1, ParallelInfo(tp_size=8, tp_rank=5), is_mla=False, total_heads=2)
    assert _targets(m) == [(5, 0, 0, False)]
    assert head_slice(5, 8, 5, 8, 2) == HeadSlice(0, 1, 0, 1, 1)
    # TP 8 -> 1: only the first replica of each head sends; the others are dummies
    m = map_ranks(8, 1, 1, ParallelInfo(tp_size=1, tp_rank=0), is_mla=False, total_heads=2)
    assert _targets(m) == [(r, 0, 0, r not in (0, 4)) for r in range(8)]
    assert m.required_responses == 2
    assert head_slice(0, 8, 0, 1, 2) == HeadSlice(0, 1, 0, 1, 2)
    assert head_slice(4, 8, 0, 1, 2) == HeadSlice(0, 1, 1, 1, 2)
    # TP 2 -> 8: decode ranks 0-3 hold head 0 (from prefill 0), 4-7 head 1 (from prefill 1)
    for d in range(8):
        m = map_ranks(2, 1, 1, ParallelInfo(tp_size=8, tp_rank=d), is_mla=False, total_heads=2)
        assert _targets(m) == [(d // 4, 0, 0, False)]
        assert m.required_dst_info_num == 4
        assert head_slice(d // 4, 2, d, 8, 2) == HeadSlice(0, 1, 0, 1, 1)


def test_mla_8_to_2_dummies() -> None:
    m0 = map_ranks(8, 1, 1, ParallelInfo(tp_size=2, tp_rank=0), is_mla=True)
    m1 = map_ranks(8, 1, 1, ParallelInfo(tp_size=2, tp_rank=1), is_mla=True)
    assert _targets(m0) == [(0, 0, 0, False), (1, 0, 0, True), (2, 0, 0, True), (3, 0, 0, True)]
    assert _targets(m1) == [(4, 0, 0, False), (5, 0, 0, True), (6, 0, 0, True), (7, 0, 0, True)]
    assert (m0.required_responses, m0.required_dst_info_num) == (1, 1)


def test_pp_2_to_1() -> None:
    m = map_ranks(1, 2, 1, ParallelInfo(tp_size=1, pp_size=1), is_mla=False, total_heads=8)
    assert _targets(m) == [(0, 0, 0, False), (0, 1, 0, False)]
    assert [t.unique_rank for t in m.targets] == [0, 1]
    assert m.required_responses == 2
    same = map_ranks(1, 2, 1, ParallelInfo(tp_size=1, pp_size=2, pp_rank=1), is_mla=False, total_heads=8)
    assert _targets(same) == [(0, 1, 0, False)]
    with pytest.raises(IncompatiblePeer, match="must equal prefill PP"):
        map_ranks(1, 4, 1, ParallelInfo(pp_size=2), is_mla=False)


def test_cp_2_with_dummy() -> None:
    m = map_ranks(1, 1, 2, ParallelInfo(), is_mla=False, total_heads=8)
    assert _targets(m) == [(0, 0, 0, False), (0, 0, 1, True)]
    assert [t.unique_rank for t in m.targets] == [0, 1]
    assert m.required_responses == 1
    every = map_ranks(1, 1, 2, ParallelInfo(), is_mla=False, total_heads=8, all_cp_ranks_send=True)
    assert every.required_responses == 2


def test_unique_rank_formula() -> None:
    assert unique_rank(tp_rank=3, pp_rank=1, cp_rank=1, pp_size=2, cp_size=2) == 3 * 4 + 1 * 2 + 1
    assert ParallelInfo(tp_size=4, tp_rank=2, pp_size=2, pp_rank=1).unique_rank == 2 * 2 + 1


def test_invalid_topologies() -> None:
    with pytest.raises(IncompatiblePeer, match="not multiples"):
        map_ranks(3, 1, 1, ParallelInfo(tp_size=2), is_mla=False, total_heads=6)
    with pytest.raises(ConfigError):
        ParallelInfo(tp_size=2, tp_rank=2)
    with pytest.raises(ConfigError, match="do not split"):
        held_heads(0, 3, 8)
