"""Device-init ordering: this rank's device is set on an executor thread before the engine is
created on that thread, and every executor thread binds the same device.

A fake device module (``set_device`` / ``is_available``) records calls, with thread ids, into the same log
as a registered engine factory and the engine's own calls. The engine behind the factory is the real
Mooncake adapter (TCP), so the manager runs for real.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, TransferConfig
from aiotransfer._device import bind_device, device_initializer, use_backends
from aiotransfer._offload import Offloader
from aiotransfer.engines import _registry as registry
from aiotransfer.engines._base import MemoryRegion
from aiotransfer.engines._mooncake import MooncakeEngine

Event = tuple[str, int, Any]  # (what, thread id, detail)


class Log:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def add(self, what: str, detail: Any = None) -> None:
        with self._lock:
            self.events.append((what, threading.get_ident(), detail))

    def of(self, what: str) -> list[Event]:
        return [e for e in self.events if e[0] == what]

    def first_per_thread(self) -> dict[int, Event]:
        first: dict[int, Event] = {}
        for e in self.events:
            first.setdefault(e[1], e)
        return first


class FakeDevice:
    """What ``torch.cuda`` / ``torch.npu`` offer for binding."""

    def __init__(self, log: Log, name: str = "fake.cuda", available: bool = True) -> None:
        self.__name__ = name
        self.log = log
        self.available = available

    def is_available(self) -> bool:
        return self.available

    def set_device(self, index: int) -> None:
        self.log.add("set_device", (self.__name__, index))


class RecordingEngine(MooncakeEngine):
    """The real Mooncake adapter (TCP), logging the calls the manager makes on executor threads."""

    def __init__(self, config: TransferConfig, log: Log) -> None:
        self.log = log
        super().__init__(config, alias_tcp=True)

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.log.add("engine.register")
        super().register(regions)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        self.log.add("engine.deregister")
        super().deregister(regions)


@pytest.fixture
def log() -> Iterator[Log]:
    events = Log()

    def factory(config: TransferConfig) -> RecordingEngine:
        events.add("engine_factory", config.device_id)
        return RecordingEngine(config, events)

    registry.register_engine("fake-order", factory)
    try:
        yield events
    finally:
        registry._ENGINES.pop("fake-order", None)


def args() -> KVArgs:
    return KVArgs([np.zeros((16, 1024), dtype=np.uint8)], page_size=1, dtype="uint8")


async def occupy_all_threads(offload: Offloader, n: int, log: Log) -> None:
    """Make the executor run ``n`` threads: many calls at once, each held until ``n`` threads have shown up.

    (ThreadPoolExecutor reuses idle threads first, and counts one idle credit per finished call, so a
    handful of calls may all land on old threads; 64 outstanding calls exhaust those credits.)"""
    seen: set[int] = set()
    cond = threading.Condition()

    def hold() -> None:
        with cond:
            if threading.get_ident() not in seen:
                seen.add(threading.get_ident())
                log.add("work")
                cond.notify_all()
            cond.wait_for(lambda: len(seen) >= n, timeout=10)

    await asyncio.gather(*(offload.run(hold, timeout=15, what="hold") for _ in range(64)))
    assert len(seen) == n


async def test_device_set_before_engine_and_on_every_executor_thread(log: Log) -> None:
    unavailable = FakeDevice(log, "fake.absent", available=False)
    with use_backends([unavailable, FakeDevice(log)]):
        cfg = TransferConfig(engine="fake-order", device_id=3, executor_threads=3, staging_bytes=0)
        async with KVManager(args(), cfg) as mgr:
            assert mgr.describe()["transport"] == "tcp"
            await occupy_all_threads(mgr._ctx.offload, 3, log)
    loop_thread = threading.get_ident()

    binds = log.of("set_device")
    factory = log.of("engine_factory")
    assert len(factory) == 1 and factory[0][2] == 3
    # the engine was created on its driver thread, after that thread set the device
    first = log.first_per_thread()
    driver = factory[0][1]
    assert driver != loop_thread
    assert first[driver][0] == "set_device"
    assert log.events.index(first[driver]) < log.events.index(factory[0])
    # the driver made every engine call of the manager (registration included)
    assert {tid for what, tid, _ in log.events if what.startswith("engine")} == {driver}
    # every thread that worked (the three executor threads and the driver) bound the same device, exactly
    # once, before doing anything else
    working = {tid for what, tid, _ in log.events if what != "set_device"}
    assert len(working - {driver}) == 3
    assert {tid for _, tid, _ in binds} == working and len(binds) == 4
    assert {detail for _, _, detail in binds} == {("fake.cuda", 3)}  # the unavailable backend was skipped
    for tid in working:
        assert first[tid][0] == "set_device", f"thread {tid} worked before binding: {log.events}"
    assert log.of("engine.register") and log.of("engine.deregister")


async def test_no_device_id_binds_nothing(log: Log) -> None:
    with use_backends([FakeDevice(log)]):
        async with KVManager(args(), TransferConfig(engine="fake-order", staging_bytes=0)) as mgr:
            await occupy_all_threads(mgr._ctx.offload, 2, log)
    assert log.of("set_device") == []
    assert len(log.of("engine_factory")) == 1


async def test_explicit_backends_on_a_plain_offloader() -> None:
    log = Log()
    init = device_initializer(TransferConfig(device_id=1), backends=[FakeDevice(log, "fake.npu")])
    assert init is not None
    offload = Offloader("order-test", 4, initializer=init)
    try:
        await occupy_all_threads(offload, 4, log)
    finally:
        offload.shutdown(wait=True)
    first = log.first_per_thread()
    assert len(first) == 4 and all(e == ("set_device", tid, ("fake.npu", 1)) for tid, e in first.items())
    assert len(log.of("set_device")) == 4


def test_bind_device_picks_the_first_available_backend() -> None:
    log = Log()
    assert device_initializer(TransferConfig()) is None
    assert bind_device(None, [FakeDevice(log)]) is None
    assert bind_device(2, [FakeDevice(log, available=False)]) is None
    assert bind_device(2, []) is None
    assert bind_device(2, [FakeDevice(log, "a", available=False), FakeDevice(log, "b"), FakeDevice(log, "c")]) == "b"
    assert [d for _, _, d in log.events] == [("b", 2)]


def test_default_backends_come_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an override, torch.cuda then torch.npu are used when available (torch faked here)."""
    log = Log()
    fake_torch = types.SimpleNamespace(
        cuda=FakeDevice(log, "torch.cuda", available=False), npu=FakeDevice(log, "torch.npu")
    )
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert bind_device(5) == "torch.npu"
    fake_torch.cuda.available = True
    assert bind_device(6) == "torch.cuda"
    assert [d for _, _, d in log.events] == [("torch.npu", 5), ("torch.cuda", 6)]


def test_use_backends_nests_and_restores() -> None:
    log = Log()
    outer, inner = FakeDevice(log, "outer"), FakeDevice(log, "inner")
    with use_backends([outer]):
        with use_backends([inner]):
            assert bind_device(0) == "inner"
        assert bind_device(0) == "outer"
        with pytest.raises(RuntimeError), use_backends([inner]):
            raise RuntimeError
        assert bind_device(0) == "outer"
    assert [d for _, _, d in log.events] == [("inner", 0), ("outer", 0), ("outer", 0)]
