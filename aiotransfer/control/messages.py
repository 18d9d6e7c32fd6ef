"""Versioned, strictly validated control messages (msgpack via msgspec).

Every message is a tagged struct; decoding checks types, and :func:`validate` checks values (sizes,
ranges). A message that fails either is a :class:`~aiotransfer.errors.ProtocolError`: the endpoint
counts it, logs it and drops it. An error's text up to its first colon is a fixed cause (the drop counter's
key), never a value from the wire, so the counters stay bounded whatever a peer sends.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ..errors import ProtocolError
from ..plan import bounds

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "validate",
    "Drained",
    "Ping",
    "Pong",
    "RankEndpoint",
    "StageGrant",
    "StageRequest",
    "Staged",
    "StagedAck",
    "RankRegister",
    "Topology",
    "TopologyQuery",
    "AuxData",
    "BufferSpec",
    "Hello",
    "HelloAck",
    "Message",
    "StateSpec",
    "Status",
    "TransferRequest",
    "decode",
    "encode",
    "pack_indices",
    "unpack_indices",
]

PROTOCOL_VERSION = 2
"""2: signed messages bind their sender and destination endpoints (see :mod:`.endpoint`)."""
_INDEX_DTYPE = np.dtype("<i4")
_MAX_LIST = 1 << 16
_MAX_SETTLE_MS = 60_000
"""A drain acknowledgement may ask the decode to keep its pages at most this long (a minute)."""


class BufferSpec(msgspec.Struct, frozen=True, array_like=True):
    """One registered buffer as a peer sees it."""

    ptr: int
    nbytes: int
    item_len: int
    layer_id: int = -1


class StateSpec(msgspec.Struct, frozen=True, array_like=True):
    """The buffers of one state type (mamba, swa, nsa...)."""

    kind: str
    buffers: list[BufferSpec]
    dims: list[int] = []


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Decode -> prefill, once per peer: who we are and where our memory is."""

    version: int
    endpoint: str
    generation: int
    engine: str
    session_id: str
    engine_info: bytes
    probe_addr: int
    compat: str
    kv: list[BufferSpec]
    aux: list[BufferSpec] = []
    state: list[StateSpec] = []
    layout: str = "layer_first"
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    kv_heads: int = 0
    total_kv_heads: int = 0
    page_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    outer: int = 1
    staging: BufferSpec | None = None
    dtype: str = ""
    """The KV cache dtype (empty from peers that do not declare it)."""
    kv_device: str = "cpu"
    """Where the KV buffers live (``cpu``, ``cuda:0``...)."""
    head_order: str = "NHD"
    """Inside a page: token-major (``NHD``) or head-major (``HND``)."""
    num_layers: int = 0
    incarnation: int = 0
    """The registering manager's incarnation id (what its ``Pong`` reports; 0: not said)."""


class HelloAck(msgspec.Struct, tag="hello_ack", frozen=True):
    """Prefill -> decode: accepted (and the engine can reach the decode) or refused with a reason."""

    version: int
    endpoint: str
    generation: int
    accepted: bool
    reason: str = ""
    engine: str = ""
    session_id: str = ""
    rank: int = 0
    incarnation: int = 0
    """The answering manager's incarnation id (what its ``Pong`` reports; 0: not said)."""


class TransferRequest(msgspec.Struct, tag="req", frozen=True):
    """Decode -> prefill, per room and target prefill rank: where the pages go."""

    room: int
    endpoint: str
    generation: int
    kv_indices: bytes
    aux_index: int = -1
    state_indices: dict[str, list[int]] = {}
    required_dst_info_num: int = 1
    is_dummy: bool = False
    num_tokens: int = -1
    """Tokens the room holds (-1: every declared page full); the prefill maps them onto its own pages."""


class Status(msgspec.Struct, tag="status", frozen=True):
    """Prefill -> decode: a room's terminal status (Success=4 / Failed=0) with a reason."""

    room: int
    status: int
    rank: int
    endpoint: str
    reason: str = ""
    aux_path: str = ""
    checksum: int = -1
    """CRC32 of every byte this rank wrote for the room, in canonical order (-1: not computed)."""
    slices: list[int] = []
    """For the checksum: rows, heads, start, count, head_bytes, then the decode buffer indices."""


class AuxData(msgspec.Struct, tag="aux", frozen=True):
    """Prefill -> decode: aux bytes sent over the control channel (TCP path)."""

    room: int
    buffer: int
    index: int
    data: bytes
    endpoint: str = ""


class RankEndpoint(msgspec.Struct, frozen=True, array_like=True):
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    endpoint: str


