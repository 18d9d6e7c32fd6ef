"""The connector's worker side: a :class:`BackgroundManager` over vLLM's KV tensors, one room per request.

Plain Python (no vLLM import). vLLM's model runner calls in from its own thread; every room runs as a
coroutine on the manager's loop thread, and its outcome comes back through :meth:`WorkerSide.finished`.
A room is reported finished only once its pages are released (:meth:`KVSender.released` /
:meth:`KVReceiver.released`), so vLLM never frees or reuses a block an engine may still read or write.
Every request the scheduler hands over is reported: one whose room cannot open (the room taken, too many
rooms) is reported failed at once, as no engine touched its blocks.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from ..._args import KVArgs
from ..._manager import KVManager
from ..._receiver import KVReceiver
from ..._sender import KVSender
from ...errors import AiotransferError, TransferTimeout
from .._sync import BackgroundManager
from ._config import FORGONE, STATE_KIND, ConnectorConfig
from ._layers import ChunkFeed, ForwardPass, device_event
from ._scheduler import Orders, RecvJob, SendJob
from ._streaming import StreamRule

__all__ = ["WorkerSide"]

log = logging.getLogger("aiotransfer.integrations.vllm")

_Side = TypeVar("_Side", KVSender, KVReceiver)


def _reason(exc: BaseException) -> str:
    """The reason a room ends with, for both sides and vLLM's log."""
    if not isinstance(exc, Exception):
        return "cancelled (the connector is shutting down)"
    return str(exc) or type(exc).__name__


