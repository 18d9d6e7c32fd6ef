"""The world the interleaving tests explore (tests/test_interleavings.py): two prefill pipeline stages and a
decode on the memory engine (aiotransfer.testing) in one process, with real ZeroMQ on 127.0.0.1, a loop whose clock the test moves,
held-back message delivery, and the invariants checked after every step."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from aiotransfer import KVManager, KVPoll, TransferConfig
from aiotransfer._control.messages import Status
from aiotransfer._receiver import KVReceiver, decode_reason
from aiotransfer._sender import KVSender
from aiotransfer.engines import _registry as registry
from aiotransfer.testing import MemoryEngine, MemoryFabric, Page, Write
from tests.interleave_parts import PAGES, STAGES, Mailbox, Node, Op, QuickContext, Room, SkewLoop, node_args

ENGINE = "memory-interleave"
ROOM_PAGES = 2
ENGINE_TIMEOUT = 5.0
QUARANTINE = 2 * ENGINE_TIMEOUT + 1.0
"""The release quarantine: a write the engine has not ended this long is beyond what the library promises
(the decode releases its pages, the prefill abandons its handle); the checks count such writes apart."""
LANDING_GRACE = 1.0
"""How long a failed write may still land (``EngineTraits.landing_grace_s``)."""
MARGIN = 0.25
"""Loop seconds a bounded call may take past its timeout to notice it."""
EXAMPLES = int(os.environ.get("AIOTRANSFER_INTERLEAVING_EXAMPLES", "0")) or 40
STEPS = int(os.environ.get("AIOTRANSFER_INTERLEAVING_STEPS", "0")) or 25
SOAK = "AIOTRANSFER_INTERLEAVING_EXAMPLES" in os.environ

CONFIG: dict[str, Any] = dict(
    engine=ENGINE, staging="never", handshake_timeout=2.0, ready_timeout=3.0, transfer_timeout=3.0,
    done_timeout=4.0, engine_timeout_s=int(ENGINE_TIMEOUT), heartbeat_interval=1e5, peer_timeout=1e5,
    release_quarantine_s=QUARANTINE, max_entries_in_flight=2, max_batch_entries=2, lag_probe_interval=0.0,
    pending_request_ttl=30.0, executor_threads=1, yield_after_notify=False, poll_interval_min=0.0001,
    poll_interval_max=0.0001,
)


class Violation(AssertionError):
    """An invariant of the page lifecycle failed."""


class World:
    """The managers, the fabric, the decode's page pool, the calls in progress and the checks."""

    def __init__(self) -> None:
        self.loop = SkewLoop()
        self.fabric = MemoryFabric(auto_complete=False, clock=self.loop.time, engine_timeout_s=ENGINE_TIMEOUT,
                                   landing_grace_s=LANDING_GRACE)
        self.fabric.loop_thread = threading.get_ident()
        self.beyond_bound = 0
        """Checks skipped because the write outlived the release quarantine (its documented bound)."""
        self.nodes: dict[str, Node] = {}
        self.incarnations = 0
        self.pool: dict[int, int] = {}
        """Decode page -> the room it is allocated to (the current decode incarnation's pages)."""
        self.rooms: dict[int, Room] = {}
        self.ops: list[Op] = []
        self.checks = 0
        self.restless = 0
        """Steps after which the loop never went quiet within the limit."""
        self.steps = 0
        self.rids = iter(range(1, 1 << 30))
        self.fabric.owner = self._owner
        registry.register_engine(ENGINE, lambda config: MemoryEngine(self.fabric))
        self._context = zmq.Context
        zmq.Context = QuickContext  # type: ignore[misc]

    # -- running -------------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def step(self, action: Callable[[], Any] = lambda: None) -> None:
        """Run ``action`` on the loop (awaited when it returns a coroutine), then the loop until it is quiet."""

        async def act() -> None:
            result = action()
            if asyncio.iscoroutine(result):
                await result

        self.run(act())
        self.run(self.quiesce())
        self.fabric.observe()
        self.steps += 1

    def _fingerprint(self) -> tuple[Any, ...]:
        parts: list[Any] = [len(self.fabric.writes), sum(w.outcome == "pending" for w in self.fabric.writes),
                            sum(op.task.done() for op in self.ops)]
        for node in self.nodes.values():
            ctx = node.mgr._ctx
            c, p = ctx.control_or_none, ctx.poller_or_none
            parts += [c.sent if c else 0, node.mailbox.arrived, p.in_flight if p else 0, len(ctx._tasks)]
        for room in self.rooms.values():
            parts.append((room.rx.status, room.rx.is_released(),
                          tuple((tx.status, tx.is_released()) for tx, _ in room.txs.values())))
        return tuple(parts)

    def _unread(self) -> bool:
        """The engine has news (a write ended, or it is past the engine's timeout and not yet doomed) that the
        poll loop of a live manager has not read yet."""
        now = self.loop.time()
        live = {n.mgr.engine.session_id for n in self.nodes.values() if not n.mgr._ctx.closed}
        return any(w.src in live and not w.handle.consumed and not w.abandoned and (
            w.outcome != "pending" or (now >= w.posted_at + ENGINE_TIMEOUT and w.handle.doomed is None))
            for w in self.fabric.writes)

    def _delivered(self) -> bool:
        """Every message a live manager sent to another has arrived in its mailbox."""
        live = [n for n in self.nodes.values() if not n.mgr._ctx.closed]
        for node in live:
            ep = node.mgr.endpoint
            sent = sum(s.sent_to.get(ep, 0) - s.base.get(ep, 0) for s in live if s is not node)
            if node.mailbox.arrived < sent:
                return False
        return True

    async def _still(self, quiet: int, end: float) -> bool:
        """Until nothing changed over ``quiet`` consecutive polls (each 2 ms of real time); False when the
        real time ``end`` came first."""
        last: tuple[Any, ...] | None = None
        same = 0
        while time.monotonic() < end:
            await asyncio.sleep(0.002 / SkewLoop.SLOW)
            now = self._fingerprint()
            same = same + 1 if now == last and not self._unread() and self._delivered() else 0
            last = now
            if same >= quiet:
                return True
        return False

    async def quiesce(self, quiet: int = 4, limit: float = 3.0) -> None:
        """Run the loop until it is quiet: nothing moves, and every message that arrived was delivered (those
        of one round, manager by manager, one per loop iteration), or ``limit`` real seconds passed."""
        end = time.monotonic() + limit
        while await self._still(quiet, end):
            batch = [(node, msg) for label in sorted(self.nodes) for node in [self.nodes[label]]
                     for msg in node.mailbox.take()]
            if not batch:
                return
            for node, msg in batch:
                if self.alive(node.name):
                    node.mailbox.dispatch(msg)
                await asyncio.sleep(0)
        self.restless += 1

    def launch(self, name: str, coro: Awaitable[Any], bound: float) -> Op:
        async def call() -> Any:
            return await coro

        op = Op(name, self.loop.create_task(call(), name=name), self.loop.time(), bound)
        op.task.add_done_callback(_consume)
        self.ops.append(op)
        return op

    # -- managers ------------------------------------------------------------------------------
    async def start_node(self, label: str, port: int = 0) -> Node:
        args, bufs = node_args(label)
        extra: dict[str, Any] = {"control_port": port}
        if label == "P1":
            extra["bootstrap"] = self.nodes["P0"].mgr.endpoint
        mgr = KVManager(args, TransferConfig(**CONFIG, **extra))
        old = self.nodes.get(label)
        mailbox = Mailbox(mgr._dispatch, hold_route=old is not None and old.mailbox.hold_route)
        mgr._dispatch = mailbox  # type: ignore[method-assign]  # the control plane delivers into the mailbox
        await mgr.start()
        self.incarnations += 1
        node = Node(label, mgr, bufs, self.incarnations, mailbox)
        node.count_sends()
        self._read_mail_at_completion(node)
        for other in self.nodes.values():
            if other.label != label:
                other.base[mgr.endpoint] = other.sent_to.get(mgr.endpoint, 0)
        self.nodes[label] = node
        self.fabric.label(mgr.engine.session_id, node.name, args.kv)
        return node

    def _read_mail_at_completion(self, node: Node) -> None:
        """When armed, the node's held mail is read right after the poll that sees one of its writes end:
        queued before the task waiting on the write wakes, as a message that arrived with the completion is
        (the reader callback and the poll fall in the same loop iteration)."""
        engine = node.mgr.engine
        check = engine.check

        def check_then_read(handle: Any) -> Any:
            status = check(handle)
            if node.mail_at_completion and status.is_terminal:
                node.mail_at_completion = False
                self.loop.call_soon(self._read_held, node)
            return status

        engine.check = check_then_read  # type: ignore[method-assign]  # before the poll loop first reads it

    def _read_held(self, node: Node) -> None:
        node.mailbox.held = False
        if self.alive(node.name):
            for msg in node.mailbox.take():
                node.mailbox.dispatch(msg)

    async def start(self) -> None:
        for label in ("P0", "P1", "D"):
            await self.start_node(label)

    async def restart(self, label: str) -> None:
        """The manager's process dies (nothing it posted lands any more) and a new one starts on its port."""
        node = self.nodes[label]
        port = int(node.mgr.endpoint.rsplit(":", 1)[1])
        self.fabric.kill(node.mgr.engine.session_id)
        for room in self.rooms.values():
            if room.rx_node == node.name or any(n == node.name for _, n in room.txs.values()):
                room.exempt = True
        await node.mgr.aclose(timeout=0.05)
        await self.start_node(label, port)
        if label == "D":
            self.pool.clear()  # the new process has pages of its own; the old rooms died with the old one
        if label == "P0":
            await self.nodes["P1"].mgr._leader.register_with(self.nodes["P0"].mgr.endpoint)
        await self._still(15, time.monotonic() + 1.0)  # the others' sockets reconnect to the new process

    async def close(self) -> None:
        self.fabric.hang_handshakes(False)
        for op in self.ops:
            op.task.cancel()
        for node in self.nodes.values():
            self.fabric.kill(node.mgr.engine.session_id)
            with contextlib.suppress(Exception):
                await node.mgr.aclose(timeout=0.05)
        await asyncio.sleep(0)

    def teardown(self) -> None:
        try:
            self.run(self.close())
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                self.run(asyncio.wait(pending, timeout=2.0))
            self.run(self.loop.shutdown_asyncgens())
            self.run(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()
            registry._ENGINES.pop(ENGINE, None)
            zmq.Context = self._context  # type: ignore[misc]

    def alive(self, name: str) -> bool:
        return any(n.name == name for n in self.nodes.values())

    # -- the decode's page pool ------------------------------------------------------------------
    def _owner(self, page: Page) -> Any:
        name, _, p = page
        if name != self.nodes["D"].name:
            return ("dead", name)
        return self.pool.get(p)

    def allocate(self, scattered: bool) -> list[int] | None:
        free = [p for p in range(PAGES) if p not in self.pool]
        if len(free) < ROOM_PAGES:
            return None
        if scattered:
            return [free[0], free[-1]]
        for a, b in itertools.pairwise(free):
            if b == a + 1:
                return [a, b]
        return free[:ROOM_PAGES]

    def free_released(self) -> None:
        for room in self.rooms.values():
            if room.rx_node == self.nodes["D"].name and room.rx.is_released():
                for p in room.pages:
                    if self.pool.get(p) == room.rid:
                        del self.pool[p]

    # -- actions ---------------------------------------------------------------------------------
    def new_room(self, scattered: bool, whole: bool = False) -> Room | None:
        """``whole``: our pages one run too, so a stage's write is one handle and its Success leaves from the
        write's completion (two runs, the default, make two handles of the two-entry batches)."""
        pages = self.allocate(scattered)
        if pages is None:
            return None
        rid = next(self.rids)
        d = self.nodes["D"]
        rx = d.mgr.receiver(rid, self.nodes["P0"].mgr.endpoint)
        for p in pages:
            self.pool[p] = rid
        src = [(2 * rid) % PAGES, (2 * rid + (1 if whole else 5)) % PAGES]
        room = self.rooms[rid] = Room(rid, pages, src, rx, d.name)
        return room

    def ready(self, scattered: bool, whole: bool = False) -> Room | None:
        """A room opened on both sides, its metadata on its way."""
        room = self.new_room(scattered, whole)
        if room is not None:
            for stage in STAGES:
                self.open_sender(room, stage)
            self.send_metadata(room, 2.5)
        return room

    def rx(self, room: Room) -> KVReceiver | None:
        return room.rx if self.alive(room.rx_node) else None

    def tx(self, room: Room, stage: str) -> KVSender | None:
        entry = room.txs.get(stage)
        if entry is None or not self.alive(entry[1]):
            return None
        return entry[0]

    def open_sender(self, room: Room, stage: str) -> None:
        if self.tx(room, stage) is not None:
            return
        node = self.nodes[stage]
        if room.rid in node.mgr._senders:
            return
        room.txs[stage] = (node.mgr.sender(room.rid), node.name)

    def send_metadata(self, room: Room, timeout: float) -> None:
        rx = self.rx(room)
        if rx is not None:
            self.launch(f"rx{room.rid}.send_metadata", rx.send_metadata(room.pages, timeout=timeout), timeout)

    def rx_done(self, room: Room, timeout: float) -> None:
        rx = self.rx(room)
        if rx is not None:
            # a done() that times out aborts the room: its notices add at most 1 s per prefill stage
            self.launch(f"rx{room.rid}.done", rx.done(timeout=timeout), timeout + 1.0 * len(STAGES))

    def rx_released(self, room: Room, timeout: float) -> None:
        rx = self.rx(room)
        if rx is not None:
            self.launch(f"rx{room.rid}.released", rx.released(timeout=timeout), timeout)

    def rx_abort(self, room: Room) -> None:
        rx = self.rx(room)
        if rx is not None:
            self.launch(f"rx{room.rid}.abort", rx.abort("client went away"), 1.0 * len(STAGES))

    def wait_ready(self, room: Room, stage: str, timeout: float) -> None:
        tx = self.tx(room, stage)
        if tx is not None:
            self.launch(f"{stage}.tx{room.rid}.wait_ready", tx.wait_ready(timeout=timeout), timeout)

    def send_kv(self, room: Room, stage: str, timeout: float) -> None:
        tx = self.tx(room, stage)
        if tx is not None:
            self.launch(f"{stage}.tx{room.rid}.send_kv", tx.send_kv(room.src, timeout=timeout), timeout)

    def stream(self, room: Room, stage: str, timeout: float) -> None:
        tx = self.tx(room, stage)
        if tx is None:
            return
        try:
            stream = tx.stream(room.src)
        except Exception:
            return  # not ready, already sent, failed: refused before anything moves
        self.launch(f"{stage}.tx{room.rid}.send_layers", stream.send_layers(stream.layers, timeout=timeout), timeout)

    def tx_abort(self, room: Room, stage: str) -> None:
        tx = self.tx(room, stage)
        if tx is not None:
            self.launch(f"{stage}.tx{room.rid}.abort", tx.abort("scheduler gave up"), 1.0)

    def tx_done(self, room: Room, stage: str, timeout: float) -> None:
        tx = self.tx(room, stage)
        if tx is not None:
            self.launch(f"{stage}.tx{room.rid}.done", tx.done(timeout=timeout), timeout)

    def settle_write(self, index: int, ok: bool) -> None:
        """One write the engine has not ended completes (a late completion when it was doomed) or fails."""
        pending = self.fabric.pending()
        if pending:
            w = pending[index % len(pending)]
            (self.fabric.complete if ok else self.fabric.fail)(w)

    def fail_entry(self, index: int) -> None:
        """One entry of a pending write fails; the others still run."""
        pending = self.fabric.pending()
        if pending:
            self.fabric.fail_entry(pending[index % len(pending)])

    def hang_handshakes(self, hang: bool) -> None:
        """Engine handshakes hold the engine's mutex (until released)."""
        self.fabric.hang_handshakes(hang)

    def hold_mail(self, label: str, hold: bool) -> None:
        self.nodes[label].mailbox.held = hold

    def write_ends_with_mail(self, index: int, ok: bool) -> None:
        """One live write ends, and the mail its manager holds is read in the iteration that sees it end."""
        pending = self.fabric.pending()
        if pending:
            w = pending[index % len(pending)]
            for node in self.nodes.values():
                node.mail_at_completion |= node.mgr.engine.session_id == w.src and node.mailbox.held
            (self.fabric.complete if ok else self.fabric.fail)(w)

    async def settle_all(self, ok: bool) -> None:
        """Until no write is live: each completes (or fails), and the writes waiting for credit follow."""
        for _ in range(8):
            pending = self.fabric.pending()
            if not pending:
                return
            for w in pending:
                (self.fabric.complete if ok else self.fabric.fail)(w)
            await self.quiesce()

    def advance(self, seconds: float) -> None:
        self.loop.skew += seconds

    def hold_route(self) -> None:
        self.nodes["D"].mailbox.hold_route = True

    def release_route(self) -> None:
        self.nodes["D"].mailbox.hold_route = False

    async def heartbeat(self) -> None:
        """One heartbeat tick of every manager: ping the peers its rooms depend on (a restart shows)."""
        for node in list(self.nodes.values()):
            for ep in sorted(node.mgr._active_peers()):
                await node.mgr._ping(ep)

    async def forge_success(self, room: Room) -> None:
        """Stage 0, having concluded the room, reports Success a second time under stage 1's rank."""
        tx = self.tx(room, "P0")
        if tx is None or tx.status is not KVPoll.Success or self.rx(room) is None:
            return
        p0 = self.nodes["P0"].mgr
        msg = Status(room=room.rid, status=int(KVPoll.Success), rank=1, endpoint=p0.endpoint)
        await p0._ctx.control.send(self.nodes["D"].mgr.endpoint, msg, timeout=1.0)

    # -- invariants --------------------------------------------------------------------------------
    def check(self, before: float | None = None) -> None:
        """Every invariant; ``before``: the loop time when the last step started (for (d))."""
        self.check_pages()
        self.check_rooms()
        self.check_holds()
        self.check_loop()
        if before is not None:
            self.check_bounds(before)
        self.free_released()

    def _room_of_page(self, owner: Any) -> Room | None:
        return self.rooms.get(owner) if isinstance(owner, int) else None

    def check_pages(self) -> None:
        """(a)"""
        d = self.nodes["D"].name
        for w in self.fabric.live():
            for i, page in enumerate(w.pages):
                self.checks += 1
                if page[0] != d:
                    continue
                if self._beyond_bound(w, i):
                    self.beyond_bound += 1
                    continue
                at_submit = w.owners_at_submit[i]
                now = self._owner(page)
                if at_submit is None:
                    raise Violation(f"(a) write {w.wid} from {w.src} was posted into free decode page {page}")
                room = self._room_of_page(at_submit)
                if now != at_submit:
                    raise Violation(f"(a) decode page {page} passed from room {at_submit} to {now} while write "
                                    f"{w.wid} into it was live")
                if room is not None and room.rx.is_released():
                    raise Violation(
                        f"(a) write {w.wid} ({_outcome(w)}) is live over decode page {page} of room {room.rid}, "
                        f"which the decode released ({room.rx.release_cause}; rx {room.rx.status.name}: "
                        f"{room.rx.failure_reason}; {self._sides(room)})")

    def _beyond_bound(self, w: Write, i: int) -> bool:
        """The write outlived the release quarantine: its prefill abandoned it, or the room that owned the page
        was released by the quarantine while it was live (both the documented bound of docs/page-lifecycle.md)."""
        if w.abandoned:
            return True
        room = self._room_of_page(w.owners_at_submit[i])
        return room is not None and room.rx.release_cause == "quarantine"

    def _sides(self, room: Room) -> str:
        return ", ".join(f"{s} {tx.status.name}: {tx.failure_reason} released={tx.release_cause}"
                         for s, (tx, _) in sorted(room.txs.items()))

    def check_rooms(self) -> None:
        """(b)"""
        for room in self.rooms.values():
            sides: list[tuple[str, Any, str]] = [("rx", room.rx, room.rx_node)]
            sides += [(f"{s}@{n}", tx, n) for s, (tx, n) in room.txs.items()]
            for key, side, name in sides:
                self.checks += 1
                status = side.poll()
                first = room.terminal.get(key)
                if first is None:
                    if status.is_terminal:
                        unread = any(n.name == name and n.mailbox.held and n.mailbox.inbox for n in self.nodes.values())
                        room.terminal[key] = (status, self.steps, unread)
                elif status is not first[0] or side.status is not first[0]:
                    raise Violation(f"(b) room {room.rid} ended twice on {key}: {first[0].name} then {side.status.name}")
            if room.exempt:
                continue
            rx = room.rx
            if not rx.status.is_terminal:
                continue
            d = self.nodes["D"].mgr.endpoint
            for stage, (tx, _) in room.txs.items():
                self.checks += 1
                if not tx.status.is_terminal or d not in tx.decode_endpoints:
                    continue  # a stage that no request of the decode reached does not know of its room yet
                if rx.status is KVPoll.Success and tx.status is KVPoll.Failed:
                    raise Violation(f"(b) room {room.rid} succeeded on the decode but failed on {stage}: "
                                    f"{tx.failure_reason}")
                if rx.status is KVPoll.Failed and tx.status is KVPoll.Failed:
                    mine, theirs = tx.failure_reason or "", rx.failure_reason or ""
                    relayed = mine == decode_reason(theirs)
                    _, step, unread = room.terminal[f"{stage}@{room.txs[stage][1]}"]
                    crossed = (room.terminal["rx"][1] == step or unread) and not mine.startswith("aborted by decode")
                    if mine != theirs and not relayed and not crossed:
                        raise Violation(f"(b) room {room.rid} failed with different reasons: decode {theirs!r}, "
                                        f"{stage} {mine!r}")

    def check_loop(self) -> None:
        """(f): no native call on the event loop waited for the engine's mutex (a handshake held it)."""
        self.checks += 1
        if self.fabric.loop_waits:
            raise Violation(f"(f) the event loop waited on the engine mutex: {self.fabric.loop_waits}")

    def check_holds(self) -> None:
        """(c)"""
        if self.fabric.live():
            return
        for room in self.rooms.values():
            if self.rx(room) is not None and not room.rx.status.is_terminal:
                return
            for stage in room.txs:
                tx = self.tx(room, stage)
                if tx is not None and not tx.status.is_terminal:
                    return
        for node in self.nodes.values():
            stats = node.mgr.stats()
            for key in ("in_flight", "engine_holds_pending", "staging_bytes_in_use"):
                self.checks += 1
                if stats[key]:
                    raise Violation(f"(c) every room is terminal and no write is live, yet {node.name} has "
                                    f"{key}={stats[key]}")

    def check_drains(self) -> None:
        """(e), once every write is over and the loop is quiet: a decode room waits for no drain from a stage
        whose side of the room was released (that acknowledgement never comes; the pages would sit out the
        quarantine)."""
        stages = {n.mgr.endpoint: n for n in self.nodes.values() if not n.mgr._ctx.closed}
        for room in self.rooms.values():
            rx = self.rx(room)
            if rx is None or room.exempt or rx.is_released():
                continue
            for ep in rx.awaiting_drain:
                if ep in rx.settling:
                    continue  # acknowledged; the settle it asked for has not passed yet
                node = stages.get(ep)
                if node is None:
                    continue
                tx = self.tx(room, node.label)
                self.checks += 1
                if tx is not None and tx.is_released():
                    raise Violation(f"(e) room {room.rid}: the decode waits for a drain from {node.label}, whose "
                                    f"side ended {tx.status.name} and was released")

    def check_bounds(self, before: float) -> None:
        """(d): a call whose bound had passed when the last step started has had a quiet loop to end."""
        for op in self.ops:
            if op.task.done():
                continue
            self.checks += 1
            if op.started + op.bound + MARGIN <= before:
                raise Violation(f"(d) {op.name} (bound {op.bound:.3g}s) still runs "
                                f"{self.loop.time() - op.started:.3g}s after it started")

    # -- the end of a run ----------------------------------------------------------------------------
    def finish(self) -> None:
        """End every room (aborts from both sides, every write completed, the quarantine passed), then
        check that everything was released and returned."""

        def let_through() -> None:
            self.release_route()
            self.fabric.hang_handshakes(False)
            for node in self.nodes.values():
                node.mailbox.held = False

        self.step(let_through)

        def abort_decode() -> None:
            for room in self.rooms.values():
                self.rx_abort(room)

        def abort_prefill() -> None:
            for room in self.rooms.values():
                for stage in room.txs:
                    self.tx_abort(room, stage)

        self.step(abort_decode)
        self.check()
        self.step(abort_prefill)
        for _ in range(8):
            before = self.loop.time()
            self.step()
            self.check(before)
            pending = self.fabric.pending()
            if not pending and not self.fabric.live():
                break
            for w in pending:
                self.fabric.complete(w)
            self.advance(LANDING_GRACE)  # failed writes stop being able to land
        self.check_drains()
        self.advance(QUARANTINE + 1.0)
        before = self.loop.time()
        self.step()
        self.check(before)
        for room in self.rooms.values():
            sides: list[tuple[str, Any]] = [("rx", self.rx(room))]
            sides += [(s, self.tx(room, s)) for s in room.txs]
            for key, side in sides:
                self.checks += 1
                if side is not None and not side.is_released():
                    raise Violation(f"(c) room {room.rid} is never released on {key} ({side.status.name}, "
                                    f"{side.failure_reason})")
        for op in self.ops:
            self.checks += 1
            if not op.task.done():
                raise Violation(f"(d) {op.name} never ended")


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _outcome(w: Write) -> str:
    return f"{w.src} -> {w.dst}, {len(w.entries)} entries, posted at {w.posted_at:.3f}"
