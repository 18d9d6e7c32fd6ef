"""Chunked prefill through the vLLM connector: once the decode has asked, each chunk's complete blocks go in
the step that computes them, and a request vLLM preempts between two chunks gets its blocks back only once
no write reads them.

The scheduler's half runs on duck-typed requests; the worker's over a real engine across two OS processes
(a decode worker in tests/vllm_worker_peer.py), driven as vLLM's model runner drives it. A chunk's writes are
held back by a stand-in for a device event (:class:`Gate`, what ``ready=`` waits for on a GPU), so a
preemption meets them in flight on every run; the negative control overwrites the blocks without
``handle_preemptions`` and the decode receives what vLLM wrote there next.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from aiotransfer.integrations.vllm import _worker
from aiotransfer.integrations.vllm._config import ConnectorConfig, room_of
from aiotransfer.integrations.vllm._scheduler import Orders, SchedulerSide, SendJob
from aiotransfer.integrations.vllm._worker import WorkerSide
from tests.conftest import ENGINES
from tests.peer import digest
from tests.test_vllm_layers import asked
from tests.test_vllm_sides import FakeRequest, wait_sent, workers

BLOCK = 16
SRC = (50, 51, 52, 53)
"""The prompt's four blocks as vLLM first computes them (64 tokens of 16)."""
NEW = (70, 71, 72, 73)
"""Where vLLM computes the prompt again after preempting it."""
DST = [60, 61, 62, 63]


# -- the scheduler ---------------------------------------------------------------------------------
def chunking_scheduler(blocks: dict[str, list[int]], **extra: Any) -> SchedulerSide:
    side = SchedulerSide(ConnectorConfig(**extra), lambda req_id: (blocks[req_id],), block_size=BLOCK)
    side.set_endpoints({0: "tcp://127.0.0.1:5999"})
    return side


def test_each_chunk_of_a_prompt_gets_a_job_with_the_blocks_it_completes() -> None:
    req = FakeRequest("c1", 100, {"do_remote_decode": True})  # 7 blocks of 16
    blocks = {"c1": [7, 8, 9]}
    side = chunking_scheduler(blocks)
    side.after_alloc(req, [7, 8, 9], 0)
    first = side.build_orders({"c1": 40}).send
    assert first == [SendJob("c1", room_of("c1"), (7, 8, 9), last=False, complete=2, total=7)]
    assert side.counts()["sending"] == 1, "the sender opens with the first chunk"
    req.num_computed_tokens = 40
    blocks["c1"] += [10, 11, 12]
    assert side.build_orders({"c1": 56}).send == [SendJob("c1", room_of("c1"), (7, 8, 9, 10, 11, 12), last=False,
                                                          complete=6, total=7)]
    assert not side.build_orders({}).send, "a step that does not schedule the request has no job for it"
    req.num_computed_tokens = 96
    blocks["c1"] += [13]
    assert side.build_orders({"c1": 4}).send == [SendJob("c1", room_of("c1"), (7, 8, 9, 10, 11, 12, 13))]
    assert side.counts() == {"sending": 1, "receiving": 0, "prefilling": 0, "requests": 1, "refused": 0}


def test_without_send_chunks_a_prompt_goes_with_its_last_chunk_only() -> None:
    req = FakeRequest("c2", 100, {"do_remote_decode": True})
    side = chunking_scheduler({"c2": [1, 2, 3, 4, 5, 6, 7]}, send_chunks=False)
    side.after_alloc(req, [1, 2, 3], 0)
    assert not side.build_orders({"c2": 40})
    req.num_computed_tokens = 40
    assert [job.last for job in side.build_orders({"c2": 60}).send] == [True]


