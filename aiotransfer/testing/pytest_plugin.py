"""pytest fixtures for testing code that drives aiotransfer, on the memory engine.

Installed with aiotransfer as a pytest plugin (the ``pytest11`` entry point ``aiotransfer``), so a test file
uses the fixtures without importing anything; ``-p no:aiotransfer`` turns it off. The async fixture runs on
pytest-asyncio's event loop (``asyncio_mode = "auto"``, or ``@pytest.mark.asyncio`` on each test in its
strict mode); where pytest-asyncio is not installed it is a plain async fixture, for anyio's plugin.

* ``memory_fabric``   -- a `MemoryFabric` of the test's own, current for the whole test
* ``kv_pair_options`` -- the shape of the pair's memory and its config; override it in a ``conftest.py``
* ``kv_pair``         -- a `KVPair`: a prefill and a decode manager on ``memory_fabric``, started, with
                         their KV buffers; closed after the test

```python
async def test_a_room_moves(kv_pair):
    await kv_pair.move(room=1, src=[3, 4], dst=[10, 11])
    assert kv_pair.landed([10, 11], [3, 4])
```
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import pytest

from .. import KVArgs, KVManager, TransferConfig
from ._engine import MemoryEngine
from ._fabric import MemoryFabric

__all__ = ["KVPair", "KVPairOptions", "kv_pair", "kv_pair_options", "memory_fabric"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _async_fixture(fn: _F) -> _F:
    """pytest-asyncio's fixture decorator, which runs the fixture on the test's loop in its strict mode too;
    without pytest-asyncio, pytest's own (anyio's plugin runs such async fixtures)."""
    try:
        import pytest_asyncio
    except ImportError:
        return cast(_F, pytest.fixture(fn))
    return cast(_F, pytest_asyncio.fixture(fn))


@dataclass(frozen=True)
class KVPairOptions:
    """The memory of a `KVPair`'s two managers and their config. Every page of the prefill's buffer ``b``
    holds a pattern of its own (see `KVPair.pattern`); the decode's start zeroed."""

    buffers: int = 2
    """KV buffers per side (K and V of one layer)."""
    pages: int = 64
    """Pages per buffer."""
    page_bytes: int = 256
    """Bytes of one page in one buffer."""
    page_size: int = 16
    """Tokens per page."""
    config: dict[str, Any] = field(default_factory=lambda: {"transfer_timeout": 10.0, "done_timeout": 10.0})
    """`TransferConfig` fields for both managers (``engine`` is the memory engine's)."""


@dataclass
class KVPair:
    """A prefill and a decode manager in this process, on one memory fabric."""

    prefill: KVManager
    decode: KVManager
    prefill_kv: list[np.ndarray]
    """The prefill's KV buffers, one ``(pages, page_bytes)`` uint8 array each."""
    decode_kv: list[np.ndarray]
    """The decode's KV buffers, zeroed at the start."""
    fabric: MemoryFabric
    """What the test steers the writes with (`MemoryFabric.fail_next`, manual mode, ...)."""

    @staticmethod
    def pattern(buffer: int, page: int, page_bytes: int) -> np.ndarray:
        """What page ``page`` of the prefill's buffer ``buffer`` holds: distinct for every page and buffer."""
        return ((np.arange(page_bytes, dtype=np.uint32) + page * 131 + buffer * 7919) % 251).astype(np.uint8)

    async def move(self, room: int, src: Sequence[int], dst: Sequence[int], *, timeout: float = 10.0) -> None:
        """One room end to end, as a scheduler runs it: the decode asks for ``dst``, the prefill sends ``src``,
        both wait for the end. Raises what either side raises."""
        async with self.decode.receiver(room, peer=self.prefill.endpoint) as rx, self.prefill.sender(room) as tx:
            await rx.send_metadata(list(dst), timeout=timeout)
            await tx.wait_ready(timeout=timeout)
            await tx.send_kv(np.asarray(src, dtype=np.int64), timeout=timeout)
            await rx.done(timeout=timeout)

    def landed(self, dst: Sequence[int], src: Sequence[int]) -> bool:
        """The decode's pages ``dst`` hold the prefill's pages ``src``, in every buffer."""
        return all(np.array_equal(d[list(dst)], s[list(src)]) for d, s in zip(self.decode_kv, self.prefill_kv, strict=True))


@pytest.fixture
def memory_fabric() -> Iterator[MemoryFabric]:
    """A fabric of this test's own: ``engine="memory"`` managers created during the test join it."""
    with MemoryFabric() as fabric:
        yield fabric


@pytest.fixture
def kv_pair_options() -> KVPairOptions:
    """What `kv_pair` builds; override this fixture to change it."""
    return KVPairOptions()


@_async_fixture
async def kv_pair(memory_fabric: MemoryFabric, kv_pair_options: KVPairOptions) -> AsyncIterator[KVPair]:
    """A started prefill and decode manager on `memory_fabric`, closed after the test."""
    o = kv_pair_options
    config = TransferConfig(**{**o.config, "engine": "memory"})
    prefill_kv = [np.stack([KVPair.pattern(b, p, o.page_bytes) for p in range(o.pages)]) for b in range(o.buffers)]
    decode_kv = [np.zeros((o.pages, o.page_bytes), dtype=np.uint8) for _ in range(o.buffers)]
    async with contextlib.AsyncExitStack() as stack:
        managers = []
        for kv in (prefill_kv, decode_kv):
            engine = MemoryEngine(memory_fabric)
            stack.callback(engine.close)  # once its manager closed: the manager does not close an engine given
            args = KVArgs(kv, page_size=o.page_size, dtype="uint8")
            managers.append(await stack.enter_async_context(KVManager(args, config, engine=engine)))
        yield KVPair(managers[0], managers[1], prefill_kv, decode_kv, memory_fabric)
