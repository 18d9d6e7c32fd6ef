"""When the prefill streams a pass's KV layer by layer, and when it sends it whole after the pass.

Plain Python, no vLLM import. A streamed layer's write runs behind the compute of the layers after it, so
at the end of the pass only the last layer's write is left instead of all of them. Each streamed layer
pays for that: an engine post, a completion and the library's own work on the prefill (CPU taken beside
vLLM's forward pass), where a pass sent whole pays them once. So a layer is worth streaming when its
write takes longer on the wire than that per-layer cost::

    tokens x bytes_per_token_per_layer / wire_bandwidth  >  per_layer_cost

that is, when the tokens one layer's write carries reach :func:`stream_threshold`, and never below
:data:`STREAM_FLOOR_TOKENS`. A short prompt's layers are small: it goes whole.

The connector decides per pass of each request (the whole prompt, or one chunk of a chunked prefill),
with the blocks that pass sends: ``kv_connector_extra_config`` ``stream_layers`` (``"auto"``: this rule,
``"always"``, ``"never"``) and ``stream_min_tokens`` (the rule's threshold, set by hand).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import ConfigError

__all__ = ["LAYER_COST_US", "STREAM_FLOOR_TOKENS", "STREAM_MODES", "WIRE_GBPS", "StreamRule", "check_streaming",
           "stream_mode", "stream_threshold"]

STREAM_MODES = ("auto", "always", "never")
"""``stream_layers`` values: ``auto`` streams a pass whose layers carry at least the rule's threshold of
tokens; ``always`` streams every pass whose decode has asked (the behaviour before the rule); ``never``
sends every pass whole after it."""

LAYER_COST_US: Mapping[str, float] = {"mooncake_tcp": 1000.0, "mooncake": 1000.0, "nixl": 700.0}
"""What streaming one more layer costs, in µs: the library's CPU for one streamed layer of 256 contiguous
pages (2 entries of 512 KiB, a 1 MiB layer), the engine's post and the completion included, measured by the
``cpu`` phase on the project's 2-vCPU machine over loopback (``python -m benchmarks full --quick --engines
mooncake_tcp,nixl_shm --phases cpu``). Mooncake TCP: 711-909 µs in ten runs of a quieter day, 1,395 and
1,752 on loaded ones; NIXL over UCX shared memory: 436-735, then 728 and 1,273 (docs/vllm.md lists the runs).
On Mooncake most of it is the event loop polling the write while it runs, so it grows with the layer.
``mooncake`` (RDMA) is not measured here and takes Mooncake TCP's figure."""

WIRE_GBPS: Mapping[str, float] = {"mooncake_tcp": 1.85, "mooncake": 1.85, "nixl": 8.17}
"""The wire's bandwidth, in GB/s: the raw engine's 64 MiB write on the same machine (docs/performance.md,
Results: Mooncake TCP 1.85, NIXL over UCX shared memory 8.17). A faster wire makes a layer's write shorter,
so there is less to hide and the threshold rises: on RDMA, measure and set ``stream_min_tokens``."""

STREAM_FLOOR_TOKENS = 1024
"""The rule never streams a pass of fewer tokens. SGLang's layer-pipelined transfer (its PR 23515,
Qwen2.5-72B on H20 GPUs over RDMA) cut TTFT by 61 % at 1,024 tokens and left 256-token prompts 18 % slower:
1,024 is the shortest prompt measured to gain."""


