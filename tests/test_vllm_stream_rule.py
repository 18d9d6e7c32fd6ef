"""When the vLLM connector streams a pass layer by layer and when it sends it whole: the rule alone (no vLLM,
no engine), its configuration, and the prefill worker applying it per request over a real engine across two
OS processes."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiotransfer.errors import ConfigError
from aiotransfer.integrations.vllm._config import ConnectorConfig
from aiotransfer.integrations.vllm._scheduler import Orders, SendJob
from aiotransfer.integrations.vllm._streaming import (
    LAYER_COST_US,
    STREAM_FLOOR_TOKENS,
    WIRE_GBPS,
    StreamRule,
    stream_threshold,
)
from aiotransfer.integrations.vllm._worker import WorkerSide
from tests.conftest import ENGINES
from tests.peer import digest, make_buffers
from tests.test_vllm_sides import ITEM, DecodeWorker, prefill_worker, wait_sent, workers

tokens = st.integers(min_value=0, max_value=10**7)
sizes = st.floats(min_value=1.0, max_value=1e7, allow_nan=False, allow_infinity=False)
costs = st.floats(min_value=0.0, max_value=1e5, allow_nan=False, allow_infinity=False)
bandwidths = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False, allow_infinity=False)


# -- the rule ----------------------------------------------------------------------------------------
@given(st.sampled_from(["auto", "always", "never"]), st.integers(min_value=1, max_value=10**6), tokens, tokens)
def test_a_pass_that_streams_a_longer_one_streams_too(mode: str, threshold: int, a: int, b: int) -> None:
    rule = StreamRule(mode, threshold)
    short, long = sorted((a, b))
    assert not rule.streams(short) or rule.streams(long)


@given(st.integers(min_value=1, max_value=10**6), tokens)
def test_always_and_never_obey_whatever_the_prompt(threshold: int, n: int) -> None:
    assert StreamRule("always", threshold).streams(n)
    assert not StreamRule("never", threshold).streams(n)
    assert StreamRule("auto", threshold).streams(n) == (n >= threshold)


@given(sizes, costs, bandwidths, st.integers(min_value=0, max_value=10**5))
def test_the_threshold_is_the_break_even_and_never_below_the_floor(per_token: float, cost: float, gbps: float,
                                                                   floor: int) -> None:
    n = stream_threshold(per_token, layer_cost_us=cost, wire_gbps=gbps, floor=floor)
    assert n >= floor
    if n > floor:  # a layer of n tokens takes at least the per-layer cost on the wire; one token fewer, less
        wire_us = lambda t: t * per_token / (gbps * 1e9) * 1e6  # noqa: E731
        assert wire_us(n) >= cost * (1 - 1e-9)
        assert wire_us(n - 1) < cost * (1 + 1e-9)


@given(sizes, sizes, costs, bandwidths)
def test_larger_layers_stream_from_fewer_tokens(a: float, b: float, cost: float, gbps: float) -> None:
    small, large = sorted((a, b))
    assert (stream_threshold(large, layer_cost_us=cost, wire_gbps=gbps)
            <= stream_threshold(small, layer_cost_us=cost, wire_gbps=gbps))


@given(sizes, costs, costs, bandwidths)
def test_a_costlier_layer_needs_more_tokens(per_token: float, a: float, b: float, gbps: float) -> None:
    cheap, dear = sorted((a, b))
    assert (stream_threshold(per_token, layer_cost_us=cheap, wire_gbps=gbps)
            <= stream_threshold(per_token, layer_cost_us=dear, wire_gbps=gbps))


def test_the_threshold_by_hand() -> None:
    # 1 ms a layer at 2 GB/s: 2 MB per layer; at 4 KiB per token and layer (Llama-8B in bf16), 489 tokens
    assert stream_threshold(4096, layer_cost_us=1000, wire_gbps=2.0, floor=0) == math.ceil(2e6 / 4096) == 489
    assert stream_threshold(4096, layer_cost_us=1000, wire_gbps=2.0) == STREAM_FLOOR_TOKENS
    assert StreamRule.of("auto", "nixl", 256).min_tokens == math.ceil(
        LAYER_COST_US["nixl"] * 1e-6 * WIRE_GBPS["nixl"] * 1e9 / 256)
    assert StreamRule.of("auto", "nixl", 256, min_tokens=7) == StreamRule("auto", 7)


@pytest.mark.parametrize(("per_token", "cost", "gbps"), [
    (0, 1000, 1.0), (-1, 1000, 1.0), (float("nan"), 1000, 1.0), (4096, -1, 1.0), (4096, 1000, 0),
    (4096, float("inf"), 1.0), (True, 1000, 1.0),
])
def test_the_threshold_refuses_sizes_costs_and_bandwidths_that_are_none(per_token: Any, cost: Any, gbps: Any) -> None:
    with pytest.raises(ValueError, match="expected a finite number above 0"):
        stream_threshold(per_token, layer_cost_us=cost, wire_gbps=gbps)


# -- the knob ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "mode"), [
    (None, "auto"), ("auto", "auto"), ("always", "always"), ("never", "never"), (True, "always"), (False, "never"),
])
def test_stream_layers_names_a_mode_and_the_booleans_keep_their_meaning(value: Any, mode: str) -> None:
    extra = {} if value is None else {"stream_layers": value}
    assert ConnectorConfig.from_extra(extra).stream_mode == mode


@pytest.mark.parametrize(("extra", "match"), [
    ({"stream_layers": "sometimes"}, r"stream_layers='sometimes': expected one of 'auto', 'always', 'never'"),
    ({"stream_layers": 1}, r"stream_layers=1: expected one of"),
    ({"stream_layers": None}, r"stream_layers=None: expected one of"),
    ({"stream_min_tokens": 0}, r"stream_min_tokens=0: expected a whole number of tokens >= 1"),
    ({"stream_min_tokens": -5}, r"stream_min_tokens=-5: expected a whole number"),
    ({"stream_min_tokens": 1.5}, r"stream_min_tokens=1.5: expected a whole number"),
    ({"stream_min_tokens": "512"}, r"stream_min_tokens='512': expected a whole number"),
    ({"stream_min_tokens": True}, r"stream_min_tokens=True: expected a whole number"),
    ({"stream_layers": "never", "stream_min_tokens": 512}, r"applies only with stream_layers='auto', not 'never'"),
    ({"stream_layers": True, "stream_min_tokens": 512}, r"applies only with stream_layers='auto', not True"),
])
def test_bad_streaming_settings_are_refused_with_the_reason(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra)


def test_stream_min_tokens_is_a_known_key() -> None:
    assert ConnectorConfig.from_extra({"stream_min_tokens": 2048}).stream_min_tokens == 2048


# -- the prefill worker, per request, over a real engine ---------------------------------------------
PAUSE = 0.2
"""Seconds between two layers of the pass: time for a push that should not have started to have moved."""


def ask_early(prefill: WorkerSide, decode: DecodeWorker, req: str, room: int, blocks: list[int]) -> None:
    """The decode asks for ``room`` before the prefill computes it (concurrent dispatch)."""
    decode.post({"op": "recv", "req": req, "room": room, "peer": prefill.endpoint, "blocks": blocks})
    deadline = time.monotonic() + 20
    while prefill.manager_stats()["pending_requests"] != 1:
        assert time.monotonic() < deadline, f"the decode's request never reached the prefill: {prefill.counts()}"
        time.sleep(0.01)


def run_pass(prefill: WorkerSide, kv: list[np.ndarray], blocks: tuple[int, ...], *, tell_first: bool) -> None:
    """The forward pass writes ``blocks`` in each layer and reports the layer: after writing it, or
    (``tell_first``) before, which only a room sent whole after the pass survives."""
    for layer, buf in enumerate(kv):
        time.sleep(PAUSE)
        if tell_first:
            prefill.layer_written(f"layer.{layer}")
            time.sleep(PAUSE)
        buf[list(blocks)] = 100 + layer
        if not tell_first:
            prefill.layer_written(f"layer.{layer}")


@pytest.mark.parametrize("engine", ENGINES)
def test_auto_sends_a_short_prompt_whole_after_the_pass_and_streams_a_long_one(engine: str) -> None:
    """Blocks of 16 tokens, ``stream_min_tokens=64``: a 2-block prompt goes whole once the pass is over, so
    layers reported before they are written still arrive fresh (streamed, they would land stale); a
    4-block prompt of the next pass streams, and its room ends before that pass does."""
    short, long = (40, 41), (50, 51, 52, 53)
    with workers(engine, seed=21, stream_layers="auto", stream_min_tokens=64) as (kv, prefill, decode):
        assert prefill.streams_layers and prefill.stream_rule == StreamRule("auto", 64)
        ask_early(prefill, decode, "short", 4101, [60, 61])
        prefill.begin_pass(Orders(send=[SendJob("short", 4101, short)]))
        run_pass(prefill, kv, short, tell_first=True)
        time.sleep(PAUSE)
        assert prefill.finished({"short"})[0] == set() and prefill.counts()["in_flight"] == 1, prefill.counts()
        prefill.end_pass()
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == [], out
        assert out["digest"] == digest(kv, list(short)), "the short prompt was pushed before its layers were written"
        wait_sent(prefill, "short", 10)

        ask_early(prefill, decode, "long", 4102, [62, 63, 64, 65])
        prefill.begin_pass(Orders(send=[SendJob("long", 4102, long)]))
        run_pass(prefill, kv, long, tell_first=False)
        out = decode.ask(None)  # the room ends without the pass's end: every layer went as it was written
        assert out["finished"] and out["load_errors"] == [], out
        assert out["digest"] == digest(kv, list(long))
        prefill.end_pass()
        wait_sent(prefill, "long", 10)
        counts = prefill.counts()
        assert (counts["sends_asked_early"], counts["sends_streamed"], counts["sends_whole_by_rule"],
                counts["sends_failed"], counts["in_flight"]) == (2, 1, 1, 0, 0), counts


def test_auto_takes_its_threshold_from_the_registered_kv_and_the_engine() -> None:
    worker = prefill_worker("mooncake_tcp", make_buffers(2, 8, ITEM, seed=22), stream_layers="auto")
    try:
        per_token = ITEM / 16  # one block of one layer, over the block's 16 tokens
        want = stream_threshold(per_token, layer_cost_us=LAYER_COST_US["mooncake_tcp"],
                                wire_gbps=WIRE_GBPS["mooncake_tcp"])
        assert worker.streams_layers and worker.stream_rule == StreamRule("auto", want)
    finally:
        worker.shutdown()
    worker = prefill_worker("mooncake_tcp", make_buffers(2, 8, ITEM, seed=23), stream_layers="never")
    try:
        assert not worker.streams_layers
    finally:
        worker.shutdown()
