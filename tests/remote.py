"""Async client for tests/peer.py: a KVManager in another OS process."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
from typing import Any

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")


class RemoteError(Exception):
    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(f"{reply.get('error')}: {reply.get('reason')}")
        self.error = reply.get("error")
        self.reason = reply.get("reason", "")


class RemotePeer:
    """A manager in a child process; ``await call(op, ...)`` sends one command and awaits its reply."""

    def __init__(self, proc: asyncio.subprocess.Process, endpoint: str) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(
        cls, engine: str = "mooncake_tcp", *, timeout: float = 30.0, env: dict[str, str] | None = None,
        prefix: list[str] | None = None, **opts: Any
    ) -> RemotePeer:
        argv = [*(prefix or []), sys.executable, PEER, "--engine", engine]
        for k, v in opts.items():
            values = v if isinstance(v, list) else [v]
            for item in values:
                if item is not None:
                    argv += ["--" + k.replace("_", "-"), str(item)]
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"), **(env or {}))
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"peer process exited early (rc={await proc.wait()})")
        hello = json.loads(line)
        return cls(proc, hello["endpoint"])

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                break
            msg = json.loads(line)
            fut = self._waiting.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("peer process exited"))

    async def call(self, op: str, *, call_timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": rid, "op": op, **kw}) + "\n").encode())
        await self.proc.stdin.drain()
        reply = await asyncio.wait_for(fut, call_timeout)
        if not reply.get("ok"):
            raise RemoteError(reply)
        return reply

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    async def close(self) -> None:
        if self.proc.returncode is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "exit"}\n')
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 5)
            except (asyncio.TimeoutError, ConnectionError, BrokenPipeError):
                pass
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()
        self._reader.cancel()
