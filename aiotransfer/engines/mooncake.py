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

Protocol selection happens in one place, :func:`select_mooncake_setup` (pure): config ``protocol``, then
``$MOONCAKE_PROTOCOL``, then ``"rdma"``; engine ``mooncake_tcp`` means ``tcp``. Mooncake's ``protocol``
argument does not select the transport in most builds (it picks a memory allocator; the transport comes
from the build, ``MC_FORCE_TCP``/``MC_FORCE_MNNVL``/``MC_INTRANODE_NVLINK`` and topology discovery), so
the adapter sets those variables itself (``setdefault``: a user's value wins) and reports the transport
that was actually installed (:func:`installed_transport`) in a log line and in ``describe()``.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import TransferConfig
from ..errors import ConfigError, EngineError, EngineUnavailable
from ..plan import Blocks
from .base import EngineStatus, MemoryRegion, TransferHandle, WaitMode

__all__ = [
    "MOONCAKE_PROTOCOLS",
    "MooncakeEngine",
    "MooncakeSetup",
    "installed_transport",
    "select_mooncake_setup",
]

log = logging.getLogger("aiotransfer.engines.mooncake")

MOONCAKE_PROTOCOLS = ("rdma", "efa", "tcp", "nvlink", "nvlink_intra", "ascend", "hip")
PROTOCOL_ENV = "MOONCAKE_PROTOCOL"
FORCE_TCP_ENV = "MC_FORCE_TCP"
NPU_PHY_ID_ENV = "ASCEND_NPU_PHY_ID"
ASCEND_DIST = "mooncake-transfer-engine-npu"
ASCEND_FLAG = "SUPPORT_ASCEND"
"""Pseudo build flag: the binding exports none for Ascend, so it is derived from the installed wheel."""

_PROTOCOL_BUILD_FLAG = {
    "efa": "SUPPORT_EFA",
    "nvlink": "SUPPORT_MNNVL",
    "nvlink_intra": "SUPPORT_INTRA_NVLINK",
    "hip": "SUPPORT_HIP",
}
_PROTOCOL_ENV_DEFAULTS: dict[str, dict[str, str]] = {
    # Mooncake tests these with getenv(): presence, not value. The protocol argument alone does not
    # select these transports (it only picks the memory allocator), the variables do.
    "tcp": {FORCE_TCP_ENV: "1"},
    "nvlink": {"MC_FORCE_MNNVL": "1"},
    "nvlink_intra": {"MC_INTRANODE_NVLINK": "1"},
}
_FALSY = {"", "0", "false", "no", "off"}
_CHECK_PENDING, _CHECK_DONE, _CHECK_FAILED, _CHECK_TIMEOUT = 0, 1, -1, -2
_RC_ALREADY_REGISTERED = -7
_HANDSHAKE_RETRY_S = 0.25
_HANDSHAKE_WINDOW_S = 2.0
REFRESH_ENV = "MC_TE_METADATA_REFRESH_INTERVAL_SECONDS"


def _wheel_for(protocol: str, build_flags: Mapping[str, bool]) -> str:
    """The Mooncake wheel (or build) providing ``protocol``; wheel names as published for 0.3.13."""
    cuda = build_flags.get("SUPPORT_CUDA", False)
    if protocol == "efa":
        if cuda:
            return "pip install mooncake-transfer-engine-efa  (CUDA 12; mooncake-transfer-engine-efa-cuda13 for CUDA 13)"
        return "pip install mooncake-transfer-engine-efa-non-cuda"
    if protocol == "hip":
        return "pip install mooncake-transfer-engine-rocm  (ROCm build, USE_HIP)"
    if protocol == "nvlink_intra":
        return ("pip install mooncake-transfer-engine  (the x86_64 CUDA wheels are built with USE_INTRA_NVLINK; "
                "mooncake-transfer-engine-cuda13 for CUDA 13)")
    return ("the aarch64 CUDA wheel of mooncake-transfer-engine (built with USE_MNNVL); on x86_64 build "
            "Mooncake from source with -DUSE_MNNVL=ON")


@dataclass(frozen=True)
class MooncakeSetup:
    """The outcome of protocol selection: what to pass to ``initialize`` and which env to set first."""

    protocol: str
    """Protocol string passed to ``TransferEngine.initialize``."""
    source: str
    """Where the protocol came from: ``alias`` (engine ``mooncake_tcp``), ``config``, ``env`` or ``default``."""
    device_name: str
    """RDMA device list passed to ``initialize`` (empty: auto-discovery, or none when TCP is forced)."""
    env_defaults: Mapping[str, str] = field(default_factory=dict)
    """Variables set with ``setdefault`` before the engine exists (an explicit user value wins)."""
    force_tcp: bool = False
    """TCP was asked for (protocol ``tcp`` or the ``mooncake_tcp`` alias): ``MC_FORCE_TCP``, no devices."""
    npu_id: int | None = None
    """Ascend only: the NPU physical id that ends the local hostname (``host:port:npu_<id>``)."""
    notes: tuple[str, ...] = ()
    """Things the user should know (logged as warnings when the engine is created)."""

    @property
    def hostname_suffix(self) -> str:
        """Template of what is appended to the hostname: ``":{port}:npu_<id>"`` for Ascend, else empty."""
        return "" if self.npu_id is None else f":{{port}}:npu_{self.npu_id}"

    def local_hostname(self, hostname: str, port: int | None = None) -> str:
        """The ``local_hostname`` for ``initialize``; Ascend needs ``port`` (a free port, see ``_free_port``)."""
        if self.npu_id is None:
            return hostname
        if port is None:
            raise ValueError("the Ascend hostname needs a port")
        return hostname + self.hostname_suffix.format(port=port)


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
    alias (``alias_tcp``) means protocol ``tcp`` (``$MOONCAKE_PROTOCOL`` is then ignored; a different
    explicit ``config_protocol`` is an error). Protocol ``tcp`` sets ``MC_FORCE_TCP=1`` (setdefault) and
    passes no RDMA devices. Protocols that need a special build (efa, nvlink, nvlink_intra, hip) are
    refused without the build flag, naming the wheel to install. ``ascend`` gets the NPU id for the
    ``host:port:npu_<id>`` hostname from ``$ASCEND_NPU_PHY_ID``, else ``device_id``, else 0.
    ``rdma_devices`` is a comma list or a JSON map ``{gpu_id: "dev,dev" | [dev, ...]}`` (by ``device_id``).
    """
    notes: list[str] = []
    config_value = (config_protocol or "").strip().lower()
    env_value = env.get(PROTOCOL_ENV, "").strip().lower()
    if alias_tcp:
        if config_value and config_value != "tcp":
            raise ConfigError(
                f"engine 'mooncake_tcp' forces TCP but protocol={config_protocol!r} was given; use "
                f"engine='mooncake' with that protocol, or drop the protocol"
            )
        protocol, source = "tcp", "alias"
        if env_value and env_value != "tcp":
            notes.append(f"engine 'mooncake_tcp' ignores {PROTOCOL_ENV}={env[PROTOCOL_ENV]!r}")
    elif config_value:
        protocol, source = config_value, "config"
    elif env_value:
        protocol, source = env_value, "env"
    else:
        protocol, source = "rdma", "default"
    if protocol not in MOONCAKE_PROTOCOLS:
        where = f"${PROTOCOL_ENV}" if source == "env" else "config protocol"
        raise ConfigError(
            f"unknown Mooncake protocol {protocol!r} (from {where}); expected one of {', '.join(MOONCAKE_PROTOCOLS)}"
        )
    flag = _PROTOCOL_BUILD_FLAG.get(protocol)
    if flag is not None and not build_flags.get(flag, False):
        raise ConfigError(
            f"Mooncake protocol {protocol!r} needs a Mooncake build with {flag}; the installed mooncake "
            f"package lacks it. All Mooncake wheels provide the same 'mooncake' package: pip uninstall the "
            f"installed one, then {_wheel_for(protocol, build_flags)}"
        )
    force_tcp = protocol == "tcp"
    env_defaults = dict(_PROTOCOL_ENV_DEFAULTS.get(protocol, {}))
    forced = env.get(FORCE_TCP_ENV)
    if forced is not None and forced.strip().lower() in _FALSY:
        notes.append(
            f"{FORCE_TCP_ENV}={forced!r} is set: Mooncake only checks that the variable exists, so TCP is "
            f"forced anyway; unset it to let Mooncake use RDMA"
        )
    elif forced is not None and not force_tcp:
        notes.append(f"{FORCE_TCP_ENV} is set: Mooncake installs TCP, not {protocol!r}")
    if build_flags.get("SUPPORT_EFA", False) and protocol not in ("efa", "tcp"):
        notes.append(f"this Mooncake build has EFA support and installs only EFA or TCP: {protocol!r} runs over TCP")
    npu_id: int | None = None
    if protocol == "ascend":
        npu_id = _npu_id(env, device_id)
        if not build_flags.get(ASCEND_FLAG, False):
            notes.append(f"protocol 'ascend' but the installed Mooncake is not the Ascend wheel ({ASCEND_DIST})")
    if force_tcp:
        device_name = ""
        if rdma_devices:
            notes.append("rdma_devices is ignored: TCP is forced")
    else:
        device_name = _resolve_rdma_devices(rdma_devices, device_id)
    return MooncakeSetup(protocol, source, device_name, env_defaults, force_tcp, npu_id, tuple(notes))


def _npu_id(env: Mapping[str, str], device_id: int | None) -> int:
    raw = env.get(NPU_PHY_ID_ENV, "").strip()
    if raw and raw != "-1":  # SGLang's convention: -1 means unset
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{NPU_PHY_ID_ENV}={raw!r} is not an integer NPU physical id") from None
        if value < 0:
            raise ConfigError(f"{NPU_PHY_ID_ENV}={raw!r} must be >= 0 (or -1 for unset)")
        return value
    return device_id if device_id is not None else 0


def _resolve_rdma_devices(spec: str | None, device_id: int | None) -> str:
    """A comma list, or a JSON map ``{gpu_id: "dev1,dev2"}`` / ``{gpu_id: [..]}`` picked by ``device_id``."""
    if not spec or not spec.strip():
        return ""
    spec = spec.strip()
    if not spec.startswith(("{", "[")):
        return _device_list(spec.split(","), spec)
    try:
        table = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"rdma_devices is not valid JSON: {exc}") from None
    if not isinstance(table, dict):
        raise ConfigError(
            f"rdma_devices JSON must map a GPU id to devices, e.g. {{\"0\": \"mlx5_0,mlx5_1\"}}; got {spec!r}"
        )
    key = str(device_id if device_id is not None else 0)
    if key not in table:
        raise ConfigError(
            f"rdma_devices has no entry for GPU {key} (this rank's device_id); keys: {', '.join(sorted(table))}"
        )
    value = table[key]
    if isinstance(value, str):
        return _device_list(value.split(","), spec)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return _device_list(value, spec)
    raise ConfigError(f"rdma_devices entry for GPU {key} must be a string or a list of strings, got {value!r}")


def _device_list(items: Sequence[str], spec: str) -> str:
    names: list[str] = []
    for item in items:
        name = item.strip()
        if name and name not in names:
            names.append(name)
    if not names:
        raise ConfigError(f"rdma_devices names no device: {spec!r}")
    return ",".join(names)


def installed_transport(
    protocol: str,
    build_flags: Mapping[str, bool],
    env: Mapping[str, str],
    has_hca: bool | Callable[[], bool],
) -> str:
    """The transport Mooncake installs for this protocol, build and environment (pure; ``has_hca`` may be
    a callable, asked only when the answer depends on it).

    Mirrors ``TransferEnginePy::initializeExt`` and ``TransferEngineImpl::init`` (Mooncake 0.3.13): EFA
    builds install EFA for ``efa`` and TCP otherwise; ``MC_FORCE_TCP`` (present, whatever its value) means
    TCP; Ascend builds install the Ascend transport; NVLink builds pick ``nvlink_intra`` on
    ``MC_INTRANODE_NVLINK``, ``nvlink`` when forced or without HCAs, else RDMA; other builds pick RDMA when
    an HCA is found (or ``MC_FORCE_HCA``), else TCP. HIP builds add ``hip`` for intra-node GPU copies.
    """
    if build_flags.get("SUPPORT_EFA", False):
        return "efa" if protocol == "efa" else "tcp"
    if FORCE_TCP_ENV in env:
        return "tcp"
    if build_flags.get(ASCEND_FLAG, False):
        return "ascend"

    def hca() -> bool:
        return has_hca() if callable(has_hca) else has_hca

    force_hca = "MC_FORCE_HCA" in env
    musa = build_flags.get("SUPPORT_MUSA", False)
    p2p_compiled = build_flags.get("SUPPORT_MNNVL", False) or musa
    if p2p_compiled or build_flags.get("SUPPORT_INTRA_NVLINK", False):
        force_p2p = "MC_FORCE_MNNVL" in env or (musa and "MC_FORCE_MUSA" in env)
        if "MC_INTRANODE_NVLINK" in env:
            base = "nvlink_intra"
        elif p2p_compiled and (force_p2p or not hca()):
            base = "musa" if musa else "nvlink"
        elif force_hca or hca():
            base = "rdma"
        else:
            base = "tcp"
    else:
        base = "rdma" if force_hca or hca() else "tcp"
    return base + "+hip" if build_flags.get("SUPPORT_HIP", False) else base


def _load_time_env(config: TransferConfig) -> dict[str, str]:
    """Variables the extension reads once, when it loads (glog's level, the engine's global config)."""
    wanted = {"MC_LOG_LEVEL": config.engine_log_level}
    if config.engine_metadata_refresh_s is not None:
        wanted[REFRESH_ENV] = str(config.engine_metadata_refresh_s)
    return wanted


_LOAD_APPLIED: dict[str, str] = {}
"""What ``_import_engine_module`` set before the first import (reported with the engine's start line)."""


def _import_engine_module(config: TransferConfig) -> Any:
    # Set (unless the user did) before the first import: later values are ignored by the loaded extension.
    if "mooncake.engine" not in sys.modules:
        for key, value in _load_time_env(config).items():
            if key not in os.environ:
                os.environ[key] = value
                _LOAD_APPLIED[key] = value
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


def _build_flags(module: Any) -> dict[str, bool]:
    """The module's ``SUPPORT_*`` build flags, plus ``SUPPORT_ASCEND`` derived from the installed wheel."""
    flags = {k: bool(getattr(module, k, False)) for k in dir(module) if k.startswith("SUPPORT_")}
    try:
        importlib.metadata.version(ASCEND_DIST)
        flags[ASCEND_FLAG] = True
    except importlib.metadata.PackageNotFoundError:
        flags.setdefault(ASCEND_FLAG, False)
    return flags


def _apply_env(config: TransferConfig, setup: MooncakeSetup, environ: MutableMapping[str, str]) -> dict[str, str]:
    """``setdefault`` the engine's variables (a value the user set wins); returns what was actually set."""
    wanted = dict(setup.env_defaults)
    wanted.update(_load_time_env(config))
    if config.engine_timeout_s is not None:
        wanted["MC_TRANSFER_TIMEOUT"] = str(config.engine_timeout_s)
        wanted["MC_TCP_STATUS_TIMEOUT_SEC"] = str(max(3, config.engine_timeout_s - 1))
    applied: dict[str, str] = {}
    for key, value in wanted.items():
        if key not in environ:
            environ[key] = value
            applied[key] = value
    return applied


def _free_port() -> int:
    """A TCP port free right now (Ascend's ``host:port:npu_<id>`` hostname needs one, as SGLang does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def _visible_hcas(device_filter: str, root: str = "/sys/class/infiniband") -> list[str]:
    """RDMA devices the kernel shows, restricted to ``device_filter`` (a comma list) when given."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    wanted = {d for d in device_filter.split(",") if d}
    return [n for n in names if not wanted or n in wanted]


def _has_hca(native: Any, device_filter: str) -> bool:
    """Whether Mooncake's topology discovery finds a usable HCA. No device in sysfs means none (cheap);
    otherwise ask the engine (``get_local_topology`` runs a discovery: ~1 s)."""
    if not _visible_hcas(device_filter):
        return False
    try:
        topo = json.loads(native.get_local_topology(device_filter or None))
        return any(any(hcas) for entry in topo.values() for hcas in entry)
    except Exception as exc:  # unknown: the devices exist, so Mooncake most likely installed RDMA
        log.debug("Mooncake topology query failed: %r", exc)
        return True


def _fresh_alias(name: str) -> str:
    """``host:port`` -> ``host:0port``: the same address to the engine, a new key in its descriptor cache."""
    host, _, port = name.rpartition(":")
    return f"{host}:0{port}"


def _env_int(name: str) -> int:
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0


class _SharedNative:
    """The process-wide native engine, reference counted."""

    lock = threading.Lock()
    instance: _SharedNative | None = None

    def __init__(
        self, native: Any, session_id: str, transport: str, setup: MooncakeSetup, module: Any,
        flags: Mapping[str, bool],
    ) -> None:
        self.native = native
        self.session_id = session_id
        self.transport = transport
        self.setup = setup
        self.module = module
        self.flags = dict(flags)
        self.refs = 0
        self.known: set[str] = set()
        """Peers the engine has fetched a descriptor for (it keeps them for its lifetime)."""
        self.names: dict[str, str] = {}
        """Peer session -> the alias the engine knows a restarted peer by (see ``_handshake``)."""
        self.regions: dict[tuple[int, int], int] = {}  # (ptr, nbytes) -> refcount
        self.refresh_s = _env_int(REFRESH_ENV)
        """How often the engine re-reads cached peer descriptors (0: never)."""


class MooncakeEngine:
    """Mooncake adapter; one native engine per process, shared (see module docstring)."""

    name = "mooncake"
    cheap_submit = True
    """``transfer_submit_write`` only queues: single entries are submitted inline from the loop."""
    quiet_threads = True
    """The transport's threads block while idle (0.5 % CPU for an idle process, measured), so the loop may
    yield its CPU after a Success (``TransferConfig.yield_after_notify``) without waiting behind them."""
    entry_cost_s = 30e-6
    """Measured per-entry cost over TCP, whatever the entry size (drives the staging cost model)."""
    bandwidth_bps = 2.0e9
    """Measured TCP loopback throughput of one peer connection."""

    def __init__(self, config: TransferConfig, *, alias_tcp: bool = False) -> None:
        module = _import_engine_module(config)
        flags = _build_flags(module)
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
                shared = self._create(config, setup, module, flags)
                _SharedNative.instance = shared
            elif shared.setup.protocol != setup.protocol:
                raise ConfigError(
                    f"this process already runs a Mooncake engine with protocol {shared.setup.protocol!r}; "
                    f"one engine per process (asked for {setup.protocol!r})"
                )
            elif shared.setup.device_name != setup.device_name:
                log.warning(
                    "Mooncake engine is shared per process: RDMA devices %r asked for, %r in use",
                    setup.device_name, shared.setup.device_name,
                )
            shared.refs += 1
        self._shared = shared
        self._owned: list[MemoryRegion] = []
        self._closed = False
        self._handshake_window = min(_HANDSHAKE_WINDOW_S, config.handshake_timeout / 2)
        scratch = np.zeros(64, dtype=np.uint8)
        self._scratch = scratch
        self.probe_region = MemoryRegion(int(scratch.ctypes.data), scratch.nbytes)
        self.register([self.probe_region])

    @staticmethod
    def _create(
        config: TransferConfig, setup: MooncakeSetup, module: Any, flags: Mapping[str, bool]
    ) -> _SharedNative:
        applied = {**_LOAD_APPLIED, **_apply_env(config, setup, os.environ)}
        for note in setup.notes:
            log.warning("Mooncake: %s", note)
        native = module.TransferEngine()
        hostname = setup.local_hostname(config.hostname, _free_port() if setup.npu_id is not None else None)
        rc = native.initialize(hostname, "P2PHANDSHAKE", setup.protocol, setup.device_name)
        if rc != 0:
            raise EngineError(
                f"Mooncake initialize({hostname!r}, protocol={setup.protocol!r}, devices={setup.device_name!r}) "
                f"failed with {rc}",
                code=rc,
            )
        port = native.get_rpc_port()
        transport = installed_transport(
            setup.protocol, flags, os.environ, lambda: _has_hca(native, setup.device_name)
        )
        session = f"{config.hostname}:{port}"
        log.info(
            "Mooncake engine up: session=%s protocol=%s (from %s) transport=%s devices=%r env set=%s",
            session, setup.protocol, setup.source, transport, setup.device_name,
            ",".join(f"{k}={v}" for k, v in applied.items()) or "none",
        )
        if setup.protocol not in transport.split("+"):
            log.warning(
                "Mooncake protocol %r was asked for (from %s) but the %r transport is installed",
                setup.protocol, setup.source, transport,
            )
        return _SharedNative(native, session, transport, setup, module, flags)

    @property
    def credit_scope(self) -> object:
        """In-flight entry limits are per native engine, which every manager of the process shares."""
        return self._shared

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
            "build": sorted(k for k, v in s.flags.items() if v),
            "shared_refs": s.refs,
            "metadata_refresh_s": s.refresh_s,
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
        which performs the engine handshake now (bounded by the caller) instead of on the first transfer.
        Peers that publish no probe region (``probe_addr == 0``: SGLang decodes) only get the probe."""
        s = self._shared
        probe = getattr(s.native, "send_probe", None)
        if probe is not None:
            rc = probe(s.names.get(peer, peer))
            if rc != 0:
                raise EngineError(f"Mooncake peer {peer} is unreachable (send_probe returned {rc})", code=rc)
        if probe_addr > 0:
            self._handshake(peer, probe_addr)
        s.known.add(peer)

    def _handshake(self, peer: str, probe_addr: int) -> None:
        """Write one byte into the peer's probe region, retrying over a short window.

        The engine caches a peer's descriptor (its data port, its buffers) under the name it was addressed
        by, and never drops it. A peer restarted on an address this engine already knew would fail every
        write: the engine keeps using the dead process's data port. When a known peer fails, it is addressed
        under a fresh alias of the same ``host:port`` (the port with a leading zero, which the engine parses
        to the same number), so the engine fetches its descriptor again. A data port reused from a dead
        peer fails until its connection lane cools down: the retries cover that."""
        s = self._shared
        name = s.names.get(peer, peer)
        deadline = time.monotonic() + self._handshake_window
        attempts = 0
        while True:
            attempts += 1
            rc = s.native.transfer_sync_write(name, self.probe_region.ptr, probe_addr, 1)
            if rc == 0:
                if name != s.names.get(peer, peer):
                    s.names[peer] = name
                    log.info("Mooncake peer %s restarted on a known address: addressed as %s from now on", peer, name)
                elif attempts > 1:
                    log.info("Mooncake handshake with %s succeeded after %d attempts", peer, attempts)
                return
            if attempts == 1 and peer in s.known:
                name = _fresh_alias(name)
                continue
            if time.monotonic() + _HANDSHAKE_RETRY_S >= deadline:
                break
            time.sleep(_HANDSHAKE_RETRY_S)
        raise EngineError(
            f"Mooncake handshake write to {peer} failed with {rc} ({attempts} attempts over "
            f"{self._handshake_window:.1f} s)",
            code=rc,
        )

    def forget_peer(self, peer: str) -> None:
        """Nothing to drop: the engine keeps a peer's descriptor for its lifetime, and a peer that comes
        back on the same address is re-fetched by the next handshake (see ``_handshake``)."""

    def submit_write(self, peer: str, blocks: Blocks) -> TransferHandle:
        n = len(blocks)
        if n == 0:
            raise EngineError("empty transfer batch")
        native = self._shared.native
        nbytes = blocks.nbytes
        if n == 1:
            bid = native.transfer_submit_write(
                self._shared.names.get(peer, peer), int(blocks.src[0]), int(blocks.dst[0]), int(blocks.length[0])
            )
            mode = WaitMode.POLL
        else:
            bid = native.batch_transfer_async_write(
                self._shared.names.get(peer, peer), blocks.src.tolist(), blocks.dst.tolist(), blocks.length.tolist()
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