class WorkerSide:
    """One vLLM worker's rooms. Thread-safe: vLLM's thread calls in, the loop thread reports back."""

    def __init__(self, config: ConnectorConfig, *, tp_rank: int = 0) -> None:
        self._config = config
        self._tp_rank = tp_rank
        self._bg: BackgroundManager | None = None
        self._endpoint: str | None = None
        self._lock = threading.Lock()
        self._rooms: dict[str, KVSender | KVReceiver] = {}  # req_id -> room, while it runs
        self._opening: dict[str, str | None] = {}  # req_id -> abort reason (None: none yet), room not open yet
        self._sent: set[str] = set()  # finished sends (released) not yet reported
        self._received: set[str] = set()  # finished receives (released) not yet reported
        self._sends: set[str] = set()  # requests with a send not yet reported
        self._feeds: dict[str, ChunkFeed] = {}  # req_id -> its prompt's steps, while its room task runs
        self._finished_ids: set[str] = set()  # of those, the ones vLLM has declared finished
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()
        self._withheld: set[str] = set()  # rooms never released: their blocks stay out of vLLM's pool
        self._block_bytes = 0
        self._state_bytes = 0
        self._by_request = False  # hybrid: failed loads are reported per request, not per block
        self._layer_index: dict[str, int] = {}  # layer name -> KV buffer (= layer id), for layer streaming
        self._num_buffers = 0  # KV buffers registered, each a "layer" for streaming (a region, for hybrid models)
        self._pass: ForwardPass | None = None  # the forward pass under way, while it has rooms to push
        self._pass_streams = False  # some room of that pass may stream: its layers are reported as written
        self._rule = StreamRule(config.stream_mode)  # which passes stream; its threshold is set at register
        self._block_size = 1  # tokens per block (the rule counts a pass's tokens in whole blocks)
        self._device: Any = None  # the KV's device: on CUDA, sends wait for an event of the pass that wrote it
        self.loads: collections.deque[tuple[str, float, int]] = collections.deque(maxlen=4096)
        """Recent successful loads: (request id, seconds from asking the prefill to the last byte, bytes)."""
        self.stats: dict[str, int] = {"sends": 0, "sends_asked_early": 0, "sends_streamed": 0, "chunks_sent_early": 0,
                                      "sends_whole_by_rule": 0, "sends_failed": 0, "sends_forgone": 0, "receives": 0,
                                      "receives_failed": 0, "forgone": 0, "aborted": 0, "preempted": 0, "withheld": 0}

    # -- start and stop --------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any], block_size: int) -> str:
        """Register vLLM's KV tensors (one per layer, blocks along dim 0) and start the manager.

        Returns this worker's control address."""
        tensors = list(kv_caches.values())
        if not tensors:
            raise AiotransferError("register_kv_caches: vLLM gave no KV tensors")
        dtype = _dtype(kv_caches)
        self._block_bytes = sum(int(t[0].numel()) * int(t.element_size()) if hasattr(t, "element_size")
                                else int(t[0].nbytes) for t in tensors)
        # One buffer per layer, in vLLM's order: buffer i holds layer i, which layer streaming pushes.
        args = KVArgs(tensors, page_size=block_size, dtype=dtype, tp_rank=0, tp_size=1, num_layers=len(tensors))
        self._device = getattr(tensors[0], "device", None)  # device_event records nothing for host memory
        self._num_buffers = len(tensors)
        self._set_rule(block_size)
        if self._rule.mode != "never":
            self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        return self._start(args, f"{len(tensors)} KV tensors of {dtype}")

    def _set_rule(self, block_size: int) -> None:
        """The streaming rule for this KV: a layer's share of a block, per token, against the engine's cost."""
        self._block_size = max(int(block_size), 1)
        per_token = self._block_bytes / max(self._num_buffers, 1) / self._block_size
        cfg = self._config
        self._rule = StreamRule.of(cfg.stream_mode, cfg.engine, max(per_token, 1.0), cfg.stream_min_tokens)
        if self._rule.mode == "auto":
            log.info("aiotransfer connector: a pass streams layer by layer from %d tokens (%.0f bytes per token "
                     "and layer)", self._rule.min_tokens, per_token)

    def _start(self, args: KVArgs, what: str) -> str:
        bg = BackgroundManager(args, self._config.transfer_config(self._tp_rank), name="aiotransfer-vllm")
        bg.start()
        self._bg = bg
        endpoint: str = bg.call(lambda m: m.endpoint)
        self._endpoint = endpoint
        log.info("aiotransfer connector: %s registered, %s on %s", what, self._config.engine, endpoint)
        return endpoint

    def register_hybrid(self, attention: Mapping[str, Any], mamba: Mapping[str, Any], block_size: int) -> str:
        """Register a hybrid model's KV cache (vLLM's hybrid allocator) and start the manager.

        vLLM lays every group's layers over one pool of equal pages: each region holds one attention
        layer and one Mamba layer, and a block id belongs to one group at a time. So each region is
        registered once, as a KV buffer (the attention blocks travel with ``send_kv``) and as the same
        ``mamba`` state buffer (the state block travels with ``send_state``), both indexed by block.
        ``attention`` and ``mamba`` map layer names to vLLM's tensors (a Mamba layer's may be a list)."""
        kv = _regions(attention, "attention")
        state = _regions(mamba, "Mamba")
        if {r[:2] for r in kv} != {r[:2] for r in state}:
            raise AiotransferError("register_kv_caches: the Mamba state does not share the attention layers' "
                                   "pages; only vLLM's hybrid layout (one shared page pool) is supported")
        page = kv[0][2]
        if any(r[2] != page for r in kv + state):
            raise AiotransferError("register_kv_caches: attention and Mamba pages differ in size")
        buffers = [(ptr, nbytes) for ptr, nbytes, _ in kv]
        # Region i is "layer" i for layer streaming: an attention layer reported written sends its region's
        # blocks of the prompt; the Mamba state block goes once the pass is over (its layers write it).
        args = KVArgs(buffers, kv_item_lens=page, page_size=block_size, dtype=_dtype(attention), tp_rank=0,
                      tp_size=1, state_buffers={STATE_KIND: buffers}, state_item_lens={STATE_KIND: page},
                      kv_layer_ids=list(range(len(buffers))))
        self._block_bytes = self._state_bytes = page * len(buffers)
        self._by_request = True
        self._device = getattr(next(iter(attention.values())), "device", None)
        self._num_buffers = len(buffers)
        self._set_rule(block_size)
        if self._rule.mode != "never":
            region = {ptr: i for i, (ptr, _, _) in enumerate(kv)}
            self._layer_index = {name: region[_region_start(value)] for name, value in attention.items()}
        return self._start(args, f"{len(buffers)} regions of {page}-byte pages (attention KV and Mamba state)")

    @property
    def endpoint(self) -> str | None:
        return self._endpoint

    @property
    def streams_layers(self) -> bool:
        """Whether rooms whose decode has asked may be pushed layer by layer during the forward pass
        (``stream_layers`` not ``"never"``; with ``"auto"``, only a pass large enough for it to pay,
        :attr:`stream_rule`; on a GPU each layer waits for the event of its kernels; hybrid models send
        their Mamba state once the pass is over)."""
        return bool(self._layer_index)

    @property
    def stream_rule(self) -> StreamRule:
        """Which passes stream (set when the KV caches are registered)."""
        return self._rule

    def _streams(self, blocks: int) -> bool:
        """Whether a pass that sends ``blocks`` blocks of each layer streams them (the rule, in tokens)."""
        return self._rule.streams(blocks * self._block_size)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close the manager: rooms still open fail (both sides learn why), the engine drains, memory is
        deregistered. Idempotent."""
        bg, self._bg = self._bg, None
        if bg is not None:
            bg.close(timeout)

    # -- orders from the scheduler ---------------------------------------------------------------
    def start_receives(self, orders: Orders) -> None:
        """Called before the forward pass: ask prefills for KV, abort rooms whose request ended."""
        bg = self._require()
        for job in orders.recv:
            self._spawn(bg, job.req_id, functools.partial(self._receive, job))
        for req_id in orders.abort:
            self._abort(bg, req_id)
        for room, endpoint in orders.forgo:
            self.stats["forgone"] += 1
            bg.submit(functools.partial(self._forgo, room=room, endpoint=endpoint))

    def start_sends(self, orders: Orders, fwd: ForwardPass | None = None) -> None:
        """Hold a sender per request whose prompt (or a chunk of it) this step computes, opened with the
        request's first job; each later job goes to the same room. Called after the forward pass (the
        KV is written, or on a GPU queued to be: the sends wait for an event recorded now), or, with layer
        streaming, before it with the pass (:meth:`begin_pass`)."""
        bg = self._require()
        ready = device_event(self._device) if fwd is None and orders.send else None
        for job in orders.send:
            with self._lock:
                feed = self._feeds.get(job.req_id)
                first = feed is None and job.req_id not in self._sends
                if first:
                    feed = self._feeds[job.req_id] = ChunkFeed(bg.loop)
                    self._sends.add(job.req_id)
            if feed is None:
                continue  # its room has ended (failed between two chunks): it is reported as it is
            feed.put((job, fwd, ready))
            if first:
                self._spawn(bg, job.req_id, functools.partial(self._send, job.req_id, job.room, feed))

    def handle_preemptions(self, orders: Orders) -> None:
        """vLLM's ``handle_preemptions``, before a step whose pass may overwrite the blocks of the requests
        it preempted: returns once no write reads them any more. A chunk whose writes do not end within
        ``transfer_timeout`` fails its room first, so what they read then can never be taken as the KV; so
        does a request preempted after its prompt was computed (decoding on, ``max_tokens`` > 1), whose
        room would wait for its decode."""
        bg = self._require()
        for req_id in orders.preempted:
            with self._lock:
                feed = self._feeds.get(req_id)
            if feed is None:
                continue
            self.stats["preempted"] += 1
            try:
                bg.submit(functools.partial(self._settle, req_id=req_id, feed=feed)).result(
                    self._config.transfer_timeout + 5.0)
            except Exception as exc:  # the loop is gone (shutting down): its rooms have failed already
                log.warning("aiotransfer: request %s preempted: %s", req_id, _reason(exc))

    async def _settle(self, _: KVManager, req_id: str, feed: ChunkFeed) -> None:
        if await feed.preempted(self._config.transfer_timeout):
            return
        reason = f"vLLM preempted request {req_id}, and gave its blocks to others, before its KV was sent"
        feed.close_now(reason)
        with self._lock:
            side = self._rooms.get(req_id)
        if side is not None:
            await side.abort(reason)

    # -- layer streaming (prefill) ---------------------------------------------------------------
    def begin_pass(self, orders: Orders) -> None:
        """Called before the forward pass, with layer streaming: this step's senders open now, so a room
        whose decode has already asked (concurrent dispatch) pushes each layer as :meth:`layer_written`
        reports it; the others are sent whole once :meth:`end_pass` says the pass is over."""
        bg = self._require()
        if self._pass is not None:  # a pass that never ended: its rooms must not send what it may not have written
            self._pass.abandon("vLLM began a step before the forward pass that computes the prompt ended")
            self._pass = None
        if orders.send:
            self._pass = ForwardPass(bg.loop, self._num_buffers)
            # A room sends at most the blocks its job completes: a pass none of whose rooms could stream
            # them reports no layer (no loop wake-up per layer), and its rooms go whole once it is over.
            self._pass_streams = any(self._streams(job.num_complete) for job in orders.send)
            self.start_sends(orders, self._pass)

    def layer_written(self, layer_name: str) -> None:
        """vLLM's ``save_kv_layer``: ``layer_name``'s KV is written (a no-op in a step with no room to push)."""
        fwd = self._pass
        if fwd is not None and self._pass_streams:
            layer = self._layer_index.get(layer_name)
            if layer is not None:
                fwd.written(layer, device_event(self._device))

    def end_pass(self) -> None:
        """vLLM's ``wait_for_save``: the forward pass is over, every layer written (or queued, on a GPU)."""
        fwd, self._pass = self._pass, None
        if fwd is not None:
            fwd.over(device_event(self._device))

    def _require(self) -> BackgroundManager:
        if self._bg is None:
            raise AiotransferError("aiotransfer connector: KV caches are not registered (or shut down)")
        return self._bg

    def _spawn(self, bg: BackgroundManager, req_id: str, room_task: Callable[[], Awaitable[None]]) -> None:
        """Run a request's room task on the loop thread. From here on the request counts as in flight: an
        abort that comes before its room opens is kept for it (:meth:`_open`), and whatever happens to the
        room, the request is reported finished (:meth:`_conclude`)."""
        with self._lock:
            self._opening[req_id] = None

        async def run(_: KVManager) -> None:
            await room_task()

        def check(fut: concurrent.futures.Future[None]) -> None:
            if not fut.cancelled() and fut.exception() is not None:
                log.error("request %s: room task failed: %r", req_id, fut.exception())

        try:
            bg.submit(run).add_done_callback(check)
        except BaseException:
            with self._lock:
                self._opening.pop(req_id, None)
            raise

    def _abort(self, bg: BackgroundManager, req_id: str) -> None:
        reason = f"vLLM request {req_id} ended before its KV transfer did"
        with self._lock:
            side = self._rooms.get(req_id)
            opening = side is None and req_id in self._opening
            if opening:
                self._opening[req_id] = reason  # its room task aborts the room as soon as it opens
        if side is None and not opening:
            return  # already concluded: its report is on its way
        self.stats["aborted"] += 1
        with self._lock:
            feed = self._feeds.get(req_id)
        if feed is not None:
            feed.close(reason)  # a room waiting for its prompt's next chunk ends
        if side is not None:
            bg.submit(lambda m: side.abort(reason))

    # -- one room --------------------------------------------------------------------------------
    def _open(self, req_id: str, make: Callable[[KVManager], _Side]) -> tuple[_Side, str | None]:
        """Open a request's room with ``make(manager)``. Raises if it cannot be opened (a duplicate room,
        too many rooms, the manager closed). Returns the room, and the reason when vLLM ended the request
        before it opened: the room task must then abort the room (its peer learns why) and report it."""
        try:
            side = make(self._require().manager)
        except BaseException as exc:
            with self._lock:
                self._opening.pop(req_id, None)
            if isinstance(exc, Exception):
                raise AiotransferError(f"its room could not be opened: {_reason(exc)}") from exc
            raise
        with self._lock:
            aborted = self._opening.pop(req_id, None)
            self._rooms[req_id] = side
        return side, aborted

    async def _send(self, req_id: str, room: int, feed: ChunkFeed) -> None:
        """Send one request's prompt, as vLLM's steps compute it (``feed``). Each job carries the step's
        forward pass while it is still under way (layer streaming), or the device event of the pass that
        computed it (KV on a GPU). With chunked prefill, once the decode has asked, each chunk's complete
        blocks go in their own step; the rest go with the last chunk. What a pass sends goes layer by layer
        if the decode has asked and :attr:`stream_rule` says it pays, else whole once the pass is over."""
        cfg = self._config
        self.stats["sends"] += 1
        tx: KVSender | None = None
        failure: str | None = None
        try:
            tx, ended = self._open(req_id, lambda m: m.sender(room))
            if ended is not None:
                raise AiotransferError(ended)
            sent = _Sent()
            while True:
                job, fwd, ready = await feed.next(cfg.transfer_timeout)
                if job.last:
                    feed.final()
                    break
                chunk = sent.take(tx, job) if tx.num_pages is not None else ()  # asked: this chunk's blocks go now
                if chunk:
                    self.stats["chunks_sent_early"] += 1
                    if fwd is not None and self._streams(len(chunk)):
                        await self._push_layers(tx, chunk, fwd, last=False)
                    else:
                        ready = await self._pass_over(fwd, ready)
                        await tx.send_kv(chunk, last=False, ready=ready, timeout=cfg.transfer_timeout)
            asked = tx.num_pages is not None  # the decode asked before the prompt was computed (concurrent dispatch)
            blocks = sent.take(tx, job) if asked else None
            if asked:
                self.stats["sends_asked_early"] += 1
            if fwd is not None and blocks and self._streams(len(blocks)):
                self.stats["sends_streamed"] += 1
                await self._push_layers(tx, blocks, fwd, last=True, state_block=job.state_block)
            else:
                if fwd is not None and blocks:
                    self.stats["sends_whole_by_rule"] += 1  # it could have streamed: the rule sent it whole
                ready = await self._pass_over(fwd, ready)
                await tx.wait_ready(timeout=cfg.lease)
                # ready: on a GPU the pass's kernels are queued, maybe not done; no byte moves before they are
                if job.state_block is not None:
                    await tx.send_state({STATE_KIND: [job.state_block]}, ready=ready, timeout=cfg.transfer_timeout)
                await tx.send_kv(sent.take(tx, job) if blocks is None else blocks, ready=ready,
                                 timeout=cfg.transfer_timeout)
            await tx.done(timeout=cfg.transfer_timeout)
        except BaseException as exc:  # any failure, cancellation included, ends the room on both sides
            failure = _reason(exc)
            if tx is not None:
                await tx.abort(failure)
            if not isinstance(exc, Exception):
                raise
        finally:
            feed.done()
            with self._lock:
                self._feeds.pop(req_id, None)
            await self._conclude(req_id, room, tx, failure, sending=True, blocks=())

    async def _pass_over(self, fwd: ForwardPass | None, ready: Any) -> Any:
        """Wait until the pass under way (if any) is over; returns the device event a whole send of what it
        wrote waits for (``ready`` when there is no pass: the event of the pass that computed it)."""
        if fwd is None:
            return ready
        await fwd.finished(self._config.transfer_timeout)
        return fwd.end_ready

    async def _push_layers(self, tx: KVSender, blocks: tuple[int, ...], fwd: ForwardPass, *, last: bool,
                           state_block: int | None = None) -> None:
        """Push each layer of ``blocks`` as soon as the forward pass has written it, in the order it writes
        them: the writes of one layer run while the pass computes the next, and on the ``last`` chunk the
        last one concludes the room."""
        deadline = time.monotonic() + self._config.transfer_timeout
        stream = tx.stream(blocks, last=last)
        sends: list[asyncio.Future[None]] = []
        try:
            async for layer, ready in fwd.layers(deadline - time.monotonic()):
                send = stream.send_layers(layer, ready=ready, timeout=max(deadline - time.monotonic(), 0.001))
                sends.append(asyncio.ensure_future(send))  # kept as it starts: a failure later still gathers it
            if state_block is not None:  # the pass is over: its Mamba layers have written (or queued) the state
                await tx.send_state({STATE_KIND: [state_block]}, ready=fwd.end_ready,
                                    timeout=max(deadline - time.monotonic(), 0.001))
        finally:
            if sends:
                results = await asyncio.gather(*sends, return_exceptions=True)
                failed = next((r for r in results if isinstance(r, BaseException)), None)
                if failed is not None:
                    raise failed

    async def _receive(self, job: RecvJob) -> None:
        cfg = self._config
        self.stats["receives"] += 1
        rx: KVReceiver | None = None
        failure: str | None = None
        start = time.monotonic()
        try:
            rx, ended = self._open(job.req_id, lambda m: m.receiver(job.room, peer=job.endpoint))
            if ended is not None:
                raise AiotransferError(ended)
            states = {STATE_KIND: [job.state_block]} if job.state_block is not None else None
            await rx.send_metadata(list(job.block_ids), state_indices=states, timeout=cfg.transfer_timeout)
            await rx.done(timeout=max(cfg.transfer_timeout - (time.monotonic() - start), 0.001))
            moved = len(job.block_ids) * self._block_bytes + (self._state_bytes if states else 0)
            self.loads.append((job.req_id, time.monotonic() - start, moved))
        except BaseException as exc:  # any failure, cancellation included, ends the room on both sides
            failure = _reason(exc)
            if rx is not None:
                await rx.abort(failure)
            if not isinstance(exc, Exception):
                raise
        finally:
            await self._conclude(job.req_id, job.room, rx, failure, sending=False, blocks=job.block_ids)

    async def _conclude(self, req_id: str, room: int, side: KVSender | KVReceiver | None, failure: str | None, *,
                        sending: bool, blocks: Iterable[int]) -> None:
        """Wait until the room's pages are provably untouched, then report the request finished. A room
        that never opened (``side`` None) touched nothing: its request is reported at once, as failed."""
        what = "send" if sending else "load"
        if sending and failure is not None and FORGONE in failure:
            # The decode never needed this KV (it ended, or its prefix cache held it): expected, not an error.
            self.stats["sends_forgone"] += 1
            log.info("aiotransfer: KV %s of request %s (room %d) not needed: %s", what, req_id, room, failure)
        elif failure is not None:
            self.stats["sends_failed" if sending else "receives_failed"] += 1
            log.warning("aiotransfer: KV %s of request %s (room %d) failed: %s", what, req_id, room, failure)
        try:
            if side is not None:
                await side.released(timeout=self._config.release_timeout)
        except TransferTimeout as exc:
            # Never hand back what an engine may still touch: these blocks stay out of vLLM's pool.
            self.stats["withheld"] += 1
            log.error("aiotransfer: request %s: %s; its blocks stay withheld from vLLM", req_id, exc)
            with self._lock:
                self._rooms.pop(req_id, None)
                self._withheld.add(req_id)
            return
        with self._lock:
            self._rooms.pop(req_id, None)
            if sending:
                self._sent.add(req_id)
            else:
                if failure is not None:
                    self._failed.add(req_id)
                    if not self._by_request:
                        self._load_errors.update(blocks)
                self._received.add(req_id)

    # -- reports to vLLM -------------------------------------------------------------------------
    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` for vLLM's ``get_finished``. A send is reported only
        once vLLM has declared its request finished (vLLM's contract), and only after its release."""
        with self._lock:
            self._finished_ids.update(i for i in finished_req_ids if i in self._sends)
            sent = self._sent & self._finished_ids
            self._sent -= sent
            self._finished_ids -= sent
            self._sends -= sent
            received, self._received = self._received, set()
        return sent, received

    def take_failed_receives(self, received: Iterable[str]) -> set[str]:
        """Of ``received`` (just reported finished), the loads that failed, for a hybrid model's vLLM, which
        takes failures per request (``failed_recving``): its block ids are not unique across groups."""
        with self._lock:
            if not self._by_request:
                return set()
            failed = self._failed & set(received)
            self._failed -= failed
        return failed

    def take_load_errors(self) -> set[int]:
        """Block ids of failed loads since the last call (reported with, or before, their request)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
            if not self._by_request:
                self._failed.clear()
        return errors

    def counts(self) -> dict[str, int]:
        """Rooms in flight and reports pending (a leak check), plus the running totals."""
        with self._lock:
            return {"in_flight": len(self._rooms) + len(self._opening), "unreported_sends": len(self._sent),
                    "unreported_receives": len(self._received), "withheld": len(self._withheld), **self.stats}

    def manager_stats(self) -> dict[str, Any]:
        """The worker's :meth:`KVManager.stats` (engine, control plane, rooms, pending requests)."""
        return dict(self._require().call(lambda m: m.stats()))

    @staticmethod
    async def _forgo(mgr: KVManager, room: int, endpoint: str) -> None:
        rx = mgr.receiver(room, peer=endpoint)
        await rx.abort(FORGONE)


class _Sent:
    """How far a prompt's blocks have gone to the decode, chunk after chunk."""

    def __init__(self) -> None:
        self.upto = 0  # the prompt's blocks before this went, or the decode had them (a prefix-cache hit)
        self.total: int | None = None  # the prompt's block count the chunks sent so far assumed

    def take(self, tx: KVSender, job: SendJob) -> tuple[int, ...]:
        """The blocks of ``job`` to send now: those its step completed that the decode asked for (the
        prompt's tail: a prefix-cache hit on the decode covers its head) and that have not gone yet."""
        total, wanted = job.num_total, tx.num_pages or 0
        if self.total is not None and total != self.total:
            raise AiotransferError(f"the prompt's blocks changed from {self.total} to {total} between its chunks")
        if wanted > total:
            raise AiotransferError(f"decode asked for {wanted} blocks; the prompt has {total}")
        start, end = max(self.upto, total - wanted), job.num_complete
        self.upto = max(self.upto, end)
        if end <= start:
            return ()
        self.total = total
        return job.block_ids[start:end]


def _dtype(layers: Mapping[str, Any]) -> str:
    first = next(iter(layers.values()))
    tensor = first[0] if isinstance(first, (list, tuple)) else first
    return str(tensor.dtype).removeprefix("torch.")


def _region_start(value: Any) -> int:
    """Where a layer's block-indexed region starts: the lowest address of its tensors."""
    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    return min(int(t.data_ptr()) for t in tensors)


def _regions(layers: Mapping[str, Any], what: str) -> list[tuple[int, int, int]]:
    """``(ptr, nbytes, page bytes)`` of each layer's block-indexed region, in layer order, duplicates once.

    A layer's tensors (a Mamba layer may have several: conv and SSM state) index blocks along dim 0 with one
    stride, the page; the region starts at the lowest of their addresses."""
    out: dict[int, tuple[int, int, int]] = {}
    for name, value in layers.items():
        tensors = list(value) if isinstance(value, (list, tuple)) else [value]
        pages = {int(t.stride(0)) * int(t.element_size()) for t in tensors}
        blocks = {int(t.shape[0]) for t in tensors}
        if len(pages) != 1 or len(blocks) != 1:
            raise AiotransferError(f"register_kv_caches: {what} layer {name}: its tensors disagree on the block "
                                   f"stride ({sorted(pages)} bytes) or count ({sorted(blocks)})")
        page, count = pages.pop(), blocks.pop()
        ptr = _region_start(tensors)
        region = (ptr, page * count, page)
        if out.setdefault(ptr, region) != region:
            raise AiotransferError(f"register_kv_caches: {what} layer {name} overlaps another layer unevenly")
    if not out:
        raise AiotransferError(f"register_kv_caches: vLLM gave no {what} layers")
    return list(out.values())