def stream_threshold(bytes_per_token_per_layer: float, *, layer_cost_us: float, wire_gbps: float,
                     floor: int = STREAM_FLOOR_TOKENS) -> int:
    """The fewest tokens a layer's write must carry for streaming it to pay: the tokens whose bytes the
    wire moves in ``layer_cost_us``, and at least ``floor``.

    Args:
        bytes_per_token_per_layer: One token's KV in one layer (K and V), in bytes.
        layer_cost_us: What streaming one layer costs (:data:`LAYER_COST_US`).
        wire_gbps: The wire's bandwidth in GB/s (:data:`WIRE_GBPS`).
        floor: The fewest tokens ever streamed.

    Raises:
        ValueError: A size, cost or bandwidth that is not a finite number above 0 (a cost of 0 is allowed:
            streaming is then free, and only ``floor`` holds).
    """
    for name, value, zero_ok in (("bytes_per_token_per_layer", bytes_per_token_per_layer, False),
                                 ("layer_cost_us", layer_cost_us, True), ("wire_gbps", wire_gbps, False)):
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or value < 0 or (value == 0 and not zero_ok)):
            raise ValueError(f"stream_threshold: {name}={value!r}: expected a finite number above 0")
    break_even = layer_cost_us * 1e-6 * wire_gbps * 1e9 / bytes_per_token_per_layer
    return max(int(floor), math.ceil(break_even))


@dataclass(frozen=True)
class StreamRule:
    """Whether a pass that writes a layer of ``tokens`` tokens is streamed (:meth:`streams`)."""

    mode: str = "auto"
    """One of :data:`STREAM_MODES`."""
    min_tokens: int = STREAM_FLOOR_TOKENS
    """``auto``: the fewest tokens streamed."""

    @classmethod
    def of(cls, mode: str, engine: str, bytes_per_token_per_layer: float, min_tokens: int | None = None,
           ) -> StreamRule:
        """The rule of a worker: ``min_tokens`` as set by hand, else :func:`stream_threshold` with the
        engine's measured constants (Mooncake TCP's for an engine not listed)."""
        if mode not in STREAM_MODES:
            raise ValueError(f"StreamRule: mode={mode!r}: expected one of {STREAM_MODES}")
        if min_tokens is None:
            min_tokens = stream_threshold(bytes_per_token_per_layer,
                                          layer_cost_us=LAYER_COST_US.get(engine, LAYER_COST_US["mooncake_tcp"]),
                                          wire_gbps=WIRE_GBPS.get(engine, WIRE_GBPS["mooncake_tcp"]))
        return cls(mode, min_tokens)

    def streams(self, tokens: int) -> bool:
        """Whether a pass whose layers each carry ``tokens`` tokens is streamed layer by layer (else it is
        sent whole after the pass). Monotone: a pass that streams, a longer one streams too."""
        if self.mode == "always":
            return True
        if self.mode == "never":
            return False
        return tokens >= self.min_tokens


def stream_mode(stream_layers: object) -> str:
    """``stream_layers`` of ``kv_connector_extra_config`` as one of :data:`STREAM_MODES` (``true`` is
    ``"always"``, ``false`` ``"never"``: the values it took before the rule); raises :class:`ConfigError`."""
    if stream_layers is True:
        return "always"
    if stream_layers is False:
        return "never"
    if isinstance(stream_layers, str) and stream_layers in STREAM_MODES:
        return stream_layers
    raise ConfigError(f"kv_connector_extra_config stream_layers={stream_layers!r}: expected one of "
                      f"{', '.join(map(repr, STREAM_MODES))} (or true for 'always', false for 'never')")


def check_streaming(stream_layers: object, stream_min_tokens: object) -> None:
    """Validate ``stream_layers`` and ``stream_min_tokens``; raises :class:`ConfigError` saying what is
    wrong: a mode not known, a threshold that is not a whole number of tokens >= 1, or a threshold given
    with a mode that does not use it."""
    mode = stream_mode(stream_layers)
    if stream_min_tokens is None:
        return
    if not isinstance(stream_min_tokens, int) or isinstance(stream_min_tokens, bool) or stream_min_tokens < 1:
        raise ConfigError(f"kv_connector_extra_config stream_min_tokens={stream_min_tokens!r}: expected a whole "
                          "number of tokens >= 1")
    if mode != "auto":
        raise ConfigError(f"kv_connector_extra_config stream_min_tokens={stream_min_tokens} applies only with "
                          f"stream_layers='auto', not {stream_layers!r}: drop one of the two")
