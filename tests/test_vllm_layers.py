"""Layer-pipelined push of the vLLM connector's prefill worker, over a real engine across two OS processes.

The prefill worker here is driven as vLLM's model runner drives it: ``begin_pass`` (``start_load_kv``)
before the forward pass, ``layer_written`` (``save_kv_layer``) after each layer has written its KV,
``end_pass`` (``wait_for_save``) after the pass. "The pass writes a layer" is this test filling the
layer's blocks; it waits between layers, so a push that came before its layer was written would carry the
old bytes and fail the digest (the negative control shows that it does).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from aiotransfer.errors import AiotransferError, TransferTimeout
from aiotransfer.integrations.vllm._config import ConnectorConfig
from aiotransfer.integrations.vllm._layers import ForwardPass
from aiotransfer.integrations.vllm._scheduler import Orders, SendJob
from aiotransfer.integrations.vllm._worker import WorkerSide
from tests.conftest import ENGINES
from tests.peer import digest, make_buffers
from tests.test_vllm_sides import ITEM, PAGES, DecodeWorker, prefill_worker, wait_sent, workers
from tests.vllm_worker_peer import hybrid_layers

SRC = (50, 51, 52, 53)
DST = [60, 61, 62, 63]
PAUSE = 0.2
"""Seconds between two layers of the pass: time for a push that should not have started to have moved."""


def asked(prefill: WorkerSide, decode: DecodeWorker, room: int, bound: float = 20.0) -> None:
    """The decode asks for ``room`` before the prefill has a sender for it; returns once the prefill has
    the request."""
    decode.post({"op": "recv", "req": f"r{room}", "room": room, "peer": prefill.endpoint, "blocks": DST})
    deadline = time.monotonic() + bound
    while prefill.manager_stats()["pending_requests"] != 1:
        assert time.monotonic() < deadline, f"the decode's request never reached the prefill: {prefill.counts()}"
        time.sleep(0.01)


def run_pass(prefill: WorkerSide, kv: list[np.ndarray], *, tell_first: bool = False) -> None:
    """The forward pass: each layer writes the prompt's blocks, then ``save_kv_layer`` reports it
    (``tell_first``: reported before it is written, the negative control)."""
    for layer, buf in enumerate(kv):
        time.sleep(PAUSE)
        if tell_first:
            prefill.layer_written(f"layer.{layer}")
            time.sleep(PAUSE)
        buf[list(SRC)] = 100 + layer
        if not tell_first:
            prefill.layer_written(f"layer.{layer}")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_room_whose_decode_asked_is_pushed_layer_by_layer_and_ends_before_the_pass(engine: str) -> None:
    with workers(engine, seed=11) as (kv, prefill, decode):
        assert prefill.streams_layers
        asked(prefill, decode, 4001)
        prefill.begin_pass(Orders(send=[SendJob("r4001", 4001, SRC)]))
        run_pass(prefill, kv)
        # The room ends without the pass's end: every layer went as it was written, then the Success.
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == [], out
        assert out["digest"] == digest(kv, list(SRC))
        prefill.end_pass()
        wait_sent(prefill, "r4001", 10)
        counts = prefill.counts()
        assert (counts["sends_streamed"], counts["sends_asked_early"], counts["sends_failed"]) == (1, 1, 0), counts
        assert counts["in_flight"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_negative_control_a_layer_reported_before_it_is_written_lands_stale(engine: str) -> None:
    with workers(engine, seed=12) as (kv, prefill, decode):
        asked(prefill, decode, 4002)
        prefill.begin_pass(Orders(send=[SendJob("r4002", 4002, SRC)]))
        run_pass(prefill, kv, tell_first=True)
        out = decode.ask(None)
        assert out["finished"], out
        assert out["digest"] != digest(kv, list(SRC)), "the digest cannot tell a premature push"
        prefill.end_pass()
        wait_sent(prefill, "r4002", 10)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_room_whose_decode_has_not_asked_goes_whole_after_the_pass(engine: str) -> None:
    with workers(engine, seed=13) as (kv, prefill, decode):
        prefill.begin_pass(Orders(send=[SendJob("r4003", 4003, SRC)]))
        run_pass(prefill, kv)
        prefill.end_pass()
        out = decode.ask({"op": "recv", "req": "r4003", "room": 4003, "peer": prefill.endpoint, "blocks": DST})
        assert out["finished"] and out["load_errors"] == [], out
        assert out["digest"] == digest(kv, list(SRC))
        wait_sent(prefill, "r4003", 10)
        counts = prefill.counts()
        assert (counts["sends_streamed"], counts["sends_asked_early"], counts["sends_failed"]) == (0, 0, 0), counts


@pytest.mark.parametrize("engine", ENGINES)
def test_a_pass_that_never_ends_fails_its_rooms_and_both_sides_learn_why(engine: str) -> None:
    with workers(engine, seed=14) as (_, prefill, decode):
        asked(prefill, decode, 4004)
        prefill.begin_pass(Orders(send=[SendJob("r4004", 4004, SRC)]))
        prefill.layer_written("layer.0")
        prefill.begin_pass(Orders())  # the next step, without wait_for_save for this one
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == DST, out  # the load failed: vLLM's policy applies
        wait_sent(prefill, "r4004", 10)
        counts = prefill.counts()
        assert counts["sends_failed"] == 1 and counts["in_flight"] == 0, counts


def test_stream_layers_false_turns_layer_streaming_off() -> None:
    kv = make_buffers(2, 8, 64, seed=15)
    worker = prefill_worker(str(ENGINES[0]), kv, stream_layers=False)
    try:
        assert not worker.streams_layers
    finally:
        worker.shutdown()


# -- the pass as the loop thread sees it -----------------------------------------------------------
async def test_layers_come_in_the_order_the_pass_writes_them_and_the_rest_when_it_ends() -> None:
    fwd = ForwardPass(asyncio.get_running_loop(), 4)
    got: list[int] = []

    readies: list[object] = []

    async def room() -> None:
        async for layer, ready in fwd.layers(10.0):
            got.append(layer)
            readies.append(ready)

    task = asyncio.create_task(room())
    for layer in (2, 0, 2):  # vLLM's order need not be the buffers' order; a repeat is ignored
        fwd.written(layer, ready=f"event {layer}" if layer == 0 else None)
        await asyncio.sleep(0.01)
    assert got == [2, 0] and not task.done()
    fwd.over(ready="end")  # layers never reported are written once the pass is over (its event fired)
    await asyncio.wait_for(task, 5)
    assert got == [2, 0, 1, 3]
    assert readies == [None, "event 0", "end", "end"] and fwd.end_ready == "end"


async def test_an_abandoned_pass_fails_its_rooms_and_a_silent_one_times_out() -> None:
    loop = asyncio.get_running_loop()
    fwd = ForwardPass(loop, 2)
    fwd.written(0)
    fwd.abandon("vLLM began another step")
    with pytest.raises(AiotransferError, match="another step"):
        async for _ in fwd.layers(10.0):
            pass
    with pytest.raises(AiotransferError, match="another step"):
        await fwd.finished(10.0)
    silent = ForwardPass(loop, 2)
    with pytest.raises(TransferTimeout, match="did not end within"):
        async for _ in silent.layers(0.05):
            pass


def test_a_pass_told_after_the_connector_closed_its_loop_does_not_fail_vllms_forward() -> None:
    loop = asyncio.new_event_loop()
    fwd = ForwardPass(loop, 2)
    loop.close()
    fwd.written(0)  # no RuntimeError("Event loop is closed") into vLLM's save_kv_layer
    fwd.over()


# -- hybrid models: attention regions streamed, the Mamba state once the pass is over ----------------
STATE_SRC, STATE_DST = 99, 12


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("state_late", [False, True], ids=["state-in-the-pass", "negative-control"])
def test_a_hybrid_room_is_pushed_region_by_region_and_its_state_once_the_pass_is_over(engine: str,
                                                                                       state_late: bool) -> None:
    """Each attention layer's region goes as the layer is reported; the state block, which the Mamba layers
    write during the pass, goes when the pass is over. The negative control writes the state only after
    the pass has ended: the decode then gets the old state, so the digest can tell."""
    kv = make_buffers(2, PAGES, ITEM, seed=16)
    prefill = WorkerSide(ConnectorConfig.from_extra({"engine": engine, "transfer_timeout": 10.0,
                                                     "stream_layers": "always"}))
    prefill.register_hybrid(*hybrid_layers(kv), block_size=16)
    decode = DecodeWorker(engine, "hybrid")
    try:
        assert prefill.streams_layers
        decode.post({"op": "recv", "req": "h1", "room": 4011, "peer": prefill.endpoint, "blocks": DST,
                     "state": STATE_DST})
        deadline = time.monotonic() + 20
        while prefill.manager_stats()["pending_requests"] != 1:
            assert time.monotonic() < deadline, prefill.counts()
            time.sleep(0.01)
        prefill.begin_pass(Orders(send=[SendJob("h1", 4011, SRC, STATE_SRC)]))
        for layer, buf in enumerate(kv):
            time.sleep(PAUSE)
            buf[list(SRC)] = 100 + layer
            if not state_late:
                buf[STATE_SRC] = 200 + layer  # this region's Mamba layer writes the state
            prefill.layer_written(f"attn.{layer}")
        prefill.end_pass()
        if state_late:
            time.sleep(PAUSE)
            for layer, buf in enumerate(kv):
                buf[STATE_SRC] = 200 + layer
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == [] and out["failed"] == [], out
        assert out["digest"] == digest(kv, list(SRC))
        assert (out["state_digest"] == digest(kv, [STATE_SRC])) != state_late
        wait_sent(prefill, "h1", 10)
        counts = prefill.counts()
        assert (counts["sends_streamed"], counts["sends_failed"], counts["in_flight"]) == (1, 0, 0), counts
    finally:
        decode.close()
        prefill.shutdown()
