"""Layer streaming (``KVSender.stream`` / ``KVStream.send_layers``) through a real engine: prefill in this
process, decode in another OS process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from aiotransfer import (
    InvalidArgument,
    KVArgs,
    KVManager,
    KVPoll,
    KVSender,
    TransferConfig,
    TransferFailed,
    TransferTimeout,
)
from tests.conftest import GEOMETRY, expected_digest
from tests.peer import make_buffers
from tests.remote import RemoteError, RemotePeer

PAGES = GEOMETRY["pages"]
LAYER_IDS = [0, 1, 0, 1]  # K of layers 0 and 1, then V of layers 0 and 1


@contextlib.asynccontextmanager
async def streamed_room(engine: str, decode: RemotePeer, room: int, n: int, *, staging: str = "never",
                        seed: int = 5) -> AsyncIterator[tuple[KVManager, KVSender, list[np.ndarray], list[int], list[int]]]:
    bufs = make_buffers(GEOMETRY["buffers"], PAGES, GEOMETRY["item_len"], seed=seed)
    cfg = TransferConfig(engine=engine, staging=staging, staging_bytes=1 << 20, handshake_timeout=10.0)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8", kv_layer_ids=LAYER_IDS), cfg) as mgr:
        rng = np.random.default_rng(seed)
        dst = [int(x) for x in rng.permutation(PAGES)[:n]]
        src = [int(x) for x in rng.permutation(PAGES)[:n]]
        tx = mgr.sender(room)
        await decode.call("receiver", room=room, peer=mgr.endpoint, pages=dst)
        await tx.wait_ready(timeout=10)
        yield mgr, tx, bufs, src, dst


@pytest.mark.parametrize("staging", ["never", "always"])
async def test_a_room_streamed_layer_by_layer_in_chunks_is_byte_exact(engine: str, decode: RemotePeer,
                                                                      staging: str) -> None:
    async with streamed_room(engine, decode, 1, 120, staging=staging) as (mgr, tx, bufs, src, dst):
        first = tx.stream(src[:50], last=False)
        assert first.layers == (0, 1) and first.pages == 50
        await first.send_layers(1)  # any order
        entries = mgr.stats().get("kv_entries_sent", 0)
        if staging == "never":
            assert entries > 0, "a direct layer moves as soon as it is sent"
        else:
            assert entries == 0, "a staged chunk moves whole, with its last layer"
        assert first.layers_left == (0,) and not first.complete
        await first.send_layers(0)
        assert first.complete
        await tx.send_kv(src[50:80], last=False)  # a whole chunk between streamed ones
        last = tx.stream(src[80:])
        await last.send_layers(0)
        assert (await decode.call("poll", room=1))["status"] != "Success"
        await last.send_layers([1])
        await tx.done(timeout=10)
        assert (await decode.call("done", room=1))["status"] == "Success"
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
        assert tx.bytes_sent == 120 * GEOMETRY["buffers"] * GEOMETRY["item_len"]


async def test_layers_sent_concurrently_conclude_only_after_all_of_them_landed(engine: str,
                                                                                decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 7, 200, seed=9) as (_mgr, tx, bufs, src, dst):
        for chunk, last in ((src[:100], False), (src[100:], True)):
            stream = tx.stream(chunk, last=last)
            # as a forward pass would: one task per layer, not awaited before the next layer computes
            await asyncio.gather(*(stream.send_layers(layer) for layer in (1, 0)))
        await tx.done(timeout=10)
        assert (await decode.call("done", room=7))["status"] == "Success"
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)


async def test_layers_that_queue_up_are_posted_as_one_write(engine: str, decode: RemotePeer) -> None:
    """Layers sent in the same loop iteration (hooks that queued up) go out as one engine write; a layer
    sent alone gets a write of its own."""
    async with streamed_room(engine, decode, 8, 60, seed=4) as (mgr, tx, bufs, src, dst):
        first = tx.stream(src[:30], last=False)
        await asyncio.gather(*(first.send_layers(layer) for layer in (0, 1)))
        stats = mgr.stats()
        assert (stats["layer_writes"], stats["layer_calls_batched"]) == (1, 1)
        last = tx.stream(src[30:])
        await last.send_layers(0)
        await last.send_layers(1)
        stats = mgr.stats()
        assert (stats["layer_writes"], stats["layer_calls_batched"]) == (3, 1)
        await tx.done(timeout=10)
        assert (await decode.call("done", room=8))["status"] == "Success"
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)


async def test_a_room_failed_before_its_layers_are_posted_posts_nothing(engine: str, decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 9, 20, seed=6) as (mgr, tx, bufs, src, dst):
        stream = tx.stream(src)
        call = asyncio.ensure_future(stream.send_layers(0))
        await asyncio.sleep(0)  # the call has queued its layer; the write is posted on the next iteration
        await tx.abort("scheduler gave up")  # fails the room before that
        with pytest.raises(TransferFailed, match="scheduler gave up"):
            await call
        await tx.released(timeout=10)
        await asyncio.sleep(0.2)
        assert mgr.stats().get("layer_writes", 0) == 0, "a write was posted for a failed room"
        zeros = [np.zeros_like(b) for b in bufs]
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(zeros, dst)


async def test_a_large_layer_plan_is_computed_off_the_loop(engine: str, decode: RemotePeer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the planning threshold a layer's entries are planned on the offload thread, as a chunk's are."""
    from aiotransfer._kv import push

    monkeypatch.setattr(push, "_PLAN_OFFLOAD_ENTRIES", 4)
    threads: list[str] = []
    real = push.Pusher._blocks

    def recording(self: push.Pusher, *args: object, **kw: object) -> object:
        threads.append(threading.current_thread().name)
        return real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(push.Pusher, "_blocks", recording)
    async with streamed_room(engine, decode, 10, 40, seed=8) as (_mgr, tx, bufs, src, dst):
        stream = tx.stream(src)
        for layer in (0, 1):
            await stream.send_layers(layer, timeout=10)
        await tx.done(timeout=10)
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
    assert len(threads) == 2 and threading.main_thread().name not in threads, threads


