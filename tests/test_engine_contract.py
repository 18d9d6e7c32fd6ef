"""The engine contract, run against every engine that can run here.

* ``mooncake``: the real Mooncake TCP engine; the target buffer lives in another OS process.
* ``nixl``: the real NIXL agent (UCX); the target lives in another OS process. Skipped if nixl is missing.
* ``mori``: the MORI adapter over ``tests/fake_mori.py`` (MORI-IO needs ROCm); both engines in this process.
* ``memory``: the in-memory test engine of ``aiotransfer.testing`` (auto mode); both engines in this process.

Completion is driven by polling ``check``: a handle is over on DONE or FAILED, and a write the engine
dooms (``handle.doomed``: it will not succeed, but the engine has not let go of its memory) counts as
failed for the caller while the handle stays live.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiotransfer._config import TransferConfig
from aiotransfer._plan import Blocks
from aiotransfer.engines._base import (
    EngineStatus,
    EngineTraits,
    MemoryRegion,
    TransferEngine,
    TransferHandle,
)
from aiotransfer.engines._registry import create_engine
from aiotransfer.errors import ClosedError, EngineError, EngineUnavailable
from aiotransfer.testing import MemoryFabric
from tests import fake_mori

PEER_SCRIPT = Path(__file__).with_name("_engine_peer.py")
ROOT = PEER_SCRIPT.parent.parent
NBYTES = 1 << 20


def u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


class ProcessPeer:
    """The target engine and its buffer in another OS process (tests/_engine_peer.py)."""

    def __init__(self, engine: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), engine, str(NBYTES)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=None if env is None else {**os.environ, **env},
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PEER "):
                hello = json.loads(line[5:])
                break
        else:
            raise RuntimeError(f"engine peer for {engine} exited with {self.proc.wait()}")
        self.session_id: str = hello["session_id"]
        self.info = base64.b64decode(hello["info"])
        self.addr: int = hello["addr"]
        self.nbytes: int = hello["nbytes"]
        self.probe: int = hello["probe"]

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def crc(self, off: int, n: int) -> int:
        reply = self._ask(f"crc {off} {n}")
        assert reply.startswith("CRC "), reply
        return int(reply[4:])

    def all_equal(self, off: int, n: int, value: int) -> bool:
        return self._ask(f"check {off} {n} {value}") == "OK"

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a killed peer: broken pipe
            if self.proc.poll() is None:
                self._ask("exit")
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class LocalPeer:
    """The target engine in this process (MORI over the fake, or the memory engine)."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self.buf = np.zeros(NBYTES, dtype=np.uint8)
        self.region = MemoryRegion(int(self.buf.ctypes.data), NBYTES)
        engine.register([self.region])
        self.session_id = engine.session_id
        self.info = engine.local_info()
        self.addr = self.region.ptr
        self.nbytes = NBYTES
        self.probe = self.addr

    def crc(self, off: int, n: int) -> int:
        return zlib.crc32(self.buf[off:off + n].tobytes())

    def all_equal(self, off: int, n: int, value: int) -> bool:
        return bool((self.buf[off:off + n] == value).all())

    def close(self) -> None:
        self.engine.close()


@dataclass
class Rig:
    kind: str
    engine: Any
    peer: ProcessPeer | LocalPeer
    src: np.ndarray
    fake: fake_mori.FakeMori | None = None

    @property
    def base(self) -> int:
        return int(self.src.ctypes.data)

    def native_owner(self) -> tuple[Any, str]:
        """(object, attribute) holding the native engine, to prove a consumed handle never reaches it."""
        if self.kind == "mooncake":
            return self.engine._shared, "native"
        if self.kind == "nixl":
            return self.engine, "_agent"
        if self.kind == "memory":
            return self.engine, "fabric"
        return self.engine, "_engine"


