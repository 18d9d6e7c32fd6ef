"""Messages answer to their senders: a decode holding the shared key cannot answer for another decode's
staging, frames signed for one process are refused by its successor on the same endpoint, and a prefill
restarted on its endpoint fails none of the requests sent to it after it came up."""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Any

import pytest

from aiotransfer import KVArgs, KVManager, KVPoll, TransferConfig, TransferFailed
from aiotransfer._control.endpoint import ControlPlane
from aiotransfer._control.messages import Drained, Ping, StageGrant, StageRequest, Status
from aiotransfer.errors import ProtocolError
from tests.peer import digest, make_buffers
from tests.remote import RemotePeer
from tests.test_lifecycle import BIG, SEED, expected, local_decode, pages
from tests.zmqtools import wait_until

KEY = b"insiders-share-this-key"
MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plane(port: int = 0, handler: Any = None) -> ControlPlane:
    return ControlPlane("127.0.0.1", port, handler or (lambda _m: None), max_sockets=8, max_message_bytes=MiB,
                        hmac_key=KEY, curve=True)


# -- a process's successor on its endpoint refuses what was signed for it ---------------------------------

async def test_frames_signed_for_one_process_are_refused_by_its_successor_on_the_same_endpoint() -> None:
    """A decode accepts a signed ``Status`` and ``Drained``; the process is replaced on the same endpoint
    and the captured frames are replayed to the new one inside the replay window: refused, as addressed to
    an earlier incarnation. What the prefill signs after hearing from the new process is accepted."""
    port = _free_port()
    prefill, first = _plane(), _plane(port)
    await prefill.start()
    await first.start()
    try:
        # the decode's first message (a registration, here a ping) tells the prefill its incarnation
        assert isinstance(prefill.parse(first.frames(Ping(endpoint=first.endpoint, nonce=1), prefill.endpoint)), Ping)
        status = prefill.frames(Status(room=7, status=int(KVPoll.Success), rank=0, endpoint=prefill.endpoint),
                                first.endpoint)
        drained = prefill.frames(Drained(room=8, endpoint=prefill.endpoint), first.endpoint)
        assert isinstance(first.parse(status), Status) and isinstance(first.parse(drained), Drained)
        await first.aclose()

        second = _plane(port)
        await second.start()
        try:
            assert second.endpoint == first.endpoint and second.incarnation != first.incarnation
            for frames in (status, drained):
                with pytest.raises(ProtocolError, match="earlier incarnation"):
                    second.parse(frames)
            assert isinstance(prefill.parse(second.frames(Ping(endpoint=second.endpoint, nonce=2), prefill.endpoint)),
                              Ping)
            fresh = prefill.frames(Status(room=7, status=int(KVPoll.Failed), rank=0, endpoint=prefill.endpoint),
                                   second.endpoint)
            assert isinstance(second.parse(fresh), Status)
        finally:
            await second.aclose()
    finally:
        await prefill.aclose()


async def test_a_non_contact_message_to_a_process_its_sender_never_heard_from_is_refused() -> None:
    """Without having heard from us, a sender can only open contact (a registration, a topology query, a
    ping): anything else it signs for this endpoint names no incarnation of ours and is refused."""
    a, b = _plane(), _plane()
    await a.start()
    await b.start()
    try:
        with pytest.raises(ProtocolError, match="no incarnation"):
            b.parse(a.frames(Status(room=1, status=int(KVPoll.Success), rank=0, endpoint=a.endpoint), b.endpoint))
        assert isinstance(b.parse(a.frames(Ping(endpoint=a.endpoint, nonce=1), b.endpoint)), Ping)
    finally:
        await a.aclose()
        await b.aclose()


# -- a staging answer is the asked decode's own --------------------------------------------------------

SRC_BUFFERS = make_buffers(2, 64, 4096, 3)


