"""The vLLM connector's scheduler half against contradictory, malformed and hostile ``kv_transfer_params``.

The rule: a request's parameters are checked once, at the first scheduler call that sees them, and every
later call follows that decision. A refused request moves no KV and contacts no peer: vLLM computes it
locally, never parks it for a load, and never holds its blocks for a worker. The fuzz at the end drives the
scheduler half as vLLM's scheduler does (duck-typed requests, no vLLM), with a worker that ends every job it
is given, and checks that no request is parked for a load that is never ordered and none holds its blocks
once the workers have ended their jobs.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiotransfer._control.endpoint import normalize_endpoint
from aiotransfer.integrations.vllm._config import (
    KEY_BLOCKS,
    KEY_DECODE,
    KEY_ENDPOINT,
    KEY_ERROR,
    KEY_PREFILL,
    KEY_ROOM,
    KEY_TOKENS,
    MAX_REMOTE_BLOCKS,
    ConnectorConfig,
    PlanKind,
    RemotePrefill,
    plan_request,
)
from aiotransfer.integrations.vllm._scheduler import Orders, SchedulerSide

ENDPOINT = "tcp://127.0.0.1:5999"
BLOCK = 16
"""Tokens per block of the modelled vLLM."""


@dataclass
class Request:
    """What the scheduler half reads of a vLLM request, plus the modelled vLLM's own state of it."""

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: Any
    num_computed_tokens: int = 0
    state: str = "new"  # waiting, parked (WAITING_FOR_REMOTE_KVS), running, finished
    blocks: list[int] = field(default_factory=list)
    pinned: bool = False  # finished, its blocks kept until a worker reports it


def decode_params(room: int = 42, num_tokens: int | None = 100) -> dict[str, Any]:
    return RemotePrefill(ENDPOINT, room, num_tokens, (3, 4, 5, 6)).to_params()


def new_side(blocks: dict[str, list[int]] | None = None) -> SchedulerSide:
    """The scheduler half over ``blocks`` (request id -> its blocks), sending chunk by chunk."""
    held = blocks if blocks is not None else {}
    side = SchedulerSide(ConnectorConfig(), lambda req_id: (held.get(req_id, []),), block_size=BLOCK)
    side.set_endpoints({0: ENDPOINT})
    return side


BOTH = {**decode_params(), KEY_DECODE: True}
"""The reported case: a prefill's answer with ``do_remote_decode`` set too."""


def test_a_request_with_both_flags_is_not_parked_and_its_blocks_come_back_at_once() -> None:
    """vLLM parks a request whose ``get_num_new_matched_tokens`` says "load asynchronously" until a worker
    reports its load. With both flags set, no load may be promised: the request is computed locally, and
    an abort frees its blocks at once (vLLM keeps a parked request's blocks until its load reports)."""
    side = new_side()
    req = Request("both", 100, dict(BOTH))
    count, load_async = side.num_new_matched_tokens(req, 0)
    assert (count, load_async) == (0, False), "parked for a load"
    side.after_alloc(req, [11, 12, 13, 14, 15, 16, 17], count)
    for _ in range(1001):
        orders = side.build_orders({"both": 100})
        assert not orders.recv and not orders.send and not orders.forgo, orders
    delay, answer = side.request_finished(req, [11, 12, 13, 14, 15, 16, 17], completed=False)
    assert delay is False and answer is not None and "both true" in answer[KEY_ERROR]
    assert not side.build_orders({}) and not side.has_pending_work()
    assert side.counts() == {"sending": 0, "receiving": 0, "prefilling": 0, "requests": 0, "refused": 1}


