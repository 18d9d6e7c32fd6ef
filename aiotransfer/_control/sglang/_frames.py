"""SGLang's multipart frames <-> aiotransfer's internal messages: the codec (pure: no sockets, no HTTP).

Encoders build frames to the contract in ``docs/sglang-wire.md`` (SGLang's receive loops die on frames
they cannot parse). Decoders parse leniently by length and validate; anything malformed raises
:class:`~aiotransfer.errors.ProtocolError`. What the frames leave implicit (our own rank, page size,
layout...) comes from :class:`SglangIdentity`; what depends on earlier traffic (which decode registered,
which rank a room went to) from the callables the plane passes in.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...errors import ProtocolError
from ..messages import PROTOCOL_VERSION, Abort, AuxData, BufferSpec, Hello, Status, TransferRequest

__all__ = [
    "REMOTE_EXTENT",
    "SGLANG_VERSION",
    "RegisterFrames",
    "SglangIdentity",
    "abort_ack_frames",
    "abort_frames",
    "ascii_int",
    "aux_frames",
    "decode_abort",
    "decode_aux",
    "decode_metadata",
    "decode_register",
    "decode_status",
    "hello_from_register",
    "metadata_frames",
    "pack_int_lists",
    "register_frames",
    "status_frames",
    "unpack_int_lists",
]

SGLANG_VERSION = "0.5.23"
"""The SGLang release this profile was checked against (frames are stable across 0.5.x)."""
REMOTE_EXTENT = 1 << 40
"""SGLang registrations carry no buffer sizes: a remote buffer is taken to span this many bytes (the
engine itself refuses writes outside the decode's registered memory)."""


@dataclass(frozen=True)
class SglangIdentity:
    """What the profile must know about its own manager (SGLang frames leave these implicit)."""

    host: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int
    dp_rank: int
    dp_size: int
    page_size: int
    kv_cache_dtype: str
    is_mla: bool
    kv_heads: int
    total_kv_heads: int
    aux_item_lens: tuple[int, ...]
    compat: str
    layout: str
    engine: str = "mooncake"
    bootstrap_port: int = 0
    """Leader only: serve SGLang's bootstrap HTTP API on this port (0: not the leader)."""

    @property
    def unique_rank(self) -> int:
        return self.tp_rank * (self.pp_size * self.cp_size) + self.pp_rank * self.cp_size + self.cp_rank


# -- primitives -------------------------------------------------------------------------------------


def pack_int_lists(lists: list[list[int]], fmt: str) -> bytes:
    """SGLang's list-of-int-lists framing: u32 count, u32 byte lengths, packed arrays (all little-endian)."""
    if not lists:
        return b""
    parts = [struct.pack(f"<{len(x)}{fmt}", *x) for x in lists]
    return struct.pack(f"<I{len(parts)}I", len(parts), *(len(p) for p in parts)) + b"".join(parts)


def unpack_int_lists(data: bytes, fmt: str) -> list[list[int]]:
    if not data:
        return []
    (n,) = struct.unpack_from("<I", data, 0)
    if n > 1 << 16 or len(data) < 4 + 4 * n:
        raise ProtocolError("bad int-list framing")
    lens = struct.unpack_from(f"<{n}I", data, 4)
    size = struct.calcsize(fmt)
    out, off = [], 4 + 4 * n
    for nbytes in lens:
        if nbytes % size or off + nbytes > len(data):
            raise ProtocolError("bad int-list framing")
        out.append(list(struct.unpack_from(f"<{nbytes // size}{fmt}", data, off)))
        off += nbytes
    return out


def ascii_int(frame: bytes, what: str) -> int:
    try:
        return int(frame.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"{what} is not an ASCII integer") from None


def _u64s(frame: bytes, what: str) -> list[int]:
    if len(frame) % 8:
        raise ProtocolError(f"{what} is not a whole u64 array")
    return [int(x) for x in np.frombuffer(frame, dtype="<u8")]


# -- encoders ---------------------------------------------------------------------------------------


def register_frames(h: Hello, me: SglangIdentity, port: str) -> list[bytes]:
    """Decode -> prefill registration (a ``None`` frame plus 19)."""
    kv = np.array([b.ptr for b in h.kv], dtype="<u8").tobytes()
    aux = np.array([b.ptr for b in h.aux], dtype="<u8").tobytes()
    lens = np.array([b.item_len for b in h.kv], dtype="<u8").tobytes()
    return [
        b"None", me.host.encode(), port.encode(), h.session_id.encode(), kv, aux, b"",
        str(h.tp_rank).encode(), str(h.tp_size).encode(), str(h.kv[0].item_len if h.kv else 0).encode(),
        b"", b"", b"", b"", b"", b"", b"1", b"0", b"", lens,
    ]


def metadata_frames(r: TransferRequest, me: SglangIdentity, port: str, session: str) -> list[bytes]:
    """Decode -> prefill transfer metadata (10 frames; a dummy has empty pages and aux slot)."""
    if r.state_indices:
        raise ProtocolError("the SGLang profile does not carry state (Mamba/SWA/NSA) indices")
    aux = b"" if r.is_dummy else str(max(r.aux_index, 0)).encode()
    return [
        str(r.room).encode(), me.host.encode(), port.encode(), session.encode(),
        b"" if r.is_dummy else r.kv_indices, aux, b"", str(r.required_dst_info_num).encode(), b"0", b"",
    ]


def status_frames(msg: Status, me: SglangIdentity) -> list[bytes]:
    return [str(msg.room).encode(), str(msg.status).encode(), str(me.unique_rank).encode()]


def aux_frames(msg: AuxData) -> list[bytes]:
    return [b"AUX_DATA", str(msg.room).encode(), str(msg.buffer).encode(), str(msg.index).encode(),
            struct.pack(">I", len(msg.data)), msg.data]


def abort_frames(room: int, me: SglangIdentity, port: str) -> list[bytes]:
    return [b"ABORT", str(room).encode(), me.host.encode(), port.encode()]


def abort_ack_frames(room: int, me: SglangIdentity, token: bytes) -> list[bytes]:
    return [b"ABORT_ACK", str(room).encode(), str(me.unique_rank).encode(), token]


# -- decoders ---------------------------------------------------------------------------------------


def decode_aux(f: list[bytes], endpoint_of: Callable[[int], str]) -> AuxData:
    """``AUX_DATA`` frames; ``endpoint_of(room)`` names the prefill rank they came from."""
    if len(f) < 6 or len(f[4]) != 4:
        raise ProtocolError("malformed AUX_DATA")
    (n,) = struct.unpack(">I", f[4])
    if n != len(f[5]):
        raise ProtocolError("AUX_DATA length mismatch")
    room = ascii_int(f[1], "room")
    return AuxData(room=room, buffer=ascii_int(f[2], "aux buffer"), index=ascii_int(f[3], "aux slot"), data=f[5],
                   endpoint=endpoint_of(room))


def decode_status(f: list[bytes], endpoint_of: Callable[[int, int], str]) -> Status:
    """``[room, status, prefill_unique_rank]``; ``endpoint_of(room, rank)`` names the sender."""
    room, status, rank = (ascii_int(x, "status field") for x in f)
    if status not in (0, 4):
        raise ProtocolError(f"unexpected status {status}")
    return Status(room=room, status=status, rank=rank, endpoint=endpoint_of(room, rank),
                  reason="" if status == 4 else "the SGLang prefill reported failure (no reason on the wire)")


@dataclass(frozen=True)
class RegisterFrames:
    """A decode rank's registration, validated."""

    endpoint: str
    session: str
    kv_ptrs: list[int]
    aux_ptrs: list[int]
    lens: list[int]
    layer_ids: list[int]
    tp_rank: int
    tp_size: int


def decode_register(f: list[bytes]) -> RegisterFrames:
    if len(f) < 10:
        raise ProtocolError(f"register message has {len(f)} frames, needs at least 10")
    ip = f[1].decode("ascii", "replace")
    port = ascii_int(f[2], "rank port")
    session = f[3].decode("ascii", "replace")
    if ":" not in session:
        raise ProtocolError("session id is not host:port")
    kv_ptrs = _u64s(f[4], "KV addresses")
    aux_ptrs = _u64s(f[5], "aux addresses")
    if f[6] and any(unpack_int_lists(f[6], "Q")):
        raise ProtocolError("state buffers are not supported by the SGLang profile")
    tp_rank, tp_size, first_len = ascii_int(f[7], "tp rank"), ascii_int(f[8], "tp size"), ascii_int(f[9], "item length")
    lens = _u64s(f[19], "KV item lengths") if len(f) > 19 and f[19] else [first_len] * len(kv_ptrs)
    layer_ids = list(np.frombuffer(f[12], dtype="<u4")) if len(f) > 12 and f[12] and len(f[12]) % 4 == 0 else []
    if len(lens) != len(kv_ptrs) or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ProtocolError("inconsistent register message")
    return RegisterFrames(f"tcp://{ip}:{port}", session, kv_ptrs, aux_ptrs, lens, layer_ids, tp_rank, tp_size)


def hello_from_register(reg: RegisterFrames, me: SglangIdentity, generation: int) -> Hello:
    """The internal ``Hello`` a registration stands for (sizes and layout from our own identity)."""
    tp_size = reg.tp_size
    heads = (me.total_kv_heads // tp_size if tp_size <= me.total_kv_heads else 1) if me.total_kv_heads else 0
    kv = [BufferSpec(p, n * (REMOTE_EXTENT // max(n, 1)), n,
                     int(reg.layer_ids[i]) if i < len(reg.layer_ids) else -1)
          for i, (p, n) in enumerate(zip(reg.kv_ptrs, reg.lens, strict=True))]
    aux = [BufferSpec(p, n * (REMOTE_EXTENT // max(n, 1)), n)
           for p, n in zip(reg.aux_ptrs, me.aux_item_lens, strict=False)]
    return Hello(
        version=PROTOCOL_VERSION, endpoint=reg.endpoint, generation=generation, engine=me.engine,
        session_id=reg.session, engine_info=b"", probe_addr=0, compat=me.compat, kv=kv, aux=aux, layout=me.layout,
        tp_size=tp_size, tp_rank=reg.tp_rank, kv_heads=heads, total_kv_heads=me.total_kv_heads,
        page_size=me.page_size,
    )


def decode_metadata(f: list[bytes], generation_of: Callable[[str, str], int]) -> TransferRequest:
    """Transfer metadata; ``generation_of(session, endpoint)`` raises ProtocolError for an unknown decode."""
    room = ascii_int(f[0], "room")
    endpoint = f"tcp://{f[1].decode('ascii', 'replace')}:{ascii_int(f[2], 'rank port')}"
    session = f[3].decode("ascii", "replace")
    generation = generation_of(session, endpoint)
    if len(f[4]) % 4:
        raise ProtocolError("page indices are not a whole int32 array")
    dummy = not f[4] and not f[5]
    if f[6] and any(unpack_int_lists(f[6], "i")):
        raise ProtocolError("state indices are not supported by the SGLang profile")
    return TransferRequest(
        room=room, endpoint=endpoint, generation=generation, kv_indices=bytes(f[4]),
        aux_index=-1 if dummy or not f[5] else ascii_int(f[5], "aux slot"), state_indices={},
        required_dst_info_num=ascii_int(f[7], "required_dst_info_num"), is_dummy=dummy,
    )


def decode_abort(f: list[bytes], me: SglangIdentity) -> tuple[Abort, list[bytes] | None]:
    """An ``ABORT`` and, when the decode asked for one, the ``ABORT_ACK`` frames to send back."""
    room = ascii_int(f[1], "room") if len(f) > 1 else -1
    if room < 0:
        raise ProtocolError("ABORT without a room")
    endpoint = f"tcp://{f[2].decode('ascii', 'replace')}:{ascii_int(f[3], 'port')}" if len(f) > 3 else ""
    ack = abort_ack_frames(room, me, bytes(f[4])) if len(f) > 4 and endpoint else None
    return Abort(room=room, endpoint=endpoint, reason="aborted by the SGLang decode"), ack
