"""A fleet, not a pair: a manager serving many peers keeps its costs flat. A heartbeat pass over many peers never
holds the loop; the control plane's sockets stay inside ZeroMQ's own limit; a send that fails is not swallowed;
evicted sockets deliver what they queued; and the registrations of decodes that left are forgotten."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, KVPoll, TransferConfig
from aiotransfer._control.endpoint import ControlPlane
from aiotransfer._control.messages import HelloAck, Message, Ping, Pong
from aiotransfer._liveness import Liveness
from aiotransfer.errors import AiotransferError, PeerError
from tests.peer import digest, make_buffers
from tests.test_room_reuse import ITEM, PAGES, managers


async def test_a_heartbeat_pass_over_many_peers_never_holds_the_loop() -> None:
    """2,000 peers with a room open, each ping costing the CPU of one signed send: the pass is spread over its
    interval in slices, so the loop is held for a slice's pings at a time (about a millisecond; a few slices
    when a busy machine delays the loop), not for the whole pass (100 ms in one go), and every peer is still
    pinged once per interval."""
    peers = [f"tcp://10.0.0.1:{port}" for port in range(20000, 22000)]
    pinged: Counter[str] = Counter()

    async def ping(endpoint: str) -> None:
        spin = time.thread_time()
        while time.thread_time() - spin < 50e-6:
            pass
        pinged[endpoint] += 1

    live = Liveness(interval=0.5, timeout=60.0, active_peers=lambda: peers, ping=ping,
                    on_dead=lambda ep, why: None, on_restart=lambda ep: None)
    loop = asyncio.get_running_loop()
    live.start()
    worst = 0.0
    try:
        end = loop.time() + 1.6
        while loop.time() < end:
            # the loop thread's own CPU while this waits for a millisecond: what other callbacks held it for
            # (a busy machine's preemption does not count)
            cpu = time.thread_time()
            await asyncio.sleep(0.001)
            worst = max(worst, time.thread_time() - cpu)
    finally:
        await live.aclose()
    print(f"longest hold of the loop over three passes of {len(peers)} pings: {worst * 1000:.1f} ms of CPU")
    assert min(pinged[ep] for ep in peers) >= 2, "a pass did not reach every peer within its interval"
    assert worst < 0.04, f"a heartbeat pass held the loop for {worst * 1000:.0f} ms"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(cond: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        await asyncio.sleep(0.02)


async def test_the_socket_cache_lives_inside_zeromqs_own_limit() -> None:
    """The default cache (512 sockets) with as many evicted ones still delivering: 1,100 distinct peers (one
    listener reached at 1,100 loopback addresses) take more than ZeroMQ's default 1,023 sockets per context.
    Every send goes through and every message arrives; no send fails with "Too many open files"."""
    got: list[int] = []

    def handler(msg: Message) -> None:
        assert isinstance(msg, Ping)
        got.append(msg.nonce)

    port = _free_port()
    receiver = ControlPlane("0.0.0.0", port, handler, max_sockets=8, max_message_bytes=4096)
    sender = ControlPlane("127.0.0.1", 0, lambda _: None, max_sockets=512, max_message_bytes=4096)
    await receiver.start()
    await sender.start()
    n = 1100
    try:
        for i in range(n):
            peer = f"tcp://127.0.{1 + i // 250}.{1 + i % 250}:{port}"
            await sender.send(peer, Ping(endpoint=sender.endpoint, nonce=i), timeout=10)
        await _until(lambda: len(got) == n, 30, lambda: f"{n - len(got)} of {n} messages lost")
        assert sorted(got) == list(range(n))
    finally:
        await sender.aclose(0.0)
        await receiver.aclose(0.0)


async def test_evicted_sockets_never_drop_what_they_queued() -> None:
    """A cache of two sockets and 24 peers slow to come up (not listening yet): a burst of messages to each,
    then a second message to each, evicts sockets long before their connections are made. Once the peers
    listen, every one receives both of its messages, in order: an evicted socket is never closed with what it
    queued (beyond ``max_sockets`` evicted ones, libzmq is left to deliver it, and the next message to that peer
    waits for it)."""
    ports = [_free_port() for _ in range(24)]
    got: dict[int, list[int]] = {}

    def recorder(port: int) -> Callable[[Message], None]:
        def handler(msg: Message) -> None:
            assert isinstance(msg, Ping)
            got.setdefault(port, []).append(msg.nonce)
        return handler

    sender = ControlPlane("127.0.0.1", 0, lambda _: None, max_sockets=2, max_message_bytes=4096)
    peers = [ControlPlane("127.0.0.1", port, recorder(port), max_sockets=2, max_message_bytes=4096) for port in ports]
    await sender.start()
    try:
        async def to_all(nonce: int) -> None:
            for port in ports:
                await sender.send(f"tcp://127.0.0.1:{port}", Ping(endpoint=sender.endpoint, nonce=nonce), timeout=30)

        burst = asyncio.ensure_future(asyncio.gather(to_all(1), to_all(2)))
        await asyncio.sleep(0.3)
        for peer in peers:
            await peer.start()
        await asyncio.wait_for(burst, 30)
        await _until(lambda: sum(len(v) for v in got.values()) >= 2 * len(ports), 20,
                     lambda: f"messages lost: {got}")
        await asyncio.sleep(0.1)
        assert all(got.get(port) == [1, 2] for port in ports), got
        assert sender.evicted > 2
    finally:
        for plane in [sender, *peers]:
            await plane.aclose(0.0)


def _failing(plane: ControlPlane, kind: type, times: int = 1) -> list[str]:
    """Make ``plane``'s next ``times`` sends of a ``kind`` message fail as libzmq fails one when the process is out
    of sockets; returns where they were going."""
    send, try_send, failed = plane.send, plane.try_send, list[str]()

    async def wrapper(endpoint: str, msg: Message, **kw: Any) -> None:
        if isinstance(msg, kind) and len(failed) < times:
            failed.append(endpoint)
            raise PeerError(f"cannot send to {endpoint}: Too many open files")
        await send(endpoint, msg, **kw)

    def at_once(endpoint: str, msg: Message, **kw: Any) -> bool:
        # out of sockets, no socket can be had without waiting either: the message goes the ordinary way
        if isinstance(msg, kind) and len(failed) < times:
            return False
        return try_send(endpoint, msg, **kw)

    plane.send = wrapper  # type: ignore[method-assign]
    plane.try_send = at_once  # type: ignore[method-assign]
    return failed


async def test_a_pong_that_cannot_leave_fails_the_rooms_on_both_sides_with_the_reason(engine: str) -> None:
    """The prefill's answer to a decode's ping fails: the decode would hear nothing and declare the prefill
    dead. Instead the prefill fails the room it holds with that decode, with the reason, and the decode's room
    fails with the same reason; the failure is counted."""
    async with managers(engine, 2, heartbeat_interval=0.1, peer_timeout=30.0) as [(dec, _), (pre, _)]:
        tx = pre.sender(1)
        rx = dec.receiver(1, pre.endpoint)
        await rx.send_metadata([1, 2], timeout=10)
        await tx.wait_ready(timeout=10)
        failed = _failing(pre._ctx.control, Pong)
        await _until(lambda: rx.status is KVPoll.Failed and tx.status is KVPoll.Failed, 10,
                     lambda: f"rooms still {tx.status.name} / {rx.status.name} after the Pong failed ({failed})")
        assert failed == [dec.endpoint]
        assert "Too many open files" in (tx.failure_reason or "")
        assert rx.failure_reason == tx.failure_reason
        assert pre.stats()["control_send_failed"] == 1


async def test_a_registration_answer_that_cannot_leave_is_not_kept_and_the_decode_learns_why(engine: str) -> None:
    """The prefill's HelloAck fails: the registration is not kept (the decode never learned of it), the
    failure is counted, and the decode's room fails at once with the reason, not after a timeout. The next
    room registers again and goes through."""
    async with managers(engine, 2, handshake_timeout=10.0) as [(dec, _), (pre, _)]:
        failed = _failing(pre._ctx.control, HelloAck)
        pre.sender(1)
        rx = dec.receiver(1, pre.endpoint)
        t0 = time.monotonic()
        with pytest.raises(AiotransferError, match=r"could not leave: .*Too many open files"):
            await rx.send_metadata([1, 2], timeout=10)
        assert time.monotonic() - t0 < 5.0
        assert failed == [dec.endpoint]
        assert pre.stats()["control_send_failed"] == 1 and pre.stats()["decode_peers"] == 0
        tx = pre.sender(2)
        rx2 = dec.receiver(2, pre.endpoint)
        await rx2.send_metadata([1, 2], timeout=10)
        await tx.wait_ready(timeout=10)
        assert pre.stats()["decode_peers"] == 1


async def test_registrations_of_decodes_that_left_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill holding at most 16 registrations (``max_peers``) serves 120 decode ranks that come and go, at
    most 8 alive at once, each on a new endpoint (pods rescheduled): every one registers and moves its KV, and
    the registrations held stay within twice those alive. A long-lived decode whose registration was forgotten
    meanwhile (it stayed idle) is told to register again by its next request, and that room goes through."""
    cfg: dict[str, Any] = {"engine": "memory", "max_peers": 16, "handshake_timeout": 5.0, "lag_probe_interval": 0}
    pre_bufs = make_buffers(2, PAGES, ITEM, seed=7)
    pre = await KVManager(KVArgs(pre_bufs, page_size=16, dtype="uint8"), TransferConfig(**cfg)).start()
    alive: list[KVManager] = []
    room = 0

    async def transfer(dec: KVManager, bufs: list[np.ndarray]) -> None:
        nonlocal room
        room += 1
        tx = pre.sender(room)
        rx = dec.receiver(room, pre.endpoint)
        await rx.send_metadata([room % PAGES], timeout=10)
        await tx.wait_ready(timeout=10)
        await tx.send_kv([1], timeout=10)
        await rx.done(timeout=10)
        assert digest(bufs, [room % PAGES]) == digest(pre_bufs, [1])

    try:
        old_bufs = make_buffers(2, PAGES, ITEM, seed=None)
        old = await KVManager(KVArgs(old_bufs, page_size=16, dtype="uint8"), TransferConfig(**cfg)).start()
        await transfer(old, old_bufs)
        held = 0
        for _ in range(120):
            if len(alive) == 8:
                await alive.pop(0).aclose()
            bufs = make_buffers(2, PAGES, ITEM, seed=None)
            dec = await KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), TransferConfig(**cfg)).start()
            alive.append(dec)
            await transfer(dec, bufs)
            held = max(held, pre.stats()["decode_peers"])
            assert held <= 2 * 9, f"{held} registrations held with {len(alive) + 1} decodes alive"
        stats = pre.stats()
        print(f"121 decodes registered, at most {held} registrations held; forgotten "
              f"{stats.get('decode_peers_forgotten', 0)}")
        assert stats.get("dropped_too-many-peers", 0) == 0
        assert stats["decode_peers_forgotten"] >= 121 - 16
        await transfer(old, old_bufs)  # its registration was forgotten: it registers again, and moves its KV
        assert old.stats()["requests_sent_again"] == 1 and pre.stats()["requests_register_again"] == 1
        await old.aclose()
    finally:
        for dec in alive:
            await dec.aclose()
        await pre.aclose()


