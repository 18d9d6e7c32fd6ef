"""NIXL through the whole stack: two KVManagers in this process (loopback), real NIXL agents over UCX."""

from __future__ import annotations

import os
import time
import types
from typing import Any

import numpy as np
import pytest

from aiotransfer import KVArgs, KVManager, KVPoll, TransferConfig
from aiotransfer._plan import Blocks
from aiotransfer.engines._base import TransferHandle
from aiotransfer.errors import ConfigError, EngineUnavailable

BUFFERS, PAGES, ITEM = 3, 128, 2048


def _nixl_or_skip() -> None:
    from aiotransfer.engines._nixl import NixlEngine

    try:
        NixlEngine(TransferConfig(engine="nixl")).close()
    except EngineUnavailable as exc:
        pytest.skip(f"nixl unavailable here: {exc}")


async def test_nixl_managers_loopback_scattered_two_chunks() -> None:
    _nixl_or_skip()
    rng = np.random.default_rng(11)
    src = [rng.integers(0, 256, (PAGES, ITEM), dtype=np.uint8) for _ in range(BUFFERS)]
    dst = [np.zeros((PAGES, ITEM), dtype=np.uint8) for _ in range(BUFFERS)]
    cfg = TransferConfig(engine="nixl", hostname="127.0.0.1", handshake_timeout=10.0)
    src_pages = [int(p) for p in rng.permutation(PAGES)[:50]]
    dst_pages = [int(p) for p in rng.permutation(PAGES)[:50]]
    async with (
        KVManager(KVArgs(src, page_size=16, dtype="uint8"), cfg) as prefill,
        KVManager(KVArgs(dst, page_size=16, dtype="uint8"), cfg) as decode,
    ):
        assert prefill.describe()["engine"] == "nixl"
        tx = prefill.sender(42)
        rx = decode.receiver(42, peer=prefill.endpoint)
        await rx.send_metadata(dst_pages, timeout=10)
        await tx.wait_ready(timeout=10)
        await tx.send_kv(src_pages[:20], last=False, timeout=10)
        await tx.send_kv(src_pages[20:], timeout=10)
        await rx.done(timeout=10)
        await tx.done(timeout=10)
        assert tx.poll() is KVPoll.Success and rx.poll() is KVPoll.Success
        for s, d in zip(src, dst, strict=True):
            np.testing.assert_array_equal(d[dst_pages], s[src_pages])
        untouched = sorted(set(range(PAGES)) - set(dst_pages))
        assert not any(d[untouched].any() for d in dst)
        assert prefill.stats()["engine_failed"] == 0


class _InlineSpy:
    """A prefill and a decode manager over NIXL, with every inline attempt of the prefill's engine recorded
    as ``(bytes, posted inline)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        rng = np.random.default_rng(12)
        self.src = [rng.integers(0, 256, (PAGES, ITEM), dtype=np.uint8) for _ in range(BUFFERS)]
        self.dst = [np.zeros((PAGES, ITEM), dtype=np.uint8) for _ in range(BUFFERS)]
        cfg = TransferConfig(engine="nixl", hostname="127.0.0.1", handshake_timeout=10.0)
        self.prefill = KVManager(KVArgs(self.src, page_size=16, dtype="uint8"), cfg)
        self.decode = KVManager(KVArgs(self.dst, page_size=16, dtype="uint8"), cfg)
        self.attempts: list[tuple[int, bool]] = []
        self._monkeypatch = monkeypatch

    async def __aenter__(self) -> _InlineSpy:
        await self.prefill.__aenter__()
        await self.decode.__aenter__()
        self.eng = eng = self.prefill.engine
        original = eng.try_submit_inline

        def spy(peer: str, blocks: Blocks) -> TransferHandle | None:
            handle = original(peer, blocks)
            self.attempts.append((blocks.nbytes, handle is not None))
            return handle

        self._monkeypatch.setattr(eng, "try_submit_inline", spy)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.decode.__aexit__(None, None, None)
        await self.prefill.__aexit__(None, None, None)

    async def room(self, n: int, src_pages: list[int], dst_pages: list[int]) -> None:
        tx, rx = self.prefill.sender(n), self.decode.receiver(n, peer=self.prefill.endpoint)
        await rx.send_metadata(dst_pages, timeout=10)
        await tx.wait_ready(timeout=10)
        await tx.send_kv(src_pages, timeout=10)
        await rx.done(timeout=10)
        for s, d in zip(self.src, self.dst, strict=True):
            np.testing.assert_array_equal(d[dst_pages], s[src_pages])


async def test_nixl_small_writes_post_from_the_loop_only_when_the_agent_is_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small write is posted from the event loop when the agent lock is free; while another thread holds
    it, the attempt returns at once and the write goes through the executor. Bytes land either way."""
    import asyncio
    import threading

    _nixl_or_skip()
    async with _InlineSpy(monkeypatch) as spy:
        attempts, eng = spy.attempts, spy.eng
        await spy.room(1, [5], [9])
        assert attempts[-1] == (BUFFERS * ITEM, True)  # one page of each buffer: posted inline

        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with eng._lock:  # type: ignore[attr-defined]
                held.set()
                release.wait(5)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(5)
        task = asyncio.ensure_future(spy.room(2, [6], [10]))
        ticks = 0
        while not attempts or attempts[-1][1]:  # until the inline attempt has been refused
            await asyncio.sleep(0.001)
            ticks += 1
            assert ticks < 5000
        assert attempts[-1] == (BUFFERS * ITEM, False)
        await asyncio.sleep(0.05)
        assert not task.done()  # waiting for the agent on the executor, not on the loop
        release.set()
        await asyncio.wait_for(task, 10)
        holder.join(5)