class RankRegister(msgspec.Struct, tag="rank_register", frozen=True):
    """Prefill rank -> bootstrap leader: here I am."""

    version: int
    rank: RankEndpoint
    tp_size: int
    pp_size: int
    cp_size: int
    dp_size: int
    layout: str
    total_kv_heads: int
    page_size: int


class TopologyQuery(msgspec.Struct, tag="topology_query", frozen=True):
    """Decode -> prefill leader: who are the prefill ranks?"""

    version: int
    endpoint: str
    nonce: int


class Topology(msgspec.Struct, tag="topology", frozen=True):
    """Prefill leader -> decode: the prefill topology (``ready`` once every rank registered)."""

    version: int
    nonce: int
    ready: bool
    reason: str = ""
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    dp_size: int = 1
    layout: str = "layer_first"
    total_kv_heads: int = 0
    page_size: int = 1
    ranks: list[RankEndpoint] = []
    redirect: str = ""


class StageRequest(msgspec.Struct, tag="stage_req", frozen=True):
    """Prefill -> decode: reserve ``nbytes`` of your staging arena for a piece of ``room``."""

    room: int
    endpoint: str
    req_id: int
    nbytes: int


class StageGrant(msgspec.Struct, tag="stage_grant", frozen=True):
    """Decode -> prefill: where to write the piece (or why not)."""

    room: int
    req_id: int
    offset: int
    granted: bool
    reason: str = ""


class Staged(msgspec.Struct, tag="staged", frozen=True):
    """Prefill -> decode: the piece landed at ``offset``; scatter it into the room's pages.

    Layout: one segment per entry of ``buffers`` (decode buffer indices), each ``n_pages`` pages x
    ``rows`` rows x ``count`` heads x ``head_bytes``, going to heads ``[start, start+count)`` of rows of
    ``heads`` heads, for the decode pages ``kv_indices[dst_start : dst_start + n_pages]``.
    With ``n_pages == nbytes == 0`` and no buffers, nothing was written: the granted space is handed back.
    """

    room: int
    endpoint: str
    req_id: int
    offset: int
    nbytes: int
    dst_start: int
    n_pages: int
    rows: int
    heads: int
    start: int
    count: int
    head_bytes: int
    buffers: list[int]
    stream: bool = False
    """A converted piece: tokens ``[dst_start, dst_start + n_pages)`` of the room, laid out (plane, token,
    head, byte) with heads ``[start, start+count)`` of ``heads``; the decode scatters it with its own
    geometry (every plane, ``buffers`` empty)."""


class StagedAck(msgspec.Struct, tag="staged_ack", frozen=True):
    room: int
    req_id: int
    ok: bool
    reason: str = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Liveness probe; answered with :class:`Pong`."""

    endpoint: str
    nonce: int
    incarnation: int = 0


class Pong(msgspec.Struct, tag="pong", frozen=True):
    endpoint: str
    nonce: int
    incarnation: int = 0


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Either direction: fail the room on the other side too."""

    room: int
    endpoint: str
    reason: str
    generation: int = 0


class Drained(msgspec.Struct, tag="drained", frozen=True):
    """Prefill -> decode, after the room failed: no engine operation of this room that writes into the
    decode's pages or staging arena is pending any more (each reached a terminal state in the engine).

    ``settle_ms``: a write of the room ended FAILED on an engine whose failed writes may still deliver bytes
    they had sent (``EngineTraits.landing_grace_s``): the decode keeps the pages this long after the message
    arrives."""

    room: int
    endpoint: str
    settle_ms: int = 0


