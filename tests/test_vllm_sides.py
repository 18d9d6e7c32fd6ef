"""The vLLM connector's two halves without vLLM: the scheduler's bookkeeping on duck-typed requests, and
the worker's rooms over a real engine across two OS processes (a decode worker in tests/vllm_worker_peer.py).

What vLLM itself does with them (tokens, block pools, failure policies) is tested in tests/vllm/ against
unmodified vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiotransfer import ConfigError, InvalidArgument, KVArgs
from aiotransfer._control.endpoint import normalize_endpoint
from aiotransfer.errors import AiotransferError
from aiotransfer.integrations.vllm._config import (
    KEY_ENDPOINT,
    KEY_ERROR,
    KEY_ROOM,
    CacheGroups,
    ConnectorConfig,
    RemotePrefill,
    check_endpoint,
    room_of,
)
from aiotransfer.integrations.vllm._scheduler import Orders, RecvJob, SchedulerSide, SendJob
from aiotransfer.integrations.vllm._worker import WorkerSide
from tests.conftest import ENGINES
from tests.peer import digest, make_buffers
from tests.vllm_worker_peer import TensorView, hybrid_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES, ITEM = 128, 4096


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)


def scheduler(blocks: dict[str, list[int]]) -> SchedulerSide:
    side = SchedulerSide(ConnectorConfig(), lambda req_id: (blocks[req_id],))
    side.set_endpoints({0: "tcp://127.0.0.1:5999"})
    return side


# -- scheduler side --------------------------------------------------------------------------------
def test_prefill_request_gets_its_sender_when_its_last_chunk_is_scheduled_and_holds_its_blocks() -> None:
    req = FakeRequest("p1", 100, {"do_remote_decode": True})
    side = scheduler({"p1": [7, 8, 9, 10]})
    side.after_alloc(req, [7, 8], 0)
    assert not side.build_orders({"p1": 64})  # chunked prefill: 64 of 100 tokens
    req.num_computed_tokens = 64
    orders = side.build_orders({"p1": 36})
    assert orders.send == [SendJob("p1", room_of("p1"), (7, 8, 9, 10))]
    delay, params = side.request_finished(req, [7, 8, 9, 10], completed=True)
    assert delay is True and params is not None
    remote = RemotePrefill.parse(params)
    assert (remote.endpoint, remote.room, remote.num_tokens, remote.block_ids) == (
        "tcp://127.0.0.1:5999", room_of("p1"), 100, (7, 8, 9, 10))
    assert side.has_pending_work()
    side.on_worker_output(["p1"], [])
    assert not side.has_pending_work() and side.counts()["sending"] == 0


def test_prefill_request_aborted_after_its_sender_started_keeps_blocks_until_the_worker_releases() -> None:
    req = FakeRequest("p2", 10, {"do_remote_decode": True})
    side = scheduler({"p2": [1]})
    side.after_alloc(req, [1], 0)
    side.build_orders({"p2": 10})
    assert side.request_finished(req, [1], completed=False) == (True, None)
    assert side.build_orders({}).abort == ["p2"]


def test_prefill_request_aborted_before_its_prompt_was_computed_frees_at_once() -> None:
    req = FakeRequest("p3", 100, {"do_remote_decode": True})
    side = scheduler({"p3": [1]})
    side.after_alloc(req, [1], 0)
    assert side.request_finished(req, [1], completed=False) == (False, None)
    assert not side.build_orders({"p3": 100}) and not side.has_pending_work()


def decode_params(room: int = 42, num_tokens: int = 100) -> dict[str, Any]:
    return RemotePrefill("tcp://127.0.0.1:5999", room, num_tokens, (3, 4, 5, 6)).to_params()


def test_decode_request_loads_every_prompt_token_asynchronously_once() -> None:
    req = FakeRequest("d1", 100, decode_params())
    side = scheduler({})
    assert side.num_new_matched_tokens(req, 0) == (100, True)
    assert side.num_new_matched_tokens(req, 32) == (68, True)  # a local prefix hit covers the head
    side.after_alloc(req, [11, 12, 13, 14], 100)
    orders = side.build_orders({})
    assert [(j.room, j.endpoint, j.block_ids) for j in orders.recv] == [(42, "tcp://127.0.0.1:5999", (11, 12, 13, 14))]
    assert req.kv_transfer_params is not None and req.kv_transfer_params["do_remote_prefill"] is False
    assert side.num_new_matched_tokens(req, 0) == (0, False)  # after a preemption: no second transfer
    side.on_worker_output([], ["d1"])
    assert not side.has_pending_work()


def test_decode_request_ending_while_its_kv_arrives_is_aborted_and_its_blocks_held() -> None:
    req = FakeRequest("d2", 100, decode_params())
    side = scheduler({})
    side.num_new_matched_tokens(req, 0)
    side.after_alloc(req, [11, 12, 13, 14], 100)
    side.build_orders({})
    assert side.request_finished(req, [11, 12, 13, 14], completed=False) == (True, None)
    assert side.build_orders({}).abort == ["d2"]


def test_decode_that_needs_nothing_tells_the_prefill_to_free_its_blocks() -> None:
    side = scheduler({})
    hit = FakeRequest("d3", 100, decode_params(room=7))
    side.after_alloc(hit, [], 0)  # full local prefix hit
    never = FakeRequest("d4", 100, decode_params(room=8))
    assert side.request_finished(never, [], completed=False) == (False, None)  # aborted while waiting
    assert side.build_orders({}).forgo == [(7, "tcp://127.0.0.1:5999"), (8, "tcp://127.0.0.1:5999")]


@pytest.mark.parametrize("params, why", [
    ({"do_remote_prefill": True}, KEY_ENDPOINT),
    ({**decode_params(), KEY_ENDPOINT: "http://x"}, KEY_ENDPOINT),
    ({**decode_params(), KEY_ROOM: -1}, KEY_ROOM),
    ({**decode_params(), KEY_ROOM: True}, KEY_ROOM),
    ({**decode_params(), "remote_num_tokens": "100"}, "remote_num_tokens"),
    ({**decode_params(), "remote_block_ids": [1, -2]}, "remote_block_ids"),
    ({**decode_params(), KEY_ENDPOINT: "tcp://10.0.0.1"}, "has no port"),
    ({**decode_params(), KEY_ENDPOINT: "tcp://10.0.0.1:0"}, "port '0' is not in 1..65535"),
    ({**decode_params(), KEY_ENDPOINT: "tcp://:5600"}, "host '' is not a host name"),
])
def test_malformed_params_are_refused_and_the_prompt_is_computed_locally(
        params: dict[str, Any], why: str, caplog: pytest.LogCaptureFixture) -> None:
    req = FakeRequest("d5", 100, dict(params))
    assert scheduler({}).num_new_matched_tokens(req, 0) == (0, False)
    assert why in caplog.text and "computing its prompt here" in caplog.text
    assert req.kv_transfer_params is not None and req.kv_transfer_params["do_remote_prefill"] is False


@pytest.mark.parametrize("endpoint, why", [
    (None, "missing or not a tcp:// address"),
    ("10.0.0.1:5600", "missing or not a tcp:// address"),
    ("tcp://10.0.0.1", "has no port"),
    ("tcp://10.0.0.1:", "has no port"),
    ("tcp://[::1]", "has no port"),
    ("tcp://10.0.0.1:65536", "port '65536' is not in 1..65535"),
    ("tcp://10.0.0.1:http", "port 'http' is not in 1..65535"),
    ("tcp://10.0.0.1:-5", "port '-5' is not in 1..65535"),
    ("tcp://:5600", "host '' is not a host name"),
    ("tcp://fe80::1:5600", "host 'fe80::1' is not a host name"),  # IPv6 needs brackets
    ("tcp://a host:5600", "host 'a host' is not a host name"),
    ("tcp://" + "h" * 300 + ":5600", "is not a host name"),
])
def test_a_prefill_endpoint_without_a_usable_host_and_port_is_refused_when_parsed(endpoint: Any, why: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(why)) as err:
        RemotePrefill.parse({**decode_params(), KEY_ENDPOINT: endpoint})
    assert KEY_ENDPOINT in str(err.value) and "tcp://host:port" in str(err.value)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5600", "tcp://prefill-3.example:1", "tcp://[::1]:65535"])
def test_a_well_formed_prefill_endpoint_is_one_the_manager_accepts(endpoint: str) -> None:
    assert RemotePrefill.parse({**decode_params(), KEY_ENDPOINT: endpoint}).endpoint == endpoint
    assert normalize_endpoint(endpoint) == endpoint


@given(st.one_of(
    st.text(alphabet="tcp:/[]0123456789.abx -", max_size=24),
    st.builds("tcp://{}:{}".format, st.text(alphabet="[]:.0123456789abx_- ", max_size=12),
              st.text(alphabet="0123456789x", max_size=6)),
))
def test_every_endpoint_check_endpoint_accepts_opens_a_room(text: str) -> None:
    """No endpoint passes the parse only to be refused when the worker opens its room."""
    try:
        check_endpoint(text)
    except InvalidArgument:
        return
    assert normalize_endpoint(text) == text


@pytest.mark.parametrize("extra, why", [
    ({"engin": "nixl"}, "unknown keys"),
    ({"engine": "rdma"}, "engine"),
    ({"port": 70000}, "port"),
    ({"transfer_timeout": 0}, "transfer_timeout"),
    ({"lease": float("inf")}, "lease"),
    ({"transfer": {"no_such_field": 1}}, "transfer"),
])
def test_bad_extra_config_is_refused_naming_the_key(extra: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        ConnectorConfig.from_extra(extra).transfer_config()


def test_nixl_progress_thread_is_paced_unless_the_user_sets_it() -> None:
    assert ConnectorConfig.from_extra({"engine": "nixl"}).transfer_config().nixl_progress_delay_us == 200
    own = ConnectorConfig.from_extra({"engine": "nixl", "transfer": {"nixl_progress_delay_us": 0}})
    assert own.transfer_config().nixl_progress_delay_us == 0
    assert ConnectorConfig.from_extra({"engine": "mooncake_tcp"}).transfer_config().nixl_progress_delay_us == 0
    assert ConnectorConfig.from_extra({"lease": 7}).transfer_config().ready_timeout == 7


# -- hybrid models (Mamba + attention) -------------------------------------------------------------
def test_cache_groups_split_attention_pages_from_the_mamba_state_block() -> None:
    plain = CacheGroups()
    assert plain.backoff == 0 and plain.pages(([3, 4],)) == [3, 4] and plain.state_block(([3, 4],)) is None
    assert plain.loaded_tokens(100, 100) == 100
    hybrid = CacheGroups(attention=1, mamba=0)
    assert hybrid.backoff == 1
    assert hybrid.pages(([9], [3, 4, 5])) == [3, 4, 5] and hybrid.state_block(([9], [3, 4, 5])) == 9
    assert hybrid.state_block(([], [3])) is None
    assert hybrid.loaded_tokens(99, 100) == 99 and hybrid.loaded_tokens(50, 100) == 50
    # a prefill whose state holds the whole prompt is not loaded: the decode would apply the last token twice
    assert hybrid.loaded_tokens(100, 100) == 0 and hybrid.loaded_tokens(1, 1) == 0
    # speculative scratch slots trail the running state
    assert CacheGroups(attention=1, mamba=0, mamba_spec_blocks=2).state_block(([0, 7, 8, 9], [1])) == 7


def test_hybrid_prefill_is_cut_one_token_short_once_and_its_sender_carries_the_state_block() -> None:
    groups = {"p1": ([42], [7, 8, 9])}
    side = SchedulerSide(ConnectorConfig(), lambda req_id: groups[req_id], CacheGroups(attention=1, mamba=0))
    side.set_endpoints({0: "tcp://127.0.0.1:5999"})
    req = FakeRequest("p1", 600, {"do_remote_decode": True})
    assert side.prefill_backoff(req) == 1
    assert side.prefill_backoff(req) == 0, "cut once, also after a preemption"
    assert side.prefill_backoff(FakeRequest("p2", 1, {"do_remote_decode": True})) == 0
    assert side.prefill_backoff(FakeRequest("d1", 600, {"do_remote_prefill": True})) == 0
    req.num_prompt_tokens = 599  # what the connector's on_new_request does to vLLM's request
    side.after_alloc(req, [7, 8, 9], 0, 42)
    assert side.build_orders({"p1": 599}).send == [SendJob("p1", room_of("p1"), (7, 8, 9), 42)]
    _, params = side.request_finished(req, [7, 8, 9], completed=True)
    assert params is not None and params["remote_num_tokens"] == 599


def test_hybrid_decode_loads_all_but_the_last_prompt_token_and_asks_for_the_state() -> None:
    side = SchedulerSide(ConnectorConfig(), lambda req_id: ([], []), CacheGroups(attention=1, mamba=0))
    remote = RemotePrefill("tcp://127.0.0.1:6000", 77, 599, (1, 2, 3))
    req = FakeRequest("d1", 600, remote.to_params())
    assert side.num_new_matched_tokens(req, 0) == (599, True)
    side.after_alloc(req, [11, 12, 13], 599, 40)
    assert side.build_orders({}).recv == [RecvJob("d1", 77, remote.endpoint, (11, 12, 13), 40)]
    # A prefill that computed the whole prompt (no backoff on its side): the decode computes the prompt
    # itself and tells the prefill to free its blocks.
    full = FakeRequest("d2", 600, RemotePrefill("tcp://127.0.0.1:6000", 78, 600, (1, 2, 3)).to_params())
    assert side.num_new_matched_tokens(full, 0) == (0, False)
    side.after_alloc(full, [14, 15, 16], 0, 41)
    orders = side.build_orders({})
    assert orders.recv == [] and orders.forgo == [(78, "tcp://127.0.0.1:6000")]


# -- concurrent dispatch: the router gives both requests the room, the decode asks before the prefill answers
CONCURRENT = {"do_remote_prefill": True, "do_remote_decode": False, KEY_ENDPOINT: "tcp://127.0.0.1:5999",
              KEY_ROOM: 4242}
"""A concurrent decode's ``kv_transfer_params``: the prefill worker's address and the router's room only."""