def _make_engine(kind: str) -> Any:
    try:
        if kind == "mooncake":
            from aiotransfer.engines._mooncake import MooncakeEngine

            return MooncakeEngine(TransferConfig(engine="mooncake_tcp"))
        if kind == "nixl":
            from aiotransfer.engines._nixl import NixlEngine

            return NixlEngine(TransferConfig(engine="nixl"))
        if kind == "memory":
            return create_engine(TransferConfig(engine="memory"))
        from aiotransfer.engines._mori import MoriEngine

        return MoriEngine(TransferConfig(engine="mori"))
    except EngineUnavailable as exc:
        pytest.skip(f"{kind} engine unavailable here: {exc}")


@pytest.fixture(scope="module", params=["mooncake", "nixl", "mori", "memory"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    kind: str = request.param
    with pytest.MonkeyPatch.context() as mp, MemoryFabric():  # engine="memory" joins this fabric
        fake = fake_mori.install(mp.setitem) if kind == "mori" else None
        engine = _make_engine(kind)
        peer: ProcessPeer | LocalPeer = LocalPeer(_make_engine(kind)) if kind in ("mori", "memory") else ProcessPeer(
            "mooncake_tcp" if kind == "mooncake" else kind
        )
        src = np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)
        engine.register([MemoryRegion(int(src.ctypes.data), NBYTES)])
        engine.connect(peer.session_id, peer.info, peer.probe)
        try:
            yield Rig(kind, engine, peer, src, fake)
        finally:
            peer.close()
            engine.close()


def drive(engine: Any, handle: TransferHandle, timeout: float = 15.0, *, until_doomed: bool = False) -> EngineStatus:
    """Poll ``check`` until a terminal answer (or, with ``until_doomed``, until the engine dooms the write:
    then PENDING is returned and the handle stays live)."""
    deadline = time.monotonic() + timeout
    while (status := engine.check(handle)) is EngineStatus.PENDING:
        if until_doomed and handle.doomed is not None:
            return status
        assert time.monotonic() < deadline, f"{handle!r} did not finish in {timeout}s"
        time.sleep(0.0002)
    return status


def write(rig: Rig, src_offs: list[int], dst_offs: list[int], lens: list[int]) -> TransferHandle:
    blocks = Blocks(
        u64(*(rig.base + o for o in src_offs)), u64(*(rig.peer.addr + o for o in dst_offs)), u64(*lens)
    )
    handle: TransferHandle = rig.engine.submit_write(rig.peer.session_id, blocks)
    return handle


def src_crc(rig: Rig, off: int, n: int) -> int:
    return zlib.crc32(rig.src[off:off + n].tobytes())


# -- identity --------------------------------------------------------------------------------------


def test_satisfies_protocol_and_describes_itself(rig: Rig) -> None:
    assert isinstance(rig.engine, TransferEngine)
    assert isinstance(rig.engine.traits, EngineTraits)
    assert rig.engine.credit_scope is not None
    probe = rig.engine.probe_region
    assert probe is None or isinstance(probe, MemoryRegion)
    info = rig.engine.describe()
    assert {"engine", "session_id", "transport"} <= set(info)
    assert info["engine"] == rig.kind
    assert info["session_id"] == rig.engine.session_id != ""
    assert info["transport"] == rig.engine.transport


def test_transport_is_truthful(rig: Rig) -> None:
    if rig.kind == "mooncake":
        assert rig.engine.transport == "tcp"  # mooncake_tcp forces MC_FORCE_TCP; no RDMA device here
    elif rig.kind == "nixl":
        tls = os.environ.get("UCX_TLS")
        assert rig.engine.transport == (f"ucx({tls})" if tls else "ucx")
    elif rig.kind == "memory":
        assert rig.engine.transport == "memory"
    else:
        assert rig.engine.transport == "rdma"  # the only data backend the adapter creates


# -- memory ----------------------------------------------------------------------------------------


def test_register_deregister_roundtrip(rig: Rig) -> None:
    extra = np.arange(8192, dtype=np.uint8)
    region = MemoryRegion(int(extra.ctypes.data), extra.nbytes)
    rig.engine.register([region])
    rig.engine.deregister([region])
    rig.engine.deregister([region])  # unknown now: a no-op
    rig.engine.register([region])
    rig.engine.deregister([region])


# -- transfers -------------------------------------------------------------------------------------


def test_multi_entry_write_is_byte_exact(rig: Rig) -> None:
    src_offs, dst_offs, lens = [0, 70_000, 300_000], [500_000, 4096, 200_000], [4096, 65_536, 12_345]
    handle = write(rig, src_offs, dst_offs, lens)
    assert handle.entries == 3 and handle.nbytes == sum(lens)
    assert drive(rig.engine, handle) is EngineStatus.DONE, handle.error
    for s, d, n in zip(src_offs, dst_offs, lens, strict=True):
        assert rig.peer.crc(d, n) == src_crc(rig, s, n)


@pytest.mark.parametrize("aligned", [True, False], ids=["on-boundaries", "off-boundaries"])
def test_many_equal_entries_are_byte_exact(rig: Rig, aligned: bool) -> None:
    """A scattered room's shape: many entries of one length. On their length's boundaries, NIXL makes the
    write from descriptor lists prepared once (by index); off them, it builds the write's own lists."""
    size, n = 2048, 40
    shift = 0 if aligned else 100
    src_offs = [shift + 2 * i * size for i in range(n)]
    dst_offs = [shift + (2 * i + 1) * size for i in range(n)]
    before = rig.engine.describe().get("prepared_writes", 0)
    for _ in range(2):  # the second write reuses what the first prepared
        handle = write(rig, src_offs, dst_offs, [size] * n)
        assert drive(rig.engine, handle) is EngineStatus.DONE, handle.error
        for s, d in zip(src_offs, dst_offs, strict=True):
            assert rig.peer.crc(d, size) == src_crc(rig, s, size)
    if rig.kind == "nixl":
        assert rig.engine.describe()["prepared_writes"] - before == (2 if aligned else 0)


def test_a_many_entry_write_is_posted_from_the_loop_only_from_prepared_lists(rig: Rig) -> None:
    """On NIXL, a write of more entries than a built descriptor list is worth on the loop is posted there
    only once the driver has prepared the lists it is made from; before that (or off its length's
    boundaries) ``try_submit_inline`` posts nothing and the driver takes it."""
    if rig.kind != "nixl":
        pytest.skip("NIXL's prepared descriptor lists")
    size, n = 2048, 24
    src_offs = [2 * i * size for i in range(n)]
    dst_offs = [(2 * i + 1) * size for i in range(n)]

    def blocks(src: list[int], dst: list[int], length: int) -> Blocks:
        return Blocks(u64(*(rig.base + o for o in src)), u64(*(rig.peer.addr + o for o in dst)), u64(*[length] * n))

    fresh = [o + 100 for o in src_offs], [o + 100 for o in dst_offs]  # off the boundaries: never from lists
    assert rig.engine.try_submit_inline(rig.peer.session_id, blocks(*fresh, size)) is None
    handle = write(rig, src_offs, dst_offs, [size] * n)  # the driver's write prepares the lists
    assert drive(rig.engine, handle) is EngineStatus.DONE, handle.error
    rig.src[: 2 * n * size] = np.random.default_rng(3).integers(0, 256, 2 * n * size, dtype=np.uint8)
    before = rig.engine.describe()["prepared_writes"]
    inline = rig.engine.try_submit_inline(rig.peer.session_id, blocks(src_offs, dst_offs, size))
    assert inline is not None, "a write made from prepared lists was not posted from the loop"
    assert drive(rig.engine, inline) is EngineStatus.DONE, inline.error
    assert rig.engine.describe()["prepared_writes"] - before == 1
    for s_, d in zip(src_offs, dst_offs, strict=True):
        assert rig.peer.crc(d, size) == src_crc(rig, s_, size)
    assert rig.engine.try_submit_inline(rig.peer.session_id, blocks(*fresh, size)) is None


def test_single_entry_write_is_byte_exact(rig: Rig) -> None:
    handle = write(rig, [123_456], [700_000], [250_000])
    assert drive(rig.engine, handle) is EngineStatus.DONE, handle.error
    assert rig.peer.crc(700_000, 250_000) == src_crc(rig, 123_456, 250_000)


@pytest.mark.parametrize("entries", [1, 3, 9])  # Mooncake: inline-sized writes, then a driver-sized one
def test_handle_is_one_shot_and_never_touches_native(rig: Rig, monkeypatch: pytest.MonkeyPatch, entries: int) -> None:
    handle = write(rig, [2000 * i for i in range(entries)], [940_000 + 2000 * i for i in range(entries)], [1000] * entries)
    assert drive(rig.engine, handle) is EngineStatus.DONE
    assert handle.consumed

    class Exploding:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"a consumed handle reached the native engine ({name})")

    owner, attr = rig.native_owner()
    monkeypatch.setattr(owner, attr, Exploding())
    with pytest.raises(EngineError, match="consumed"):
        rig.engine.check(handle)


