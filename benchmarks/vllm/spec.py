"""What one vLLM engine of the harness is (picklable, no vLLM needed): its spec, its connector's
``KVTransferConfig`` fields and its environment. Both sides use it: the parent that starts the engine
(:mod:`.engine`) and the child that builds it (:mod:`.server`)."""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "EngineSpec", "engine_env", "free_port", "kv_transfer_config"]

_AIOTRANSFER_KINDS = ("aiotransfer-mooncake", "aiotransfer-nixl", "aiotransfer-nixl-spin")
_SUFFIXES = ("-whole", "-nochunks", "-auto")
KINDS = ("single", "nixl", *_AIOTRANSFER_KINDS, *(k + s for s in _SUFFIXES for k in _AIOTRANSFER_KINDS))
"""``single``: no connector; ``nixl``: vLLM's NixlConnector; ``aiotransfer-*``: AiotransferConnector
(``aiotransfer-nixl-spin``: over NIXL with UCX's progress thread spinning, as NixlConnector runs it,
instead of the connector's paced default; every pass of a request whose decode has asked is streamed,
``stream_layers="always"``; ``-whole``: without layer streaming, ``stream_layers="never"``; ``-auto``: only
the passes the connector's rule says streaming pays for, ``stream_layers="auto"``, its default; ``-nochunks``:
with chunked prefill, the whole prompt goes with its last chunk, ``send_chunks=False``)."""

_AIOTRANSFER_ENGINE = {"aiotransfer-mooncake": "mooncake_tcp", "aiotransfer-nixl": "nixl",
                       "aiotransfer-nixl-spin": "nixl"}
_AIOTRANSFER_TRANSFER: dict[str, dict[str, Any]] = {"aiotransfer-nixl-spin": {"nixl_progress_delay_us": 0}}
_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


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
    max_num_batched_tokens: int | None = None
    """vLLM's token budget per step; a prompt longer than it is computed in chunks (chunked prefill)."""
    omp_cpu: int | None = None
    """The one core the engine process runs on (its affinity, set before vLLM starts a thread, and
    ``VLLM_CPU_OMP_THREADS_BIND``), or ``None`` for any core and vLLM's default binding."""
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
    base = spec.kind
    for suffix in _SUFFIXES:
        base = base.removesuffix(suffix)
    if base in _AIOTRANSFER_ENGINE:
        return {"kv_connector": "AiotransferConnector", "kv_connector_module_path": "aiotransfer.integrations.vllm",
                "kv_role": _ROLES[spec.role], "kv_load_failure_policy": spec.failure_policy,
                "kv_connector_extra_config": {"engine": _AIOTRANSFER_ENGINE[base],
                                              "transfer_timeout": spec.transfer_timeout, "lease": spec.lease,
                                              "transfer": _AIOTRANSFER_TRANSFER.get(base, {}),
                                              "stream_layers": _stream_layers(spec.kind),
                                              "send_chunks": not spec.kind.endswith("-nochunks")}}
    raise ValueError(f"unknown connector kind {spec.kind!r}; expected one of {KINDS}")


def _stream_layers(kind: str) -> str:
    return "never" if kind.endswith("-whole") else "auto" if kind.endswith("-auto") else "always"


def engine_env(spec: EngineSpec) -> dict[str, str]:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo",
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.nixl_port),
           "MC_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "VLLM_CONFIGURE_LOGGING": "1"}
    if spec.omp_cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(spec.omp_cpu)
    env.update(spec.env)
    return env


_LISTEN_PORTS = (20000, 32000)
"""Ports for the engines' listening sockets, below Linux's ephemeral range (32768-60999 by default): a port the
kernel handed out as free there may be taken by any outgoing connection before the engine binds it."""
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port no socket of this host listens on, outside the ephemeral range, never handed out twice here."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*_LISTEN_PORTS)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # the range is exhausted: any free port, still never handed out twice
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _HANDED_OUT.add(port)
    return port