def test_a_prefill_request_sends_in_the_room_its_router_gave() -> None:
    req = FakeRequest("p1", 100, {"do_remote_decode": True, KEY_ROOM: 4242})
    side = scheduler({"p1": [7, 8, 9, 10]})
    side.after_alloc(req, [7, 8, 9, 10], 0)
    assert side.build_orders({"p1": 100}).send == [SendJob("p1", 4242, (7, 8, 9, 10))]
    _, params = side.request_finished(req, [7, 8, 9, 10], completed=True)
    assert params is not None and params[KEY_ROOM] == 4242


@pytest.mark.parametrize("room", [-1, 2**63, "4242", True, 1.5])
def test_a_room_the_router_gave_that_is_not_one_is_refused_and_the_prefill_sends_nothing(
        room: Any, caplog: pytest.LogCaptureFixture) -> None:
    req = FakeRequest("p1", 100, {"do_remote_decode": True, KEY_ROOM: room})
    side = scheduler({"p1": [7]})
    side.after_alloc(req, [7], 0)
    assert not side.build_orders({"p1": 100})
    assert KEY_ROOM in caplog.text and "computing its prompt here instead" in caplog.text
    delay, params = side.request_finished(req, [7], completed=True)
    assert not delay and params is not None and KEY_ROOM in params[KEY_ERROR] and not params["do_remote_prefill"]
    assert side.counts() == {"sending": 0, "receiving": 0, "prefilling": 0, "requests": 0, "refused": 1}