def test_connect_is_idempotent(rig: Rig) -> None:
    rig.engine.connect(rig.peer.session_id, rig.peer.info, rig.peer.probe)
    handle = write(rig, [5000], [900_000], [777])
    assert drive(rig.engine, handle) is EngineStatus.DONE
    assert rig.peer.crc(900_000, 777) == src_crc(rig, 5000, 777)


def _outcome(rig: Rig, dst_off: int, n: int) -> str:
    """Submit + drive a write that must fail; returns how it failed."""
    try:
        handle = write(rig, [0], [dst_off], [n])
        status = drive(rig.engine, handle)
    except EngineError as exc:
        return f"raised: {exc}"
    assert status is EngineStatus.FAILED, "a write outside the peer's registered memory succeeded"
    assert handle.consumed and handle.error and handle.doomed
    return f"failed: {handle.error}"


def test_write_past_registered_memory_fails_cleanly(rig: Rig) -> None:
    # Two rejections at most: each one costs Mooncake a TCP lane (4 rejections poison the next write).
    crossing = _outcome(rig, rig.peer.nbytes - 100, 4096)
    outside = _outcome(rig, rig.peer.nbytes + (1 << 20), 64)
    assert crossing and outside
    assert rig.peer.all_equal(rig.peer.nbytes - 100, 100, 0), "a rejected write touched the region's tail"


