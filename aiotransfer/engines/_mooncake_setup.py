"""Mooncake protocol, environment and wheel selection: pure, no engine created, no ``mooncake`` import.

* :func:`select_mooncake_setup`  -- protocol, RDMA devices and environment defaults, from config, env and build
* :func:`installed_transport`    -- the transport Mooncake will actually install for that choice
* :func:`apply_env`              -- ``setdefault`` the chosen variables (a user's value wins)
* :func:`read_build_flags`       -- the ``SUPPORT_*`` flags of a loaded ``mooncake.engine`` module
* :func:`recommended_wheels`     -- which Mooncake and NIXL wheels fit a host's CUDA major version

The adapter (:mod:`aiotransfer.engines._mooncake`) applies the outcome; the doctor command and the tests
use these functions directly.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._config import TransferConfig
from ..errors import ConfigError

__all__ = [
    "MOONCAKE_PROTOCOLS",
    "MooncakeSetup",
    "WheelChoice",
    "apply_env",
    "installed_transport",
    "load_time_env",
    "read_build_flags",
    "recommended_wheels",
    "select_mooncake_setup",
]

MOONCAKE_PROTOCOLS = ("rdma", "efa", "tcp", "nvlink", "nvlink_intra", "ascend", "hip")
PROTOCOL_ENV = "MOONCAKE_PROTOCOL"
FORCE_TCP_ENV = "MC_FORCE_TCP"
NPU_PHY_ID_ENV = "ASCEND_NPU_PHY_ID"
ASCEND_DIST = "mooncake-transfer-engine-npu"
ASCEND_FLAG = "SUPPORT_ASCEND"
"""Pseudo build flag: the binding exports none for Ascend, so it is derived from the installed wheel."""

PROTOCOL_BUILD_FLAGS: Mapping[str, str] = {
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
    flag = PROTOCOL_BUILD_FLAGS.get(protocol)
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


def load_time_env(config: TransferConfig) -> dict[str, str]:
    """Variables the extension reads once, when it loads (glog's level, the engine's global config)."""
    wanted = {"MC_LOG_LEVEL": config.engine_log_level}
    if config.engine_metadata_refresh_s is not None:
        wanted[REFRESH_ENV] = str(config.engine_metadata_refresh_s)
    return wanted


def read_build_flags(module: Any) -> dict[str, bool]:
    """The module's ``SUPPORT_*`` build flags, plus ``SUPPORT_ASCEND`` derived from the installed wheel."""
    flags = {k: bool(getattr(module, k, False)) for k in dir(module) if k.startswith("SUPPORT_")}
    try:
        importlib.metadata.version(ASCEND_DIST)
        flags[ASCEND_FLAG] = True
    except importlib.metadata.PackageNotFoundError:
        flags.setdefault(ASCEND_FLAG, False)
    return flags


def apply_env(config: TransferConfig, setup: MooncakeSetup, environ: MutableMapping[str, str]) -> dict[str, str]:
    """``setdefault`` the engine's variables (a value the user set wins); returns what was actually set."""
    wanted = dict(setup.env_defaults)
    wanted.update(load_time_env(config))
    if config.engine_timeout_s is not None:
        wanted["MC_TRANSFER_TIMEOUT"] = str(config.engine_timeout_s)
        wanted["MC_TCP_STATUS_TIMEOUT_SEC"] = str(max(3, config.engine_timeout_s - 1))
    applied: dict[str, str] = {}
    for key, value in wanted.items():
        if key not in environ:
            environ[key] = value
            applied[key] = value
    return applied


MOONCAKE_VERSION = "0.3.13.post1"
"""The pinned Mooncake wheels (``-non-cuda``, CUDA 12); the CUDA 13 wheel starts at 0.3.14."""
MOONCAKE_CUDA13_VERSION = "0.3.14"


@dataclass(frozen=True)
class WheelChoice:
    """The engine wheels that fit one host, with the aiotransfer extras that install them."""

    cuda_major: int | None
    """The host's CUDA major version (None: no NVIDIA driver)."""
    mooncake: str
    """Mooncake distribution, pinned (``mooncake-transfer-engine-non-cuda==...``, ...)."""
    mooncake_extra: str
    """The aiotransfer extra that installs it (``mooncake-cpu``, ``mooncake``, ``mooncake-cuda13``)."""
    nixl: str
    """NIXL distribution (``nixl-cu12`` or ``nixl-cu13``)."""
    nixl_extra: str
    """The aiotransfer extra that installs it (``nixl`` or ``nixl-cu13``)."""
    nixl_no_deps: bool
    """Install NIXL with ``--no-deps``: without CUDA its unpinned ``torch`` requirement would pull a
    multi-GB CUDA build that NIXL only uses for type hints."""

    @property
    def mooncake_pip(self) -> str:
        return f"pip install 'aiotransfer[{self.mooncake_extra}]'  ({self.mooncake})"

    @property
    def nixl_pip(self) -> str:
        if self.nixl_no_deps:
            return f"pip install --no-deps {self.nixl} numpy"
        return f"pip install 'aiotransfer[{self.nixl_extra}]'  ({self.nixl})"


def recommended_wheels(cuda_major: int | None) -> WheelChoice:
    """The Mooncake and NIXL wheels for a host whose CUDA major version is ``cuda_major`` (pure).

    ``None`` (no NVIDIA driver): ``mooncake-transfer-engine-non-cuda`` (the CUDA wheels cannot even be
    imported without ``libcuda.so.1``) and ``nixl-cu12`` with ``--no-deps``. 12: the CUDA 12 wheels
    (``mooncake-transfer-engine``, ``nixl-cu12``). 13 and newer: the CUDA 13 wheels
    (``mooncake-transfer-engine-cuda13``, ``nixl-cu13``), the newest published. Older CUDA has no
    published wheel: ``ConfigError``. All Mooncake wheels install the same ``mooncake`` package, so
    uninstall the one present before installing another.
    """
    if cuda_major is None:
        return WheelChoice(None, f"mooncake-transfer-engine-non-cuda=={MOONCAKE_VERSION}", "mooncake-cpu",
                           "nixl-cu12", "nixl", nixl_no_deps=True)
    if cuda_major < 12:
        raise ConfigError(
            f"no published Mooncake or NIXL wheel supports CUDA {cuda_major} (they need CUDA 12 or 13); "
            "upgrade the driver and CUDA runtime, or build both from source"
        )
    if cuda_major == 12:
        return WheelChoice(12, f"mooncake-transfer-engine=={MOONCAKE_VERSION}", "mooncake", "nixl-cu12", "nixl",
                           nixl_no_deps=False)
    return WheelChoice(cuda_major, f"mooncake-transfer-engine-cuda13=={MOONCAKE_CUDA13_VERSION}",
                       "mooncake-cuda13", "nixl-cu13", "nixl-cu13", nixl_no_deps=False)
