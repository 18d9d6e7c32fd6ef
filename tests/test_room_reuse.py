"""A room number names one request until its pages are released, on both sides.

A router that retries a request with the same ``kv_transfer_params`` opens the same room number again. While
the first room of that number still holds pages (open, awaiting its drain acknowledgement, quarantined, its
engine writes still pending, or failed on the prefill within its tombstone), what is keyed by the number (a
``Drained``, staging space granted to its pieces) could be taken for the second room: the first room's
release would then free space the second room's prefill still writes into. The second room is refused with
the state the first one is in; and staging grants belong to the room itself, so that releasing a room frees
only its own even if a number were reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import InvalidArgument, KVArgs, KVManager, KVPoll, TransferConfig, TransferFailed
from aiotransfer._control.messages import StageGrant, StageRequest, encode
from aiotransfer._kv.lifecycle import Lifecycle
from aiotransfer._kv.prefill import PrefillSide
from tests.peer import digest, make_buffers
from tests.zmqtools import push, wait_until

PAGES, ITEM = 64, 1024
STAGED: dict[str, Any] = {"staging": "always", "staging_bytes": 4 << 20}


@contextlib.asynccontextmanager
async def managers(engine: str, n: int, **cfg: Any) -> AsyncIterator[list[tuple[KVManager, list[np.ndarray]]]]:
    """``n`` managers in this process on a real engine, each with its own seeded pages (the first's zeroed)."""
    config = TransferConfig(engine=engine, **cfg)
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for i in range(n):
            bufs = make_buffers(2, PAGES, ITEM, seed=None if i == 0 else 40 + i)
            mgr = await stack.enter_async_context(KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), config))
            out.append((mgr, bufs))
        yield out


def no_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills in this process never hear a decode's abort: a failed decode room waits for its drain."""
    monkeypatch.setattr(PrefillSide, "on_abort", lambda self, msg: True)


async def awaiting_drain(dec: KVManager, pre: KVManager, room: int) -> Any:
    """Room ``room`` opened on both sides, then aborted by the decode: it waits for ``pre``'s drain."""
    tx = pre.sender(room)
    rx = dec.receiver(room, pre.endpoint)
    await rx.send_metadata([1, 2, 3], timeout=10)
    await tx.wait_ready(timeout=10)
    await rx.abort("client went away")
    assert rx.awaiting_drain == [pre.endpoint] and not rx.is_released()
    return rx