def test_a_concurrent_decode_loads_the_whole_prompt_from_the_routers_room() -> None:
    req = FakeRequest("d1", 100, dict(CONCURRENT))
    side = scheduler({})
    assert side.num_new_matched_tokens(req, 0) == (100, True)
    assert side.num_new_matched_tokens(req, 64) == (36, True)  # a local prefix hit covers the head
    side.after_alloc(req, [11, 12, 13, 14], 100)
    assert side.build_orders({}).recv == [RecvJob("d1", 4242, "tcp://127.0.0.1:5999", (11, 12, 13, 14))]


def test_a_concurrent_hybrid_decode_loads_all_but_the_prefills_backoff() -> None:
    side = SchedulerSide(ConnectorConfig(), lambda req_id: ([], []), CacheGroups(attention=1, mamba=0))
    assert side.num_new_matched_tokens(FakeRequest("d1", 600, dict(CONCURRENT)), 0) == (599, True)
    # a one-token prompt is not cut on the prefill, so its state would apply the token twice: computed here
    assert side.num_new_matched_tokens(FakeRequest("d2", 1, dict(CONCURRENT)), 0) == (0, False)


@pytest.mark.parametrize("params, why", [
    ({**CONCURRENT, "remote_num_tokens": -1}, "remote_num_tokens"),
    ({**CONCURRENT, "remote_block_ids": "3"}, "remote_block_ids"),
    ({**CONCURRENT, KEY_ROOM: None}, KEY_ROOM),
])
def test_concurrent_params_are_validated_like_a_prefills_answer(params: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        RemotePrefill.parse(params)


def test_a_room_another_request_of_the_prefill_holds_is_refused_and_never_named_to_a_decode(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two prefill requests name the same room (a client set ``aiotransfer_room``, or sent the same
    ``kv_transfer_params`` twice). The first holds it; the second sends nothing, and its answer names no room
    but the reason, so its decode computes the prompt itself instead of asking for the room and being
    written the first request's KV. Once the first's room is released, the number may name a request again."""
    side = scheduler({"a": [1, 2], "b": [3, 4], "c": [5]})
    first, second = (FakeRequest(i, 100, {"do_remote_decode": True, KEY_ROOM: 4242}) for i in ("a", "b"))
    side.after_alloc(first, [1, 2], 0)
    assert side.build_orders({"a": 100}).send == [SendJob("a", 4242, (1, 2))]
    side.after_alloc(second, [3, 4], 0)
    assert side.build_orders({"b": 100}).send == []
    assert "room of request a" in caplog.text
    delay, params = side.request_finished(second, [3, 4], completed=True)
    assert not delay and params is not None and not params["do_remote_prefill"] and KEY_ROOM not in params
    assert "room of request a" in params[KEY_ERROR]
    assert side.counts() == {"sending": 1, "receiving": 0, "prefilling": 0, "requests": 1, "refused": 1}
    delay, params = side.request_finished(first, [1, 2], completed=True)
    assert delay and params is not None and params[KEY_ROOM] == 4242
    side.on_worker_output(["a"], [])
    third = FakeRequest("c", 100, {"do_remote_decode": True, KEY_ROOM: 4242})
    side.after_alloc(third, [5], 0)
    assert side.build_orders({"c": 100}).send == [SendJob("c", 4242, (5,))]


def test_kv_args_take_a_state_buffer_that_is_a_kv_buffer_but_not_a_partial_overlap() -> None:
    arena = np.zeros((2, 8, 64), dtype=np.uint8)
    regions = [(int(arena[i].ctypes.data), arena[i].nbytes) for i in range(2)]
    args = KVArgs(regions, kv_item_lens=64, state_buffers={"mamba": regions}, state_item_lens={"mamba": 64})
    assert args.num_pages == 8 and [b.num_items for b in args.state["mamba"]] == [8, 8]
    with pytest.raises(InvalidArgument, match="overlap"):
        KVArgs(regions, kv_item_lens=64, state_buffers={"mamba": [(regions[0][0] + 64, 256)]},
               state_item_lens={"mamba": 64})


def test_hybrid_registration_refuses_a_mamba_state_outside_the_attention_pages() -> None:
    kv = make_buffers(2, 8, 256, seed=1)
    other = make_buffers(1, 8, 256, seed=2)
    attention, _ = hybrid_layers(kv)
    worker = WorkerSide(ConnectorConfig())
    with pytest.raises(AiotransferError, match="does not share the attention layers' pages"):
        worker.register_hybrid(attention, {"mamba.0": [TensorView(other[0])]}, block_size=16)
    with pytest.raises(AiotransferError, match="disagree on the block stride"):
        worker.register_hybrid(attention, {"mamba.0": [TensorView(kv[0]), TensorView(kv[0][::2])]}, block_size=16)


# -- worker side over a real engine, two processes -------------------------------------------------
class DecodeWorker:
    def __init__(self, engine: str, *mode: str) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), MC_LOG_LEVEL="ERROR")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_worker_peer", engine, str(PAGES), str(ITEM),
                                      *mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.endpoint = self.ask(None)["endpoint"]

    def post(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: dict[str, Any] | None) -> dict[str, Any]:
        """Posts ``cmd`` (``None``: nothing) and reads the next answer."""
        assert self.proc.stdout is not None
        if cmd is not None:
            self.post(cmd)
        line = self.proc.stdout.readline()
        assert line, "decode worker exited"
        return dict(json.loads(line))

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(20)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()


def prefill_worker(engine: str, kv: list[Any], **extra: Any) -> WorkerSide:
    """A worker over ``kv``; it streams every pass whose decode has asked unless ``extra`` says otherwise (these
    test prompts are far below the streaming rule's threshold)."""
    worker = WorkerSide(ConnectorConfig.from_extra({"engine": engine, "transfer_timeout": 10.0,
                                                    "stream_layers": "always", **extra}))
    worker.register({f"layer.{i}": buf for i, buf in enumerate(kv)}, block_size=16)
    return worker


@contextlib.contextmanager
def workers(engine: str, seed: int, **extra: Any) -> Iterator[tuple[list[np.ndarray], WorkerSide, DecodeWorker]]:
    """A prefill worker in this process over fresh buffers, and a decode worker in another."""
    kv = make_buffers(2, PAGES, ITEM, seed=seed)
    prefill = prefill_worker(engine, kv, **extra)
    decode = DecodeWorker(engine)
    try:
        yield kv, prefill, decode
    finally:
        decode.close()
        prefill.shutdown()


def wait_sent(worker: WorkerSide, req_id: str, bound: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < bound:
        if req_id in worker.finished({req_id})[0]:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"{req_id} not reported sent within {bound}s: {worker.counts()}")


@pytest.mark.parametrize("engine", ENGINES)
def test_worker_moves_the_prompt_tail_into_the_decode_blocks_byte_exact(engine: str) -> None:
    kv = make_buffers(2, PAGES, ITEM, seed=5)
    prefill = prefill_worker(engine, kv)
    decode = DecodeWorker(engine)
    try:
        src = (20, 21, 22, 23, 90, 91)
        prefill.start_sends(Orders(send=[SendJob("r1", 1001, src)]))
        assert prefill.finished(set()) == (set(), set())
        # The decode had the first two blocks cached: it asks for four, and gets the prompt's tail.
        out = decode.ask({"op": "recv", "req": "r1", "room": 1001, "peer": prefill.endpoint, "blocks": [5, 6, 7, 8]})
        assert out["finished"] and out["load_errors"] == []
        assert out["digest"] == digest(kv, list(src[2:]))
        assert out["loaded_bytes"] == [4 * 2 * ITEM]
        assert prefill.finished(set()) == (set(), set()), "a send is reported only once vLLM declared it finished"
        wait_sent(prefill, "r1", 10)
        assert prefill.counts()["in_flight"] == 0 and prefill.counts()["sends_failed"] == 0
    finally:
        decode.close()
        prefill.shutdown()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_decode_that_asks_before_the_prompt_is_computed_is_served_when_the_sender_opens(engine: str) -> None:
    """Concurrent dispatch: the decode's request reaches the prefill before the prefill's step computed the
    prompt. The prefill keeps it, and its sender, opened after the forward pass, writes at once."""
    with workers(engine, seed=9) as (kv, prefill, decode):
        src = (30, 31, 32)
        decode.post({"op": "recv", "req": "c1", "room": 3001, "peer": prefill.endpoint, "blocks": [40, 41, 42]})
        deadline = time.monotonic() + 20
        while prefill.manager_stats()["pending_requests"] != 1:
            assert time.monotonic() < deadline, f"the decode's request never reached the prefill: {prefill.counts()}"
            time.sleep(0.01)
        prefill.start_sends(Orders(send=[SendJob("c1", 3001, src)]))
        out = decode.ask(None)
        assert out["finished"] and out["load_errors"] == [], out
        assert out["digest"] == digest(kv, list(src))
        wait_sent(prefill, "c1", 10)
        counts = prefill.counts()
        assert counts["sends_asked_early"] == 1 and counts["sends_failed"] == 0 and counts["in_flight"] == 0, counts
        assert prefill.manager_stats()["pending_requests"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prefill_whose_decode_never_asks_frees_at_its_lease_and_a_forgone_one_at_once(engine: str) -> None:
    kv = make_buffers(2, PAGES, ITEM, seed=6)
    prefill = prefill_worker(engine, kv, lease=1.0)
    decode = DecodeWorker(engine)
    try:
        prefill.start_sends(Orders(send=[SendJob("lease", 2001, (1, 2))]))
        assert 0.8 < wait_sent(prefill, "lease", 10) < 5
        prefill_long = prefill_worker(engine, kv, lease=60.0)
        try:
            prefill_long.start_sends(Orders(send=[SendJob("forgone", 2002, (1, 2))]))
            assert decode.ask({"op": "forgo", "room": 2002, "peer": prefill_long.endpoint})["ok"]
            assert wait_sent(prefill_long, "forgone", 10) < 5  # not the 60 s lease
            assert prefill_long.counts()["sends_forgone"] == 1  # expected: not counted as a failure
            assert prefill_long.counts()["sends_failed"] == 0
        finally:
            prefill_long.shutdown()
    finally:
        decode.close()
        prefill.shutdown()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_prefill_fails_the_load_and_reports_its_blocks_once_proven_gone(engine: str) -> None:
    decode = DecodeWorker(engine)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), MC_LOG_LEVEL="ERROR")
    # A prefill worker process that is killed before it sends anything.
    victim = DecodeWorker.__new__(DecodeWorker)
    victim.proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_worker_peer", engine, str(PAGES), str(ITEM)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        endpoint = victim.ask(None)["endpoint"]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        out = decode.ask({"op": "recv", "req": "k1", "room": 3001, "peer": endpoint, "blocks": [9, 10, 11],
                          "bound": 40})
        assert out["finished"], out
        assert out["load_errors"] == [9, 10, 11]
        assert out["seconds"] < 6, out  # first contact sees the port refuse; no handshake timeout
        assert out["counts"]["in_flight"] == 0 and out["counts"]["receives_failed"] == 1
    finally:
        victim.close()
        decode.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_hybrid_worker_moves_attention_pages_and_the_mamba_state_block_byte_exact(engine: str) -> None:
    kv = make_buffers(2, PAGES, ITEM, seed=8)
    prefill = WorkerSide(ConnectorConfig.from_extra({"engine": engine, "transfer_timeout": 10.0}))
    prefill.register_hybrid(*hybrid_layers(kv), block_size=16)
    decode = DecodeWorker(engine, "hybrid")
    try:
        prefill.start_sends(Orders(send=[SendJob("h1", 4001, (30, 31, 32), 99)]))
        out = decode.ask({"op": "recv", "req": "h1", "room": 4001, "peer": prefill.endpoint, "blocks": [5, 6, 7],
                          "state": 12})
        assert out["finished"] and out["load_errors"] == [] and out["failed"] == []
        assert out["digest"] == digest(kv, [30, 31, 32])
        assert out["state_digest"] == digest(kv, [99])  # the whole page: conv and SSM state, padding included
        assert out["loaded_bytes"] == [(3 + 1) * 2 * ITEM]
        wait_sent(prefill, "h1", 10)
        # A decode that declares no state while the prefill sends one: the room fails, per request.
        prefill.start_sends(Orders(send=[SendJob("h2", 4002, (30,), 99)]))
        out = decode.ask({"op": "recv", "req": "h2", "room": 4002, "peer": prefill.endpoint, "blocks": [5],
                          "bound": 30})
        assert out["finished"] and out["failed"] == ["h2"] and out["load_errors"] == [], out
    finally:
        decode.close()
        prefill.shutdown()


