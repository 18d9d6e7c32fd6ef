"""The parts of the interleaving tests' world (tests/interleave_world.py): its loop, its mailboxes, the
records of its managers, rooms and calls, and the managers' geometry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from aiotransfer import KVArgs, KVManager, KVPoll
from aiotransfer._control.messages import HelloAck, Topology
from aiotransfer._receiver import KVReceiver
from aiotransfer._sender import KVSender

PS, HEADS, HEAD_BYTES, PAGES = 2, 1, 16, 12
ITEM = PS * HEADS * HEAD_BYTES
STAGES = ("P0", "P1")


class SkewLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock runs ``SLOW`` times slower than real time, and which the test moves
    forward (timers fall due at once). A run of a few seconds of real time lasts a fraction of the shortest
    timeout here: timeouts expire when the test advances the clock, at the same step on every replay."""

    SLOW = 20.0

    def __init__(self) -> None:
        super().__init__()
        self.skew = 0.0
        self._origin = time.monotonic()

    def time(self) -> float:
        return self._origin + (time.monotonic() - self._origin) / self.SLOW + self.skew


class QuickContext(zmq.Context):
    """ZeroMQ sockets that reconnect to a restarted peer within milliseconds (the default waits 100 ms),
    so that what a step sends has arrived when the step ends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setsockopt(zmq.RECONNECT_IVL, 2)


class Mailbox:
    """A manager's inbound control messages, received over ZeroMQ and handed to the manager when the test
    delivers them: in one order on every replay (by sender, each sender's in arrival order). Topology and
    registration answers are held back while ``hold_route`` is set (a slow route)."""

    ROUTE = (HelloAck, Topology)

    def __init__(self, dispatch: Callable[[Any], None], hold_route: bool = False) -> None:
        self.dispatch = dispatch
        self.hold_route = hold_route
        self.held = False
        """Every message stays (a stage's mail held back, read later with a write's completion)."""
        self.inbox: list[tuple[str, int, Any]] = []
        self.arrived = 0

    def __call__(self, msg: Any) -> None:
        self.arrived += 1
        self.inbox.append((str(getattr(msg, "endpoint", "")), self.arrived, msg))

    def take(self) -> list[Any]:
        """The messages to deliver now, in order; held ones stay."""
        if self.held:
            return []
        ready = [m for m in self.inbox if not (self.hold_route and isinstance(m[2], self.ROUTE))]
        self.inbox = [m for m in self.inbox if m not in ready]
        return [m[2] for m in sorted(ready, key=lambda m: (m[0], m[1]))]


@dataclass
class Node:
    """One manager incarnation."""

    label: str
    mgr: KVManager
    bufs: list[np.ndarray]
    incarnation: int
    mailbox: Mailbox
    mail_at_completion: bool = False
    """Its held mail is read in the loop iteration whose poll sees one of its writes end."""
    sent_to: dict[str, int] = field(default_factory=dict)
    """Messages this manager handed to ZeroMQ, by destination endpoint."""
    base: dict[str, int] = field(default_factory=dict)
    """``sent_to`` when the manager now at that endpoint started (what was sent before went to its
    predecessor)."""

    def count_sends(self) -> None:
        """Count what the control plane sends (the test waits until it has all arrived)."""
        plane = self.mgr._ctx.control
        send_frames, try_send = plane.send_frames, plane.try_send

        async def counted_send(endpoint: str, frames: list[bytes], **kw: Any) -> None:
            await send_frames(endpoint, frames, **kw)
            self.sent_to[endpoint] = self.sent_to.get(endpoint, 0) + 1

        def counted_try(endpoint: str, msg: Any, **kw: Any) -> bool:
            ok = try_send(endpoint, msg, **kw)
            if ok:
                self.sent_to[endpoint] = self.sent_to.get(endpoint, 0) + 1
            return ok

        plane.send_frames = counted_send  # type: ignore[method-assign]
        plane.try_send = counted_try  # type: ignore[method-assign]

    @property
    def name(self) -> str:
        return f"{self.label}#{self.incarnation}"


@dataclass
class Room:
    rid: int
    pages: list[int]
    src: list[int]
    rx: KVReceiver
    rx_node: str
    txs: dict[str, tuple[KVSender, str]] = field(default_factory=dict)
    exempt: bool = False
    """A manager of this room restarted while it was open: its reasons differ by design."""
    terminal: dict[str, tuple[KVPoll, int, bool]] = field(default_factory=dict)
    """Per side, the first terminal status seen, the step it was seen after, and whether the side held unread
    mail then (it ended before reading what the other side had sent)."""


@dataclass
class Op:
    name: str
    task: asyncio.Task[Any]
    started: float
    bound: float


def node_args(label: str) -> tuple[KVArgs, list[np.ndarray]]:
    if label == "D":
        bufs = [np.zeros((PAGES, ITEM), dtype=np.uint8) for _ in range(4)]
        return KVArgs(bufs, page_size=PS, dtype="uint8", kv_layer_ids=[0, 0, 1, 1], kv_heads=HEADS,
                      total_kv_heads=HEADS), bufs
    q = STAGES.index(label)
    bufs = [np.full((PAGES, ITEM), q + 1, dtype=np.uint8) for _ in range(2)]
    return KVArgs(bufs, page_size=PS, dtype="uint8", pp_size=2, pp_rank=q, kv_layer_ids=[q, q],
                  kv_heads=HEADS, total_kv_heads=HEADS), bufs
