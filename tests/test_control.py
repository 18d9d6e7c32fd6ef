"""Control plane over real zmq sockets: malformed, hostile and misdirected messages."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgspec
import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, KVPoll, TransferConfig
from aiotransfer._control.messages import (
    PROTOCOL_VERSION,
    Hello,
    Staged,
    Status,
    TransferRequest,
    decode,
    encode,
    pack_indices,
)
from aiotransfer._kv.client import Route
from aiotransfer.errors import ProtocolError
from tests.conftest import GEOMETRY
from tests.remote import RemotePeer
from tests.zmqtools import push, wait_until


def test_codec_rejects_garbage_and_bad_values() -> None:
    with pytest.raises(ProtocolError):
        decode(b"\x00\x01garbage")
    with pytest.raises(ProtocolError):
        decode(encode(Status(room=1, status=9, rank=0, endpoint="x")))
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode({"type": "req", "room": -5}))
    with pytest.raises(ProtocolError, match="whole int32"):
        decode(encode(TransferRequest(room=1, endpoint="e", generation=1, kv_indices=b"\x01\x02\x03")))
    ok = TransferRequest(room=1, endpoint="e", generation=1, kv_indices=pack_indices(np.arange(4)))
    assert decode(encode(ok)) == ok


def test_staged_piece_or_space_handed_back_nothing_in_between() -> None:
    """A staged piece either carries pages whose size matches its geometry, or is empty (the granted space
    handed back): n_pages 0 with bytes or buffers, or bytes without pages, is refused."""
    base: dict[str, Any] = {"room": 3, "endpoint": "e", "req_id": 1, "offset": 0, "dst_start": 0, "rows": 1,
                            "heads": 1, "start": 0, "count": 1, "head_bytes": 8}
    ok = [Staged(**base, nbytes=16, n_pages=2, buffers=[0]), Staged(**base, nbytes=0, n_pages=0, buffers=[])]
    for msg in ok:
        assert decode(encode(msg)) == msg
    for nbytes, n_pages, buffers in ((8, 0, []), (0, 0, [0]), (16, 1, [0]), (0, 2, [0])):
        with pytest.raises(ProtocolError):
            decode(encode(Staged(**base, nbytes=nbytes, n_pages=n_pages, buffers=buffers)))


async def test_garbage_leaves_manager_working(prefill: KVManager, decode: RemotePeer) -> None:
    rng = np.random.default_rng(5)
    junk = [
        [b""],
        [os.urandom(64)],
        [os.urandom(1 << 16)],
        [b"\x81\xa4type\xa3req"],  # truncated struct
        [encode(Status(room=1, status=4, rank=0, endpoint="tcp://1.2.3.4:1"))[:-3]],
        [b"a", b"b", b"c"],  # wrong frame count
        [msgspec.msgpack.encode({"type": "hello", "version": PROTOCOL_VERSION})],  # missing fields
        [msgspec.msgpack.encode([1, 2, 3])],
    ]
    junk += [[bytes(rng.integers(0, 256, size=int(rng.integers(1, 300)), dtype=np.uint8))] for _ in range(50)]
    for frames in junk:
        await push(prefill.endpoint, frames)
    await wait_until(lambda: sum(prefill.stats()["control_dropped"].values()) >= len(junk))
    assert prefill.stats()["control_received"] == 0
    # still works end to end
    tx = prefill.sender(1)
    await decode.call("receiver", room=1, peer=prefill.endpoint, pages=[3, 4])
    await tx.wait_ready(timeout=10)
    await tx.send_kv([9, 10])
    await decode.call("done", room=1)


async def test_hostile_request_indices_fail_the_room_on_both_sides(prefill: KVManager, engine: str) -> None:
    """A registered decode asking for pages beyond what it registered is refused with a reason."""
    peer = await RemotePeer.start(engine, **GEOMETRY)
    try:
        tx = prefill.sender(2)
        await peer.call("receiver", room=2, peer=prefill.endpoint, pages=[1])  # registers, room 2 is fine
        await tx.wait_ready(timeout=10)
        registered = next(iter(prefill._prefill.decode_peers.values()))
        # now forge a request for room 3 from that decode's endpoint, pointing past its buffers
        forged = TransferRequest(
            room=3, endpoint=registered.endpoint, generation=registered.hello.generation,
            kv_indices=pack_indices(np.array([GEOMETRY["pages"] + 10])),
        )
        tx3 = prefill.sender(3)
        await push(prefill.endpoint, [encode(forged)])
        await wait_until(lambda: prefill.stats().get("dropped_invalid-request", 0) == 1)
        assert tx3.poll() is KVPoll.Failed
        assert "invalid transfer request" in (tx3.failure_reason or "")
        assert "out of range" in (tx3.failure_reason or "")
        # the decode endpoint was told (it has no receiver for room 3, so it counts the status as unknown)
        for _ in range(500):
            if (await peer.call("stats"))["stats"].get("dropped_unknown-room", 0) == 1:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("decode never received the failure status")
        await tx.send_kv([5])
        await peer.call("done", room=2)
    finally:
        await peer.close()


async def test_forged_status_from_wrong_peer_is_ignored(prefill: KVManager, engine: str) -> None:
    cfg = TransferConfig(engine=engine)
    dst = [np.zeros((GEOMETRY["pages"], GEOMETRY["item_len"]), np.uint8) for _ in range(GEOMETRY["buffers"])]
    async with KVManager(KVArgs(dst, page_size=16, dtype="uint8"), cfg) as dec:
        rx = dec.receiver(5, prefill.endpoint)
        tx = prefill.sender(5)
        await rx.send_metadata([1, 2])
        await tx.wait_ready(timeout=10)
        forged = Status(room=5, status=int(KVPoll.Success), rank=0, endpoint="tcp://127.0.0.1:1")
        await push(dec.endpoint, [encode(forged)])
        await wait_until(lambda: dec.stats().get("dropped_wrong-peer", 0) == 1)
        assert rx.poll() is KVPoll.WaitingForInput
        forged_fail = Status(room=99, status=int(KVPoll.Failed), rank=0, endpoint=prefill.endpoint, reason="x")
        await push(dec.endpoint, [encode(forged_fail)])
        await wait_until(lambda: dec.stats().get("dropped_unknown-room", 0) == 1)
        await tx.send_kv([3, 4])
        await rx.done(timeout=10)
        # a late status for the concluded room does nothing
        await push(dec.endpoint, [encode(Status(room=5, status=0, rank=0, endpoint=prefill.endpoint))])
        await wait_until(lambda: dec.stats().get("dropped_unknown-room", 0) == 2)
        assert rx.poll() is KVPoll.Success


async def test_incompatible_peer_is_refused_at_registration(prefill: KVManager, engine: str) -> None:
    peer = await RemotePeer.start(engine, buffers=GEOMETRY["buffers"], pages=64, item_len=2048)
    try:
        with pytest.raises(Exception, match="KV item length mismatch at buffer 0: peer 2048"):
            await peer.call("receiver", room=1, peer=prefill.endpoint, pages=[1])
        assert prefill.stats()["peers_refused"] == 1
    finally:
        await peer.close()


async def test_a_request_naming_a_registration_the_prefill_does_not_hold_takes_nothing(
        prefill: KVManager, engine: str) -> None:
    """The prefill answers "register again" and leaves its room alone; a decode room that never sent such a
    request (no request of it names that registration) ignores the answer, and counts it."""
    cfg = TransferConfig(engine=engine)
    dst = [np.zeros((GEOMETRY["pages"], GEOMETRY["item_len"]), np.uint8) for _ in range(GEOMETRY["buffers"])]
    async with KVManager(KVArgs(dst, page_size=16, dtype="uint8"), cfg) as dec:
        tx = prefill.sender(6)
        rx = dec.receiver(6, prefill.endpoint)
        # skip registration: a raw request straight to the prefill
        req = TransferRequest(room=6, endpoint=dec.endpoint, generation=1, kv_indices=pack_indices(np.arange(2)))
        rx._route = Route(sources={prefill.endpoint: 0}, endpoints=[prefill.endpoint], required=1, requests=[])
        await push(prefill.endpoint, [encode(req)])
        await wait_until(lambda: dec.stats().get("dropped_unexpected-register-again", 0) == 1)
        assert prefill.stats()["requests_register_again"] == 1
        assert tx.poll() is KVPoll.Bootstrapping and rx.poll() is KVPoll.Bootstrapping
        await tx.abort("test over")


async def test_hello_with_wrong_version_is_dropped(prefill: KVManager) -> None:
    h = Hello(version=PROTOCOL_VERSION + 1, endpoint="tcp://127.0.0.1:9", generation=1, engine="mooncake",
              session_id="x", engine_info=b"", probe_addr=1, compat="x", kv=[])
    await push(prefill.endpoint, [encode(h)])
    await wait_until(lambda: sum(prefill.stats()["control_dropped"].values()) == 1)


async def test_a_kv_dtype_mismatch_is_refused_at_the_handshake_naming_both(prefill: KVManager, engine: str) -> None:
    """A decode whose KV cache has another dtype is refused before any byte moves, and told which two."""
    from aiotransfer import IncompatiblePeer

    dst = [np.zeros((GEOMETRY["pages"], GEOMETRY["item_len"]), np.uint8) for _ in range(GEOMETRY["buffers"])]
    async with KVManager(KVArgs(dst, page_size=16, dtype="float16"), TransferConfig(engine=engine)) as dec:
        rx = dec.receiver(9, prefill.endpoint)
        with pytest.raises(IncompatiblePeer, match=r"KV dtype mismatch: peer 'float16', ours 'uint8'"):
            await rx.send_metadata([1], timeout=10)
    assert prefill.stats()["peers_refused"] == 1


class _DeviceTensor:
    """What KVArgs reads of a torch tensor on a GPU (the test machine has none)."""

    def __init__(self, backing: np.ndarray, device: str) -> None:
        self._backing, self.device, self.shape = backing, device, backing.shape

    def data_ptr(self) -> int:
        return int(self._backing.ctypes.data)

    def element_size(self) -> int:
        return 1

    def numel(self) -> int:
        return int(self._backing.size)

    def is_contiguous(self) -> bool:
        return True

    def dim(self) -> int:
        return self._backing.ndim


def test_kv_buffers_on_several_devices_are_refused() -> None:
    from aiotransfer import InvalidArgument

    host, backing = np.zeros((4, 64), np.uint8), np.zeros((4, 64), np.uint8)
    with pytest.raises(InvalidArgument, match=r"several devices \(cpu, cuda:0\)"):
        KVArgs([host, _DeviceTensor(backing, "cuda:0")])
    args = KVArgs([_DeviceTensor(backing, "cuda:0")], aux_buffers=[host])  # aux may live elsewhere
    assert args.kv_device == "cuda:0"