def test_a_request_preempted_between_its_chunks_is_named_to_the_worker() -> None:
    req = FakeRequest("c3", 100, {"do_remote_decode": True})
    side = chunking_scheduler({"c3": [1, 2, 3]})
    side.after_alloc(req, [1, 2, 3], 0)
    side.build_orders({"c3": 40})
    # vLLM preempts it (and also requests this connector never sent for); it comes back with new blocks
    assert side.build_orders({}, preempted={"c3", "other"}).preempted == ["c3"]
    side.after_alloc(req, [4, 5, 6], 0)
    req.num_computed_tokens = 0
    job = side.build_orders({"c3": 40}).send[0]
    assert (job.room, job.block_ids, job.last) == (room_of("c3"), (1, 2, 3), False)
    assert side.request_finished(req, [1, 2, 3], completed=False) == (True, None)
    assert side.build_orders({}).abort == ["c3"], "an aborted request's open room is aborted"


def test_a_request_preempted_after_its_prompt_is_named_to_the_worker_too() -> None:
    """A prefill request asked for more than one token decodes on once its prompt is computed; its room
    may still be sending when vLLM preempts it."""
    req = FakeRequest("c4", 40, {"do_remote_decode": True})
    side = chunking_scheduler({"c4": [1, 2, 3]})
    side.after_alloc(req, [1, 2, 3], 0)
    assert [job.last for job in side.build_orders({"c4": 40}).send] == [True]
    assert side.build_orders({}, preempted={"c4"}).preempted == ["c4"]


# -- the worker ------------------------------------------------------------------------------------
class Gate:
    """Stands in for a device event: ``query()`` is False until :meth:`fire`."""

    def __init__(self) -> None:
        self._fired = threading.Event()

    def query(self) -> bool:
        return self._fired.is_set()

    def fire(self) -> None:
        self._fired.set()


def true_kv(layer: int, block: int) -> int:
    """What the prompt's block ``block`` holds in layer ``layer`` once computed."""
    return 16 * layer + block + 1


def step(prefill: WorkerSide, kv: list[np.ndarray], job: SendJob, computes: dict[int, int]) -> None:
    """One engine step: the pass writes ``computes`` (local block -> the prompt's block) layer by layer."""
    prefill.begin_pass(Orders(send=[job]))
    for layer, buf in enumerate(kv):
        for block, index in computes.items():
            buf[block] = true_kv(layer, index)
        prefill.layer_written(f"layer.{layer}")
    prefill.end_pass()


def preempted_mid_stream(engine: str, monkeypatch: pytest.MonkeyPatch, seed: int, *,
                         guard: bool) -> tuple[dict[str, Any], list[np.ndarray], dict[str, int], float]:
    """The decode asks early; the first chunk (blocks 0-1 complete, 2 partial) is pushed, its writes held
    back by a gate that fires 0.5 s later; vLLM preempts the request (``guard``: through
    ``handle_preemptions``), overwrites its blocks and computes the prompt again in ``NEW``."""
    gate = Gate()
    with workers(engine, seed=seed) as (kv, prefill, decode):
        room = 5000 + seed
        asked(prefill, decode, room)
        monkeypatch.setattr(_worker, "device_event", lambda device: gate)
        step(prefill, kv, SendJob("r", room, SRC[:3], last=False, complete=2, total=4), {50: 0, 51: 1, 52: 2})
        monkeypatch.setattr(_worker, "device_event", lambda device: None)
        deadline = time.monotonic() + 10
        while prefill.counts()["chunks_sent_early"] < 1:
            assert time.monotonic() < deadline, prefill.counts()
            time.sleep(0.01)
        threading.Timer(0.5, gate.fire).start()
        t0 = time.monotonic()
        if guard:
            prefill.handle_preemptions(Orders(preempted=["r"]))
        waited = time.monotonic() - t0
        for buf in kv:  # vLLM gives the blocks to another request, which writes them
            buf[list(SRC)] = 0xEE
        step(prefill, kv, SendJob("r", room, NEW[:3], last=False, complete=2, total=4), {70: 0, 71: 1, 72: 2})
        step(prefill, kv, SendJob("r", room, NEW), {72: 2, 73: 3})
        out = decode.ask(None)
        wait_sent(prefill, "r", 10)
        return out, kv, prefill.counts(), waited