MALFORMED = [
    pytest.param(BOTH, "both true", id="both-flags"),
    pytest.param({KEY_DECODE: True, KEY_PREFILL: True, KEY_ROOM: 7}, "both true", id="both-flags-prefill"),
    pytest.param({**decode_params(), KEY_PREFILL: "yes"}, KEY_PREFILL, id="prefill-flag-a-string"),
    pytest.param({**decode_params(), KEY_DECODE: 1}, KEY_DECODE, id="decode-flag-an-int"),
    pytest.param({KEY_DECODE: "false"}, KEY_DECODE, id="decode-flag-a-truthy-string"),
    pytest.param({KEY_DECODE: True, KEY_ROOM: -1}, KEY_ROOM, id="prefill-room-negative"),
    pytest.param({KEY_DECODE: True, KEY_ROOM: 2**63}, KEY_ROOM, id="prefill-room-too-big"),
    pytest.param({**decode_params(), KEY_ROOM: None}, KEY_ROOM, id="decode-room-missing"),
    pytest.param({**decode_params(), KEY_ROOM: "42"}, KEY_ROOM, id="decode-room-a-string"),
    pytest.param({**decode_params(), KEY_ENDPOINT: None}, KEY_ENDPOINT, id="endpoint-missing"),
    pytest.param({**decode_params(), KEY_ENDPOINT: "tcp://10.0.0.1:0"}, KEY_ENDPOINT, id="endpoint-port-0"),
    pytest.param({**decode_params(), KEY_ENDPOINT: ["tcp://h:1"]}, KEY_ENDPOINT, id="endpoint-a-list"),
    pytest.param({**decode_params(), KEY_TOKENS: 101}, "exceeds the request's 100 prompt tokens",
                 id="tokens-past-the-prompt"),
    pytest.param({**decode_params(), KEY_TOKENS: 2**70}, KEY_TOKENS, id="tokens-huge"),
    pytest.param({**decode_params(), KEY_TOKENS: 99.0}, KEY_TOKENS, id="tokens-a-float"),
    pytest.param({**decode_params(), KEY_BLOCKS: [1, 1]}, "distinct", id="blocks-duplicated"),
    pytest.param({**decode_params(), KEY_BLOCKS: [2**63]}, KEY_BLOCKS, id="block-out-of-range"),
    pytest.param({**decode_params(), KEY_BLOCKS: [-1]}, KEY_BLOCKS, id="block-negative"),
    pytest.param({**decode_params(), KEY_BLOCKS: [True]}, KEY_BLOCKS, id="block-a-bool"),
    pytest.param({**decode_params(), KEY_BLOCKS: {"0": 1}}, KEY_BLOCKS, id="blocks-a-dict"),
    pytest.param({**decode_params(), KEY_BLOCKS: list(range(MAX_REMOTE_BLOCKS + 1))}, KEY_BLOCKS,
                 id="blocks-too-many"),
    pytest.param(["do_remote_prefill"], "must be a dict", id="not-a-dict"),
]
FIRST_CALLS = ["admit", "num_new_matched_tokens", "after_alloc", "request_finished"]


@pytest.mark.parametrize("first", FIRST_CALLS)
@pytest.mark.parametrize("params, why", MALFORMED)
def test_malformed_params_are_refused_the_same_way_whichever_scheduler_call_sees_them_first(
        params: Any, why: str, first: str, caplog: pytest.LogCaptureFixture) -> None:
    """No load, no send, no forgo to a peer the parameters name; the request's blocks are never pinned; the
    refusal is logged once, counted, and the request's answer says why."""
    side = new_side({"r": [11, 12]})
    req = Request("r", 100, params if not isinstance(params, dict) else dict(params))
    calls = {
        "admit": lambda: side.admit(req),
        "num_new_matched_tokens": lambda: side.num_new_matched_tokens(req, 0),
        "after_alloc": lambda: side.after_alloc(req, [11, 12], 0),
        "request_finished": lambda: side.request_finished(req, [11, 12], completed=False),
    }
    calls[first]()
    if first != "request_finished":
        assert side.num_new_matched_tokens(req, 0) == (0, False)
        side.after_alloc(req, [11, 12], 100)
        orders = side.build_orders({"r": 100})
        assert not orders.recv and not orders.send and not orders.forgo, orders
        delay, answer = side.request_finished(req, [11, 12], completed=True)
        assert delay is False and answer is not None and why in answer[KEY_ERROR]
        assert answer[KEY_PREFILL] is False and answer[KEY_DECODE] is False
    assert not side.build_orders({}) and not side.has_pending_work()
    assert side.counts()["refused"] == 1 and side.counts()["requests"] == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and why in warnings[0].getMessage(), caplog.text
    assert "computing its prompt here instead" in warnings[0].getMessage()
    if isinstance(req.kv_transfer_params, dict):  # vLLM, too, then sees a request that moves no KV
        assert not req.kv_transfer_params[KEY_PREFILL] and not req.kv_transfer_params[KEY_DECODE]