def test_write_to_killed_peer_fails_cleanly(rig: Rig) -> None:
    if rig.kind == "mori":
        pytest.skip("in-process fake; peer death is covered by test_mori_peer_death_in_flight_fails_the_handle")
    if rig.kind == "memory":
        pytest.skip("in-process; peer death (MemoryFabric.kill) is covered by tests/test_memory_engine.py")
    victim = ProcessPeer("mooncake_tcp" if rig.kind == "mooncake" else rig.kind)
    try:
        rig.engine.connect(victim.session_id, victim.info, victim.probe)
        blocks = Blocks(u64(rig.base), u64(victim.addr), u64(4096))
        assert drive(rig.engine, rig.engine.submit_write(victim.session_id, blocks)) is EngineStatus.DONE
        victim.proc.kill()
        victim.proc.wait(timeout=10)
        started = time.monotonic()
        try:
            handle = rig.engine.submit_write(victim.session_id, blocks)
            status = drive(rig.engine, handle, timeout=10.0, until_doomed=True)
        except EngineError:
            status, handle = EngineStatus.FAILED, None
        # the write fails promptly: refused at its post, ended FAILED, or doomed (NIXL: ERR is not an end)
        assert status is EngineStatus.FAILED or (handle is not None and handle.doomed), status
        assert time.monotonic() - started < 5.0
    finally:
        victim.close()
        rig.engine.forget_peer(victim.session_id)


# -- NIXL specifics ----------------------------------------------------------------------------------


