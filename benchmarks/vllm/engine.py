"""One offline vLLM engine in its own process, driven over a pipe with bounded waits.

The parent holds an :class:`Engine`; the child (multiprocessing ``spawn``) starts a new session, sends its
stdout/stderr (the native libraries' too) to a log file, builds ``vllm.LLM`` in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and serves commands until ``shutdown``. Each command runs the
engine loop itself (``add_request`` / ``step``) so the child can time every request, abort one mid-flight
and keep stepping until a connector hands its blocks back. Teardown kills the child's whole process group.

vLLM is imported only in the child: this module imports without it.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any

from .spec import EngineSpec, engine_env

__all__ = ["Engine", "EngineDied", "EngineError", "start_engines"]

class EngineError(RuntimeError):
    """A command failed inside the engine process (the message carries its traceback)."""


class EngineDied(EngineError):
    """The engine process exited or stopped answering (the message carries the tail of its log)."""



# ----------------------------------------------------------------------------------------------------
# parent side
# ----------------------------------------------------------------------------------------------------
_LIVE: set[Engine] = set()
"""Engines started and not closed: killed at exit whatever happened (no orphan keeps spinning)."""


@atexit.register
def _kill_leftovers() -> None:
    for eng in list(_LIVE):
        eng.kill(signal.SIGKILL)


def log_tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class Engine:
    """Parent-side handle of one engine process; every wait is bounded."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.info: dict[str, Any] = {}
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(spec, child), name=f"vllm-{spec.name}")
        self._started = time.monotonic()
        self._proc.start()
        _LIVE.add(self)
        child.close()
        self.ready_s: float | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.is_alive()

    def _died(self, what: str) -> EngineDied:
        code = self._proc.exitcode
        return EngineDied(f"engine {self.spec.name} ({self.spec.kind}) {what} (exit code {code}); "
                          f"log {self.spec.log_path}:\n{log_tail(self.spec.log_path)}")

    def _recv(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
                    status, payload = self._conn.recv()
                    break
            except (EOFError, OSError):
                raise self._died(f"died during {what}") from None
            if not self._proc.is_alive() and not self._conn.poll(0):
                raise self._died(f"died during {what}")
            if time.monotonic() >= deadline:
                raise self._died(f"did not answer {what} within {timeout:.0f} s")
        if status != "ok":
            raise EngineError(f"engine {self.spec.name}: {what} failed:\n{payload}")
        return payload

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:
        self.info = self._recv(timeout, "start-up")
        self.ready_s = time.monotonic() - self._started
        return self.info

    def call(self, cmd: str, wait: float = 120.0, **kwargs: Any) -> Any:
        """Run ``cmd`` in the engine process with ``kwargs``; ``wait`` bounds the wait for its answer."""
        try:
            self._conn.send((cmd, kwargs))
        except (BrokenPipeError, OSError):
            raise self._died(f"gone before {cmd}") from None
        return self._recv(wait, cmd)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the engine's whole process group (its own session; the group outlives its leader), or
        the process alone if it has not made its session yet."""
        pid = self._proc.pid
        if pid is None:
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            if self._proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        except PermissionError:
            pass

    def close(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """``shutdown`` (vLLM's engine core and the connector), then kill the group; idempotent.

        Returns the engine's last stats (peak memory, free blocks), or ``None`` if it could not answer."""
        stats: dict[str, Any] | None = None
        t0 = time.monotonic()
        if self._proc.is_alive():
            with contextlib.suppress(EngineError):
                stats = self.call("shutdown", wait=timeout)
            self._proc.join(2)  # the interpreter's own exit (NIXL's at-exit hooks) may take long: not waited for
        self.kill(signal.SIGKILL)
        self._proc.join(10)
        self._conn.close()
        _LIVE.discard(self)
        if stats is not None:
            stats["close_s"] = time.monotonic() - t0
        return stats


def start_engines(specs: list[EngineSpec], timeout: float = 240.0) -> list[Engine]:
    """Start every engine at once and wait for all; on failure none is left running."""
    engines: list[Engine] = []
    try:
        for spec in specs:
            engines.append(Engine(spec))  # noqa: PERF401 (those started stay listed if one fails)
        for eng in engines:
            eng.wait_ready(timeout)
    except BaseException:
        for eng in engines:
            eng.close(timeout=5.0)
        raise
    return engines


# ----------------------------------------------------------------------------------------------------
# child side
# ----------------------------------------------------------------------------------------------------
def _child_main(spec: EngineSpec, conn: Any) -> None:
    os.setsid()
    fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(engine_env(spec))
    if spec.omp_cpu is not None:  # the whole process, before vLLM starts a thread: its own core, as on its own host
        os.sched_setaffinity(0, {spec.omp_cpu})
    print(f"[harness] engine {spec.name}: {asdict(spec)}", flush=True)
    try:
        from .server import Server

        server = Server(spec)
        conn.send(("ok", server.info()))
    except BaseException:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            cmd, kwargs = conn.recv()
        except (EOFError, OSError):
            server.shutdown()
            return
        try:
            result = getattr(server, f"cmd_{cmd}")(**kwargs)
            reply: tuple[str, Any] = ("ok", result)
        except Exception:
            traceback.print_exc()
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:
            return
        if cmd == "shutdown":
            return