def wait_received(worker: WorkerSide, req_id: str, bound: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < bound:
        if req_id in worker.finished(set())[1]:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"{req_id} not reported received within {bound}s: {worker.counts()}")


def hold_loop(worker: WorkerSide) -> threading.Event:
    """Keep the worker's loop thread busy until the returned event is set (at most 10 s): no room task of
    what is ordered meanwhile starts before then."""
    gate = threading.Event()
    worker._require().loop.call_soon_threadsafe(gate.wait, 10)
    return gate


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_whose_room_cannot_open_is_still_reported_finished(
        engine: str, caplog: pytest.LogCaptureFixture) -> None:
    worker = prefill_worker(engine, make_buffers(2, PAGES, ITEM, seed=9), lease=60.0)
    try:
        # A load from an endpoint the manager refuses (RemotePrefill.parse refuses it before the worker).
        worker.start_receives(Orders(recv=[RecvJob("noport", 5001, "tcp://10.0.0.1", (3, 4))]))
        # Two requests on one room (a client may send the same kv_transfer_params twice): the second
        # cannot open it.
        worker.start_sends(Orders(send=[SendJob("first", 5002, (1,)), SendJob("second", 5002, (2,))]))
        wait_received(worker, "noport", 10)
        assert worker.take_load_errors() == {3, 4}
        assert wait_sent(worker, "second", 10) < 10  # not the first's 60 s lease
        counts = worker.counts()
        assert counts["receives_failed"] == 1 and counts["sends_failed"] == 1, counts
        assert counts["in_flight"] == 1 and counts["withheld"] == 0, counts  # "first" waits for its decode
        assert "request noport (room 5001) failed: its room could not be opened" in caplog.text
        assert "duplicate room 5002" in caplog.text
        worker.start_receives(Orders(abort=["first"]))  # the room "second" could not take is still "first"'s
        wait_sent(worker, "first", 10)
        assert worker.counts()["in_flight"] == 0
    finally:
        worker.shutdown()