def _free_ports(n: int) -> int:
    """A base port such that base .. base + n - 1 are all free (outside Mooncake's default 15000-17000)."""
    rng = np.random.default_rng()
    for _ in range(200):
        base = int(rng.integers(20000, 30000))
        if all(_bindable(port) for port in range(base, base + n)):
            return base
    raise RuntimeError("no free port range")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _drop_lingering_sockets(*ports: int) -> None:
    """A dead peer's ports stay unbindable for a minute (TIME-WAIT, FIN-WAIT-2); clear them (needs root)."""
    for port in ports:
        subprocess.run(
            ["ss", "-K", "-tan", "state", "time-wait", "state", "fin-wait-2", f"( sport = :{port} )"],
            check=False, capture_output=True,
        )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ss") is None, reason="needs root and ss to free the dead peer's port now"
)
def test_mooncake_peer_restarted_on_the_same_address_is_reachable_again() -> None:
    """Mooncake caches a peer's descriptor (its data port) by ``host:port`` and never drops it. A peer
    restarted on the same address with another data port would be unreachable for good; the adapter
    re-fetches its descriptor under an alias and reaches it at once."""
    engine = _make_engine("mooncake")
    src = np.random.default_rng(11).integers(0, 256, NBYTES, dtype=np.uint8)
    engine.register([MemoryRegion(int(src.ctypes.data), NBYTES)])
    base = _free_ports(3)
    window = {"MC_MIN_RPC_PORT": str(base), "MC_MAX_RPC_PORT": str(base + 2)}  # engine port and data port
    first = ProcessPeer("mooncake_tcp", env=window)
    peers = [first]
    try:
        engine.connect(first.session_id, first.info, first.probe)
        blocks = Blocks(u64(int(src.ctypes.data)), u64(first.addr), u64(4096))
        assert drive(engine, engine.submit_write(first.session_id, blocks)) is EngineStatus.DONE
        assert first.crc(0, 4096) == zlib.crc32(src[:4096].tobytes())
        ports = set(range(base, base + 3))
        engine_port = int(first.session_id.rsplit(":", 1)[1])
        (data_port,) = (p for p in ports - {engine_port} if not _bindable(p))
        first.proc.kill()
        first.close()
        (spare,) = ports - {engine_port, data_port}
        with socket.socket() as holder:  # the restarted peer must get another data port
            for _ in range(40):  # its engine port is drawn at random: retry until it is reused
                _drop_lingering_sockets(*ports)
                if holder.getsockname()[1] != data_port:
                    with contextlib.suppress(OSError):
                        holder.bind(("0.0.0.0", data_port))
                with contextlib.suppress(RuntimeError):  # ports briefly taken
                    second = ProcessPeer("mooncake_tcp", env=window)
                    peers.append(second)
                    if second.session_id == first.session_id and not _bindable(spare):  # data port moved
                        break
                    second.close()
            else:
                pytest.fail(f"no restarted peer got {first.session_id} again with another data port")
        t0 = time.monotonic()
        engine.connect(second.session_id, second.info, second.probe)
        assert time.monotonic() - t0 < 3.0  # one handshake window (2 s), not a refresh period or a timeout
        blocks = Blocks(u64(int(src.ctypes.data) + 4096), u64(second.addr), u64(8192))
        assert drive(engine, engine.submit_write(second.session_id, blocks)) is EngineStatus.DONE
        assert second.crc(0, 8192) == zlib.crc32(src[4096:12288].tobytes())
    finally:
        for peer in peers:
            peer.close()
        engine.close()


