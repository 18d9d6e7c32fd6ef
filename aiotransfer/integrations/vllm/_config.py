"""The connector's settings and the ``kv_transfer_params`` it exchanges: plain Python, no vLLM import.

Everything a request carries between the prefill and the decode instance is validated here, so a malformed
or foreign ``kv_transfer_params`` dict is refused with a clear reason before any byte moves.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._config import TransferConfig
from ...errors import ConfigError, InvalidArgument
from ._streaming import check_streaming, stream_mode

__all__ = ["CacheGroups", "ConnectorConfig", "Plan", "PlanKind", "RemotePrefill", "check_endpoint", "check_room",
           "concurrent_params", "plan_request", "room_of", "FORGONE", "MAX_REMOTE_BLOCKS",
           "NIXL_PROGRESS_DELAY_US", "KEY_BLOCKS", "KEY_DECODE", "KEY_ENDPOINT", "KEY_ERROR", "KEY_PREFILL",
           "KEY_ROOM", "KEY_TOKENS", "STATE_KIND"]

KEY_ENDPOINT = "aiotransfer_endpoint"
"""``kv_transfer_params`` key: the prefill worker's control address (``tcp://host:port``)."""
KEY_ROOM = "aiotransfer_room"
"""``kv_transfer_params`` key: the room both sides use for this request."""
KEY_ERROR = "aiotransfer_error"
"""``kv_transfer_params`` key of an answer whose request moved no KV: why (its prompt was computed locally)."""
KEY_PREFILL = "do_remote_prefill"
"""``kv_transfer_params`` key (vLLM's): a decode request that loads its prompt's KV from a prefill."""
KEY_DECODE = "do_remote_decode"
"""``kv_transfer_params`` key (vLLM's): a prefill request that computes the prompt and keeps its KV for a decode."""
KEY_TOKENS = "remote_num_tokens"
"""``kv_transfer_params`` key of a prefill's answer: the prompt tokens it computed."""
KEY_BLOCKS = "remote_block_ids"
"""``kv_transfer_params`` key of a prefill's answer: its blocks (the decode never reads them: the prefill
writes from them)."""
MAX_REMOTE_BLOCKS = 1 << 20
"""The most ``remote_block_ids`` a decode request may carry (16 Mi tokens in blocks of 16): the list is
checked entry by entry, so its length is bounded too."""

FORGONE = "the decode request needs no KV from this prefill (ended, or a local cache hit)"
"""The abort reason a decode gives a prefill room it will never ask for; the prefill frees its blocks."""

NIXL_PROGRESS_DELAY_US = 200
"""The connector's default ``TransferConfig.nixl_progress_delay_us`` (NIXL's own default is 0: spin)."""

_ENGINES = ("mooncake_tcp", "mooncake", "nixl")

STATE_KIND = "mamba"
"""The aiotransfer state kind a hybrid model's Mamba block travels as (``KVSender.send_state``)."""


