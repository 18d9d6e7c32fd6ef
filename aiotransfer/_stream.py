"""``KVStream``: one chunk of a room sent layer by layer, as a model's forward pass computes the layers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ._deadline import DEFAULT, Default, seconds
from ._device import check_ready
from ._types import DeviceWork
from .errors import InvalidArgument

__all__ = ["KVStream"]


class KVStream:
    """One chunk of a room (its pages and its slice of the decode's pages are fixed when it is opened by
    :meth:`KVSender.stream`), sent layer by layer: call :meth:`send_layers` once a layer's KV is written.

    Every layer is sent exactly once, in any order, one or several per call. The call that sends the
    chunk's last layers completes the chunk; on the room's last chunk it also delivers aux and state and
    concludes Success, as ``send_kv(last=True)`` does. Layers move as direct engine entries as soon as
    they are sent; a chunk that is staged (scattered pages), head-sliced (TP mismatch), or whose pages hold
    every layer (page-first layouts), moves whole when its last layer is sent. No control message is sent per layer.

    KV on a GPU is written by kernels that run after the host code that queued them: pass the layer's
    ``ready`` event to :meth:`send_layers`, and its bytes move only once the kernels are done.
    """

    def __init__(self, room: int, pages: int, layers: Iterable[int], last: bool,
                 send: Callable[[frozenset[int], bool, float | Default, Any], Awaitable[None]]) -> None:
        self.room = room
        self.pages = pages
        """Pages in this chunk."""
        self.last = last
        """Whether this is the room's last chunk."""
        self._all = tuple(sorted(set(layers)))
        self._left = set(self._all)
        self._send = send
        self._readies: list[Any] = []  # the ready= of earlier calls: a chunk that moves whole waits for them

    def __repr__(self) -> str:
        return (f"<KVStream room={self.room} pages={self.pages} layers sent "
                f"{len(self._all) - len(self._left)}/{len(self._all)}{' last' if self.last else ''}>")

    @property
    def layers(self) -> tuple[int, ...]:
        """Every layer of the chunk (the layer ids of the KV buffers)."""
        return self._all

    @property
    def layers_left(self) -> tuple[int, ...]:
        """Layers not sent yet."""
        return tuple(sorted(self._left))

    @property
    def complete(self) -> bool:
        """Every layer has been sent."""
        return not self._left

    async def send_layers(self, layers: int | Iterable[int], *, ready: DeviceWork | None = None,
                          timeout: float | Default = DEFAULT) -> None:
        """Send some layers of this chunk.

        Args:
            layers: One layer id, or several.
            ready: The device work that writes these layers, as an object whose ``query()`` says whether
                it is done: a ``torch.cuda.Event`` recorded on the stream of the layers' kernels. The call
                waits for it (polled from the loop, which it never blocks) before any of their bytes move.
                Without it, the layers must be written when the call is made.
            timeout: Bounds the call (the room's conclusion included, on the call that completes the last
                chunk); ``DEFAULT`` means ``transfer_timeout``. A call that moves data takes no ``None``.

        Raises:
            InvalidArgument: A layer that is unknown or already sent, or ``timeout=None``, before any byte
                moves.
            TransferTimeout: ``ready`` or the write did not end within ``timeout``; the room fails.
            TransferFailed: The room failed (``.reason`` says why).
        """
        seconds(timeout, 0.0, what="send_layers")  # refused before the layers count as sent
        ids = [layers] if isinstance(layers, int) else [int(x) for x in layers]
        if not ids:
            raise InvalidArgument(f"room {self.room}: send_layers needs at least one layer")
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"room {self.room}: layers must not repeat in one call, got {ids}")
        unknown = [x for x in ids if x not in self._all]
        if unknown:
            raise InvalidArgument(f"room {self.room}: unknown layers {unknown}; this chunk has layers "
                                  f"{self._all[0]}..{self._all[-1]}" if self._all else f"room {self.room}: no layers")
        again = [x for x in ids if x not in self._left]
        if again:
            raise InvalidArgument(f"room {self.room}: layers {again} were already sent in this chunk")
        check_ready(ready, f"room {self.room}")
        self._left.difference_update(ids)
        complete = not self._left
        if ready is not None:
            self._readies.append(ready)
        if complete and len(self._readies) > (ready is not None):
            # A staged or page-first chunk moves whole with this call: its earlier layers too, so it waits
            # for their device work as well (each earlier call waits only for its own).
            ready = _AllReady(self._readies)
        await self._send(frozenset(ids), complete, timeout, ready)


class _AllReady:
    """Ready once every one of ``readies`` is (``query()`` of each, the fired ones asked no more)."""

    __slots__ = ("_pending",)

    def __init__(self, readies: Iterable[Any]) -> None:
        self._pending = list(readies)

    def query(self) -> bool:
        self._pending = [r for r in self._pending if not r.query()]
        return not self._pending
