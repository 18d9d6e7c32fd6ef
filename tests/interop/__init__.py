"""Interop tests against unmodified SGLang 0.5.23 (see docs/sglang-wire.md).

SGLang runs in its own processes with the .interop-venv Python (built by scripts/interop-venv.sh), driven by
tests/interop/sglang_peer.py over the same JSON-line protocol as tests/peer.py, through tests/remote.py's
``RemotePeer``. Nothing here imports SGLang: this package is imported by the project's own test run.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

from tests.remote import RemotePeer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SGLANG_PEER = os.path.join(HERE, "sglang_peer.py")
INTEROP_VENV = os.environ.get("AIOTRANSFER_INTEROP_VENV", os.path.join(ROOT, ".interop-venv"))
INTEROP_PYTHON = os.path.join(INTEROP_VENV, "bin", "python")
SGLANG_VERSION = "0.5.23"


def interop_venv_problem() -> str | None:
    """Why the interop tests can't run here, or None when .interop-venv is usable."""
    if not os.path.exists(INTEROP_PYTHON):
        return (f"{INTEROP_VENV} is missing: build it with `bash scripts/interop-venv.sh` "
                f"(SGLang {SGLANG_VERSION} on CPU torch, ~2 GB, a few minutes)")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SGLangRemote(RemotePeer):
    """A ``RemotePeer`` for an SGLang peer; ``hello`` is its first reply line (session id, item_len, ...)."""

    def __init__(self, proc: asyncio.subprocess.Process, hello: dict[str, Any]) -> None:
        super().__init__(proc, hello["endpoint"])
        self.hello = hello


async def start_sglang_peer(
    role: str, bootstrap_port: int, *, timeout: float = 120.0, env: dict[str, str] | None = None, **opts: Any
) -> SGLangRemote:
    """Start tests/interop/sglang_peer.py (SGLang's real classes) and return a ``RemotePeer`` for it.

    ``opts`` become command-line flags (``tp_size=2`` -> ``--tp-size 2``; ``True`` -> a bare flag, ``False``
    or None -> omitted). ``env`` adds to the environment, e.g. ``{"SGLANG_MOONCAKE_SEND_AUX_TCP": "1"}``.
    The peer's ``endpoint`` is the bootstrap address (prefill) or its ZMQ PULL endpoint (decode); the rest
    of its hello line is in ``peer.hello``.
    """
    argv = [INTEROP_PYTHON, SGLANG_PEER, "--role", role, "--bootstrap-port", str(bootstrap_port)]
    for k, v in opts.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    full_env = dict(os.environ, **(env or {}))
    # The project's own venv must not leak into SGLang's interpreter.
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        full_env.pop(k, None)
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=full_env
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if not line:
        raise RuntimeError(f"SGLang {role} peer exited early (rc={await proc.wait()})")
    hello = json.loads(line)
    if not hello.get("ok"):
        await proc.wait()
        raise RuntimeError(f"SGLang {role} peer failed to start: {hello.get('error')}: {hello.get('reason')}\n"
                           f"{hello.get('trace', '')}")
    return SGLangRemote(proc, hello)


# The fixed geometry of the SGLang<->SGLang baseline (tests/interop/test_sglang_baseline.py), to be run again
# unchanged for SGLang<->aiotransfer so the latency and throughput numbers compare: an 8-layer MHA model with
# 8 KV heads x 128 dims in bf16, 16-token pages, 64 requests of 1024 tokens (64 pages each).
BASELINE_GEOMETRY: dict[str, int] = {
    "layers": 8,
    "page_size": 16,
    "heads": 8,
    "head_dim": 128,
    "dtype_bytes": 2,
    "requests": 64,
    "tokens": 1024,
}
BASELINE_AUX = "64,64,64,64,2048"  # output ids, cached tokens, logprob val/idx, hidden state (bytes per slot)
