"""The SGLang profile's frame codec (``aiotransfer._control.sglang._frames``), without sockets: what we
encode decodes back to the same internal message, and malformed frames are refused. The codec against
real SGLang processes is covered by ``tests/interop``."""

from __future__ import annotations

import numpy as np
import pytest

from aiotransfer._control.messages import AuxData, BufferSpec, Hello, Status, TransferRequest
from aiotransfer._control.sglang import SglangControlPlane, SglangIdentity, pack_int_lists, unpack_int_lists
from aiotransfer._control.sglang import _frames as fr
from aiotransfer._control.sglang._bootstrap import BootstrapServer, registration_body, topology_problem
from aiotransfer.errors import ProtocolError

ME = SglangIdentity(
    host="127.0.0.1", tp_size=2, tp_rank=1, pp_size=1, pp_rank=0, cp_size=1, cp_rank=0, dp_rank=0, dp_size=1,
    page_size=16, kv_cache_dtype="bf16", is_mla=False, kv_heads=4, total_kv_heads=8, aux_item_lens=(64, 32),
    compat="c", layout="layer_first",
)


def test_public_names() -> None:
    assert SglangControlPlane.__module__ == "aiotransfer._control.sglang._plane"
    assert ME.unique_rank == 1


def test_int_lists_roundtrip_and_refuse_bad_framing() -> None:
    lists = [[1, 2, 3], [], [7]]
    assert unpack_int_lists(pack_int_lists(lists, "i"), "i") == lists
    assert pack_int_lists([], "Q") == b"" and unpack_int_lists(b"", "Q") == []
    with pytest.raises(ProtocolError):
        unpack_int_lists(pack_int_lists(lists, "i")[:-2], "i")


def test_register_roundtrip() -> None:
    hello = Hello(version=1, endpoint="", generation=0, engine="mooncake", session_id="127.0.0.1:15000",
                  engine_info=b"", probe_addr=0, compat="c",
                  kv=[BufferSpec(0x1000, 4096, 512), BufferSpec(0x9000, 4096, 512)],
                  aux=[BufferSpec(0x20000, 640, 64), BufferSpec(0x30000, 320, 32)], tp_size=2, tp_rank=1)
    frames = fr.register_frames(hello, ME, "40000")
    assert frames[0] == b"None" and len(frames) == 20
    reg = fr.decode_register(frames)
    assert (reg.endpoint, reg.session, reg.kv_ptrs, reg.aux_ptrs, reg.lens) == (
        "tcp://127.0.0.1:40000", "127.0.0.1:15000", [0x1000, 0x9000], [0x20000, 0x30000], [512, 512]
    )
    back = fr.hello_from_register(reg, ME, generation=7)
    assert [b.ptr for b in back.kv] == [0x1000, 0x9000] and [b.item_len for b in back.aux] == [64, 32]
    assert (back.generation, back.tp_rank, back.tp_size, back.kv_heads, back.page_size) == (7, 1, 2, 4, 16)
    with pytest.raises(ProtocolError, match="at least 10"):
        fr.decode_register(frames[:9])
    bad = list(frames)
    bad[3] = b"no-port"
    with pytest.raises(ProtocolError, match="host:port"):
        fr.decode_register(bad)


def test_metadata_roundtrip_and_unknown_sessions() -> None:
    pages = np.array([3, 9, 4], dtype="<i4").tobytes()
    req = TransferRequest(room=42, endpoint="", generation=0, kv_indices=pages, aux_index=5, required_dst_info_num=2)
    frames = fr.metadata_frames(req, ME, "40000", "127.0.0.1:15000")
    assert len(frames) == 10

    def known(session: str, endpoint: str) -> int:
        if (session, endpoint) != ("127.0.0.1:15000", "tcp://127.0.0.1:40000"):
            raise ProtocolError("metadata from a decode session that never registered")
        return 11

    back = fr.decode_metadata(frames, known)
    assert (back.room, back.kv_indices, back.aux_index, back.required_dst_info_num, back.is_dummy) == (
        42, pages, 5, 2, False
    )
    assert back.generation == 11
    dummy = fr.decode_metadata(fr.metadata_frames(
        TransferRequest(room=43, endpoint="", generation=0, kv_indices=b"", is_dummy=True), ME, "40000",
        "127.0.0.1:15000"), known)
    assert dummy.is_dummy and dummy.aux_index == -1
    with pytest.raises(ProtocolError, match="never registered"):
        fr.decode_metadata(fr.metadata_frames(req, ME, "40000", "127.0.0.1:15001"), known)
    with pytest.raises(ProtocolError, match="state"):
        fr.metadata_frames(TransferRequest(room=1, endpoint="", generation=0, kv_indices=b"",
                                           state_indices={"mamba": [1]}), ME, "1", "s")


def test_status_aux_and_abort() -> None:
    status = fr.decode_status(fr.status_frames(Status(room=3, status=4, rank=0, endpoint=""), ME),
                              lambda room, rank: f"ep-{room}-{rank}")
    assert (status.room, status.status, status.rank, status.endpoint, status.reason) == (3, 4, 1, "ep-3-1", "")
    with pytest.raises(ProtocolError, match="unexpected status"):
        fr.decode_status([b"3", b"2", b"0"], lambda room, rank: "")
    aux = fr.decode_aux(fr.aux_frames(AuxData(room=5, buffer=1, index=7, data=b"xyz")), lambda room: "ep")
    assert (aux.room, aux.buffer, aux.index, aux.data, aux.endpoint) == (5, 1, 7, b"xyz", "ep")
    with pytest.raises(ProtocolError, match="length mismatch"):
        fr.decode_aux([b"AUX_DATA", b"5", b"1", b"7", b"\x00\x00\x00\x09", b"xyz"], lambda room: "")
    abort, ack = fr.decode_abort([*fr.abort_frames(9, ME, "40000"), b"token"], ME)
    assert (abort.room, abort.endpoint) == (9, "tcp://127.0.0.1:40000")
    assert ack == [b"ABORT_ACK", b"9", b"1", b"token"]
    assert fr.decode_abort(fr.abort_frames(9, ME, "40000"), ME)[1] is None
    with pytest.raises(ProtocolError, match="ABORT without a room"):
        fr.decode_abort([b"ABORT"], ME)


def test_bootstrap_table_and_topology_checks() -> None:
    server = BootstrapServer(aiohttp=None)
    body = registration_body(ME, "tcp://10.0.0.5:40000")
    assert (body["rank_ip"], body["rank_port"], body["attn_tp_rank"]) == ("10.0.0.5", 40000, 1)
    server.register(body)
    info = server.table.info
    assert info is not None and (info["attn_tp_size"], info["dp_size"], info["page_size"]) == (2, 1, 16)
    assert server.table.ranks[(0, 0, 1, 0)] == {"rank_ip": "10.0.0.5", "rank_port": 40000}
    assert topology_problem(info, ME) is None
    assert "page size mismatch" in (topology_problem({**info, "page_size": 32}, ME) or "")
    assert "lacks" in (topology_problem({"page_size": 16}, ME) or "")
    assert topology_problem([], ME) == "topology is not a JSON object"
