"""Mooncake protocol selection and one native engine per process.

Selection is pure (``select_mooncake_setup`` + ``installed_transport``), so most of this file is tables
over config x environment x alias x build flags. The real engine is checked in a subprocess (Mooncake's
native engine is a per-process singleton in the adapter and protocols must match within a process) and,
for sharing, with two real managers in this process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aiotransfer import KVArgs, KVManager, TransferConfig
from aiotransfer.engines import _mooncake as mc
from aiotransfer.engines import _mooncake_setup as mcs
from aiotransfer.engines._mooncake import (
    MOONCAKE_PROTOCOLS,
    MooncakeSetup,
    installed_transport,
    select_mooncake_setup,
)
from aiotransfer.errors import ConfigError
from tests.conftest import GEOMETRY, expected_digest
from tests.peer import make_buffers
from tests.remote import RemotePeer

ROOT = Path(__file__).resolve().parent.parent

# Build flags as the wheels report them (``SUPPORT_ASCEND`` is derived from the installed wheel).
NON_CUDA: dict[str, bool] = {}  # mooncake-transfer-engine-non-cuda: every flag False
CUDA = {"SUPPORT_CUDA": True, "SUPPORT_INTRA_NVLINK": True}  # mooncake-transfer-engine, x86_64
CUDA_ARM = {"SUPPORT_CUDA": True, "SUPPORT_MNNVL": True}  # mooncake-transfer-engine, aarch64
EFA = {"SUPPORT_EFA": True}  # mooncake-transfer-engine-efa-non-cuda
EFA_CUDA = {"SUPPORT_EFA": True, "SUPPORT_CUDA": True}
HIP = {"SUPPORT_HIP": True}  # mooncake-transfer-engine-rocm
ASCEND = {"SUPPORT_ASCEND": True}  # mooncake-transfer-engine-npu
FLAG_SETS = {"non-cuda": NON_CUDA, "cuda": CUDA, "cuda-arm": CUDA_ARM, "efa": EFA, "efa-cuda": EFA_CUDA,
             "hip": HIP, "ascend": ASCEND}


@dataclass
class Case:
    id: str
    config: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    alias: bool = False
    flags: Mapping[str, bool] = field(default_factory=dict)
    devices: str | None = None
    device_id: int | None = None
    # expected
    protocol: str = ""
    source: str = ""
    device_name: str = ""
    env_defaults: Mapping[str, str] = field(default_factory=dict)
    npu_id: int | None = None
    error: str | None = None
    note: str | None = None


P = "MOONCAKE_PROTOCOL"
TCP_ENV = {"MC_FORCE_TCP": "1"}
CASES = [
    # precedence: config > env > default
    Case("default", protocol="rdma", source="default"),
    Case("env", env={P: "tcp"}, protocol="tcp", source="env", env_defaults=TCP_ENV),
    Case("env-efa", env={P: "efa"}, flags=EFA, protocol="efa", source="env"),
    Case("config-beats-env", config="rdma", env={P: "tcp"}, protocol="rdma", source="config"),
    Case("config-normalised", config=" TCP ", protocol="tcp", source="config", env_defaults=TCP_ENV),
    Case("blank-env-is-unset", env={P: "  "}, protocol="rdma", source="default"),
    Case("bad-env", env={P: "bogus"}, error="unknown Mooncake protocol 'bogus' (from $MOONCAKE_PROTOCOL)"),
    Case("bad-config", config="infiniband", env={P: "tcp"}, error="unknown Mooncake protocol 'infiniband'"),
    # build flags
    Case("efa-without-flag", config="efa", error="pip install mooncake-transfer-engine-efa-non-cuda"),
    Case("efa-without-flag-cuda", config="efa", flags=CUDA,
         error="pip install mooncake-transfer-engine-efa  (CUDA 12; mooncake-transfer-engine-efa-cuda13"),
    Case("efa-with-flag", config="efa", flags=EFA, protocol="efa", source="config"),
    Case("rdma-on-efa-build", config="rdma", flags=EFA, protocol="rdma", source="config", note="runs over TCP"),
    Case("nvlink-without-flag", config="nvlink", flags=CUDA, error="SUPPORT_MNNVL"),
    Case("nvlink-with-flag", config="nvlink", flags=CUDA_ARM, protocol="nvlink", source="config",
         env_defaults={"MC_FORCE_MNNVL": "1"}),
    Case("nvlink-intra-without-flag", config="nvlink_intra", error="pip install mooncake-transfer-engine "),
    Case("nvlink-intra-with-flag", config="nvlink_intra", flags=CUDA, protocol="nvlink_intra", source="config",
         env_defaults={"MC_INTRANODE_NVLINK": "1"}),
    Case("hip-without-flag", env={P: "hip"}, error="pip install mooncake-transfer-engine-rocm"),
    Case("hip-with-flag", env={P: "hip"}, flags=HIP, protocol="hip", source="env"),
    # the mooncake_tcp alias
    Case("alias", alias=True, protocol="tcp", source="alias", env_defaults=TCP_ENV),
    Case("alias-clears-devices", alias=True, devices="mlx5_0,mlx5_1", protocol="tcp", source="alias",
         env_defaults=TCP_ENV, note="rdma_devices is ignored"),
    Case("alias-ignores-env", alias=True, env={P: "rdma"}, protocol="tcp", source="alias", env_defaults=TCP_ENV,
         note="ignores MOONCAKE_PROTOCOL='rdma'"),
    Case("alias-ignores-bad-env", alias=True, env={P: "bogus"}, protocol="tcp", source="alias",
         env_defaults=TCP_ENV, note="ignores MOONCAKE_PROTOCOL='bogus'"),
    Case("alias-with-config-tcp", alias=True, config="tcp", protocol="tcp", source="alias", env_defaults=TCP_ENV),
    Case("alias-contradicted", alias=True, config="rdma", error="engine 'mooncake_tcp' forces TCP"),
    Case("alias-user-force-tcp-0", alias=True, env={"MC_FORCE_TCP": "0"}, protocol="tcp", source="alias",
         env_defaults=TCP_ENV, note="only checks that the variable exists"),
    Case("rdma-with-user-force-tcp", env={"MC_FORCE_TCP": "1"}, protocol="rdma", source="default",
         note="installs TCP, not 'rdma'"),
    # ascend: host:port:npu_<id>
    Case("ascend-env-id", config="ascend", env={"ASCEND_NPU_PHY_ID": "5"}, device_id=2, flags=ASCEND,
         protocol="ascend", source="config", npu_id=5),
    Case("ascend-device-id", config="ascend", device_id=3, flags=ASCEND, protocol="ascend", source="config",
         npu_id=3),
    Case("ascend-default-id", env={P: "ascend"}, flags=ASCEND, protocol="ascend", source="env", npu_id=0),
    Case("ascend-env-unset-marker", config="ascend", env={"ASCEND_NPU_PHY_ID": "-1"}, device_id=4, flags=ASCEND,
         protocol="ascend", source="config", npu_id=4),
    Case("ascend-bad-env-id", config="ascend", env={"ASCEND_NPU_PHY_ID": "npu3"}, error="ASCEND_NPU_PHY_ID"),
    Case("ascend-not-npu-wheel", config="ascend", protocol="ascend", source="config", npu_id=0,
         note="mooncake-transfer-engine-npu"),
    # RDMA device lists
    Case("devices-comma", devices=" mlx5_0, mlx5_1,,mlx5_0", protocol="rdma", source="default",
         device_name="mlx5_0,mlx5_1"),
    Case("devices-json-string", devices='{"0": "mlx5_0,mlx5_1", "1": "mlx5_2"}', device_id=1,
         protocol="rdma", source="default", device_name="mlx5_2"),
    Case("devices-json-list", devices='{"0": ["mlx5_0"], "1": ["mlx5_2", "mlx5_3"]}', device_id=1,
         protocol="rdma", source="default", device_name="mlx5_2,mlx5_3"),
    Case("devices-json-no-device-id", devices='{"0": ["mlx5_0"], "1": ["mlx5_2"]}', protocol="rdma",
         source="default", device_name="mlx5_0"),
    Case("devices-json-efa", config="efa", flags=EFA, devices='{"0": "rdmap0s6"}', protocol="efa",
         source="config", device_name="rdmap0s6"),
    Case("devices-json-missing-gpu", devices='{"0": "mlx5_0", "1": "mlx5_1"}', device_id=7,
         error="no entry for GPU 7 (this rank's device_id); keys: 0, 1"),
    Case("devices-json-invalid", devices='{"0": mlx5_0}', error="not valid JSON"),
    Case("devices-json-not-a-map", devices='["mlx5_0"]', error="must map a GPU id"),
    Case("devices-json-bad-value", devices='{"0": 5}', error="must be a string or a list of strings"),
    Case("devices-empty-list", devices=" , ", error="names no device"),
    Case("devices-ignored-for-tcp", config="tcp", devices='{"0": "mlx5_0"}', protocol="tcp", source="config",
         env_defaults=TCP_ENV, note="rdma_devices is ignored"),
]


def select(case: Case) -> MooncakeSetup:
    return select_mooncake_setup(
        config_protocol=case.config, env=case.env, alias_tcp=case.alias, build_flags=case.flags,
        rdma_devices=case.devices, device_id=case.device_id,
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_select(case: Case) -> None:
    if case.error is not None:
        with pytest.raises(ConfigError) as info:
            select(case)
        assert case.error in str(info.value)
        assert isinstance(info.value, ValueError)
        return
    setup = select(case)
    assert (setup.protocol, setup.source, setup.device_name) == (case.protocol, case.source, case.device_name)
    assert dict(setup.env_defaults) == dict(case.env_defaults)
    assert setup.force_tcp == (case.protocol == "tcp")
    assert setup.npu_id == case.npu_id
    if case.note is None:
        assert setup.notes == ()
    else:
        assert any(case.note in n for n in setup.notes), setup.notes


def test_protocol_list_is_the_documented_one() -> None:
    assert MOONCAKE_PROTOCOLS == ("rdma", "efa", "tcp", "nvlink", "nvlink_intra", "ascend", "hip")


# -- ascend hostname ---------------------------------------------------------------------------------------


def test_ascend_hostname_suffix_and_free_port() -> None:
    setup = select_mooncake_setup(config_protocol="ascend", env={"ASCEND_NPU_PHY_ID": "6"}, alias_tcp=False,
                                  build_flags=ASCEND)
    assert setup.hostname_suffix == ":{port}:npu_6"
    assert setup.local_hostname("10.0.0.5", 40123) == "10.0.0.5:40123:npu_6"
    with pytest.raises(ValueError):
        setup.local_hostname("10.0.0.5")
    plain = select_mooncake_setup(config_protocol="rdma", env={}, alias_tcp=False, build_flags={})
    assert plain.hostname_suffix == "" and plain.local_hostname("10.0.0.5", 1) == "10.0.0.5"
    port = mc._free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:  # it was free: binding it again works
        sock.bind(("", port))


# -- environment: setdefault, a user's value wins --------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "expected"),
    [({}, {"MC_FORCE_TCP": "1"}), ({"MC_FORCE_TCP": "0"}, {"MC_FORCE_TCP": "0"})],
    ids=["alias", "alias-user-MC_FORCE_TCP=0"],
)
def test_alias_env_is_setdefault(user: dict[str, str], expected: dict[str, str]) -> None:
    environ = dict(user)
    setup = select_mooncake_setup(config_protocol=None, env=environ, alias_tcp=True, build_flags=NON_CUDA)
    applied = mcs.apply_env(TransferConfig(engine="mooncake_tcp"), setup, environ)
    assert environ["MC_FORCE_TCP"] == expected["MC_FORCE_TCP"]
    assert ("MC_FORCE_TCP" in applied) == (not user)
    # Mooncake checks getenv("MC_FORCE_TCP") != NULL: either way the engine runs TCP, and we say so
    assert installed_transport(setup.protocol, NON_CUDA, environ, has_hca=True) == "tcp"


def test_apply_env_timeouts_and_log_level() -> None:
    setup = select_mooncake_setup(config_protocol="rdma", env={}, alias_tcp=False, build_flags=NON_CUDA)
    environ = {"MC_LOG_LEVEL": "INFO"}
    applied = mcs.apply_env(TransferConfig(engine_timeout_s=7), setup, environ)
    assert environ == {
        "MC_LOG_LEVEL": "INFO", "MC_TRANSFER_TIMEOUT": "7", "MC_TCP_STATUS_TIMEOUT_SEC": "6",
    }
    assert "MC_LOG_LEVEL" not in applied and "MC_FORCE_TCP" not in environ
    environ = {mcs.REFRESH_ENV: "9"}
    config = TransferConfig(engine_timeout_s=None, engine_log_level="ERROR", engine_metadata_refresh_s=5)
    mcs.apply_env(config, setup, environ)
    assert environ == {"MC_LOG_LEVEL": "ERROR", mcs.REFRESH_ENV: "9"}  # the user's value wins
    environ = {}
    mcs.apply_env(TransferConfig(engine_timeout_s=None, engine_metadata_refresh_s=3), setup, environ)
    assert environ == {"MC_LOG_LEVEL": "ERROR", mcs.REFRESH_ENV: "3"}
    assert mc._fresh_alias("10.0.0.5:15228") == "10.0.0.5:015228"
    assert mc._fresh_alias("[fe80::1]:015228") == "[fe80::1]:0015228"


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_metadata_refresh_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ConfigError, match="engine_metadata_refresh_s"):
        TransferConfig(engine_metadata_refresh_s=value)  # type: ignore[arg-type]


# -- the transport actually installed ----------------------------------------------------------------------

TRANSPORT_CASES = [
    # (id, protocol, flags, env, has_hca, expected)
    ("rdma-no-hca-falls-back", "rdma", NON_CUDA, {}, False, "tcp"),
    ("rdma-with-hca", "rdma", NON_CUDA, {}, True, "rdma"),
    ("protocol-ignored-without-env", "tcp", NON_CUDA, {}, True, "rdma"),
    ("force-tcp", "tcp", NON_CUDA, {"MC_FORCE_TCP": "1"}, True, "tcp"),
    ("force-tcp-any-value", "rdma", NON_CUDA, {"MC_FORCE_TCP": "0"}, True, "tcp"),
    ("force-hca", "rdma", NON_CUDA, {"MC_FORCE_HCA": "1"}, False, "rdma"),
    ("efa-build-efa", "efa", EFA, {}, True, "efa"),
    ("efa-build-efa-force-tcp", "efa", EFA, {"MC_FORCE_TCP": "1"}, True, "efa"),
    ("efa-build-rdma", "rdma", EFA, {}, True, "tcp"),
    ("efa-protocol-without-build", "efa", NON_CUDA, {}, False, "tcp"),
    ("mnnvl-forced", "nvlink", CUDA_ARM, {"MC_FORCE_MNNVL": "1"}, True, "nvlink"),
    ("mnnvl-no-hca", "rdma", CUDA_ARM, {}, False, "nvlink"),
    ("mnnvl-hca", "rdma", CUDA_ARM, {}, True, "rdma"),
    ("intra-nvlink", "nvlink_intra", CUDA, {"MC_INTRANODE_NVLINK": "1"}, True, "nvlink_intra"),
    ("intra-only-build-no-hca", "rdma", CUDA, {}, False, "tcp"),
    ("intra-only-build-hca", "rdma", CUDA, {}, True, "rdma"),
    ("hip", "hip", HIP, {}, True, "rdma+hip"),
    ("ascend", "ascend", ASCEND, {}, True, "ascend"),
    ("ascend-force-tcp", "ascend", ASCEND, {"MC_FORCE_TCP": "1"}, True, "tcp"),
]


@pytest.mark.parametrize(("protocol", "flags", "env", "has_hca", "expected"),
                         [c[1:] for c in TRANSPORT_CASES], ids=[c[0] for c in TRANSPORT_CASES])
def test_installed_transport(protocol: str, flags: dict[str, bool], env: dict[str, str], has_hca: bool,
                             expected: str) -> None:
    assert installed_transport(protocol, flags, env, has_hca) == expected


def test_hca_probe_only_when_it_matters() -> None:
    def boom() -> bool:
        raise AssertionError("topology probed although the answer does not depend on it")

    assert installed_transport("tcp", NON_CUDA, {"MC_FORCE_TCP": "1"}, boom) == "tcp"
    assert installed_transport("efa", EFA, {}, boom) == "efa"
    assert installed_transport("ascend", ASCEND, {}, boom) == "ascend"
    assert installed_transport("rdma", NON_CUDA, {}, lambda: False) == "tcp"


@pytest.mark.parametrize("flags_id", sorted(FLAG_SETS))
@pytest.mark.parametrize("alias", [False, True], ids=["mooncake", "mooncake_tcp"])
@pytest.mark.parametrize("protocol", [None, *MOONCAKE_PROTOCOLS])
@pytest.mark.parametrize("has_hca", [False, True], ids=["no-hca", "hca"])
def test_reported_transport_never_claims_a_missing_build(
    flags_id: str, alias: bool, protocol: str | None, has_hca: bool
) -> None:
    """Whole pipeline (select -> setdefault env -> installed transport) over every combination."""
    flags = FLAG_SETS[flags_id]
    environ: dict[str, str] = {}
    try:
        setup = select_mooncake_setup(config_protocol=protocol, env=environ, alias_tcp=alias, build_flags=flags)
    except ConfigError as exc:  # alias contradicted by the config, or a build flag missing
        assert (alias and protocol != "tcp") or protocol in mcs.PROTOCOL_BUILD_FLAGS, exc
        return
    mcs.apply_env(TransferConfig(), setup, environ)
    transport = installed_transport(setup.protocol, flags, environ, has_hca)
    needs = {"efa": "SUPPORT_EFA", "nvlink": "SUPPORT_MNNVL", "nvlink_intra": "SUPPORT_INTRA_NVLINK",
             "hip": "SUPPORT_HIP", "ascend": "SUPPORT_ASCEND"}
    for part in transport.split("+"):
        assert part in ("tcp", "rdma") or flags.get(needs[part], False), (transport, flags)
    if setup.protocol == "tcp":
        assert transport.split("+")[0] == "tcp"
    if setup.protocol in needs and flags.get(needs[setup.protocol], False):  # asked for and built in: used
        assert setup.protocol in transport.split("+")


# -- HCA detection --------------------------------------------------------------------------------------------


class FakeNative:
    def __init__(self, topology: str | Exception) -> None:
        self.topology = topology
        self.asked: list[str | None] = []

    def get_local_topology(self, device_name: str | None = None) -> str:
        self.asked.append(device_name)
        if isinstance(self.topology, Exception):
            raise self.topology
        return self.topology


def test_visible_hcas_honours_the_device_filter(tmp_path: Path) -> None:
    for name in ("mlx5_0", "mlx5_1", "mlx5_2"):
        (tmp_path / name).mkdir()
    assert mc._visible_hcas("", str(tmp_path)) == ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert mc._visible_hcas("mlx5_2,mlx5_9", str(tmp_path)) == ["mlx5_2"]
    assert mc._visible_hcas("", str(tmp_path / "absent")) == []


def test_has_hca(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mc, "_visible_hcas", lambda f: [])
    native = FakeNative(AssertionError("no device in sysfs: the engine is not asked"))
    assert mc._has_hca(native, "") is False and native.asked == []
    monkeypatch.setattr(mc, "_visible_hcas", lambda f: ["mlx5_0"])
    with_hca = FakeNative(json.dumps({"cpu:0": [["mlx5_0"], []]}))
    assert mc._has_hca(with_hca, "mlx5_0") is True and with_hca.asked == ["mlx5_0"]
    assert mc._has_hca(FakeNative(json.dumps({"cpu:0": [[], []]})), "") is False  # present but unusable
    assert mc._has_hca(FakeNative(RuntimeError("x")), "") is True


# -- the real engine, in a subprocess (one protocol per process) -------------------------------------------

REAL_RDMA = textwrap.dedent("""
    import asyncio, json, logging, os
    import numpy as np
    from aiotransfer import KVArgs, KVManager, TransferConfig

    logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")

    async def main():
        bufs = [np.zeros((8, 256), dtype=np.uint8)]
        cfg = TransferConfig(engine="mooncake", protocol="rdma", staging_bytes=0)
        async with KVManager(KVArgs(bufs, page_size=1, dtype="uint8"), cfg) as mgr:
            info = mgr.describe()
            info["mc_force_tcp"] = os.environ.get("MC_FORCE_TCP")
            print("DESCRIBE " + json.dumps(info), flush=True)

    asyncio.run(main())
