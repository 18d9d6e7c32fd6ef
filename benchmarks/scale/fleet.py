"""The prefill's side of the fleet: the decode processes, each a :class:`Worker` (commands answered in order,
``room`` events handed to a callback), spread and grown, killed and replaced."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Any

from aiotransfer._cli.channel import Child

from .common import Params

__all__ = ["Fleet", "Worker"]


class Worker:
    """One decode process: ``call`` sends a command and waits for its answer; events go to ``on_event``."""

    def __init__(self, child: Child, on_event: Callable[[dict[str, Any]], None]) -> None:
        self.child = child
        self.on_event = on_event
        self.indices: list[int] = []
        """Global indices of the decode managers it hosts."""
        self._replies: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self.killed = False

    @classmethod
    async def spawn(cls, params: Params, on_event: Callable[[dict[str, Any]], None]) -> Worker:
        child = await Child.spawn("benchmarks.scale.decode", ["--params", params.to_json()])
        w = cls(child, on_event)
        await child.expect("ready", 60.0)
        w._reader = asyncio.ensure_future(w._read())
        return w

    @property
    def pid(self) -> int:
        return int(self.child.proc.pid)

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.child.channel.recv(1e9)
                if msg is None:
                    break
                if msg.get("event") in ("ok", "error"):
                    self._replies.put_nowait(msg)
                else:
                    self.on_event(msg)
        finally:
            self._replies.put_nowait(None)

    async def call(self, cmd: str, wait: float, **kw: Any) -> dict[str, Any]:
        """Send ``cmd`` with ``kw`` and wait at most ``wait`` seconds for its answer."""
        async with self._lock:
            await self.child.channel.send({"cmd": cmd, **kw}, timeout=60.0)
            msg = await asyncio.wait_for(self._replies.get(), wait)
        if msg is None:
            raise RuntimeError(f"decode process {self.pid} exited during {cmd!r}")
        if msg["event"] == "error":
            raise RuntimeError(f"decode process {self.pid}: {cmd}: {msg.get('message')}")
        return msg

    async def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            self.child.proc.send_signal(signal.SIGKILL)
        await self.child.wait(30.0)
        await self._stop_reader()

    async def close(self) -> None:
        if not self.killed:
            await self.child.close(30.0)
        await self._stop_reader()

    async def _stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
            self._reader = None


class Fleet:
    """The decode processes and the managers each hosts (global indices ``0 .. size - 1``)."""

    def __init__(self, params: Params, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.params = params
        self.on_event = on_event or (lambda msg: None)
        self.workers: list[Worker] = []
        self.size = 0

    async def spawn(self, processes: int) -> None:
        self.workers += await asyncio.gather(*(Worker.spawn(self.params, self.on_event) for _ in range(processes)))

    async def grow(self, total: int, timeout: float) -> None:
        """Start managers until there are ``total``, spread evenly over the processes."""
        new: dict[int, list[int]] = {}
        while self.size < total:
            w = min(self.workers, key=lambda x: len(x.indices))
            w.indices.append(self.size)
            new.setdefault(id(w), []).append(self.size)
            self.size += 1
        await asyncio.gather(*(w.call("grow", timeout, indices=new[id(w)]) for w in self.workers if id(w) in new))

    async def replace(self, killed: list[Worker], base: int, timeout: float) -> list[tuple[Worker, dict[str, Any]]]:
        """As many new processes as ``killed``, hosting as many new managers each (new indices, new endpoints),
        each manager opening room ``base + index`` as soon as it is up: ``(worker, its grow's answer)``."""
        fresh = await asyncio.gather(*(Worker.spawn(self.params, self.on_event) for _ in killed))
        calls = []
        for old, w in zip(killed, fresh, strict=True):
            count = len(old.indices)
            w.indices = list(range(self.size, self.size + count))
            calls.append(w.call("grow", timeout, indices=w.indices, base=base, timeout=timeout))
            self.size += count
        self.workers = [w for w in self.workers if w not in killed] + list(fresh)
        answers = await asyncio.gather(*calls)
        return list(zip(fresh, answers, strict=True))

    async def all(self, cmd: str, wait: float, **kw: Any) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(w.call(cmd, wait, **kw) for w in self.workers)))

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers))
        self.workers = []