async def _staged_pair(engine: str) -> tuple[KVManager, KVManager, list[Any]]:
    cfg = TransferConfig(engine=engine, hmac_key=KEY, staging="always", staging_bytes=1 << 20)
    dst = make_buffers(2, 64, 4096, None)
    p = await KVManager(KVArgs(SRC_BUFFERS, page_size=16, dtype="uint8"), cfg).start()
    d = await KVManager(KVArgs(dst, page_size=16, dtype="uint8"), cfg).start()
    return p, d, dst


async def test_a_decode_holding_the_key_cannot_answer_another_decodes_staging_request(engine: str) -> None:
    """While the decode asked for staging space has not answered yet, another holder of the key answers the
    request in its place, once in its own name and once naming the asked decode: the first is an answer
    nobody asked it for, the second is refused as signed by another sender. The room's bytes land in its
    own pages once the asked decode answers."""
    p, d, dst_buffers = await _staged_pair(engine)
    attacker = _plane()
    await attacker.start()
    try:
        # an insider: it has heard from the prefill (a ping answered), so what it signs names the prefill's
        # incarnation and passes the control plane
        await attacker.send(p.endpoint, Ping(endpoint=attacker.endpoint, nonce=1), timeout=5)
        await wait_until(lambda: attacker.received == 1)
        tx, rx = p.sender(1), d.receiver(1, p.endpoint)
        dst, src = [5, 9, 2], [1, 2, 3]
        await rx.send_metadata(dst, timeout=10)
        await tx.wait_ready(timeout=10)
        held: list[StageRequest] = []
        grant_for_real = d._handlers[StageRequest]
        d._handlers[StageRequest] = held.append  # the asked decode is slow to answer
        send = asyncio.ensure_future(tx.send_kv(src))
        await wait_until(lambda: len(held) >= 1)
        ask = held[0]
        for claimed in (attacker.endpoint, d.endpoint):
            forged = StageGrant(room=1, endpoint=claimed, req_id=ask.req_id, offset=0, granted=True)
            await attacker.send(p.endpoint, forged, timeout=5)
        await wait_until(lambda: p.stats().get("dropped_unexpected-staging-answer", 0) == 1
                         and p.stats()["control_dropped"].get("sender mismatch", 0) == 1)
        assert not send.done()
        d._handlers[StageRequest] = grant_for_real
        for request in held:
            grant_for_real(request)
        await asyncio.wait_for(send, 10)
        await tx.done(timeout=10)
        await rx.done(timeout=10)
        assert digest(dst_buffers, dst) == digest(SRC_BUFFERS, src)
    finally:
        await attacker.aclose()
        await d.aclose()
        await p.aclose()


async def test_a_grant_outside_the_arena_the_decode_declared_is_refused_before_any_write(engine: str) -> None:
    """The asked decode itself grants space past the end of the staging arena it declared: the prefill
    refuses the grant, counted, posts nothing, and the room fails with the reason on both sides."""
    p, d, _ = await _staged_pair(engine)
    try:
        tx, rx = p.sender(1), d.receiver(1, p.endpoint)
        await rx.send_metadata([5, 9], timeout=10)
        await tx.wait_ready(timeout=10)
        arena = d.describe()
        assert arena["staging_backend"] is not None

        def grant_past_the_end(msg: StageRequest) -> None:
            bad = StageGrant(room=msg.room, endpoint=d.endpoint, req_id=msg.req_id, offset=(1 << 20) - 1, granted=True)
            d._ctx.spawn(d._ctx.reply(msg.endpoint, bad), "bad-grant")

        d._handlers[StageRequest] = grant_past_the_end
        with pytest.raises(TransferFailed, match=r"outside the .* staging arena it declared"):
            await tx.send_kv([1, 2])
        assert p.stats()["dropped_invalid-staging-grant"] == 1
        assert p.stats()["engine_completed"] == 0
        with pytest.raises(TransferFailed, match=r"outside the .* staging arena it declared"):
            await rx.done(timeout=10)
    finally:
        await d.aclose()
        await p.aclose()


# -- a prefill restarted on its endpoint -----------------------------------------------------------------