def test_the_first_decision_holds_whatever_the_params_say_later() -> None:
    side = new_side({"p": [1]})
    refused = Request("d", 100, dict(BOTH))
    side.admit(refused)
    refused.kv_transfer_params.update(decode_params())  # now a well-formed decode request
    assert side.num_new_matched_tokens(refused, 0) == (0, False)
    side.after_alloc(refused, [5], 100)
    loading = Request("l", 100, decode_params(room=9))
    assert side.num_new_matched_tokens(loading, 0) == (100, True)
    loading.kv_transfer_params.update({KEY_DECODE: True, KEY_ENDPOINT: "garbage"})
    side.after_alloc(loading, [6, 7], 100)  # vLLM parked it: its load is ordered as first decided
    orders = side.build_orders({})
    assert [(j.req_id, j.room, j.endpoint) for j in orders.recv] == [("l", 9, ENDPOINT)]
    assert not orders.send and not orders.forgo


@pytest.mark.parametrize("params, kind", [
    (None, PlanKind.LOCAL), ({}, PlanKind.LOCAL), ({KEY_PREFILL: False, KEY_DECODE: None}, PlanKind.LOCAL),
    ({KEY_DECODE: True}, PlanKind.SEND), ({KEY_DECODE: True, KEY_ROOM: 0, KEY_ENDPOINT: "ignored"}, PlanKind.SEND),
    (decode_params(num_tokens=100), PlanKind.RECV), (decode_params(num_tokens=None), PlanKind.RECV),
    ({**decode_params(), KEY_BLOCKS: None}, PlanKind.RECV), (decode_params(num_tokens=0), PlanKind.RECV),
])
def test_well_formed_params_are_planned_as_before(params: Any, kind: PlanKind) -> None:
    plan = plan_request(params, 100)
    assert plan.kind == kind and plan.reason is None


# -- the fuzz: the scheduler half as vLLM drives it, over buggy and hostile kv_transfer_params -------------
ROOMS = st.sampled_from([7, 8, 2**63 - 1])  # few rooms: prefill requests collide on them
GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=True), st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=4), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FLAG = st.one_of(st.booleans(), st.none(), GARBAGE)


@st.composite
def buggy_params(draw: st.DrawFn) -> Any:
    """What a buggy router or client sends: well-formed parameters with some keys set wrong, missing or
    contradicting the others (both flags, another prompt's answer, a prefill's answer sent twice)."""
    kind = draw(st.sampled_from(["prefill", "decode", "concurrent", "local", "both"]))
    params: dict[str, Any]
    if kind == "both":
        params = {**decode_params(draw(ROOMS), draw(st.one_of(st.none(), st.integers(0, 400)))), KEY_DECODE: True}
    elif kind == "prefill":
        params = {KEY_DECODE: True, KEY_PREFILL: False}
        if draw(st.booleans()):
            params[KEY_ROOM] = draw(ROOMS)
    elif kind == "local":
        params = {}
    else:
        params = decode_params(draw(ROOMS), None if kind == "concurrent" else draw(st.integers(0, 400)))
    for key in draw(st.lists(st.sampled_from([KEY_DECODE, KEY_PREFILL, KEY_ROOM, KEY_ENDPOINT, KEY_TOKENS,
                                               KEY_BLOCKS]), max_size=2)):
        if draw(st.booleans()):
            params.pop(key, None)
        else:
            params[key] = draw(st.one_of(FLAG, ROOMS, st.just(ENDPOINT), st.just("tcp://h:0"),
                                         st.lists(st.integers(0, 9), max_size=3)))
    return params


