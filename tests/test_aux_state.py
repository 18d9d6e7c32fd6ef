"""Aux (engine vs TCP path) and state (mamba / swa / nsa) over a real engine across two processes."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotransfer import AuxPath, ConfigError, KVArgs, KVManager, KVPoll, TransferConfig, TransferFailed
from aiotransfer._aux_state import MemPool, StateType, alloc_metadata_buffer, metadata_device, select_aux_path
from aiotransfer.engines._base import EngineStatus
from aiotransfer.errors import EngineError, InvalidArgument
from tests.conftest import expected_digest
from tests.peer import make_buffers
from tests.remote import RemoteError, RemotePeer
from tests.test_stream import LateWrite

GEO: dict[str, Any] = {"buffers": 2, "pages": 64, "item_len": 1024, "aux_buffers": 2, "aux_slots": 16, "aux_item_len": 256}
STATE = ["mamba:2:8:512", "swa:2:64:1024", "nsa:1:64:256"]


def _state_buffers(seed: int | None) -> dict[str, list[np.ndarray]]:
    out = {}
    for i, spec in enumerate(STATE):
        kind, nbuf, slots, item_len = spec.split(":")
        out[kind] = make_buffers(int(nbuf), int(slots), int(item_len), None if seed is None else seed + 1000 * (i + 1))
    return out


def _args(seed: int | None) -> KVArgs:
    return KVArgs(
        make_buffers(GEO["buffers"], GEO["pages"], GEO["item_len"], seed),
        page_size=16,
        dtype="uint8",
        aux_buffers=make_buffers(GEO["aux_buffers"], GEO["aux_slots"], GEO["aux_item_len"], seed),
        state_buffers=_state_buffers(seed),
    )


@pytest.fixture
async def hybrid_prefill(engine: str, request: pytest.FixtureRequest) -> AsyncIterator[KVManager]:
    aux_path = getattr(request, "param", "auto")
    async with KVManager(_args(7), TransferConfig(engine=engine, aux_path=aux_path)) as mgr:
        yield mgr


@pytest.fixture
async def hybrid_decode(engine: str) -> AsyncIterator[RemotePeer]:
    peer = await RemotePeer.start(engine, state=STATE, **GEO)
    try:
        yield peer
    finally:
        await peer.close()


# -- pure selection rule -----------------------------------------------------------------------

_RULE = {
    # (pool, config) -> expected path without the env override
    (MemPool.NONE, AuxPath.AUTO): AuxPath.ENGINE,
    (MemPool.NONE, AuxPath.ENGINE): AuxPath.ENGINE,
    (MemPool.NONE, AuxPath.TCP): AuxPath.TCP,
    (MemPool.NVLINK, AuxPath.AUTO): AuxPath.TCP,
    (MemPool.NVLINK, AuxPath.ENGINE): ConfigError,
    (MemPool.NVLINK, AuxPath.TCP): AuxPath.TCP,
    (MemPool.BAREX, AuxPath.AUTO): AuxPath.TCP,
    (MemPool.BAREX, AuxPath.ENGINE): ConfigError,
    (MemPool.BAREX, AuxPath.TCP): AuxPath.TCP,
    (MemPool.INTRA_NODE_NVLINK, AuxPath.AUTO): AuxPath.ENGINE,
    (MemPool.INTRA_NODE_NVLINK, AuxPath.ENGINE): AuxPath.ENGINE,
    (MemPool.INTRA_NODE_NVLINK, AuxPath.TCP): AuxPath.TCP,
}


@pytest.mark.parametrize(("pool", "config", "env"), list(itertools.product(MemPool, AuxPath, [False, True])))
def test_aux_path_rule_table(pool: MemPool, config: AuxPath, env: bool) -> None:
    expected = AuxPath.TCP if env else _RULE[(pool, config)]
    if expected is ConfigError:
        with pytest.raises(ConfigError, match="cannot move host memory"):
            select_aux_path(config, pool, env_force_tcp=env)
    else:
        assert select_aux_path(config, pool, env_force_tcp=env) is expected


def test_pool_parsing_and_metadata_device() -> None:
    assert MemPool.parse(None) is MemPool.NONE
    assert MemPool.parse("true") is MemPool.NVLINK
    assert MemPool.parse("intra_node_nvlink") is MemPool.INTRA_NODE_NVLINK
    with pytest.raises(ConfigError):
        MemPool.parse("nvlink2")
    assert metadata_device("INTRA_NODE_NVLINK", 3) == "cuda:3"
    assert metadata_device("NVLINK", 3) == "cpu"
    assert metadata_device(None, None) == "cpu"
    assert TransferConfig.from_env({"AIOTRANSFER_SEND_AUX_TCP": "1"}).aux_path is AuxPath.TCP


def test_alloc_metadata_buffer_places_aux_by_the_pool() -> None:
    torch = pytest.importorskip("torch")
    host = alloc_metadata_buffer(8, (4,), torch.int32)
    assert (tuple(host.shape), host.dtype, str(host.device)) == ((8, 4), torch.int32, "cpu")
    assert str(alloc_metadata_buffer(2, (16,), torch.float32, pool="NVLINK").device) == "cpu"
    if not torch.cuda.is_available():  # the device the rule picks must exist, or the error says so
        with pytest.raises(ConfigError, match="INTRA_NODE_NVLINK puts aux buffers on cuda:1"):
            alloc_metadata_buffer(8, (4,), torch.int32, pool="INTRA_NODE_NVLINK", device_id=1)


# -- aux over a real engine -------------------------------------------------------------------


async def _open(prefill: KVManager, decode: RemotePeer, room: int, *, aux: int | None = 3,
                state: dict[str, list[int]] | None = None, pages: int = 8):
    tx = prefill.sender(room)
    await decode.call("receiver", room=room, peer=prefill.endpoint, pages=list(range(pages)), aux_index=aux,
                      state=state)
    await tx.wait_ready(timeout=10)
    return tx


async def test_aux_via_engine_lands_before_success(hybrid_prefill: KVManager, hybrid_decode: RemotePeer) -> None:
    tx = await _open(hybrid_prefill, hybrid_decode, 1)
    assert tx.needs_aux
    await tx.send_kv(list(range(10, 18)))
    assert tx.poll() is KVPoll.Transferring  # KV landed, but Success waits for the declared aux
    await tx.send_aux(5)
    assert tx.poll() is KVPoll.Success  # the send that delivers the last outstanding part concludes the room
    assert tx.aux_path == "engine"
    await tx.done(timeout=10)
    await hybrid_decode.call("done", room=1)
    got = (await hybrid_decode.call("aux_digest", slots=[3]))["digest"]
    assert got == expected_digest(hybrid_prefill.args.aux_buffers, [5])
    assert (await hybrid_decode.call("aux_path", room=1))["path"] == "engine"
    assert hybrid_prefill.stats()["aux_engine"] == 1


@pytest.mark.parametrize("hybrid_prefill", ["tcp"], indirect=True)
async def test_aux_via_tcp_forced_by_config(hybrid_prefill: KVManager, hybrid_decode: RemotePeer) -> None:
    tx = await _open(hybrid_prefill, hybrid_decode, 2)
    await tx.send_kv(list(range(8)))
    await tx.send_aux(9)
    assert tx.aux_path == "tcp"
    await hybrid_decode.call("done", room=2)
    assert (await hybrid_decode.call("aux_digest", slots=[3]))["digest"] == expected_digest(
        hybrid_prefill.args.aux_buffers, [9]
    )
    stats = (await hybrid_decode.call("stats"))["stats"]
    assert stats["aux_tcp_received"] == GEO["aux_buffers"]


async def test_aux_via_tcp_forced_by_env(engine: str) -> None:
    prefill = await RemotePeer.start(engine, env={"AIOTRANSFER_SEND_AUX_TCP": "1"}, seed=3, state=STATE, **GEO)
    try:
        args = _args(None)
        async with KVManager(args, TransferConfig(engine=engine)) as dec:
            await prefill.call("sender", room=4)
            rx = dec.receiver(4, prefill.endpoint)
            await rx.send_metadata([1, 2], aux_index=6)
            await prefill.call("wait_ready", room=4)
            await prefill.call("send_kv", room=4, pages=[7, 8])
            assert (await prefill.call("send_aux", room=4, aux_index=2))["path"] == "tcp"
            await rx.done(timeout=10)
            assert rx.aux_path == "tcp"
            expected = (await prefill.call("aux_digest", slots=[2]))["digest"]
            assert expected_digest(args.aux_buffers, [6]) == expected
    finally:
        await prefill.close()


async def test_engine_aux_failure_falls_back_to_tcp(
    hybrid_prefill: KVManager, hybrid_decode: RemotePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = hybrid_prefill.engine
    aux_spans = [(b.ptr, b.ptr + b.nbytes) for b in hybrid_prefill.args.aux]

    def failing(real):
        def submit(peer, blocks):
            if any(lo <= int(blocks.src[0]) < hi for lo, hi in aux_spans):
                raise EngineError("injected aux engine failure")
            return real(peer, blocks)

        return submit

    # every way a write reaches the engine: the executor path and NIXL's inline path for small writes
    for name in ("submit_write", "try_submit_inline"):
        if hasattr(engine, name):
            monkeypatch.setattr(engine, name, failing(getattr(engine, name)))
    tx = await _open(hybrid_prefill, hybrid_decode, 5)
    await tx.send_kv(list(range(8)))
    await tx.send_aux(4)
    assert tx.aux_path == "tcp"
    await hybrid_decode.call("done", room=5)
    assert (await hybrid_decode.call("aux_digest", slots=[3]))["digest"] == expected_digest(
        hybrid_prefill.args.aux_buffers, [4]
    )
    assert hybrid_prefill.stats()["aux_fallback"] == 1
    assert (await hybrid_decode.call("aux_path", room=5))["path"] == "tcp"


# -- state ------------------------------------------------------------------------------------


async def test_mamba_swa_nsa_state_byte_exact(hybrid_prefill: KVManager, hybrid_decode: RemotePeer) -> None:
    declared = {"mamba": [6], "swa": [40, 41, 42, 10], "nsa": [3, 60]}
    sent = {StateType.MAMBA: [1], StateType.SWA: [5, 6, 7, 30], StateType.NSA: [9, 10]}
    tx = await _open(hybrid_prefill, hybrid_decode, 6, aux=None, state=declared)
    assert tx.declared_state == {"mamba": 1, "swa": 4, "nsa": 2}
    await tx.send_kv(list(range(8)))
    assert tx.poll() is KVPoll.Transferring
    await tx.send_state(sent)
    await tx.done(timeout=10)
    await hybrid_decode.call("done", room=6)
    bufs = hybrid_prefill.args.state_buffers
    for kind, dst in declared.items():
        got = (await hybrid_decode.call("state_digest", kind=kind, slots=dst))["digest"]
        assert got == expected_digest(bufs[kind], sent[StateType(kind)]), kind


async def test_hybrid_room_needs_kv_aux_and_state(hybrid_prefill: KVManager, hybrid_decode: RemotePeer) -> None:
    tx = await _open(hybrid_prefill, hybrid_decode, 7, aux=0, state={"mamba": [2]})
    await tx.send_state({"mamba": [3]})
    await tx.send_aux(1)
    assert tx.poll() is KVPoll.Transferring
    await tx.send_kv(list(range(8)))
    assert tx.poll() is KVPoll.Success  # aux and state landed first: the last chunk concludes the room
    await hybrid_decode.call("done", room=7)


async def test_state_kind_mismatch_fails_both_sides(hybrid_prefill: KVManager, hybrid_decode: RemotePeer) -> None:
    tx = await _open(hybrid_prefill, hybrid_decode, 8, aux=None, state={"mamba": [1]})
    await tx.send_kv(list(range(8)))
    with pytest.raises(TransferFailed, match=r"state kinds mismatch: prefill sends \['swa'\], decode declared \['mamba'\]"):
        await tx.send_state({"swa": [1]})
    with pytest.raises(RemoteError, match="state kinds mismatch") as info:
        await hybrid_decode.call("done", room=8, timeout=5)
    assert info.value.error == "TransferFailed"


async def test_state_count_mismatch_fails_both_sides(hybrid_prefill: KVManager, hybrid_decode: RemotePeer) -> None:
    tx = await _open(hybrid_prefill, hybrid_decode, 9, aux=None, state={"swa": [1, 2, 3]})
    with pytest.raises(TransferFailed, match="swa state count mismatch: prefill sends 2, decode declared 3"):
        await tx.send_state({"swa": [1, 2]})
    with pytest.raises(RemoteError, match="swa state count mismatch"):
        await hybrid_decode.call("done", room=9, timeout=5)


async def test_state_validation_before_sending(hybrid_prefill: KVManager, hybrid_decode: RemotePeer) -> None:
    with pytest.raises(RemoteError, match="mamba state takes exactly one slot"):
        await hybrid_decode.call("receiver", room=10, peer=hybrid_prefill.endpoint, pages=[1], state={"mamba": [1, 2]})
    with pytest.raises(RemoteError, match="out of range"):
        await hybrid_decode.call("receiver", room=11, peer=hybrid_prefill.endpoint, pages=[1], state={"mamba": [8]})
    with pytest.raises(RemoteError, match="no such state buffers"):
        await hybrid_decode.call("receiver", room=12, peer=hybrid_prefill.endpoint, pages=[1], state={"ssm2": [0]})
    tx = await _open(hybrid_prefill, hybrid_decode, 13, aux=None, state={"mamba": [1]})
    with pytest.raises(Exception, match="out of range"):
        await tx.send_state({"mamba": [99]})
    assert tx.poll() is KVPoll.WaitingForInput  # validation errors lose nothing


async def test_decode_declares_state_prefill_lacks(engine: str, hybrid_decode: RemotePeer) -> None:
    plain = KVArgs(make_buffers(GEO["buffers"], GEO["pages"], GEO["item_len"], 1), page_size=16, dtype="uint8",
                   aux_buffers=make_buffers(GEO["aux_buffers"], GEO["aux_slots"], GEO["aux_item_len"], 1))
    async with KVManager(plain, TransferConfig(engine=engine)) as mgr:
        tx = mgr.sender(14)
        await hybrid_decode.call("receiver", room=14, peer=mgr.endpoint, pages=[1], state={"mamba": [0]})
        with pytest.raises(RemoteError, match="no mamba state buffers"):
            await hybrid_decode.call("done", room=14, timeout=5)
        assert tx.poll() is KVPoll.Failed
        assert "no mamba state buffers" in (tx.failure_reason or "")


def test_status_enum_guard() -> None:
    assert EngineStatus.DONE.is_terminal and not EngineStatus.PENDING.is_terminal


@pytest.mark.parametrize("with_ready", [True, False], ids=["ready", "negative-control"])
async def test_send_state_with_its_ready_event_moves_only_once_the_work_that_writes_it_is_done(
    hybrid_prefill: KVManager, hybrid_decode: RemotePeer, with_ready: bool
) -> None:
    """The Mamba state slot is written 0.3 s after ``send_state`` is called: with ``ready=`` the new bytes
    arrive; without it (the negative control) the old ones."""
    mamba = hybrid_prefill.args.state_buffers["mamba"]
    before = [np.array(b, copy=True) for b in mamba]
    tx = await _open(hybrid_prefill, hybrid_decode, 31, aux=None, state={"mamba": [6]})
    await tx.send_kv(list(range(8)))
    work = LateWrite(list(mamba), list(range(len(mamba))), [1], 0x6D, 0.3)
    with pytest.raises(InvalidArgument, match=r"query\(\) method"):
        await tx.send_state({"mamba": [1]}, ready="soon")
    await tx.send_state({"mamba": [1]}, ready=work if with_ready else None)
    work.join()
    await tx.done(timeout=10)
    await hybrid_decode.call("done", room=31)
    got = (await hybrid_decode.call("state_digest", kind="mamba", slots=[6]))["digest"]
    assert got == expected_digest(mamba if with_ready else before, [1])
