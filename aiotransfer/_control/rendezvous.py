"""Rendezvous: a key -> future table for answers that arrive on the control plane.

A caller :meth:`Rendezvous.expect`\\ s an answer under a key (a nonce, a request id), sends its question,
then awaits the answer with a bound; the dispatcher :meth:`Rendezvous.resolve`\\ s it when it arrives.
An answer nobody waits for (late, duplicate or forged) is refused, and the caller counts the drop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from .._deadline import within

__all__ = ["Rendezvous"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Rendezvous(Generic[K, V]):
    """Futures keyed by what the answer will carry. Owned by one event loop; not thread-safe."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: dict[K, asyncio.Future[V]] = {}

    @contextlib.contextmanager
    def expect(self, key: K) -> Iterator[asyncio.Future[V]]:
        """Register a future for ``key`` for the duration of the block; it is removed on the way out."""
        fut: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        try:
            yield fut
        finally:
            if self._waiting.get(key) is fut:
                del self._waiting[key]

    def resolve(self, key: K, value: V) -> bool:
        """Hand ``value`` to whoever expects ``key``; False when nobody does (the caller drops it)."""
        fut = self._waiting.get(key)
        if fut is None or fut.done():
            return False
        fut.set_result(value)
        return True

    @staticmethod
    async def wait(fut: asyncio.Future[V], timeout: float) -> V | None:
        """The answer, or None when none arrived within ``timeout`` seconds."""
        try:
            return await within(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return None

    def __len__(self) -> int:
        return len(self._waiting)