async def test_bad_stream_calls_are_refused_before_any_byte_moves(engine: str, decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 2, 40) as (mgr, tx, bufs, src, dst):
        stream = tx.stream(src[:20], last=False)
        bad_calls: list[tuple[int | list[int], str]] = [
            (7, "unknown layers"), ([0, 0], "must not repeat"), ([], "at least one layer")]
        for bad, why in bad_calls:
            with pytest.raises(InvalidArgument, match=why):
                await stream.send_layers(bad)
        assert mgr.stats().get("kv_entries_sent", 0) == 0
        await stream.send_layers(0)
        with pytest.raises(InvalidArgument, match="already sent"):
            await stream.send_layers([1, 0])
        with pytest.raises(InvalidArgument, match="destination pages remain"):
            tx.stream(src[20:30])  # a last chunk that does not complete the room
        await stream.send_layers(1)
        await tx.send_kv(src[20:])
        await tx.done(timeout=10)
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)


async def test_streaming_needs_to_know_each_buffers_layer(engine: str, decode: RemotePeer) -> None:
    bufs = make_buffers(GEOMETRY["buffers"], PAGES, GEOMETRY["item_len"], seed=3)
    assert KVArgs(bufs, num_layers=2).buffer_layers() == [0, 1, 0, 1]
    assert KVArgs(bufs, num_layers=4).buffer_layers() == [0, 1, 2, 3]
    assert KVArgs(bufs, num_layers=3).buffer_layers() is None
    cfg = TransferConfig(engine=engine, handshake_timeout=10.0)
    async with KVManager(KVArgs(bufs, page_size=16, dtype="uint8"), cfg) as mgr:
        tx = mgr.sender(3)
        await decode.call("receiver", room=3, peer=mgr.endpoint, pages=[1, 2])
        await tx.wait_ready(timeout=10)
        with pytest.raises(InvalidArgument, match="needs kv_layer_ids or num_layers"):
            tx.stream([1, 2])
        await tx.send_kv([1, 2])
        await tx.done(timeout=10)


async def test_a_decode_abort_mid_stream_fails_the_room_on_both_sides(engine: str, decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 4, 60) as (_mgr, tx, _bufs, src, _dst):
        stream = tx.stream(src)
        await stream.send_layers(0)
        await decode.call("abort", room=4, reason="client went away")
        with pytest.raises(TransferFailed, match="client went away"):
            await tx.done(timeout=10)
        with pytest.raises(TransferFailed, match="client went away"):
            await stream.send_layers(1)
        await tx.released(timeout=10)


