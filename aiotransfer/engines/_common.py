"""What the agent-style adapters (NIXL, MORI) share, and the one place vendor exceptions are mapped.

* :func:`map_errors`         -- a context manager turning a vendor exception into :class:`EngineError`
                                (or a subclass) chained ``from`` it, as httpcore's ``map_exceptions`` does
* :func:`vendor_error`       -- ``"nixlNotFoundError: NIXL_ERR_NOT_FOUND"`` from a vendor exception
* :func:`quietly`            -- call a cleanup function, log (never raise) its failure
* :class:`RegionIndex`       -- registered regions by address: absolute address -> (region, offset), in bulk
* :func:`block_arrays`       -- a :class:`~aiotransfer.engines.Blocks` batch as contiguous ``uint64`` arrays
* :class:`AgentEngine`       -- base of adapters with one native agent, a lock, peers and live handles:
                                their ``__repr__``
* :class:`LoopGate`          -- keeps the event loop off an engine lock that a handshake may hold

Nothing here imports a vendor package.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._plan import Blocks
from ..errors import AiotransferError, EngineError
from ._base import EngineBase, EngineStatus, TransferHandle

__all__ = [
    "AgentEngine",
    "LoopGate",
    "RegionIndex",
    "block_arrays",
    "map_errors",
    "quietly",
    "vendor_error",
]

_DEFAULT_MAP: Mapping[type[Exception], type[AiotransferError]] = {Exception: EngineError}


def vendor_error(exc: BaseException) -> str:
    """``TypeName: message`` of a vendor exception (bindings often raise bare codes as messages)."""
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def map_errors(
    what: str, *, hint: str = "", mapping: Mapping[type[Exception], type[AiotransferError]] = _DEFAULT_MAP
) -> Iterator[None]:
    """Raise ``Mapped(f"{what}: {vendor_error(exc)}{hint}")`` from a vendor exception raised in the block.

    ``mapping`` goes from vendor exception types to aiotransfer's (first match wins; default: any
    ``Exception`` to :class:`EngineError`). aiotransfer's own errors, and exceptions no entry matches,
    pass through unchanged; ``BaseException`` (cancellation, interrupts) is never mapped.
    """
    try:
        yield
    except AiotransferError:
        raise
    except Exception as exc:
        for vendor, ours in mapping.items():
            if isinstance(exc, vendor):
                raise ours(f"{what}: {vendor_error(exc)}{hint}") from exc
        raise


def quietly(log: logging.Logger, what: str, fn: Callable[..., Any], *args: Any) -> bool:
    """Call a cleanup function; log a failure as ``"<what> failed: ..."`` (never raise). True if it worked."""
    try:
        fn(*args)
    except Exception as exc:
        log.warning("%s failed: %s", what, vendor_error(exc))
        return False
    return True


def block_arrays(
    blocks: Blocks,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """(src, dst, length) as contiguous ``uint64`` arrays, the form descriptor building needs."""
    return (
        np.ascontiguousarray(blocks.src, dtype=np.uint64),
        np.ascontiguousarray(blocks.dst, dtype=np.uint64),
        np.ascontiguousarray(blocks.length, dtype=np.uint64),
    )


class RegionIndex:
    """Regions (start, nbytes) sorted by address; maps absolute addresses to (region, offset) in bulk.

    Region numbers are positions in the sequence given to the constructor, whatever its order.
    """

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        order = sorted(range(len(spans)), key=lambda i: spans[i][0])
        arr = np.array([spans[i] for i in order], dtype=np.uint64).reshape(-1, 2)
        self.starts = arr[:, 0].copy()
        self.ends = arr[:, 0] + arr[:, 1]
        self.index = np.array(order, dtype=np.intp)

    def __len__(self) -> int:
        return int(self.index.size)

    def locate(
        self, addrs: npt.NDArray[np.uint64], what: str
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.uint64]]:
        """(region number, offset inside it) of each address; raises EngineError naming the first stray one."""
        pos = np.searchsorted(self.starts, addrs, side="right") - 1
        inside = pos >= 0
        inside[inside] = addrs[inside] < self.ends[pos[inside]]
        if not inside.all():
            bad = int(addrs[int(np.argmin(inside))])
            raise EngineError(f"{what} address {bad:#x} is not inside any registered region")
        return self.index[pos], addrs - self.starts[pos]


class AgentEngine(EngineBase):
    """Base of adapters with one native agent per instance, serialised by one lock (NIXL, MORI).

    Subclasses set ``_closed``, ``_peers`` and ``_live`` in ``__init__`` and provide ``session_id``,
    ``transport`` and a non-blocking ``check``.
    """

    _lock: threading.Lock
    _closed: bool
    _peers: dict[str, Any]
    _live: set[TransferHandle]

    @property
    def session_id(self) -> str:
        raise NotImplementedError

    @property
    def transport(self) -> str:
        raise NotImplementedError

    def check(self, handle: TransferHandle) -> EngineStatus:
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"peers={len(self._peers)} in_flight={len(self._live)}"
        return f"<{type(self).__name__} {self.session_id} {self.transport} {state}>"


class LoopGate:
    """Keeps the event loop off an engine lock while a call that may hold it across network I/O runs.

    Calls made from the loop (a ``try_submit_inline``) never wait: they ``enter`` only while no such call
    (a handshake) is in progress, and are handed to the driver thread otherwise. A handshake closes the gate,
    then waits for the loop's calls already inside the engine to ``leave`` (they hold the engine's lock only
    briefly), before it calls the engine. The gate's own lock is held only around these counters, never
    across an engine call. (Mooncake: the binding's engine-wide mutex, held by ``openSegment``.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left = threading.Condition(self._lock)
        self.handshakes = 0
        self.posting = 0

    def enter(self) -> bool:
        with self._lock:
            if self.handshakes:
                return False
            self.posting += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.posting -= 1
            if self.posting == 0:
                self._left.notify_all()

    @contextlib.contextmanager
    def handshake(self) -> Iterator[None]:
        with self._lock:
            self.handshakes += 1
            while self.posting:
                self._left.wait()
        try:
            yield
        finally:
            with self._lock:
                self.handshakes -= 1
