"""The public API of ``aiotransfer.testing``: the fabric's modes and injections, which fabric ``engine="memory"``
joins, and what the engine refuses. (Its engine semantics are pinned against the real engines by
tests/test_engine_conformance.py, its contract by tests/test_engine_contract.py; managers on it run in
examples/test_with_memory_engine.py and the interleaving tests.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, TransferConfig, TransferTimeout
from aiotransfer._plan import Blocks
from aiotransfer.engines._base import EngineStatus, MemoryRegion, TransferHandle
from aiotransfer.engines._registry import create_engine
from aiotransfer.errors import ConfigError, EngineError
from aiotransfer.testing import MemoryEngine, MemoryFabric, current_fabric, default_fabric

PAGE = 4096


class Pair:
    """Two connected engines on ``fabric``, each with one registered buffer."""

    def __init__(self, fabric: MemoryFabric) -> None:
        self.fabric = fabric
        self.src, self.dst = MemoryEngine(fabric), MemoryEngine(fabric)
        self.a = np.random.default_rng(0).integers(1, 256, 4 * PAGE, dtype=np.uint8)  # no zero byte
        self.b = np.zeros(4 * PAGE, dtype=np.uint8)
        self.src.register([MemoryRegion(int(self.a.ctypes.data), self.a.nbytes)])
        self.dst.register([MemoryRegion(int(self.b.ctypes.data), self.b.nbytes)])
        self.src.connect(self.dst.session_id, b"", 0)

    def blocks(self, src_page: int = 0, dst_page: int = 1, pages: int = 1) -> Blocks:
        n = pages * PAGE
        return Blocks(np.array([int(self.a.ctypes.data) + src_page * PAGE], dtype=np.uint64),
                      np.array([int(self.b.ctypes.data) + dst_page * PAGE], dtype=np.uint64),
                      np.array([n], dtype=np.uint64))

    def submit(self, **kw: int) -> TransferHandle:
        return self.src.submit_write(self.dst.session_id, self.blocks(**kw))

    def landed(self, src_page: int = 0, dst_page: int = 1) -> bool:
        return bool((self.b[dst_page * PAGE:(dst_page + 1) * PAGE] == self.a[src_page * PAGE:(src_page + 1) * PAGE]).all())


def test_auto_mode_lands_inside_the_post() -> None:
    pair = Pair(MemoryFabric())
    handle = pair.submit(src_page=2, dst_page=1)
    assert handle.landed and pair.landed(2, 1)  # the poll loop asks check at once
    assert pair.src.check(handle) is EngineStatus.DONE
    assert pair.fabric.writes[0].landed_bytes == PAGE


def test_auto_mode_with_a_delay_lands_when_due() -> None:
    clock = SimpleNamespace(t=0.0)
    pair = Pair(MemoryFabric(delay=0.5, clock=lambda: clock.t))
    handle = pair.submit()
    assert not handle.landed and pair.src.check(handle) is EngineStatus.PENDING and not pair.landed()
    clock.t = 0.5
    assert pair.src.check(handle) is EngineStatus.DONE and pair.landed()


def test_manual_mode_waits_for_the_test() -> None:
    pair = Pair(MemoryFabric(auto_complete=False))
    first, second = pair.submit(dst_page=1), pair.submit(src_page=1, dst_page=2)
    assert pair.src.check(first) is EngineStatus.PENDING and not pair.landed()
    assert pair.fabric.complete_all() == 2
    assert pair.src.check(first) is EngineStatus.DONE and pair.src.check(second) is EngineStatus.DONE
    assert pair.landed(0, 1) and pair.landed(1, 2)
    pair.fabric.auto_complete = True  # switched during a test
    assert pair.src.check(pair.submit(src_page=3, dst_page=3)) is EngineStatus.DONE and pair.landed(3, 3)


def test_fail_next_fails_the_next_writes_into_one_session_only() -> None:
    fabric = MemoryFabric()
    pair, other = Pair(fabric), Pair(fabric)
    fabric.fail_next(2, to=pair.dst.session_id, reason="link down")
    elsewhere = other.submit()
    assert other.src.check(elsewhere) is EngineStatus.DONE
    for dst_page in (1, 2):
        handle = pair.submit(dst_page=dst_page)
        assert pair.src.check(handle) is EngineStatus.FAILED and "link down" in (handle.error or "")
        assert not pair.landed(0, dst_page)
    assert pair.src.check(pair.submit(dst_page=3)) is EngineStatus.DONE  # only two
    with pytest.raises(ValueError):
        fabric.fail_next(0)


def test_a_killed_session_lands_nothing_and_cannot_be_reached() -> None:
    pair = Pair(MemoryFabric(auto_complete=False))
    handle = pair.submit()
    pair.fabric.kill(pair.dst.session_id)
    assert pair.src.check(handle) is EngineStatus.FAILED and not pair.landed()
    with pytest.raises(EngineError, match="died"):
        MemoryEngine(pair.fabric).connect(pair.dst.session_id, b"", 0)


def test_memory_deregistered_before_the_landing_is_not_written() -> None:
    pair = Pair(MemoryFabric(auto_complete=False))
    handle = pair.submit()
    (write,) = pair.fabric.pending()
    pair.dst.deregister([MemoryRegion(int(pair.b.ctypes.data), pair.b.nbytes)])
    pair.fabric.complete(write)
    assert pair.src.check(handle) is EngineStatus.DONE and write.landed_bytes == 0 and not pair.b.any()


def test_refusals() -> None:
    fabric = MemoryFabric()
    pair = Pair(fabric)
    with pytest.raises(EngineError, match="not registered"):  # outside the peer's memory: nothing posted
        pair.src.submit_write(pair.dst.session_id, pair.blocks(dst_page=4))
    with pytest.raises(EngineError, match="source address"):
        pair.src.submit_write(pair.dst.session_id, pair.blocks(src_page=4))
    with pytest.raises(EngineError, match="host memory only"):
        pair.src.register([MemoryRegion(1 << 30, 64, "cuda:0")])
    stranger = MemoryEngine(MemoryFabric())  # another fabric: as unreachable as another process
    with pytest.raises(EngineError, match="one process"):
        stranger.reach(pair.dst.session_id, 1.0)
    with pytest.raises(EngineError, match="one process"):
        stranger.connect(pair.dst.session_id, b"", 0)
    pair.src.close()
    with pytest.raises(EngineError, match="closed"):
        pair.submit()
    with pytest.raises(ConfigError):
        MemoryFabric(delay=-1)
    assert not fabric.writes


def test_engine_memory_joins_the_current_fabric() -> None:
    outer, inner = MemoryFabric(), MemoryFabric()
    assert current_fabric() is default_fabric()
    with outer:
        with inner:
            engine = create_engine(TransferConfig(engine="memory"))
            assert isinstance(engine, MemoryEngine) and engine.fabric is inner
            assert engine.describe() == {"engine": "memory", "transport": "memory", "session_id": engine.session_id,
                                         "mode": "auto"}
        assert current_fabric() is outer
    assert current_fabric() is default_fabric()
    engine.close()


async def test_wait_for_writes() -> None:
    pair = Pair(MemoryFabric(auto_complete=False))
    with pytest.raises(TransferTimeout):
        await pair.fabric.wait_for_writes(timeout=0.01)
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, pair.submit)
    (write,) = await pair.fabric.wait_for_writes(1, timeout=5.0)
    assert write.dst == pair.dst.session_id and write.outcome == "pending"


def test_a_write_lands_only_inside_one_registered_region_nested_or_not() -> None:
    """The fabric finds an entry's region by address: inside one region, even one that starts before a
    region nested in it, or not at all (straddling two, or past the end)."""
    from aiotransfer.testing._fabric import _Regions

    regions = _Regions()
    regions.extend([MemoryRegion(0x10000, 0x1000), MemoryRegion(0x1000, 0x100000), MemoryRegion(0x2000, 0x100)])
    assert regions.covers(0x10000, 0x1000) and regions.covers(0x2000, 0x100)
    assert regions.covers(0x20000, 0x10), "inside the large region, past the nested ones"
    assert regions.covers(0x2080, 0x200), "straddles a nested region's end, inside the large one"
    assert not regions.covers(0x100f00, 0x200) and not regions.covers(0x800, 0x10)
    regions.discard(MemoryRegion(0x1000, 0x100000))
    assert not regions.covers(0x20000, 0x10) and not regions.covers(0x2080, 0x200)
    assert regions.covers(0x10000, 0x800)


async def test_a_manager_given_an_engine_object_names_that_engine() -> None:
    """``KVManager(args, engine=MemoryEngine(fabric))`` with a config that names another engine: the manager
    tells its peers the engine it runs, and moves bytes on it without closing it."""
    fabric = MemoryFabric()
    engines = [MemoryEngine(fabric), MemoryEngine(fabric)]
    src = [np.arange(8 * 64, dtype=np.uint8).reshape(8, 64)]
    dst = [np.zeros((8, 64), dtype=np.uint8)]
    config = TransferConfig(engine="mooncake_tcp")
    async with (KVManager(KVArgs(src, page_size=16, dtype="uint8"), config, engine=engines[0]) as pre,
                KVManager(KVArgs(dst, page_size=16, dtype="uint8"), config, engine=engines[1]) as dec):
        assert pre.config.engine == dec.config.engine == "memory"
        async with dec.receiver(1, peer=pre.endpoint) as rx, pre.sender(1) as tx:
            await rx.send_metadata([5], timeout=10)
            await tx.wait_ready(timeout=10)
            await tx.send_kv([2], timeout=10)
            await rx.done(timeout=10)
    assert np.array_equal(dst[0][5], src[0][2])
    assert not any(e.closed for e in engines)
    for e in engines:
        e.close()