@st.composite
def hostile_params(draw: st.DrawFn) -> Any:
    """What a hostile client sends: any value under every key the connector reads, or no dict at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(GARBAGE)
    keys = {KEY_DECODE: FLAG, KEY_PREFILL: FLAG, KEY_ROOM: st.one_of(ROOMS, GARBAGE),
            KEY_ENDPOINT: st.one_of(st.just(ENDPOINT), st.text(max_size=24), GARBAGE),
            KEY_TOKENS: st.one_of(st.integers(-5, 500), GARBAGE),
            KEY_BLOCKS: st.one_of(st.lists(st.integers(-2, 2**64), max_size=5), GARBAGE)}
    return {k: draw(v) for k, v in keys.items() if draw(st.booleans())}


@dataclass
class Case:
    """One request of a fuzz run, as the hypothesis draw made it."""

    params: Any
    prompt: int
    admitted: bool  # vLLM's on_new_request came first (else another call is the first to see the params)
    abort_at: int | None  # the step at which its client goes away (None: it runs to its end)
    latency: int  # steps a worker takes to end each of its jobs
    mutate: dict[str, Any] | None  # what is written into its params after the first call


CASES = st.builds(Case, params=st.one_of(buggy_params(), buggy_params(), hostile_params()), prompt=st.integers(1, 300),
                  admitted=st.booleans(), abort_at=st.one_of(st.none(), st.integers(0, 6)),
                  latency=st.integers(0, 6),
                  mutate=st.one_of(st.none(), st.dictionaries(st.sampled_from([KEY_DECODE, KEY_PREFILL]),
                                                              st.booleans(), min_size=1)))


class Worker:
    """A worker that ends every job it is given: loads after their latency, sends once vLLM has finished
    their request, aborted jobs at once. It reports only requests it holds a job for, as vLLM's workers do."""

    def __init__(self) -> None:
        self.recv: dict[str, int] = {}
        self.send: dict[str, int] = {}
        self.ended: set[str] = set()

    def take(self, orders: Orders, latency: dict[str, int]) -> None:
        for job in orders.recv:
            assert job.req_id not in self.recv, f"two loads for {job.req_id}"
            self.recv[job.req_id] = latency[job.req_id]
        for sjob in orders.send:
            self.send.setdefault(sjob.req_id, latency[sjob.req_id])
        for req_id in orders.abort:
            for jobs in (self.recv, self.send):
                if req_id in jobs:
                    jobs[req_id] = 0
                    self.ended.add(req_id)

    def report(self, finished: set[str]) -> tuple[set[str], set[str]]:
        received = {r for r, left in self.recv.items() if left <= 0}
        sent = {r for r, left in self.send.items() if left <= 0 and (r in finished or r in self.ended)}
        for r in received:
            del self.recv[r]
        for r in sent:
            del self.send[r]
        for jobs in (self.recv, self.send):
            for r in jobs:
                jobs[r] -= 1
        return sent, received