@pytest.mark.parametrize("keyed", [False, True], ids=["open", "signed"])
async def test_requests_sent_to_a_prefill_restarted_on_its_endpoint_all_succeed(engine: str, keyed: bool) -> None:
    """The prefill process is killed with a room in flight and restarted on the same endpoint. Before the
    decode can notice (heartbeats are far apart), five rooms send their requests to it: the new process does
    not know the decode's registration and refuses each, the decode registers again and resends, and all
    five succeed, byte-exact. The room in flight at the kill fails, on the decode and on a sender the new
    process opens for it, with the same reason."""
    env = {"AIOTRANSFER_CONTROL_PORT": str(_free_port())}
    if keyed:
        env["AIOTRANSFER_HMAC_KEY"] = KEY.decode()
    cfg: dict[str, Any] = {"heartbeat_interval": 30.0, "peer_timeout": 120.0}
    if keyed:
        cfg["hmac_key"] = KEY
    old = await RemotePeer.start(engine, seed=SEED, env=env, **BIG)
    new: RemotePeer | None = None
    try:
        async with local_decode(engine, **cfg) as (dec, bufs):
            await old.call("sender", room=10)
            rx0 = dec.receiver(10, old.endpoint)
            await rx0.send_metadata(pages(8, 100), timeout=10)
            await old.call("wait_ready", room=10)
            old.signal(signal.SIGKILL)
            await old.close()
            new = await RemotePeer.start(engine, seed=SEED, env=env, **BIG)
            assert new.endpoint == old.endpoint

            rooms = range(11, 16)
            dsts = {r: pages(64, r, 64 * (r - 10), 64 * (r - 9)) for r in rooms}
            srcs = {r: pages(64, 50 + r) for r in rooms}
            for r in rooms:
                await new.call("sender", room=r)
            rxs = [dec.receiver(r, new.endpoint) for r in rooms]
            await asyncio.gather(*(rx.send_metadata(dsts[rx.room], timeout=10) for rx in rxs))
            for r in rooms:
                await new.call("wait_ready", room=r)
                await new.call("send_kv", room=r, pages=srcs[r])
            for rx in rxs:
                await rx.done(timeout=20)
                assert digest(bufs, dsts[rx.room]) == expected(srcs[rx.room])
            assert dec.stats()["requests_sent_again"] == len(rooms)

            with pytest.raises(TransferFailed, match="restarted") as on_decode:
                await rx0.done(timeout=20)
            await rx0.released(timeout=10)
            await new.call("sender", room=10)
            reason = (await new.call("reason", room=10))["reason"]
            assert reason is not None and on_decode.value.reason in reason
    finally:
        await old.close()
        if new is not None:
            await new.close()


async def test_a_second_decode_naming_an_open_room_gets_no_copy_of_it(engine: str) -> None:
    """A room asked for by its one decode rank is not written to another decode that names the same room
    (a room number is not a secret): the other is refused with the reason, and the first gets its bytes."""
    cfg = TransferConfig(engine=engine)
    src_bufs = make_buffers(2, 64, 4096, 3)
    d1_bufs, d2_bufs = make_buffers(2, 64, 4096, None), make_buffers(2, 64, 4096, None)
    async with KVManager(KVArgs(src_bufs, page_size=16, dtype="uint8"), cfg) as p, \
            KVManager(KVArgs(d1_bufs, page_size=16, dtype="uint8"), cfg) as d1, \
            KVManager(KVArgs(d2_bufs, page_size=16, dtype="uint8"), cfg) as d2:
        tx = p.sender(4)
        rx1 = d1.receiver(4, p.endpoint)
        await rx1.send_metadata([7, 8], timeout=10)
        await tx.wait_ready(timeout=10)
        rx2 = d2.receiver(4, p.endpoint)
        await rx2.send_metadata([7, 8], timeout=10)
        with pytest.raises(TransferFailed, match="already has the 1 decode rank"):
            await rx2.done(timeout=10)
        await tx.send_kv([1, 2])
        await rx1.done(timeout=10)
        assert digest(d1_bufs, [7, 8]) == digest(src_bufs, [1, 2])
        assert digest(d2_bufs, [7, 8]) == digest(make_buffers(2, 64, 4096, None), [7, 8])
