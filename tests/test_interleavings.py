"""Interleavings of one room's awaits against aborts, timeouts, restarts and forged messages.

Three managers in this process on the memory engine (``aiotransfer.testing``, manual mode) and real ZeroMQ
on 127.0.0.1: two prefill pipeline stages (PP 2, stage 0 the bootstrap leader) and one decode (PP 1) that
pulls each room from both stages. The test owns the event loop (its clock can be moved forward), every engine
write's completion, engine credit (two entries in flight per peer), the delivery of the decode's
topology and registration answers (held back to make a route slow), and a stage's mail (held back, then
read later, or in the loop iteration whose poll sees one of its writes end: a message that arrived with the
completion, read before the call waiting on the write resumes). A hypothesis state machine
interleaves opening rooms, metadata, whole and streamed sends, aborts from either side, ``done()`` and
``released()`` waits with short timeouts, restarts of any manager on its port, heartbeats, forged
duplicate Success reports, engine completions and failures (with or without the held mail read at once),
failed entries, hanging handshakes, and time. Each step runs the loop until it
is quiet: every message sent has arrived and was delivered (manager by manager, each sender's in order),
and nothing moves; the loop's clock runs twenty times slower than real time, so timeouts expire when a
step advances it, at the same step on every replay. Staging is off (direct writes only). After every
step it checks:

(a) no engine write is live over (or posted into) a decode page that is free, that changed hands while
    the write was live, or whose room the decode released; the decode frees a room's pages, as a
    scheduler does, only when ``rx.is_released()``;
(b) a room ends once on each side, and once both sides have failed they name the same reason;
(c) once every room is terminal and no write is live, nothing is in flight, held or staged anywhere;
(d) no public call outlives its timeout (plus the time to notice it: one quiet loop);
(e) at the end of a run, once every write is over: no decode room waits for a drain acknowledgement from a
    stage whose side of the room was released (it would never come: the pages would sit out the quarantine);
(f) no engine call made on the event loop waited for the engine's mutex (a hanging handshake held it).

The memory engine answers as the real engines do (aiotransfer.testing, pinned by
tests/test_engine_conformance.py): a write past the engine's timeout is doomed but still lands until it
ends, a doomed write can complete late, one entry can fail while the others run, a failed write's bytes may
land for ``LANDING_GRACE`` more, and a handshake holds the engine's mutex while the rules keep it hanging. A
write that outlives the release quarantine is beyond what the library promises (its prefill abandons it, or
the decode's quarantine released the room): (a) counts those checks apart, in the summary line.

Differences the checks allow. By design, from the docs: a prefill stage that concluded Success while the
decode failed the room (the decode gave up, or the other stage failed: each stage concludes on its own); a
stage that no request of the decode reached (it has no room to share a reason with yet); two sides that
fail on their own in the same instant (aborts that cross, timeouts that expire together, both stages'
writes failing at once: the decode takes the first reason it hears) or while one still holds the other's
message unread (a held abort that crossed the stage's own failure), each keeping its own reason; rooms
open on a manager that restarted (the dead side ends with ``manager closed``). A stage told of a failure by the decode's abort words it ``aborted by decode: <reason>`` where the
decode's own reason is ``<reason>`` (another stage's failure, a restarted or refusing stage), as
docs/errors.md says: the checks accept that wording.

``AIOTRANSFER_INTERLEAVING_EXAMPLES`` and ``AIOTRANSFER_INTERLEAVING_STEPS`` raise the budget
(``make soak``, which also shrinks a failing run to a minimal one; ``AIOTRANSFER_INTERLEAVING_SHRINK=1``
does that at the fixed budget).

An abort against the write that concludes a stage's side is also run in every order (read before the write
ends, with its completion, after the call that sent it returned; the write done or failed; either stage),
with a negative control: the explorer above reaches that crossing only by chance.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from aiotransfer import KVPoll
from aiotransfer._receiver import KVReceiver
from aiotransfer.engines._base import EngineStatus
from tests.interleave_parts import STAGES, Room
from tests.interleave_world import ENGINE_TIMEOUT, EXAMPLES, LANDING_GRACE, SOAK, STEPS, Violation, World

# ---------------------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------------------

TOTALS = {"examples": 0, "steps": 0, "checks": 0, "restless": 0, "beyond": 0}

stages = st.sampled_from(STAGES)
short_or_long = st.sampled_from([0.3, 2.5])


class Interleavings(RuleBasedStateMachine):
    rooms = Bundle("rooms")

    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self._before = 0.0
        self._broken = False
        TOTALS["examples"] += 1

    @initialize(slow_first_route=st.booleans())
    def start(self, slow_first_route: bool) -> None:
        """The three managers; the decode's first route may start slow (its answers held back)."""
        self.world.run(self.world.start())
        if slow_first_route:
            self.world.step(self.world.hold_route)

    def _do(self, action: Callable[[], Any]) -> None:
        self._before = self.world.loop.time()
        self.world.step(action)
        TOTALS["steps"] += 1

    @invariant()
    def lifecycle(self) -> None:
        if not self.world.nodes:
            return
        try:
            self.world.check(self._before)
        except Violation:
            self._broken = True
            raise

    def teardown(self) -> None:
        try:
            if self.world.nodes and not self._broken:
                self.world.finish()
        finally:
            TOTALS["checks"] += self.world.checks
            TOTALS["restless"] += self.world.restless
            TOTALS["beyond"] += self.world.beyond_bound
            self.world.teardown()

    # -- rooms ----------------------------------------------------------------------------------
    @rule(target=rooms, scattered=st.booleans())
    def new_room(self, scattered: bool) -> Any:
        """A decode room with pages and nothing else yet."""
        room: Room | None = None

        def new() -> None:
            nonlocal room
            room = self.world.new_room(scattered)

        self._do(new)
        return room.rid if room is not None else 0

    @rule(target=rooms, scattered=st.booleans())
    def ready_room(self, scattered: bool) -> Any:
        """A room opened on both sides, its metadata on its way."""
        w = self.world
        room: Room | None = None

        def open_all() -> None:
            nonlocal room
            room = w.ready(scattered)

        self._do(open_all)
        return room.rid if room is not None else 0

    @rule(target=rooms)
    def ready_whole_room(self) -> Any:
        """A room whose pages are one run on both sides: a stage's write is one handle, and its Success
        leaves from the write's completion."""
        room: Room | None = None

        def open_all() -> None:
            nonlocal room
            room = self.world.ready(scattered=False, whole=True)

        self._do(open_all)
        return room.rid if room is not None else 0

    def _on(self, rid: int, action: Callable[[Room], Any]) -> None:
        room = self.world.rooms.get(rid)
        self._do((lambda: action(room)) if room is not None else (lambda: None))

    @rule(room=rooms, stage=stages)
    def open_sender(self, room: int, stage: str) -> None:
        self._on(room, lambda r: self.world.open_sender(r, stage))

    @rule(room=rooms, timeout=short_or_long)
    def send_metadata(self, room: int, timeout: float) -> None:
        self._on(room, lambda r: self.world.send_metadata(r, timeout))

    @rule(room=rooms, stage=stages, layers=st.booleans(), timeout=short_or_long)
    def send(self, room: int, stage: str, layers: bool, timeout: float) -> None:
        """The stage's whole chunk: with ``send_kv``, or opened as a stream and sent with ``send_layers``."""
        send = self.world.stream if layers else self.world.send_kv
        self._on(room, lambda r: send(r, stage, timeout))

    @rule(room=rooms, side=st.sampled_from(("D", *STAGES)))
    def abort(self, room: int, side: str) -> None:
        self._on(room, lambda r: self.world.rx_abort(r) if side == "D" else self.world.tx_abort(r, side))

    @rule(room=rooms, call=st.sampled_from(["rx.done", "rx.released", "P0.wait_ready", "P1.wait_ready",
                                            "P0.done", "P1.done"]), timeout=short_or_long)
    def wait(self, room: int, call: str, timeout: float) -> None:
        """A bounded wait; ``rx.done`` aborts the room when it times out."""
        w = self.world
        side = call.split(".")[0]
        calls: dict[str, Callable[[Room], None]] = {
            "rx.done": lambda r: w.rx_done(r, timeout), "rx.released": lambda r: w.rx_released(r, timeout),
            f"{side}.wait_ready": lambda r: w.wait_ready(r, side, timeout),
            f"{side}.done": lambda r: w.tx_done(r, side, timeout),
        }
        self._on(room, calls[call])

    @rule(room=rooms)
    def forge_duplicate_success(self, room: int) -> None:
        self._on(room, self.world.forge_success)

    # -- the engine, the network, time --------------------------------------------------------------
    @rule(index=st.integers(0, 7), ok=st.booleans())
    def engine_write_ends(self, index: int, ok: bool) -> None:
        """One live write completes (or fails) in the engine; its credit goes back."""
        self._do(lambda: self.world.settle_write(index, ok))

    @rule(index=st.integers(0, 7), ok=st.booleans())
    def engine_write_ends_with_mail(self, index: int, ok: bool) -> None:
        """One live write ends, and the mail its stage holds is read in the loop iteration that sees it end,
        before the call waiting on the write resumes (an abort that crossed the stage's Success)."""
        self._do(lambda: self.world.write_ends_with_mail(index, ok))

    @rule(index=st.integers(0, 7))
    def engine_entry_fails(self, index: int) -> None:
        """One entry of a pending write fails while its others still run: the write is doomed, not over."""
        self._do(lambda: self.world.fail_entry(index))

    @rule(hang=st.booleans())
    def handshakes_hang(self, hang: bool) -> None:
        """Engine handshakes hold the engine's mutex until released (a peer that does not answer the engine's
        metadata request): writes wait on the driver, never on the loop."""
        self._do(lambda: self.world.hang_handshakes(hang))

    @rule(stage=stages, hold=st.booleans())
    def stage_mail(self, stage: str, hold: bool) -> None:
        """Hold back (or let through) every message a prefill stage receives."""
        self._do(lambda: self.world.hold_mail(stage, hold))

    @rule(ok=st.booleans())
    def engine_catches_up(self, ok: bool) -> None:
        """The engine finishes (or fails) every write it holds, and those that were waiting for credit."""
        self._do(lambda: self.world.settle_all(ok))

    @rule(seconds=st.sampled_from([0.5, 3.0, ENGINE_TIMEOUT + 0.5]))
    def advance_time(self, seconds: float) -> None:
        self._do(lambda: self.world.advance(seconds))

    @rule(hold=st.booleans())
    def route(self, hold: bool) -> None:
        """Hold back (or deliver) the decode's topology and registration answers."""
        self._do(self.world.hold_route if hold else self.world.release_route)

    @rule()
    def heartbeat(self) -> None:
        self._do(self.world.heartbeat)

    @rule(which=st.sampled_from(["P0", "P1", "D"]))
    def restart(self, which: str) -> None:
        self._do(lambda: self.world.restart(which))