async def test_nixl_writes_up_to_1_mib_post_from_the_loop_only_while_nothing_else_is_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write over ``inline_max_bytes`` but within ``inline_alone_max_bytes`` (64 pages of 3 buffers, 384
    KiB) is posted from the loop while no other write of the agent is in flight; with one in flight it goes
    through the executor; above the alone limit it always does. Bytes land every time."""
    from aiotransfer.engines._nixl import NixlEngine

    _nixl_or_skip()
    nbytes = 64 * BUFFERS * ITEM
    assert NixlEngine.inline_max_bytes < nbytes <= NixlEngine.inline_alone_max_bytes
    async with _InlineSpy(monkeypatch) as spy:
        await spy.room(1, list(range(64)), list(range(64, 128)))
        assert spy.attempts[-1] == (nbytes, True)
        live = spy.eng._live  # type: ignore[attr-defined]
        other = object()  # stands for another write of the agent still in flight
        live.add(other)
        try:
            await spy.room(2, list(range(64, 128)), list(range(64)))
        finally:
            live.discard(other)
        assert spy.attempts[-1] == (nbytes, False)
        monkeypatch.setattr(spy.eng, "inline_alone_max_bytes", nbytes - 1)
        await spy.room(3, list(range(64)), list(range(64, 128)))
        assert spy.attempts[-1] == (nbytes, False)


def _native_thread_cpu(tids: set[int]) -> float:
    """CPU seconds (user + system) used so far by the listed threads of this process."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread CPU accounting is Linux-only")
@pytest.mark.parametrize("delay_us", [0, 1000])
def test_nixl_progress_delay_lets_the_progress_thread_sleep(delay_us: int) -> None:
    """NIXL's UCX progress thread polls without pause by default (a core while idle); with
    ``nixl_progress_delay_us`` it sleeps between polls. Measured on the threads the agent starts."""
    _nixl_or_skip()
    from aiotransfer.engines._nixl import NixlEngine

    before = {int(t) for t in os.listdir("/proc/self/task")}
    engine = NixlEngine(TransferConfig(engine="nixl", nixl_progress_delay_us=delay_us))
    try:
        assert engine.describe()["progress_delay_us"] == delay_us
        time.sleep(0.2)
        native = {int(t) for t in os.listdir("/proc/self/task")} - before
        assert native, "the agent started no thread"
        cpu0, t0 = _native_thread_cpu(native), time.monotonic()
        time.sleep(1.0)
        share = (_native_thread_cpu(native) - cpu0) / (time.monotonic() - t0)
    finally:
        engine.close()
    if delay_us:
        assert share < 0.15, f"progress thread used {share:.2f} of a core while idle"
    else:
        assert share > 0.3, f"progress thread used only {share:.2f} of a core while idle (NIXL no longer spins?)"


def test_nixl_progress_delay_without_the_native_setting_is_declined(caplog: pytest.LogCaptureFixture) -> None:
    """A NIXL build without the native progress-delay field: the agent is made as usual, delay 0, logged."""
    from aiotransfer.engines import _nixl as nixl

    made: list[tuple[str, Any]] = []

    def agent(name: str, cfg: Any) -> str:
        made.append((name, cfg))
        return "agent"

    api = types.SimpleNamespace(nixl_agent_config=lambda backends: {"backends": backends}, nixl_agent=agent)
    with caplog.at_level("WARNING", logger="aiotransfer.engines.nixl"):
        assert nixl._create_agent(api, "a", 500) == ("agent", 0)
    assert made == [("a", {"backends": ["UCX"]})]
    assert "progress thread delay" in caplog.text
    assert nixl._create_agent(api, "b", 0) == ("agent", 0)


def test_nixl_progress_delay_is_validated() -> None:
    with pytest.raises(ConfigError):
        TransferConfig(nixl_progress_delay_us=-1)
    with pytest.raises(ConfigError):
        TransferConfig(nixl_progress_delay_us=2_000_000)