@dataclass(frozen=True)
class CacheGroups:
    """Which of vLLM's KV cache groups the connector moves, and how.

    ``attention``: the full-attention group, whose blocks travel as KV pages. ``mamba``: the Mamba group of
    a hybrid model (``None`` otherwise), whose one state block per request travels as state; the last
    ``mamba_spec_blocks`` of its block list are speculative scratch, not state.
    """

    attention: int = 0
    mamba: int | None = None
    mamba_spec_blocks: int = 0

    @property
    def backoff(self) -> int:
        """Prompt tokens the prefill leaves to the decode. A Mamba state holds every token it has seen, and
        vLLM recomputes the last prompt token on the decode: so the prefill stops one token short, the
        decode loads the state after N-1 tokens and computes token N itself (vLLM's NixlConnector does
        the same, its ``_prefill_backoff``)."""
        return 0 if self.mamba is None else 1

    def pages(self, groups: Sequence[Sequence[int]]) -> list[int]:
        """The attention blocks of a request's per-group block ids."""
        return list(groups[self.attention]) if len(groups) > self.attention else []

    def state_block(self, groups: Sequence[Sequence[int]]) -> int | None:
        """The block holding a request's running Mamba state (``None``: not hybrid, or no block yet)."""
        if self.mamba is None or len(groups) <= self.mamba:
            return None
        blocks = list(groups[self.mamba])
        if self.mamba_spec_blocks and len(blocks) > 1:
            blocks = blocks[:-min(self.mamba_spec_blocks, len(blocks) - 1)]
        return int(blocks[-1]) if blocks else None

    def loaded_tokens(self, remote_tokens: int | None, num_prompt_tokens: int) -> int:
        """Prompt tokens a decode loads (0: it computes the prompt itself).

        ``remote_tokens`` is what the prefill computed; ``None`` (concurrent dispatch: the decode asks before
        the prefill has answered) means what a prefill of the same model computes for this prompt, all of
        it less :attr:`backoff` (a prompt no longer than the backoff is not cut).
        Attention KV: what the prefill computed, up to the prompt. A Mamba state holds every token the
        prefill saw, and vLLM recomputes the last prompt token on the decode: a hybrid decode can use the
        state only if the prefill stopped short of the last token, and then loads exactly what the prefill
        computed. A prefill that computed the whole prompt (a one-token prompt, or a request vLLM would not
        let it cut) would have the decode apply a token twice, so its KV is not loaded."""
        if remote_tokens is None:
            cut = num_prompt_tokens > self.backoff
            remote_tokens = num_prompt_tokens - self.backoff if cut else num_prompt_tokens
        if self.mamba is None:
            return min(remote_tokens, num_prompt_tokens)
        return remote_tokens if remote_tokens < num_prompt_tokens else 0


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of :class:`AiotransferConnector`, validated.

    ``transfer_timeout`` bounds one request's transfer on each side: the decode's metadata delivery plus
    its wait for every byte, and the prefill's sending once the decode has asked. ``lease`` bounds how long
    a prefill holds a finished request's blocks for a decode that has not asked for them yet.
    ``release_timeout`` bounds the wait for a failed room's pages to be provably untouched; a room that
    does not get there keeps its blocks out of vLLM's pool (logged) rather than risk another request's KV.

    With ``engine="nixl"`` the connector lets UCX's progress thread sleep up to
    :data:`NIXL_PROGRESS_DELAY_US` between polls unless ``transfer`` sets ``nixl_progress_delay_us``
    itself: a thread spinning a core in every vLLM process slows the engines' own steps (see the vLLM page
    of the docs for the figures).
    """

    engine: str = "mooncake_tcp"
    hostname: str = "127.0.0.1"
    port: int = 0
    transfer_timeout: float = 30.0
    lease: float = 30.0
    release_timeout: float = 120.0
    stream_layers: str | bool = "auto"
    """Prefill: push a room layer by layer during the forward pass when its decode has already asked
    (concurrent dispatch): ``"auto"`` when the pass's layers are large enough for it to pay (a short
    prompt goes whole after the pass; the vLLM page of the docs states the rule), ``"always"`` (``true``),
    ``"never"`` (``false``). On a GPU each layer waits for its kernels; hybrid models send their Mamba
    state once the pass is over."""
    stream_min_tokens: int | None = None
    """Prefill, ``stream_layers="auto"``: the fewest tokens a pass's layer must carry to be streamed, in
    place of the threshold the rule computes from the engine's measured per-layer cost."""
    send_chunks: bool = True
    """Prefill, chunked prefill: once the decode has asked, send the blocks each chunk's pass completes in
    that pass (layer by layer with ``stream_layers``, else whole right after it), not all with the last
    chunk. A request preempted between two chunks waits (``handle_preemptions``) until no write reads its
    blocks before vLLM reuses them."""
    transfer: Mapping[str, Any] = field(default_factory=dict)
    """More :class:`~aiotransfer.TransferConfig` fields, passed through (e.g. ``checksum``)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {"engine", "hostname", "port", "transfer_timeout", "lease", "release_timeout", "stream_layers",
                 "stream_min_tokens", "send_chunks", "transfer"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        cfg = cls(**extra)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.engine not in _ENGINES:
            raise ConfigError(f"kv_connector_extra_config engine={self.engine!r}: expected one of {_ENGINES}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"kv_connector_extra_config port={self.port!r}: expected 0..65535")
        for name in ("transfer_timeout", "lease", "release_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"kv_connector_extra_config {name}={value!r}: expected seconds > 0")
        if not isinstance(self.send_chunks, bool):
            raise ConfigError(f"kv_connector_extra_config send_chunks={self.send_chunks!r}: expected true or false")
        check_streaming(self.stream_layers, self.stream_min_tokens)
        if not isinstance(self.transfer, Mapping):
            raise ConfigError("kv_connector_extra_config transfer: expected a dict of TransferConfig fields")

    @property
    def stream_mode(self) -> str:
        """``stream_layers`` as one of ``"auto"``, ``"always"``, ``"never"``."""
        return stream_mode(self.stream_layers)

    def transfer_config(self, tp_rank: int = 0) -> TransferConfig:
        """The worker's :class:`TransferConfig`: each TP rank listens on ``port + tp_rank`` (or any port)."""
        port = self.port + tp_rank if self.port else 0
        timeouts = {"handshake_timeout": self.transfer_timeout, "transfer_timeout": self.transfer_timeout,
                    "done_timeout": self.transfer_timeout, "ready_timeout": self.lease}
        if self.engine == "nixl":
            timeouts["nixl_progress_delay_us"] = NIXL_PROGRESS_DELAY_US
        try:
            return TransferConfig(engine=self.engine, hostname=self.hostname, control_port=port,
                                  **{**timeouts, **dict(self.transfer)})
        except TypeError as exc:
            raise ConfigError(f"kv_connector_extra_config transfer: {exc}") from None