def run_vllm(cases: list[Case], steps: int = 80) -> None:
    """Drive the scheduler half as vLLM's scheduler does, checking its promises at every step."""
    held: dict[str, list[int]] = {}
    side = new_side(held)
    reqs = {f"r{i}": Request(f"r{i}", c.prompt, copy.deepcopy(c.params)) for i, c in enumerate(cases)}
    spec = dict(zip(reqs, cases, strict=True))
    worker, finished = Worker(), set[str]()
    next_block, pool = 0, {}  # block -> the request holding it
    jobs: dict[str, set[str]] = {r: set() for r in reqs}
    answers: dict[str, Any] = {}

    def allocate(req: Request) -> list[int]:
        nonlocal next_block
        new = list(range(next_block, next_block + -(-req.num_prompt_tokens // BLOCK)))
        next_block += len(new)
        pool.update(dict.fromkeys(new, req.request_id))
        req.blocks = held[req.request_id] = new
        return new

    def free(req: Request) -> None:
        for b in req.blocks:
            del pool[b]
        req.blocks, req.pinned = [], False
        held.pop(req.request_id, None)

    def first_seen(req: Request) -> None:
        mutate = spec[req.request_id].mutate
        if mutate and isinstance(req.kv_transfer_params, dict):
            req.kv_transfer_params.update(mutate)

    def finish(req: Request, completed: bool) -> None:
        parked = req.state == "parked"
        req.state = "finished"
        finished.add(req.request_id)
        delay, answers[req.request_id] = side.request_finished(req, list(req.blocks), completed)
        # vLLM keeps a parked request's blocks until its load reports (Scheduler.finish_requests)
        if (delay or parked) and req.blocks:
            req.pinned = True
            assert jobs[req.request_id] & {"recv", "send"}, f"{req.request_id} pinned with no job to report it"
        else:
            free(req)

    for req in reqs.values():
        req.state = "waiting"
        if spec[req.request_id].admitted:
            side.admit(req)
            first_seen(req)
    for step in range(steps):
        scheduled: dict[str, int] = {}
        for req in reqs.values():  # clients that go away
            if req.state in ("waiting", "parked", "running") and spec[req.request_id].abort_at == step:
                finish(req, completed=False)
        for req in reqs.values():  # the waiting queue
            if req.state != "waiting":
                continue
            count, load_async = side.num_new_matched_tokens(req, 0)
            assert count >= 0 and (count > 0) == load_async
            if not spec[req.request_id].admitted:
                first_seen(req)
            side.after_alloc(req, allocate(req), count)
            if load_async:
                req.state, req.num_computed_tokens = "parked", count
            else:
                req.state = "running"
        for req in reqs.values():  # running requests compute their prompt in chunks, then end
            if req.state == "running":
                scheduled[req.request_id] = min(64, req.num_prompt_tokens - req.num_computed_tokens) or 1
        orders = side.build_orders(scheduled)
        for job in orders.recv:
            jobs[job.req_id].add("recv")
            normalize_endpoint(job.endpoint)  # an address the worker's manager takes
            assert 0 <= job.room < 2**63 and job.block_ids == tuple(reqs[job.req_id].blocks)
        for sjob in orders.send:
            jobs[sjob.req_id].add("send")
        for req in reqs.values():  # vLLM parks only what a worker will report
            if req.state == "parked":
                assert "recv" in jobs[req.request_id], f"{req.request_id} parked for a load never ordered"
        worker.take(orders, {r: spec[r].latency for r in reqs})
        sent, received = worker.report(finished)
        side.on_worker_output(sent, received)
        for r in sent | received:
            req = reqs[r]
            if req.state == "parked":
                req.state = "running"
            elif req.state == "finished":
                assert req.pinned, f"{r} reported after its blocks were freed"
                free(req)
        for r, n in scheduled.items():
            req = reqs[r]
            if req.state != "running":
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_prompt_tokens:
                finish(req, completed=True)
    assert all(r.state == "finished" for r in reqs.values()), {r: q.state for r, q in reqs.items()}
    assert not pool, f"blocks held after every job ended: {sorted(set(pool.values()))}"
    assert side.counts()["requests"] == 0 and not side.has_pending_work(), side.counts()
    for r, case in spec.items():
        params = case.params
        both = isinstance(params, dict) and params.get(KEY_PREFILL) is True and params.get(KEY_DECODE) is True
        refused = answers[r] is not None and KEY_ERROR in answers[r]
        assert not (both and not refused), f"{r}: both flags, not refused: {answers[r]}"
        assert not (refused and jobs[r]), f"{r} refused ({answers[r]}) yet ordered {jobs[r]}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(CASES, min_size=1, max_size=8))
def test_fuzz_no_request_is_parked_for_a_load_never_ordered_nor_holds_blocks_past_its_jobs(cases: list[Case]) -> None:
    logging.getLogger("aiotransfer.integrations.vllm").disabled = True
    try:
        run_vllm(cases)
    finally:
        logging.getLogger("aiotransfer.integrations.vllm").disabled = False
