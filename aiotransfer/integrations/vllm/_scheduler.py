"""The connector's scheduler side: which requests send, which receive, when blocks may go back.

Plain Python over duck-typed vLLM requests (``request_id``, ``kv_transfer_params``, ``num_prompt_tokens``,
``num_computed_tokens``), so its bookkeeping is tested without vLLM. The scheduler never moves bytes: it
hands the workers one :class:`Orders` per step, and learns from their ``finished_sending`` /
``finished_recving`` reports when a request's blocks may be freed.

The rule it keeps: a request whose room a worker may still touch is never given back to vLLM's block
pool by ``request_finished`` (it returns ``delay_free_blocks=True``); the blocks come back only when the
worker reports the room released (every engine operation on it over, or on the decode the prefill proven
drained, gone or quarantined).

A request's ``kv_transfer_params`` are checked once, by :func:`plan_request`, at the first scheduler call
that sees them (vLLM's ``on_new_request``), and every later call follows that :class:`Plan`: a request whose
parameters are contradictory or malformed is refused (logged, counted, its answer says why), moves no KV,
contacts no peer and is computed locally, so vLLM never parks it for a load that is not ordered and never
holds its blocks for a worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._config import (
    KEY_DECODE,
    KEY_ERROR,
    KEY_PREFILL,
    KEY_ROOM,
    CacheGroups,
    ConnectorConfig,
    Plan,
    PlanKind,
    RemotePrefill,
    plan_request,
    room_of,
)

__all__ = ["Orders", "RecvJob", "SchedulerSide", "SendJob"]

log = logging.getLogger("aiotransfer.integrations.vllm")


@dataclass(frozen=True)
class SendJob:
    """Prefill worker: this step computes (the next chunk of) the request's prompt; hold a sender for its
    room, opened with the request's first such job."""

    req_id: str
    room: int
    block_ids: tuple[int, ...]
    """The request's blocks so far (every block of the prompt, on its last chunk)."""
    state_block: int | None = None
    """A hybrid model's Mamba state block (sent with ``send_state``, on the last chunk), or ``None``."""
    last: bool = True
    """This step computes the prompt's last token. Otherwise, a chunk of chunked prefill: its pass completes
    the first :attr:`complete` blocks, of :attr:`total`."""
    complete: int | None = None
    """Blocks of the prompt whose every token is computed once this step's pass is over (None: all)."""
    total: int | None = None
    """Blocks of the whole prompt (None: ``len(block_ids)``, as on the last chunk)."""

    @property
    def num_complete(self) -> int:
        return len(self.block_ids) if self.complete is None else self.complete

    @property
    def num_total(self) -> int:
        return len(self.block_ids) if self.total is None else self.total


@dataclass(frozen=True)
class RecvJob:
    """Decode worker: ask the prefill at ``endpoint`` to write the room into ``block_ids``."""

    req_id: str
    room: int
    endpoint: str
    block_ids: tuple[int, ...]
    state_block: int | None = None
    """Where a hybrid model's Mamba state must land, or ``None``."""


@dataclass
class Orders:
    """One step's work for the workers (the connector metadata's payload)."""

    send: list[SendJob] = field(default_factory=list)
    recv: list[RecvJob] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)
    """Requests whose room the worker must abort (the request ended before its transfer did)."""
    forgo: list[tuple[int, str]] = field(default_factory=list)
    """(room, prefill endpoint) the decode will never ask for: tell the prefill to free its blocks now."""
    preempted: list[str] = field(default_factory=list)
    """Prefill requests with a sender that vLLM preempted (between two chunks, or while decoding on after
    the prompt): it has taken their blocks back, and may overwrite them in this step; no write may read
    them any more (``handle_preemptions``)."""

    def __bool__(self) -> bool:
        return bool(self.send or self.recv or self.abort or self.forgo or self.preempted)


