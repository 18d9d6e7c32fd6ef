"""Staging grants on the decode: a request id that repeats (a prefill restarted on the same endpoint counts
from 1 again; a peer that sends one twice) never replaces a grant, and every byte granted comes back."""

from __future__ import annotations

import asyncio
import signal
import socket

from aiotransfer._control.messages import StageRequest, encode
from tests.peer import digest
from tests.remote import RemotePeer
from tests.test_lifecycle import BIG, SEED, expected, local_decode, open_room, pages
from tests.zmqtools import push, wait_until

STAGED = {"AIOTRANSFER_STAGING": "always", "AIOTRANSFER_STAGING_BYTES": str(8 << 20)}
"""The prefill's 8 MiB arena: 2 MiB pieces, 128 pages each."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_prefill_restarted_on_the_same_endpoint_does_not_take_over_its_old_grants(engine: str) -> None:
    """The old prefill process dies while the decode holds space granted to its pieces; a new one comes up
    on the same endpoint before a heartbeat could tell (they are far apart) and its request ids start at 1
    again. Its pieces land where they belong, and every byte granted to the old process is back in the
    decode's arena once the old room is released, which registering with the new process proves."""
    env = {**STAGED, "AIOTRANSFER_CONTROL_PORT": str(free_port())}
    old = await RemotePeer.start(engine, seed=SEED, env=env, **BIG)
    new: RemotePeer | None = None
    try:
        async with local_decode(engine, staging="always", staging_bytes=32 << 20, heartbeat_interval=30.0,
                                peer_timeout=120.0) as (dec, bufs):
            rx1 = await open_room(dec, old, 1, pages(1500, 80, 0, 1500))
            send = asyncio.ensure_future(old.call("send_kv", room=1, pages=pages(1500, 81)))
            for _ in range(5000):  # until space is granted to a piece of the old process
                if dec.stats()["staging_bytes_in_use"]:
                    break
                await asyncio.sleep(0.001)
            old.signal(signal.SIGKILL)
            await asyncio.gather(send, return_exceptions=True)
            await old.close()
            await asyncio.sleep(0.3)  # scatters under way end; what stays is granted to the dead process
            held = dec.stats()["staging_bytes_in_use"]
            assert held > 0

            new = await RemotePeer.start(engine, seed=SEED, env=env, **BIG)
            assert new.endpoint == old.endpoint
            # the new process does not know this decode: it refuses the first request, and the decode registers
            # again and resends it
            await new.call("sender", room=2)
            rx2 = dec.receiver(2, new.endpoint)
            await rx2.send_metadata([1, 2])
            await new.call("wait_ready", room=2)
            await new.call("send_kv", room=2, pages=[3, 4])
            await rx2.done(timeout=10)
            assert dec.stats()["requests_sent_again"] == 1
            dst, src = pages(500, 82, 1500, 2048), pages(500, 84)  # pages outside room 1's
            rx3 = await open_room(dec, new, 3, dst)
            await new.call("send_kv", room=3, pages=src)  # request ids 1, 2, ... again
            await rx3.done(timeout=30)
            assert digest(bufs, dst) == expected(src)
            # registering again showed the decode a new process on that endpoint (its incarnation): the old one
            # is gone, so its room was released and the space granted to it came back, before any piece of the
            # new process, whose ids start again, could arrive
            await rx1.released(timeout=10)
            assert rx1.release_cause == "peer-restarted"
            assert dec.stats()["staging_bytes_in_use"] == 0
    finally:
        await old.close()
        if new is not None:
            await new.close()


async def test_a_repeated_staging_request_is_refused_and_its_first_grant_comes_back() -> None:
    """The same request id for the same room, twice (no real prefill does this): the first grant stands, the
    second is refused, and releasing the room gives back all the space."""
    engine = "mooncake_tcp"
    prefill = await RemotePeer.start(engine, seed=SEED, env=STAGED, **BIG)
    try:
        async with local_decode(engine, staging="always", staging_bytes=8 << 20) as (dec, _):
            rx = await open_room(dec, prefill, 1, pages(64, 85))
            nbytes = 1 << 20
            req = StageRequest(room=1, endpoint=prefill.endpoint, req_id=7, nbytes=nbytes)
            await push(dec.endpoint, [encode(req)])
            await wait_until(lambda: dec.stats()["staging_bytes_in_use"] == nbytes)
            await push(dec.endpoint, [encode(req)])
            await asyncio.sleep(0.3)
            assert dec.stats()["staging_bytes_in_use"] == nbytes
            assert dec.stats()["dropped_repeated-staging-request"] == 1
            await rx.abort("cancelled by the scheduler")
            await rx.released(timeout=10)
            assert dec.stats()["staging_bytes_in_use"] == 0
    finally:
        await prefill.close()