@pytest.mark.parametrize("engine", ENGINES)
def test_an_abort_that_comes_before_the_room_opens_ends_it_at_once(engine: str) -> None:
    # Neither room could finish on its own within the test's bound: no sender ever serves the decode's
    # room, and no decode ever asks for the prefill's.
    prefill = prefill_worker(engine, make_buffers(2, PAGES, ITEM, seed=10), lease=60.0, transfer_timeout=60.0)
    decode = prefill_worker(engine, make_buffers(2, PAGES, ITEM, seed=11), lease=60.0, transfer_timeout=60.0)
    try:
        gates = [hold_loop(prefill), hold_loop(decode)]
        decode.start_receives(Orders(recv=[RecvJob("r", 6001, str(prefill.endpoint), (5, 6))], abort=["r"]))
        prefill.start_sends(Orders(send=[SendJob("s", 6002, (1, 2))]))
        prefill.start_receives(Orders(abort=["s"]))  # vLLM ended the request in the next step
        for gate in gates:
            gate.set()
        assert wait_received(decode, "r", 10) < 10  # not its 60 s transfer timeout
        assert decode.take_load_errors() == {5, 6}
        assert wait_sent(prefill, "s", 10) < 10  # not its 60 s lease
        # The decode's room was opened and then aborted: its prefill heard why, and keeps the room's
        # tombstone (a sender that opens there later fails at once instead of holding its blocks).
        deadline = time.monotonic() + 10
        while prefill.manager_stats()["tombstones"] < 1:
            assert time.monotonic() < deadline, prefill.manager_stats()
            time.sleep(0.01)
        for worker, failed in ((decode, "receives_failed"), (prefill, "sends_failed")):
            counts = worker.counts()
            assert counts["aborted"] == 1 and counts[failed] == 1, counts
            assert counts["in_flight"] == 0 and counts["withheld"] == 0, counts
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.mark.parametrize("engine", ENGINES)
def test_two_decode_requests_naming_one_room_get_one_load_and_one_clear_error(engine: str,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Two decode requests name the same prefill and room at once (a client chose ``aiotransfer_room``). The
    first loads the room; the second's room cannot open (``duplicate room``): its load fails at once with
    that reason and its blocks are never written, so neither request gets KV meant for the other."""
    src = make_buffers(2, PAGES, ITEM, seed=12)
    dst = make_buffers(2, PAGES, ITEM, None)
    prefill = prefill_worker(engine, src, lease=60.0)
    decode = prefill_worker(engine, dst, lease=60.0)
    try:
        gate = hold_loop(decode)  # both jobs are ordered before either room task runs
        decode.start_receives(Orders(recv=[RecvJob("x", 7001, str(prefill.endpoint), (5, 6)),
                                           RecvJob("y", 7001, str(prefill.endpoint), (7, 8))]))
        gate.set()
        assert wait_received(decode, "y", 10) < 10
        assert decode.take_load_errors() == {7, 8}
        assert "request y (room 7001) failed: its room could not be opened: duplicate room 7001" in caplog.text
        prefill.start_sends(Orders(send=[SendJob("p", 7001, (1, 2))]))
        wait_received(decode, "x", 10)
        assert decode.take_load_errors() == set()
        assert digest(dst, [5, 6]) == digest(src, [1, 2])
        assert not any(b[[7, 8]].any() for b in dst), "the refused request's blocks were written"
        wait_sent(prefill, "p", 10)
    finally:
        decode.shutdown()
        prefill.shutdown()