SHRINK = SOAK or bool(os.environ.get("AIOTRANSFER_INTERLEAVING_SHRINK"))
"""Shrink a failing run to a minimal one (minutes); the fixed budget prints the failing run as found."""


def _settings(examples: int, steps: int) -> settings:
    phases = list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
                    database=None, suppress_health_check=list(HealthCheck), print_blob=False, phases=phases)


Interleavings.TestCase.settings = _settings(EXAMPLES, STEPS)


def _run(machine: type[RuleBasedStateMachine], what: str) -> None:
    t0 = time.monotonic()
    before = dict(TOTALS)
    try:
        machine.TestCase("runTest").runTest()
    finally:
        done = {k: TOTALS[k] - before[k] for k in TOTALS}
        print(f"\n{what}: {done['examples']} examples, {done['steps']} steps, {done['checks']} invariant checks, "
              f"{done['restless']} steps never quiet, {done['beyond']} page checks of writes beyond the quarantine, "
              f"{time.monotonic() - t0:.1f}s")


@pytest.mark.timeout(0 if SOAK else 900)
def test_interleavings() -> None:
    """Every rule, the budget above."""
    _run(Interleavings, "interleavings")


# ---------------------------------------------------------------------------------------------------
# The known races, each explored by the rules that reach it (fixed seeds, small budgets)
# ---------------------------------------------------------------------------------------------------