async def test_a_registration_idle_past_its_bound_is_forgotten() -> None:
    """A decode that moved its KV and then stayed idle past ``registration_idle_s``: the prefill forgets its
    registration (counted), and the decode's next room registers again and goes through."""
    async with managers("memory", 2, registration_idle_s=0.3, lag_probe_interval=0) as [(dec, dst), (pre, src)]:
        for room in (1, 2):
            tx = pre.sender(room)
            rx = dec.receiver(room, pre.endpoint)
            await rx.send_metadata([room], timeout=10)
            await tx.wait_ready(timeout=10)
            await tx.send_kv([3], timeout=10)
            await rx.done(timeout=10)
            assert digest(dst, [room]) == digest(src, [3])
            assert pre.stats()["decode_peers"] == 1
            await _until(lambda: pre.stats()["decode_peers"] == 0, 5, lambda: "the idle registration is still held")
            assert pre.stats()["decode_peers_forgotten"] == room


async def test_connections_to_peers_used_again_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four peers, a cache of two sockets, each peer sent a message every 0.4 s (past the 0.2 s an evicted
    socket is given to deliver): the evicted sockets are kept and taken back, so the four connections (and
    their CurveZMQ handshakes) are made once, not on every round; every message arrives."""
    from aiotransfer._control import endpoint, sockets

    monkeypatch.setattr(sockets, "RETIRE_S", 0.2)
    monkeypatch.setattr(endpoint, "RETIRE_S", 0.2, raising=False)  # where it was kept before
    got: list[int] = []
    key = b"k" * 32
    def handler(msg: Message) -> None:
        assert isinstance(msg, Ping)
        got.append(msg.nonce)

    peers = [ControlPlane("127.0.0.1", 0, handler, max_sockets=2, max_message_bytes=4096, hmac_key=key)
             for _ in range(4)]
    sender = ControlPlane("127.0.0.1", 0, lambda _: None, max_sockets=2, max_message_bytes=4096, hmac_key=key)
    for plane in [sender, *peers]:
        await plane.start()
    assert sender._ctx is not None
    create, opened = sender._ctx.socket, list[int]()

    def counting(kind: int, **kw: Any) -> Any:
        opened.append(kind)
        return create(kind, **kw)

    monkeypatch.setattr(sender._ctx, "socket", counting)
    sent = [0]
    try:
        for round_ in range(5):
            for peer in peers:
                await sender.send(peer.endpoint, Ping(endpoint=sender.endpoint, nonce=round_), timeout=5)
            sent[0] += 4
            await _until(lambda: len(got) == sent[0], 10, lambda: f"messages lost: {got}")
            await asyncio.sleep(0.4)
        assert len(opened) == 4, f"{len(opened)} connections made for 4 peers over 5 rounds"
        assert sender.sockets_opened == 4
    finally:
        for plane in [sender, *peers]:
            await plane.aclose(0.0)


async def test_a_ping_that_cannot_leave_at_once_does_not_hold_the_heartbeat_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer whose socket cannot take a message now (its queue full, or its evicted socket still delivering):
    the heartbeat's ping to it waits in the background, bounded by the interval, and the pass goes on to the
    next peer at once (it waited up to 50 ms per such peer, so that a hundred of them held a pass for 5 s)."""
    async with managers("memory", 1, heartbeat_interval=0.5) as [(mgr, _)]:
        plane = mgr._ctx.control
        waited: list[float] = []

        async def waits_its_bound(endpoint: str, msg: Message, *, timeout: float, **kw: Any) -> None:
            waited.append(timeout)
            await asyncio.sleep(timeout)  # no room for it within its bound

        monkeypatch.setattr(plane, "try_send", lambda endpoint, msg, **kw: False)
        monkeypatch.setattr(plane, "send", waits_its_bound)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for port in range(20):
            await mgr._ping(f"tcp://127.0.0.1:{30000 + port}")
        assert loop.time() - t0 < 0.2, f"20 pings held the pass for {loop.time() - t0:.2f}s"
        await _until(lambda: len(waited) == 20, 5, lambda: f"{len(waited)} pings tried")
        assert waited == [0.5] * 20