""")


def test_real_engine_rdma_on_this_host_reports_tcp() -> None:
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices")
    env = {k: v for k, v in os.environ.items() if k not in ("MC_FORCE_TCP", P, "MC_FORCE_HCA")}
    env["MC_LOG_LEVEL"] = "ERROR"
    proc = subprocess.run([sys.executable, "-c", REAL_RDMA], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DESCRIBE "))
    info: dict[str, Any] = json.loads(line[len("DESCRIBE "):])
    assert info["engine"] == "mooncake"
    assert (info["protocol"], info["protocol_source"], info["transport"]) == ("rdma", "config", "tcp")
    assert info["mc_force_tcp"] is None  # the fallback is Mooncake's own, not something we forced
    assert "SUPPORT_EFA" not in info["build"] and "SUPPORT_MNNVL" not in info["build"]
    assert "transport=tcp" in proc.stderr  # the log line
    assert "protocol 'rdma' was asked for (from config) but the 'tcp' transport is installed" in proc.stderr


# -- one native engine per process ---------------------------------------------------------------------------


def keys(bufs: list[Any]) -> set[tuple[int, int]]:
    return {(int(b.ctypes.data), int(b.nbytes)) for b in bufs}


async def test_two_managers_share_one_native_engine() -> None:
    cfg = TransferConfig(engine="mooncake_tcp", handshake_timeout=10.0, staging_bytes=0)
    bufs_a = make_buffers(GEOMETRY["buffers"], GEOMETRY["pages"], GEOMETRY["item_len"], seed=5)
    bufs_b = make_buffers(GEOMETRY["buffers"], GEOMETRY["pages"], GEOMETRY["item_len"], seed=6)
    mgr_a = await KVManager(KVArgs(bufs_a, page_size=16, dtype="uint8"), cfg).start()
    try:
        mgr_b = await KVManager(KVArgs(bufs_b, page_size=16, dtype="uint8"), cfg).start()
    except BaseException:
        await mgr_a.aclose()
        raise
    shared = mc._SharedNative.instance
    assert shared is not None
    refs = shared.refs
    decode = await RemotePeer.start("mooncake_tcp", **GEOMETRY)
    try:
        eng_a: Any = mgr_a.engine
        eng_b: Any = mgr_b.engine
        assert eng_a is not eng_b and eng_a.raw() is eng_b.raw() is shared.native
        assert mgr_a.describe()["session_id"] == mgr_b.describe()["session_id"] == shared.session_id
        assert mgr_a.describe()["shared_refs"] == refs >= 2

        owned_a = {(r.ptr, r.nbytes) for r in eng_a._owned}
        owned_b = {(r.ptr, r.nbytes) for r in eng_b._owned}
        assert keys(bufs_a) <= owned_a and keys(bufs_b) <= owned_b
        assert not keys(bufs_a) & owned_b and not keys(bufs_b) & owned_a
        assert keys(bufs_a) | keys(bufs_b) <= set(shared.regions)

        await mgr_a.aclose()
        assert shared.refs == refs - 1 and mc._SharedNative.instance is shared
        assert not keys(bufs_a) & set(shared.regions)  # a's memory left the engine...
        assert keys(bufs_b) <= set(shared.regions)  # ...b's did not

        # b still transfers through the shared engine, to another process
        dst, src = list(range(10, 50)), list(range(100, 140))
        tx = mgr_b.sender(3)
        await decode.call("receiver", room=3, peer=mgr_b.endpoint, pages=dst)
        await tx.wait_ready(timeout=10)
        await tx.send_kv(src)
        await tx.done(timeout=10)
        assert (await decode.call("done", room=3))["status"] == "Success"
        assert (await decode.call("digest", pages=dst))["digest"] == expected_digest(bufs_b, src)
    finally:
        await decode.close()
        await mgr_a.aclose()
        await mgr_b.aclose()
    assert shared.refs == refs - 2
    assert not (keys(bufs_a) | keys(bufs_b)) & set(shared.regions)
