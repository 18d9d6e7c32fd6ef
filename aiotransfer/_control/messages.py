"""Versioned, strictly validated control messages (msgpack via msgspec).

Every message is a tagged struct; decoding checks types and lengths (every string, bytes, list and map
field has a bound, checked on its length prefix before any of it is decoded), and :func:`validate` checks
values (ranges, sizes that depend on other fields). A message that fails either is a
:class:`~aiotransfer.errors.ProtocolError`: the endpoint counts it, logs it and drops it. An error's text up
to its first colon is a fixed cause (the drop counter's key), never a value from the wire, so the counters
stay bounded whatever a peer sends.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from .._plan import bounds
from ..errors import ProtocolError

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

PROTOCOL_VERSION = 3
"""2: signed messages bind their sender and destination endpoints; 3: and both incarnations, staging answers
name their sender, and a refusal can ask the decode to register again (see :mod:`.endpoint`)."""
_INDEX_DTYPE = np.dtype("<i4")
_MAX_SETTLE_MS = 60_000
"""A drain acknowledgement may ask the decode to keep its pages at most this long (a minute)."""

# Length bounds, enforced by the decoder as it reads each length prefix: an oversized field is refused before
# any of its items is decoded, so refusing a message costs time and memory in proportion to these bounds,
# not to what the peer sent. Each is sized from the largest legitimate message.
MAX_ROOM_PAGES = 1 << 20
"""Pages one room names (1,048,576): the longest context served today (1 Mi tokens) at page size 1, 16 Mi
tokens at page size 16. A request's page indices are at most 4 MiB (int32); a page-indexed state kind names
at most as many indices."""
MAX_BUFFERS = 1 << 12
"""Buffers in one list of a registration (KV, aux, one state kind) and decode buffers of a staged piece: a
model registers one or two per layer (the deepest have about 128 layers), far below this."""
MAX_STATE_KINDS = 4
"""State kinds one rank registers, and one request names: ``mamba``, ``swa``, ``nsa`` and one custom kind."""
MAX_RANKS = 1 << 14
"""Prefill ranks behind one bootstrap leader, in a topology answer."""
MAX_REASON = 4096
"""Characters of a failure reason."""
MAX_ENDPOINT = 255
"""Characters of a control endpoint (the signed header holds at most 255 bytes of one)."""
MAX_ID = 1024
"""Characters of an engine session id (a NIXL agent name holds the host name) or a compatibility digest."""
MAX_NAME = 64
"""Characters of a name: engine, layout, dtype, device, head order, state kind, aux path."""
MAX_ENGINE_INFO = 8 << 20
"""Bytes of an engine's connection info (NIXL: its agent metadata and about 60 bytes per registered region)."""
MAX_AUX_BYTES = 4 << 20
"""Bytes of one aux slot sent over the control channel (SGLang's largest, hidden states, are about 64 KiB)."""
MAX_DIMS = 64
"""Entries of a state kind's shape."""

_Endpoint = Annotated[str, msgspec.Meta(max_length=MAX_ENDPOINT)]
_Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON)]
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
_Id = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
_Indices = Annotated[list[int], msgspec.Meta(max_length=MAX_ROOM_PAGES)]


class BufferSpec(msgspec.Struct, frozen=True, array_like=True):
    """One registered buffer as a peer sees it."""

    ptr: int
    nbytes: int
    item_len: int
    layer_id: int = -1


class StateSpec(msgspec.Struct, frozen=True, array_like=True):
    """The buffers of one state type (mamba, swa, nsa...)."""

    kind: _Name
    buffers: Annotated[list[BufferSpec], msgspec.Meta(max_length=MAX_BUFFERS)]
    dims: Annotated[list[int], msgspec.Meta(max_length=MAX_DIMS)] = []


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Decode -> prefill, once per peer: who we are and where our memory is."""

    version: int
    endpoint: _Endpoint
    generation: int
    engine: _Name
    session_id: _Id
    engine_info: Annotated[bytes, msgspec.Meta(max_length=MAX_ENGINE_INFO)]
    probe_addr: int
    compat: _Id
    kv: Annotated[list[BufferSpec], msgspec.Meta(max_length=MAX_BUFFERS)]
    aux: Annotated[list[BufferSpec], msgspec.Meta(max_length=MAX_BUFFERS)] = []
    state: Annotated[list[StateSpec], msgspec.Meta(max_length=MAX_STATE_KINDS)] = []
    layout: _Name = "layer_first"
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
    dtype: _Name = ""
    """The KV cache dtype (empty from peers that do not declare it)."""
    kv_device: _Name = "cpu"
    """Where the KV buffers live (``cpu``, ``cuda:0``...)."""
    head_order: _Name = "NHD"
    """Inside a page: token-major (``NHD``) or head-major (``HND``)."""
    num_layers: int = 0
    incarnation: int = 0
    """The registering manager's incarnation id (what its ``Pong`` reports; 0: not said)."""