_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+")
"""A control address's host: a name, an IPv4 address or a bracketed IPv6 address."""
_MAX_HOST = 253


def check_endpoint(endpoint: object) -> str:
    """A prefill worker's control address from ``kv_transfer_params``: ``tcp://host:port``, port 1..65535.

    Raises :class:`InvalidArgument` naming what is wrong. Anything that passes is an address the decode's
    manager accepts (:func:`~aiotransfer._control.endpoint.normalize_endpoint`), so a request is refused
    here, before it is scheduled, rather than failing when its room opens."""
    what = f"kv_transfer_params: {KEY_ENDPOINT}={reprlib.repr(endpoint)}"
    hint = "expected tcp://host:port with a port in 1..65535, as AiotransferConnector makes them"
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise InvalidArgument(f"{what} is missing or not a tcp:// address; {hint}")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port or port.endswith("]"):
        raise InvalidArgument(f"{what} has no port; {hint}")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{what}: port {port!r} is not in 1..65535; {hint}")
    if not host or len(host) > _MAX_HOST or not _HOST.fullmatch(host):
        raise InvalidArgument(f"{what}: host {host!r} is not a host name or IP address; {hint}")
    return endpoint


def room_of(request_id: str) -> int:
    """The room of a request: a 63-bit hash of its id, the same in the scheduler and the worker."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def check_room(room: object) -> int:
    """A room from ``kv_transfer_params``: an int in ``[0, 2**63)``; raises :class:`InvalidArgument`."""
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
        raise InvalidArgument(f"kv_transfer_params: {KEY_ROOM} must be an int in [0, 2**63), got {reprlib.repr(room)}")
    return room


def concurrent_params(endpoint: str, room: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kv_transfer_params`` for concurrent dispatch: the two requests of one prompt sent at once.

    Args:
        endpoint: The prefill worker's control address (any answer of that prefill carries it as
            ``aiotransfer_endpoint``); the decode's parameters name it.
        room: The room both name (a router picks one per request, e.g. 63 random bits).

    Returns:
        ``(prefill's, decode's)`` parameters.

    Raises:
        InvalidArgument: A bad address or room.
    """
    room = check_room(room)
    return ({"do_remote_decode": True, "do_remote_prefill": False, KEY_ROOM: room},
            {"do_remote_prefill": True, "do_remote_decode": False, KEY_ENDPOINT: check_endpoint(endpoint), KEY_ROOM: room})


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode request needs to receive its prompt's KV, read from its ``kv_transfer_params``.

    From a prefill's answer (the serial flow) it has every field. A router that dispatches to the prefill
    and the decode at once (concurrent dispatch) gives the decode only the prefill worker's address and
    the room: ``num_tokens`` is then ``None`` (the prompt, as a prefill of the same model computes it) and
    ``block_ids`` empty (the decode never needs the prefill's block ids: the prefill writes from them).
    """

    endpoint: str
    room: int
    num_tokens: int | None
    block_ids: tuple[int, ...] = ()

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Validate ``kv_transfer_params`` from a prefill's output; raises :class:`InvalidArgument`."""
        endpoint = check_endpoint(params.get(KEY_ENDPOINT))
        room = check_room(params.get(KEY_ROOM))
        num_tokens = params.get(KEY_TOKENS)
        if num_tokens is not None and not _is_int(num_tokens, 0, 2**63):
            raise InvalidArgument(f"kv_transfer_params: {KEY_TOKENS} must be an int >= 0, got "
                                  f"{reprlib.repr(num_tokens)}")
        blocks = params.get(KEY_BLOCKS)
        if blocks is None:
            blocks = ()
        if (not isinstance(blocks, (list, tuple)) or len(blocks) > MAX_REMOTE_BLOCKS
                or not all(_is_int(b, 0, 2**63) for b in blocks) or len(set(blocks)) != len(blocks)):
            raise InvalidArgument(f"kv_transfer_params: {KEY_BLOCKS} must be a list of at most {MAX_REMOTE_BLOCKS} "
                                  f"distinct block ids in [0, 2**63), got {reprlib.repr(blocks)}")
        return cls(endpoint, room, num_tokens, tuple(blocks))

    def to_params(self) -> dict[str, Any]:
        """The dict the prefill's ``request_finished`` returns (vLLM puts it on the request output); the
        same keys, less ``remote_num_tokens`` and ``remote_block_ids``, are a concurrent decode's."""
        return {
            KEY_PREFILL: True,
            KEY_DECODE: False,
            KEY_ENDPOINT: self.endpoint,
            KEY_ROOM: self.room,
            KEY_TOKENS: self.num_tokens,
            KEY_BLOCKS: list(self.block_ids),
        }


def _is_int(value: object, low: int, high: int) -> bool:
    """``value`` is an int (not a bool) in ``[low, high)``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


class PlanKind(enum.Enum):
    """What the connector does with a request."""

    LOCAL = "local"
    """No transfer: the request computes its prompt, as without a connector."""
    SEND = "send"
    """A prefill request: compute the prompt and send its KV to the decode that asks."""
    RECV = "recv"
    """A decode request: load the prompt's KV from a prefill."""
    REFUSED = "refused"
    """Contradictory or malformed ``kv_transfer_params``: no KV moves, no peer is contacted, and the prompt
    is computed locally."""


@dataclass(frozen=True)
class Plan:
    """What the connector does with one request, decided once from its ``kv_transfer_params``
    (:func:`plan_request`) at the first scheduler call that sees them; every later call follows it.

    ``room``: a :attr:`~PlanKind.SEND` request's room when the router gave one (else the room of the
    request id). ``remote``: what a :attr:`~PlanKind.RECV` request loads. ``reason``: why a
    :attr:`~PlanKind.REFUSED` request was refused.
    """

    kind: PlanKind
    room: int | None = None
    remote: RemotePrefill | None = None
    reason: str | None = None


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise InvalidArgument(f"kv_transfer_params: {key} must be true or false, got {reprlib.repr(value)}")


def plan_request(params: object, num_prompt_tokens: int) -> Plan:
    """The one check of a request's ``kv_transfer_params``: what the connector does with it. Never raises.

    Each key the connector reads has a meaning and a range, checked here before any use:

    - ``do_remote_decode`` / ``do_remote_prefill``: true, false or absent; at most one of them true.
    - a prefill request (``do_remote_decode``): ``aiotransfer_room`` absent or an int in ``[0, 2**63)``.
    - a decode request (``do_remote_prefill``): ``aiotransfer_endpoint`` a ``tcp://host:port`` address;
      ``aiotransfer_room`` an int in ``[0, 2**63)``; ``remote_num_tokens`` absent (concurrent dispatch) or
      an int in ``[0, num_prompt_tokens]`` (a prefill cannot have computed more of the prompt than it has);
      ``remote_block_ids`` absent or a list of at most :data:`MAX_REMOTE_BLOCKS` distinct ints in
      ``[0, 2**63)``.

    Anything else is a :attr:`~PlanKind.REFUSED` plan naming what is wrong. Other keys are not read.
    """
    if params is None:
        return Plan(PlanKind.LOCAL)
    if not isinstance(params, Mapping):
        return Plan(PlanKind.REFUSED, reason=f"kv_transfer_params must be a dict, got {reprlib.repr(params)}")
    try:
        decode, prefill = _flag(params, KEY_DECODE), _flag(params, KEY_PREFILL)
        if decode and prefill:
            raise InvalidArgument(f"kv_transfer_params: {KEY_PREFILL} and {KEY_DECODE} are both true; a request "
                                  "either loads its prompt's KV from a prefill or sends it to a decode")
        if decode:
            room = params.get(KEY_ROOM)
            return Plan(PlanKind.SEND, room=None if room is None else check_room(room))
        if not prefill:
            return Plan(PlanKind.LOCAL)
        remote = RemotePrefill.parse(params)
        if remote.num_tokens is not None and remote.num_tokens > num_prompt_tokens:
            raise InvalidArgument(f"kv_transfer_params: {KEY_TOKENS}={remote.num_tokens} exceeds the request's "
                                  f"{num_prompt_tokens} prompt tokens (the answer of another prompt's prefill?)")
        return Plan(PlanKind.RECV, remote=remote)
    except InvalidArgument as exc:
        return Plan(PlanKind.REFUSED, reason=str(exc))