class SchedulerSide:
    """Scheduler-side bookkeeping; ``block_ids_of(req_id)`` returns a request's block ids per KV cache group.

    ``groups`` says which group holds the attention KV and which (hybrid models) the Mamba state. The
    block lists it takes and gives elsewhere (``after_alloc``, ``request_finished``) are the attention
    group's.
    """

    def __init__(self, config: ConnectorConfig, block_ids_of: Callable[[str], Sequence[Sequence[int]]],
                 groups: CacheGroups | None = None, block_size: int | None = None) -> None:
        self._config = config
        self._block_size = block_size if config.send_chunks else None  # None: a prompt goes with its last chunk
        self._block_ids_of = block_ids_of
        self._groups = groups if groups is not None else CacheGroups()
        self._endpoints: dict[int, str] = {}
        self._prefilling: dict[str, Any] = {}  # prefill requests not yet fully scheduled
        self._sending: dict[str, int] = {}  # req_id -> room: a worker holds a sender, blocks pinned
        self._holders: dict[int, str] = {}  # room -> the req_id in _sending that holds it
        self._receiving: dict[str, int] = {}  # req_id -> room: a worker holds a receiver, blocks pinned
        self._plans: dict[str, Plan] = {}  # req_id -> what to do with it, decided once (until it finishes)
        self._cut: set[str] = set()  # hybrid prefill requests already cut short by the backoff
        self._refused = 0  # requests refused so far (their kv_transfer_params, or a room another holds)
        self._orders = Orders()

    # -- every request: its kv_transfer_params, checked once ---------------------------------------
    def admit(self, request: Any) -> Plan:
        """The request's :class:`Plan`, decided at the first call that sees it and kept until it finishes.
        vLLM's ``on_new_request`` calls this first; every other scheduler call goes through it too, so the
        decision is the same whichever call comes first and whatever the parameters say later."""
        plan = self._plans.get(request.request_id)
        if plan is None:
            plan = plan_request(request.kv_transfer_params, request.num_prompt_tokens)
            self._plans[request.request_id] = plan
            if plan.kind == PlanKind.REFUSED:
                assert plan.reason is not None
                self._refuse(request, plan.reason)
        return plan

    def _refuse(self, request: Any, reason: str) -> None:
        """Refuse ``request``: it moves no KV and is computed locally; its flags are cleared so that vLLM
        too sees a local request, and its answer (:meth:`request_finished`) carries ``reason``."""
        self._plans[request.request_id] = Plan(PlanKind.REFUSED, reason=reason)
        self._refused += 1
        params = request.kv_transfer_params
        if isinstance(params, MutableMapping):
            params[KEY_PREFILL] = params[KEY_DECODE] = False
        log.warning("request %s: %s; computing its prompt here instead, no KV moves", request.request_id, reason)

    # -- workers' endpoints (from vLLM's handshake metadata) -------------------------------------
    def set_endpoints(self, endpoints: Mapping[int, str]) -> None:
        self._endpoints = dict(endpoints)

    @property
    def endpoint(self) -> str | None:
        """The TP-rank-0 worker's control address, given to decode in ``kv_transfer_params``."""
        return self._endpoints.get(0)

    # -- decode ----------------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens to load, asynchronously: only for a :attr:`PlanKind.RECV` request whose load is not yet
        ordered (:meth:`after_alloc` orders it whenever vLLM then parks the request)."""
        plan = self.admit(request)
        if plan.kind != PlanKind.RECV:
            return 0, False
        assert plan.remote is not None
        count = self._groups.loaded_tokens(plan.remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def prefill_backoff(self, request: Any) -> int:
        """How many trailing prompt tokens a new prefill request must drop (0: none), marking it so that it
        is cut once only (also after a preemption). The prefill then computes the prompt short of them and
        the decode computes them itself (:attr:`CacheGroups.backoff`)."""
        backoff = self._groups.backoff
        if (not backoff or self.admit(request).kind != PlanKind.SEND or request.request_id in self._cut
                or request.num_prompt_tokens <= backoff):
            return 0
        self._cut.add(request.request_id)
        return backoff

    def after_alloc(self, request: Any, new_block_ids: list[int], num_external_tokens: int,
                    state_block: int | None = None) -> None:
        """Blocks were allocated for ``request``; ``new_block_ids`` are those not filled by a local
        prefix-cache hit, i.e. where the prefill's KV must land; ``state_block``, where its Mamba state
        must (hybrid models)."""
        req_id = request.request_id
        plan = self.admit(request)
        if plan.kind == PlanKind.SEND:
            if req_id not in self._sending:
                self._prefilling[req_id] = request
            return
        if plan.kind != PlanKind.RECV:
            return
        assert plan.remote is not None
        remote = plan.remote
        self._plans[req_id] = Plan(PlanKind.LOCAL)  # one transfer per request, also after a preemption
        params = request.kv_transfer_params
        if isinstance(params, MutableMapping):
            params[KEY_PREFILL] = False  # so vLLM too sees the transfer ordered
        if num_external_tokens <= 0 or not new_block_ids:
            self._orders.forgo.append((remote.room, remote.endpoint))  # a full local hit: nothing to fetch
            return
        self._orders.recv.append(RecvJob(request.request_id, remote.room, remote.endpoint, tuple(new_block_ids),
                                         state_block))
        self._receiving[request.request_id] = remote.room

    # -- every step ------------------------------------------------------------------------------
    def build_orders(self, num_scheduled_tokens: Mapping[str, int], preempted: Iterable[str] = ()) -> Orders:
        """This step's orders. A prefill request whose last prompt token is scheduled now gets its
        sender: the worker starts it after the forward pass, once the KV is written. With chunked prefill
        (and ``send_chunks``), each earlier chunk gets a job too: the sender opens with the first, and the
        blocks each chunk completes can go while the next chunks compute. ``preempted``: vLLM's
        ``preempted_req_ids`` of this step."""
        for req_id in preempted:
            if req_id in self._sending:  # between two chunks, or decoding on after its prompt (max_tokens > 1)
                self._orders.preempted.append(req_id)
        for req_id, request in list(self._prefilling.items()):
            scheduled = num_scheduled_tokens.get(req_id, 0)
            if not scheduled:
                continue
            computed = request.num_computed_tokens + scheduled
            last = computed >= request.num_prompt_tokens
            if not last and self._block_size is None:
                continue
            room = self._sending.get(req_id)
            if room is None:
                chosen = self._plans[req_id].room  # the router's, or None
                room = chosen if chosen is not None else room_of(req_id)
                holder = self._holders.get(room)
                if holder is not None:
                    del self._prefilling[req_id]
                    self._refuse(request, f"kv_transfer_params: {KEY_ROOM}={room} is the room of request {holder}, "
                                          f"still in flight on this prefill; a room names one request at a time (a "
                                          f"router picks 63 random bits per request)")
                    continue
                self._sending[req_id] = room
                self._holders[room] = req_id
            groups = self._block_ids_of(req_id)
            pages = tuple(self._groups.pages(groups))
            if last:
                del self._prefilling[req_id]
                self._orders.send.append(SendJob(req_id, room, pages, self._groups.state_block(groups)))
            else:
                assert self._block_size is not None
                total = -(-request.num_prompt_tokens // self._block_size)
                self._orders.send.append(SendJob(req_id, room, pages, last=False,
                                                 complete=min(computed // self._block_size, len(pages)), total=total))
        orders, self._orders = self._orders, Orders()
        return orders

    def on_worker_output(self, finished_sending: Iterable[str], finished_recving: Iterable[str]) -> None:
        for req_id in finished_sending:
            room = self._sending.pop(req_id, None)
            if room is not None and self._holders.get(room) == req_id:
                del self._holders[room]
        for req_id in finished_recving:
            self._receiving.pop(req_id, None)

    def has_pending_work(self) -> bool:
        """Keep vLLM's engine loop stepping while a worker holds a room: its completion frees blocks."""
        return bool(self._sending or self._receiving or self._orders)

    # -- end of a request ------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int], completed: bool) -> tuple[bool, dict[str, Any] | None]:
        """``completed``: the request ended normally (length cap or stop), not aborted or failed.

        Returns vLLM's ``(delay_free_blocks, kv_transfer_params)``.
        """
        req_id = request.request_id
        plan = self.admit(request)
        del self._plans[req_id]
        self._cut.discard(req_id)
        self._prefilling.pop(req_id, None)
        if req_id in self._sending:
            endpoint = self.endpoint
            if completed and endpoint is not None and block_ids:
                remote = RemotePrefill(endpoint, self._sending[req_id], request.num_prompt_tokens, tuple(block_ids))
                return True, remote.to_params()
            # Ended otherwise (aborted, or no endpoint known): the sender is aborted; the blocks stay
            # pinned until the worker reports the room released.
            self._orders.abort.append(req_id)
            return True, None
        if req_id in self._receiving:
            self._orders.abort.append(req_id)  # finished while its KV was still arriving
            return True, None
        if plan.kind == PlanKind.REFUSED:
            return False, {KEY_PREFILL: False, KEY_DECODE: False, KEY_ERROR: plan.reason}
        if plan.kind == PlanKind.RECV:
            # Never scheduled (aborted while waiting): let the prefill free its blocks now, not at its lease.
            assert plan.remote is not None
            self._orders.forgo.append((plan.remote.room, plan.remote.endpoint))
        return False, None

    def counts(self) -> dict[str, int]:
        """Rooms whose blocks a worker still holds, by side, requests followed (a leak check for tests and
        metrics), and the requests refused so far."""
        return {"sending": len(self._sending), "receiving": len(self._receiving),
                "prefilling": len(self._prefilling), "requests": len(self._plans), "refused": self._refused}
