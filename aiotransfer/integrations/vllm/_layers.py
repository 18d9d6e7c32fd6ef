"""Layer-pipelined push on the prefill: one forward pass, as the connector's loop thread sees it.

vLLM's model runner calls ``save_kv_layer`` from its own thread after each attention layer has written its
KV; :class:`ForwardPass` carries that, one loop wake-up per layer, to the rooms on the connector's event
loop thread, which then push that layer's blocks to their decode while the pass computes the next layers.
Plain Python, no vLLM import.
"""

from __future__ import annotations

import asyncio

from ..._deadline import within
from ...errors import AiotransferError, TransferTimeout

__all__ = ["ForwardPass"]


class ForwardPass:
    """The layers one forward pass has written. :meth:`written`, :meth:`over` and :meth:`abandon` are
    called from vLLM's thread; :meth:`layer` and :meth:`finished` are awaited on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_layers: int) -> None:
        self._loop = loop
        self._layers = [asyncio.Event() for _ in range(num_layers)]
        self._over = asyncio.Event()
        self._abandoned: str | None = None

    # -- vLLM's thread -----------------------------------------------------------------------------
    def written(self, layer: int) -> None:
        """Layer ``layer``'s KV is in its blocks."""
        self._loop.call_soon_threadsafe(self._layers[layer].set)

    def over(self) -> None:
        """The pass has ended: every layer's KV is in its blocks (a layer that was never reported too)."""
        self._loop.call_soon_threadsafe(self._end, None)

    def abandon(self, reason: str) -> None:
        """The pass will not complete (vLLM began another step without ending this one): rooms waiting on
        it fail with ``reason`` rather than send blocks that may not hold their KV."""
        self._loop.call_soon_threadsafe(self._end, reason)

    def _end(self, abandoned: str | None) -> None:
        if self._over.is_set():
            return
        self._abandoned = abandoned
        self._over.set()
        for event in self._layers:
            event.set()

    # -- the loop thread ---------------------------------------------------------------------------
    async def layer(self, layer: int, timeout: float) -> None:
        """Until layer ``layer`` is written (or the pass is over); raises if it was abandoned, or after
        ``timeout`` seconds."""
        await self._wait(self._layers[layer], timeout, f"layer {layer} of the forward pass")

    async def finished(self, timeout: float) -> None:
        """Until the pass is over; raises if it was abandoned, or after ``timeout`` seconds."""
        await self._wait(self._over, timeout, "the forward pass")

    async def _wait(self, event: asyncio.Event, timeout: float, what: str) -> None:
        if not event.is_set():
            try:
                await within(event.wait(), max(timeout, 0.0))
            except asyncio.TimeoutError:
                raise TransferTimeout(f"{what} did not end within {timeout:.3g} s") from None
        if self._abandoned is not None:
            raise AiotransferError(self._abandoned)
