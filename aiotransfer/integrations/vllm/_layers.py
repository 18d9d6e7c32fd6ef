"""Layer-pipelined push on the prefill: one forward pass, and one prompt's chunks, as the connector's loop
thread sees them.

vLLM's model runner calls ``save_kv_layer`` from its own thread after each attention layer has written its
KV; :class:`ForwardPass` carries that, one loop wake-up per layer, to the rooms on the connector's event
loop thread, which then push that layer's blocks to their decode while the pass computes the next layers.

On a GPU, ``save_kv_layer`` runs once the layer's kernels are queued, not done: each report carries a CUDA
event recorded then (:func:`device_event`), and the layer's bytes move only once it has fired
(``KVStream.send_layers(ready=...)``). Plain Python, no vLLM import (torch only for KV on a GPU).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..._deadline import within
from ...errors import AiotransferError, TransferTimeout

__all__ = ["ChunkFeed", "ForwardPass", "device_event"]


def device_event(device: Any) -> Any:
    """A CUDA event recorded now on ``device``'s current stream: it fires once the work queued there so far
    (the layer's kernels) is done. None for host memory (``device`` None or not CUDA): nothing to wait for."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


class ForwardPass:
    """The layers one forward pass has written, in the order it wrote them. :meth:`written`, :meth:`over`
    and :meth:`abandon` are called from vLLM's thread; :meth:`layers` and :meth:`finished` run on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_layers: int) -> None:
        self._loop = loop
        self._num_layers = num_layers
        self._order: list[int] = []  # layers written so far, in the order they were
        self._ready: dict[int, Any] = {}  # layer -> the device event its bytes wait for (KV on a GPU)
        self.end_ready: Any = None
        """The device event recorded when the pass ended (KV on a GPU): whole sends wait for it."""
        self._progress = asyncio.Event()  # replaced by a fresh one each time a layer is written
        self._over = asyncio.Event()
        self._abandoned: str | None = None

    # -- vLLM's thread -----------------------------------------------------------------------------
    def written(self, layer: int, ready: Any = None) -> None:
        """Layer ``layer``'s KV is in its blocks, or will be once ``ready`` (a device event) fires."""
        self._tell(self._add, (layer, ready))

    def over(self, ready: Any = None) -> None:
        """The pass has ended: every layer's KV is in its blocks (a layer that was never reported too), or
        will be once ``ready`` fires."""
        self._tell(self._end, (None, ready))

    def abandon(self, reason: str) -> None:
        """The pass will not complete (vLLM began another step without ending this one): rooms waiting on
        it fail with ``reason`` rather than send blocks that may not hold their KV."""
        self._tell(self._end, (reason, None))

    def _tell(self, fn: Callable[[Any], None], arg: Any) -> None:
        # A connector shutting down closes the loop under a pass still running: its rooms have failed
        # already, and vLLM's forward pass must not fail for it.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, arg)

    def _add(self, report: tuple[int, Any]) -> None:
        layer, ready = report
        if not self._over.is_set() and 0 <= layer < self._num_layers and layer not in self._order:
            self._order.append(layer)
            self._ready[layer] = ready
            self._progress.set()
            self._progress = asyncio.Event()

    def _end(self, report: tuple[str | None, Any]) -> None:
        abandoned, ready = report
        if self._over.is_set():
            return
        if abandoned is None:
            rest = [layer for layer in range(self._num_layers) if layer not in self._order]
            self._order += rest
            self._ready.update(dict.fromkeys(rest, ready))
            self.end_ready = ready
        self._abandoned = abandoned
        self._over.set()
        self._progress.set()

    # -- the loop thread ---------------------------------------------------------------------------
    async def layers(self, timeout: float) -> AsyncIterator[tuple[int, Any]]:
        """Each layer as soon as it is reported, with the device event its bytes wait for (None: written
        already); every layer once the pass is over. Raises if the pass is abandoned, or when the whole
        pass has not ended within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            while seen < len(self._order):
                seen += 1
                layer = self._order[seen - 1]
                yield layer, self._ready.get(layer)
            if self._abandoned is not None:
                raise AiotransferError(self._abandoned)
            if self._over.is_set():
                return
            await _wait(self._progress, deadline - time.monotonic(), "the forward pass")

    async def finished(self, timeout: float) -> None:
        """Until the pass is over; raises if it was abandoned, or after ``timeout`` seconds."""
        await _wait(self._over, timeout, "the forward pass")
        if self._abandoned is not None:
            raise AiotransferError(self._abandoned)


async def _wait(event: asyncio.Event, timeout: float, what: str) -> None:
    if event.is_set():
        return
    try:
        await within(event.wait(), max(timeout, 0.0))
    except asyncio.TimeoutError:
        raise TransferTimeout(f"{what} did not end within {timeout:.3g} s") from None


class ChunkFeed:
    """The steps that compute one prefill request's prompt, chunk by chunk, in the order vLLM runs them:
    :meth:`put` and :meth:`close` are called from vLLM's thread; the room's task takes them with :meth:`next`
    on ``loop``. A job the task has taken is under way until it asks for the next one (or ends)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._jobs: collections.deque[Any] = collections.deque()
        self._more = asyncio.Event()
        self._idle = asyncio.Event()  # set while no job is under way
        self._idle.set()
        self._closed: str | None = None
        self._final = False

    # -- vLLM's thread -----------------------------------------------------------------------------
    def put(self, job: Any) -> None:
        """The next step's job."""
        with contextlib.suppress(RuntimeError):  # a closed loop: the room has failed already
            self._loop.call_soon_threadsafe(self._put, job)

    def close(self, reason: str) -> None:
        """No more jobs: the room's task fails with ``reason`` when it next asks for one."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.close_now, reason)

    # -- the loop thread ---------------------------------------------------------------------------
    def _put(self, job: Any) -> None:
        if self._closed is None:
            self._jobs.append(job)
            self._more.set()

    def close_now(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
            self._more.set()

    async def next(self, timeout: float) -> Any:
        """The next job, once vLLM has handed it over; raises after ``timeout`` seconds without one, or
        once the feed is closed. The job taken before is over."""
        self.done()
        while not self._jobs:
            if self._closed is not None:
                raise AiotransferError(self._closed)
            self._more.clear()
            await _wait(self._more, timeout, "the prompt's next chunk")
        self._idle.clear()
        return self._jobs.popleft()

    def done(self) -> None:
        """The job under way is over (the task takes no more)."""
        self._idle.set()

    def final(self) -> None:
        """The job taken is the prompt's last: it is under way until the room ends, which may be the
        prefill's whole lease, so a preemption cannot wait for it."""
        self._final = True

    async def preempted(self, timeout: float) -> bool:
        """vLLM has taken the request's blocks back: the jobs not yet taken are dropped (their blocks are no
        longer the request's), and this waits until the job under way is over, so that no write reads
        them any more. False if it is not over within ``timeout`` seconds, or is the prompt's last."""
        self._jobs.clear()
        if self._final:
            return False
        try:
            await _wait(self._idle, timeout, "the preempted chunk's writes")
        except TransferTimeout:
            return False
        return True