class LayersAfterRelease(Interleavings):
    """A streamed layer batch waiting for engine credit while the decode aborts its room: the batch must
    hold the room from its first await, or it posts into pages the decode was told are drained."""

    new_room = open_sender = send_metadata = wait = forge_duplicate_success = None  # type: ignore[assignment]
    advance_time = route = heartbeat = restart = None  # type: ignore[assignment]
    ready_whole_room = engine_write_ends_with_mail = stage_mail = None  # type: ignore[assignment]
    engine_entry_fails = handshakes_hang = None  # type: ignore[assignment]

    @initialize()
    def start(self) -> None:
        self.world.run(self.world.start())


class LateRequest(Interleavings):
    """An abort or a done() timeout while the decode's route is slow: the request must not leave after the
    room failed (the prefill answered the abort with Drained and would serve it)."""

    new_room = open_sender = send_metadata = forge_duplicate_success = None  # type: ignore[assignment]
    engine_write_ends = engine_catches_up = heartbeat = restart = None  # type: ignore[assignment]
    ready_whole_room = engine_write_ends_with_mail = stage_mail = None  # type: ignore[assignment]
    engine_entry_fails = handshakes_hang = None  # type: ignore[assignment]


class DuplicateSuccess(Interleavings):
    """A source reporting Success twice, under another stage's rank: the decode must count sources, not
    rank numbers, or it releases pages the other stage still writes."""

    new_room = open_sender = send_metadata = wait = abort = send = None  # type: ignore[assignment]
    advance_time = route = heartbeat = restart = engine_write_ends = None  # type: ignore[assignment]
    ready_whole_room = engine_write_ends_with_mail = stage_mail = None  # type: ignore[assignment]
    engine_entry_fails = handshakes_hang = None  # type: ignore[assignment]

    @initialize()
    def start(self) -> None:
        self.world.run(self.world.start())

    @rule(room=Interleavings.rooms, stage=stages, timeout=short_or_long)
    def send_whole(self, room: int, stage: str, timeout: float) -> None:
        """Whole chunks only (``send_kv``): a stage's write stays live while the other stage concludes."""
        self._on(room, lambda r: self.world.send_kv(r, stage, timeout))