class HelloAck(msgspec.Struct, tag="hello_ack", frozen=True):
    """Prefill -> decode: accepted (and the engine can reach the decode) or refused with a reason."""

    version: int
    endpoint: _Endpoint
    generation: int
    accepted: bool
    reason: _Reason = ""
    engine: _Name = ""
    session_id: _Id = ""
    rank: int = 0
    incarnation: int = 0
    """The answering manager's incarnation id (what its ``Pong`` reports; 0: not said)."""


class TransferRequest(msgspec.Struct, tag="req", frozen=True):
    """Decode -> prefill, per room and target prefill rank: where the pages go."""

    room: int
    endpoint: _Endpoint
    generation: int
    kv_indices: Annotated[bytes, msgspec.Meta(max_length=MAX_ROOM_PAGES * 4)]
    aux_index: int = -1
    state_indices: Annotated[dict[_Name, _Indices], msgspec.Meta(max_length=MAX_STATE_KINDS)] = {}
    required_dst_info_num: int = 1
    is_dummy: bool = False
    num_tokens: int = -1
    """Tokens the room holds (-1: every declared page full); the prefill maps them onto its own pages."""


class Status(msgspec.Struct, tag="status", frozen=True):
    """Prefill -> decode: a room's terminal status (Success=4 / Failed=0) with a reason."""

    room: int
    status: int
    rank: int
    endpoint: _Endpoint
    reason: _Reason = ""
    aux_path: _Name = ""
    checksum: int = -1
    """CRC32 of every byte this rank wrote for the room, in canonical order (-1: not computed)."""
    slices: Annotated[list[int], msgspec.Meta(max_length=6 * MAX_BUFFERS)] = []
    """For the checksum, per paired buffer: rows, heads, start, count, head_bytes and the decode buffer index."""
    register_again: bool = False
    """A refused request only (``Failed``): this prefill process does not know the decode registration the
    request names (it restarted, or forgot the decode). Nothing of the room was taken here: the decode
    registers again and resends the request with ``generation`` = the one it was sent with."""
    generation: int = 0
    """With ``register_again``: the registration generation of the refused request."""


class AuxData(msgspec.Struct, tag="aux", frozen=True):
    """Prefill -> decode: aux bytes sent over the control channel (TCP path)."""

    room: int
    buffer: int
    index: int
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_AUX_BYTES)]
    endpoint: _Endpoint = ""


class RankEndpoint(msgspec.Struct, frozen=True, array_like=True):
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    endpoint: _Endpoint


class RankRegister(msgspec.Struct, tag="rank_register", frozen=True):
    """Prefill rank -> bootstrap leader: here I am."""

    version: int
    rank: RankEndpoint
    tp_size: int
    pp_size: int
    cp_size: int
    dp_size: int
    layout: _Name
    total_kv_heads: int
    page_size: int


class TopologyQuery(msgspec.Struct, tag="topology_query", frozen=True):
    """Decode -> prefill leader: who are the prefill ranks?"""

    version: int
    endpoint: _Endpoint
    nonce: int


class Topology(msgspec.Struct, tag="topology", frozen=True):
    """Prefill leader -> decode: the prefill topology (``ready`` once every rank registered)."""

    version: int
    nonce: int
    ready: bool
    reason: _Reason = ""
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    dp_size: int = 1
    layout: _Name = "layer_first"
    total_kv_heads: int = 0
    page_size: int = 1
    ranks: Annotated[list[RankEndpoint], msgspec.Meta(max_length=MAX_RANKS)] = []
    redirect: _Endpoint = ""


class StageRequest(msgspec.Struct, tag="stage_req", frozen=True):
    """Prefill -> decode: reserve ``nbytes`` of your staging arena for a piece of ``room``."""

    room: int
    endpoint: _Endpoint
    req_id: int
    nbytes: int