async def test_a_decode_room_number_is_refused_while_its_old_room_awaits_its_drain(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room 7 failed and waits for its prefill's drain; the router retries it with another prefill. The retry
    is refused with the state room 7 is in, and once room 7 is released (here by its quarantine) the number is
    free again: a staged transfer from the other prefill lands in it."""
    no_drain(monkeypatch)
    async with managers(engine, 3, release_quarantine_s=2.0, **STAGED) as [(dec, dst), (a, _), (b, src)]:
        old = await awaiting_drain(dec, a, 7)
        expected = (f"duplicate room 7: it ended (failed: aborted by decode: client went away) and is awaiting its "
                    f"drain acknowledgement from {a.endpoint}; a room number is unique until its pages are released: await "
                    "rx.released() of the ended room first, and give a retried request a new room number")
        with pytest.raises(InvalidArgument, match=re.escape(expected)):
            dec.receiver(7, b.endpoint)
        assert dec.stats()["rooms_refused_in_use"] == 1
        assert dec.stats()["receivers_active"] == 0

        await old.released(timeout=10)
        assert old.release_cause == "quarantine"
        tx = b.sender(7)
        rx = dec.receiver(7, b.endpoint)
        pages, theirs = list(range(8, 16)), list(range(30, 38))
        await rx.send_metadata(pages, timeout=10)
        await tx.wait_ready(timeout=10)
        await tx.send_kv(theirs, timeout=10)
        await rx.done(timeout=10)
        assert digest(dst, pages) == digest(src, theirs)
        assert dec.stats()["staged_pieces_received"] >= 1
        await wait_until(lambda: dec.stats()["staging_bytes_in_use"] == 0)


async def test_releasing_a_room_frees_only_its_own_staging_grants(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grants stand on their own: with the factory's refusal switched off, a second room 7 is opened while
    the first waits for its drain, and its prefill is granted staging space. When the first room's quarantine
    ends, that space stays granted to the second room, and room 8 is granted other space."""
    no_drain(monkeypatch)
    monkeypatch.setattr(Lifecycle, "holding", lambda self, room, *, prefill: None, raising=False)
    async with managers(engine, 3, release_quarantine_s=1.0, **STAGED) as [(dec, _), (a, _), (b, _)]:
        grants: list[Any] = []
        b._handlers[StageGrant] = grants.append  # what the decode answers b's (hand-made) requests
        old = await awaiting_drain(dec, a, 7)
        piece = 1 << 20
        for room in (7, 8):
            tx = b.sender(room)
            rx = dec.receiver(room, b.endpoint)
            await rx.send_metadata([room], timeout=10)
            await tx.wait_ready(timeout=10)
        await push(dec.endpoint, [encode(StageRequest(room=7, endpoint=b.endpoint, req_id=1, nbytes=piece))])
        await wait_until(lambda: len(grants) == 1)
        assert grants[0].granted
        await old.released(timeout=10)
        assert old.release_cause == "quarantine"
        assert dec.stats()["staging_bytes_in_use"] == piece, "the old room's release freed the new room's grant"
        await push(dec.endpoint, [encode(StageRequest(room=8, endpoint=b.endpoint, req_id=2, nbytes=piece))])
        await wait_until(lambda: len(grants) == 2)
        first, second = grants
        assert second.granted
        assert second.offset >= first.offset + piece or second.offset + piece <= first.offset, (
            "room 8 was granted the space room 7's prefill is still writing into")


async def test_a_prefill_room_number_is_refused_while_its_writes_drain_and_while_its_tombstone_lasts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the prefill: a room that failed with an engine write still in flight holds its number until the
    engine ends the write, then for ``tombstone_ttl``; both refusals name the state. A room whose decode aborted
    it before the prefill opened it is the same request, not a reuse: its sender opens and fails at once with
    the decode's reason. The memory engine, its completions given by the test, in this process."""
    from aiotransfer.testing import MemoryFabric

    fabric = MemoryFabric(auto_complete=False, engine_timeout_s=5.0, landing_grace_s=1.0)
    cfg = TransferConfig(engine="memory", staging="never", yield_after_notify=False, heartbeat_interval=1e5,
                         peer_timeout=1e5)
    src = make_buffers(2, 16, 4096, seed=1)
    dst = make_buffers(2, 16, 4096, None)
    async with (
        fabric,
        KVManager(KVArgs(src, page_size=16, dtype="uint8"), cfg) as pre,
        KVManager(KVArgs(dst, page_size=16, dtype="uint8"), cfg) as dec,
    ):
        fabric.label(dec.engine.session_id, "D", dec.args.kv)
        rx = dec.receiver(1, pre.endpoint)
        await rx.send_metadata([3], timeout=5)
        tx = pre.sender(1)
        await tx.wait_ready(timeout=5)
        send = asyncio.ensure_future(tx.send_kv([5], timeout=5))
        await wait_until(lambda: bool(fabric.pending()))
        (write,) = fabric.pending()
        await tx.abort("scheduler gave up")
        with pytest.raises(TransferFailed, match="scheduler gave up"):
            await send
        assert tx.engine_holds > 0 and not tx.is_released()
        why = "failed: aborted by prefill: scheduler gave up"
        with pytest.raises(InvalidArgument, match=re.escape(
                f"duplicate room 1: it ended ({why}) and engine operations or worker copies of its pages are still "
                "pending (1); a room number is unique until its pages are released: await tx.released() of the "
                "ended room first, and give a retried request a new room number")):
            pre.sender(1)
        fabric.complete(write)
        await tx.released(timeout=5)
        with pytest.raises(InvalidArgument, match=r"duplicate room 1: it failed here \d+s ago \(aborted by prefill: "
                                                  r"scheduler gave up\) and is remembered for tombstone_ttl \(600s\); "
                                                  "a room number is unique until its tombstone expires: give a "
                                                  "retried request a new room number$"):
            pre.sender(1)
        assert pre.stats()["rooms_refused_in_use"] == 2 and pre.stats()["senders_active"] == 0

        aborted = dec.receiver(2, pre.endpoint)
        await aborted.abort("client went away")  # before the prefill opened room 2
        await wait_until(lambda: pre.stats()["tombstones"] == 2)
        late = pre.sender(2)
        assert late.poll() is KVPoll.Failed and late.failure_reason == "aborted by decode: client went away"


def test_each_state_that_holds_a_decode_room_number_is_named() -> None:
    """The refusal says why the number is taken: a drain awaited, a quarantine (every awaited prefill rank is
    silent), or the decode's own copies into the room's pages."""
    from collections import Counter
    from types import SimpleNamespace

    dead = {"tcp://p:2"}
    ctx: Any = SimpleNamespace(counters=Counter(), config=TransferConfig(release_quarantine_s=63.0),
                               liveness=SimpleNamespace(is_dead=dead.__contains__))
    life = Lifecycle(ctx, None, lambda event: None)  # type: ignore[arg-type]

    def room(n: int, waiting: list[str], released: bool = False) -> Any:
        return SimpleNamespace(room=n, status=KVPoll.Failed, failure_reason="aborted by decode: gone",
                               awaiting_drain=waiting, is_released=lambda: released)

    for r in (room(1, ["tcp://p:1", "tcp://p:2"]), room(2, ["tcp://p:2"]), room(3, []), room(4, [], True)):
        life.ended(rx=r)
    assert life.holding(1, prefill=False) == (
        "it ended (failed: aborted by decode: gone) and is awaiting its drain acknowledgement from tcp://p:1, "
        "tcp://p:2; a room number is unique until its pages are released: await rx.released() of the ended room "
        "first, and give a retried request a new room number")
    assert life.holding(2, prefill=False) == (
        "it ended (failed: aborted by decode: gone) and is quarantined: its prefill ranks tcp://p:2 are silent, "
        "so only a proof that they are gone or the 63s quarantine releases its pages; a room number is unique "
        "until its pages are released: await rx.released() of the ended room first, and give a retried request "
        "a new room number")
    assert "its own copies into its pages are still running" in (life.holding(3, prefill=False) or "")
    assert life.holding(4, prefill=False) is None and life.holding(5, prefill=False) is None
    assert life.holding(1, prefill=True) is None  # the prefill side's rooms are others


@pytest.mark.parametrize("cause", ["peer-restarted", "peer-gone", "drained"])
async def test_a_settle_is_not_cut_short_when_its_prefill_is_proven_gone(
    cause: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill acknowledged the drain of a room whose write failed on an engine whose failed writes may still
    deliver what they had sent, and asked the decode to settle. Learning during the settle that the prefill's
    process is gone (restarted on its endpoint, or refusing connections) does not end it: the bytes already on
    their way are in the decode's own engine and land whether or not their sender lives."""
    no_drain(monkeypatch)
    async with managers("memory", 2) as [(dec, _), (pre, _)]:
        rx = await awaiting_drain(dec, pre, 7)
        settle = 0.6
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert rx.on_drained(pre.endpoint, settle=settle)
        assert rx.on_drained(pre.endpoint, cause)
        assert not rx.is_released() and rx.settling == [pre.endpoint]
        await rx.released(timeout=10)
        assert loop.time() - t0 >= settle * 0.95
        assert rx.release_cause == "drained"
