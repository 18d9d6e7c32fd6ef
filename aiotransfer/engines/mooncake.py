"""Mooncake TransferEngine adapter (``mooncake.engine``).

Install: ``pip install aiotransfer[mooncake-cpu]`` (``mooncake-transfer-engine-non-cuda``) on hosts without
an NVIDIA driver, ``aiotransfer[mooncake]`` (``mooncake-transfer-engine``) on GPU hosts. The wheels are
mutually exclusive (same ``mooncake`` package); the CUDA ones fail to import without ``libcuda.so.1``.

Call by call (measured facts, see the project's engine notes):

=========================  ============================  ============  ===========================
method                     blocks?                       GIL released  thread-safe
=========================  ============================  ============  ===========================
``__init__``               yes (engine init, ~ms)        no            -- (run on the offload thread)
``register``/``deregister``  no (metadata only on TCP)   yes (batch)   yes
``connect``                yes: probe + 1-byte handshake  yes          yes, but the first transfer to
                           write; a silent peer can hold               a peer takes an engine-wide
                           the engine mutex for 60 s                   mutex: always bound it
``submit_write``           short (~10 us per entry)      yes           yes
``check`` (POLL handles)   no (~5 us)                    yes           yes
``wait`` (BLOCK handles)   yes, **busy-spins a core**    yes           one call per handle, ever
=========================  ============================  ============  ===========================

Single-entry batches become POLL handles (``transfer_submit_write`` + ``transfer_check_status``, polled
from the event loop: lowest loop lag, no spinning thread). Multi-entry batches become BLOCK handles
(``batch_transfer_async_write`` + exactly one ``get_batch_transfer_status([id])`` on a waiter thread).
Native batch ids are raw pointers freed by the first terminal query; :class:`TransferHandle` makes
them one-shot so no id is ever queried twice (a second query is a use-after-free: SIGSEGV).

The native engine is shared by every manager in the process under a reference count (as serving stacks
share it between PD transfer and KV offloading); each adapter owns only its own registrations.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import TransferConfig
from ..errors import ConfigError, EngineError, EngineUnavailable
from ..plan import Blocks
from .base import EngineStatus, MemoryRegion, TransferHandle, WaitMode

__all__ = ["MOONCAKE_PROTOCOLS", "MooncakeEngine", "MooncakeSetup", "select_mooncake_setup"]

log = logging.getLogger("aiotransfer.engines.mooncake")

MOONCAKE_PROTOCOLS = ("rdma", "efa", "tcp", "nvlink", "nvlink_intra", "ascend", "hip")
_PROTOCOL_BUILD_FLAG = {
    "efa": "SUPPORT_EFA",
    "nvlink": "SUPPORT_MNNVL",
    "nvlink_intra": "SUPPORT_INTRA_NVLINK",
    "hip": "SUPPORT_HIP",
}
_PROTOCOL_WHEEL = {
    "efa": "mooncake-transfer-engine with EFA support (the '-efa' build for AWS hosts)",
    "nvlink": "mooncake-transfer-engine built with -DUSE_MNNVL=ON",
    "nvlink_intra": "mooncake-transfer-engine (CUDA build with intra-node NVLink)",
    "hip": "mooncake-transfer-engine built with -DUSE_HIP=ON (ROCm)",
}
NPU_PHY_ID_ENV = "ASCEND_NPU_PHY_ID"
_CHECK_PENDING, _CHECK_DONE, _CHECK_FAILED, _CHECK_TIMEOUT = 0, 1, -1, -2
_RC_ALREADY_REGISTERED = -7


@dataclass(frozen=True)
class MooncakeSetup:
    """The outcome of protocol selection: what to pass to ``initialize`` and which env to set first."""

    protocol: str
    """Protocol string passed to ``TransferEngine.initialize``."""
    source: str
    """Where the protocol came from: ``config``, ``env`` or ``default``."""
    device_name: str
    """RDMA device list passed to ``initialize`` (empty: auto / none)."""
    hostname_suffix: str = ""
    """Appended to the hostname (Ascend: ``:port:npu_<id>`` is built at init)."""
    env_defaults: Mapping[str, str] = field(default_factory=dict)
    """Variables set with ``setdefault`` before the engine exists (an explicit user value wins)."""
    force_tcp: bool = False


def select_mooncake_setup(
    *,
    config_protocol: str | None,
    env: Mapping[str, str],
    alias_tcp: bool,
    build_flags: Mapping[str, bool],
    rdma_devices: str | None = None,
    device_id: int | None = None,
) -> MooncakeSetup:
    """Choose the Mooncake protocol, device list and environment, in one place (pure).

    Precedence: ``config_protocol``, then ``$MOONCAKE_PROTOCOL``, then ``"rdma"``. The ``mooncake_tcp``
    alias (``alias_tcp``) forces TCP: ``MC_FORCE_TCP=1`` (setdefault) and no RDMA devices.
    """
    if alias_tcp:
        protocol, source = "tcp", "alias"
    elif config_protocol:
        protocol, source = config_protocol, "config"
    elif env.get("MOONCAKE_PROTOCOL"):
        protocol, source = env["MOONCAKE_PROTOCOL"], "env"
    else:
        protocol, source = "rdma", "default"
    protocol = protocol.strip().lower()
    if protocol not in MOONCAKE_PROTOCOLS:
        raise ConfigError(
            f"unknown Mooncake protocol {protocol!r} (from {source}); expected one of {', '.join(MOONCAKE_PROTOCOLS)}"
        )
    flag = _PROTOCOL_BUILD_FLAG.get(protocol)
    if flag is not None and not build_flags.get(flag, False):
        raise ConfigError(
            f"Mooncake protocol {protocol!r} needs a build with {flag}; the installed mooncake package "
            f"lacks it. Install {_PROTOCOL_WHEEL[protocol]}."
        )
    env_defaults: dict[str, str] = {}
    force_tcp = protocol == "tcp"
    if force_tcp:
        env_defaults["MC_FORCE_TCP"] = "1"
    device_name = "" if (force_tcp or alias_tcp) else _resolve_rdma_devices(rdma_devices, device_id)
    suffix = ""
    if protocol == "ascend":
        npu = env.get(NPU_PHY_ID_ENV) or (str(device_id) if device_id is not None else "0")
        suffix = f":npu_{npu}"
    return MooncakeSetup(protocol, source, device_name, suffix, env_defaults, force_tcp)


def _resolve_rdma_devices(spec: str | None, device_id: int | None) -> str:
    """A comma list, or a JSON map ``{gpu_id: "dev1,dev2"}`` / ``{gpu_id: [..]}`` picked by ``device_id``."""
    if not spec:
        return ""
    spec = spec.strip()
    if not spec.startswith("{"):
        return ",".join(d.strip() for d in spec.split(",") if d.strip())
    try:
        table = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"rdma_devices is not valid JSON: {exc}") from None
    key = str(device_id if device_id is not None else 0)
    if key not in table:
        raise ConfigError(f"rdma_devices has no entry for device {key}; keys: {sorted(table)}")
    value = table[key]
    return ",".join(value) if isinstance(value, list) else str(value)


def _import_engine_module() -> Any:
    try:
        import mooncake.engine as module
    except ImportError as exc:
        hint = (
            "pip install 'aiotransfer[mooncake-cpu]'  (mooncake-transfer-engine-non-cuda, for hosts without "
            "an NVIDIA driver) or 'aiotransfer[mooncake]' (mooncake-transfer-engine, GPU hosts)"
        )
        if "libcuda" in str(exc) or "libcudart" in str(exc):
            hint = (
                "the installed Mooncake wheel is a CUDA build and this host has no NVIDIA driver: "
                "pip uninstall -y mooncake-transfer-engine && pip install mooncake-transfer-engine-non-cuda"
            )
        elif "libibverbs" in str(exc) or "libnuma" in str(exc) or "libcurl" in str(exc):
            hint = "missing system libraries: apt-get install -y libibverbs1 libnuma1 libcurl4"
        raise EngineUnavailable(f"Mooncake TransferEngine cannot be loaded ({exc}); {hint}") from exc
    return module


def _apply_env(config: TransferConfig, setup: MooncakeSetup, environ: MutableMapping[str, str]) -> None:
    for key, value in setup.env_defaults.items():
        environ.setdefault(key, value)
    environ.setdefault("MC_LOG_LEVEL", config.engine_log_level)
    if config.engine_timeout_s is not None:
        environ.setdefault("MC_TRANSFER_TIMEOUT", str(config.engine_timeout_s))
        environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", str(max(3, config.engine_timeout_s - 1)))


class _SharedNative:
    """The process-wide native engine, reference counted."""

    lock = threading.Lock()
    instance: _SharedNative | None = None

    def __init__(self, native: Any, session_id: str, transport: str, setup: MooncakeSetup, module: Any) -> None:
        self.native = native
        self.session_id = session_id
        self.transport = transport
        self.setup = setup
        self.module = module
        self.refs = 0
        self.connected: set[str] = set()
        self.regions: dict[tuple[int, int], int] = {}  # (ptr, nbytes) -> refcount


class MooncakeEngine:
    """Mooncake adapter; one native engine per process, shared (see module docstring)."""

    name = "mooncake"

    def __init__(self, config: TransferConfig, *, alias_tcp: bool = False) -> None:
        module = _import_engine_module()
        flags = {k: bool(getattr(module, k, False)) for k in dir(module) if k.startswith("SUPPORT_")}
        setup = select_mooncake_setup(
            config_protocol=config.protocol,
            env=os.environ,
            alias_tcp=alias_tcp or config.engine == "mooncake_tcp",
            build_flags=flags,
            rdma_devices=config.rdma_devices,
            device_id=config.device_id,
        )
        with _SharedNative.lock:
            shared = _SharedNative.instance
            if shared is None:
                shared = self._create(config, setup, module)
                _SharedNative.instance = shared
            elif shared.setup.protocol != setup.protocol:
                raise ConfigError(
                    f"this process already runs a Mooncake engine with protocol {shared.setup.protocol!r}; "
                    f"one engine per process (asked for {setup.protocol!r})"
                )
            shared.refs += 1
        self._shared = shared
        self._owned: list[MemoryRegion] = []
        self._closed = False
        scratch = np.zeros(64, dtype=np.uint8)
        self._scratch = scratch
        self.probe_region = MemoryRegion(int(scratch.ctypes.data), scratch.nbytes)
        self.register([self.probe_region])

    @staticmethod
    def _create(config: TransferConfig, setup: MooncakeSetup, module: Any) -> _SharedNative:
        _apply_env(config, setup, os.environ)
        native = module.TransferEngine()
        hostname = config.hostname + setup.hostname_suffix
        rc = native.initialize(hostname, "P2PHANDSHAKE", setup.protocol, setup.device_name)
        if rc != 0:
            raise EngineError(
                f"Mooncake initialize({hostname!r}, protocol={setup.protocol!r}, devices={setup.device_name!r}) "
                f"failed with {rc}",
                code=rc,
            )
        port = native.get_rpc_port()
        transport = _detect_transport(native, setup)
        session = f"{config.hostname}:{port}"
        log.info(
            "Mooncake engine up: session=%s protocol=%s (%s) transport=%s devices=%r",
            session, setup.protocol, setup.source, transport, setup.device_name,
        )
        return _SharedNative(native, session, transport, setup, module)

    # -- identity ------------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self._shared.session_id

    @property
    def transport(self) -> str:
        return self._shared.transport

    def describe(self) -> dict[str, Any]:
        s = self._shared
        return {
            "engine": self.name,
            "session_id": s.session_id,
            "protocol": s.setup.protocol,
            "protocol_source": s.setup.source,
            "transport": s.transport,
            "rdma_devices": s.setup.device_name,
            "shared_refs": s.refs,
        }

    def local_info(self) -> bytes:
        return b""

    # -- memory --------------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        s = self._shared
        fresh: list[MemoryRegion] = []
        with _SharedNative.lock:
            for r in regions:
                key = (r.ptr, r.nbytes)
                if key in s.regions:
                    s.regions[key] += 1
                    self._owned.append(r)
                else:
                    fresh.append(r)
            for r in fresh:
                rc = s.native.register_memory(r.ptr, r.nbytes)
                if rc != 0:
                    hint = " (overlaps a region already registered)" if rc == _RC_ALREADY_REGISTERED else ""
                    raise EngineError(f"register_memory({r.ptr:#x}, {r.nbytes}) failed with {rc}{hint}", code=rc)
                s.regions[(r.ptr, r.nbytes)] = 1
                self._owned.append(r)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        s = self._shared
        with _SharedNative.lock:
            for r in regions:
                key = (r.ptr, r.nbytes)
                count = s.regions.get(key)
                if count is None:
                    continue
                if r in self._owned:
                    self._owned.remove(r)
                if count > 1:
                    s.regions[key] = count - 1
                    continue
                del s.regions[key]
                rc = s.native.unregister_memory(r.ptr)
                if rc != 0:
                    log.warning("unregister_memory(%#x) returned %d", r.ptr, rc)

    # -- transfers -----------------------------------------------------------------------------
    def connect(self, peer: str, peer_info: bytes, probe_addr: int) -> None:
        """Blocking first contact: a liveness probe, then a 1-byte write into the peer's probe region,
        which performs the engine handshake now (bounded by the caller) instead of on the first transfer."""
        s = self._shared
        probe = getattr(s.native, "send_probe", None)
        if probe is not None:
            rc = probe(peer)
            if rc != 0:
                raise EngineError(f"Mooncake peer {peer} is unreachable (send_probe returned {rc})", code=rc)
        rc = s.native.transfer_sync_write(peer, self.probe_region.ptr, probe_addr, 1)
        if rc != 0:
            raise EngineError(f"Mooncake handshake write to {peer} failed with {rc}", code=rc)
        s.connected.add(peer)

    def forget_peer(self, peer: str) -> None:
        self._shared.connected.discard(peer)

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        n = len(blocks)
        if n == 0:
            raise EngineError("empty transfer batch")
        native = self._shared.native
        nbytes = blocks.nbytes
        if n == 1:
            bid = native.transfer_submit_write(peer, int(blocks.src[0]), int(blocks.dst[0]), int(blocks.length[0]))
            mode = WaitMode.POLL
        else:
            bid = native.batch_transfer_async_write(
                peer, blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist()
            )
            mode = WaitMode.BLOCK
        if not bid:
            raise EngineError(f"Mooncake refused a {n}-entry write to {peer} (peer unreachable or bad batch)")
        return TransferHandle(token=bid, mode=mode, peer=peer, entries=n, nbytes=nbytes)

    def check(self, handle: TransferHandle) -> EngineStatus:
        handle.ensure_pending()
        if handle.mode is not WaitMode.POLL:
            raise EngineError("check() on a BLOCK handle: multi-entry Mooncake batches can only be waited")
        rc = self._shared.native.transfer_check_status(handle.token)
        if rc == _CHECK_PENDING:
            return EngineStatus.PENDING
        if rc == _CHECK_DONE:
            return handle.finish(EngineStatus.DONE)
        reason = "engine timeout" if rc == _CHECK_TIMEOUT else f"engine reported failure ({rc})"
        return handle.finish(EngineStatus.FAILED, f"Mooncake write to {handle.peer}: {reason}")

    def wait(self, handle: TransferHandle, timeout: float) -> EngineStatus:
        """Blocks (spinning) until the batch completes, fails or hits ``MC_TRANSFER_TIMEOUT``; ``timeout``
        is advisory here: the native wait cannot be interrupted."""
        handle.ensure_pending()
        native = self._shared.native
        if handle.mode is WaitMode.POLL:
            # Spin on the cheap check; used only by blocking callers (benchmarks, sync helpers).
            while (status := self.check(handle)) is EngineStatus.PENDING:
                pass
            return status
        rc = native.get_batch_transfer_status([handle.token])
        if rc == 0:
            return handle.finish(EngineStatus.DONE)
        return handle.finish(
            EngineStatus.FAILED, f"Mooncake batch write of {handle.entries} entries to {handle.peer} failed ({rc})"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.deregister(list(self._owned))
        with _SharedNative.lock:
            s = self._shared
            s.refs -= 1
            if s.refs == 0 and _SharedNative.instance is s:
                # The native engine is kept for the life of the process: Mooncake has no safe teardown
                # while peers may still hold its segment, and re-initialising in-process is not supported.
                pass

    def raw(self) -> Any:
        """The native ``mooncake.engine.TransferEngine`` (benchmarks and diagnostics only)."""
        return self._shared.native


def _detect_transport(native: Any, setup: MooncakeSetup) -> str:
    if setup.force_tcp or os.environ.get("MC_FORCE_TCP") == "1":
        return "tcp"
    try:
        topo = json.loads(native.get_local_topology())
    except Exception:
        return setup.protocol
    has_hca = any(any(lst) for entry in topo.values() for lst in entry)
    if setup.protocol == "rdma" and not has_hca:
        return "tcp"
    return setup.protocol
