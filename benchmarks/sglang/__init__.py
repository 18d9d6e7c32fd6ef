"""SGLang 0.5.23's own transfer layer beside aiotransfer's, each in its own processes.

* :mod:`~benchmarks.sglang.peer`     -- SGLang's unmodified Mooncake prefill / decode classes in one
  process; a script run with the interop venv's Python (``bash scripts/interop-venv.sh`` builds it), never
  imported here. ``stubs/`` and ``tiny-llama/`` beside it are what that process needs to import SGLang
  and build its ``ServerArgs``.
* :mod:`~benchmarks.sglang.aio_peer` -- the same commands over an aiotransfer ``KVManager``.
* :mod:`~benchmarks.sglang.bench`    -- ``python -m benchmarks sglang``: both stacks, interleaved.

This module holds what the tests under tests/interop/ and the benchmark share: where the interop venv is,
how a peer process is started, and :class:`PeerProcess`, the client of the peers' protocol (one JSON object
per line each way: ``{"id": n, "op": ..., ...}`` in, ``{"id": n, "ok": bool, ...}`` out, the first line out
a hello with the peer's ``endpoint``). Nothing here imports SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .. import ROOT

__all__ = [
    "HERE",
    "INTEROP_PYTHON",
    "INTEROP_VENV",
    "PEER_SCRIPT",
    "SGLANG_VERSION",
    "PeerError",
    "PeerProcess",
    "interop_venv_problem",
    "sglang_peer_argv",
    "start_peer",
    "start_sglang_peer",
]

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_SCRIPT = os.path.join(HERE, "peer.py")
SGLANG_VERSION = "0.5.23"


def _default_venv() -> str:
    """``$AIOTRANSFER_INTEROP_VENV``, else ``.interop-venv`` of the checkout this package lives in."""
    given = os.environ.get("AIOTRANSFER_INTEROP_VENV")
    if given:
        return given
    return os.path.join(ROOT, ".interop-venv")


INTEROP_VENV = _default_venv()
INTEROP_PYTHON = os.path.join(INTEROP_VENV, "bin", "python")


def interop_venv_problem() -> str | None:
    """Why SGLang can't run here, or None when the interop venv is usable."""
    if not os.path.exists(INTEROP_PYTHON):
        return (
            f"{INTEROP_VENV} is missing: build it with `bash scripts/interop-venv.sh` "
            f"(SGLang {SGLANG_VERSION} on CPU torch, ~2 GB, a few minutes)"
        )
    return None


class PeerError(RuntimeError):
    """A peer answered ``ok: false``; ``error`` and ``reason`` are its words."""

    def __init__(self, op: str, reply: Mapping[str, Any]) -> None:
        super().__init__(f"{op}: {reply.get('error')}: {reply.get('reason')}")
        self.error = reply.get("error")
        self.reason = reply.get("reason", "")


class PeerProcess:
    """A peer process and its protocol: ``await call(op, ...)`` sends a command and returns its reply.

    Calls on one peer are answered in order; several may be in flight (each waits for its own id).
    """

    def __init__(self, proc: asyncio.subprocess.Process, hello: dict[str, Any]) -> None:
        self.proc = proc
        self.hello = hello
        self.endpoint: str = hello["endpoint"]
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                sys.stderr.write(line.decode(errors="replace"))
                continue
            fut = self._waiting.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"peer process exited (rc={self.proc.returncode})"))

    async def call(self, op: str, *, call_timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": rid, "op": op, **kw}) + "\n").encode())
        await asyncio.wait_for(self.proc.stdin.drain(), call_timeout)
        reply = await asyncio.wait_for(fut, call_timeout)
        if not reply.get("ok"):
            raise PeerError(op, reply)
        return reply

    async def close(self, timeout: float = 5.0) -> None:
        """Ask the peer to exit, kill it if it lingers."""
        if self.proc.returncode is None and self.proc.stdin is not None:
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                self.proc.stdin.write(b'{"op": "exit"}\n')
                await asyncio.wait_for(self.proc.stdin.drain(), timeout)
                await asyncio.wait_for(self.proc.wait(), timeout)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


async def start_peer(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 300.0, what: str = "peer"
) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    """Start a peer process and read its hello line; returns ``(process, hello)``. A peer that fails to
    start (``ok: false`` hello, early exit, no hello within ``timeout``) raises ``RuntimeError``."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=dict(env or os.environ),
        limit=64 * 1024 * 1024,
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"{what} did not start within {timeout:.0f} s") from None
    if not line:
        raise RuntimeError(f"{what} exited early (rc={await proc.wait()})")
    hello: dict[str, Any] = json.loads(line)
    if not hello.get("ok"):
        await proc.wait()
        raise RuntimeError(
            f"{what} failed to start: {hello.get('error')}: {hello.get('reason')}\n{hello.get('trace', '')}"
        )
    return proc, hello


def sglang_peer_argv(role: str, bootstrap_port: int, **opts: Any) -> list[str]:
    """The command line of an SGLang peer: ``opts`` become flags (``tp_size=2`` -> ``--tp-size 2``;
    ``True`` -> a bare flag, ``False`` or None -> omitted)."""
    argv = [INTEROP_PYTHON, PEER_SCRIPT, "--role", role, "--bootstrap-port", str(bootstrap_port)]
    for k, v in opts.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return argv


async def start_sglang_peer(
    role: str,
    bootstrap_port: int,
    *,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    **opts: Any,
) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    """Start an SGLang peer (SGLang's real classes, interop venv); returns ``(process, hello)``.

    The hello's ``endpoint`` is the bootstrap address (prefill) or the decode's ZMQ PULL endpoint.
    ``env`` adds to the environment, e.g. ``{"SGLANG_MOONCAKE_SEND_AUX_TCP": "1"}``.
    """
    problem = interop_venv_problem()
    if problem is not None:
        raise RuntimeError(problem)
    full_env = dict(os.environ, **(env or {}))
    # The project's own venv must not leak into SGLang's interpreter.
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        full_env.pop(k, None)
    argv = sglang_peer_argv(role, bootstrap_port, **opts)
    return await start_peer(argv, env=full_env, timeout=timeout, what=f"SGLang {role} peer")