def test_nixl_missing_package_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiotransfer.engines import _nixl as nixl

    for name in ("nixl_cu12", "nixl_cu12._api", "nixl_cu13", "nixl_cu13._api", "nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(EngineUnavailable, match=r"pip install --no-deps nixl-cu12"):
        nixl.NixlEngine(TransferConfig(engine="nixl"))


def test_nixl_env_defaults() -> None:
    from aiotransfer.engines._nixl import nixl_env_defaults

    assert nixl_env_defaults({}, log_level="WARNING", has_rdma_device=False) == {
        "NIXL_LOG_LEVEL": "WARN",
        "UCX_MODULES": "^ib*",
    }
    assert nixl_env_defaults({"UCX_MODULES": "*"}, log_level="error", has_rdma_device=False) == {
        "NIXL_LOG_LEVEL": "ERROR"
    }
    assert "UCX_MODULES" not in nixl_env_defaults({}, log_level="INFO", has_rdma_device=True)


def test_nixl_rejects_bad_peer_info(rig: Rig) -> None:
    if rig.kind not in ("nixl", "mori"):
        pytest.skip(f"{rig.kind} peers carry no engine info")
    with pytest.raises(EngineError, match=r"no .* from peer"):
        rig.engine.connect("someone", b"", 0)
    with pytest.raises(EngineError, match="malformed"):
        rig.engine.connect("someone", b"\x01garbage", 0)
    with pytest.raises(EngineError, match="describes"):
        rig.engine.connect("not-" + rig.peer.session_id, rig.peer.info, 0)


# -- MORI over the fake: what only a fake can do on demand ------------------------------------------


@pytest.fixture
def mori_pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, LocalPeer, np.ndarray, fake_mori.FakeMori]]:
    fake = fake_mori.install(monkeypatch.setitem)
    from aiotransfer.engines._mori import MoriEngine

    engine = MoriEngine(TransferConfig(engine="mori"))
    peer = LocalPeer(MoriEngine(TransferConfig(engine="mori")))
    src = np.arange(NBYTES, dtype=np.uint8)
    engine.register([MemoryRegion(int(src.ctypes.data), NBYTES)])
    engine.connect(peer.session_id, peer.info, 0)
    yield engine, peer, src, fake
    peer.close()
    engine.close()


def _mori_write(engine: Any, peer: LocalPeer, src: np.ndarray, dst_off: int, n: int) -> TransferHandle:
    blocks = Blocks(u64(int(src.ctypes.data)), u64(peer.addr + dst_off), u64(n))
    handle: TransferHandle = engine.submit_write(peer.session_id, blocks)
    return handle


def test_mori_polls_statuses_and_never_blocks(mori_pair: Any) -> None:
    engine, peer, src, fake = mori_pair
    fake.polls_to_complete = 5
    handle = _mori_write(engine, peer, src, 0, 4096)
    assert [engine.check(handle) for _ in range(4)] == [EngineStatus.PENDING] * 4
    assert peer.all_equal(0, 4096, 0), "bytes landed before the status completed"
    assert engine.check(handle) is EngineStatus.DONE
    assert bytes(peer.buf[:4096]) == bytes(src[:4096])
    assert fake.blocking_waits == 0


def test_mori_groups_entries_by_region_pair(mori_pair: Any) -> None:
    engine, peer, src, fake = mori_pair
    extra_src = np.full(8192, 9, dtype=np.uint8)
    extra_dst = np.zeros(8192, dtype=np.uint8)
    engine.register([MemoryRegion(int(extra_src.ctypes.data), 8192)])
    peer.engine.register([MemoryRegion(int(extra_dst.ctypes.data), 8192)])
    engine.connect(peer.session_id, peer.engine.local_info(), 0)  # new info: the peer's second region
    base, xs, xd = int(src.ctypes.data), int(extra_src.ctypes.data), int(extra_dst.ctypes.data)
    blocks = Blocks(u64(base, xs, base + 10, xs + 100), u64(peer.addr, xd, xd + 4000, peer.addr + 50_000),
                    u64(10, 20, 30, 40))
    posted = fake.sessions_posted
    handle = engine.submit_write(peer.session_id, blocks)
    assert fake.sessions_posted - posted == 4  # (src, dst), (extra, extra2), (src, extra2), (extra, dst)
    assert drive(engine, handle) is EngineStatus.DONE
    assert bytes(peer.buf[:10]) == bytes(src[:10])
    assert (extra_dst[:20] == 9).all() and bytes(extra_dst[4000:4030]) == bytes(src[10:40])
    assert (peer.buf[50_000:50_040] == 9).all()