class StageGrant(msgspec.Struct, tag="stage_grant", frozen=True):
    """Decode -> prefill: where to write the piece (or why not); ``offset`` into the staging arena the decode
    declared in its ``Hello``."""

    room: int
    endpoint: _Endpoint
    req_id: int
    offset: int
    granted: bool
    reason: _Reason = ""


class Staged(msgspec.Struct, tag="staged", frozen=True):
    """Prefill -> decode: the piece landed at ``offset``; scatter it into the room's pages.

    Layout: one segment per entry of ``buffers`` (decode buffer indices), each ``n_pages`` pages x
    ``rows`` rows x ``count`` heads x ``head_bytes``, going to heads ``[start, start+count)`` of rows of
    ``heads`` heads, for the decode pages ``kv_indices[dst_start : dst_start + n_pages]``.
    With ``n_pages == nbytes == 0`` and no buffers, nothing was written: the granted space is handed back.
    """

    room: int
    endpoint: _Endpoint
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
    buffers: Annotated[list[int], msgspec.Meta(max_length=MAX_BUFFERS)]
    stream: bool = False
    """A converted piece: tokens ``[dst_start, dst_start + n_pages)`` of the room, laid out (plane, token,
    head, byte) with heads ``[start, start+count)`` of ``heads``; the decode scatters it with its own
    geometry (every plane, ``buffers`` empty)."""


class StagedAck(msgspec.Struct, tag="staged_ack", frozen=True):
    """Decode -> prefill: a staged piece was scattered into the room's pages (or why not)."""

    room: int
    endpoint: _Endpoint
    req_id: int
    ok: bool
    reason: _Reason = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Liveness probe; answered with :class:`Pong`."""

    endpoint: _Endpoint
    nonce: int
    incarnation: int = 0


class Pong(msgspec.Struct, tag="pong", frozen=True):
    endpoint: _Endpoint
    nonce: int
    incarnation: int = 0


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Either direction: fail the room on the other side too."""

    room: int
    endpoint: _Endpoint
    reason: _Reason
    generation: int = 0


class Drained(msgspec.Struct, tag="drained", frozen=True):
    """Prefill -> decode, after the room failed: no engine operation of this room that writes into the
    decode's pages or staging arena is pending any more (each reached a terminal state in the engine).

    ``settle_ms``: a write of the room ended FAILED on an engine whose failed writes may still deliver bytes
    they had sent (``EngineTraits.landing_grace_s``): the decode keeps the pages this long after the message
    arrives."""

    room: int
    endpoint: _Endpoint
    settle_ms: int = 0


Message = (
    Hello | HelloAck | TransferRequest | Status | AuxData | Abort | RankRegister | TopologyQuery | Topology
    | StageRequest | StageGrant | Staged | StagedAck | Ping | Pong | Drained
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """``msg`` as msgpack; a reason over :data:`MAX_REASON` characters is cut to it (a peer would refuse it)."""
    reason = getattr(msg, "reason", "")
    if len(reason) > MAX_REASON:
        msg = msgspec.structs.replace(msg, reason=reason[:MAX_REASON])
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
            _check(min(idx, default=0) >= 0, f"negative state index: {kind}")
    elif isinstance(msg, Status):
        _check_room(msg.room)
        _check(msg.status in (0, 1, 2, 3, 4), f"bad status: {msg.status}")
    elif isinstance(msg, AuxData):
        _check_room(msg.room)
        _check(msg.buffer >= 0 and msg.index >= 0, "bad aux buffer/index")
    elif isinstance(msg, Drained):
        _check_room(msg.room)
        _check(0 <= msg.settle_ms <= _MAX_SETTLE_MS, "bad settle time")
    elif isinstance(msg, Abort):
        _check_room(msg.room)
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
        _check((not msg.buffers if msg.stream else len(msg.buffers) > 0)
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


def pack_indices(indices: np.ndarray) -> bytes:
    """int32 little-endian page indices (the receiver checked they fit)."""
    return np.ascontiguousarray(indices, dtype=_INDEX_DTYPE).tobytes()


def unpack_indices(data: bytes) -> np.ndarray:
    arr = np.frombuffer(data, dtype=_INDEX_DTYPE).astype(np.int64)
    if arr.size and bounds(arr)[0] < 0:
        raise ProtocolError("negative page index in transfer request")
    return arr
