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
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KINDS", "Engine", "EngineDied", "EngineError", "EngineSpec", "kv_transfer_config"]

KINDS = ("single", "nixl", "aiotransfer-mooncake", "aiotransfer-nixl", "aiotransfer-nixl-spin")
"""``single``: no connector; ``nixl``: vLLM's NixlConnector; ``aiotransfer-*``: AiotransferConnector
(``aiotransfer-nixl-spin``: over NIXL with UCX's progress thread spinning, as NixlConnector runs it,
instead of the connector's paced default)."""

_AIOTRANSFER_ENGINE = {"aiotransfer-mooncake": "mooncake_tcp", "aiotransfer-nixl": "nixl",
                       "aiotransfer-nixl-spin": "nixl"}
_AIOTRANSFER_TRANSFER: dict[str, dict[str, Any]] = {"aiotransfer-nixl-spin": {"nixl_progress_delay_us": 0}}
_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


class EngineError(RuntimeError):
    """A command failed inside the engine process (the message carries its traceback)."""


class EngineDied(EngineError):
    """The engine process exited or stopped answering (the message carries the tail of its log)."""


@dataclass(frozen=True)
class EngineSpec:
    """Everything the child needs to build its ``vllm.LLM`` (picklable)."""

    name: str
    model: str
    kind: str = "single"
    role: str | None = None
    """``prefill`` or ``decode`` (ignored for ``single``)."""
    log_path: str = "engine.log"
    block_size: int | None = 32
    """Tokens per KV block; ``None``: vLLM's choice (a hybrid model's attention block is sized to its Mamba page)."""
    max_model_len: int = 1024
    kv_cache_bytes: int = 64 << 20
    dtype: str = "float32"
    """Model and KV dtype (vLLM on CPU would otherwise downcast fp32 checkpoints to bf16)."""
    nixl_port: int = 0
    """``VLLM_NIXL_SIDE_CHANNEL_PORT`` (distinct per engine; NixlConnector only)."""
    failure_policy: str = "fail"
    """``kv_load_failure_policy``: ``fail`` or ``recompute``."""
    transfer_timeout: float = 10.0
    lease: float = 10.0
    """aiotransfer ``lease`` / NixlConnector ``kv_lease_duration`` (s)."""
    omp_cpu: int | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` (one core), or ``None`` for vLLM's default."""
    env: dict[str, str] = field(default_factory=dict)


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    """The ``KVTransferConfig`` fields for ``spec`` (``None``: no connector)."""
    if spec.kind == "single":
        return None
    if spec.role not in _ROLES:
        raise ValueError(f"engine {spec.name}: role must be prefill or decode, got {spec.role!r}")
    if spec.kind == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": _ROLES[spec.role], "kv_buffer_device": "cpu",
                "kv_load_failure_policy": spec.failure_policy,
                "kv_connector_extra_config": {"kv_lease_duration": max(1, int(spec.lease))}}
    if spec.kind in _AIOTRANSFER_ENGINE:
        return {"kv_connector": "AiotransferConnector", "kv_connector_module_path": "aiotransfer.integrations.vllm",
                "kv_role": _ROLES[spec.role], "kv_load_failure_policy": spec.failure_policy,
                "kv_connector_extra_config": {"engine": _AIOTRANSFER_ENGINE[spec.kind],
                                              "transfer_timeout": spec.transfer_timeout, "lease": spec.lease,
                                              "transfer": _AIOTRANSFER_TRANSFER.get(spec.kind, {})}}
    raise ValueError(f"unknown connector kind {spec.kind!r}; expected one of {KINDS}")


def _env(spec: EngineSpec) -> dict[str, str]:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo",
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.nixl_port),
           "MC_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "VLLM_CONFIGURE_LOGGING": "1"}
    if spec.omp_cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(spec.omp_cpu)
    env.update(spec.env)
    return env


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
    os.environ.update(_env(spec))
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
