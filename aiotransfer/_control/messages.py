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
    "staged_shape",
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
_Indices = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]], msgspec.Meta(max_length=MAX_ROOM_PAGES)]
"""Page or slot indices of a state kind (int32, like a request's page indices)."""

# Value bounds of every integer a peer sends, checked by the decoder like the lengths: each alias says what
# such a field means, and its range. Checks that depend on other fields (a rank below its size, a piece's
# shape against its size) are :func:`validate`'s.
_U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
"""An opaque non-negative number: a room, a registration generation, an incarnation, a nonce, a request id."""
_Size = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]
"""Bytes, or an offset in bytes."""
_Addr = Annotated[int, msgspec.Meta(ge=0)]
"""An address in the sender's process (the decoder holds it to 64 bits)."""
_Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
"""A count or index of geometry: pages, rows, heads, bytes of a head, layers, a buffer index, a dimension."""
_Unit = Annotated[int, msgspec.Meta(ge=1, le=1 << 31)]
"""A count of at least one: tokens per page, buffers per layer."""
_Ranks = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
"""A parallel group's size (TP, PP, CP, DP)."""
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
"""A rank in a parallel group (below its size: checked by :func:`validate`)."""
_Slot = Annotated[int, msgspec.Meta(ge=-1, le=1 << 31)]
"""An index, or -1 for none."""
_Version = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
"""A protocol version."""


class BufferSpec(msgspec.Struct, frozen=True, array_like=True):
    """One registered buffer as a peer sees it."""

    ptr: _Addr
    nbytes: _Size
    item_len: _Size
    layer_id: _Slot = -1


class StateSpec(msgspec.Struct, frozen=True, array_like=True):
    """The buffers of one state type (mamba, swa, nsa...)."""

    kind: _Name
    buffers: Annotated[list[BufferSpec], msgspec.Meta(max_length=MAX_BUFFERS)]
    dims: Annotated[list[_Dim], msgspec.Meta(max_length=MAX_DIMS)] = []


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Decode -> prefill, once per peer: who we are and where our memory is."""

    version: _Version
    endpoint: _Endpoint
    generation: _U63
    engine: _Name
    session_id: _Id
    engine_info: Annotated[bytes, msgspec.Meta(max_length=MAX_ENGINE_INFO)]
    probe_addr: _Addr
    compat: _Id
    kv: Annotated[list[BufferSpec], msgspec.Meta(max_length=MAX_BUFFERS)]
    aux: Annotated[list[BufferSpec], msgspec.Meta(max_length=MAX_BUFFERS)] = []
    state: Annotated[list[StateSpec], msgspec.Meta(max_length=MAX_STATE_KINDS)] = []
    layout: _Name = "layer_first"
    tp_size: _Ranks = 1
    tp_rank: _Rank = 0
    pp_size: _Ranks = 1
    pp_rank: _Rank = 0
    kv_heads: _Dim = 0
    total_kv_heads: _Dim = 0
    page_size: _Unit = 1
    cp_size: _Ranks = 1
    cp_rank: _Rank = 0
    outer: _Unit = 1
    staging: BufferSpec | None = None
    dtype: _Name = ""
    """The KV cache dtype (empty from peers that do not declare it)."""
    kv_device: _Name = "cpu"
    """Where the KV buffers live (``cpu``, ``cuda:0``...)."""
    head_order: _Name = "NHD"
    """Inside a page: token-major (``NHD``) or head-major (``HND``)."""
    num_layers: _Dim = 0
    incarnation: _U63 = 0
    """The registering manager's incarnation id (what its ``Pong`` reports; 0: not said)."""


class HelloAck(msgspec.Struct, tag="hello_ack", frozen=True):
    """Prefill -> decode: accepted (and the engine can reach the decode) or refused with a reason."""

    version: _Version
    endpoint: _Endpoint
    generation: _U63
    accepted: bool
    reason: _Reason = ""
    engine: _Name = ""
    session_id: _Id = ""
    rank: _Rank = 0
    incarnation: _U63 = 0
    """The answering manager's incarnation id (what its ``Pong`` reports; 0: not said)."""


class TransferRequest(msgspec.Struct, tag="req", frozen=True):
    """Decode -> prefill, per room and target prefill rank: where the pages go."""

    room: _U63
    endpoint: _Endpoint
    generation: _U63
    kv_indices: Annotated[bytes, msgspec.Meta(max_length=MAX_ROOM_PAGES * 4)]
    aux_index: _Slot = -1
    state_indices: Annotated[dict[_Name, _Indices], msgspec.Meta(max_length=MAX_STATE_KINDS)] = {}
    required_dst_info_num: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    is_dummy: bool = False
    num_tokens: Annotated[int, msgspec.Meta(ge=-1, lt=1 << 62)] = -1
    """Tokens the room holds (-1: every declared page full); the prefill maps them onto its own pages."""


