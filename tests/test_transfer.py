"""End-to-end transfers through a real engine, prefill in this process, decode in another OS process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from aiotransfer import (
    InvalidArgument,
    KVManager,
    KVPoll,
    KVSender,
    TransferFailed,
    TransferTimeout,
    _threads,
)
from tests.conftest import GEOMETRY, expected_digest, nixl_available
from tests.remote import RemoteError, RemotePeer

PAGES = GEOMETRY["pages"]


def scattered(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.permutation(PAGES)[:n]]


async def test_single_send_is_byte_exact(prefill: KVManager, decode: RemotePeer) -> None:
    rng = np.random.default_rng(1)
    dst, src = scattered(rng, 40), scattered(rng, 40)
    tx = prefill.sender(7)
    assert tx.poll() is KVPoll.Bootstrapping
    await decode.call("receiver", room=7, peer=prefill.endpoint, pages=dst)
    await tx.wait_ready(timeout=10)
    assert tx.poll() is KVPoll.WaitingForInput
    await tx.send_kv(src)
    await tx.done(timeout=10)
    assert (await decode.call("done", room=7))["status"] == "Success"
    got = (await decode.call("digest", pages=dst))["digest"]
    assert got == expected_digest(prefill.args.kv_buffers, src)
    assert tx.poll() is KVPoll.Success


@contextlib.asynccontextmanager
async def scattered_room(
    engine: str, decode: RemotePeer, room: int, n: int, staging: str, seed: int, **config: object
) -> AsyncIterator[tuple[KVManager, KVSender, list[np.ndarray], list[int], list[int]]]:
    """A prefill manager in this process with a 1 MiB staging arena (many pieces), and a room of ``n``
    scattered pages on each side, ready to send."""
    from aiotransfer import KVArgs, TransferConfig
    from tests.peer import make_buffers

    bufs = make_buffers(GEOMETRY["buffers"], PAGES, GEOMETRY["item_len"], seed=seed)
    cfg = TransferConfig(engine=engine, staging=staging, staging_bytes=1 << 20, **config)  # type: ignore[arg-type]
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), cfg) as mgr:
        rng = np.random.default_rng(seed)
        dst, src = scattered(rng, n), scattered(rng, n)
        tx = mgr.sender(room)
        await decode.call("receiver", room=room, peer=mgr.endpoint, pages=dst)
        await tx.wait_ready(timeout=10)
        yield mgr, tx, bufs, src, dst


@pytest.mark.parametrize("staging", ["never", "always"])
async def test_scattered_pages_direct_and_staged(engine: str, decode: RemotePeer, staging: str) -> None:
    async with scattered_room(engine, decode, 12, 200, staging, seed=77) as (mgr, tx, bufs, src, dst):
        await tx.send_kv(src[:77], last=False)
        await tx.send_kv(src[77:])
        await decode.call("done", room=12)
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
        stats = mgr.stats()
        if staging == "always":
            assert stats["staged_pieces"] >= 200 * 4 * GEOMETRY["item_len"] // ((1 << 20) // 4)
            assert stats["kv_entries_sent"] == stats["staged_pieces"]
        else:
            assert stats.get("staged_pieces", 0) == 0
            assert stats["kv_entries_sent"] >= 4 * 190  # one entry per page run per buffer


async def test_a_write_of_more_entries_than_the_peers_credit_is_byte_exact(engine: str, decode: RemotePeer) -> None:
    """Hundreds of entries against a credit of 96 a peer: on Mooncake the loop posts the write 64 entries a turn
    into one growing handle, which stops growing where the credit runs out and ends to give it back; the
    rest follows as further handles."""
    async with scattered_room(engine, decode, 13, 200, "never", seed=78, max_entries_in_flight=96) as (
        mgr, tx, bufs, src, dst,
    ):
        await asyncio.wait_for(tx.send_kv(src), 20)
        await decode.call("done", room=13)
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
        assert mgr.stats()["kv_entries_sent"] >= 4 * 190


async def test_polls_on_a_fine_timer_are_byte_exact(engine: str, decode: RemotePeer) -> None:
    """``fine_poll_timer``: chunks of scattered pages (a few dozen entries each, timed polls on a timerfd)."""
    async with scattered_room(engine, decode, 14, 120, "never", seed=79, fine_poll_timer=True) as (
        mgr, tx, bufs, src, dst,
    ):
        for lo in range(0, 120, 12):
            await asyncio.wait_for(tx.send_kv(src[lo:lo + 12], last=lo + 12 >= 120), 20)
        await decode.call("done", room=14)
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
        assert mgr.config.fine_poll_timer


async def test_chunked_send_fills_consecutive_slices(prefill: KVManager, decode: RemotePeer) -> None:
    rng = np.random.default_rng(2)
    dst, src = scattered(rng, 100), scattered(rng, 100)
    tx = prefill.sender(8)
    await decode.call("receiver", room=8, peer=prefill.endpoint, pages=dst)
    await tx.wait_ready(timeout=10)
    await tx.send_kv(src[:30], last=False)
    assert tx.pages_remaining == 70
    await tx.send_kv(src[30:31], last=False)
    await tx.send_kv(src[31:])
    await tx.done(timeout=10)
    await decode.call("done", room=8)
    got = (await decode.call("digest", pages=dst))["digest"]
    assert got == expected_digest(prefill.args.kv_buffers, src)


async def test_contiguous_runs_are_coalesced(prefill: KVManager, decode: RemotePeer) -> None:
    dst = list(range(100, 164))
    src = list(range(10, 74))
    tx = prefill.sender(9)
    await decode.call("receiver", room=9, peer=prefill.endpoint, pages=dst)
    await tx.wait_ready(timeout=10)
    before = prefill.stats().get("kv_entries_sent", 0)
    await tx.send_kv(src)
    assert prefill.stats()["kv_entries_sent"] - before == GEOMETRY["buffers"]  # one entry per buffer
    await decode.call("done", room=9)
    assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(
        prefill.args.kv_buffers, src
    )


async def test_concurrent_rooms(prefill: KVManager, decode: RemotePeer) -> None:
    rng = np.random.default_rng(3)
    perm_dst = rng.permutation(PAGES)
    perm_src = rng.permutation(PAGES)
    rooms = list(range(100, 108))
    plans = {
        room: ([int(x) for x in perm_dst[i * 30 : (i + 1) * 30]], [int(x) for x in perm_src[i * 30 : (i + 1) * 30]])
        for i, room in enumerate(rooms)
    }

    async def one(room: int) -> None:
        dst, src = plans[room]
        tx = prefill.sender(room)
        await decode.call("receiver", room=room, peer=prefill.endpoint, pages=dst)
        await tx.wait_ready(timeout=10)
        await tx.send_kv(src[:10], last=False)
        await tx.send_kv(src[10:])
        await decode.call("done", room=room)

    await asyncio.gather(*(one(r) for r in rooms))
    for room in rooms:
        dst, src = plans[room]
        got = (await decode.call("digest", pages=dst))["digest"]
        assert got == expected_digest(prefill.args.kv_buffers, src)
    assert prefill.stats()["senders_active"] == 0


async def test_metadata_before_sender_exists(prefill: KVManager, decode: RemotePeer) -> None:
    """Decode may speak first: the request is held until the prefill creates the room."""
    await decode.call("receiver", room=11, peer=prefill.endpoint, pages=[1, 2, 3])
    for _ in range(200):
        if prefill.stats()["pending_requests"]:
            break
        await asyncio.sleep(0.01)
    tx = prefill.sender(11)
    assert tx.poll() is KVPoll.WaitingForInput
    await tx.send_kv([4, 5, 6])
    await decode.call("done", room=11)


# -- bad input: a clear error before any byte moves ------------------------------------------------


async def _ready_room(prefill: KVManager, decode: RemotePeer, room: int, dst: list[int]):
    await decode.call("zero")
    tx = prefill.sender(room)
    await decode.call("receiver", room=room, peer=prefill.endpoint, pages=dst)
    await tx.wait_ready(timeout=10)
    return tx


async def test_index_out_of_range_moves_nothing(prefill: KVManager, decode: RemotePeer) -> None:
    dst = [0, 1, 2]
    tx = await _ready_room(prefill, decode, 20, dst)
    zero = (await decode.call("digest", pages=dst))["digest"]
    with pytest.raises(InvalidArgument, match="out of range"):
        await tx.send_kv([0, 1, PAGES])
    with pytest.raises(InvalidArgument, match="negative"):
        await tx.send_kv([0, -1, 2])
    assert (await decode.call("digest", pages=dst))["digest"] == zero
    assert tx.poll() is KVPoll.WaitingForInput  # the room is intact: a valid send still works
    await tx.send_kv([5, 6, 7])
    await decode.call("done", room=20)


async def test_chunk_length_mismatch(prefill: KVManager, decode: RemotePeer) -> None:
    tx = await _ready_room(prefill, decode, 21, [0, 1, 2, 3])
    with pytest.raises(InvalidArgument, match="last chunk has 3 pages but 4"):
        await tx.send_kv([0, 1, 2])
    with pytest.raises(InvalidArgument, match="only 4 destination pages remain"):
        await tx.send_kv([0, 1, 2, 3, 4], last=False)
    await tx.send_kv([0, 1], last=False)
    with pytest.raises(InvalidArgument, match="only 2 destination pages remain"):
        await tx.send_kv([0, 1, 2], last=False)
    await tx.send_kv([2, 3])
    with pytest.raises(InvalidArgument, match="last chunk was already sent"):
        await tx.send_kv([])
    await decode.call("done", room=21)


async def test_unknown_and_duplicate_rooms(prefill: KVManager, decode: RemotePeer) -> None:
    prefill.sender(30)
    with pytest.raises(InvalidArgument, match="duplicate room 30"):
        prefill.sender(30)
    with pytest.raises(InvalidArgument, match="room must be an integer"):
        prefill.sender(-1)
    with pytest.raises(InvalidArgument, match="room must be an integer"):
        prefill.sender("x")  # type: ignore[arg-type]
    tx = prefill.sender(31)
    with pytest.raises(InvalidArgument, match="not ready"):
        await tx.send_kv([1])
    # a status for a room the decode never opened is dropped and counted, not applied
    with pytest.raises(RemoteError, match="duplicate room"):
        await decode.call("receiver", room=32, peer=prefill.endpoint, pages=[1])
        await decode.call("receiver", room=32, peer=prefill.endpoint, pages=[2])


async def test_decode_side_validation(prefill: KVManager, decode: RemotePeer) -> None:
    with pytest.raises(RemoteError, match="out of range"):
        await decode.call("receiver", room=40, peer=prefill.endpoint, pages=[PAGES + 5])
    with pytest.raises(RemoteError, match="must not repeat"):
        await decode.call("receiver", room=41, peer=prefill.endpoint, pages=[3, 3])
    with pytest.raises(RemoteError, match="aux_index given but this manager has no aux buffers"):
        await decode.call("receiver", room=42, peer=prefill.endpoint, pages=[3], aux_index=0)


async def test_wrong_peer_is_a_bounded_clear_error(decode: RemotePeer) -> None:
    import socket
    import time

    with socket.socket() as s:  # bound, not listening: the port refuses, so the call fails at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="refuses connections") as info:
            await decode.call("receiver", room=50, peer=f"127.0.0.1:{port}", pages=[1], timeout=5.0)
        assert time.monotonic() - t0 < 3.0
    assert info.value.error == "PeerError"
    with socket.socket() as s:  # listening, but nothing aiotransfer behind it: the budget runs out
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RemoteError, match="no registration answer") as info:
            await decode.call("receiver", room=52, peer=f"127.0.0.1:{port}", pages=[1], timeout=1.0)
    assert info.value.error == "PeerError"
    with pytest.raises(RemoteError, match="must be 'host:port'"):
        await decode.call("receiver", room=51, peer="nonsense", pages=[1])


# -- status rules through the real stack --------------------------------------------------------


async def test_decode_abort_fails_both_sides(prefill: KVManager, decode: RemotePeer) -> None:
    tx = prefill.sender(60)
    await decode.call("receiver", room=60, peer=prefill.endpoint, pages=[1, 2])
    await tx.wait_ready(timeout=10)
    await decode.call("abort", room=60, reason="client went away")
    with pytest.raises(TransferFailed, match="aborted by decode: client went away"):
        await tx.done(timeout=5)
    assert tx.poll() is KVPoll.Failed
    with pytest.raises(TransferFailed):
        await tx.send_kv([1, 2])
    assert (await decode.call("poll", room=60))["status"] == "Failed"


async def test_prefill_abort_reaches_decode_with_reason(prefill: KVManager, decode: RemotePeer) -> None:
    tx = prefill.sender(61)
    await decode.call("receiver", room=61, peer=prefill.endpoint, pages=[1, 2])
    await tx.wait_ready(timeout=10)
    await tx.abort("prefill evicted the request")
    with pytest.raises(RemoteError, match="prefill evicted the request") as info:
        await decode.call("done", room=61, timeout=5)
    assert info.value.error == "TransferFailed"
    assert tx.poll() is KVPoll.Failed


async def test_wait_ready_timeout_fails_the_room(prefill: KVManager) -> None:
    tx = prefill.sender(62)
    with pytest.raises(TransferTimeout):
        await tx.wait_ready(timeout=0.2)
    assert tx.poll() is KVPoll.Failed
    assert "did not arrive" in (tx.failure_reason or "")
    # the number stays taken while the room's tombstone lasts (a late request for it is refused): a second
    # sender for it is refused with that state, not opened already failed
    with pytest.raises(InvalidArgument, match=r"duplicate room 62: it failed here .*did not arrive.* tombstone_ttl"):
        prefill.sender(62)


async def test_done_timeout_aborts_prefill(prefill: KVManager, decode: RemotePeer) -> None:
    tx = prefill.sender(63)
    await decode.call("receiver", room=63, peer=prefill.endpoint, pages=[1])
    await tx.wait_ready(timeout=10)
    with pytest.raises(RemoteError) as info:
        await decode.call("done", room=63, timeout=0.3)
    assert info.value.error == "TransferTimeout"
    with pytest.raises(TransferFailed, match="decode gave up"):
        await tx.done(timeout=5)


async def test_poll_latches_first_terminal_status(prefill: KVManager, decode: RemotePeer) -> None:
    tx = prefill.sender(64)
    seen = [tx.poll()]
    await decode.call("receiver", room=64, peer=prefill.endpoint, pages=[1])
    await tx.wait_ready(timeout=10)
    seen.append(tx.poll())
    await tx.send_kv([2])
    seen.append(tx.poll())
    await tx.abort("too late")  # a terminal room ignores later failures
    seen.append(tx.poll())
    assert seen == [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Success, KVPoll.Success]
    await decode.call("done", room=64)


async def test_reverse_direction_remote_prefill_local_decode(engine: str) -> None:
    """The other pairing: KVSender in the child process, KVReceiver here."""
    from aiotransfer import KVArgs, TransferConfig
    from tests.peer import make_buffers

    peer = await RemotePeer.start(engine, seed=99, **GEOMETRY)
    try:
        dst = make_buffers(GEOMETRY["buffers"], PAGES, GEOMETRY["item_len"], None)
        async with KVManager(KVArgs(dst, page_size=16, dtype="uint8"), TransferConfig(engine=engine)) as dec:
            rng = np.random.default_rng(11)
            d_pages, s_pages = scattered(rng, 50), scattered(rng, 50)
            await peer.call("sender", room=70)
            rx = dec.receiver(70, peer.endpoint)
            await rx.send_metadata(d_pages)
            assert rx.poll() is KVPoll.WaitingForInput
            await peer.call("wait_ready", room=70)
            await peer.call("send_kv", room=70, pages=s_pages[:25], last=False)
            await peer.call("send_kv", room=70, pages=s_pages[25:])
            await rx.done(timeout=10)
            assert rx.poll() is KVPoll.Success
            expected = (await peer.call("digest", pages=s_pages))["digest"]
            assert expected_digest(dst, d_pages) == expected
    finally:
        await peer.close()


async def test_back_to_back_buffers_merge_across_layers(engine: str) -> None:
    """Per-layer views of one tensor: entries merge across buffers, so regions must be registered merged."""
    from aiotransfer import KVArgs, TransferConfig

    src = np.random.default_rng(3).integers(0, 255, size=(4, 8, 4096), dtype=np.uint8)
    dst = np.zeros_like(src)
    cfg = TransferConfig(engine=engine, staging="never")
    async with KVManager(KVArgs(list(src), page_size=16, dtype="uint8"), cfg) as p, KVManager(
        KVArgs(list(dst), page_size=16, dtype="uint8"), cfg
    ) as d:
        tx = p.sender(1)
        rx = d.receiver(1, p.endpoint)
        await rx.send_metadata([0, 7])
        await tx.wait_ready(timeout=10)
        await tx.send_kv([0, 7])  # page 7 of layer l and page 0 of layer l+1 are adjacent on both sides
        await rx.done(timeout=10)
        assert p.stats()["kv_entries_sent"] == 5  # 4 layers x 2 pages, joined at 3 layer boundaries
        assert (dst[:, [0, 7]] == src[:, [0, 7]]).all()


@pytest.mark.parametrize("yield_after_notify", [True, False])
async def test_success_leaves_at_completion_and_yields_only_when_idle(
    engine: str, decode: RemotePeer, monkeypatch: pytest.MonkeyPatch, yield_after_notify: bool
) -> None:
    """A one-chunk room with nothing else owed concludes from the engine completion itself; with nothing else
    in flight the loop then yields its CPU to ZMQ's I/O thread once, unless configured off or the engine
    has busy threads."""
    from aiotransfer import KVArgs, TransferConfig
    from aiotransfer._control import endpoint
    from tests.peer import make_buffers

    yields: list[int] = []
    monkeypatch.setattr(endpoint, "_sched_yield", lambda: yields.append(1))
    bufs = make_buffers(GEOMETRY["buffers"], PAGES, GEOMETRY["item_len"], seed=5)
    cfg = TransferConfig(engine=engine, yield_after_notify=yield_after_notify)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), cfg) as mgr:
        await decode.call("receiver", room=31, peer=mgr.endpoint, pages=[3])
        tx = mgr.sender(31)
        await tx.wait_ready(timeout=10)
        await tx.send_kv([9])
        assert tx.poll() is KVPoll.Success
        assert (await decode.call("done", room=31))["status"] == "Success"
        assert (await decode.call("digest", pages=[3]))["digest"] == expected_digest(bufs, [9])
        assert mgr.stats()["success_at_completion"] == 1
        quiet = mgr.engine.traits.quiet_threads  # Mooncake yes; NIXL's UCX threads poll
        assert yields == ([1] if yield_after_notify and quiet else [])
        # A multi-entry last chunk (one engine batch) concludes the same way.
        await decode.call("receiver", room=32, peer=mgr.endpoint, pages=list(range(64, 128)))
        tx = mgr.sender(32)
        await tx.wait_ready(timeout=10)
        await tx.send_kv(list(range(64)))
        assert (await decode.call("done", room=32))["status"] == "Success"
        assert (await decode.call("digest", pages=list(range(64, 128))))["digest"] == expected_digest(bufs, list(range(64)))
        assert mgr.stats()["success_at_completion"] == 2


@pytest.mark.skipif(not _threads.supported(), reason="SCHED_IDLE per thread is Linux-only")
@pytest.mark.parametrize("mode", ["background", "normal"])
async def test_engine_threads_background_idles_only_the_engines_native_threads(engine: str, mode: str) -> None:
    """``engine_threads="background"``: the engine's native threads run under SCHED_IDLE on both sides,
    while the event loop, every Python thread and ZMQ's threads keep the normal policy; bytes still land.
    Both sides run in processes of their own: the setting holds for the process (its native engine).
    NIXL's threads busy-poll holding UCX's lock: there the setting is declined and every thread stays normal."""
    env = {"AIOTRANSFER_ENGINE_THREADS": mode}
    takes = mode == "background" and engine != "nixl"
    prefill = await RemotePeer.start(engine, env=env, **GEOMETRY)
    decode = await RemotePeer.start(engine, env=env, **GEOMETRY)
    try:
        await decode.call("zero")
        await decode.call("receiver", room=41, peer=prefill.endpoint, pages=[7, 8, 30])
        await prefill.call("sender", room=41)
        await prefill.call("wait_ready", room=41)
        await prefill.call("send_kv", room=41, pages=[1, 2, 40])
        await decode.call("done", room=41)
        want = (await prefill.call("digest", pages=[1, 2, 40]))["digest"]
        assert (await decode.call("digest", pages=[7, 8, 30]))["digest"] == want
        for side, peer in (("prefill", prefill), ("decode", decode)):
            for _ in range(50):  # threads move once two sweeps have seen them: 0.2 s after start, then 1 s
                threads = (await peer.call("thread_policies"))["threads"]
                idle = [t for t in threads if t["idle"]]
                if idle or not takes:
                    break
                await asyncio.sleep(0.1)
            for t in idle:
                assert not (t["python"] or t["main"] or t["name"].startswith("ZMQbg")), (side, t)
            effective = (await peer.call("info"))["describe"]["engine_threads"]
            assert effective == ("background" if takes else "normal"), (side, effective)
            if takes:
                assert idle, f"{side}: no engine thread runs in the background: {threads}"
                # threads the engine starts from an idle thread inherit the policy without being counted
                assert 1 <= (await peer.call("stats"))["stats"]["engine_threads_background"] <= len(idle)
            else:
                assert not idle, (side, idle)
    finally:
        await prefill.close()
        await decode.close()


@pytest.mark.skipif(not nixl_available(), reason="nixl not installed")
async def test_nixl_with_a_sleeping_progress_thread_moves_bytes_between_processes() -> None:
    """``nixl_progress_delay_us``: the UCX progress thread sleeps between polls on both sides; connection
    set-up and writes still complete, byte for byte."""
    env = {"AIOTRANSFER_NIXL_PROGRESS_DELAY_US": "1000"}
    prefill = await RemotePeer.start("nixl", env=env, **GEOMETRY)
    decode = await RemotePeer.start("nixl", env=env, **GEOMETRY)
    try:
        for side in (prefill, decode):
            assert (await side.call("info"))["describe"]["progress_delay_us"] == "1000"
        await decode.call("zero")
        for room, src, dst in ((51, [3, 9, 10, 11], [100, 5, 6, 7]), (52, list(range(64)), list(range(64, 128)))):
            await decode.call("receiver", room=room, peer=prefill.endpoint, pages=dst)
            await prefill.call("sender", room=room)
            await prefill.call("wait_ready", room=room)
            await prefill.call("send_kv", room=room, pages=src)
            assert (await decode.call("done", room=room))["status"] == "Success"
            want = (await prefill.call("digest", pages=src))["digest"]
            assert (await decode.call("digest", pages=dst))["digest"] == want
    finally:
        await prefill.close()
        await decode.close()


async def test_staged_piece_failing_before_its_write_hands_the_decode_space_back(
    engine: str, decode: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged piece asks the decode for space while it gathers; when the gather fails nothing is written
    there, so the space goes back (an empty piece) instead of staying held on the decode forever."""
    from aiotransfer import _staging as staging_module

    def broken_gather(*args: object) -> None:
        raise RuntimeError("gather broke")

    monkeypatch.setattr(staging_module, "gather_pages", broken_gather)
    async with scattered_room(engine, decode, 13, 100, "always", seed=78) as (mgr, tx, _, src, _):
        with pytest.raises(TransferFailed, match="gather broke"):
            await tx.send_kv(src)
        stats: dict[str, object] = {}
        outcomes = ("staging_space_returned", "staging_space_reclaimed", "staging_refused_ended")
        for _ in range(100):
            stats = (await decode.call("stats"))["stats"]
            if any(stats.get(k) for k in outcomes) and stats["staging_bytes_in_use"] == 0:
                break
            await asyncio.sleep(0.05)
        # each piece that had asked before the failure stopped the others: its space handed back by the
        # prefill (an empty piece), or reclaimed by the decode once the failed room drained, or never granted
        # (the request came after the decode had heard of the failure, and was refused)
        assert sum(int(stats.get(k, 0)) for k in outcomes) >= 1, stats  # type: ignore[call-overload]
        assert stats["staging_bytes_in_use"] == 0, stats
        await tx.released(timeout=10)  # the failed gather's thread has returned: its slice is free too
        assert mgr.stats()["staging_bytes_in_use"] == 0


async def test_staged_piece_the_decode_cannot_scatter_fails_with_its_reason(engine: str, decode: RemotePeer) -> None:
    """An unexpected error while the decode scatters a piece comes back in the ack: the prefill fails the
    transfer at once, with the decode's reason, instead of waiting for an ack until its deadline."""
    await decode.call("break_scatter")
    async with scattered_room(engine, decode, 14, 50, "always", seed=79) as (_, tx, _, src, _):
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TransferFailed, match="scatter broke"):
            await tx.send_kv(src, timeout=30)
        assert asyncio.get_running_loop().time() - t0 < 10