@pytest.mark.parametrize("engine", ENGINES)
def test_a_chunk_goes_in_its_step_and_a_preemption_waits_until_no_write_reads_its_blocks(
        engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out, kv, counts, waited = preempted_mid_stream(engine, monkeypatch, seed=21, guard=True)
    assert out["finished"] and out["load_errors"] == [], out
    # blocks 0-1 went in the first chunk's step, before the preemption; 2-3 with the last chunk
    assert out["digest"] == digest(kv, list(NEW))
    assert waited >= 0.4, f"handle_preemptions returned after {waited:.2f} s, while the chunk's writes waited"
    assert (counts["chunks_sent_early"], counts["preempted"], counts["sends_streamed"]) == (1, 1, 1), counts
    assert (counts["sends_failed"], counts["in_flight"]) == (0, 0), counts


@pytest.mark.parametrize("engine", ENGINES)
def test_negative_control_without_the_preemption_guard_the_decode_gets_what_vllm_wrote_next(
        engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out, kv, _, _ = preempted_mid_stream(engine, monkeypatch, seed=22, guard=False)
    assert out["finished"] and out["load_errors"] == [], out
    assert out["digest"] != digest(kv, list(NEW)), "the digest cannot tell blocks overwritten under a write"


def test_a_preempted_chunk_whose_writes_never_end_fails_its_room_and_the_decode_learns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with workers(str(ENGINES[0]), seed=23, transfer_timeout=1.5) as (kv, prefill, decode):
        asked(prefill, decode, 5023)
        monkeypatch.setattr(_worker, "device_event", lambda device: Gate())  # never fires
        step(prefill, kv, SendJob("r", 5023, SRC[:3], last=False, complete=2, total=4), {50: 0, 51: 1, 52: 2})
        t0 = time.monotonic()
        prefill.handle_preemptions(Orders(preempted=["r"]))
        assert time.monotonic() - t0 < 8.0
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == DST, out  # the load failed: vLLM's policy applies
        # vLLM computes the prompt again; its room has ended, and these steps are left alone
        step(prefill, kv, SendJob("r", 5023, NEW[:3], last=False, complete=2, total=4), {70: 0, 71: 1, 72: 2})
        step(prefill, kv, SendJob("r", 5023, NEW), {72: 2, 73: 3})
        wait_sent(prefill, "r", 10)
        counts = prefill.counts()
        assert (counts["sends"], counts["sends_failed"], counts["in_flight"]) == (1, 1, 0), counts


def test_a_request_preempted_after_its_prompt_fails_its_room_at_once_and_the_decode_learns() -> None:
    """Its room waits for the decode (which has not asked): a preemption cannot wait for that, so the room
    fails before vLLM reuses the blocks, and the decode that asks later is told why."""
    with workers(str(ENGINES[0]), seed=26) as (kv, prefill, decode):
        step(prefill, kv, SendJob("r", 5026, SRC), {50: 0, 51: 1, 52: 2, 53: 3})
        time.sleep(0.2)  # the room task takes the job and waits for the decode
        t0 = time.monotonic()
        prefill.handle_preemptions(Orders(preempted=["r"]))
        assert time.monotonic() - t0 < 3.0, "handle_preemptions waited for a decode that had not asked"
        out = decode.ask({"op": "recv", "req": "r5026", "room": 5026, "peer": prefill.endpoint, "blocks": DST})
        assert out["finished"] and out["load_errors"] == DST, out
        wait_sent(prefill, "r", 10)
        counts = prefill.counts()
        assert (counts["preempted"], counts["sends_failed"], counts["in_flight"]) == (1, 1, 0), counts


def test_a_request_aborted_between_its_chunks_ends_its_room_at_once() -> None:
    with workers(str(ENGINES[0]), seed=24) as (kv, prefill, decode):
        asked(prefill, decode, 5024)
        step(prefill, kv, SendJob("r", 5024, SRC[:3], last=False, complete=2, total=4), {50: 0, 51: 1, 52: 2})
        t0 = time.monotonic()
        prefill.start_receives(Orders(abort=["r"]))
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == DST, out
        assert time.monotonic() - t0 < 5.0, "the room waited for a chunk that will never come"
        wait_sent(prefill, "r", 10)
        counts = prefill.counts()
        assert (counts["sends"], counts["sends_failed"], counts["in_flight"]) == (1, 1, 0), counts


def test_a_decode_that_asks_between_chunks_gets_the_blocks_computed_before_with_the_next_chunk() -> None:
    with workers(str(ENGINES[0]), seed=25) as (kv, prefill, decode):
        step(prefill, kv, SendJob("r", 5025, SRC[:3], last=False, complete=2, total=4), {50: 0, 51: 1, 52: 2})
        assert prefill.counts()["chunks_sent_early"] == 0
        decode.post({"op": "recv", "req": "r5025", "room": 5025, "peer": prefill.endpoint, "blocks": DST})
        deadline = time.monotonic() + 20
        while prefill.manager_stats()["pages_in_use"] != len(DST):  # the open room learns the decode's pages
            assert time.monotonic() < deadline, prefill.manager_stats()
            time.sleep(0.01)
        step(prefill, kv, SendJob("r", 5025, SRC, last=False, complete=3, total=4), {52: 2, 53: 3})
        step(prefill, kv, SendJob("r", 5025, SRC), {53: 3})
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == [], out
        assert out["digest"] == digest(kv, list(SRC))
        wait_sent(prefill, "r", 10)
        assert prefill.counts()["chunks_sent_early"] == 1, prefill.counts()


@pytest.mark.parametrize(("kind", "engine", "stream", "chunks"), [
    ("aiotransfer-nixl-spin", "nixl", "always", True),
    ("aiotransfer-mooncake-whole", "mooncake_tcp", "never", True),
    ("aiotransfer-nixl-spin-nochunks", "nixl", "always", False),
    ("aiotransfer-mooncake-auto", "mooncake_tcp", "auto", True),
])
def test_the_harness_kinds_configure_the_connector_as_named(kind: str, engine: str, stream: str, chunks: bool) -> None:
    from benchmarks.vllm.spec import EngineSpec, kv_transfer_config

    fields = kv_transfer_config(EngineSpec(name="p", model="m", kind=kind, role="prefill"))
    assert fields is not None
    config = ConnectorConfig.from_extra(fields["kv_connector_extra_config"])
    assert (config.engine, config.stream_mode, config.send_chunks) == (engine, stream, chunks)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prefill_killed_mid_stream_fails_the_load_and_its_blocks_come_back_once_proven_gone(engine: str) -> None:
    """Concurrent dispatch: the decode has asked, the prefill has pushed its first layer and is killed
    before the next. The decode's load fails (its liveness finds the prefill gone), and its blocks are
    reported only then, with the failure, so vLLM's policy applies and no write can land in them later."""
    from tests.test_vllm_sides import DecodeWorker

    decode = DecodeWorker(engine)
    prefill = DecodeWorker(engine)  # a worker process of its own, acting as the prefill
    try:
        decode.post({"op": "recv", "req": "m1", "room": 5030, "peer": prefill.endpoint, "blocks": DST, "bound": 40})
        pushed = prefill.ask({"op": "stream", "req": "p1", "room": 5030, "blocks": list(SRC), "layers": 1})
        assert pushed["ok"] and pushed["counts"]["sends_streamed"] == 1, pushed
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(10)
        out = decode.ask(None)
        assert out["finished"], out
        assert out["load_errors"] == DST
        assert out["counts"]["in_flight"] == 0 and out["counts"]["receives_failed"] == 1, out
    finally:
        prefill.close()
        decode.close()
