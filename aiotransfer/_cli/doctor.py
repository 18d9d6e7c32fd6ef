"""``python -m aiotransfer doctor``: which engines load, which transport, what is missing (and the fix).

``doctor`` probes every engine in a child interpreter (a broken native library cannot take the CLI down,
and nothing heavy is imported here), predicts which transport Mooncake will install, looks for the
Debian libraries the engines need, and prints one fix line per problem. It exits 0 unless ``--strict``
is given and a problem was found.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from aiotransfer import ConfigError, TransferConfig, __version__

__all__ = ["add_arguments", "doctor"]

MOONCAKE_DISTS = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-cuda13",
)
NIXL_DISTS = ("nixl-cu12", "nixl-cu13", "nixl")
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
"""Import names of the NIXL wheels (nixl-cu12, nixl-cu13, and the ``nixl`` meta package), in probe order."""
MORI_DISTS = ("amd-mori",)
SYSTEM_LIBS = {  # soname -> Debian package
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
}
ENV_KEYS = (
    "MC_FORCE_TCP", "MC_FORCE_HCA", "MOONCAKE_PROTOCOL", "MC_LOG_LEVEL", "MC_TRANSFER_TIMEOUT",
    "MC_TCP_STATUS_TIMEOUT_SEC", "AIOTRANSFER_ENGINE", "AIOTRANSFER_PROTOCOL", "UCX_TLS",
)
_PROBE_TIMEOUT = 60.0


@dataclass
class Finding:
    """One line of the report. ``level``: ok | info | warn | error; warn and error are problems."""

    level: str
    topic: str
    message: str
    fix: str | None = None

    @property
    def is_problem(self) -> bool:
        return self.level in ("warn", "error")


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, level: str, topic: str, message: str, fix: str | None = None) -> None:
        self.findings.append(Finding(level, topic, message, fix))

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.is_problem]


def _dist_versions(names: Sequence[str]) -> dict[str, str]:
    out = {}
    for name in names:
        version = _dist_version(name)
        if version is not None:
            out[name] = version
    return out


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _probe(code: str, timeout: float = _PROBE_TIMEOUT) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it prints one JSON object. Returns it, or ``{"error": ...}``."""
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"probe timed out after {timeout:.0f}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        result: dict[str, Any] = json.loads(lines[-1])
        return result
    err = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    if proc.returncode < 0:
        err = f"interpreter killed by signal {-proc.returncode} while importing ({err})"
    return {"error": err}


_MOONCAKE_PROBE = """
import json, mooncake, mooncake.engine as m
print(json.dumps({"file": m.__file__, "flags": {k: bool(getattr(m, k)) for k in dir(m) if k.startswith("SUPPORT_")}}))
"""
_NIXL_PROBE = f"""
import importlib, importlib.util, json
pkgs = [p for p in {NIXL_MODULES!r} if importlib.util.find_spec(p) is not None]
for pkg in pkgs:
    try:
        api = importlib.import_module(pkg + "._api")
        break
    except ImportError:
        if pkg == pkgs[-1]:
            raise
print(json.dumps({{"file": api.__file__, "package": pkg}}))
"""
_MORI_PROBE = """
import json, mori.io as io
print(json.dumps({"file": io.__file__}))
"""


def _import_fix(error: str, engine: str) -> str:
    if "libcuda" in error or "libcudart" in error:
        return ("pip uninstall -y mooncake-transfer-engine mooncake-transfer-engine-cuda13 && "
                "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1   # CUDA wheel without an NVIDIA driver")
    missing = [pkg for so, pkg in SYSTEM_LIBS.items() if so.split(".so")[0] in error]
    if missing:
        return f"apt-get install -y {' '.join(missing)}"
    if "libamdhip64" in error or "libhsa-runtime64" in error:
        return "MORI-IO needs ROCm (libamdhip64, libhsa-runtime64); it cannot run on this host"
    if "libpci" in error:
        return "apt-get install -y libpci3"
    return f"reinstall the {engine} package (see the error above)"