FOCUSED_EXAMPLES = max(EXAMPLES, 40)
LayersAfterRelease.TestCase.settings = _settings(FOCUSED_EXAMPLES, 12)
LateRequest.TestCase.settings = _settings(FOCUSED_EXAMPLES, 12)
DuplicateSuccess.TestCase.settings = _settings(2 * FOCUSED_EXAMPLES, 10)


@pytest.mark.timeout(0 if SOAK else 600)
def test_layer_batch_is_not_posted_after_its_room_was_released() -> None:
    _run(LayersAfterRelease, "layers after release")


@pytest.mark.timeout(0 if SOAK else 600)
def test_no_request_leaves_after_its_room_failed_during_a_slow_route() -> None:
    _run(LateRequest, "late request")


@pytest.mark.timeout(0 if SOAK else 600)
def test_a_duplicate_success_under_another_rank_completes_nothing() -> None:
    _run(DuplicateSuccess, "duplicate success")


def test_a_decode_restart_seen_late_fails_only_the_old_rooms() -> None:
    """The decode restarts on its port and opens a room with the new process (which registers again);
    only then does a heartbeat show the prefill stages the new incarnation. The room the new decode opened
    must not end on the prefill alone (reasons agree once both sides end: invariant (b))."""
    with world() as w:
        checked(w, lambda: w.ready(scattered=False))
        checked(w, w.heartbeat)
        checked(w, lambda: w.restart("D"))
        checked(w, lambda: w.ready(scattered=False))
        checked(w, w.heartbeat)
        w.finish()


# ---------------------------------------------------------------------------------------------------
# The checks can fail
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def world() -> Iterator[World]:
    w = World()
    try:
        w.run(w.start())
        yield w
    finally:
        w.teardown()


def checked(w: World, action: Callable[[], Any] = lambda: None) -> None:
    before = w.loop.time()
    w.step(action)
    w.check(before)


