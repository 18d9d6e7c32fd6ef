"""Authentication, replay protection, and fuzzing of the decoder and the manager's message handler.

The signed managers here turn CurveZMQ off (it is on by default with a key, see ``test_curve.py``): what they
test is the layer beneath it, the signatures that every message must carry whoever could connect."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiotransfer import KVArgs, KVManager, TransferConfig
from aiotransfer._control.endpoint import ControlPlane, signed_frames
from aiotransfer._control.messages import Ping, Status, TransferRequest, encode
from aiotransfer.errors import ProtocolError
from tests.conftest import GEOMETRY, expected_digest
from tests.peer import make_buffers
from tests.remote import RemoteError, RemotePeer
from tests.zmqtools import push, wait_until

KEY = b"s3cret-shared-key"
NO_CURVE = {"AIOTRANSFER_CONTROL_CURVE": "0"}


@pytest.fixture
async def signed_prefill(engine: str) -> AsyncIterator[KVManager]:
    bufs = make_buffers(GEOMETRY["buffers"], GEOMETRY["pages"], GEOMETRY["item_len"], seed=3)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), TransferConfig(engine=engine, hmac_key=KEY, control_curve=False)) as m:
        yield m


def _dropped(m: KVManager, cause: str) -> int:
    return int(m.stats()["control_dropped"].get(cause, 0))


async def test_signed_transfer_end_to_end(signed_prefill: KVManager, engine: str) -> None:
    peer = await RemotePeer.start(engine, env={"AIOTRANSFER_HMAC_KEY": KEY.decode(), **NO_CURVE}, **GEOMETRY)
    try:
        tx = signed_prefill.sender(1)
        await peer.call("receiver", room=1, peer=signed_prefill.endpoint, pages=[5, 6, 7])
        await tx.wait_ready(timeout=10)
        await tx.send_kv([1, 2, 3])
        await peer.call("done", room=1)
        assert (await peer.call("digest", pages=[5, 6, 7]))["digest"] == expected_digest(
            signed_prefill.args.kv_buffers, [1, 2, 3]
        )
    finally:
        await peer.close()


async def test_wrong_key_peer_is_refused_and_logged(signed_prefill: KVManager, engine: str) -> None:
    peer = await RemotePeer.start(engine, env={"AIOTRANSFER_HMAC_KEY": "not-the-key", **NO_CURVE}, **GEOMETRY)
    try:
        with pytest.raises(RemoteError, match="no registration answer"):
            await peer.call("receiver", room=2, peer=signed_prefill.endpoint, pages=[1], timeout=1.0)
        assert _dropped(signed_prefill, "bad signature") >= 1
        assert signed_prefill.stats()["decode_peers"] == 0
    finally:
        await peer.close()


async def test_unsigned_and_replayed_messages_are_dropped(signed_prefill: KVManager) -> None:
    ping = Ping(endpoint="tcp://127.0.0.1:9", nonce=1)
    await push(signed_prefill.endpoint, [encode(ping)])
    await wait_until(lambda: _dropped(signed_prefill, "unauthenticated message") == 1)
    # a correctly signed message is accepted once; the identical bytes again are a replay
    plane = ControlPlane("127.0.0.1", 0, lambda m: None, max_sockets=4, max_message_bytes=1 << 20, hmac_key=KEY,
                         curve=False)
    await plane.start()
    ping = Ping(endpoint=plane.endpoint, nonce=1)  # signed messages name their signed sender
    frames = plane.frames(ping, signed_prefill.endpoint)
    await push(signed_prefill.endpoint, frames)
    await wait_until(lambda: signed_prefill.stats()["control_received"] == 1)
    await push(signed_prefill.endpoint, frames)
    await wait_until(lambda: _dropped(signed_prefill, "replayed message") == 1)
    # a validly signed but old message is outside the replay window
    payload = encode(ping)
    old = signed_frames(KEY, payload, sender=plane.endpoint, destination=signed_prefill.endpoint,
                        counter=time.time_ns(), sent=time.time() - 3600)
    await push(signed_prefill.endpoint, old)
    await wait_until(lambda: _dropped(signed_prefill, "stale signed message (outside the replay window)") == 1)
    header = old[1]
    await push(signed_prefill.endpoint, [payload, header, b"x" * 32])
    await wait_until(lambda: _dropped(signed_prefill, "bad signature") == 1)
    assert signed_prefill.stats()["control_received"] == 1
    await plane.aclose()


# -- fuzzing --------------------------------------------------------------------------------

_TAGS = ["hello", "hello_ack", "req", "status", "aux", "abort", "rank_register", "topology_query", "topology",
         "stage_req", "stage_grant", "staged", "staged_ack", "ping", "pong", "bogus"]
_FIELDS = ["room", "endpoint", "generation", "kv_indices", "status", "rank", "reason", "nonce", "version",
           "data", "buffer", "index", "offset", "nbytes", "req_id", "granted", "ok", "kv", "aux", "state",
           "session_id", "engine", "engine_info", "probe_addr", "compat", "incarnation", "buffers", "rows",
           "heads", "start", "count", "head_bytes", "dst_start", "n_pages", "checksum", "slices", "ranks",
           "ready", "accepted", "is_dummy", "aux_index", "state_indices", "required_dst_info_num"]
_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=20), st.binary(max_size=64),
)
_value = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                      max_leaves=12)
_message = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(_TAGS),
    st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=10),
)
FUZZ_COUNT = {"inputs": 0}


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(_message.map(msgspec.msgpack.encode), st.binary(max_size=512)), st.integers(0, 2))
def test_fuzz_decoder_and_handler(fuzz_manager: KVManager, data: bytes, extra_frames: int) -> None:
    """Any bytes: parse either raises ProtocolError or yields a valid message that the handler survives."""
    FUZZ_COUNT["inputs"] += 1
    plane = fuzz_manager._ctx.control_or_none
    assert plane is not None
    frames = [data] + [os.urandom(8)] * extra_frames
    try:
        msg = plane.parse(frames)
    except ProtocolError:
        return
    if msg is not None:
        fuzz_manager._dispatch(msg)  # must not raise


@pytest.fixture(scope="module")
def fuzz_manager() -> Any:
    loop = asyncio.new_event_loop()
    bufs = make_buffers(2, 16, 256, seed=1)
    mgr = KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), TransferConfig(engine="mooncake_tcp"))
    loop.run_until_complete(mgr.start())
    # the dispatcher spawns tasks on the running loop; give it one
    asyncio.set_event_loop(loop)
    ctx = mgr._ctx
    original = ctx.spawn

    def spawn(coro: Any, name: str) -> Any:
        coro.close()  # handlers' replies are not the subject here
        done = loop.create_future()
        done.cancel()
        return done

    ctx.spawn = spawn  # type: ignore[method-assign]
    yield mgr
    ctx.spawn = original  # type: ignore[method-assign]
    loop.run_until_complete(mgr.aclose())
    loop.close()
    asyncio.set_event_loop(None)
    print(f"fuzz inputs tried: {FUZZ_COUNT['inputs']}")


async def test_fuzz_over_the_socket_keeps_manager_alive(signed_prefill: KVManager, engine: str) -> None:
    """Garbage and wrongly signed floods on a real socket: all dropped, the manager keeps serving."""
    rng = __import__("random").Random(7)
    for i in range(300):
        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        frames = [body] if i % 3 else [encode(Status(room=i, status=4, rank=0, endpoint="x")), os.urandom(24), os.urandom(32)]
        await push(signed_prefill.endpoint, frames)
    await wait_until(lambda: sum(signed_prefill.stats()["control_dropped"].values()) >= 300)
    await test_signed_transfer_end_to_end(signed_prefill, engine)


def test_request_size_bound() -> None:
    plane = ControlPlane("127.0.0.1", 0, lambda m: None, max_sockets=4, max_message_bytes=1024)
    big = encode(TransferRequest(room=1, endpoint="e", generation=1, kv_indices=b"\x00" * 4096))
    with pytest.raises(ProtocolError, match="too large"):
        plane.parse([big])
