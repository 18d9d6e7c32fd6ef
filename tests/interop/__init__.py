"""Interop tests against unmodified SGLang 0.5.23 (see docs/sglang-wire.md).

SGLang runs in its own processes with the .interop-venv Python (built by scripts/interop-venv.sh), driven by
benchmarks/sglang/peer.py over the same JSON-line protocol as tests/peer.py, through tests/remote.py's
``RemotePeer``. Nothing here imports SGLang: this package is imported by the project's own test run.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from benchmarks import sglang as _sglang
from benchmarks.sglang import SGLANG_VERSION, interop_venv_problem
from tests.remote import RemotePeer

__all__ = [
    "BASELINE_AUX",
    "BASELINE_GEOMETRY",
    "ROOT",
    "SGLANG_VERSION",
    "SGLangRemote",
    "free_port",
    "interop_venv_problem",
    "start_sglang_peer",
]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


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
    """Start benchmarks/sglang/peer.py (SGLang's real classes) and return a ``RemotePeer`` for it.

    See :func:`benchmarks.sglang.start_sglang_peer` for ``opts`` and ``env``. The peer's ``endpoint``
    is the bootstrap address (prefill) or its ZMQ PULL endpoint (decode); the rest of its hello line is in
    ``peer.hello``.
    """
    proc, hello = await _sglang.start_sglang_peer(role, bootstrap_port, timeout=timeout, env=env, **opts)
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