async def test_a_prefill_abort_mid_stream_reaches_the_decode_with_its_reason(engine: str, decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 5, 60) as (_mgr, tx, _bufs, src, _dst):
        stream = tx.stream(src)
        await stream.send_layers(1)
        await tx.abort("layer 0 failed to compute")
        assert tx.poll() is KVPoll.Failed
        with pytest.raises(RemoteError, match="layer 0 failed to compute"):
            await decode.call("done", room=5, timeout=10)
        assert "layer 0 failed to compute" in (await decode.call("reason", room=5))["reason"]
        with pytest.raises(TransferFailed):
            await stream.send_layers(0)


async def test_a_stream_left_incomplete_fails_the_last_chunk_within_its_timeout(engine: str,
                                                                              decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 6, 40) as (_mgr, tx, _bufs, src, _dst):
        stream = tx.stream(src[:20], last=False)
        await stream.send_layers(0)  # layer 1 never comes
        with pytest.raises(TransferTimeout, match="earlier chunks did not finish"):
            await tx.send_kv(src[20:], timeout=0.5)
        assert tx.poll() is KVPoll.Failed


def test_streaming_bench_quick_runs_and_reports_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "streaming.json"
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "streaming", "--quick",
                           "--engines", "mooncake_tcp", "--out", str(out)], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    size = result["sizes"]["1024"]
    assert size["bytes"] == 128 << 20
    assert size["exposed_after_compute_ms"] > 0 and size["exposed_streamed_ms"] > 0
    assert "exposed transfer after compute" in proc.stdout
    assert set(result["call_cpu_us"]) == {"queued", "alone"} and min(result["call_cpu_us"].values()) > 0


class LateWrite:
    """Device work as the host sees it: kernels queued before ``send_layers`` that write a layer's pages a
    little later. A thread writes ``value`` into ``pages`` of ``buffers`` after ``delay`` seconds;
    ``query()`` says whether it is done, as a ``torch.cuda.Event`` does."""

    def __init__(self, bufs: list[np.ndarray], buffers: list[int], pages: list[int], value: int, delay: float) -> None:
        self.queries = 0
        self._done = threading.Event()

        def write() -> None:
            self._done.wait(delay)  # never set before: a bounded sleep off the loop
            for b in buffers:
                bufs[b][pages] = value
            self._done.set()

        self._thread = threading.Thread(target=write, daemon=True)
        self._thread.start()

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def join(self) -> None:
        self._thread.join(5)


@pytest.mark.parametrize("with_ready", [True, False], ids=["ready", "negative-control"])
async def test_a_layer_sent_with_its_ready_event_moves_only_once_the_work_that_writes_it_is_done(
    engine: str, decode: RemotePeer, with_ready: bool
) -> None:
    """Layer 0's pages are written 0.3 s after ``send_layers(0)`` is called. With ``ready=`` the new bytes
    arrive; without it (the negative control) the engine reads the pages before they are written."""
    async with streamed_room(engine, decode, 11, 40, seed=12) as (_mgr, tx, bufs, src, dst):
        before = [b.copy() for b in bufs]
        stream = tx.stream(src)
        work = LateWrite(bufs, [i for i, layer in enumerate(LAYER_IDS) if layer == 0], src, 0x5A, 0.3)
        await stream.send_layers(0, ready=work if with_ready else None)
        work.join()
        await stream.send_layers(1)
        await tx.done(timeout=10)
        assert (await decode.call("done", room=11))["status"] == "Success"
        got = (await decode.call("digest", pages=dst))["digest"]
        assert got == expected_digest(bufs if with_ready else before, src)
        assert work.queries > 1 if with_ready else work.queries == 0