Message = (
    Hello | HelloAck | TransferRequest | Status | AuxData | Abort | RankRegister | TopologyQuery | Topology
    | StageRequest | StageGrant | Staged | StagedAck | Ping | Pong | Drained
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode and validate one message; raises :class:`ProtocolError`."""
    try:
        msg: Message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable control message: {exc}") from None
    validate(msg)
    return msg


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(what)


def _check_room(room: int) -> None:
    _check(0 <= room < (1 << 63), f"room out of range: {room}")


def _check_buffers(buffers: list[BufferSpec], what: str) -> None:
    _check(len(buffers) <= _MAX_LIST, f"too many buffers: {what}")
    for b in buffers:
        _check(b.ptr > 0 and b.nbytes >= 0 and b.item_len > 0, f"bad buffer: {what} {b}")
        _check(b.ptr + b.nbytes < (1 << 64), f"buffer exceeds the address space: {what}")


def validate(msg: Message) -> None:
    """Value checks beyond types."""
    if isinstance(msg, Hello):
        _check(msg.version == PROTOCOL_VERSION, f"protocol version mismatch: {msg.version} != {PROTOCOL_VERSION}")
        _check_buffers(msg.kv, "kv")
        _check_buffers(msg.aux, "aux")
        for s in msg.state:
            _check_buffers(s.buffers, f"state {s.kind}")
        _check(msg.probe_addr > 0, "missing probe address")
        _check(msg.tp_size >= 1 and 0 <= msg.tp_rank < msg.tp_size, "bad tp rank")
        _check(msg.pp_size >= 1 and 0 <= msg.pp_rank < msg.pp_size, "bad pp rank")
        _check(msg.page_size >= 1, "bad page size")
    elif isinstance(msg, HelloAck):
        _check(msg.version == PROTOCOL_VERSION, f"protocol version mismatch: {msg.version} != {PROTOCOL_VERSION}")
    elif isinstance(msg, TransferRequest):
        _check_room(msg.room)
        _check(len(msg.kv_indices) % _INDEX_DTYPE.itemsize == 0, "kv_indices is not a whole int32 array")
        _check(msg.aux_index >= -1, "bad aux index")
        _check(1 <= msg.required_dst_info_num <= 4096, "bad required_dst_info_num")
        for kind, idx in msg.state_indices.items():
            _check(len(kind) <= 64 and len(idx) <= (1 << 24), "bad state indices")
            _check(all(i >= 0 for i in idx), f"negative state index: {kind}")
    elif isinstance(msg, Status):
        _check_room(msg.room)
        _check(msg.status in (0, 1, 2, 3, 4), f"bad status: {msg.status}")
        _check(len(msg.reason) <= 4096, "reason too long")
    elif isinstance(msg, AuxData):
        _check_room(msg.room)
        _check(msg.buffer >= 0 and msg.index >= 0, "bad aux buffer/index")
    elif isinstance(msg, Drained):
        _check_room(msg.room)
        _check(0 <= msg.settle_ms <= _MAX_SETTLE_MS, "bad settle time")
    elif isinstance(msg, Abort):
        _check_room(msg.room)
        _check(len(msg.reason) <= 4096, "reason too long")
    elif isinstance(msg, (StageRequest, StageGrant, StagedAck)):
        _check_room(msg.room)
        if isinstance(msg, StageRequest):
            _check(0 < msg.nbytes < (1 << 40), "bad staging size")
        if isinstance(msg, StageGrant):
            _check(msg.offset >= 0, "bad staging offset")
    elif isinstance(msg, Staged):
        _check_room(msg.room)
        if msg.n_pages == 0 and msg.nbytes == 0 and not msg.buffers:  # the granted space handed back unused
            _check(msg.offset >= 0 and msg.dst_start == 0, "bad staged piece")
            return
        _check(msg.offset >= 0 and msg.nbytes > 0 and msg.dst_start >= 0 and msg.n_pages > 0, "bad staged piece")
        _check(msg.rows > 0 and msg.heads > 0 and msg.count > 0 and msg.head_bytes > 0, "bad staged geometry")
        _check(0 <= msg.start and msg.start + msg.count <= msg.heads, "bad staged head range")
        _check((not msg.buffers if msg.stream else 0 < len(msg.buffers) <= _MAX_LIST)
               and all(b >= 0 for b in msg.buffers), "bad staged buffers")
        per_buffer = msg.n_pages * msg.rows * msg.count * msg.head_bytes  # a stream: per plane, checked on scatter
        _check(msg.nbytes % per_buffer == 0 if msg.stream else msg.nbytes == len(msg.buffers) * per_buffer,
               "staged size does not match its geometry")
    elif isinstance(msg, (RankRegister, TopologyQuery, Topology)):
        _check(msg.version == PROTOCOL_VERSION, f"protocol version mismatch: {msg.version} != {PROTOCOL_VERSION}")
        if isinstance(msg, RankRegister):
            r = msg.rank
            _check(0 <= r.tp_rank < msg.tp_size and 0 <= r.pp_rank < msg.pp_size and 0 <= r.cp_rank < msg.cp_size,
                   "rank out of range")
            _check(0 <= r.dp_rank < msg.dp_size <= 4096, "bad dp rank")
        if isinstance(msg, Topology):
            _check(len(msg.ranks) <= 65536, "too many ranks")


def pack_indices(indices: np.ndarray) -> bytes:
    """int32 little-endian page indices (the receiver checked they fit)."""
    return np.ascontiguousarray(indices, dtype=_INDEX_DTYPE).tobytes()


def unpack_indices(data: bytes) -> np.ndarray:
    arr = np.frombuffer(data, dtype=_INDEX_DTYPE).astype(np.int64)
    if arr.size and bounds(arr)[0] < 0:
        raise ProtocolError("negative page index in transfer request")
    return arr
