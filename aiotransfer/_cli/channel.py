"""JSON lines between a tool's process and the child it drives (the demo's decode, the benchmark workers).

The parent spawns ``python -m <module> --role decode ...`` (:class:`Child`); the child opens its end with
:func:`open_parent_channel`. Protocol lines on the child's stdout start with ``@aiotransfer ``; anything
else printed there (native libraries writing to fd 1) is passed through to stderr. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

__all__ = ["Channel", "Child", "open_parent_channel", "watch_eof"]

_MARK = "@aiotransfer "
"""Prefix of protocol lines on the child's stdout (anything else there is passed through to stderr)."""


class Channel:
    """JSON objects, one per line, over a pair of asyncio streams (bounded waits everywhere)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, obj: dict[str, Any], timeout: float = 10.0) -> None:
        if self.writer is None:
            raise RuntimeError("channel is read-only")
        self.writer.write((_MARK + json.dumps(obj) + "\n").encode())
        await asyncio.wait_for(self.writer.drain(), timeout)

    async def recv(self, timeout: float) -> dict[str, Any] | None:
        """The next protocol message; None at end of stream. Other lines are echoed to stderr."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError
            line = await asyncio.wait_for(self.reader.readline(), remaining)
            if not line:
                return None
            text = line.decode(errors="replace")
            if text.startswith(_MARK):
                msg: dict[str, Any] = json.loads(text[len(_MARK) :])
                return msg
            sys.stderr.write(text)

    async def serve(
        self,
        handle: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
        *,
        idle_timeout: float,
        send_timeout: float = 10.0,
        trace: bool = False,
    ) -> None:
        """Answer commands ``{"cmd": ...}`` with ``handle`` until end of stream or ``idle_timeout`` of silence;
        a failing command is answered with ``{"event": "error", "message": ...}`` and serving goes on."""
        while True:
            try:
                cmd = await self.recv(idle_timeout)
            except asyncio.TimeoutError:
                return
            if cmd is None:
                return
            try:
                reply = await handle(cmd)
                reply.update(event="ok", cmd=cmd["cmd"])
            except Exception as exc:
                if trace:
                    traceback.print_exc(file=sys.stderr)
                reply = {"event": "error", "cmd": cmd.get("cmd"), "message": f"{type(exc).__name__}: {exc}"}
            await self.send(reply, timeout=send_timeout)


class Child:
    """A child process running ``python -m <module> --role decode ...`` with a :class:`Channel`."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        assert proc.stdout is not None and proc.stdin is not None
        self.channel = Channel(proc.stdout, proc.stdin)

    @classmethod
    async def spawn(cls, module: str, argv: Sequence[str]) -> Child:
        env = dict(os.environ)
        env.setdefault("MC_LOG_LEVEL", "WARNING")
        proc = await asyncio.wait_for(asyncio.create_subprocess_exec(
            sys.executable, "-m", module, "--role", "decode", *argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            limit=16 * 1024 * 1024,
        ), 30.0)
        return cls(proc)

    async def expect(self, event: str, timeout: float) -> dict[str, Any]:
        msg = await self.channel.recv(timeout)
        if msg is None:
            rc = await self.wait(5.0)
            raise RuntimeError(f"decode process exited (rc={rc}) before sending {event!r}")
        if msg.get("event") == "error":
            raise RuntimeError(f"decode process failed: {msg.get('message')}")
        if msg.get("event") != event:
            raise RuntimeError(f"decode process sent {msg.get('event')!r}, expected {event!r}")
        return msg

    async def wait(self, timeout: float) -> int | None:
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            return None

    async def close(self, timeout: float = 10.0) -> int:
        """Close its stdin (the child exits on EOF), wait, and kill it if it lingers."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        rc = await self.wait(timeout)
        if rc is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            rc = await self.wait(5.0)
        return -9 if rc is None else rc


async def open_parent_channel() -> Channel:
    """In the child: stdin/stdout as a :class:`Channel`. Native code printing to fd 1 is sent to stderr."""
    loop = asyncio.get_running_loop()
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    reader = asyncio.StreamReader(limit=16 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, proto)
    # drain() returns only once the pipe took every byte: a process that exits right after its last
    # send (a large result) must not lose the tail still buffered in the transport.
    transport.set_write_buffer_limits(high=0)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    return Channel(reader, writer)


async def watch_eof(channel: Channel, on_eof: Callable[[], None]) -> None:
    """Call ``on_eof`` when the parent goes away (its end of our stdin closes)."""
    while True:
        line = await channel.reader.readline()
        if not line:
            on_eof()
            return