def _asked_room(w: World, whole: bool = False) -> Room:
    """A room whose decode sent its metadata to both stages, each with a sender open (``whole``: see
    :meth:`World.new_room`)."""
    room = w.new_room(scattered=False, whole=whole)
    assert room is not None

    def ready() -> None:
        for stage in STAGES:
            w.open_sender(room, stage)
        w.send_metadata(room, 2.5)

    checked(w, ready)
    return room


def test_the_checks_catch_a_decode_that_releases_without_a_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the decode's drain wait removed (a failed room releases its pages at once), an abort while a
    write is live is caught: invariant (a)."""

    def release_at_once(rx: KVReceiver, status: KVPoll) -> None:
        if status.is_terminal:
            rx._release("nothing-sent")

    monkeypatch.setattr(KVReceiver, "_changed", release_at_once)
    with world() as w:
        room = _asked_room(w)
        checked(w, lambda: w.send_kv(room, "P0", 2.5))
        assert w.fabric.live(), "the write stays live until the test completes it"
        with pytest.raises(Violation, match=r"\(a\) write .* is live over decode page"):
            checked(w, lambda: w.rx_abort(room))


def test_the_checks_catch_a_call_that_outlives_its_timeout() -> None:
    """A wait that ignores its bound is caught: invariant (d)."""
    with world() as w:
        w.launch("a wait with no end", asyncio.Event().wait(), 0.3)
        checked(w)
        w.advance(1.0)  # its bound passes before the next step, which is a quiet loop to notice it in
        with pytest.raises(Violation, match=r"\(d\) a wait with no end"):
            checked(w)


def _a_write_that_outlives_the_engine_timeout(w: World) -> None:
    room = _asked_room(w)
    checked(w, lambda: w.send_kv(room, "P0", 2.5))
    assert len(w.fabric.pending()) >= 1
    checked(w, lambda: w.advance(ENGINE_TIMEOUT + 0.5))  # the engine's timeout passes: the write still runs
    for _ in range(8):  # the calls' own bounds, the drain acknowledgements and the settles they ask for
        checked(w, lambda: w.advance(LANDING_GRACE + 0.5))
    w.finish()


def test_a_write_that_outlives_the_engine_timeout_pins_its_pages() -> None:
    """The write is doomed (the room fails at once) and still in flight: no side releases its pages before it
    ends; ``finish`` then completes it late and everything is released."""
    with world() as w:
        _a_write_that_outlives_the_engine_timeout(w)


def test_the_checks_catch_a_timeout_taken_for_an_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: an adapter that answers FAILED once the engine's timeout passed (what the Mooncake
    adapter did with ``get_batch_transfer_status``'s -1 and ``transfer_check_status``'s -2) lets the prefill
    drain and the decode release pages the write still lands in: invariant (a)."""
    from aiotransfer.testing import MemoryEngine

    check = MemoryEngine.check

    def timeout_is_an_end(self: MemoryEngine, handle: Any) -> Any:
        status = check(self, handle)
        if handle.doomed is not None and not handle.consumed:
            return handle.finish(EngineStatus.FAILED, handle.doomed)
        return status

    monkeypatch.setattr(MemoryEngine, "check", timeout_is_an_end)
    with world() as w, pytest.raises(Violation, match=r"\(a\) write .* is live over decode page"):
        _a_write_that_outlives_the_engine_timeout(w)


def _a_write_while_a_handshake_hangs(w: World) -> None:
    """A stage writes a room while another stage's engine handshake (a decode registering with it) holds the
    engine's mutex: the handshake runs on a thread of its own, as on that stage's driver."""
    import threading

    room = _asked_room(w)
    checked(w, lambda: w.hang_handshakes(True))
    p1, d = w.nodes["P1"].mgr.engine, w.nodes["D"].mgr.engine
    handshake = threading.Thread(target=p1.connect, args=(d.session_id, b"", 0), daemon=True)
    handshake.start()
    try:
        for _ in range(500):
            if w.fabric.handshakes:
                break
            time.sleep(0.002)
        checked(w, lambda: w.send_kv(room, "P0", 2.5))
    finally:
        w.hang_handshakes(False)
        handshake.join(5)
    checked(w)


