"""``RankContext``: what every part of one rank shares.

Config, buffers, the engine, its driver thread, the offload executor, the poll loop, the control plane,
liveness, the staging arena, counters and metrics, and the spawning of background tasks. The parts (prefill side, decode side,
push, staging, leader) each hold the context and nothing of each other but what they are handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

from .._args import KVArgs
from .._aux_state import StateType, select_aux_path
from .._config import AuxPath, TransferConfig, aux_tcp_forced
from .._control.endpoint import ControlPlane
from .._control.messages import Message
from .._convert import PageGeometry, plane_views
from .._deadline import Deadline
from .._device import device_initializer
from .._driver import Driver
from .._layout import RankGeometry
from .._liveness import Liveness
from .._metrics import Metrics
from .._offload import Offloader
from .._plan import as_index_array, check_range, check_unique
from .._poller import Poller
from .._staging import ArenaCopier, HostCopier, StagingArena, host_view, staging_backend
from .._topology import ParallelInfo
from .._types import PageIndices
from ..engines._base import MemoryRegion, TransferEngine
from ..errors import (
    AiotransferError,
    ClosedError,
    EngineError,
    InvalidArgument,
    PeerError,
    TransferFailed,
    TransferTimeout,
)

__all__ = [
    "RankContext", "annotate", "check_aux_index", "engine_failures", "merge_regions", "state_mismatch",
    "validate_state_indices",
]

log = logging.getLogger("aiotransfer.manager")

ANSWERS_PER_PEER = 16
"""Answers to one destination waiting to leave (each a task bounded by the handshake timeout): a peer that
reads its messages leaves none waiting; beyond this it is not reading, or another host floods us in its name."""
ANSWERS_TOTAL = 1024
"""Answers waiting to leave, all destinations together: what a flood naming many endpoints can hold."""


class RankContext:
    """Shared state of one rank. The manager fills in ``engine``, ``poller`` and ``control`` at start."""

    def __init__(
        self, args: KVArgs, config: TransferConfig, engine: TransferEngine | None, liveness: Liveness
    ) -> None:
        self.args = args
        self.config = config
        self.generation = secrets.randbits(62)
        """This manager's incarnation: a peer seeing it change knows we restarted."""
        self.liveness = liveness
        self.counters: Counter[str] = Counter()
        self.metrics = Metrics()
        # Device first (engines allocate per-device resources at init), and on every executor thread.
        self.offload = Offloader(config.engine, config.executor_threads, initializer=device_initializer(config))
        self.driver = Driver(config.engine, initializer=device_initializer(config))
        """The one thread that makes the engine's calls that may wait (creation, registration, handshakes,
        the writes the loop cannot post, close)."""
        self.engine_or_none: TransferEngine | None = engine
        self.poller_or_none: Poller | None = None
        self.engine_info = b""
        """What a peer needs to reach our engine (``engine.local_info()`` once our memory is registered)."""
        self.control_or_none: ControlPlane | None = None
        self.on_send_failed: Callable[[str, str, AiotransferError], None] | None = None
        """Told when an answer to a peer could not leave (its endpoint, what it was, why): the manager fails the
        rooms it has with that peer, with the reason, and tells the peer (see :meth:`reply`)."""
        self._send_failed_logged = 0.0
        self._answers: dict[str, int] = {}
        """Answers waiting to leave, by destination (see :meth:`answer`)."""
        self._answers_total = 0
        self.started = False
        self.closed = False
        host_kv = all(b.device == "cpu" for b in args.kv)
        self.kv_views: list[np.ndarray] | None = [host_view(b.ptr, b.nbytes) for b in args.kv] if host_kv else None
        """Writable host views of the KV buffers (None when any KV buffer lives on a device)."""
        geo = args.page_geometry()
        self.page_geometry: PageGeometry | None = None if isinstance(geo, str) else geo
        """How our pages hold tokens (None when ``KVArgs`` does not say enough to convert them)."""
        self.planes: list[np.ndarray] | None = None
        """Per (K or V, layer): our pages as (page, token, head, byte) views, for converted transfers."""
        if self.page_geometry is not None and self.kv_views is not None:
            with contextlib.suppress(InvalidArgument):
                self.planes = plane_views(self.kv_views, self.page_geometry)
        staging = _copier(args, config, self.kv_views)
        self.staging_backend: str | None = staging[0] if staging is not None else None
        """``numpy`` or ``torch``: what gathers and scatters staged pieces (None when staging is off)."""
        self.copier: ArenaCopier | None = staging[1] if staging is not None else None
        self.arena: StagingArena | None = self.copier.arena if self.copier is not None else None
        self.kv_bases = np.array([b.ptr for b in args.kv], dtype=np.uint64)
        self.num_pages = args.num_pages
        """Pages addressable in every KV buffer: the bound of page indices, fixed with the registered memory."""
        self.aux_bases = np.array([b.ptr for b in args.aux], dtype=np.uint64)
        self.aux_item_lens = np.array([b.item_len for b in args.aux], dtype=np.uint64)
        self.compat = args.compat_hash()
        self.aux_path: AuxPath = select_aux_path(config.aux_path, config.custom_mem_pool,
                                                 env_force_tcp=aux_tcp_forced())
        """The aux path this rank uses (``ENGINE`` may still fall back to TCP on ``auto``)."""
        self.parallel = ParallelInfo(
            args.tp_size, args.tp_rank, args.pp_size, args.pp_rank, args.cp_size, args.cp_rank, args.dp_rank
        )
        self.geometry = RankGeometry(
            layout=args.layout, page_size=args.page_size, item_lens=[b.item_len for b in args.kv],
            layer_ids=[b.layer_id for b in args.kv], tp_size=args.tp_size, tp_rank=args.tp_rank,
            kv_heads=args.kv_heads, total_kv_heads=args.total_kv_heads, outer=args.outer,
        )
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- what start() provides ------------------------------------------------------------------
    @property
    def engine(self) -> TransferEngine:
        return _started(self.engine_or_none)

    @property
    def poller(self) -> Poller:
        return _started(self.poller_or_none)

    @property
    def control(self) -> ControlPlane:
        return _started(self.control_or_none)

    @property
    def endpoint(self) -> str:
        """This rank's control address."""
        return self.control_or_none.endpoint if self.control_or_none is not None else ""

    @property
    def engine_name(self) -> str:
        """The engine family as peers compare it (``mooncake_tcp`` is Mooncake)."""
        return self.config.engine.replace("mooncake_tcp", "mooncake")

    @property
    def rank_id(self) -> int:
        return self.parallel.unique_rank

    def regions(self) -> list[MemoryRegion]:
        """Every region the engine must register: buffers, plus the staging arena."""
        regions = [MemoryRegion(b.ptr, b.nbytes, b.device) for b in self.args.all_buffers()]
        if self.arena is not None:
            regions.append(MemoryRegion(self.arena.ptr, self.arena.nbytes, self.arena.device))
        # Back-to-back buffers (per-layer views of one tensor) are registered as one region: the planner
        # merges entries across such buffers, and engines require every entry inside one registration.
        return merge_regions(regions)

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("manager is closed")
        if not self.started:
            raise ClosedError(_NOT_STARTED)

    async def on_worker_threads(self, fn: Callable[[str], None], timeout: float) -> None:
        """``fn("driver")`` on the engine's driver thread, then ``fn("offload")`` once on every offload thread:
        each offload job waits at a barrier until every thread holds one, so no thread takes two."""
        self.check_open()
        await self.driver.run(fn, "driver", timeout=timeout, what="diagnostic call on the driver")
        n = self.offload.threads
        barrier = threading.Barrier(n)

        def job() -> None:
            try:
                barrier.wait(timeout)
            except threading.BrokenBarrierError:
                raise TransferTimeout(f"the offload threads did not all take a diagnostic call within {timeout:.3g}s "
                                      "(busy with other work)") from None
            fn("offload")

        await asyncio.gather(*(self.offload.run(job, timeout=timeout, what="diagnostic call on an offload thread")
                               for _ in range(n)))

    # -- tasks and messages ---------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; the manager cancels what is left at close."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_tasks(self, timeout: float = 2.0) -> None:
        """Cancel every background task and wait (bounded) until they have ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            ended, stuck = await asyncio.wait(tasks, timeout=timeout)
            for task in ended:
                if not task.cancelled():
                    task.exception()  # retrieved: a task that failed while closing is not news
            for task in stuck:
                log.warning("background task %s did not end within %.3gs of its cancellation", task.get_name(),
                            timeout)

    def drop(self, cause: str, detail: str) -> None:
        """Count and log a control message we refuse (it never raises into the receive loop)."""
        self.counters[f"dropped_{cause}"] += 1
        log.debug("dropped control message (%s): %s", cause, detail)

    async def send(self, endpoint: str, msg: Message, deadline: Deadline, *, yield_cpu: bool = False) -> None:
        await self.control.send(endpoint, msg, timeout=deadline.remaining(), yield_cpu=yield_cpu)

    def answer(self, endpoint: str, msg: Message, name: str) -> None:
        """An answer to a peer's message (a ``Pong``, a "register again", a staging answer, a topology): handed
        to ZeroMQ at once when it can take it, without a task. One that must wait becomes a task bounded by the
        handshake timeout (:meth:`reply`), at most :data:`ANSWERS_PER_PEER` for one destination and
        :data:`ANSWERS_TOTAL` in all; beyond either it is dropped and counted (``dropped_answer-over-cap``). A
        flood of requests in the name of an endpoint nobody reads therefore costs a bounded number of tasks."""
        control = self.control_or_none
        if control is None or self.closed or control.try_send(endpoint, msg):
            return
        waiting = self._answers.get(endpoint, 0)
        if waiting >= ANSWERS_PER_PEER or self._answers_total >= ANSWERS_TOTAL:
            self.drop("answer-over-cap", f"{type(msg).__name__} to {endpoint}")
            return
        self._answers[endpoint] = waiting + 1
        self._answers_total += 1
        self.spawn(self.reply(endpoint, msg), name).add_done_callback(functools.partial(self._answered, endpoint))

    def _answered(self, endpoint: str, _task: object) -> None:
        self._answers_total -= 1
        left = self._answers.get(endpoint, 0) - 1
        if left > 0:
            self._answers[endpoint] = left
        else:
            self._answers.pop(endpoint, None)

    async def reply(self, endpoint: str, msg: Message) -> None:
        """An answer, bounded by the handshake timeout. One that cannot leave is not swallowed: it is counted
        (``control_send_failed``) and :attr:`on_send_failed` fails the rooms held with that peer."""
        if self.control_or_none is None:
            return
        try:
            await self.control_or_none.send(endpoint, msg, timeout=self.config.handshake_timeout)
        except AiotransferError as exc:
            self.send_failed(endpoint, type(msg).__name__, exc)

    def send_failed(self, endpoint: str, what: str, exc: AiotransferError) -> None:
        """A message to ``endpoint`` could not leave (see :meth:`reply`)."""
        if self.closed:
            return
        self.counters["control_send_failed"] += 1
        now = time.monotonic()
        if now - self._send_failed_logged > 1.0:  # rate-limited: answers to a flood may all fail
            self._send_failed_logged = now
            log.warning("%s to %s could not leave: %s [%d so far]", what, endpoint, exc,
                        self.counters["control_send_failed"])
        if self.on_send_failed is not None:
            self.on_send_failed(endpoint, what, exc)

    def yield_after_notify(self) -> bool:
        """Yield the CPU to ZMQ's I/O thread after a Success (prefill) or a transfer request (decode), the two
        messages on a room's path, only when no transfer of ours waits for the loop,
        and only on engines whose threads sleep while idle: ``sched_yield`` hands the CPU to any runnable
        thread, and a spinning one (NIXL over UCX) keeps it for a whole time slice (4 KiB end to end on NIXL
        shm measured 2.3 ms with the yield, 0.68 ms without)."""
        return (
            self.config.yield_after_notify
            and self.engine_or_none is not None
            and self.engine_or_none.traits.quiet_threads
            and (self.poller_or_none is None or self.poller_or_none.in_flight == 0)
        )


_NOT_STARTED = "manager is not started: use 'async with KVManager(...)' or 'await mgr.start()'"
_T = TypeVar("_T")


def _started(part: _T | None) -> _T:
    """What ``start()`` creates, or ClosedError before it."""
    if part is None:
        raise ClosedError(_NOT_STARTED)
    return part


def _copier(args: KVArgs, config: TransferConfig, views: list[np.ndarray] | None) -> tuple[str, ArenaCopier] | None:
    """The staging backend and its copier (which holds the arena, on the KV's device); None: staging off."""
    device = args.kv_device
    backend = staging_backend(config.staging_backend, device)
    if not config.staging_bytes or config.staging == "never":
        return None
    if backend == "torch":
        from .._torch_staging import TorchCopier  # imports torch: an optional dependency, loaded on use

        return backend, TorchCopier(args.kv, device, config.staging_bytes)
    assert views is not None  # staging_backend refuses NumPy for device memory
    return backend, HostCopier(views, StagingArena(config.staging_bytes))


def validate_state_indices(
    args: KVArgs, states: Mapping[Any, PageIndices], role: str = "send_metadata"
) -> dict[str, list[int]]:
    """``{kind: indices}`` checked against the registered state buffers, before any byte moves."""
    out: dict[str, list[int]] = {}
    for key, idx in states.items():
        kind = key.value if isinstance(key, StateType) else str(key)
        bufs = args.state.get(kind)
        if not bufs:
            raise InvalidArgument(f"{role}: state indices for {kind!r} but no such state buffers are registered")
        arr = as_index_array(idx, what=f"{kind} state indices")
        check_range(arr, min(b.num_items for b in bufs), what=f"{kind} state indices")
        if StateType.slot_based(kind) and arr.size != 1:
            raise InvalidArgument(f"{role}: {kind} state takes exactly one slot per request, got {arr.size}")
        if not StateType.slot_based(kind):
            check_unique(arr, what=f"{kind} state indices")
        out[kind] = [int(v) for v in arr]
    return out


def state_mismatch(local: Mapping[str, list[int]], declared: Mapping[str, int]) -> str | None:
    """Why the state a prefill sends (``{kind: indices}``) is not what the decode declared (``{kind: count}``),
    or None when it is."""
    if set(local) != set(declared):
        return f"state kinds mismatch: prefill sends {sorted(local)}, decode declared {sorted(declared)}"
    for kind, idx in local.items():
        if len(idx) != declared[kind]:
            return f"{kind} state count mismatch: prefill sends {len(idx)}, decode declared {declared[kind]}"
    return None


def check_aux_index(args: KVArgs, aux_index: object) -> int:
    """``aux_index`` as a local aux slot, or :class:`InvalidArgument` (no aux buffers, not an int, out of range)."""
    if not args.aux:
        raise InvalidArgument("send_aux: this manager has no aux buffers")
    slots = min(b.num_items for b in args.aux)
    if isinstance(aux_index, bool) or not isinstance(aux_index, (int, np.integer)) or not 0 <= aux_index < slots:
        raise InvalidArgument(f"aux_index {aux_index!r} out of range [0, {slots})")
    return int(aux_index)


def merge_regions(regions: list[MemoryRegion]) -> list[MemoryRegion]:
    """Merge touching or overlapping regions of the same device into one."""
    out: list[MemoryRegion] = []
    for r in sorted(set(regions), key=lambda r: (r.device, r.ptr)):
        if out and out[-1].device == r.device and r.ptr <= out[-1].end:
            last = out[-1]
            out[-1] = MemoryRegion(last.ptr, max(last.end, r.end) - last.ptr, last.device)
        else:
            out.append(r)
    return out


def annotate(exc: TransferTimeout | PeerError, room: int | None, peer: str | None) -> None:
    """Fill in the room and peer an error concerns, where the raise site did not know them."""
    if exc.room is None:
        exc.room = room
    if exc.peer is None:
        exc.peer = peer


@contextlib.contextmanager
def engine_failures(room: int, peer: str, what: str) -> Iterator[None]:
    """The one place where an engine's failure becomes the room's: ``EngineError`` -> ``TransferFailed``
    (``"<what> to <peer> failed: ..."``); timeouts and peer errors get the room and peer filled in."""
    try:
        yield
    except EngineError as exc:
        raise TransferFailed(f"{what} to {peer} failed: {exc}", room=room) from exc
    except (TransferTimeout, PeerError) as exc:
        annotate(exc, room, peer)
        raise