class Status(msgspec.Struct, tag="status", frozen=True):
    """Prefill -> decode: a room's terminal status (Success=4 / Failed=0) with a reason."""

    room: _U63
    status: Annotated[int, msgspec.Meta(ge=0, le=4)]
    rank: _Rank
    endpoint: _Endpoint
    reason: _Reason = ""
    aux_path: _Name = ""
    checksum: Annotated[int, msgspec.Meta(ge=-1, lt=1 << 32)] = -1
    """CRC32 of every byte this rank wrote for the room, in canonical order (-1: not computed)."""
    slices: Annotated[list[int], msgspec.Meta(max_length=6 * MAX_BUFFERS)] = []
    """For the checksum, per paired buffer: rows, heads, start, count, head_bytes and the decode buffer index.
    Checked where they are read, not by the decoder: a Success whose geometry does not fit our buffers fails
    its room on both sides at once, where a dropped message would leave it open until ``done_timeout``."""
    register_again: bool = False
    """A refused request only (``Failed``): this prefill process does not know the decode registration the
    request names (it restarted, or forgot the decode). Nothing of the room was taken here: the decode
    registers again and resends the request with ``generation`` = the one it was sent with."""
    generation: _U63 = 0
    """With ``register_again``: the registration generation of the refused request."""


class AuxData(msgspec.Struct, tag="aux", frozen=True):
    """Prefill -> decode: aux bytes sent over the control channel (TCP path)."""

    room: _U63
    buffer: _Dim
    index: _Dim
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_AUX_BYTES)]
    endpoint: _Endpoint = ""


class RankEndpoint(msgspec.Struct, frozen=True, array_like=True):
    dp_rank: _Rank
    tp_rank: _Rank
    pp_rank: _Rank
    cp_rank: _Rank
    endpoint: _Endpoint


class RankRegister(msgspec.Struct, tag="rank_register", frozen=True):
    """Prefill rank -> bootstrap leader: here I am."""

    version: _Version
    rank: RankEndpoint
    tp_size: _Ranks
    pp_size: _Ranks
    cp_size: _Ranks
    dp_size: _Ranks
    layout: _Name
    total_kv_heads: _Dim
    page_size: _Unit


class TopologyQuery(msgspec.Struct, tag="topology_query", frozen=True):
    """Decode -> prefill leader: who are the prefill ranks?"""

    version: _Version
    endpoint: _Endpoint
    nonce: _U63


class Topology(msgspec.Struct, tag="topology", frozen=True):
    """Prefill leader -> decode: the prefill topology (``ready`` once every rank registered)."""

    version: _Version
    nonce: _U63
    ready: bool
    reason: _Reason = ""
    tp_size: _Ranks = 1
    pp_size: _Ranks = 1
    cp_size: _Ranks = 1
    dp_size: _Ranks = 1
    layout: _Name = "layer_first"
    total_kv_heads: _Dim = 0
    page_size: _Unit = 1
    ranks: Annotated[list[RankEndpoint], msgspec.Meta(max_length=MAX_RANKS)] = []
    redirect: _Endpoint = ""


class StageRequest(msgspec.Struct, tag="stage_req", frozen=True):
    """Prefill -> decode: reserve ``nbytes`` of your staging arena for a piece of ``room``."""

    room: _U63
    endpoint: _Endpoint
    req_id: _U63
    nbytes: Annotated[int, msgspec.Meta(ge=1, lt=1 << 40)]


class StageGrant(msgspec.Struct, tag="stage_grant", frozen=True):
    """Decode -> prefill: where to write the piece (or why not); ``offset`` into the staging arena the decode
    declared in its ``Hello``."""

    room: _U63
    endpoint: _Endpoint
    req_id: _U63
    offset: _Size
    granted: bool
    reason: _Reason = ""