def test_a_write_made_while_a_handshake_hangs_never_waits_on_the_loop() -> None:
    """The write goes to the driver, which waits for the handshake; invariant (f) holds."""
    with world() as w:
        _a_write_while_a_handshake_hangs(w)
        p0 = w.nodes["P0"].mgr.engine.session_id
        assert any(wr.src == p0 for wr in w.fabric.writes), "the stage wrote the room"
        assert not w.fabric.loop_waits
        w.finish()


def test_the_checks_catch_a_loop_that_waits_on_the_engine_mutex(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the gate removed (writes always posted from the loop), the same write waits on
    the mutex the hanging handshake holds, on the loop: invariant (f)."""
    from aiotransfer.testing import MemoryEngine

    monkeypatch.setattr(MemoryEngine, "try_submit_inline", MemoryEngine.submit_write)
    with world() as w, pytest.raises(Violation, match=r"\(f\) the event loop waited on the engine mutex"):
        _a_write_while_a_handshake_hangs(w)


def test_the_checks_catch_a_drain_acknowledgement_that_never_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the decode deaf to drain acknowledgements, a room it aborted waits for stages whose side of the
    room was released: invariant (e), before the run's end moves the clock past the quarantine."""
    from aiotransfer._kv.decode import DecodeSide

    monkeypatch.setattr(DecodeSide, "on_drained", lambda self, msg: None)
    with world() as w:
        room = _asked_room(w)
        checked(w, lambda: w.rx_abort(room))
        with pytest.raises(Violation, match=r"\(e\) room .* waits for a drain from P"):
            w.finish()


# ---------------------------------------------------------------------------------------------------
# An abort against the write that concludes the room, in every order
# ---------------------------------------------------------------------------------------------------

READ = ("before", "with", "after")
"""When the stage reads the decode's abort: before the write ends; in the loop iteration whose poll sees it
end (the stage has sent Success from the completion, its ``send_kv`` has not returned); after that call."""


def _abort_against_the_last_write(stage: str, ok: bool, read: str) -> None:
    with world() as w:
        room = _asked_room(w, whole=True)
        checked(w, lambda: w.send_kv(room, stage, 2.5))
        assert len(w.fabric.live()) == 1, "one handle: its completion concludes the stage's side"
        if read != "before":
            checked(w, lambda: w.hold_mail(stage, True))
        checked(w, lambda: w.rx_abort(room))
        if read == "with":
            checked(w, lambda: w.write_ends_with_mail(0, ok))
        else:
            checked(w, lambda: w.settle_write(0, ok))
            checked(w, lambda: w.hold_mail(stage, False))
        w.finish()


ORDERS = [(stage, ok, read) for stage in STAGES for ok in (True, False) for read in READ]


@pytest.mark.parametrize(("stage", "ok", "read"), ORDERS)
def test_an_abort_against_the_write_that_concludes_the_room(stage: str, ok: bool, read: str) -> None:
    """Every order of the decode's abort against the stage's one write (done or failed): every invariant
    holds, (e) included: an abort read with the completion that sent Success is acknowledged at once."""
    _abort_against_the_last_write(stage, ok, read)


def test_the_orders_reach_an_abort_that_crosses_the_success(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the acknowledgement of an abort that crossed Success withheld (the code before
    it was fixed), exactly the orders where the abort is read with a completed write's Success fail (e)."""
    from aiotransfer._kv.prefill import PrefillSide

    drained_now = PrefillSide.drained_now

    def withheld(self: PrefillSide, room: int, endpoint: str, reason: str | None = None) -> None:
        ended = self._draining.get(room)
        if ended is None or ended.status is not KVPoll.Success:
            drained_now(self, room, endpoint, reason)

    monkeypatch.setattr(PrefillSide, "drained_now", withheld)
    caught = set()
    for order in ORDERS:
        try:
            _abort_against_the_last_write(*order)
        except Violation as exc:
            assert str(exc).startswith("(e)"), exc
            caught.add(order)
    assert caught == {(stage, True, "with") for stage in STAGES}