def test_mori_scripted_failure_is_reported_and_is_not_an_end(mori_pair: Any) -> None:
    """ERR_RDMA_OP may come while some of the status's work still runs (a partial post, a failed notification
    after the data, the first of several queue pairs): the handle is doomed at once, never ended by it, and
    ``abandon`` (after the release quarantine) parks its statuses instead of dropping them."""
    from aiotransfer.engines import _mori as mori

    engine, peer, src, fake = mori_pair
    fake.fail_next(fake_mori.StatusCode.ERR_RDMA_OP, "link down")
    handle = _mori_write(engine, peer, src, 0, 4096)
    assert drive(engine, handle, until_doomed=True) is EngineStatus.PENDING
    assert handle.doomed is not None and "ERR_RDMA_OP" in handle.doomed and "link down" in handle.doomed
    assert [engine.check(handle) for _ in range(3)] == [EngineStatus.PENDING] * 3
    assert peer.all_equal(0, 4096, 0)
    parked = len(mori._PARKED)
    engine.abandon(handle)
    assert handle.status is EngineStatus.FAILED and len(mori._PARKED) == parked + 1
    with pytest.raises(EngineError, match="consumed"):
        engine.check(handle)


def test_mori_out_of_range_is_invalid_args(mori_pair: Any) -> None:
    engine, peer, src, _fake = mori_pair
    handle = _mori_write(engine, peer, src, NBYTES - 10, 100)
    assert drive(engine, handle) is EngineStatus.FAILED
    assert handle.error is not None and "ERR_INVALID_ARGS" in handle.error


@pytest.mark.parametrize("mode", ["raise", "status"])
def test_mori_unregistered_remote_memory(mori_pair: Any, mode: str) -> None:
    engine, peer, src, fake = mori_pair
    fake.missing_remote_memory = mode
    peer.engine.deregister([peer.region])  # after connect: our copy of its MemoryDesc is stale
    if mode == "raise":
        with pytest.raises(EngineError, match="remote MR size mismatch"):
            _mori_write(engine, peer, src, 0, 64)
    else:
        handle = _mori_write(engine, peer, src, 0, 64)
        assert drive(engine, handle) is EngineStatus.FAILED
        assert handle.error is not None and "ERR_NOT_FOUND" in handle.error


def test_mori_peer_death_in_flight_fails_the_handle(mori_pair: Any) -> None:
    engine, peer, src, fake = mori_pair
    handle = _mori_write(engine, peer, src, 0, 64)
    fake.kill(peer.session_id)
    assert drive(engine, handle, until_doomed=True) is EngineStatus.PENDING
    assert handle.doomed is not None and "ERR_RDMA_OP" in handle.doomed
    engine.abandon(handle)


def test_mori_close_with_transfer_in_flight_keeps_statuses(mori_pair: Any) -> None:
    from aiotransfer.engines import _mori as mori

    engine, peer, src, fake = mori_pair
    fake.polls_to_complete = 1000
    handle = _mori_write(engine, peer, src, 0, 64)
    parked = len(mori._PARKED)
    engine.close()
    assert handle.status is EngineStatus.FAILED and "closed" in (handle.error or "")
    assert len(mori._PARKED) == parked + 1
    with pytest.raises(ClosedError):
        engine.submit_write(peer.session_id, Blocks(u64(int(src.ctypes.data)), u64(peer.addr), u64(1)))


def test_mori_setup_failure_and_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiotransfer.engines._mori import MoriEngine

    fake = fake_mori.install(monkeypatch.setitem)
    fake.rdma_available = False
    with pytest.raises(EngineError, match="no active RDMA device"):
        MoriEngine(TransferConfig(engine="mori"))
    monkeypatch.setitem(sys.modules, "mori.io", None)
    with pytest.raises(EngineUnavailable, match="pip install amd-mori"):
        MoriEngine(TransferConfig(engine="mori"))