class Staged(msgspec.Struct, tag="staged", frozen=True):
    """Prefill -> decode: the piece landed at ``offset``; scatter it into the room's pages.

    Layout: one segment per entry of ``buffers`` (decode buffer indices), each ``n_pages`` pages x
    ``rows`` rows x ``count`` heads x ``head_bytes``, going to heads ``[start, start+count)`` of rows of
    ``heads`` heads, for the decode pages ``kv_indices[dst_start : dst_start + n_pages]``.
    With ``n_pages == nbytes == 0`` and no buffers, nothing was written: the granted space is handed back.
    """

    room: _U63
    endpoint: _Endpoint
    req_id: _U63
    offset: _Size
    nbytes: _Size
    dst_start: _Dim
    n_pages: _Dim
    rows: _Dim
    heads: _Dim
    start: _Dim
    count: _Dim
    head_bytes: _Dim
    buffers: Annotated[list[_Dim], msgspec.Meta(max_length=MAX_BUFFERS)]
    stream: bool = False
    """A converted piece: tokens ``[dst_start, dst_start + n_pages)`` of the room, laid out (plane, token,
    head, byte) with heads ``[start, start+count)`` of ``heads``; the decode scatters it with its own
    geometry (every plane, ``buffers`` empty)."""


class StagedAck(msgspec.Struct, tag="staged_ack", frozen=True):
    """Decode -> prefill: a staged piece was scattered into the room's pages (or why not)."""

    room: _U63
    endpoint: _Endpoint
    req_id: _U63
    ok: bool
    reason: _Reason = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Liveness probe; answered with :class:`Pong`."""

    endpoint: _Endpoint
    nonce: _U63
    incarnation: _U63 = 0


class Pong(msgspec.Struct, tag="pong", frozen=True):
    endpoint: _Endpoint
    nonce: _U63
    incarnation: _U63 = 0


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Either direction: fail the room on the other side too."""

    room: _U63
    endpoint: _Endpoint
    reason: _Reason
    generation: _U63 = 0


class Drained(msgspec.Struct, tag="drained", frozen=True):
    """Prefill -> decode, after the room failed: no engine operation of this room that writes into the
    decode's pages or staging arena is pending any more (each reached a terminal state in the engine).

    ``settle_ms``: a write of the room ended FAILED on an engine whose failed writes may still deliver bytes
    they had sent (``EngineTraits.landing_grace_s``): the decode keeps the pages this long after the message
    arrives."""

    room: _U63
    endpoint: _Endpoint
    settle_ms: Annotated[int, msgspec.Meta(ge=0, le=_MAX_SETTLE_MS)] = 0


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
        _check(msg.offset >= 0, "bad staged piece")
        shape = staged_shape(msg)
        if isinstance(shape, str):
            raise ProtocolError(shape)
    elif isinstance(msg, (RankRegister, TopologyQuery, Topology)):
        _check(msg.version == PROTOCOL_VERSION, f"protocol version mismatch: {msg.version} != {PROTOCOL_VERSION}")
        if isinstance(msg, RankRegister):
            r = msg.rank
            _check(0 <= r.tp_rank < msg.tp_size and 0 <= r.pp_rank < msg.pp_size and 0 <= r.cp_rank < msg.cp_size,
                   "rank out of range")
            _check(0 <= r.dp_rank < msg.dp_size <= 4096, "bad dp rank")


def staged_shape(msg: Staged) -> int | str:
    """The bytes a staged piece's shape covers (a converted piece: per plane), or why the shape is malformed.

    A piece is read from the arena by its shape, so the shape, not the size it declares, says what is read:
    the two must agree (a converted piece's planes are the receiver's, so its size is a whole number of them,
    checked against its tokens where it is scattered). The grantor checks this again where it reads, against
    the space it granted."""
    if msg.nbytes <= 0 or msg.dst_start < 0 or msg.n_pages <= 0:
        return "bad staged piece"
    if msg.rows <= 0 or msg.heads <= 0 or msg.count <= 0 or msg.head_bytes <= 0:
        return "bad staged geometry"
    if not (0 <= msg.start and msg.start + msg.count <= msg.heads):
        return "bad staged head range"
    if (msg.buffers if msg.stream else not msg.buffers) or min(msg.buffers, default=0) < 0:
        return "bad staged buffers"
    per_buffer = msg.n_pages * msg.rows * msg.count * msg.head_bytes
    if msg.stream:
        return per_buffer if msg.nbytes % per_buffer == 0 else "staged size does not match its geometry"
    covered = len(msg.buffers) * per_buffer
    return covered if covered == msg.nbytes else "staged size does not match its geometry"


def pack_indices(indices: np.ndarray) -> bytes:
    """int32 little-endian page indices (the receiver checked they fit)."""
    return np.ascontiguousarray(indices, dtype=_INDEX_DTYPE).tobytes()


def unpack_indices(data: bytes) -> np.ndarray:
    arr = np.frombuffer(data, dtype=_INDEX_DTYPE).astype(np.int64)
    if arr.size and bounds(arr)[0] < 0:
        raise ProtocolError("negative page index in transfer request")
    return arr