async def test_a_ready_event_that_never_fires_fails_the_room_within_the_timeout(engine: str,
                                                                               decode: RemotePeer) -> None:
    class Never:
        def query(self) -> bool:
            return False

    async with streamed_room(engine, decode, 12, 20) as (mgr, tx, _bufs, src, _dst):
        stream = tx.stream(src)
        with pytest.raises(TransferTimeout, match=r"layers \[0\].*device work"):
            await stream.send_layers(0, ready=Never(), timeout=0.3)
        assert tx.poll() is KVPoll.Failed
        with pytest.raises(RemoteError, match="device work"):
            await decode.call("done", room=12, timeout=10)
        await tx.released(timeout=10)
        assert mgr.stats().get("layer_writes", 0) == 0


async def test_a_ready_without_query_is_refused_before_any_byte_moves(engine: str, decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 13, 20) as (_mgr, tx, bufs, src, dst):
        stream = tx.stream(src)
        with pytest.raises(InvalidArgument, match=r"query\(\) method"):
            await stream.send_layers(0, ready=object())  # type: ignore[arg-type]
        assert stream.layers_left == (0, 1)  # nothing was taken: the layer can still be sent
        await stream.send_layers([0, 1])
        await tx.done(timeout=10)
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)


async def test_a_chunk_that_moves_whole_waits_for_the_device_work_of_every_layer(engine: str,
                                                                                 decode: RemotePeer) -> None:
    """A staged chunk moves whole with the call that sends its last layer. That call has no work of its own
    to wait for, but layer 0's, handed over by a call still waiting, is not done: the chunk waits for it."""
    async with streamed_room(engine, decode, 14, 40, staging="always", seed=13) as (mgr, tx, bufs, src, dst):
        stream = tx.stream(src)
        work = LateWrite(bufs, [i for i, layer in enumerate(LAYER_IDS) if layer == 0], src, 0x3C, 0.3)
        first = asyncio.ensure_future(stream.send_layers(0, ready=work))
        await asyncio.sleep(0.01)  # the first call is waiting for its work
        await stream.send_layers(1)  # completes the chunk: it moves whole
        await first
        work.join()
        await tx.done(timeout=10)
        assert mgr.stats()["staged_pieces"] > 0
        assert (await decode.call("done", room=14))["status"] == "Success"
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)


async def test_an_abort_while_a_layer_waits_for_its_work_ends_the_wait_and_posts_nothing(engine: str,
                                                                                         decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 15, 20, seed=14) as (mgr, tx, _bufs, src, _dst):
        stream = tx.stream(src)
        work = LateWrite([np.zeros((PAGES, 8), np.uint8)], [0], [0], 1, 5.0)  # done only in 5 s
        call = asyncio.ensure_future(stream.send_layers(0, ready=work))
        await asyncio.sleep(0.05)
        await tx.abort("the forward pass failed")
        with pytest.raises(TransferFailed, match="the forward pass failed"):
            await asyncio.wait_for(call, 2)  # ends at once, not when the work is done
        await tx.released(timeout=10)
        assert mgr.stats().get("layer_writes", 0) == 0


@pytest.mark.parametrize("with_ready", [True, False], ids=["ready", "negative-control"])
async def test_send_kv_with_its_ready_event_moves_only_once_the_work_that_writes_the_pages_is_done(
    engine: str, decode: RemotePeer, with_ready: bool
) -> None:
    """``send_kv`` takes ``ready=`` too: the whole forward pass's work, for a chunk sent after it."""
    async with streamed_room(engine, decode, 16, 40, seed=15) as (_mgr, tx, bufs, src, dst):
        before = [b.copy() for b in bufs]
        work = LateWrite(bufs, list(range(len(bufs))), src, 0x77, 0.3)
        await tx.send_kv(src, ready=work if with_ready else None, timeout=10)
        work.join()
        await tx.done(timeout=10)
        assert (await decode.call("done", room=16))["status"] == "Success"
        got = (await decode.call("digest", pages=dst))["digest"]
        assert got == expected_digest(bufs if with_ready else before, src)


async def test_send_kv_refuses_a_ready_without_query_before_taking_its_pages(engine: str,
                                                                             decode: RemotePeer) -> None:
    async with streamed_room(engine, decode, 17, 20) as (_mgr, tx, bufs, src, dst):
        with pytest.raises(InvalidArgument, match=r"query\(\) method"):
            await tx.send_kv(src, ready=42)  # type: ignore[arg-type]
        await tx.send_kv(src)  # the pages were not taken: the same chunk goes now
        await tx.done(timeout=10)
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs, src)