def _ldconfig_names() -> set[str] | None:
    for exe in (shutil.which("ldconfig"), "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        if not exe or not os.path.exists(exe):
            continue
        try:
            out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        return {line.split()[0] for line in out.splitlines()[1:] if line.strip()}
    return None


def _lib_loadable(soname: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def _check_system_libs(rep: Report) -> None:
    names = _ldconfig_names()
    how = "ldconfig -p" if names is not None else "dlopen"
    missing = []
    for soname, pkg in SYSTEM_LIBS.items():
        present = soname in names if names is not None else _lib_loadable(soname)
        if present:
            rep.add("ok", "system", f"{soname} found ({how})")
        else:
            missing.append(pkg)
            rep.add("error", "system", f"{soname} is missing (needed by Mooncake's engine.so)",
                    f"apt-get install -y {pkg}")
    rep.facts["system_libs_missing"] = missing
    if len(missing) > 1:
        rep.add("info", "system", "all missing libraries at once", f"apt-get install -y {' '.join(missing)}")
    cuda = "libcuda.so.1" in names if names is not None else _lib_loadable("libcuda.so.1")
    rep.facts["nvidia_driver"] = cuda
    rep.add("info", "system", "NVIDIA driver (libcuda.so.1) " + ("present" if cuda else
            "absent: only CPU builds of the engines can load (mooncake-transfer-engine-non-cuda)"))


def _rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def _check_mooncake(rep: Report) -> dict[str, bool] | None:
    dists = _dist_versions(MOONCAKE_DISTS)
    rep.facts["mooncake_dists"] = dists
    if len(dists) > 1:
        keep = "mooncake-transfer-engine-non-cuda" if not rep.facts.get("nvidia_driver") else "mooncake-transfer-engine"
        others = " ".join(d for d in dists if d != keep)
        rep.add("error", "mooncake", f"several Mooncake wheels installed ({', '.join(dists)}); they all "
                "provide the same 'mooncake' package and overwrite each other",
                f"pip uninstall -y {others} && pip install --force-reinstall {keep}")
    if not _has_module("mooncake"):
        rep.add("warn", "mooncake", "mooncake is not installed (engine 'mooncake' / 'mooncake_tcp' unavailable)",
                "pip install 'aiotransfer[mooncake-cpu]'   # or 'aiotransfer[mooncake]' on GPU hosts")
        return None
    wheel = ", ".join(f"{d} {v}" for d, v in dists.items()) or "unknown distribution (source build?)"
    res = _probe(_MOONCAKE_PROBE)
    if "error" in res:
        rep.add("error", "mooncake", f"mooncake ({wheel}) is installed but mooncake.engine does not import: "
                f"{res['error']}", _import_fix(res["error"], "mooncake"))
        return None
    flags: dict[str, bool] = res["flags"]
    rep.facts["mooncake_flags"] = flags
    shown = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in sorted(flags.items()))
    rep.add("ok", "mooncake", f"mooncake imports: {wheel}; build flags: {shown or 'none reported'}")
    if rep.facts.get("nvidia_driver") is False and flags.get("SUPPORT_CUDA"):
        rep.add("warn", "mooncake", "a CUDA build of Mooncake is installed but there is no NVIDIA driver",
                "pip uninstall -y mooncake-transfer-engine && pip install mooncake-transfer-engine-non-cuda")
    return flags


def _check_transport(rep: Report, flags: dict[str, bool] | None) -> None:
    devices = _rdma_devices()
    rep.facts["rdma_devices"] = devices
    env = os.environ
    rep.add("info", "transport", "RDMA devices in /sys/class/infiniband: " + (", ".join(devices) or "none"))
    force_tcp = "MC_FORCE_TCP" in env  # Mooncake tests presence: MC_FORCE_TCP=0 forces TCP too
    force_hca = bool(env.get("MC_FORCE_HCA"))
    engine = env.get("AIOTRANSFER_ENGINE") or "mooncake"
    protocol = env.get("AIOTRANSFER_PROTOCOL") or env.get("MOONCAKE_PROTOCOL") or "rdma"
    rep.facts["mooncake_protocol"] = protocol
    if flags is not None:
        from aiotransfer.engines._mooncake_setup import select_mooncake_setup

        try:
            select_mooncake_setup(
                config_protocol=env.get("AIOTRANSFER_PROTOCOL") or None, env=env,
                alias_tcp=engine == "mooncake_tcp", build_flags=flags,
            )
        except ConfigError as exc:
            rep.add("error", "transport", str(exc), "unset MOONCAKE_PROTOCOL, or install the build it names; "
                    "on CPU hosts use TransferConfig(engine='mooncake_tcp')")
    if flags is not None and engine != "mooncake_tcp" and not force_hca:
        from aiotransfer.engines._mooncake_setup import installed_transport

        try:
            exact = installed_transport(protocol, flags, env, bool(devices))
        except Exception:  # a prediction only; fall back to the simple rules below
            exact = None
        if exact is not None:
            rep.facts["mooncake_transport_exact"] = exact
    if engine == "mooncake_tcp":
        predicted = "tcp (engine 'mooncake_tcp' sets MC_FORCE_TCP=1)"
    elif force_tcp:
        predicted = f"tcp (MC_FORCE_TCP={env['MC_FORCE_TCP']}; Mooncake only checks that it is set)"
    elif protocol != "rdma":
        predicted = f"{protocol} (protocol from the environment)"
    elif devices:
        predicted = f"rdma on {', '.join(devices)}"
    elif force_hca:
        predicted = "none: MC_FORCE_HCA is set but there is no RDMA device, initialize() will fail"
        rep.add("error", "transport", predicted,
                "unset MC_FORCE_HCA   # or use TransferConfig(engine='mooncake_tcp')")
    else:
        predicted = "tcp (protocol 'rdma' requested, no RDMA device found: Mooncake falls back to TCP)"
    rep.facts["mooncake_transport"] = predicted
    rep.add("ok" if not predicted.startswith("none") else "error", "transport",
            f"engine '{engine}' would install transport: {predicted}")
    rep.add("info", "transport", "engine 'mooncake_tcp' always installs tcp (MC_FORCE_TCP=1): deterministic on CI")
    if engine != "mooncake_tcp" and not devices and not force_tcp:
        rep.add("info", "transport", "TCP is chosen by fallback here; make it explicit",
                "export MC_FORCE_TCP=1   # or TransferConfig(engine='mooncake_tcp')")


def _check_nixl(rep: Report) -> None:
    dists = _dist_versions(NIXL_DISTS)
    rep.facts["nixl_dists"] = dists
    if not any(_has_module(m) for m in NIXL_MODULES):
        rep.add("info", "nixl", "nixl is not installed (optional engine)",
                "pip install --no-deps nixl-cu12   # nixl-cu13 on CUDA 13 hosts; add torch yourself: the plain "
                "install pulls a 5.7 GB CUDA stack")
        return
    wheel = ", ".join(f"{d} {v}" for d, v in dists.items()) or "unknown distribution"
    res = _probe(_NIXL_PROBE)
    if "error" in res:
        rep.add("error", "nixl", f"nixl ({wheel}) does not import: {res['error']}", _import_fix(res["error"], "nixl"))
        return
    rep.add("ok", "nixl", f"nixl imports ({res['package']}: {wheel}); UCX_TLS={os.environ.get('UCX_TLS', '(default)')}")
    if not _has_module("aiotransfer.engines._nixl"):
        rep.add("info", "nixl", "this aiotransfer build has no NIXL adapter (aiotransfer/engines/_nixl.py) yet")


def _check_mori(rep: Report) -> None:
    dists = _dist_versions(MORI_DISTS)
    rep.facts["mori_dists"] = dists
    if not _has_module("mori"):
        rep.add("info", "mori", "mori is not installed (optional engine; needs ROCm GPUs, wheels for cp310/cp312)")
        return
    res = _probe(_MORI_PROBE)
    if "error" in res:
        rep.add("warn", "mori", f"mori is installed but mori.io does not import: {res['error']}",
                _import_fix(res["error"], "mori"))
        return
    rep.add("ok", "mori", f"mori.io imports ({', '.join(f'{d} {v}' for d, v in dists.items()) or 'unknown'})")


def _cuda_major() -> int | None:
    """The CUDA major version the NVIDIA driver supports (``cuDriverGetVersion``), or None without one."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000 or None


def _check_wheels(rep: Report) -> None:
    """Which Mooncake and NIXL wheels fit this host's CUDA (the extras cannot detect it)."""
    from aiotransfer.engines._mooncake_setup import recommended_wheels

    cuda = _cuda_major()
    rep.facts["cuda_major"] = cuda
    try:
        choice = recommended_wheels(cuda)
    except ConfigError as exc:
        rep.add("error", "wheels", str(exc))
        return
    host = f"CUDA {cuda}" if cuda is not None else "no NVIDIA driver"
    rep.add("info", "wheels", f"for this host ({host}): Mooncake {choice.mooncake}, NIXL {choice.nixl}",
            f"{choice.mooncake_pip}; {choice.nixl_pip}")


def _check_python(rep: Report) -> None:
    core = _dist_versions(("numpy", "pyzmq", "msgspec"))
    rep.facts.update(python=platform.python_version(), platform=platform.platform(), cpus=os.cpu_count(),
                     aiotransfer=__version__, core=core)
    rep.add("ok", "python", f"aiotransfer {__version__} on Python {platform.python_version()} "
            f"({platform.machine()}, {os.cpu_count()} CPUs); " + ", ".join(f"{k} {v}" for k, v in core.items()))
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    rep.facts["env"] = env
    if env:
        rep.add("info", "env", " ".join(f"{k}={v}" for k, v in env.items()))
    if "MC_LOG_LEVEL" not in os.environ:
        level = TransferConfig().engine_log_level
        rep.add("info", "env", f"MC_LOG_LEVEL unset: aiotransfer sets it to TransferConfig.engine_log_level "
                f"({level} by default) before its first Mooncake engine loads; a Mooncake other code loaded earlier "
                "in the process logs at INFO", f"export MC_LOG_LEVEL={level}")


def doctor(ns: argparse.Namespace) -> int:
    rep = Report()
    _check_python(rep)
    _check_system_libs(rep)
    flags = _check_mooncake(rep)
    _check_transport(rep, flags)
    _check_nixl(rep)
    _check_mori(rep)
    _check_wheels(rep)
    if ns.json:
        print(json.dumps({"findings": [asdict(f) for f in rep.findings], "facts": rep.facts,
                          "problems": len(rep.problems)}, indent=2))
    else:
        marks = {"ok": " ok ", "info": "info", "warn": "WARN", "error": "FAIL"}
        for f in rep.findings:
            print(f"[{marks[f.level]}] {f.topic:9} {f.message}")
            if f.fix and (f.is_problem or ns.verbose):
                print(f"{'':17}fix: {f.fix}")
        problems = rep.problems
        print()
        if problems:
            print(f"{len(problems)} problem(s). Fix lines:")
            for f in problems:
                print(f"  {f.fix or '(see above)'}")
        else:
            print("no problems found")
    return 1 if ns.strict and rep.problems else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strict", action="store_true", help="exit 1 when a problem is found")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-v", "--verbose", action="store_true", help="show suggestions for informational lines too")
